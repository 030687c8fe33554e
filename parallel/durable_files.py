"""Files that survive a crash and are checked when read back.

The checkpoint writer and the NVMe offload both write a file to a temporary name, fsync it,
rename it into place, and fsync the directory so that the rename itself is on disk (POSIX: a
rename is durable only once its directory is synced). The checkpoint also records each file's
CRC-32 so that a load can tell a torn or corrupted file from a good one.
"""

from __future__ import annotations

import os
import zlib

__all__ = ["file_crc32", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (the renames and creations in it) to disk.

    Example:
        >>> os.replace("ckpt.tmp", "ckpt"); fsync_dir(".")
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: str | os.PathLike[str], *, chunk_bytes: int = 1 << 23) -> int:
    """The CRC-32 of a file's bytes (``zlib.crc32``), read in ``chunk_bytes`` chunks.

    Example:
        >>> file_crc32("model.pt") == zlib.crc32(open("model.pt", "rb").read())
        True
    """
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return crc
