"""Ahead-of-time compile checks: every kernel config builds for sm_80/sm_90 with no GPU.

Configs are discovered from the ``AOT_CONFIGS`` of every ``shardkit.kernels`` module, so a new
kernel module is covered here without editing this file. Compiles are cached in-process by
:func:`shardkit.kernels.aot.compile_config` (and on disk by Triton), so each config x target is
compiled once per session (~0.1-0.7 s each).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import triton.language as tl

from shardkit.kernels.aot import (
    all_configs,
    compile_config,
    kernel_resources,
    kernel_signature,
    ptx_global_accesses,
)
from shardkit.kernels.runtime import triton_kernel
from shardkit.kernels.tl_helpers import round_to

TARGETS = (80, 90)
CONFIGS = all_configs()
CASES = [
    pytest.param(cfg, cc, id=f"{cfg['module'].rsplit('.', 1)[-1]}.{cfg['name']}-sm{cc}") for cfg in CONFIGS for cc in TARGETS
]

_RESOURCES: dict[tuple[str, str, int], dict] = {}


def resources(cfg: dict, cc: int) -> dict:
    key = (cfg["module"], cfg["name"], cc)
    if key not in _RESOURCES:
        _RESOURCES[key] = kernel_resources(compile_config(cfg, cc), cfg)
    return _RESOURCES[key]


def _cfg(module: str, name: str) -> dict:
    return next(c for c in CONFIGS if c["module"] == module and c["name"] == name)


def test_discovers_adam_configs() -> None:
    names = {(c["module"], c["name"]) for c in CONFIGS}
    assert ("shardkit.kernels.adam", "adamw_fp32") in names
    assert ("shardkit.kernels.adam", "adamw_bf16_master") in names


@pytest.mark.parametrize("cfg, cc", CASES)
def test_config_compiles_without_spills(cfg: dict, cc: int) -> None:
    res = resources(cfg, cc)
    assert f".target sm_{cc}" in compile_config(cfg, cc).asm["ptx"]
    assert res["target"] == f"sm_{cc}" and res["num_warps"] == cfg["num_warps"]
    assert 0 < res["registers"] <= 255
    assert res["ptxas_matches_cubin"], "re-run ptxas disagrees with the cubin: Triton's ptxas flags changed?"
    # Memory-bound kernels at their default launch config must not spill; a kernel that
    # legitimately does declares expect_no_spills=False in its AOT config.
    if cfg.get("expect_no_spills", True):
        assert (res["spill_stores_bytes"], res["spill_loads_bytes"], res["local_bytes"]) == (0, 0, 0), res
    assert any(res[k] for k in ("global_loads", "global_stores", "global_atomics")), "no global memory access?"


def _expect_vectorized(cfg: dict, res: dict, read_bytes: int, write_bytes: int, tail: dict) -> None:
    """Full chunks: every data access 128-bit; the tail chunk's scalar accesses are ``tail``."""
    threads = cfg["num_warps"] * 32
    assert read_bytes + write_bytes == cfg["bytes_per_element"]
    # Every thread moves 16 B per 128-bit access, so a BLOCK of elements needs this many of each:
    expect_ld = read_bytes * cfg["elements_per_program"] // (16 * threads)
    expect_st = write_bytes * cfg["elements_per_program"] // (16 * threads)
    assert res["global_loads"].get("ld.global.v4.b32") == expect_ld
    assert res["global_stores"].get("st.global.v4.b32") == expect_st
    assert res["vec128_bytes_per_element"] == cfg["bytes_per_element"]
    # The masked tail chunk (one per tensor, [Note: aligned full chunks]) is scalar, one access
    # per element per tensor; the rest are the per-program launch-table reads (32/64-bit).
    scalar = {k: n for k, n in {**res["global_loads"], **res["global_stores"]}.items() if "v4" not in k}
    assert scalar == tail, scalar


@pytest.mark.parametrize("cc", TARGETS)
def test_aligned_fp32_adamw_uses_128bit_accesses(cc: int) -> None:
    cfg = _cfg("shardkit.kernels.adam", "adamw_fp32")
    per_thread = cfg["elements_per_program"] // (cfg["num_warps"] * 32)  # 8 at BLOCK=1024, 4 warps
    # fp32 AdamW reads p, g, m, v and writes p, m, v (docs/reference.md, "Optimizer bytes per
    # parameter": 28 B/param). Table reads: chunk tensor/index (b32), numel + 4 pointers (b64).
    tail = {"ld.global.b32": 4 * per_thread + 2, "ld.global.b64": 5, "st.global.b32": 3 * per_thread}
    _expect_vectorized(cfg, resources(cfg, cc), 4 * 4, 3 * 4, tail)


