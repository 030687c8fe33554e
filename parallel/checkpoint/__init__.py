"""Sharded, atomic, reshardable checkpoints on ``torch.distributed.checkpoint`` (docs/checkpoint.md).

Example:
    >>> from shardkit.parallel import save_checkpoint, load_checkpoint
    >>> save_checkpoint("ckpt/latest", sdp, opt, extra={"step": step, "rng": torch.get_rng_state()})
    >>> extra = load_checkpoint("ckpt/latest", sdp4, opt4)   # e.g. on 4 ranks, or stage 1
"""

from .api import FORMAT_VERSION, AsyncCheckpointer, load_checkpoint, load_meta, read_manifest, save_checkpoint, verify_files
from .pieces import FlatPiece

__all__ = [
    "FORMAT_VERSION",
    "AsyncCheckpointer",
    "FlatPiece",
    "load_checkpoint",
    "load_meta",
    "read_manifest",
    "save_checkpoint",
    "verify_files",
]
