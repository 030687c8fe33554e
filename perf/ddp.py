"""Step time of shardkit DataParallel vs torch DDP: same model, same data, same run.

Spawns ``--nproc`` local processes (``--device cpu``: gloo; ``--device cuda``: NCCL, one GPU per
rank, and an error naming both numbers when there are more ranks than GPUs; ``auto`` picks cuda
when CUDA is available). Each timed step is forward +
backward (with the gradient all-reduce) + optimizer step, for the same MLP under both wrappers,
interleaved repeat by repeat so machine noise hits both alike. Reports min/median per wrapper
and the ratio shardkit/torch (< 1 is faster), plus a bucket-size sweep for shardkit.

    python perf/ddp.py --device cpu                       # full run -> perf/results/ddp_cpu.json + .png
    python perf/ddp.py --device cpu --quick --out /tmp/x  # smoke run (used by the test suite)
    python perf/ddp.py --device cpu --profile --repeats 3 # + per-phase times of both wrappers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DataParallel
from bench_workers import run_workers, worker_env


def make_model(width: int, depth: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def resolve_device(device: str, backend: str, nproc: int) -> tuple[str, str]:
    """``(device, backend)`` from the flags; raise ``SystemExit`` naming both numbers when
    ``nproc`` ranks would need more GPUs than there are (each rank takes ``cuda:local_rank``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if device == "cpu" and backend == "nccl":
        raise SystemExit("--backend nccl needs --device cuda (NCCL does not run on CPU tensors)")
    if device == "cuda":
        n_gpus = torch.cuda.device_count()
        if nproc > n_gpus:
            raise SystemExit(
                f"--nproc {nproc} ranks but only {n_gpus} CUDA device(s): each rank needs its own GPU. "
                "Use --nproc <= the GPU count, or --device cpu (gloo)."
            )
    return device, backend


def phase_times(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> dict[str, float]:
    """Median ms of each phase of a step: forward, backward (incl. the all-reduce), step."""
    out: dict[str, list[float]] = {"zero_grad": [], "forward": [], "backward": [], "step": []}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = model(x).square().mean()
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        opt.step()
        sync()
        t4 = time.perf_counter()
        for k, a, b in (("zero_grad", t0, t1), ("forward", t1, t2), ("backward", t2, t3), ("step", t3, t4)):
            out[k].append(1e3 * (b - a))
    return {k: statistics.median(v) for k, v in out.items()}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    worker_env(rank, world, port)
    ctx = ParallelContext.from_env(backend=args.backend)
    # gloo on CUDA tensors is allowed: the context then says CPU, so place the model ourselves
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, device=device)

    def build(kind: str, bucket_mb: float) -> tuple[nn.Module, torch.optim.Optimizer]:
        base = make_model(args.width, args.depth).to(device)
        view = kind.endswith("_view")
        if kind.startswith("shardkit"):
            model: nn.Module = DataParallel(base, ctx, bucket_mb=bucket_mb, gradient_as_bucket_view=view)
        else:
            model = nn.parallel.DistributedDataParallel(base, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=view)
        return model, FusedAdamW(model.parameters(), lr=1e-4)

    results: dict = {"main": {}, "sweep": {}}
    models = {k: build(k, args.bucket_mb) for k in ("shardkit", "torch_ddp", "shardkit_view", "torch_ddp_view")}
    for k, (m, o) in models.items():
        time_steps(m, o, x, args.warmup)
    samples: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.repeats):  # interleaved
        for k, (m, o) in models.items():
            samples[k] += time_steps(m, o, x, args.steps)
    results["main"] = samples
    if args.profile:  # interleaved too, after the timed runs so it cannot perturb them
        phases: dict[str, list[dict[str, float]]] = {k: [] for k in models}
        for _ in range(args.repeats):
            for k, (m, o) in models.items():
                phases[k].append(phase_times(m, o, x, args.steps))
        results["phases"] = {k: {ph: statistics.median(r[ph] for r in v) for ph in v[0]} for k, v in phases.items()}
    for mb in args.sweep:
        sk = build("shardkit", mb)
        td = build("torch_ddp", mb)
        time_steps(*sk, x, args.warmup)
        time_steps(*td, x, args.warmup)
        s_sk, s_td = [], []
        for _ in range(args.repeats):
            s_sk += time_steps(*sk, x, args.steps)
            s_td += time_steps(*td, x, args.steps)
        results["sweep"][str(mb)] = {"shardkit": s_sk, "torch_ddp": s_td}
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def summarize(samples: list[float]) -> dict[str, float]:
    return {"min_ms": 1e3 * min(samples), "median_ms": 1e3 * statistics.median(samples), "n": len(samples)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="cpu: gloo on CPU; cuda: one GPU per rank (default: cuda if available)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="process-group backend (default: nccl on cuda, gloo on cpu)",
    )
    p.add_argument("--profile", action="store_true", help="also time forward/backward/step separately")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--sweep", type=float, nargs="*", default=[1.0, 4.0, 16.0, 64.0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.device, args.backend = resolve_device(args.device, args.backend, args.nproc)
    if args.quick:
        args.width, args.depth, args.batch, args.sweep = 64, 2, 8, [1.0]
        args.warmup, args.steps, args.repeats = 1, 2, 1
    try:
        raw = run_workers(worker, args.nproc, args, timeout=3600, what="ddp benchmark")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc

    n_params = sum(q.numel() for q in make_model(args.width, args.depth).parameters())
    main_sk, main_td = summarize(raw["main"]["shardkit"]), summarize(raw["main"]["torch_ddp"])
    report = {
        "benchmark": "ddp_step",
        "device": args.device,
        "backend": args.backend,
        "nproc": args.nproc,
        "params": n_params,
        "grad_bytes": 4 * n_params,
        "model": f"MLP width={args.width} depth={args.depth} batch/rank={args.batch}",
        "bucket_mb": args.bucket_mb,
        "shardkit": main_sk,
        "torch_ddp": main_td,
        "ratio_median": main_sk["median_ms"] / main_td["median_ms"],
        "ratio_min": main_sk["min_ms"] / main_td["min_ms"],
        "gradient_as_bucket_view": {
            "shardkit": summarize(raw["main"]["shardkit_view"]),
            "torch_ddp": summarize(raw["main"]["torch_ddp_view"]),
            "ratio_median": statistics.median(raw["main"]["shardkit_view"]) / statistics.median(raw["main"]["torch_ddp_view"]),
        },
        "sweep": {
            mb: {"shardkit": summarize(v["shardkit"]), "torch_ddp": summarize(v["torch_ddp"])} for mb, v in raw["sweep"].items()
        },
        "phases_median_ms": raw.get("phases"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "ddp_" + report["device"] + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['model']}, {n_params / 1e6:.1f}M params, {args.nproc} ranks, {report['backend']}")
    print(f"  shardkit DataParallel  min {main_sk['min_ms']:8.1f} ms  median {main_sk['median_ms']:8.1f} ms")
    print(f"  torch DDP              min {main_td['min_ms']:8.1f} ms  median {main_td['median_ms']:8.1f} ms")
    print(f"  ratio shardkit/torch   median {report['ratio_median']:.3f}  min {report['ratio_min']:.3f}")
    v = report["gradient_as_bucket_view"]
    print(
        f"  gradient_as_bucket_view: shardkit {v['shardkit']['median_ms']:.1f} ms, torch {v['torch_ddp']['median_ms']:.1f} ms, "
        f"ratio {v['ratio_median']:.3f}"
    )
    for k, ph in (report["phases_median_ms"] or {}).items():
        print(f"  phases {k:<15} " + "  ".join(f"{name} {ms:6.1f} ms" for name, ms in ph.items()))
    for mb, v in report["sweep"].items():
        print(f"  bucket {mb:>6} MiB: shardkit {v['shardkit']['median_ms']:8.1f} ms, torch {v['torch_ddp']['median_ms']:8.1f} ms")
    _plot(report, args.out / f"{stem}.png")
    return report


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    mbs = sorted(report["sweep"], key=float)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("shardkit", "shardkit DataParallel"), ("torch_ddp", "torch DDP")):
        ax.plot([float(m) for m in mbs], [report["sweep"][m][key]["median_ms"] for m in mbs], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket size (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{report['model']} — {report['nproc']} ranks, {report['backend']}", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
