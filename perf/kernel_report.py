"""Per-kernel resource report from an ahead-of-time compile (no GPU needed).

For every ``AOT_CONFIGS`` entry of every ``shardkit.kernels`` module and every target, prints
registers, spills, shared memory, the count and width of global loads/stores, and bytes moved
per element (the config's formula, next to the bytes covered by 128-bit accesses), and writes
them to ``perf/results/kernel_report.json``. See :mod:`shardkit.kernels.aot` for where each
number comes from.

It also compiles AdamW for a GPT-2-shaped parameter list (``param_list`` rows): the ``ALIGNED``
flag the launcher derives from real tensors of those shapes, the share of elements in full
(vectorized) chunks, and the accesses that config compiles to — so a launch group holding a
50257-element bias or a scalar visibly keeps its 128-bit accesses.

Usage:
    .venv/bin/python perf/kernel_report.py                 # sm_80 and sm_90
    .venv/bin/python perf/kernel_report.py --targets 90 --out /tmp/report.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kernel_report.json"


def gpt2_param_shapes(n_layer: int = 12, d_model: int = 768, vocab: int = 50257, n_ctx: int = 1024) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes (``model.parameters()`` order, tied embeddings), plus an
    untied output bias of the vocabulary size and a scalar: the odd sizes real models add.

    Example:
        >>> len(gpt2_param_shapes()), gpt2_param_shapes()[-2:]
        (150, [(50257,), ()])
    """
    block = [
        (d_model,),
        (d_model,),  # ln_1
        (d_model, 3 * d_model),
        (3 * d_model,),
        (d_model, d_model),
        (d_model,),  # attn c_attn, c_proj
        (d_model,),
        (d_model,),  # ln_2
        (d_model, 4 * d_model),
        (4 * d_model,),
        (4 * d_model, d_model),
        (d_model,),  # mlp c_fc, c_proj
    ]
    return [(vocab, d_model), (n_ctx, d_model), *block * n_layer, (d_model,), (d_model,), (vocab,), ()]


def param_list_config() -> dict[str, Any]:
    """The ``adamw_fp32`` AOT config with ``ALIGNED`` as the launcher sets it for GPT-2's params.

    The tensors are allocated (never touched: ~500 MB of address space, no memory use) so that
    :func:`shardkit.kernels.runtime.multi_tensor_table` judges real addresses and sizes.
    """
    import torch

    from shardkit.kernels.adam import AOT_CONFIGS, adam_launch_config
    from shardkit.kernels.runtime import multi_tensor_table

    params = [torch.empty(shape) for shape in gpt2_param_shapes()]
    block, _ = adam_launch_config(torch.device("cuda"), 1 << 20)
    table = multi_tensor_table([params], block)
    base = next(c for c in AOT_CONFIGS() if c["name"] == "adamw_fp32")
    numels = [p.numel() for p in params]
    info = {
        "name": "gpt2-small params + 50257 bias + scalar",
        "tensors": len(params),
        "elements": sum(numels),
        "odd_tensors": sum(n % 16 != 0 for n in numels),
        "aligned": table.aligned,
        # the rule before the full/tail split: every size a multiple of 16 as well
        "aligned_by_numel_rule": table.aligned and all(n % 16 == 0 for n in numels),
        "full_chunk_fraction": sum(n // block * block for n in numels) / sum(numels),
    }
    constexprs = dict(base["constexprs"], ALIGNED=table.aligned)
    return {
        **base,
        "name": "adamw_fp32_gpt2_params",
        "constexprs": constexprs,
        "param_list": info,
        "module": "shardkit.kernels.adam",
    }


def param_list_row(cc: int) -> dict[str, Any]:
    """:func:`~shardkit.kernels.aot.kernel_resources` of :func:`param_list_config` for ``sm_<cc>``."""
    from shardkit.kernels.aot import compile_config, kernel_resources

    cfg = param_list_config()
    return {**kernel_resources(compile_config(cfg, cc), cfg), "param_list": cfg["param_list"]}


def build_report(targets: list[int]) -> dict[str, Any]:
    """Compile every discovered kernel config for each target and collect its resources.

    Args:
        targets: compute capabilities, e.g. ``[80, 90]``.

    Returns:
        ``{"meta": {...}, "rows": [kernel_resources(...) per config and target]}``; a config that
        fails to compile gets a row with an ``"error"`` instead.

    Example:
        >>> report = build_report([90])
        >>> report["rows"][0]["target"]
        'sm_90'
    """
    import triton
    import torch

    from shardkit.kernels.aot import all_configs, compile_config, kernel_resources

    rows: list[dict[str, Any]] = []
    for cc in targets:
        for cfg in all_configs():
            try:
                rows.append(kernel_resources(compile_config(cfg, cc), cfg))
            except Exception as exc:  # one broken kernel must not hide the others' numbers
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                rows.append({"module": cfg["module"], "name": cfg["name"], "target": f"sm_{cc}", "error": error})
        rows.append(param_list_row(cc))
    meta = {
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "targets": [f"sm_{cc}" for cc in targets],
        "fp_fusion": True,
        "notes": "static PTX access counts per thread (both the full-chunk and the tail-chunk path); "
        "registers/shared from cuobjdump on the cubin, spills from ptxas -v; vec128_bytes_per_element = "
        "bytes/element moved by 128-bit ld/st on the full-chunk path; ptx_instructions = static count; "
        "param_list rows: AdamW for a GPT-2-shaped parameter list (see perf/kernel_report.py)",
    }
    return {"meta": meta, "rows": rows}


def _accesses(counts: dict[str, int]) -> str:
    return " ".join(f"{n}x{k.split('.', 2)[2]}" for k, n in counts.items()) or "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of :func:`build_report` rows.

    Example:
        >>> print(format_table(build_report([90])["rows"]))  # doctest: +SKIP
    """
    names = [f"{r['module'].rsplit('.', 1)[-1]}.{r['name']}" for r in rows]
    w = max([13, *map(len, names)])
    head = (
        f"{'kernel config':<{w}} {'target':<6} {'warps':>5} {'regs':>4} {'spill st/ld':>11} {'smem':>6} "
        f"{'B/elem':>6} {'vec128 B/elem':>13} {'ptx ins':>7}  global loads | stores | atomics"
    )
    lines = [head, "-" * len(head)]
    for name, r in zip(names, rows):
        if "error" in r:
            lines.append(f"{name:<{w}} {r['target']:<6} COMPILE ERROR: {r['error']}")
            continue
        lines.append(
            f"{name:<{w}} {r['target']:<6} {r['num_warps']:>5} {r['registers']:>4} "
            f"{r['spill_stores_bytes']:>5}/{r['spill_loads_bytes']:<5} {r['shared_mem_bytes']:>6} "
            f"{r['bytes_per_element']:>6} {r['vec128_bytes_per_element']:>13g} {r['ptx_instructions']:>7}  "
            f"{_accesses(r['global_loads'])} | {_accesses(r['global_stores'])} | {_accesses(r['global_atomics'])}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build, print and write the report. Returns an exit code: 1 if any config fails or spills.

    Example:
        >>> main(["--targets", "80", "90"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    report = build_report(args.targets)
    print(format_table(report["rows"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    bad = [r for r in report["rows"] if "error" in r or r["spill_stores_bytes"] or r["spill_loads_bytes"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
