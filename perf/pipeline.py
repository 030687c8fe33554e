"""Pipeline step time and measured bubble: shardkit PipelineParallel vs torch.distributed.pipelining.

Same model (a stack of residual MLP blocks, sized so compute dominates the P2P transfers), same
split into stages, same global batch, same loss, gloo, same run: for each schedule the two
implementations are timed repeat by repeat, interleaved, so machine noise hits both alike.

| ours (``schedule=``) | torch peer | stages per rank |
|---|---|---|
| ``gpipe`` | ``ScheduleGPipe`` | 1 |
| ``1f1b`` | ``Schedule1F1B`` | 1 |
| ``interleaved`` | ``ScheduleInterleaved1F1B`` | ``--virtual`` (2) |
| ``zb-h1`` | ``ScheduleInterleavedZeroBubble`` (ZB1P; with one stage per rank, ZB-H1) | 1 |

Per schedule the JSON has the step time (min/median over repeats; a step starts after a barrier
and lasts until the slowest pp rank returns), the measured bubble of both, defined as the
simulator's: the pipeline's compute window (first compute start to last compute end, over all
ranks, on the host's shared monotonic clock) minus the busiest rank's compute, over that compute
(compute is timed around ``PipelineParallel.forward/backward/backward_weight`` and around torch's
``forward_one_chunk/backward_one_chunk/backward_weight_one_chunk``; the time before and after the
window, e.g. our finalize, is ``outside_loop_ms_per_rank``), the formula's bubble (docs/reference.md, "Pipeline bubbles"; for zb-h1
with measured T_F, T_B, T_W, or the simulator's with those times where the formula's T_W <= T_F,
T_B does not hold) and the ratio measured/formula (median over repeats, and the least disturbed
repeat's: ``bubble_min``), the same schedule simulated with each stage's median action times
(``bubble_simulated_stages``: unequal stages, no latency, no noise) and measured / that
(``bubble_over_stage_sim``: what the executor and transport add), the ratios ours/torch (< 1 is faster), the step-0 loss of both (must agree) and
one timeline picture per schedule (per rank: compute bars by kind, P2P wait bars) from our
``pipe.timeline``.

    python perf/pipeline.py                            # pp=2 -> perf/results/pipeline_cpu.json + .png
    python perf/pipeline.py --quick --out /tmp/pp      # smoke run (tiny sizes; used by the tests)
    python perf/pipeline.py --pp 4 --repeats 10        # needs >= 4 cores to mean anything

pp defaults to 2: the development machine has 2 cores, one torch thread per rank; at pp=4 two
ranks share a core, so "compute" inflates whenever neighbours compute at once and the bubble
measured is the scheduler's, not the schedule's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel.pipeline import Kind, PipelineParallel, build_schedule, simulate, split_blocks

from bench_workers import run_workers, worker_env

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
TORCH_PEERS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}


class Block(nn.Module):
    """Residual MLP block ``x + W2 gelu(W1 x)``: ``[N, width] -> [N, width]`` (fp32)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_blocks(width: int, hidden: int, depth: int, seed: int = 0) -> list[nn.Module]:
    """``depth`` :class:`Block` s, initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return [Block(width, hidden) for _ in range(depth)]


def formula_bubble(schedule: str, p: int, m: int, v: int, t: dict[str, float] | None = None) -> float:
    """Idle time over compute time of one rank (docs/reference.md, "Pipeline bubbles").

    ``gpipe``/``1f1b``: ``(p-1)/m``; ``interleaved``: ``(p-1)/(v m)``; ``zb-h1``: idle
    ``(p-1)(T_F+T_B-T_W)`` over compute ``m (T_F+T_B+T_W)``, with the measured mean times ``t``
    (``{"F", "BI", "BW"}`` in any unit; the formula holds for ``T_W <= T_F, T_B`` and ``m >= p``).

    Example:
        >>> formula_bubble("1f1b", 2, 8, 1)
        0.125
        >>> formula_bubble("zb-h1", 2, 8, 1, {"F": 1.0, "BI": 1.0, "BW": 1.0})
        0.041666666666666664
    """
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    if schedule == "zb-h1":
        if t is None:
            raise ValueError("formula_bubble('zb-h1') needs the measured times t={'F', 'BI', 'BW'}")
        return (p - 1) * (t["F"] + t["BI"] - t["BW"]) / (m * (t["F"] + t["BI"] + t["BW"]))
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def summarize(samples: list[float]) -> dict[str, float]:
    return {"min_ms": 1e3 * min(samples), "median_ms": 1e3 * statistics.median(samples), "n": len(samples)}


# ---- per-rank worker ---------------------------------------------------------------------------
class _ComputeClock:
    """Times every call of some compute methods of an object (instance attributes shadow them):
    the step's compute total and its first start / last end, on the clock every process of the
    host shares (``perf_counter`` is CLOCK_MONOTONIC on Linux), so windows compare across ranks."""

    def __init__(self, obj: object, names: tuple[str, ...]) -> None:
        self.reset()
        for name in names:
            setattr(obj, name, self._timed(getattr(obj, name)))

    def reset(self) -> None:
        self.total, self.first, self.last = 0.0, float("inf"), 0.0

    def _timed(self, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.last = time.perf_counter()
                self.first = min(self.first, t)
                self.total += self.last - t

        return wrapper


class _TorchPeer:
    """A torch.distributed.pipelining schedule over this rank's stages, with its compute timed."""

    def __init__(self, name: str, blocks: list[nn.Module], ctx: ParallelContext, m: int, v: int, loss_fn) -> None:
        from torch.distributed import pipelining as tp

        p, rank = ctx.size("pp"), ctx.rank("pp")
        S = p * v
        plan = split_blocks(blocks, S, "layers")  # the same split as ours
        self.stages = [
            tp.PipelineStage(mod, s, S, torch.device("cpu"), group=ctx.group("pp"))
            for s, (_, mod) in enumerate(plan)
            if s % p == rank
        ]
        self.first, self.last = rank == 0, (S - 1) % p == rank
        self.clocks = [
            _ComputeClock(st, ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")) for st in self.stages
        ]
        cls = getattr(tp, TORCH_PEERS[name])
        if name in ("gpipe", "1f1b"):
            self.sched = cls(self.stages[0], n_microbatches=m, loss_fn=loss_fn)
        else:
            self.sched = cls(self.stages, n_microbatches=m, loss_fn=loss_fn)

    def clock(self) -> tuple[float, float, float]:
        """This step's (compute, first start, last end) over this rank's stages."""
        c = self.clocks
        return sum(k.total for k in c), min(k.first for k in c), max(k.last for k in c)

    def parameters(self) -> list[nn.Parameter]:
        return [q for st in self.stages for q in st.submod.parameters()]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if self.last else {}
        for c in self.clocks:
            c.reset()
        if self.first:
            self.sched.step(x, **kwargs)
        else:
            self.sched.step(**kwargs)
        return losses


def _timeline_rows(pipe: PipelineParallel) -> list[tuple]:
    return [(str(ta.action.kind), ta.action.stage, ta.action.mb, ta.start, ta.end, ta.wait) for ta in pipe.timeline]


def _stage_medians(steps: list[list[tuple]]) -> dict[tuple[str, int], float]:
    """Median duration (ms) of each (kind, stage)'s compute actions over every timed step."""
    out: dict[tuple[str, int], list[float]] = {}
    for rows in steps:
        for kind, stage, _, start, end, _ in rows:
            if kind in ("F", "B", "BI", "BW"):
                out.setdefault((kind, stage), []).append(1e3 * (end - start))
    return {k: statistics.median(v) for k, v in out.items()}


def _kind_means(rows: list[tuple]) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for kind, _, _, start, end, _ in rows:
        if kind in ("F", "B", "BI", "BW"):
            out.setdefault(kind, []).append(end - start)
    return {k: statistics.mean(v) for k, v in out.items()}


def run_schedule(name: str, ctx: ParallelContext, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Time ours and torch's on one schedule (every rank); rank 0's dict is the result."""
    p, m = ctx.size("pp"), args.microbatches
    v = args.virtual if name == "interleaved" else 1
    group = ctx.group("pp")
    pipe = PipelineParallel(
        make_blocks(args.width, args.hidden, args.depth), ctx, schedule=name, microbatches=m, loss_fn=F.mse_loss, virtual_stages=v
    )
    res: dict = {"virtual_stages": v, "torch_peer": TORCH_PEERS[name]}
    try:
        peer: _TorchPeer | None = _TorchPeer(name, make_blocks(args.width, args.hidden, args.depth), ctx, m, v, F.mse_loss)
    except Exception as exc:  # noqa: BLE001 - recorded: a peer that does not run is a result too
        peer, res["torch_error"] = None, f"{type(exc).__name__}: {exc}"

    def max_over_ranks(val: float) -> float:
        t = torch.tensor([val], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)

    # step 0: both from the same weights -> the same loss and gradients
    ours_loss = pipe.step(x, y)
    flag = torch.zeros(1)
    if peer is not None:
        try:
            losses = peer.step(x, y)
        except Exception as exc:  # noqa: BLE001
            res["torch_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            flag[0] = 1
    dist.all_reduce(flag, group=group)  # every rank drops the peer if any rank failed
    if flag[0]:
        peer = None
    if peer is not None:
        t_loss = torch.zeros(1, dtype=torch.float64)
        if peer.last:
            t_loss[0] = torch.stack(losses).detach().double().mean()
        dist.broadcast(t_loss, group_src=(p * v - 1) % p, group=group)
        diff = max(
            ((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30)).item()
            for a, b in zip(pipe.parameters(), peer.parameters(), strict=True)
        )
        res["step0"] = {"loss_ours": ours_loss, "loss_torch": float(t_loss), "grad_max_rel_diff": max_over_ranks(diff)}
    impls = {"ours": pipe} if peer is None else {"ours": pipe, "torch": peer}
    our_clock = _ComputeClock(pipe, ("forward", "backward", "backward_weight"))
    comm_clock = _ComputeClock(pipe, ("communicate",))  # posting P2P (receives are waited by their consumer)
    params = {"ours": pipe.parameters(), "torch": peer.parameters() if peer else []}
    times: dict[str, list[float]] = {k: [] for k in impls}
    clocks: dict[str, list[tuple[float, float, float]]] = {k: [] for k in impls}  # (compute, first, last)
    loop_bubbles: list[float] = []
    step_rows: list[list[tuple]] = []  # our timeline of every timed repeat
    waits: list[float] = []
    tails: dict[str, list[float]] = {k: [] for k in impls}  # step time outside the action loop
    for it in range(args.warmup + args.repeats):
        for k, impl in impls.items():  # interleaved repeat by repeat
            for q in params[k]:
                q.grad = None
            our_clock.reset()
            comm_clock.reset()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            impl.step(x, y)
            dt = time.perf_counter() - t0
            if k == "ours":
                summ = pipe.timeline_summary()
                clock = (our_clock.total, our_clock.first, our_clock.last)
                tail = t0 + dt - our_clock.last  # the per-step agreement, finalize
            else:
                clock = peer.clock()
                tail = t0 + dt - clock[2]  # sends, gradient scaling, output merge
            step_s = max_over_ranks(dt)
            if it >= args.warmup:
                times[k].append(step_s)
                tails[k].append(tail)
                clocks[k].append(clock)
                if k == "ours":
                    waits.append((summ["p2p_wait"], comm_clock.total))
                    loop_bubbles.append(summ["bubble_fraction"])
                    step_rows.append(_timeline_rows(pipe))
    rows = _timeline_rows(pipe)  # last timed step
    gathered: list = [None] * p
    dist.all_gather_object(
        gathered,
        {
            "clock": clocks,
            "loop": loop_bubbles,
            "wait": waits,
            "tail": tails,
            "rows": rows,
            "stage_ms": _stage_medians(step_rows),
        },
        group=group,
    )
    if ctx.rank("pp") != 0:
        return {}
    for k in impls:
        # The simulator's bubble: the pipeline's compute window (first compute start to last
        # compute end over all ranks) minus the busiest rank's compute, over that compute.
        per_rep = []
        for rep in range(args.repeats):
            c = [g["clock"][k][rep] for g in gathered]
            window = max(x[2] for x in c) - min(x[1] for x in c)
            per_rep.append([(window - x[0]) / x[0] for x in c])
        per_rank = [statistics.median(b[r] for b in per_rep) for r in range(p)]
        res[k] = {
            **summarize(times[k]),
            "bubble": statistics.median(min(b) for b in per_rep),  # busiest rank: least idle
            # the least disturbed repeat: on a shared VM, neighbours' load only ever adds idle time
            "bubble_min": min(min(b) for b in per_rep),
            "bubble_per_rank": per_rank,
            "compute_ms_per_rank": [1e3 * statistics.median(x[0] for x in g["clock"][k]) for g in gathered],
            "outside_loop_ms_per_rank": [1e3 * statistics.median(g["tail"][k]) for g in gathered],
        }
    res["ours"]["p2p_wait_ms_per_rank"] = [1e3 * statistics.median(w for w, _ in g["wait"]) for g in gathered]
    # time inside communicate(): posting isend/irecv only, the waits are p2p_wait (the timeline
    # shows posts as instants, so this is the part it leaves out)
    res["ours"]["p2p_post_ms_per_rank"] = [1e3 * statistics.median(q for _, q in g["wait"]) for g in gathered]
    res["ours"]["timeline_summary_bubble_per_rank"] = [statistics.median(g["loop"]) for g in gathered]
    # zb-h1's formula needs T_F, T_B, T_W: from the ranks > 0 (rank 0's BI is empty: no input grad)
    kinds = [_kind_means(g["rows"]) for g in gathered]
    src = kinds[1:] or kinds
    t = {k: statistics.mean(d.get(k, 0.0) for d in src) for k in ("F", "B", "BI", "BW")}
    res["action_ms"] = {k: 1e3 * val for k, val in t.items() if val}
    res["bubble_formula"] = formula_bubble(name, p, m, v, t)
    sched = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v)
    b_time = t["B"] or t["BI"] + t["BW"]
    res["bubble_simulated"] = simulate(sched, t_f=t["F"], t_b=t["BI"] or b_time / 2, t_w=t["BW"] or b_time / 2).bubble_fraction
    # ZB-H1's closed form assumes T_W <= T_F, T_B; on CPU the weight-gradient GEMMs (K = rows of a
    # micro-batch) often take longer than the input-gradient ones, and the closed form can even go
    # negative. The simulator with the measured times is then the reference (it equals the
    # closed form where that holds: tests/pipeline/test_pipeline_schedules.py).
    # The same schedule simulated with each stage's own median action times (unequal stages, no
    # latency, no noise): measured / this isolates what the executor and transport add.
    stage_ms = {(Kind(kind), stage): ms for g in gathered for (kind, stage), ms in g["stage_ms"].items()}
    res["stage_action_ms"] = {f"{kind}{stage}": ms for (kind, stage), ms in sorted(stage_ms.items())}
    res["bubble_simulated_stages"] = simulate(sched, stage_times=stage_ms).bubble_fraction
    zb_ok = name != "zb-h1" or t["BW"] <= min(t["F"], t["BI"])
    res["bubble_reference"] = "formula" if zb_ok else "simulated"
    ref = res["bubble_formula"] if zb_ok else res["bubble_simulated"]
    for k in impls:
        res[k]["bubble_over_formula"] = res[k]["bubble"] / ref
        res[k]["bubble_min_over_formula"] = res[k]["bubble_min"] / ref
        res[k]["bubble_over_stage_sim"] = res[k]["bubble"] / res["bubble_simulated_stages"]
    if peer is not None:
        res["ratio_median"] = res["ours"]["median_ms"] / res["torch"]["median_ms"]
        res["ratio_min"] = res["ours"]["min_ms"] / res["torch"]["min_ms"]
    res["timeline"] = [g["rows"] for g in gathered]
    return res


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    worker_env(rank, world, port, threads=args.threads)
    ctx = ParallelContext.from_env(pp=world, backend="gloo")
    g = torch.Generator().manual_seed(1234)  # the same global batch on every rank
    x = torch.randn(args.microbatches * args.mb_rows, args.width, generator=g)
    y = torch.randn(args.microbatches * args.mb_rows, args.width, generator=g)
    out = {}
    try:
        for name in args.schedules:
            out[name] = run_schedule(name, ctx, args, x, y)
    finally:
        if rank == 0:
            queue.put(out)
        ctx.destroy()  # from_env's default group too: gloo's threads joined before exit


# ---- driver ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (gloo processes); 2 on a 2-core machine")
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--virtual", type=int, default=2, help="stages per rank for interleaved")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8, help="number of blocks")
    ap.add_argument("--mb-rows", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores // pp)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--out", type=Path, default=Path("perf/results"), help="output directory (default perf/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.hidden, args.mb_rows, args.microbatches = 64, 64, 2, 4
        args.depth = max(4, args.pp * args.virtual)  # interleaved needs a block per stage
        args.warmup, args.repeats = 1, 2
    args.threads = args.threads or max(1, (os.cpu_count() or 2) // args.pp)
    try:
        raw = run_workers(worker, args.pp, args, timeout=3600, what="pipeline benchmark")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    if set(raw) != set(args.schedules):
        raise SystemExit(f"benchmark finished only {sorted(raw)} of {args.schedules}")
    n_params = sum(q.numel() for b in make_blocks(args.width, args.hidden, args.depth) for q in b.parameters())
    report = {
        "benchmark": "pipeline_step",
        "device": "cpu",
        "backend": "gloo",
        "pp": args.pp,
        "microbatches": args.microbatches,
        "threads_per_rank": args.threads,
        "params": n_params,
        "model": f"{args.depth} residual MLP blocks width={args.width} hidden={args.hidden}, "
        f"{args.mb_rows} rows/micro-batch, MSE loss",
        "activation_bytes": 4 * args.mb_rows * args.width,
        "results": raw,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "pipeline_cpu" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{report['model']}, {n_params / 1e6:.1f}M params, pp={args.pp}, m={args.microbatches}, gloo, {args.threads} thread(s)/rank"
    )
    for name, r in raw.items():
        o = r["ours"]
        line = f"  {name:<11} ours {o['median_ms']:8.1f} ms bubble {o['bubble']:.3f} (x{o['bubble_over_formula']:.2f}, "
        line += f"min x{o['bubble_min_over_formula']:.2f}, x{o['bubble_over_stage_sim']:.2f} the stages' "
        line += f"simulation {r['bubble_simulated_stages']:.3f}; {r['bubble_reference']} "
        line += f"{r['bubble_formula'] if r['bubble_reference'] == 'formula' else r['bubble_simulated']:.3f})"
        if "torch" in r:
            tr = r["torch"]
            line += f" | {r['torch_peer']} {tr['median_ms']:8.1f} ms bubble {tr['bubble']:.3f} | ratio {r['ratio_median']:.3f}"
            line += f" | step0 loss {r['step0']['loss_ours']:.6f} vs {r['step0']['loss_torch']:.6f}"
        else:
            line += f" | {r['torch_peer']}: {r.get('torch_error', 'unavailable')}"
        print(line)
    _plot(report, args.out, stem)
    return report


def _plot(report: dict, out: Path, stem: str) -> None:
    """One PNG per schedule: per rank, compute bars by kind and P2P wait bars (our timeline)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors = {"F": "tab:blue", "B": "tab:green", "BI": "tab:green", "BW": "tab:orange", "wait": "tab:red"}
    for name, r in report["results"].items():
        fig, ax = plt.subplots(figsize=(9, 0.8 + 0.6 * report["pp"]))
        for rank, rows in enumerate(r["timeline"]):
            for kind, stage, mb, start, end, wait in rows:
                if kind in colors:
                    ax.barh(rank, 1e3 * (end - start), left=1e3 * start, color=colors[kind], edgecolor="white", height=0.6)
                    if end - start > 0.04 * r["ours"]["median_ms"] / 1e3:
                        ax.text(1e3 * (start + end) / 2, rank, f"{kind}{stage}.{mb}", ha="center", va="center", fontsize=5)
                elif wait > 0:
                    ax.barh(rank, 1e3 * wait, left=1e3 * (end - wait), color=colors["wait"], height=0.3)
        ax.set_yticks(range(len(r["timeline"])), [f"rank {k}" for k in range(len(r["timeline"]))])
        ax.invert_yaxis()
        ax.set_xlabel("ms from the step's start")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in ("F", "B", "BW", "wait")]
        ax.legend(
            handles,
            ["F", "B / BI", "BW", "P2P wait"],
            fontsize=6,
            loc="lower right",
            bbox_to_anchor=(1, 1),
            ncol=4,
            frameon=False,
        )
        ax.set_title(
            f"{name}: bubble measured {r['ours']['bubble']:.3f}, {r['bubble_reference']} "
            f"{r['bubble_formula'] if r['bubble_reference'] == 'formula' else r['bubble_simulated']:.3f} "
            f"(pp={report['pp']}, m={report['microbatches']})",
            fontsize=8,
            loc="left",
        )
        fig.tight_layout()
        fig.savefig(out / f"{stem}_{name}.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    main()
