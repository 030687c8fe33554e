"""ZeRO step-time and memory benchmark: shardkit stages 1-2 against their peers, in one run.

Spawns ``--nproc`` gloo ranks on the CPU. Per ZeRO stage, the same TinyGPT (~20M parameters by
default) with the same AdamW hyper-parameters and the same per-rank batches is trained by:

* stage 1: shardkit ``ShardedDataParallel(stage=1)`` + ``ZeroOptimizer(sdp, FusedAdamW)`` vs
  torch ``ZeroRedundancyOptimizer(AdamW)`` over DDP (``gradient_as_bucket_view=True``) and
  DeepSpeed ZeRO-1 (optional peer).
* stage 2: shardkit ``stage=2`` vs FSDP2 ``fully_shard(reshard_after_forward=False)`` (no
  parameter all-gather in backward: ZeRO-2's communication; FSDP2 still frees the unsharded
  params after backward, so at rest it holds stage-3 memory) and DeepSpeed ZeRO-2 (optional).
* stage 3: shardkit's is not built yet (docs/zero.md); the JSON says so and measures nothing.

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
    $ python perf/zero.py --profile --repeats 2   # + phase times and top ops per configuration
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .zero_peers import HYPER, PEERS, SHARDKIT, Runner, build_model, build_runner

__all__ = ["format_table", "main", "run_benchmark", "write_plot"]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // world))
    import torch.distributed as dist

    from shardkit.comm import ParallelContext

    ctx = ParallelContext.from_env(backend="gloo")
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch, the same for every config
    x = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    runners: dict[tuple[int, str], Runner] = {}
    unavailable: dict[str, str] = {}
    for stage in args.stages:
        for kind in (SHARDKIT, *PEERS[stage]):
            if kind not in args.configs:
                unavailable[f"{stage}/{kind}"] = "not selected (--configs)"
                continue
            if kind != "deepspeed":
                runners[(stage, kind)] = build_runner(kind, stage, args, ctx)
                continue
            ok = torch.ones(1)
            try:  # the optional peer: when it cannot run here, say why and go on
                runners[(stage, kind)] = build_runner(kind, stage, args, ctx)
            except Exception as exc:
                ok.zero_()
                unavailable[f"{stage}/{kind}"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank drops it if any rank failed
            if not ok.item():
                runners.pop((stage, kind), None)
                unavailable.setdefault(f"{stage}/{kind}", "failed on another rank")
    for r in runners.values():
        for _ in range(args.warmup):
            r.step(x, y)
    samples: dict[str, list[float]] = {f"{s}/{k}": [] for s, k in runners}
    for rep in range(args.repeats):  # interleaved, rotating the order, so load hits all alike
        order = list(runners.items())
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for (stage, kind), r in order:
            for _ in range(args.steps):
                dist.barrier()  # every rank starts the step together: time the step, not the skew
                t0 = time.perf_counter()
                r.step(x, y)
                samples[f"{stage}/{kind}"].append(time.perf_counter() - t0)
    profiles = {f"{s}/{k}": _profile(r, x, y, args.steps) for (s, k), r in runners.items()} if args.profile else None
    mine = {f"{s}/{k}": r.memory(x, y) for (s, k), r in runners.items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)  # partitions differ by rank (ZeroRedundancyOptimizer's greedy split)
    memory = {key: [every[r][key] for r in range(world)] for key in mine}
    if rank == 0:
        queue.put(
            {
                "samples": samples,
                "memory": memory,
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


def _summary(samples: list[float]) -> dict[str, Any]:
    ms = [1e3 * s for s in samples]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "n": len(ms)}


def _machine() -> dict[str, Any]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("shardkit", "deepspeed"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", None)
        except Exception:  # optional: absent or broken
            versions[mod] = None
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "versions": versions}
    if hasattr(os, "getloadavg"):
        info["loadavg"] = list(os.getloadavg())
    return info


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the ranks, collect rank 0's samples and memory, and build the report dict.

    Returns:
        The report (also what :func:`main` writes as JSON): ``stages`` maps ``"1"``/``"2"`` to
        ``{"configs": {name: {time..., memory...}}, "ratios": {peer: {...}}}`` and ``"3"`` to
        ``{"built": False, ...}``.
    """
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mctx = mp.get_context("spawn")
    queue = mctx.SimpleQueue()
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    procs = [mctx.Process(target=_worker, args=(r, args.nproc, port, args, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    while queue.empty():
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            codes = [p.exitcode for p in procs]
            raise SystemExit(f"zero benchmark: a worker failed or timed out (exit codes {codes})")
        time.sleep(0.2)
    raw = queue.get()
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"zero benchmark worker failed with exit code {p.exitcode}")
    stages: dict[str, Any] = {}
    for stage in args.stages:
        configs: dict[str, Any] = {}
        for kind in (SHARDKIT, *PEERS[stage]):
            key = f"{stage}/{kind}"
            if key in raw["samples"]:
                per_rank = raw["memory"][key]
                for m in per_rank:  # persistent state plus what is gathered from forward to backward
                    m["model_state_in_step"] = m["model_state"] + m["params_in_step"] - m["params"]
                worst = max(per_rank, key=lambda m: m["model_state"])  # the rank that runs out first
                configs[kind] = {"available": True, **_summary(raw["samples"][key]), "memory": worst, "memory_per_rank": per_rank}
                if raw["profiles"]:
                    configs[kind]["profile_rank0"] = raw["profiles"][key]
            else:
                configs[kind] = {"available": False, "reason": raw["unavailable"].get(key, "not run")}
        ours = configs[SHARDKIT]
        ratios = {}
        for peer in PEERS[stage]:
            c = configs[peer]
            if c["available"]:
                ratios[peer] = {
                    "time_median": ours["median_ms"] / c["median_ms"],
                    "time_min": ours["min_ms"] / c["min_ms"],
                    "model_state": ours["memory"]["model_state"] / c["memory"]["model_state"],
                    "params_in_step": ours["memory"]["params_in_step"] / c["memory"]["params_in_step"],
                    "model_state_in_step": ours["memory"]["model_state_in_step"] / c["memory"]["model_state_in_step"],
                }
        live = [p for p in ratios]
        best = min(live, key=lambda p: configs[p]["median_ms"]) if live else None
        stages[str(stage)] = {"built": True, "configs": configs, "ratios": ratios, "fastest_peer": best}
    stages["3"] = {
        "built": False,
        "reason": "shardkit ZeRO stage 3 is not built yet (ShardedDataParallel(stage=3) raises "
        "NotImplementedError; docs/zero.md, 'Next'); nothing measured",
    }
    n = raw["n_params"]
    return {
        "benchmark": "zero_step",
        "device": "cpu",
        "backend": "gloo",
        "nproc": args.nproc,
        "params": n,
        "model": f"TinyGPT d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} "
        f"vocab={args.vocab} seq_len={args.seq_len} tied, batch/rank={args.batch}",
        "optimizer": {
            "ours": "ZeroOptimizer(sdp, FusedAdamW)",
            "peers": f"torch.optim.AdamW(fused={args.peer_fused}) / DeepSpeed AdamW(torch_adam=True)",
            **HYPER,
        },
        "settings": {
            "warmup": args.warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "bucket_mb": args.bucket_mb,
            "threads_per_rank": args.threads or max(1, (os.cpu_count() or 2) // args.nproc),
        },
        "units": {
            "time": "ms per step (zero_grad + forward + backward + step)",
            "memory": "bytes per rank: `memory` is the rank with the most model state, `memory_per_rank` all",
        },
        "formulas_bytes": {
            "ddp": 16 * n,
            "stage1": 4 * n + 4 * n + 8 * n // args.nproc,
            "stage2": 4 * n + 12 * n // args.nproc,
            "stage3": 16 * n // args.nproc,
        },
        "stages": stages,
        "notes": [
            "ratio = shardkit / peer (< 1: faster or smaller); memory ratios on model_state (at rest), "
            "params_in_step and model_state_in_step (= model_state + params_in_step - params: the persistent "
            "state plus the params gathered from forward to the end of backward; transient buckets excluded)",
            "torch.fully_shard(reshard_after_forward=False) is ZeRO-2's communication, but FSDP2 reshards "
            "after backward: at rest it holds sharded params (stage-3 memory); params_in_step shows the "
            "gathered params it holds from forward to the end of backward",
            "DeepSpeed keeps an fp32 master partition even for fp32 models (master_params)",
        ],
        "machine": _machine() | {"loadavg_start": load_start},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["shardkit bench zero", *args.argv]),
    }


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Two panels: median step time and per-rank model-state memory, per stage and configuration."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional: the JSON carries everything
        return
    short = {"torch.ZeroRedundancyOptimizer": "ZRO+DDP", "torch.fully_shard": "FSDP2"}
    bars = [
        (f"ZeRO-{s}\n{short.get(k, k)}", c)
        for s, st in report["stages"].items()
        if st["built"]
        for k, c in st["configs"].items()
        if c["available"]
    ]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.8))
    labels = [b[0] for b in bars]
    colors = ["tab:blue" if SHARDKIT in lab else "tab:gray" for lab in labels]
    ax_t.bar(labels, [c["median_ms"] for _, c in bars], color=colors)
    ax_t.set_ylabel("median step time (ms)")
    ax_m.bar(labels, [c["memory"]["model_state"] / 2**20 for _, c in bars], color=colors, label="model state at rest")
    ax_m.scatter(
        labels,
        [c["memory"]["model_state_in_step"] / 2**20 for _, c in bars],
        color="tab:red",
        marker="_",
        s=300,
        label="model state during step (+ gathered params)",
    )
    ax_m.set_ylabel("MiB per rank")
    ax_m.set_ylim(top=1.3 * max(c["memory"]["model_state_in_step"] for _, c in bars) / 2**20)  # room for the legend
    ax_m.legend(fontsize=7)
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"{report['model']}, {report['params'] / 1e6:.1f}M params, {report['nproc']} ranks gloo", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(report: dict[str, Any]) -> str:
    """A plain-text summary: one line per configuration, ratios against each peer."""
    lines = [f"{report['model']}, {report['params'] / 1e6:.1f}M params, {report['nproc']} ranks gloo"]
    for s, st in report["stages"].items():
        if not st["built"]:
            lines.append(f"ZeRO-{s}: {st['reason']}")
            continue
        for k, c in st["configs"].items():
            if not c["available"]:
                lines.append(f"ZeRO-{s} {k:<32} unavailable: {c['reason'][:120]}")
                continue
            m = c["memory"]
            lines.append(
                f"ZeRO-{s} {k:<32} median {c['median_ms']:9.1f} ms  min {c['min_ms']:9.1f} ms  "
                f"model state {m['model_state'] / 2**20:8.1f} MiB  in step {m['model_state_in_step'] / 2**20:8.1f} MiB"
            )
            if "profile_rank0" in c:
                phases = c["profile_rank0"]["phases_ms_per_step"]
                lines.append("    " + "  ".join(f"{k.split('::')[-1]} {v:.1f} ms" for k, v in phases.items()))
        for peer, r in st["ratios"].items():
            lines.append(
                f"ZeRO-{s} ours/{peer:<28} time {r['time_median']:.3f}x (min {r['time_min']:.3f}x)  "
                f"model state {r['model_state']:.3f}x  in step {r['model_state_in_step']:.3f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``shardkit bench zero`` / ``python perf/zero.py``: run, print, write JSON + PNG; exit code."""
    p = argparse.ArgumentParser(
        prog="shardkit bench zero", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument(
        "--configs",
        nargs="+",
        default=[SHARDKIT, *sorted({k for v in PEERS.values() for k in v})],
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