@pytest.mark.parametrize("cc", TARGETS)
def test_gpt2_parameter_list_keeps_128bit_accesses(cc: int) -> None:
    """A GPT-2-shaped launch group with odd sizes (a 50257 bias, a scalar) stays vectorized.

    Before the full/tail split, one tensor with numel % 16 != 0 made ALIGNED False for the whole
    launch group: every access scalar. Now ALIGNED depends only on the pointers, and the odd
    tensors pay scalar accesses in their last chunk only.
    """
    report = _kernel_report()
    row = report.param_list_row(cc)
    info = row["param_list"]
    assert info["aligned"] and not info["aligned_by_numel_rule"], info
    assert info["full_chunk_fraction"] > 0.999, info
    cfg = report.param_list_config()
    assert cfg["constexprs"]["ALIGNED"] is True
    per_thread = cfg["elements_per_program"] // (cfg["num_warps"] * 32)
    tail = {"ld.global.b32": 4 * per_thread + 2, "ld.global.b64": 5, "st.global.b32": 3 * per_thread}
    _expect_vectorized(cfg, row, 4 * 4, 3 * 4, tail)


def _kernel_report():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "perf" / "kernel_report.py"
    spec = importlib.util.spec_from_file_location("kernel_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _round_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, round_to(tl.load(x_ptr + offs), tl.bfloat16))


def _cast_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


def test_rne_rounding_costs_few_instructions() -> None:
    """round_to's bit-level fp32 -> bf16 rounding vs the native cvt.rn: a few integer ops each."""
    counts = {}
    for fn in (_round_kernel, _cast_kernel):
        cfg = dict(
            kernel=triton_kernel(fn),
            name=fn.__name__,
            constexprs={"BLOCK": 1024},
            num_warps=4,
            pointers={"x_ptr": "*fp32", "y_ptr": "*bf16"},
            elements_per_program=1024,
            bytes_per_element=6,
        )
        res = kernel_resources(compile_config(cfg, 90), cfg)
        assert res["global_loads"] == {"ld.global.v4.b32": 2} and res["global_stores"] == {"st.global.v4.b32": 1}
        counts[fn.__name__] = res["ptx_instructions"]
    # 8 elements per thread. Measured 8 per element at sm_90 (shr, bfe, 2 add, shr, or, setp.nan,
    # selp; ptxas fuses some into IADD3/LOP3): noise next to a memory-bound kernel's 16+ bytes.
    extra_per_element = (counts["_round_kernel"] - counts["_cast_kernel"]) / 8
    assert 0 < extra_per_element <= 8, counts


def test_ptx_access_parser() -> None:
    ptx = textwrap.dedent(
        """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.nc.L1::evict_last.v2.b16 { %h1, %h2 }, [ %rd2 + 0 ];
        ld.global.b64 { %rd3 }, [ %rd4 + 0 ];
        @!%p2 st.global.b32 [ %rd5 + 0 ], { %r5 };
        atom.global.gpu.acq_rel.add.f32 %f1, [ %rd6 + 0 ], %f2;
        ld.shared.b32 %r6, [ %r7 ];
        """
    )
    assert ptx_global_accesses(ptx) == {
        "global_loads": {"ld.global.b64": 1, "ld.global.v2.b16": 1, "ld.global.v4.b32": 1},
        "global_stores": {"st.global.b32": 1},
        "global_atomics": {"atom.global.add.f32": 1},
    }


def test_discovery_covers_new_modules_and_validates(tmp_path, monkeypatch) -> None:
    """A module added to the package is picked up with no change to aot.py."""
    pkg = tmp_path / "scratch_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "no_configs.py").write_text("X = 1\n")
    (pkg / "newop.py").write_text(
        "def _k(x_ptr, BLOCK): pass\n"
        "AOT_CONFIGS = lambda: [dict(kernel=None, name='newop_fp32', pointers={'x_ptr': '*fp32'},\n"
        "    constexprs={'BLOCK': 1024}, num_warps=4, elements_per_program=1024, bytes_per_element=8)]\n"
    )
    (pkg / "listed.py").write_text("AOT_CONFIGS = [dict(name='a', kernel=None)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"listed\.AOT_CONFIGS\[0\] lacks key"):
        all_configs("scratch_kernels")
    (pkg / "listed.py").unlink()
    for mod in [m for m in sys.modules if m.startswith("scratch_kernels")]:
        monkeypatch.delitem(sys.modules, mod)
    found = all_configs("scratch_kernels")
    assert [(c["module"], c["name"]) for c in found] == [("scratch_kernels.newop", "newop_fp32")]


def test_signature_is_derived_from_the_kernel() -> None:
    """Scalars by annotation, *_ptr by the config's pointers or the launch tables, constexprs."""

    def _k(ptrs_ptr, out_ptr, n: tl.int32, alpha: tl.float32, BLOCK: tl.constexpr):
        pass

    sig = kernel_signature(_k, {"BLOCK": 1024}, {"out_ptr": "*bf16"})
    assert sig == {"ptrs_ptr": "*i64", "out_ptr": "*bf16", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"}
    with pytest.raises(ValueError, match="out_ptr needs a type"):
        kernel_signature(_k, {"BLOCK": 1024})
    with pytest.raises(ValueError, match="constexpr BLOCK has no value"):
        kernel_signature(_k, {}, {"out_ptr": "*bf16"})
    with pytest.raises(ValueError, match="not constexpr / pointer"):
        kernel_signature(_k, {"BLOCK": 1, "n": 3}, {"out_ptr": "*bf16"})

    def _unannotated(x_ptr, n):
        pass

    with pytest.raises(ValueError, match="annotate scalar parameter n"):
        kernel_signature(_unannotated, {}, {"x_ptr": "*fp32"})
