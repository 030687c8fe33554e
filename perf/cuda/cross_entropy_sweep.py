"""Cross-entropy kernels on CUDA vs torch: time and peak memory of one forward + backward.

For each ``(tokens T, vocabulary V)`` in bf16: shardkit's two kernel passes as
``vocab_parallel_cross_entropy`` runs them at tp = 1 (``ce_shard_stats``, the log-sum-exp and
the mean loss, then ``ce_grad`` into a new buffer: what autograd gets) against
``F.cross_entropy`` forward + backward on the same logits, once upcast to fp32 (the reference
our loss equals) and once on the bf16 logits directly. Minimum bytes moved: the logits read
twice and the gradient written once (3·T·V·2 bytes); GB/s and % of the HBM peak are computed
from that. Medians of CUDA-event timings (``triton.testing.do_bench``); peak memory is the
allocator's peak during one call above what was allocated before it. The losses are checked
against each other first.

    python perf/cuda/cross_entropy_sweep.py --out perf/results/cross_entropy_cuda.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    from shardkit.kernels.cross_entropy import ce_grad, ce_shard_stats

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--vocabs", type=int, nargs="+", default=[32768, 128256])
    p.add_argument("--out", type=Path, default=Path("perf/results/cross_entropy_cuda.json"))
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BYTES_PER_S.items() if k in name), None)
    rows = []
    for T in args.tokens:
        for V in args.vocabs:
            g = torch.Generator(device=dev).manual_seed(0)
            x = (3 * torch.randn(T, V, device=dev, generator=g)).to(torch.bfloat16)
            t = torch.randint(V, (T,), device=dev, generator=g)
            t[::9] = -100

            def ours() -> torch.Tensor:
                s = ce_shard_stats(x, t, backend="triton")
                lse = s[0] + torch.log(s[1])
                keep = t != -100
                n = keep.sum().clamp_min(1)
                loss = torch.where(keep, lse - s[2], 0.0).sum() / n
                coef = (1.0 / n).expand(T).float().contiguous()
                ce_grad(x, t, lse, coef, vocab_size=V, backend="triton")
                return loss

            def torch_fp32() -> torch.Tensor:
                xr = x.detach().requires_grad_()
                loss = F.cross_entropy(xr.float(), t)
                loss.backward()
                return loss

            def torch_bf16() -> torch.Tensor:
                xr = x.detach().requires_grad_()
                loss = F.cross_entropy(xr, t)
                loss.backward()
                return loss

            ref = float(torch_fp32().detach())
            got = float(ours().detach())
            assert abs(got - ref) <= 1e-4 * abs(ref), (got, ref)
            row = {"tokens": T, "vocab": V, "dtype": "bf16", "loss": got}
            for label, fn in (("shardkit", ours), ("torch_fp32_upcast", torch_fp32), ("torch_bf16", torch_bf16)):
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                fn()
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated() - before
                floor = 3 * T * V * 2
                row[label] = {
                    "median_ms": ms,
                    "peak_extra_bytes": extra,
                    "gbps_at_floor_bytes": floor / ms / 1e6,
                    "pct_of_peak": None if peak is None else 100 * floor / (ms * 1e-3) / peak,
                }
            row["ratio_vs_torch_fp32"] = row["shardkit"]["median_ms"] / row["torch_fp32_upcast"]["median_ms"]
            row["ratio_vs_torch_bf16"] = row["shardkit"]["median_ms"] / row["torch_bf16"]["median_ms"]
            rows.append(row)
            print(
                f"T={T:>6} V={V:>6}  shardkit {row['shardkit']['median_ms']:7.3f} ms "
                f"({row['shardkit']['gbps_at_floor_bytes']:6.0f} GB/s, +{row['shardkit']['peak_extra_bytes'] / 2**20:7.1f} MiB)"
                f"  torch fp32 {row['torch_fp32_upcast']['median_ms']:7.3f} ms (+{row['torch_fp32_upcast']['peak_extra_bytes'] / 2**20:7.1f} MiB)"
                f"  torch bf16 {row['torch_bf16']['median_ms']:7.3f} ms (+{row['torch_bf16']['peak_extra_bytes'] / 2**20:7.1f} MiB)",
                flush=True,
            )
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "torch": torch.__version__, "command": "perf/cuda/cross_entropy_sweep.py", "rows": rows}
    args.out.write_text(json.dumps(meta, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
