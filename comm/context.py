"""The parallel context: named ``pp`` × ``dp`` × ``cp`` × ``tp`` axes over a ``DeviceMesh``.

[Note: mesh layout]
Axes are ordered ``("pp", "dp", "cp", "tp")``, outermost to innermost, as in torchtitan's
``ParallelDims`` and Megatron-Core's ``tp-cp-dp-pp`` order: global rank
``r = ((i_pp * dp + i_dp) * cp + i_cp) * tp + i_tp``. The tp axis is innermost so that a tp
group is a run of consecutive ranks, i.e. GPUs of one node joined by NVLink (tp communicates
every layer); cp next (context parallelism exchanges keys/values or heads in every attention
layer, less often than tp); dp next (one gradient reduction per step); pp outermost (only
point-to-point activations cross it, which tolerates the slowest links). With several machines
(torchrun gives each ``LOCAL_WORLD_SIZE`` consecutive global ranks), a tp group stays inside one
machine exactly when tp divides ``LOCAL_WORLD_SIZE``; cp, dp, then pp, cross machines.
:meth:`ParallelContext.from_env` warns when tp would span machines. Every context has all
four axes, size 1 where unused, so ``ctx.group("pp")`` always works; collectives on a size-1
group take the local path.

[Note: the dp_cp group]
The ranks of one cp group hold the same parameters and see different tokens of the same
sequences, so for the gradient they are data parallel too: a parameter's gradient is summed
over cp and averaged over dp. ``ctx.group("dp_cp")`` is the flattened dp × cp group (Megatron's
data-parallel group "with context parallel", torchtitan's ``dp_cp`` mesh) over which gradients
are reduced and ZeRO shards its state; with ``cp == 1`` it *is* the dp group. It is a derived
name, not a mesh axis: ``ctx.size("dp_cp") == ctx.size("dp") * ctx.size("cp")``.

[Note: process-group timeouts]
Every process group shardkit creates (the default group in :meth:`ParallelContext.from_env`, one
group per axis in :meth:`ParallelContext.from_world`) gets an explicit ``timeout``
(default :data:`DEFAULT_TIMEOUT`, 300 s, torchtitan's ``comm.init_timeout_seconds``) instead of
c10d's 30 min, so a rank that never joins a collective becomes a
:class:`~shardkit.comm.CommTimeoutError` naming the op instead of a hang. Groups inside a mesh
passed to :meth:`ParallelContext.from_mesh` keep the timeout they were created with.

[Note: what a timeout looks like on each backend]
* gloo (CPU): the blocked ``wait()`` raises after the group's timeout, and shardkit turns it into
  :class:`~shardkit.comm.CommTimeoutError` naming the op, the group and this rank. The process
  lives on (the group's collectives are out of step: rebuild the groups or restart the job).
* NCCL (CUDA), default: ``wait()`` only makes the current CUDA stream wait, so there is nothing
  on the host to raise from. NCCL's watchdog thread notices the timed-out collective, logs
  ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...)
  ran for ... milliseconds before timing out`` and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s
  default, aborts the communicator and tears the process down (SIGABRT): **no Python exception,
  no CommTimeoutError**. The log line (and torchrun's exit summary) is what the user gets. This
  is torch's choice because an async NCCL failure may leave CUDA memory in an unknown state.
* NCCL with ``blocking_wait=True`` (opt-in, :meth:`ParallelContext.from_env` /
  :meth:`~ParallelContext.from_world`): the groups shardkit creates are built with
  ``TORCH_NCCL_BLOCKING_WAIT=1``, so ``wait()`` blocks the *host* until the collective finishes
  and raises on timeout; shardkit turns that into :class:`~shardkit.comm.CommTimeoutError` as on
  gloo. The cost: every ``wait()`` is a host synchronisation (no CPU run-ahead past a wait, e.g.
  DataParallel's end-of-backward waits), so use it for debugging hangs, not for speed. After such
  an error the communicator must be considered broken: save what you need and exit.
ProcessGroupNCCL reads ``TORCH_NCCL_BLOCKING_WAIT`` once, when a group is constructed; shardkit
sets it only around its own group creation and restores the previous value, so groups created
elsewhere are unaffected, and nothing is read at import.

[Note: the store after a torchrun restart]
After a worker fails, ``torchrun --max-restarts`` starts all workers again on the same agent
store (``TORCHELASTIC_USE_AGENT_STORE``), which still holds the previous attempt's keys:
every process group's peer addresses among them. With ``init_method="env://"`` the new ranks
read those: gloo's connectFullMesh then dials the dead attempt's ports ("Connection refused"),
and NCCL likewise (pytorch/pytorch#167288). :meth:`ParallelContext.from_env` therefore opens the
agent store itself under a prefix per attempt (``TORCHELASTIC_RESTART_COUNT``), so each attempt
sees only its own keys.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["AXES", "DEFAULT_TIMEOUT", "DP_CP", "CpSplit", "ParallelContext"]

#: Mesh axes, outermost first; see [Note: mesh layout].
AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
#: The flattened dp × cp group's name; see [Note: the dp_cp group].
DP_CP = "dp_cp"
#: How long :meth:`ParallelContext.destroy` waits for the other ranks before tearing down anyway.
TEARDOWN_WAIT = timedelta(seconds=10)

#: Timeout of the process groups shardkit creates; see [Note: process-group timeouts].
DEFAULT_TIMEOUT = timedelta(seconds=300)


def _check_axis_size(name: str, value: object, *, allow_rest: bool) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value == -1 and allow_rest:
        return value
    if value < 1:
        rest = ", or -1 for 'the rest of the world'" if allow_rest else ""
        raise ValueError(f"{name} must be >= 1{rest}; got {name}={value}")
    return value


def _check_timeout(timeout: object) -> timedelta:
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def _check_blocking_wait(blocking_wait: object) -> bool:
    if not isinstance(blocking_wait, bool):
        raise TypeError(f"blocking_wait must be a bool, got {type(blocking_wait).__name__}")
    return blocking_wait


#: The variable ProcessGroupNCCL reads when a group is constructed.
NCCL_BLOCKING_WAIT_ENV = "TORCH_NCCL_BLOCKING_WAIT"


@contextlib.contextmanager
def _nccl_blocking_wait(enabled: bool) -> Iterator[None]:
    """Within the block, NCCL groups are constructed with blocking wait (if ``enabled``); the
    previous value of the variable (or its absence) is restored afterwards.
    See [Note: what a timeout looks like on each backend]."""
    if not enabled:
        yield
        return
    previous = os.environ.get(NCCL_BLOCKING_WAIT_ENV)
    os.environ[NCCL_BLOCKING_WAIT_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(NCCL_BLOCKING_WAIT_ENV, None)
        else:
            os.environ[NCCL_BLOCKING_WAIT_ENV] = previous


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise RuntimeError(f"environment variable {name} is not set (launch with torchrun)")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def warn_if_tp_spans_machines(world_size: int, per_machine: int, tp: int) -> bool:
    """Warn (and return True) when tp groups would span machines of ``per_machine`` ranks.

    Example:
        >>> warn_if_tp_spans_machines(world_size=8, per_machine=4, tp=2)
        False
    """
    if world_size <= per_machine or per_machine % tp == 0:
        return False
    warnings.warn(
        f"tp={tp} does not divide the {per_machine} ranks per machine (LOCAL_WORLD_SIZE): tp groups span "
        "machines, and every layer's all-reduce crosses the slowest link ([Note: mesh layout])",
        stacklevel=3,
    )
    return True


def _check_gpus_per_node(local_rank: int) -> None:
    """NCCL needs a GPU of its own for every rank of a node: fail clearly, on every rank, when not.

    Without this, the rank whose ``LOCAL_RANK`` has no GPU fails inside ``torch.cuda.set_device``
    with CUDA's "invalid device ordinal" while the others wait in the rendezvous until the
    timeout. ``LOCAL_WORLD_SIZE`` (set by torchrun) lets the ranks that do have a GPU raise the
    same error.
    """
    n_gpus = torch.cuda.device_count()
    per_node = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else local_rank + 1
    if local_rank < 0 or max(per_node, local_rank + 1) > n_gpus:
        raise ValueError(
            f"backend 'nccl' needs one GPU per rank on each node: local rank {local_rank} of {per_node} "
            f"ranks per node (LOCAL_RANK / LOCAL_WORLD_SIZE), but torch.cuda.device_count() is {n_gpus}; "
            f"launch at most {n_gpus} ranks per node (torchrun --nproc-per-node={n_gpus}) or use backend='gloo'"
        )


def _new_dp_cp_group(layout: torch.Tensor, *, timeout: timedelta | None) -> dist.ProcessGroup:
    """Create every rank's flattened dp x cp group over ``layout`` ``[pp, dp, cp, tp]`` (global
    ranks), in the same order on every rank, and return this rank's; see [Note: the dp_cp group]."""
    me = dist.get_rank()
    mine = None
    dim_dp, dim_cp = AXES.index("dp"), AXES.index("cp")
    flat = layout.movedim((dim_dp, dim_cp), (-2, -1))
    for ranks in flat.reshape(-1, flat.shape[-2] * flat.shape[-1]).tolist():
        kwargs = {} if timeout is None else {"timeout": timeout}
        group = dist.new_group(ranks, group_desc=f"shardkit_{DP_CP}", **kwargs)
        if me in ranks:
            mine = group
    assert mine is not None, "this rank is not in the layout"
    return mine


