"""What the torchrun workers of ``shardkit train --nproc N`` wrote to stderr, read once they exit.

``shardkit train`` launches torchrun with ``--redirects 2 --log-dir DIR``: each worker's stderr
goes to ``DIR/<run>/attempt_0/<rank>/stderr.log`` instead of the terminal, where N ranks would
print N copies of every warning and N interleaved tracebacks. After the run:

* on failure, :func:`failure_report` gives one line per failed rank at the top (the rank, the
  last line of its traceback, the log holding the full one), then each distinct traceback once,
  naming the ranks that raised it;
* on success, :func:`rank_stderr` of rank 0 is shown, so a warning appears once, not N times.

[Note: naming the rank that failed first]
When one rank dies, the others fail too, a moment later, with an error of their own: gloo's
"Connection closed by peer", NCCL's remote error, a collective timeout. Listing those first would
blame the survivors. So a traceback whose error only says that a peer went away is a
*consequence* (``_LOST_PEER``), shown as "lost its peers after that", its traceback left out. The
*cause* is the rank with any other traceback; when there is none, the frozen rank that a
heartbeat watcher named (``shardkit heartbeat: ...``, :class:`~shardkit.comm.Heartbeat`), else the
rank that a timed-out rank found behind the others (``shardkit stall: ...``), else the
rank torchrun saw exit first (:func:`first_failures`: its exit code or signal), else the ranks
that left no traceback at all (killed, frozen, out of memory).

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
import signal
from pathlib import Path

__all__ = ["earlier_failures", "failure_report", "first_failures", "rank_stderr", "stderr_logs"]

_TRACEBACK = "Traceback (most recent call last):"
#: lines that differ between ranks only by the rank's own numbers (pids, ports, addresses)
_VOLATILE = re.compile(r"0x[0-9a-f]+|\b\d+\b")
#: the ``[rank0]: `` tag torch's excepthook puts before each traceback line of a worker
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", flags=re.M)
#: a log line of the C++ runtime (glog / c10 style: ``[W1126 07:00:00 ...]``, ``W1126 ...``)
_LOG_LINE = re.compile(r"^\[?[WIEF]\d{4} |^\[rank\d+\]:\[[WIEF]")


def _attempts(log_dir: Path) -> dict[int, dict[int, Path]]:
    """attempt -> local rank -> stderr log, under a torchrun ``--log-dir``."""
    found: dict[int, dict[int, Path]] = {}
    for path in Path(log_dir).glob("**/attempt_*/*/stderr.log"):
        attempt = path.parent.parent.name.removeprefix("attempt_")
        if path.parent.name.isdigit() and attempt.isdigit():
            found.setdefault(int(attempt), {})[int(path.parent.name)] = path
    return found


def stderr_logs(log_dir: Path, attempt: int | None = None) -> dict[int, Path]:
    """Each local rank's stderr log under a torchrun ``--log-dir``, of ``attempt`` (default: the
    latest; torchrun counts a restart of the workers as a new attempt)."""
    attempts = _attempts(log_dir)
    if not attempts:
        return {}
    return dict(sorted(attempts.get(max(attempts) if attempt is None else attempt, {}).items()))


def earlier_failures(log_dir: Path, nproc: int, launcher_output: str = "") -> list[tuple[int, str]]:
    """``(attempt, failure_report)`` of every attempt before the latest (each ended in a failure
    after which torchrun restarted the workers: ``--max-restarts``); ``launcher_output`` is
    torchrun's stderr, which names the rank that failed first in each attempt."""
    attempts = sorted(_attempts(log_dir))
    first = first_failures(launcher_output)
    return [
        (a, failure_report(log_dir, nproc, attempt=a, first_failed=first[i] if i < len(first) else None))
        for i, a in enumerate(attempts[:-1])
    ]


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


#: the error of a rank that only saw another rank go away (a consequence, not the cause): gloo's
#: closed or reset connection, NCCL's remote error, a collective's timeout
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote worker crashing|Broken pipe|"
    r"NCCL (communicator was aborted|error: remote process)|CommTimeoutError|[Tt]imed out in |Timed out waiting"
)
#: a watcher's verdict about a frozen rank (shardkit.comm.Heartbeat)
_HEARTBEAT_VERDICT = re.compile(r"^shardkit heartbeat: rank \d+ .*$", flags=re.M)
#: a rank's account, after its collective timed out, of which rank the others wait for
_STALL_VERDICT = re.compile(r"^shardkit stall: .*$", flags=re.M)
#: torchrun's line for the first worker that failed in an attempt (one per failed attempt, in order)
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def first_failures(launcher_output: str) -> list[tuple[int, int]]:
    """``(local_rank, exit_code)`` of the first failed worker of each failed attempt, in order,
    from torchrun's own stderr (a negative code is the signal that killed it).

    Example:
        >>> first_failures("E1126 ... failed (exitcode: -9) local_rank: 1 (pid: 32727) of binary: python")
        [(1, -9)]
    """
    return [(int(m.group(2)), int(m.group(1))) for m in _WORKER_FAILED.finditer(launcher_output)]


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the OOM killer, or kill -9?)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"


