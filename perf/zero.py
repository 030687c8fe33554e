"""ZeRO step-time and memory benchmark: shardkit stages 1-3 (and CPU offload) against their peers, in one run.

Spawns ``--nproc`` gloo ranks on the CPU. Per row (a ZeRO stage, with or without optimizer
offload), the same TinyGPT (~20M parameters by default) with the same AdamW hyper-parameters and
the same per-rank batches is trained by:

* stage 1: shardkit ``ShardedDataParallel(stage=1)`` + ``ZeroOptimizer(sdp, FusedAdamW)`` vs
  torch ``ZeroRedundancyOptimizer(AdamW)`` over DDP (``gradient_as_bucket_view=True``) and
  DeepSpeed ZeRO-1 (optional peer).
* stage 2: shardkit ``stage=2`` vs FSDP2 ``fully_shard(reshard_after_forward=False)`` (no
  parameter all-gather in backward: ZeRO-2's communication; FSDP2 still frees the unsharded
  params after backward, so at rest it holds stage-3 memory) and DeepSpeed ZeRO-2 (optional).
* stage 3: shardkit ``stage=3`` (units: each transformer block + the root) vs FSDP2
  ``fully_shard(reshard_after_forward=True)`` on the same units and DeepSpeed ZeRO-3 (optional).
* ``--offload cpu`` rows ``2+cpu`` and ``3+cpu``: shardkit ``offload="cpu"`` vs DeepSpeed
  ``offload_optimizer: {device: cpu}`` of the same stage (time only: see the JSON's notes).

Every configuration starts from the same weights and batches; their step-0 losses are compared
on every rank and the run fails if they differ (``loss_check`` in the JSON).

A timed step is ``zero_grad`` + forward + loss + backward + optimizer step (with every
collective). The configurations of all stages are built side by side and timed interleaved,
repeat by repeat, so background load hits them alike; min/median over ``repeats x steps``
samples after ``warmup`` steps; ratio = ours / peer (< 1 is faster).

Memory per rank (bytes; the JSON's ``memory`` is the rank holding the most model state, the
one that runs out first; ``memory_per_rank`` has every rank), measured in one extra step after
timing, each category as distinct tensor storages: ``params`` (after the step), ``grads``
(after backward, before the step: the peers may free theirs in the step), ``master_params``
(fp32 copies of the params kept by the optimizer: DeepSpeed keeps one even for fp32 models),
``optimizer_state`` (the optimizer's state tensors on this rank), ``model_state`` = their sum,
``params_in_step`` (parameter storages alive right after forward: FSDP2's all-gathered params
appear here) and ``model_state_in_step`` = ``model_state + params_in_step - params``. Ours come
from ``sdp.memory_report()``; the peers' are counted the same way from their tensors. Memory
ratios = ours / peer on ``model_state`` and ``model_state_in_step`` (< 1 is smaller).
Formulas: docs/reference.md, "ZeRO memory and communication".

Example:
    $ shardkit bench zero                         # -> perf/results/zero_cpu.json + .png
    $ python perf/zero.py --quick --out /tmp/zq   # smoke run (tiny model; used by the tests)
    $ python perf/zero.py --stages 3 --offload none cpu   # the stage-3 and offload rows only
    $ python perf/zero.py --profile --repeats 2   # + phase times and top ops per configuration
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from zero_peers import OFFLOAD_PEERS, PEERS, SHARDKIT, Runner, build_model, build_runner
from zero_report import bench_rows, build_report, format_table, row_configs, write_plot
from bench_workers import run_workers, worker_env

__all__ = ["format_table", "main", "run_benchmark", "write_plot"]

#: the first steps of every configuration are compared (step 0) and recorded (step 1)
LOSS_STEPS = 2


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    worker_env(rank, world, port, threads=args.threads)
    import torch.distributed as dist

    from shardkit.comm import ParallelContext

    ctx = ParallelContext.from_env(backend="gloo")
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch, the same for every config
    x = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    runners: dict[str, Runner] = {}
    unavailable: dict[str, str] = {}
    for row, stage, offload in bench_rows(args.stages, args.offload):
        for kind in row_configs(stage, offload):
            key = f"{row}/{kind}"
            if kind not in args.configs:
                unavailable[key] = "not selected (--configs)"
                continue
            if kind != "deepspeed":
                runners[key] = build_runner(kind, stage, args, ctx, offload)
                continue
            ok = torch.ones(1)
            try:  # the optional peer: when it cannot run here, say why and go on
                runners[key] = build_runner(kind, stage, args, ctx, offload)
            except Exception as exc:
                ok.zero_()
                unavailable[key] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank drops it if any rank failed
            if not ok.item():
                runners.pop(key, None)
                unavailable.setdefault(key, "failed on another rank")
    # the first warmup steps double as the correctness check: same weights, same batch
    losses = {key: [float(r.step(x, y)) for _ in range(max(args.warmup, LOSS_STEPS))][:LOSS_STEPS] for key, r in runners.items()}
    samples: dict[str, list[float]] = {key: [] for key in runners}
    for rep in range(args.repeats):  # interleaved, rotating the order, so load hits all alike
        order = list(runners.items())
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for key, r in order:
            for _ in range(args.steps):
                dist.barrier()  # every rank starts the step together: time the step, not the skew
                t0 = time.perf_counter()
                r.step(x, y)
                samples[key].append(time.perf_counter() - t0)
    profiles = {key: _profile(r, x, y, args.steps) for key, r in runners.items()} if args.profile else None
    mine = {key: r.memory(x, y) for key, r in runners.items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (mine, losses))  # partitions differ by rank (ZeroRedundancyOptimizer's greedy split)
    memory = {key: [every[r][0][key] for r in range(world)] for key in mine}
    if rank == 0:
        queue.put(
            {
                "samples": samples,
                "memory": memory,
                "losses": {key: [every[r][1][key] for r in range(world)] for key in losses},
                "unavailable": unavailable,
                "profiles": profiles,
                "n_params": sum(p.numel() for p in build_model(args).parameters()),
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def _profile(r: Runner, x: torch.Tensor, y: torch.Tensor, steps: int, top: int = 12) -> dict[str, Any]:
    """ms per step of the ``shardkit::<phase>`` labels (total) and of the top ops (self time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            r.step(x, y)
    events = prof.key_averages(group_by_input_shape=True)
    phases = {e.key: e.cpu_time_total / 1e3 / steps for e in events if e.key.startswith("shardkit::")}
    ops = sorted((e for e in events if not e.key.startswith("shardkit::")), key=lambda e: -e.self_cpu_time_total)
    return {
        "phases_ms_per_step": phases,
        "top_self_ms_per_step": [
            {
                "op": e.key,
                "shapes": str(e.input_shapes)[:80],
                "calls_per_step": e.count / steps,
                "self_ms": e.self_cpu_time_total / 1e3 / steps,
            }
            for e in ops[:top]
        ],
    }


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the ranks, collect rank 0's samples and memory, and build the report dict.

    Returns:
        The report (also what :func:`main` writes as JSON): ``stages`` maps each row key
        (``"1"``, ``"2"``, ``"3"``, ``"2+cpu"``, ``"3+cpu"``) to ``{"built": True, "stage",
        "offload", "configs": {name: {time..., memory...}}, "ratios": {peer: {...}},
        "fastest_peer"}`` (`perf/zero_report.py`).

    Raises:
        SystemExit: a worker failed or timed out, or the step-0 losses differ.
    """

    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    try:
        raw = run_workers(_worker, args.nproc, args, timeout=args.timeout, what="zero benchmark")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    return build_report(raw, args, load_start)


def main(argv: list[str] | None = None) -> int:
    """``shardkit bench zero`` / ``python perf/zero.py``: run, print, write JSON + PNG; exit code."""
    p = argparse.ArgumentParser(
        prog="shardkit bench zero", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    p.add_argument(
        "--offload",
        nargs="+",
        default=["none", "cpu"],
        choices=["none", "cpu"],
        help="rows without offload and/or with offload='cpu' (stages 2 and 3 only; default: both)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=[SHARDKIT, *sorted({k for v in PEERS.values() for k in v} | set(OFFLOAD_PEERS))],
        help="configurations to run (default: ours and every peer)",
    )
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument(
        "--peer-fused",
        type=int,
        default=1,
        choices=[0, 1],
        help="torch peers use AdamW(fused=...) (1: the fast fused CPU path, as ours)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cpu_count // nproc)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--profile", action="store_true", help="also record per-phase times and the top ops of every configuration (rank 0)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are killed")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=Path("perf/results"), help="output directory")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.d_model, args.n_layers, args.n_heads, args.vocab, args.seq_len, args.batch = 64, 2, 4, 128, 32, 2
        args.warmup, args.steps, args.repeats = 1, 1, 2
    try:
        report = run_benchmark(args)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "zero_cpu" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    write_plot(report, args.out / f"{stem}.png")
    print(format_table(report))
    print(f"wrote {args.out / stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
