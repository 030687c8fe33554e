"""Fused linear + cross-entropy vs the unfused LM-head loss: time and peak memory of forward + backward.

For each ``(tokens T, vocabulary V)`` at hidden size ``d`` (one process, tp = 1), the loss path
``hidden [T, d] -> loss`` with gradients of ``hidden`` and the head weight ``[V, d]``, four ways
in the same run:

* ``shardkit.fused_linear_ce``: ``fused_linear_cross_entropy(hidden, weight, target)`` (chunks of
  ``planned_chunk_tokens(T, V, d, dtype)`` tokens; the logits never exist whole), and with ``--chunk-tokens``
  at other chunk sizes;
* ``shardkit.linear+vocab_parallel_ce``: ``F.linear`` then ``vocab_parallel_cross_entropy`` (today's
  path: the whole ``[T, V]`` logits and their gradient);
* ``torch.linear+cross_entropy_fp32``: ``F.cross_entropy(F.linear(h, W).float(), t)``, the
  reference every method is checked against (at tp > 1 this is gather-then-CE);
* ``torch.compile(linear+cross_entropy)`` (``--compile``): the same function compiled.

Time: min and median wall time of ``--repeats`` calls after ``--warmup`` (CUDA: synchronized).
Peak memory: the allocator's peak during one call above what was allocated before it (CUDA:
``max_memory_allocated``; CPU: torch.profiler's allocation events, replayed). The issue's bound
for the fused path is ``1.1 x (one chunk of logits + dhidden + dweight)``; ``floor_bytes``
records that sum (dweight counted as its fp32 accumulator when more than one chunk feeds it) and
``peak_over_floor`` the ratio.
Losses are checked against the reference before timing.

    python perf/fused_ce.py --device cuda --out perf/results          # -> fused_ce_cuda.json + .png
    python perf/fused_ce.py --quick --out /tmp/fce                     # CPU smoke run
    python perf/fused_ce.py --device cuda --tokens 32768 --append      # add rows to the file
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import ParallelContext
from shardkit.parallel.tensor import fused_linear_cross_entropy, vocab_parallel_cross_entropy
from shardkit.parallel.tensor.fused_linear_loss import planned_chunk_tokens

from bench_workers import machine_info
from tp import peak_bytes as cpu_peak_bytes

FUSED = "shardkit.fused_linear_ce"
VOCAB_PARALLEL = "shardkit.linear+vocab_parallel_ce"
REFERENCE = "torch.linear+cross_entropy_fp32"
COMPILED = "torch.compile(linear+cross_entropy)"


def _reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def _methods(ctx: ParallelContext, V: int, args: argparse.Namespace) -> dict[str, Callable[..., torch.Tensor]]:
    out: dict[str, Callable[..., torch.Tensor]] = {
        FUSED: lambda h, w, t: fused_linear_cross_entropy(h, w, t),
        **{
            f"{FUSED}[chunk_tokens={k}]": lambda h, w, t, k=k: fused_linear_cross_entropy(h, w, t, chunk_tokens=k)
            for k in args.chunk_tokens
        },
        VOCAB_PARALLEL: lambda h, w, t: vocab_parallel_cross_entropy(F.linear(h, w), t, ctx=ctx, vocab_size=V),
        REFERENCE: _reference,
    }
    if args.compile:
        torch._dynamo.reset()  # a fresh compile per shape: past dynamo's recompile limit it would run eagerly
        out[COMPILED] = torch.compile(_reference, dynamic=False)
    return out


def _peak(fn: Callable[[], None], device: torch.device, clear: Callable[[], None]) -> int:
    clear()  # the previous call's gradients are not part of this call's peak
    if device.type != "cuda":
        return cpu_peak_bytes(fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _times(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def bench_shape(ctx: ParallelContext, T: int, V: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every method at one ``(T, V)``; returns the JSON-ready row."""
    dev, dtype, d = torch.device(args.device), getattr(torch, args.dtype), args.hidden
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(T, d, device=dev, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, d, device=dev, generator=g) / d**0.5).to(dtype).requires_grad_()
    t = torch.randint(V, (T,), device=dev, generator=g)
    t[::9] = -100
    elt = h.element_size()
    chunk = min(planned_chunk_tokens(T, V, d, dtype), T)
    # one chunk of logits + dhidden + dweight (its fp32 accumulator when several chunks feed it)
    floor = chunk * V * elt + T * d * elt + V * d * (elt if chunk >= T or elt == 4 else 4)
    row: dict[str, Any] = {"tokens": T, "vocab": V, "hidden": d, "dtype": args.dtype, "chunk_tokens": chunk, "floor_bytes": floor}
    ref_loss = None
    for name, loss_fn in _methods(ctx, V, args).items():

        def clear() -> None:
            h.grad = w.grad = None

        def step() -> None:
            clear()
            loss_fn(h, w, t).backward()

        try:
            loss = float(loss_fn(h, w, t).detach())
            if ref_loss is None:
                ref_loss = float(_reference(h, w, t).detach())
            if abs(loss - ref_loss) > 2e-3 * abs(ref_loss):
                raise AssertionError(f"{name}: loss {loss} vs reference {ref_loss}")
            times = _times(step, dev, args.warmup, args.repeats)
            peak = _peak(step, dev, clear)
        except torch.OutOfMemoryError:
            row[name] = {"available": False, "why": "out of memory"}
            h.grad = w.grad = None
            torch.cuda.empty_cache()
            continue
        row[name] = {
            "available": True,
            "loss": loss,
            "min_ms": min(times),
            "median_ms": statistics.median(times),
            "wall_ms": [round(x, 4) for x in times],
            "peak_extra_bytes": peak,
        }
        h.grad = w.grad = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    fused = row[FUSED]
    for peer in (VOCAB_PARALLEL, REFERENCE, COMPILED):
        if peer in row and row[peer]["available"] and fused["available"]:
            row[f"time_ratio_vs_{peer}"] = fused["median_ms"] / row[peer]["median_ms"]
            row[f"memory_ratio_vs_{peer}"] = fused["peak_extra_bytes"] / row[peer]["peak_extra_bytes"]
    if fused["available"]:
        row["peak_over_floor"] = fused["peak_extra_bytes"] / floor
    return row


