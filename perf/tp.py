"""Tensor parallelism vs DTensor: step time of a TP transformer, and the vocab-parallel cross-entropy.

Spawns ``--nproc`` local gloo ranks (all on the tp axis) and measures, in the same run:

1. **Step time** (forward + backward + SGD step) of TinyGPT (``shardkit.models``, untied
   embeddings) made tensor-parallel two ways from the same dense weights:

   * ``shardkit``: ``tensor_parallelize(model, ctx, gpt_plan(tie_embeddings=False))`` and
     ``vocab_parallel_cross_entropy`` on the logits shard;
   * ``dtensor``: ``parallelize_module`` with ``ColwiseParallel`` (qkv, mlp.fc, the LM head with
     ``output_layouts=Shard(-1)``) / ``RowwiseParallel`` (attn.proj, mlp.proj, the embedding) and
     DTensor's own vocab-parallel loss (``loss_parallel()`` around ``F.cross_entropy``), as
     torchtitan does. The fused qkv rows are permuted first so that DTensor's contiguous
     ``Shard(0)`` gives each rank whole heads of q, k and v (``gpt_plan`` does it with
     ``Colwise(fused_chunks=3)``).

   Both are timed interleaved, repeat by repeat, so machine noise hits both alike. The script
   asserts that both losses at step 0 equal the dense model's (a mis-sharded model fails here).
   Sequence parallelism is not compared: ``gpt_plan`` has no sequence-parallel variant (TinyGPT's
   attention takes its sequence length from its input, which under SP is the ``s/tp`` chunk).

2. **Cross-entropy** forward + backward on a logits shard ``[T, V/tp]`` (fp32, CPU torch path),
   at each ``--vocabs``: ``vocab_parallel_cross_entropy`` vs all-gathering the logits then
   ``F.cross_entropy`` (the baseline; its gather is a minimal autograd all-gather) and vs DTensor
   ``loss_parallel``. Peak memory: see ``MEMORY_METHOD``.

Model builders (both TP variants of TinyGPT and of the block stack) live in `perf/tp_models.py`. ``shardkit bench tp`` and ``perf/tp.py`` run it.

    python perf/tp.py                                   # full run -> perf/results/tp_cpu.json + .png
    python perf/tp.py --quick --out /tmp/tp             # smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT, lm_loss
from shardkit.parallel.profiled_peak import profiled_peak_bytes
from shardkit.parallel.tensor import gpt_plan, tensor_parallelize, vocab_parallel_cross_entropy

from tp_models import Block, dtensor_blocks, dtensor_tinygpt, ours_blocks
from bench_workers import reporting_errors, run_workers, worker_env

MEMORY_METHOD = (
    "torch.profiler(profile_memory=True) records every allocation and free of torch's CPU allocator "
    "(including temporaries inside ATen ops); the events are replayed in time order and the peak of "
    "the running sum is reported, relative to the start of the measured region. The input logits "
    "shard (a clone of a leaf, made before the region) is not counted; its gradient, everything "
    "forward saves, and all temporaries are. gloo's own staging buffers are not torch allocations "
    "and are not seen. One profiled call per method on rank 0, separate from the timed calls."
)


# ---------------------------------------------------------------------------------------------
# 1. step time


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor, or ``t`` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _time_steps(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def step_bench(ctx: ParallelContext, args: argparse.Namespace) -> dict:
    V = args.vocab
    torch.manual_seed(0)  # same dense weights on every rank
    dense = TinyGPT(V, args.d_model, args.layers, args.heads, args.seq, tie_embeddings=False)
    ours = tensor_parallelize(copy.deepcopy(dense), ctx, gpt_plan(tie_embeddings=False))
    dt = dtensor_tinygpt(dense, ctx.mesh["tp"])
    g = torch.Generator().manual_seed(1)  # same batch on every rank (TP input is replicated)
    idx = torch.randint(V, (args.batch, args.seq), generator=g)
    y = torch.randint(V, (args.batch, args.seq), generator=g)

    def loss_ours() -> torch.Tensor:
        return vocab_parallel_cross_entropy(ours(idx), y, ctx=ctx, vocab_size=V)

    def loss_dt() -> torch.Tensor:  # call (and backward) inside loss_parallel()
        return F.cross_entropy(dt(idx).flatten(0, 1), y.flatten())

    with torch.no_grad(), loss_parallel():
        ref = lm_loss(dense(idx), y).item()
        l0 = {"shardkit": loss_ours().item(), "dtensor": _local(loss_dt()).item()}
    for name, value in l0.items():  # sanity: both TP models compute the dense model's loss
        assert abs(value - ref) <= 1e-4 * abs(ref), f"{name} loss at step 0 is {value}, dense model {ref}"
    del dense

    opts = {"shardkit": torch.optim.SGD(ours.parameters(), lr=args.lr), "dtensor": torch.optim.SGD(dt.parameters(), lr=args.lr)}
    last: dict[str, float] = {}

    def make_step(name: str) -> Callable[[], None]:
        opt = opts[name]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            if name == "shardkit":
                loss = loss_ours()
                loss.backward()
            else:
                with loss_parallel():
                    loss = loss_dt()
                    loss.backward()
            opt.step()
            last[name] = _local(loss.detach()).item()

        return step

    steps = {k: make_step(k) for k in opts}
    for s in steps.values():
        _time_steps(s, args.warmup)
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):  # interleaved
        for k, s in steps.items():
            samples[k] += _time_steps(s, args.steps)
    # both took the same SGD steps on the same batch: they should still agree
    return {"step0_loss": {**l0, "dense": ref}, "last_loss": last, "samples": samples}


# ---------------------------------------------------------------------------------------------
# 1b. a stack of pre-LN blocks, with and without sequence parallelism


def blocks_bench(ctx: ParallelContext, args: argparse.Namespace) -> dict:
    tp, r = ctx.size("tp"), ctx.rank("tp")
    torch.manual_seed(0)
    dense = nn.Sequential(*(Block(args.d_model, args.heads) for _ in range(args.layers)))
    x = torch.randn(args.batch, args.seq, args.d_model, generator=torch.Generator().manual_seed(1))
    x_sp = x.chunk(tp, 1)[r].contiguous()
    models = {
        "shardkit_tp": (ours_blocks(dense, ctx, False), x),
        "dtensor_tp": (dtensor_blocks(dense, ctx.mesh["tp"], False), x),
        "shardkit_sp": (ours_blocks(dense, ctx, True), x_sp),
        "dtensor_sp": (dtensor_blocks(dense, ctx.mesh["tp"], True), x_sp),
    }
    with torch.no_grad():
        ref = dense(x).square().mean().item()
        l0 = {}
        for k, (m, inp) in models.items():
            loss = _local(m(inp)).square().mean()
            if k.endswith("_sp"):  # equal chunks: the full mean is the mean of the chunk means
                dist.all_reduce(loss, group=ctx.group("tp"))
                loss /= tp
            l0[k] = loss.item()
    for k, v in l0.items():
        assert abs(v - ref) <= 1e-4 * abs(ref), f"{k} output at step 0 gives {v}, dense block stack {ref}"
    del dense

    def make_step(model: nn.Module, inp: torch.Tensor) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            _local(model(inp)).square().mean().backward()
            opt.step()

        return step

    steps = {k: make_step(m, inp) for k, (m, inp) in models.items()}
    for s in steps.values():
        _time_steps(s, args.warmup)
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeats):  # interleaved
        for k, s in steps.items():
            samples[k] += _time_steps(s, args.steps)
    return {"step0_loss": {**l0, "dense": ref}, "samples": samples}


# ---------------------------------------------------------------------------------------------
# 2. cross-entropy


class _GatherVocab(torch.autograd.Function):
    """Baseline's gather: ``[T, Vs]`` shards -> ``[T, tp Vs]`` (one all-gather + the layout copy
    that every gather along the last dim needs); backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tp = group.size()
        ctx.group = group
        buf = shard.new_empty(tp * shard.shape[0], shard.shape[1])
        dist.all_gather_single(buf, shard.contiguous(), group=group)
        return buf.view(tp, *shard.shape).permute(1, 0, 2).reshape(shard.shape[0], tp * shard.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        r, vs = ctx.group.rank(), grad.shape[1] // ctx.group.size()
        return grad[:, r * vs : (r + 1) * vs], None


def peak_bytes(fn: Callable[[], None]) -> int:
    """Peak of torch's CPU allocations during ``fn()`` above the level at its start (see MEMORY_METHOD)."""
    return profiled_peak_bytes(fn)


def ce_bench(ctx: ParallelContext, args: argparse.Namespace) -> dict:
    group, mesh = ctx.group("tp"), ctx.mesh["tp"]
    tp, T = group.size(), args.tokens
    out = {}
    for V in args.vocabs:
        vs = V // tp
        torch.manual_seed(2 + ctx.rank("tp"))
        base = (2.0 * torch.randn(T, vs)).requires_grad_()
        target = torch.randint(V, (T,), generator=torch.Generator().manual_seed(3))
        methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "shardkit": lambda s: vocab_parallel_cross_entropy(s, target, ctx=ctx, vocab_size=V),
            "gather_F_cross_entropy": lambda s: F.cross_entropy(_GatherVocab.apply(s, group), target),
        }

        def dtensor_loss(s: torch.Tensor) -> torch.Tensor:
            with loss_parallel():
                loss = F.cross_entropy(DTensor.from_local(s, mesh, [Shard(1)], run_check=False), target)
                loss.backward()  # loss_parallel needs backward inside its context
                return _local(loss.detach())

        methods["dtensor_loss_parallel"] = dtensor_loss

        def run(name: str) -> tuple[float, torch.Tensor]:
            base.grad = None
            shard = base.clone()  # a non-leaf, as a real LM head's output (ours then writes its grad in place)
            t0 = time.perf_counter()
            loss = methods[name](shard)
            if loss.requires_grad:
                loss.backward()
            dt = time.perf_counter() - t0
            return dt, loss.detach()

        entry: dict[str, Any] = {"vocab": V, "tokens": T, "shard_bytes": 4 * T * vs}
        losses, grads = {}, {}
        for name in methods:
            _, losses[name] = run(name)
            grads[name] = base.grad
        entry["max_abs_loss_diff"] = max(abs(v.item() - losses["gather_F_cross_entropy"].item()) for v in losses.values())
        entry["max_abs_grad_diff"] = max((v - grads["gather_F_cross_entropy"]).abs().max().item() for v in grads.values())
        assert entry["max_abs_loss_diff"] <= 1e-4 * abs(losses["gather_F_cross_entropy"].item()), entry
        del grads
        samples: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(args.ce_repeats):  # interleaved
            for name in methods:
                samples[name].append(run(name)[0])
        entry["samples"] = samples
        entry["peak_bytes"] = {}
        for name in methods:
            base.grad = None
            shard = base.clone()

            def once(name: str = name, shard: torch.Tensor = shard) -> None:
                loss = methods[name](shard)
                if loss.requires_grad:
                    loss.backward()

            entry["peak_bytes"][name] = peak_bytes(once)
            del shard
        out[str(V)] = entry
    return out


