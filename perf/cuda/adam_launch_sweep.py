"""Adam kernel on CUDA: kernel time per launch config, and the launcher's host cost, one run.

Separates the two parts of a ``FusedAdamW`` step on a GPU: the Triton kernel itself (tables
built once, launched directly: ``kernel``) and the whole :func:`adam_step` call as an optimizer
makes it each step (pointer table, alignment check, launch: ``call``), for each ``(BLOCK,
num_warps)`` in the grid, over the GPT-like tensor set of `perf/optim.py`'s `model_shapes`
and over one flat tensor of the same size. Bandwidth counts 28 bytes per fp32 parameter (read
p, g, m, v; write p, m, v). Medians of CUDA-event timings (``triton.testing.do_bench``).

    python perf/cuda/adam_launch_sweep.py --sizes 10M 100M --out perf/results/adam_sweep_cuda.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # perf/: the benchmark modules
    from optim import model_shapes
    from shardkit.kernels import adam as adam_mod
    from shardkit.kernels.runtime import live_multi_tensor_table, torch_to_triton_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=_size, nargs="+", default=[10_000_000, 100_000_000])
    p.add_argument("--configs", nargs="+", default=["1024x4", "2048x4", "2048x8", "4096x4", "4096x8", "8192x8"])
    p.add_argument("--out", type=Path, default=Path("perf/results/adam_sweep_cuda.json"))
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for total in args.sizes:
        for layout in ("gpt", "flat"):
            shapes = model_shapes(total) if layout == "gpt" else [(total,)]
            params = [torch.randn(s, device=dev) for s in shapes]
            grads = [torch.randn(s, device=dev) for s in shapes]
            ms = [torch.zeros_like(t) for t in params]
            vs = [torch.zeros_like(t) for t in params]
            gbytes = 28 * total / 1e9
            for cfg in args.configs:
                block, warps = (int(x) for x in cfg.split("x"))
                table, _, _ = live_multi_tensor_table([params, grads, ms, vs], lambda d, n: (block, warps))

                def kernel() -> None:
                    adam_mod._ADAM[(table.n_chunks,)](
                        table.ptrs,
                        table.numels,
                        table.chunk_tensor,
                        table.chunk_index,
                        table.n_tensors,
                        table.numels,
                        1e-3,
                        0.9,
                        0.999,
                        1e-8,
                        0.01,
                        1e-3 / 0.1,
                        0.001**0.5,
                        P_DTYPE=torch_to_triton_dtype(torch.float32),
                        G_DTYPE=torch_to_triton_dtype(torch.float32),
                        S_DTYPE=torch_to_triton_dtype(torch.float32),
                        DECOUPLED=True,
                        AMSGRAD=False,
                        MAXIMIZE=False,
                        HAS_MASTER=False,
                        MASTER_ROW=4,
                        HAS_GRAD_SCALE=False,
                        ALIGNED=table.aligned,
                        BLOCK=block,
                        num_warps=warps,
                    )

                saved = adam_mod.adam_launch_config
                adam_mod.adam_launch_config = lambda d, n: (block, warps)
                try:

                    def call() -> None:
                        adam_mod.adam_step(
                            params,
                            grads,
                            ms,
                            vs,
                            [],
                            [],
                            step=1,
                            lr=1e-3,
                            beta1=0.9,
                            beta2=0.999,
                            eps=1e-8,
                            weight_decay=0.01,
                            decoupled=True,
                            amsgrad=False,
                            maximize=False,
                            backend="triton",
                        )

                    t_kernel = triton.testing.do_bench(kernel, warmup=25, rep=200, return_mode="median")
                    t_call = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
                finally:
                    adam_mod.adam_launch_config = saved
                row = dict(
                    params=total,
                    layout=layout,
                    tensors=len(shapes),
                    block=block,
                    num_warps=warps,
                    kernel_ms=t_kernel,
                    call_ms=t_call,
                    kernel_gbps=gbytes / t_kernel * 1e3,
                    call_gbps=gbytes / t_call * 1e3,
                )
                rows.append(row)
                print(
                    f"{total:>11} {layout:>4} {cfg:>7}  kernel {t_kernel:7.3f} ms {row['kernel_gbps']:7.0f} GB/s"
                    f"   call {t_call:7.3f} ms {row['call_gbps']:7.0f} GB/s",
                    flush=True,
                )
            torch.cuda.empty_cache()
    # torch's fused AdamW on the same GPT-like set, the baseline of perf/optim.py
    for total in args.sizes:
        shapes = model_shapes(total)
        ps = [torch.randn(s, device=dev) for s in shapes]
        gs = [torch.randn(s, device=dev) for s in shapes]
        ms = [torch.zeros_like(t) for t in ps]
        vs = [torch.zeros_like(t) for t in ps]
        step = [torch.tensor(1.0, device=dev) for _ in ps]
        t = triton.testing.do_bench(
            lambda: torch._fused_adamw_(
                ps,
                gs,
                ms,
                vs,
                [],
                step,
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.01,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
            ),
            warmup=25,
            rep=200,
            return_mode="median",
        )
        rows.append(dict(params=total, layout="gpt", peer="torch._fused_adamw_", call_ms=t, call_gbps=28 * total / t / 1e6))
        print(f"{total:>11}  gpt torch._fused_adamw_  call {t:7.3f} ms {28 * total / t / 1e6:7.0f} GB/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
