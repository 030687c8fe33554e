"""Blockwise attention kernels on CUDA vs ``F.scaled_dot_product_attention`` (flash): forward and forward + backward time.

For each sequence length ``S`` (default 1k, 4k, 16k) at ``B=1``, ``H=32`` query heads, ``Hkv=8``
key/value heads (GQA), ``D=128``, causal, bf16, in the same run:

* ``shardkit``: :func:`attention_block_forward` with ``backend="triton"`` (fp32 ``out`` and
  ``lse``, the contract ring attention needs), and forward + ``delta`` + :func:`attention_block_backward`
  (fp32 ``dq``, ``dk``, ``dv``), positions ``arange(S)`` for queries and keys;
* ``sdpa_flash``: ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`` under
  the flash backend (bf16 output), and forward + ``out.backward(dout)``. Where this torch's flash
  backend refuses ``enable_gqa``, k/v are repeated to ``H`` heads outside the timed region (the
  row's ``sdpa_gqa`` says which).

Time: CUDA-event time of one call after ``--warmup`` calls, min and median over ``--repeats``;
``ratio`` is shardkit's median over SDPA's (below 1: shardkit faster). TFLOP/s counts the
causal FLOPs ``4 B H S^2 D / 2`` forward and 2.5 times that backward (flash attention's
convention). The outputs are compared first (``max_abs_diff`` of ``out``, fp32 vs bf16).

``--sweep`` also times the Triton kernels at other tile configs ``BLOCK_MxBLOCK_N:warps:stages``
(forward, and the whole backward with one of its two kernels changed) at ``--sweep-seq``, for
D = 128 and 64, to choose the launcher's defaults (``_launch_config`` in
``shardkit.kernels.attention``); each config's outputs are checked against the default's.

    python perf/cuda/attention_kernels.py --out perf/results     # -> attention_kernels_cuda.json
    python perf/cuda/attention_kernels.py --seq 1024 --repeats 5 --sweep --out /tmp/attn
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SWEEP = {
    "fwd": ["128x64:8:3", "128x64:8:2", "128x64:8:4", "128x32:4:3", "64x64:4:3", "128x64:4:3", "128x128:8:2", "64x32:4:3"],
    "dkdv": [
        "32x64:4:3",
        "32x64:4:2",
        "32x64:4:4",
        "16x64:4:3",
        "64x64:4:3",
        "32x64:8:3",
        "32x128:8:3",
        "64x128:8:3",
        "16x128:8:3",
    ],
    "dq": ["64x32:4:3", "64x32:4:2", "64x32:4:4", "128x32:8:3", "128x64:8:3", "64x64:4:3", "32x64:4:3", "128x32:4:3"],
}


def _time(fn: Callable[[], Any], warmup: int, repeats: int) -> dict[str, float]:
    """Min and median CUDA-event time (ms) of ``fn`` over ``repeats`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"min_ms": min(times), "median_ms": statistics.median(times)}


def _inputs(s: int, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (args.batch, args.heads, s, args.head_dim), (args.batch, args.kv_heads, s, args.head_dim)
    q, k, v, dout = (
        torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for shape in (shape_q, shape_kv, shape_kv, shape_q)
    )
    return q, k, v, dout, torch.arange(s, device="cuda")


def _shardkit(q, k, v, dout, pos, causal: bool) -> tuple[Callable[[], Any], Callable[[], Any]]:
    from shardkit.kernels.attention import attention_block_backward, attention_block_forward

    def fwd():
        return attention_block_forward(q, k, v, pos, pos, causal=causal, backend="triton")

    def fwd_bwd():
        out, lse = fwd()
        delta = (dout.float() * out).sum(-1)
        return attention_block_backward(dout, q, k, v, lse, delta, pos, pos, causal=causal, backend="triton")

    return fwd, fwd_bwd


def _sdpa(q, k, v, dout, causal: bool) -> tuple[Callable[[], Any], Callable[[], Any], str]:
    """Flash-backend SDPA closures, with native GQA when this torch's flash kernel takes it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    kw: dict[str, Any] = dict(is_causal=causal, enable_gqa=True)
    gqa = "enable_gqa"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, **kw)
    except RuntimeError:
        k, v, kw, gqa = (
            k.repeat_interleave(group, 1),
            v.repeat_interleave(group, 1),
            dict(is_causal=causal),
            "repeat_interleave (untimed)",
        )
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, **kw)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qg, kg, vg, **kw)
        out.backward(dout)
        qg.grad = kg.grad = vg.grad = None
        return out

    return fwd, fwd_bwd, gqa


def _flops(s: int, args: argparse.Namespace) -> float:
    full = 4.0 * args.batch * args.heads * s * s * args.head_dim
    return full / 2 if args.causal else full


def bench_seq(s: int, args: argparse.Namespace) -> dict[str, Any]:
    """One row: both methods' forward and forward + backward at sequence length ``s``."""
    q, k, v, dout, pos = _inputs(s, args)
    ours_fwd, ours_fwd_bwd = _shardkit(q, k, v, dout, pos, args.causal)
    sdpa_fwd, sdpa_fwd_bwd, gqa = _sdpa(q, k, v, dout, args.causal)
    diff = (ours_fwd()[0] - sdpa_fwd().float()).abs().max().item()
    assert diff < 5e-2, f"shardkit and SDPA outputs differ by {diff} at S={s}"
    row: dict[str, Any] = {"seq": s, "max_abs_diff_out": diff, "sdpa_gqa": gqa}
    flops = _flops(s, args)
    for phase, ours, theirs, phase_flops in (
        ("fwd", ours_fwd, sdpa_fwd, flops),
        ("fwd_bwd", ours_fwd_bwd, sdpa_fwd_bwd, 3.5 * flops),
    ):
        result = {}
        for label, fn in (("shardkit", ours), ("sdpa_flash", theirs)):
            t = _time(fn, args.warmup, args.repeats)
            result[label] = {**t, "tflops_at_median": phase_flops / (t["median_ms"] * 1e-3) / 1e12}
        result["ratio"] = result["shardkit"]["median_ms"] / result["sdpa_flash"]["median_ms"]
        row[phase] = result
    del q, k, v, dout
    torch.cuda.empty_cache()
    return row


def _parse_tiles(text: str) -> tuple[int, int, int, int]:
    blocks, warps, stages = text.split(":")
    block_m, block_n = blocks.split("x")
    return int(block_m), int(block_n), int(warps), int(stages)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward / backward time at each tile config of :data:`SWEEP`, one kernel changed at a time."""
    rows: list[dict[str, Any]] = []
    for d in (128, 64):
        rows += _sweep_head_dim(argparse.Namespace(**{**vars(args), "head_dim": d}))
        torch.cuda.empty_cache()
    return rows


def _sweep_head_dim(args: argparse.Namespace) -> list[dict[str, Any]]:
    from shardkit.kernels import attention

    default = attention._launch_config
    d = args.head_dim
    q, k, v, dout, pos = _inputs(args.sweep_seq, args)
    fwd, _ = _shardkit(q, k, v, dout, pos, args.causal)
    out, lse = fwd()
    delta = (dout.float() * out).sum(-1)

    def bwd():
        return attention.attention_block_backward(dout, q, k, v, lse, delta, pos, pos, causal=args.causal, backend="triton")

    expect = {"fwd": (out, lse), "bwd": bwd()}
    rows = []
    for kind, configs in SWEEP.items():
        fn = fwd if kind == "fwd" else bwd
        for text in configs:
            tiles = attention._Tiles(*_parse_tiles(text), scan=default(kind, q.device, d, q.dtype).scan)

            def patched(name, device, head_dim, dtype, kind=kind, tiles=tiles):
                return tiles if name == kind else default(name, device, head_dim, dtype)

            attention._launch_config = patched
            try:
                got = fn()
                err = max((a - b).abs().max().item() for a, b in zip(got, expect["fwd" if kind == "fwd" else "bwd"]))
                row = {
                    "head_dim": d,
                    "kernel": kind,
                    "tiles": text,
                    "max_abs_diff_vs_default": err,
                    **_time(fn, args.warmup, args.repeats),
                }
            except Exception as e:  # a config that does not fit (shared memory) is a result too
                row = {"head_dim": d, "kernel": kind, "tiles": text, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            finally:
                attention._launch_config = default
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time other tile configs (see SWEEP)")
    p.add_argument("--sweep-seq", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path("perf/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "benchmark": "attention_kernels",
        "command": ["perf/cuda/attention_kernels.py", *(argv if argv is not None else sys.argv[1:])],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "timing": "CUDA events around one call, after warm-up; min and median over repeats",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attention_kernels_cuda.json"
    for s in args.seq:
        rows.append(bench_seq(s, args))
        r = rows[-1]
        print(
            f"S={s:>6}  fwd {r['fwd']['shardkit']['median_ms']:8.3f} ms vs sdpa {r['fwd']['sdpa_flash']['median_ms']:8.3f} ms"
            f" (x{r['fwd']['ratio']:.2f})  fwd+bwd {r['fwd_bwd']['shardkit']['median_ms']:8.3f} ms vs sdpa"
            f" {r['fwd_bwd']['sdpa_flash']['median_ms']:8.3f} ms (x{r['fwd_bwd']['ratio']:.2f})",
            flush=True,
        )
        path.write_text(json.dumps(report, indent=2) + "\n")  # a run cut short keeps what it measured
    if args.sweep:
        report["sweep"] = sweep(args)
        path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