# ---------------------------------------------------------------------------------------------
# driver


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    worker_env(rank, world, port)
    ctx = ParallelContext.from_env(tp=world, backend="gloo")
    try:
        with reporting_errors(rank, queue):
            results = {
                "step": step_bench(ctx, args),
                "blocks": blocks_bench(ctx, args),
                "ce": ce_bench(ctx, args) if args.vocabs else {},
            }
            if rank == 0:
                queue.put(results)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _blocks_report(raw: dict, args: argparse.Namespace) -> dict:
    t = {k: summarize(v) for k, v in raw["samples"].items()}
    out: dict[str, Any] = {
        "model": f"{args.layers} pre-LN attention+MLP blocks d={args.d_model} heads={args.heads} seq={args.seq} batch={args.batch}, loss mean(y^2)",
        **t,
        "step0_loss": raw["step0_loss"],
    }
    for mode in ("tp", "sp"):
        ours, peer = t[f"shardkit_{mode}"], t[f"dtensor_{mode}"]
        out[f"ratio_median_{mode}"] = ours["median_ms"] / peer["median_ms"]
        out[f"ratio_min_{mode}"] = ours["min_ms"] / peer["min_ms"]
    return out


def summarize(samples: list[float]) -> dict[str, float]:
    return {"min_ms": 1e3 * min(samples), "median_ms": 1e3 * statistics.median(samples), "n": len(samples)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="tp size (gloo ranks)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048, help="cross-entropy tokens per rank")
    p.add_argument("--vocabs", type=int, nargs="*", default=[32768, 65536, 131072])
    p.add_argument("--ce-repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", type=Path, default=Path("perf/results"), help="output directory (default perf/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.d_model, args.layers, args.heads, args.seq, args.batch = 256, 32, 1, 2, 16, 2
        args.warmup, args.steps, args.repeats = 1, 2, 1
        args.tokens, args.vocabs, args.ce_repeats = 64, [1024, 2048], 2
    for v in [args.vocab, *args.vocabs]:
        if v % args.nproc:
            raise SystemExit(f"vocabulary {v} must be divisible by --nproc {args.nproc} (DTensor's even Shard)")
    try:
        raw = run_workers(worker, args.nproc, args, timeout=3600, what="tp benchmark")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    if "error" in raw:
        raise SystemExit(f"benchmark worker failed: {raw['error']}")

    st = raw["step"]
    ours, peer = summarize(st["samples"]["shardkit"]), summarize(st["samples"]["dtensor"])
    n_params = sum(
        q.numel() for q in TinyGPT(args.vocab, args.d_model, args.layers, args.heads, args.seq, tie_embeddings=False).parameters()
    )
    ce = {}
    for v, e in raw["ce"].items():
        times = {k: summarize(s) for k, s in e["samples"].items()}
        ce[v] = {
            "vocab": e["vocab"],
            "tokens": e["tokens"],
            "shard_bytes": e["shard_bytes"],
            "time": times,
            "peak_bytes": e["peak_bytes"],
            "ratio_time_median": times["shardkit"]["median_ms"] / times["gather_F_cross_entropy"]["median_ms"],
            "ratio_peak_bytes": e["peak_bytes"]["shardkit"] / e["peak_bytes"]["gather_F_cross_entropy"],
            "ratio_time_median_vs_dtensor": times["shardkit"]["median_ms"] / times["dtensor_loss_parallel"]["median_ms"],
            "ratio_peak_bytes_vs_dtensor": e["peak_bytes"]["shardkit"] / e["peak_bytes"]["dtensor_loss_parallel"],
            "max_abs_loss_diff": e["max_abs_loss_diff"],
            "max_abs_grad_diff": e["max_abs_grad_diff"],
        }
    report = {
        "benchmark": "tp_step_and_cross_entropy",
        "device": "cpu",
        "backend": "gloo",
        "nproc": args.nproc,
        "model": (
            f"TinyGPT vocab={args.vocab} d={args.d_model} layers={args.layers} heads={args.heads} "
            f"seq={args.seq} batch={args.batch} (untied), SGD lr={args.lr}"
        ),
        "params": n_params,
        "step": {
            "shardkit": ours,
            "dtensor": peer,
            "ratio_median": ours["median_ms"] / peer["median_ms"],
            "ratio_min": ours["min_ms"] / peer["min_ms"],
            "step0_loss": st["step0_loss"],
            "last_loss": st["last_loss"],
            "sequence_parallel": "see blocks: gpt_plan has no sequence-parallel variant",
        },
        "blocks": _blocks_report(raw["blocks"], args),
        "cross_entropy": ce,
        "memory_method": MEMORY_METHOD,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads_per_rank": max(1, (os.cpu_count() or 2) // args.nproc),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "tp_cpu" + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['model']}, {n_params / 1e6:.2f}M params, tp={args.nproc} gloo")
    print(f"  shardkit TP   min {ours['min_ms']:8.1f} ms  median {ours['median_ms']:8.1f} ms")
    print(f"  DTensor TP    min {peer['min_ms']:8.1f} ms  median {peer['median_ms']:8.1f} ms")
    print(f"  ratio shardkit/DTensor  median {report['step']['ratio_median']:.3f}  min {report['step']['ratio_min']:.3f}")
    b = report["blocks"]
    for mode in ("tp", "sp"):
        print(
            f"  blocks {mode.upper()}: shardkit {b[f'shardkit_{mode}']['median_ms']:8.1f} ms, DTensor {b[f'dtensor_{mode}']['median_ms']:8.1f} ms, "
            f"ratio median {b[f'ratio_median_{mode}']:.3f} min {b[f'ratio_min_{mode}']:.3f}"
        )
    for v, e in ce.items():
        t, m = e["time"], e["peak_bytes"]
        print(
            f"  CE V={v:>7} T={e['tokens']}: shardkit {t['shardkit']['median_ms']:7.1f} ms {m['shardkit'] / 2**20:7.1f} MiB | "
            f"gather+F.ce {t['gather_F_cross_entropy']['median_ms']:7.1f} ms {m['gather_F_cross_entropy'] / 2**20:7.1f} MiB | "
            f"DTensor loss_parallel {t['dtensor_loss_parallel']['median_ms']:7.1f} ms {m['dtensor_loss_parallel'] / 2**20:7.1f} MiB | "
            f"ratio time {e['ratio_time_median']:.3f} mem {e['ratio_peak_bytes']:.3f}"
        )
    _plot(report, args.out / f"{stem}.png")
    return report


def _plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ce = report["cross_entropy"]
    if not ce:
        return
    vocabs = sorted(ce, key=int)
    labels = {
        "shardkit": "shardkit vocab-parallel CE",
        "gather_F_cross_entropy": "gather + F.cross_entropy",
        "dtensor_loss_parallel": "DTensor loss_parallel",
    }
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.5))
    for key, label in labels.items():
        x = [int(v) for v in vocabs]
        ax_t.plot(x, [ce[v]["time"][key]["median_ms"] for v in vocabs], "o-", label=label)
        ax_m.plot(x, [ce[v]["peak_bytes"][key] / 2**20 for v in vocabs], "o-", label=label)
    for ax, ylabel in ((ax_t, "median fwd+bwd time (ms)"), (ax_m, "peak allocated (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("vocabulary size")
        ax.set_ylabel(ylabel)
    ax_m.legend(fontsize=7)
    first = ce[vocabs[0]]
    fig.suptitle(f"cross-entropy, {first['tokens']} tokens, tp={report['nproc']} gloo, fp32 CPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