def failure_report(
    log_dir: Path,
    nproc: int,
    *,
    launcher_tail: str = "",
    attempt: int | None = None,
    first_failed: tuple[int, int] | None = None,
) -> str:
    """One line per rank that raised, then each distinct traceback once (see the module docstring).

    Args:
        log_dir: the ``--log-dir`` the workers ran with.
        nproc: how many workers were started.
        launcher_tail: the end of torchrun's own output, shown only when no rank left a
            traceback (then it is the only account of what happened).
        attempt: which attempt's logs (default the latest; see :func:`stderr_logs`).
        first_failed: ``(local_rank, exit_code)`` of the attempt's first failed worker, as
            torchrun reported it (:func:`first_failures`): names the rank when none left a
            traceback.

    Returns:
        The report; when no rank left a traceback (killed by a signal, out of memory), it says so
        and names the logs.
    """
    logs = stderr_logs(log_dir, attempt)
    texts = {rank: path.read_text(errors="replace") for rank, path in sorted(logs.items())}  # each log read once
    failed: dict[int, str] = {}
    for rank, text in texts.items():
        tb = _last_traceback(text)
        if tb is not None:
            failed[rank] = tb
    # [Note: naming the rank that failed first]
    consequences = {rank: tb for rank, tb in failed.items() if _LOST_PEER.search(_error_line(tb))}
    causes = {rank: tb for rank, tb in failed.items() if rank not in consequences}
    lines: list[str] = []
    verdicts = [m.group(0) for text in texts.values() for m in _HEARTBEAT_VERDICT.finditer(text)]
    stalls = [m.group(0) for text in texts.values() for m in _STALL_VERDICT.finditer(text)]
    if verdicts and not causes:  # a watcher found a frozen rank and killed it: that is the cause
        lines.append(verdicts[0].removeprefix("shardkit heartbeat: "))
    elif stalls and not causes:  # a collective timed out: the rank the others waited for
        lines.append(stalls[0].removeprefix("shardkit "))
    elif not causes:
        silent = [rank for rank in logs if rank not in failed]
        if first_failed is not None and first_failed[0] not in failed:
            rank, code = first_failed
            lines.append(
                f"rank {rank} failed first: it {_exit_cause(code)}, without a Python traceback (log: {logs.get(rank, log_dir)})"
            )
        elif silent:
            names = ", ".join(map(str, silent))
            lines.append(
                f"rank{'s' if len(silent) > 1 else ''} {names} failed first, without a Python traceback (killed by a "
                f"signal, out of memory, or frozen?); logs: {', '.join(str(logs[r]) for r in silent)}"
            )
        elif not failed:
            where = ", ".join(str(p) for _, p in sorted(logs.items())) or str(log_dir)
            said = f"; torchrun: {launcher_tail}" if launcher_tail else ""
            return f"a worker failed without a Python traceback (killed by a signal, or out of memory?); logs: {where}{said}"
        else:  # only lost-peer errors, nobody silent: show them as the causes
            causes, consequences = consequences, {}
    if causes:
        lines.append(f"{len(causes)} of {nproc} ranks failed:")
    groups: dict[str, list[int]] = {}
    for rank, tb in causes.items():
        groups.setdefault(_VOLATILE.sub("#", tb), []).append(rank)
    first_of = {rank: ranks[0] for ranks in groups.values() for rank in ranks}
    for rank, tb in causes.items():
        what = _error_line(tb) if first_of[rank] == rank else f"the same error as rank {first_of[rank]}"
        lines.append(f"  rank {rank}: {what} (full log: {logs[rank]})")
    for rank, tb in consequences.items():
        lines.append(f"  rank {rank}: lost its peers after that: {_error_line(tb)} (full log: {logs[rank]})")
    for ranks in groups.values():
        also = f" (the same on rank{'s' if len(ranks) > 2 else ''} {', '.join(map(str, ranks[1:]))})" if len(ranks) > 1 else ""
        lines.append(f"--- traceback of rank {ranks[0]}{also}:")
        lines.append(causes[ranks[0]])
    return "\n".join(lines)