def _print(row: dict[str, Any]) -> None:
    cells = []
    for name in _method_names([row]):
        m = row[name]
        cells.append(
            f"{name.split('.')[-1][:34]:>34} "
            + (f"{m['median_ms']:9.2f} ms {m['peak_extra_bytes'] / 2**20:9.1f} MiB" if m["available"] else f"{m['why']:>26}")
        )
    print(f"T={row['tokens']:>6} V={row['vocab']:>6}\n  " + "\n  ".join(cells), flush=True)


def _method_names(rows: list[dict[str, Any]]) -> list[str]:
    """The methods measured in ``rows``, in the order they ran."""
    return list(dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, dict) and "available" in v))


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['tokens'] // 1024}k×{r['vocab'] // 1024}k" for r in rows]
    for name in _method_names(rows):
        ms = [r[name]["median_ms"] if r.get(name, {}).get("available") else float("nan") for r in rows]
        mib = [r[name]["peak_extra_bytes"] / 2**20 if r.get(name, {}).get("available") else float("nan") for r in rows]
        axes[0].plot(labels, ms, marker="o", label=name)
        axes[1].plot(labels, mib, marker="o", label=name)
    axes[0].set_ylabel("forward + backward, median ms")
    axes[1].set_ylabel("peak extra memory, MiB")
    for ax in axes:
        ax.set_xlabel("tokens × vocabulary")
        ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=45)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"LM-head loss path, d={report['settings']['hidden']}, {report['settings']['dtype']}, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _kept_rows(path: Path, measured: set[tuple[int, int]]) -> list[dict[str, Any]]:
    """``--append``: the rows of the results file at ``path`` (none if it does not exist) whose
    ``(tokens, vocab)`` is not in ``measured``, each with the command that measured it."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    return [{"command": old["command"], **r} for r in old["rows"] if (r["tokens"], r["vocab"]) not in measured]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--vocabs", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-tokens", type=int, nargs="*", default=[], help="also time the fused loss at these chunk sizes")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(linear + cross_entropy)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats (smoke run)")
    p.add_argument("--out", type=Path, default=Path("perf/results"))
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of an existing results file whose (tokens, vocab) this run does not measure "
        "(each row records the command that measured it)",
    )
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.quick:
        args.tokens, args.vocabs, args.hidden, args.warmup, args.repeats = [256], [2048, 8192], 64, 1, 2
    args.tokens = args.tokens or ([4096, 16384] if cuda else [512, 2048])
    args.vocabs = args.vocabs or ([32768, 131072, 262144] if cuda else [8192, 32768])
    args.hidden = args.hidden or (4096 if cuda else 128)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    rows: list[dict[str, Any]] = []
    stem = f"fused_ce_{args.device}" + ("_quick" if args.quick else "")
    command = ["fused_ce.py", *(argv if argv is not None else sys.argv[1:])]
    kept = _kept_rows(args.out / f"{stem}.json", {(T, V) for T in args.tokens for V in args.vocabs}) if args.append else []
    report = {
        "benchmark": "fused_ce",
        "command": command,
        "machine": machine_info(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "memory_method": "CUDA max_memory_allocated above the start" if cuda else "torch.profiler allocation events (perf/tp.py)",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        with ParallelContext.from_world(tp=1) as ctx:
            rows.extend(kept)
            for T in args.tokens:
                for V in args.vocabs:
                    rows.append({**bench_shape(ctx, T, V, args), "command": command})
                    _print(rows[-1])
                    # after every shape: a run cut short keeps what it measured
                    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    finally:
        dist.destroy_process_group()
    _plot(report, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
