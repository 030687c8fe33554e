"""ZeRO-2 step time with optimizer offload: ``offload=None`` / ``"cpu"`` / ``"nvme"`` vs DeepSpeed
ZeRO-2 with ``offload_optimizer: {device: cpu}``, plus the NVMe file format choice (raw bytes vs
``torch.save``).

Same model, batch and optimizer hyper-parameters as ``shardkit bench zero`` (TinyGPT, AdamW),
2 gloo ranks on the CPU. Every configuration's steps are interleaved over repeats, each step
timed between barriers; min and median per configuration, and ratio = ours / DeepSpeed.

Usage:
    .venv/bin/python perf/offload.py                   # ~20M-param TinyGPT -> perf/results/offload_cpu.json
    .venv/bin/python perf/offload.py --quick --out /tmp/  # tiny model (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from zero_peers import HYPER, Runner, build_model
from bench_workers import machine_info, run_workers, worker_env

CONFIGS = ("shardkit", "shardkit+cpu", "shardkit+nvme", "deepspeed+cpu")


class _Ours(Runner):
    def __init__(self, model: torch.nn.Module, ctx: Any, offload: str | None, nvme_dir: str | None, bucket_mb: float) -> None:
        from shardkit.kernels import FusedAdamW
        from shardkit.parallel import ShardedDataParallel, ZeroOptimizer

        self.model = ShardedDataParallel(model, ctx, 2, bucket_mb=bucket_mb, offload=offload, nvme_dir=nvme_dir)
        self.opt = ZeroOptimizer(self.model, FusedAdamW, **HYPER)


class _DeepSpeedOffload(Runner):
    def __init__(self, model: torch.nn.Module, batch: int, world: int, bucket_mb: float) -> None:
        import deepspeed

        bucket = int(bucket_mb * 2**20 / 4)
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "train_batch_size": batch * world,
            "optimizer": {"type": "AdamW", "params": {**HYPER, "torch_adam": True, "adam_w_mode": True}},
            # torch's AdamW on the CPU partition (DeepSpeedCPUAdam needs a compiled extension)
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": False},
                "reduce_bucket_size": bucket,
                "allgather_bucket_size": bucket,
                "overlap_comm": False,
                "contiguous_gradients": True,
            },
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.model = self.engine

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        from shardkit.models import lm_loss

        self.engine.backward(lm_loss(self.engine(x), y))
        self.engine.step()


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, nvme_dir: str, queue: Any) -> None:
    worker_env(rank, world, port, threads=args.threads)
    import torch.distributed as dist

    from shardkit.comm import ParallelContext

    ctx = ParallelContext.from_env(backend="gloo")
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    runners: dict[str, Runner] = {}
    unavailable: dict[str, str] = {}
    for name in args.configs:
        if name == "deepspeed+cpu":
            ok = torch.ones(1)
            try:  # the optional peer: when it cannot run here, say why and go on
                runners[name] = _DeepSpeedOffload(build_model(args), args.batch, world, args.bucket_mb)
            except Exception as exc:
                ok.zero_()
                unavailable[name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not ok.item():
                runners.pop(name, None)
                unavailable.setdefault(name, "failed on another rank")
            continue
        offload = {"shardkit": None, "shardkit+cpu": "cpu", "shardkit+nvme": "nvme"}[name]
        runners[name] = _Ours(build_model(args), ctx, offload, nvme_dir if offload == "nvme" else None, args.bucket_mb)
    for r in runners.values():
        for _ in range(args.warmup):
            r.step(x, y)
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(args.repeats):  # interleaved, rotating the order, so load hits all alike
        order = list(runners.items())
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for name, r in order:
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                r.step(x, y)
                samples[name].append(time.perf_counter() - t0)
    offloaded = {k: r.model.memory_report()["offloaded"] for k, r in runners.items() if k.startswith("shardkit")}
    if rank == 0:
        n = sum(p.numel() for p in build_model(args).parameters())
        queue.put({"samples": samples, "unavailable": unavailable, "offloaded": offloaded, "n_params": n})
    dist.barrier()
    dist.destroy_process_group()


def _summary(samples: list[float]) -> dict[str, Any]:
    ms = [1e3 * s for s in samples]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "n": len(ms)}


def io_formats(mib: int, repeats: int, directory: str) -> dict[str, Any]:
    """Write (+fsync) and read ``mib`` MiB of fp32 state as raw bytes vs ``torch.save``/``torch.load``.

    Example:
        >>> io_formats(8, 3, "/tmp")["raw"]["write"]["min_ms"]
    """
    from shardkit.parallel.zero.nvme import read_tensors, write_tensors

    n = mib * 2**20 // 4
    tensors = [torch.randn(n // 3) for _ in range(3)]  # master, exp_avg, exp_avg_sq
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    raw_path, pt_path = os.path.join(directory, "raw.bin"), os.path.join(directory, "state.pt")

    def torch_write() -> None:
        with open(pt_path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    ops = {
        ("raw", "write"): lambda: write_tensors(raw_path, tensors, nvme_dir=directory),
        ("raw", "read"): lambda: read_tensors(raw_path, specs),
        ("torch.save", "write"): torch_write,
        ("torch.save", "read"): lambda: torch.load(pt_path, weights_only=True),
    }
    out: dict[str, Any] = {"bytes": sum(t.numel() * 4 for t in tensors)}
    times: dict[tuple[str, str], list[float]] = {k: [] for k in ops}
    for _ in range(repeats):
        for key, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    for (fmt, op), ts in times.items():
        s = _summary(ts)
        s["GBps_min"] = out["bytes"] / (s["min_ms"] / 1e3) / 1e9  # bytes moved / best time
        out.setdefault(fmt, {})[op] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cpu_count // nproc)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--io-mib", type=int, default=64, help="size of the file-format comparison")
    p.add_argument("--nvme-dir", default=None, help="directory for offload='nvme' (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=Path("perf/results"))
    args = p.parse_args(argv)
    argv_used = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.d_model, args.n_layers, args.n_heads, args.vocab, args.seq_len, args.batch = 64, 2, 4, 128, 32, 2
        args.warmup, args.steps, args.repeats, args.io_mib = 1, 1, 2, 4

    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_dir:
        try:
            raw = run_workers(_worker, args.nproc, args, nvme_dir, timeout=args.timeout, what="offload benchmark")
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        io = io_formats(args.io_mib, max(3, args.repeats), nvme_dir)
    configs: dict[str, Any] = {}
    for name in args.configs:
        if name in raw["samples"]:
            configs[name] = {"available": True, **_summary(raw["samples"][name]), "offloaded": raw["offloaded"].get(name)}
        else:
            configs[name] = {"available": False, "reason": raw["unavailable"].get(name, "not run")}
    ratios = {}
    peer = configs.get("deepspeed+cpu", {})
    for name in ("shardkit+cpu", "shardkit+nvme"):
        if configs.get(name, {}).get("available") and peer.get("available"):
            ratios[f"{name} / deepspeed+cpu"] = {
                "time_median": configs[name]["median_ms"] / peer["median_ms"],
                "time_min": configs[name]["min_ms"] / peer["min_ms"],
            }
    report = {
        "benchmark": "zero2_offload_step",
        "device": "cpu",
        "backend": "gloo",
        "nproc": args.nproc,
        "params": raw["n_params"],
        "model": f"TinyGPT d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} "
        f"vocab={args.vocab} seq_len={args.seq_len} tied, batch/rank={args.batch}",
        "optimizer": {"ours": "ZeroOptimizer(sdp, FusedAdamW)", "peer": "DeepSpeed AdamW(torch_adam=True)", **HYPER},
        "settings": {"warmup": args.warmup, "steps": args.steps, "repeats": args.repeats, "bucket_mb": args.bucket_mb},
        "units": {"time": "ms per step (zero_grad + forward + backward + step)"},
        "configs": configs,
        "ratios": ratios,
        "io_formats": io,
        "notes": [
            "CPU-only machine: 'offload' moves nothing off a device here, so shardkit+cpu vs shardkit measures "
            "the offload machinery (copies, separate masters), and vs deepspeed+cpu the peer's equivalent",
            "nvme_dir is a temp dir on this machine's disk (page cache included): a real NVMe drive and "
            "state larger than RAM are what the read-ahead is for",
        ],
        "machine": machine_info(),
        "command": " ".join(["perf/offload.py", *argv_used]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("offload_cpu" + ("_quick" if args.quick else "") + ".json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    for name, c in configs.items():
        line = f"{c['min_ms']:8.1f} {c['median_ms']:8.1f}" if c["available"] else f"unavailable: {c['reason']}"
        print(f"{name:16s} {line}")
    for name, r in ratios.items():
        print(f"{name}: median {r['time_median']:.2f}x, min {r['time_min']:.2f}x")
    for fmt in ("raw", "torch.save"):
        w, r = io[fmt]["write"], io[fmt]["read"]
        print(
            f"{fmt:10s} write {w['min_ms']:.1f} ms ({w['GBps_min']:.2f} GB/s)  read {r['min_ms']:.1f} ms ({r['GBps_min']:.2f} GB/s)"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
