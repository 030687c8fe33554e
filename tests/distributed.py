"""Distributed test harness: run a test body on N local gloo processes, reused across tests.

Spawning a process and importing torch costs ~2-3 s, so each world size gets one pool of
long-lived workers per test session (:class:`DistPool`, the ``dist_pool`` fixture in
``conftest.py``), forked from a ``forkserver`` that imported torch once. A call sends the body
*by reference* (module + qualified name; the module is re-imported in the worker by name, or from
its file) to every worker, runs it, barriers on the default group and returns the per-rank
results in rank order. Workers run ``torch.set_num_threads(1)`` and an initialized gloo default
group of ``world_size`` ranks (60 s timeout); bodies build a ``ParallelContext.from_world(...)``.
With ``SHARDKIT_TEST_REDUCTION_ORDER=perturb`` every worker's cross-rank sums are moved within
the reduction-order bound (``tests/reduction_order.py``).

[Note: harness failure handling]
* A body that raises on some rank: the harness waits a short grace period for the other ranks
  (they are often blocked in a collective the failed rank never issued), then raises
  :class:`DistributedTestError` with every failed rank's traceback.
* A body that outlives ``timeout``, or a worker that dies: :class:`DistributedTestError` naming
  the ranks that did not finish, with each one's current Python stack (``faulthandler``).
* After *any* failure the pool is killed and restarted on the next call, since the process
  group's state (unmatched collectives, half-sent p2p) is unknown. Successful calls keep it.
* Workers bind only 127.0.0.1: the store is hosted by the test process on a free port (port 0),
  and gloo uses the loopback interface.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["DistPool", "WorkerPool", "DistributedTestError", "forbid_collectives"]


class DistributedTestError(AssertionError):
    """A distributed test body failed, hung, or a worker died (the message says which rank)."""


# ---- worker side -----------------------------------------------------------------------------
def _load_fn(module: str, path: str | None, qualname: str) -> Callable[..., Any]:
    if path is not None and os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))  # sibling helpers of the test module import too
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if path is None:
                raise
            spec = importlib.util.spec_from_file_location(module, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _thread_count() -> int:
    """This process's OS threads (Linux: /proc/self/task), gloo's C++ threads included; 0 elsewhere."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


#: a worker past this many threads is restarted before the next call: gloo keeps a tcp loop
#: thread per process group until the group is freed, and a test body that leaves a group
#: referenced (a module's hook, a cycle) leaks one. Hundreds of them in a long-lived worker
#: polled the 2-core machine to a load average of 450 and made the suite's subprocess tests time out.
MAX_WORKER_THREADS = 128


