"""What the torchrun workers of ``shardkit train --nproc N`` wrote to stderr, read once they exit.

``shardkit train`` launches torchrun with ``--redirects 2 --log-dir DIR``: each worker's stderr
goes to ``DIR/<run>/attempt_0/<rank>/stderr.log`` instead of the terminal, where N ranks would
print N copies of every warning and N interleaved tracebacks. After the run:

* on failure, :func:`failure_report` gives one line per failed rank at the top (the rank, the
  last line of its traceback, the log holding the full one), then each distinct traceback once,
  naming the ranks that raised it;
* on success, :func:`rank_stderr` of rank 0 is shown, so a warning appears once, not N times.

Example:
    >>> print(failure_report(Path("/tmp/run-logs"), nproc=2))   # doctest: +SKIP
    2 of 2 ranks failed:
      rank 0: ValueError: nvme_dir '/nope' does not exist (full log: /tmp/run-logs/.../0/stderr.log)
      rank 1: the same error (full log: /tmp/run-logs/.../1/stderr.log)
    --- traceback of rank 0 (the same on rank 1):
    Traceback (most recent call last):
    ...
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["failure_report", "rank_stderr", "stderr_logs"]

_TRACEBACK = "Traceback (most recent call last):"
#: lines that differ between ranks only by the rank's own numbers (pids, ports, addresses)
_VOLATILE = re.compile(r"0x[0-9a-f]+|\b\d+\b")
#: the ``[rank0]: `` tag torch's excepthook puts before each traceback line of a worker
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", flags=re.M)
#: a log line of the C++ runtime (glog / c10 style: ``[W1126 07:00:00 ...]``, ``W1126 ...``)
_LOG_LINE = re.compile(r"^\[?[WIEF]\d{4} |^\[rank\d+\]:\[[WIEF]")


def stderr_logs(log_dir: Path) -> dict[int, Path]:
    """Each local rank's stderr log under a torchrun ``--log-dir`` (the latest attempt's)."""
    found: dict[int, Path] = {}
    for path in sorted(Path(log_dir).glob("**/attempt_*/*/stderr.log")):
        if path.parent.name.isdigit():
            found[int(path.parent.name)] = path  # sorted: a later attempt replaces an earlier one
    return found


def rank_stderr(log_dir: Path, rank: int = 0) -> str:
    """What rank ``rank`` wrote to stderr ("" when it wrote nothing)."""
    path = stderr_logs(log_dir).get(rank)
    return path.read_text(errors="replace") if path is not None else ""


def _last_traceback(text: str) -> str | None:
    """The last traceback in ``text`` through its error message, or None (log lines that the
    runtime writes after it, such as c10d's ``[W...]`` shutdown warnings, are left out)."""
    text = _RANK_PREFIX.sub("", text)  # torch's excepthook tags each line of a worker's traceback
    at = text.rfind(_TRACEBACK)
    if at < 0:
        return None
    lines = text[at:].rstrip().splitlines()
    end = len(lines)
    for i, line in enumerate(lines[1:], start=1):
        if line and not line.startswith(" "):  # the error line: the message runs to a blank or log line
            end = next((j for j in range(i + 1, len(lines)) if not lines[j].strip() or _LOG_LINE.match(lines[j])), len(lines))
            break
    return "\n".join(lines[:end])


def _error_line(traceback: str) -> str:
    """The ``Type: message`` line that ends a traceback."""
    for line in traceback.splitlines()[1:]:
        if line and not line.startswith(" "):
            return line
    return traceback.splitlines()[-1]


def failure_report(log_dir: Path, nproc: int, *, launcher_tail: str = "") -> str:
    """One line per rank that raised, then each distinct traceback once (see the module docstring).

    Args:
        log_dir: the ``--log-dir`` the workers ran with.
        nproc: how many workers were started.
        launcher_tail: the end of torchrun's own output, shown only when no rank left a
            traceback (then it is the only account of what happened).

    Returns:
        The report; when no rank left a traceback (killed by a signal, out of memory), it says so
        and names the logs.
    """
    logs = stderr_logs(log_dir)
    failed: dict[int, str] = {}
    for rank, path in sorted(logs.items()):
        tb = _last_traceback(path.read_text(errors="replace"))
        if tb is not None:
            failed[rank] = tb
    if not failed:
        where = ", ".join(str(p) for _, p in sorted(logs.items())) or str(log_dir)
        said = f"; torchrun: {launcher_tail}" if launcher_tail else ""
        return f"a worker failed without a Python traceback (killed by a signal, or out of memory?); logs: {where}{said}"
    lines = [f"{len(failed)} of {nproc} ranks failed:"]
    groups: dict[str, list[int]] = {}
    for rank, tb in failed.items():
        groups.setdefault(_VOLATILE.sub("#", tb), []).append(rank)
    first_of = {rank: ranks[0] for ranks in groups.values() for rank in ranks}
    for rank, tb in failed.items():
        what = _error_line(tb) if first_of[rank] == rank else f"the same error as rank {first_of[rank]}"
        lines.append(f"  rank {rank}: {what} (full log: {logs[rank]})")
    for ranks in groups.values():
        also = f" (the same on rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))})" if len(ranks) > 1 else ""
        lines.append(f"--- traceback of rank {ranks[0]}{also}:")
        lines.append(failed[ranks[0]])
    return "\n".join(lines)