@dataclass(frozen=True)
class CpSplit:
    """The cp axis cut in two for hybrid context parallelism ([Note: hybrid attention] in
    :mod:`shardkit.parallel.context.hybrid_attention`): all-to-all groups of ``a2a_size``
    consecutive cp ranks, and a ring through the ranks that hold the same place in each of them.
    Cp rank ``c`` is ``ring_rank * a2a_size + a2a_rank``. Built by :meth:`ParallelContext.cp_split`.

    Attributes:
        a2a, a2a_size, a2a_rank: this rank's all-to-all group, its size and this rank's place in it.
        ring, ring_size, ring_rank: this rank's ring group (``cp / a2a_size`` ranks) and place.

    Example:
        >>> split = ctx.cp_split(2)             # cp = 4: a2a groups {0, 1}, {2, 3}; rings {0, 2}, {1, 3}
        >>> split.a2a_size, split.ring_size
        (2, 2)
    """

    a2a: dist.ProcessGroup
    a2a_size: int
    a2a_rank: int
    ring: dist.ProcessGroup
    ring_size: int
    ring_rank: int


@dataclass(frozen=True)
class ParallelContext:
    """Named parallel axes ``pp``, ``dp``, ``cp``, ``tp`` over a 4-D ``DeviceMesh``.

    Build it with :meth:`from_env` (under torchrun), :meth:`from_world` (process group already
    initialized) or :meth:`from_mesh`; pass it (or one of its groups) explicitly to everything
    that communicates. See [Note: mesh layout] and [Note: process-group timeouts].

    Attributes:
        mesh: the ``DeviceMesh``, dims named ``("pp", "dp", "cp", "tp")``.

    Example:
        >>> ctx = ParallelContext.from_env(tp=2)          # torchrun --nproc-per-node 4
        >>> ctx.size("dp"), ctx.size("tp"), ctx.rank("tp")
        (2, 2, 1)
        >>> all_reduce(grad, group=ctx.group("dp"), op="avg")
    """

    mesh: DeviceMesh
    # groups created by from_world/from_mesh for this rank, released by destroy()
    _owned: list[dist.ProcessGroup] = field(default_factory=list, repr=False, compare=False)
    # True when from_env initialized the default group: destroy() then tears it down too
    _owns_world: bool = field(default=False, repr=False, compare=False)
    # the flattened dp x cp group when cp > 1 ([Note: the dp_cp group]); None when cp == 1
    _dp_cp: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    # the cp axis split for hybrid attention, by all-to-all group size (cp_split)
    _cp_splits: dict[int, CpSplit] = field(default_factory=dict, repr=False, compare=False)
    # groups of consecutive dp_cp ranks, by size (dp_cp_blocks): ZeRO-3's secondary shards
    _dp_cp_blocks: dict[int, tuple[dist.ProcessGroup, int]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(self.mesh).__name__}")
        if self.mesh.mesh_dim_names != AXES:
            raise ValueError(
                f"mesh dims must be named {AXES}, got {self.mesh.mesh_dim_names}; "
                "use ParallelContext.from_mesh to adapt a mesh with fewer axes"
            )
        if (self._dp_cp is None) != (self.mesh.size(AXES.index("cp")) == 1):
            raise ValueError("a context with cp > 1 needs its dp_cp group (and one with cp == 1 none)")

    # ---- validation --------------------------------------------------------------------------
    @staticmethod
    def resolve_sizes(world_size: int, *, dp: int = -1, tp: int = 1, pp: int = 1, cp: int = 1) -> dict[str, int]:
        """Check axis sizes against ``world_size`` from integers alone (no communication).

        Args:
            world_size: number of ranks.
            dp, tp, pp, cp: axis sizes, each >= 1; ``dp=-1`` means
                ``world_size // (pp * cp * tp)``.

        Returns:
            ``{"pp": pp, "dp": dp, "cp": cp, "tp": tp}`` with ``dp`` resolved.

        Raises:
            TypeError: a size is not an int (the axis is named).
            ValueError: a size < 1, ``dp=-1`` not dividing, or ``pp * dp * cp * tp != world_size``
                (the axis is named).

        Example:
            >>> ParallelContext.resolve_sizes(8, tp=2)
            {'pp': 1, 'dp': 4, 'cp': 1, 'tp': 2}
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        pp = _check_axis_size("pp", pp, allow_rest=False)
        tp = _check_axis_size("tp", tp, allow_rest=False)
        cp = _check_axis_size("cp", cp, allow_rest=False)
        dp = _check_axis_size("dp", dp, allow_rest=True)
        rest = pp * cp * tp
        named = f"pp*cp*tp = {pp}*{cp}*{tp}" if cp > 1 else f"pp*tp = {pp}*{tp}"
        if dp == -1:
            if world_size % rest:
                raise ValueError(f"dp=-1 needs the world size {world_size} to be divisible by {named} = {rest}")
            dp = world_size // rest
        if rest * dp != world_size:
            product = f"pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp}" if cp > 1 else f"pp*dp*tp = {pp}*{dp}*{tp}"
            raise ValueError(
                f"{product} = {rest * dp} does not equal the world size "
                f"{world_size}; change dp (or pass dp=-1), tp{', cp' if cp > 1 else ''} or pp"
            )
        return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_env(
        cls,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        backend: str | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        blocking_wait: bool = False,
    ) -> ParallelContext:
        """Initialize from torchrun's environment and build the context.

        Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (the only
        place shardkit reads them). Sizes are validated from ``WORLD_SIZE`` before any process
        group exists, so a bad configuration fails on every rank with the same ``ValueError``.
        Without ``RANK``/``WORLD_SIZE`` it starts a single-process world (notebooks). If the
        default process group is already initialized, it is used as is (``from_world``).

        Args:
            dp, tp, pp, cp: axis sizes (see :meth:`resolve_sizes`).
            backend: ``"nccl"`` when CUDA is available, else ``"gloo"``, unless given. With NCCL
                the CUDA device is set from ``LOCAL_RANK`` first.
            timeout: timeout of the default group and of every axis group.
            blocking_wait: NCCL only: make ``wait()`` block the host and raise
                :class:`~shardkit.comm.CommTimeoutError` on timeout instead of NCCL's watchdog
                aborting the process (slower; see [Note: what a timeout looks like on each
                backend]). No effect on gloo, which always raises.

        Returns:
            The context; collective on every rank.

        Raises:
            ValueError: with NCCL, when the node has fewer GPUs than ranks
                (``LOCAL_WORLD_SIZE`` or ``LOCAL_RANK + 1`` > ``torch.cuda.device_count()``),
                before any process group exists.

        Example:
            >>> ctx = ParallelContext.from_env(tp=2, timeout=timedelta(minutes=2))
            >>> debug = ParallelContext.from_env(timeout=timedelta(seconds=60), blocking_wait=True)
        """
        _check_timeout(timeout)
        _check_blocking_wait(blocking_wait)
        if dist.is_initialized():
            return cls.from_world(dp=dp, tp=tp, pp=pp, cp=cp, timeout=timeout, blocking_wait=blocking_wait)
        env = os.environ
        if "RANK" not in env and "WORLD_SIZE" not in env:
            rank, world_size, local_rank = 0, 1, 0
        else:
            rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
            local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in env else rank
            for var in ("MASTER_ADDR", "MASTER_PORT"):
                if var not in env:
                    raise RuntimeError(f"environment variable {var} is not set (launch with torchrun)")
        if "LOCAL_WORLD_SIZE" in env:
            warn_if_tp_spans_machines(world_size, _env_int("LOCAL_WORLD_SIZE"), tp)
        try:
            cls.resolve_sizes(world_size, dp=dp, tp=tp, pp=pp, cp=cp)  # before any process group exists
        except ValueError as e:
            if "WORLD_SIZE" in env or not all(type(v) is int and v >= 1 or v == -1 for v in (dp, tp, pp, cp)):
                raise
            raise ValueError(
                f"{e}: this process was not started by torchrun (no RANK/WORLD_SIZE in the environment), so it "
                f"is a one-process world; launch it with `torchrun --nproc-per-node {pp * cp * tp if dp == -1 else pp * cp * tp * dp} "
                "your_script.py`"
            ) from None
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        device_id = None
        if "nccl" in backend:
            _check_gpus_per_node(local_rank)  # before set_device and any rendezvous
            torch.cuda.set_device(local_rank)
            device_id = torch.device("cuda", local_rank)
        with _nccl_blocking_wait(blocking_wait and "nccl" in backend):
            if world_size == 1 and "WORLD_SIZE" not in env:
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
                )
            elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # torchrun's agent store, under a prefix of this attempt: [Note: the store after a
                # torchrun restart]
                store = dist.PrefixStore(
                    f"/shardkit/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                    dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout),
                )
                dist.init_process_group(
                    backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
                )
            else:
                dist.init_process_group(
                    backend,
                    init_method="env://",
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                    device_id=device_id,
                )
        try:
            ctx = cls.from_world(dp=dp, tp=tp, pp=pp, cp=cp, timeout=timeout, blocking_wait=blocking_wait)
        except BaseException:
            dist.destroy_process_group()  # leave no half-built world behind
            raise
        object.__setattr__(ctx, "_owns_world", True)  # frozen dataclass: set once, here
        return ctx

    @classmethod
    def from_world(
        cls,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        timeout: timedelta = DEFAULT_TIMEOUT,
        blocking_wait: bool = False,
    ) -> ParallelContext:
        """Build the context on the already-initialized default process group.

        Creates one new group per axis for this rank (all with ``timeout``; the default group
        is never reused, so its own timeout does not leak in). Reads no environment variable.
        Collective: every rank of the world must call it with the same arguments.

        Args:
            dp, tp, pp, cp: axis sizes (see :meth:`resolve_sizes`), validated before any group is
                created.
            timeout: timeout of every group created.
            blocking_wait: NCCL only: create the axis groups with blocking wait, so a timeout
                raises :class:`~shardkit.comm.CommTimeoutError` (see [Note: what a timeout looks
                like on each backend]). No effect on gloo.

        Returns:
            The context; release its groups with :meth:`destroy` (or use it as a context
            manager) when building many contexts in one process, e.g. in tests.

        Raises:
            RuntimeError: the default process group is not initialized.

        Example:
            >>> with ParallelContext.from_world(dp=2, tp=2) as ctx:   # world size 4
            ...     ctx.mesh.mesh.tolist()
            [[[[0, 1]], [[2, 3]]]]
        """
        _check_timeout(timeout)
        _check_blocking_wait(blocking_wait)
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelContext.from_world needs an initialized default process group; "
                "use ParallelContext.from_env() or torch.distributed.init_process_group() first"
            )
        world_size = dist.get_world_size()
        sizes = cls.resolve_sizes(world_size, dp=dp, tp=tp, pp=pp, cp=cp)
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
        layout = torch.arange(world_size, dtype=torch.int).reshape([sizes[a] for a in AXES])
        me = dist.get_rank()
        mine: list[dist.ProcessGroup] = []
        with _nccl_blocking_wait(blocking_wait and device_type == "cuda"):
            for dim, axis in enumerate(AXES):
                # every rank creates every group of the axis, in the same order (new_group's contract)
                for ranks in layout.movedim(dim, -1).reshape(-1, sizes[axis]).tolist():
                    group = dist.new_group(ranks, timeout=timeout, group_desc=f"shardkit_{axis}")
                    if me in ranks:
                        mine.append(group)
            dp_cp = _new_dp_cp_group(layout, timeout=timeout) if sizes["cp"] > 1 else None
        mesh = DeviceMesh.from_group(mine, device_type, mesh=layout, mesh_dim_names=AXES)
        return cls(mesh, mine + ([dp_cp] if dp_cp is not None else []), _dp_cp=dp_cp)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelContext:
        """Wrap an existing mesh whose dims are named by a subset of ``("pp", "dp", "cp", "tp")``.

        Missing axes get size 1. Dims must appear in the order pp, dp, cp, tp (see
        [Note: mesh layout]). A mesh with all four axes and ``cp == 1`` is used as is (no
        communication); otherwise a size-1 group per missing axis (and, with ``cp > 1``, the
        dp_cp group: [Note: the dp_cp group]) is created, which needs the mesh to span the
        whole default group and every rank to call this.

        Args:
            mesh: e.g. ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``.

        Raises:
            ValueError: unnamed dims, unknown or repeated names, wrong order, or missing axes
                on a mesh that does not span the world.

        Example:
            >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
            >>> ParallelContext.from_mesh(mesh).size("tp")
            1
        """
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError(f"mesh dims must be named with some of {AXES}; got an unnamed mesh")
        unknown = [n for n in names if n not in AXES]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"mesh dim names must be distinct names from {AXES}, got {names}")
        if list(names) != [a for a in AXES if a in names]:
            raise ValueError(f"mesh dims must be ordered as {AXES} (outermost first), got {names}")
        cp = mesh.size(names.index("cp")) if "cp" in names else 1
        if tuple(names) == AXES and cp == 1:
            return cls(mesh)
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"a mesh without all of {AXES}, or with cp > 1, must span the world ({dist.get_world_size()} "
                f"ranks) to add size-1 axes and the dp_cp group; got {mesh.size()} ranks with dims {names}"
            )
        me = dist.get_rank()
        layout = mesh.mesh.to(torch.int)
        groups: list[dist.ProcessGroup] = []
        owned: list[dist.ProcessGroup] = []
        for dim, axis in enumerate(AXES):
            if axis in names:
                groups.append(mesh.get_group(axis))
                continue
            layout = layout.unsqueeze(dim)
            world = range(dist.get_world_size())
            singletons = [dist.new_group([r], group_desc=f"shardkit_{axis}") for r in world]
            groups.append(singletons[me])
            owned.append(singletons[me])
        dp_cp = _new_dp_cp_group(layout, timeout=None) if cp > 1 else None
        full = DeviceMesh.from_group(groups, mesh.device_type, mesh=layout, mesh_dim_names=AXES)
        return cls(full, owned + ([dp_cp] if dp_cp is not None else []), _dp_cp=dp_cp)

    # ---- queries -----------------------------------------------------------------------------
    def _axis(self, axis: str) -> str:
        if axis not in AXES and axis != DP_CP:
            raise ValueError(f"unknown axis {axis!r}; axes are {AXES} (and {DP_CP!r}, dp and cp flattened)")
        return axis

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along ``axis`` (``"pp"``, ``"dp"``, ``"cp"``, ``"tp"``,
        or ``"dp_cp"``: [Note: the dp_cp group]).

        Example:
            >>> ctx.group("tp").size() == ctx.size("tp")
            True
        """
        if self._axis(axis) == DP_CP:
            return self.mesh.get_group("dp") if self._dp_cp is None else self._dp_cp
        return self.mesh.get_group(axis)

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (its rank within ``group(axis)``); for
        ``"dp_cp"``, ``rank("dp") * size("cp") + rank("cp")``."""
        if self._axis(axis) == DP_CP:
            return self.rank("dp") * self.size("cp") + self.rank("cp")
        return self.mesh.get_local_rank(axis)

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis`` (1 when the axis is unused)."""
        if self._axis(axis) == DP_CP:
            return self.size("dp") * self.size("cp")
        return self.mesh.size(AXES.index(axis))

    def cp_split(self, a2a_size: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> CpSplit:
        """The cp axis as all-to-all groups of ``a2a_size`` consecutive cp ranks and the rings
        across them (:class:`CpSplit`), for ``context_parallel_attention(mode="hybrid")``.

        The first call for a size creates the groups of every cp group of the world: a
        collective over the default group, so every rank must make it, at the same point
        (``context_parallelize`` and ``parallelize`` do it up front, before a pipeline splits
        the ranks' work). Later calls return the same groups; :meth:`destroy` releases them.

        Args:
            a2a_size: ranks per all-to-all group; must divide ``size("cp")``.
            timeout: the new groups' timeout ([Note: process-group timeouts]).

        Raises:
            ValueError: ``a2a_size`` is not a positive divisor of the cp size.

        Example:
            >>> ctx = ParallelContext.from_env(cp=4)
            >>> ctx.cp_split(2).ring_size
            2
        """
        cp = self.size("cp")
        if isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1 or cp % a2a_size:
            raise ValueError(f"a2a_size must be a positive divisor of the cp size {cp}, got {a2a_size!r}")
        if a2a_size in self._cp_splits:
            return self._cp_splits[a2a_size]
        _check_timeout(timeout)
        me = dist.get_rank()
        rows = self.mesh.mesh.movedim(AXES.index("cp"), -1).reshape(-1, cp).tolist()  # every cp group's ranks
        rings = cp // a2a_size
        mine: dict[str, tuple[dist.ProcessGroup, int, int]] = {}
        for kind, members in (
            ("a2a", [row[g * a2a_size : (g + 1) * a2a_size] for row in rows for g in range(rings)]),
            ("ring", [row[i::a2a_size] for row in rows for i in range(a2a_size)]),
        ):
            for ranks in members:  # the same groups in the same order on every rank
                group = dist.new_group(ranks, timeout=timeout, group_desc=f"shardkit_cp_{kind}")
                if me in ranks:
                    mine[kind] = (group, len(ranks), ranks.index(me))
                    self._owned.append(group)
        split = CpSplit(*mine["a2a"], *mine["ring"])
        self._cp_splits[a2a_size] = split
        return split

    def dp_cp_blocks(self, block_size: int, *, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[dist.ProcessGroup, int]:
        """The dp_cp group cut into blocks of ``block_size`` consecutive ranks: this rank's block
        (a process group) and this rank's place in it (``rank("dp_cp") % block_size``).

        The blocks are where ZeRO-3 keeps its secondary parameter shards
        (``ShardedDataParallel(stage=3, reshard_after_forward=block_size)``: [Note: hierarchical
        gathers] in :mod:`shardkit.parallel.zero.stage3_shards`). Ranks are placed machine by
        machine with dp_cp outside tp ([Note: mesh layout]), so when ``block_size`` is the number
        of dp_cp ranks per machine (``LOCAL_WORLD_SIZE / tp`` with pp and cp 1) each block is one
        machine's ranks.

        The first call for a size creates the blocks of every dp_cp group of the world: a
        collective over the default group, so every rank must make it at the same point. Later
        calls return the same group; :meth:`destroy` releases it.

        Args:
            block_size: ranks per block; must divide ``size("dp_cp")``.
            timeout: the new groups' timeout ([Note: process-group timeouts]).

        Raises:
            ValueError: ``block_size`` is not a positive divisor of the dp_cp size.

        Example:
            >>> ctx = ParallelContext.from_env()          # 2 machines x 4 ranks: dp = 8
            >>> group, place = ctx.dp_cp_blocks(4)        # ranks 0-3 or 4-7: this rank's machine
        """
        n = self.size(DP_CP)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or n % block_size:
            raise ValueError(f"block_size must be a positive divisor of the dp_cp size {n}, got {block_size!r}")
        if block_size in self._dp_cp_blocks:
            return self._dp_cp_blocks[block_size]
        _check_timeout(timeout)
        me = dist.get_rank()
        layout = self.mesh.mesh.movedim((AXES.index("dp"), AXES.index("cp")), (-2, -1))
        rows = layout.reshape(-1, n).tolist()  # every dp_cp group's ranks, in dp_cp rank order
        mine = None
        for row in rows:
            for b in range(n // block_size):  # the same groups in the same order on every rank
                ranks = row[b * block_size : (b + 1) * block_size]
                group = dist.new_group(ranks, timeout=timeout, group_desc="shardkit_dp_cp_block")
                if me in ranks:
                    mine = (group, ranks.index(me))
                    self._owned.append(group)
        assert mine is not None, "this rank is not in the mesh"
        self._dp_cp_blocks[block_size] = mine
        return mine

    def submesh(self, axes: str | Sequence[str]) -> DeviceMesh:
        """The sub-``DeviceMesh`` over ``axes`` (one name or several, in pp, dp, cp, tp order).

        Useful for torch APIs that take a mesh (FSDP2, DTensor): ``ctx.submesh(("dp", "tp"))``.
        """
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        for a in names:
            if a not in AXES:
                raise ValueError(f"unknown axis {a!r}; submesh axes are {AXES}")
        if list(names) != [a for a in AXES if a in names] or len(set(names)) != len(names):
            raise ValueError(f"submesh axes must be distinct and ordered as {AXES}, got {names}")
        return self.mesh[names[0] if len(names) == 1 else names]

    @property
    def sizes(self) -> dict[str, int]:
        """``{"pp": ..., "dp": ..., "cp": ..., "tp": ...}``."""
        return {a: self.size(a) for a in AXES}

    @property
    def world_size(self) -> int:
        """Number of ranks in the mesh (``pp * dp * cp * tp``)."""
        return self.mesh.size()

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group."""
        return self.mesh.get_rank()

    @property
    def device(self) -> torch.device:
        """This rank's compute device: the current CUDA device on a CUDA mesh, else CPU."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    # ---- lifetime ----------------------------------------------------------------------------
    def destroy(self, *, wait_for_peers: bool = True) -> None:
        """Destroy the process groups this context created, and the default group if
        :meth:`from_env` initialized it.

        Call it on every rank before the process exits: a gloo group left to interpreter
        shutdown can abort the process ("terminate called without an active exception": its
        worker threads still hold work when Python tears down). A default group that existed
        before the context (``from_world``, ``from_mesh``, or ``from_env`` finding one) is the
        caller's and is left alone. The context (and meshes/groups taken from it) must not be
        used afterwards. Idempotent.

        When the context owns the world (``from_env`` created it), the ranks first meet: a
        barrier on each group the context made, then on the world, each waited on for at most
        :data:`TEARDOWN_WAIT`, so no rank tears a group down while a peer's last
        collective on it (a ZeRO-3 prefetch, an offload copy) is still running, which aborted
        the process now and then (seen once in 36 two-rank ZeRO-3 runs). A rank whose peers do not come
        (one raised) destroys its groups anyway once the wait expires; ``with ParallelContext...``
        skips the wait when its block raised. Contexts on a caller's world destroy locally.

        Args:
            wait_for_peers: meet the other ranks first (see above); False destroys at once.

        Example:
            >>> ctx = ParallelContext.from_env(tp=2)
            >>> try:
            ...     train(ctx)
            ... finally:
            ...     ctx.destroy()          # also destroys the default group from_env created
        """
        if wait_for_peers and self._owns_world and dist.is_initialized():
            self._meet_before_teardown()
        while self._owned:
            group = self._owned.pop()
            if dist.is_initialized():  # else they went with the world (another context owned it)
                dist.destroy_process_group(group)
        if self._owns_world:
            object.__setattr__(self, "_owns_world", False)
            if dist.is_initialized():
                dist.destroy_process_group()

    def _meet_before_teardown(self) -> None:
        """A barrier on each group this context made (in creation order, the same on every rank),
        then on the world: a gloo barrier also waits for the group's earlier work."""
        for group in [*self._owned, None]:
            try:
                work = dist.barrier(group=group, async_op=True)
                if work is not None:
                    work.wait(timeout=TEARDOWN_WAIT)
            except Exception:  # noqa: BLE001 - a peer that raised or left: tear down regardless
                return

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.destroy(wait_for_peers=exc_type is None)

    def __repr__(self) -> str:
        s = self.sizes
        cp = f", cp={s['cp']}" if s["cp"] > 1 else ""
        return f"ParallelContext(pp={s['pp']}, dp={s['dp']}{cp}, tp={s['tp']}, global_rank={self.global_rank})"