def _worker_main(rank: int, world_size: int, store_port: int, pg_timeout_s: float, dump_path: str, conn: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dump = open(dump_path, "w")  # noqa: SIM115 - lives as long as the worker
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    timeout = timedelta(seconds=pg_timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from reduction_order import perturb_reductions_if_requested

        perturb_reductions_if_requested()  # the reduction-order guard, off unless asked for
    except BaseException:  # noqa: BLE001 - the test process reports it
        conn.send_bytes(pickle.dumps(("err", 0, traceback.format_exc())))
        os._exit(1)
    conn.send_bytes(pickle.dumps(("ready", 0, rank)))
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the test process went away
        if msg[0] == "stop":
            break
        _, call_id, (module, path, qualname), payload = msg
        try:
            fn = _load_fn(module, path, qualname)
            args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
            conn.send_bytes(pickle.dumps(("body_done", call_id, _thread_count())))
            dist.barrier()  # every rank done: the next call starts in step
            reply = pickle.dumps(("ok", call_id, result))
        except BaseException:  # noqa: BLE001 - reported to the test process, which fails the test
            reply = pickle.dumps(("err", call_id, traceback.format_exc()))
        conn.send_bytes(reply)
    # Exit without tearing the process group down: nothing is left to flush, and an orderly
    # destroy_process_group waits seconds on peers that are exiting too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- test-process side -----------------------------------------------------------------------
def _fn_reference(fn: Callable[..., Any]) -> tuple[str, str | None, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    local = "<locals>" in qualname or "<lambda>" in qualname
    if not callable(fn) or module is None or module == "__main__" or local:
        raise TypeError(
            f"the distributed test body must be a module-level function of an importable test "
            f"module (it is sent by reference), got {fn!r}"
        )
    path = getattr(sys.modules.get(module), "__file__", None)
    return module, path, qualname


class WorkerPool:
    """``world_size`` long-lived gloo worker processes (started lazily, restarted after failures).

    Args:
        world_size: number of ranks.
        pg_timeout: seconds; timeout of the workers' default process group.
        start_timeout: seconds allowed for spawning, importing torch and rendezvous.
        grace: seconds the other ranks get to finish once one rank has failed.
    """

    def __init__(self, world_size: int, *, pg_timeout: float = 60.0, start_timeout: float = 180.0, grace: float = 2.0) -> None:
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self.grace = grace
        self.starts = 0  # how many times the workers were (re)started; tests check restarts
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._call_id = 0
        self._bodies_done: set[int] = set()  # ranks of the current call past the body
        self._threads = 0  # the most OS threads a worker reported since the workers started

    # -- lifecycle --
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Spawn the workers and wait until every rank has joined the process group."""
        import torch.distributed as dist

        self.kill()
        self._threads = 0
        # forkserver, with torch preloaded once, instead of paying the torch import per worker;
        # the children still start from a clean, thread-free process (unlike fork).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        # A socket of our own on 127.0.0.1, port 0 (the OS picks a free one): TCPStore would
        # listen on every interface if it bound the port itself.
        # The store takes ownership of the descriptor (it closes it), hence detach().
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(
            "127.0.0.1",
            port,
            None,
            True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.start_timeout),
            master_listen_fd=listener.detach(),
        )
        self._tmpdir = tempfile.TemporaryDirectory(prefix="shardkit-dist-")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            dump = os.path.join(self._tmpdir.name, f"rank{rank}.txt")
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.pg_timeout, dump, child),
                name=f"shardkit-dist-{self.world_size}-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self.starts += 1
        replies, errors, pending = self._collect(0, time.monotonic() + self.start_timeout)
        if errors or pending:
            detail = self._describe(errors, pending)
            self.kill()
            raise DistributedTestError(f"could not start {self.world_size} distributed workers:\n{detail}")

    def kill(self) -> None:
        """Kill the workers (if any); the next :meth:`run` starts fresh ones."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns, self._store = [], [], None
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def close(self) -> None:
        """Stop the workers cleanly (killing any that do not exit within a few seconds)."""
        for c in self._conns:
            try:
                c.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=5)
        self.kill()

    # -- calls --
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            DistributedTestError: a rank raised, hung past ``timeout`` seconds, or died; the
                message has the tracebacks (see [Note: harness failure handling]).
        """
        ref = _fn_reference(fn)
        try:
            payload = pickle.dumps((args, kwargs))
        except Exception as exc:
            raise TypeError(f"arguments of {ref[2]} must be picklable: {exc}") from exc
        if self.alive and self._threads > MAX_WORKER_THREADS:
            self.kill()  # leaked process-group threads: a fresh set of workers (see MAX_WORKER_THREADS)
        if not self.alive:
            self.start()
        self._call_id += 1
        msg = pickle.dumps(("run", self._call_id, ref, payload))
        try:
            for c in self._conns:
                c.send_bytes(msg)
        except OSError as exc:
            self.kill()
            raise DistributedTestError(f"a worker of the {self.world_size}-rank pool is gone ({exc})") from exc
        replies, errors, pending = self._collect(self._call_id, time.monotonic() + timeout)
        if errors or pending:
            detail = self._describe(errors, pending)
            self.kill()
            what = f"{ref[0]}.{ref[2]} at world size {self.world_size}"
            stuck = sorted(pending - self._bodies_done)
            hung = f"; ranks {stuck} did not finish within {timeout:g} s" if stuck and not errors else ""
            raise DistributedTestError(f"distributed test body {what} failed{hung} (pool restarted):\n{detail}")
        return [replies[r] for r in range(self.world_size)]

    def _collect(self, call_id: int, deadline: float) -> tuple[dict[int, Any], dict[int, str], set[int]]:
        self._bodies_done = set()
        replies: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        grace_deadline = float("inf")
        by_obj: dict[Any, int] = {}
        for r in pending:
            by_obj[self._conns[r]] = r
            by_obj[self._procs[r].sentinel] = r
        while pending:
            now = time.monotonic()
            if now >= min(deadline, grace_deadline):
                break
            watch = [o for o, r in by_obj.items() if r in pending]
            for obj in multiprocessing.connection.wait(watch, timeout=min(deadline, grace_deadline) - now):
                rank = by_obj[obj]
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                if obj is conn or conn.poll():
                    try:
                        kind, cid, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self._procs[rank].join(timeout=1)
                        code = self._procs[rank].exitcode
                        kind, cid, value = "err", call_id, f"rank {rank}: worker died (exit code {code})"
                    if cid != call_id:
                        continue  # stale reply of an earlier call
                    if kind == "body_done":
                        self._bodies_done.add(rank)
                        self._threads = max(self._threads, value or 0)
                        continue
                else:
                    self._procs[rank].join(timeout=1)
                    kind, value = "err", f"rank {rank}: worker died (exit code {self._procs[rank].exitcode})"
                pending.discard(rank)
                if kind in ("ok", "ready"):
                    replies[rank] = value
                else:
                    if not errors:
                        grace_deadline = time.monotonic() + self.grace
                    errors[rank] = value
        return replies, errors, pending

    def _describe(self, errors: dict[int, str], pending: set[int]) -> str:
        parts = [f"--- rank {r} raised:\n{tb.rstrip()}" for r, tb in sorted(errors.items())]
        for r in sorted(pending):
            if r in self._bodies_done:
                parts.append(f"--- rank {r} finished the body; it waits for the others in the harness barrier")
            else:
                parts.append(f"--- rank {r} did not finish; its stack:\n{self._stack(r)}")
        return "\n".join(parts)

    def _stack(self, rank: int) -> str:
        proc = self._procs[rank]
        if not hasattr(signal, "SIGUSR1") or not proc.is_alive() or self._tmpdir is None:
            return "(unavailable)"
        os.kill(proc.pid, signal.SIGUSR1)
        path = os.path.join(self._tmpdir.name, f"rank{rank}.txt")
        for _ in range(20):  # faulthandler writes from the signal handler; give it a moment
            time.sleep(0.05)
            with open(path) as f:
                text = f.read()
            if text.strip():
                return text.rstrip()
        return "(no stack dump)"


class DistPool:
    """One lazily started :class:`WorkerPool` per world size (the ``dist_pool`` fixture).

    Example:
        >>> def _body(scale):                       # module level in the test module
        ...     return dist.get_rank() * scale
        >>> dist_pool.run(_body, 10, world_size=4)
        [0, 10, 20, 30]
    """

    def __init__(self, **pool_kwargs: Any) -> None:
        self._pool_kwargs = pool_kwargs
        self._pools: dict[int, WorkerPool] = {}

    def pool(self, world_size: int) -> WorkerPool:
        """The pool for ``world_size`` (created, not yet started, on first use)."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if world_size not in self._pools:
            self._pools[world_size] = WorkerPool(world_size, **self._pool_kwargs)
        return self._pools[world_size]

    def run(self, fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; see :meth:`WorkerPool.run`."""
        return self.pool(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        """Stop every pool."""
        for p in self._pools.values():
            p.close()
        self._pools.clear()


# ---- argument checks before any collective ----------------------------------------------------
#: the torch.distributed calls :func:`forbid_collectives` turns into failures
COLLECTIVES = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single", "barrier", "all_gather_object")


def forbid_collectives() -> Any:
    """Patch torch.distributed so that any collective fails the body (a bad argument must be
    rejected before the first collective, on every rank alike); ``.stop()`` the returned patcher.

    Example:
        >>> patch = forbid_collectives()
        >>> try:
        ...     with pytest.raises(ValueError, match="stage"):
        ...         ShardedDataParallel(model, ctx, stage=4)
        ... finally:
        ...     patch.stop()
    """
    from unittest import mock

    import torch.distributed as dist

    stack = mock.patch.multiple(dist, **{n: mock.DEFAULT for n in COLLECTIVES})
    mocks = stack.start()
    for m in mocks.values():
        m.side_effect = AssertionError("a collective ran before the argument check")
    return stack
