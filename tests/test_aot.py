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

from shardkit.kernels.aot import all_configs, compile_config, kernel_resources, ptx_global_accesses

TARGETS = (80, 90)
CONFIGS = all_configs()
CASES = [
    pytest.param(cfg, cc, id=f"{cfg['module'].rsplit('.', 1)[-1]}.{cfg['name']}-sm{cc}")
    for cfg in CONFIGS
    for cc in TARGETS
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


@pytest.mark.parametrize("cc", TARGETS)
def test_aligned_fp32_adamw_uses_128bit_accesses(cc: int) -> None:
    cfg = _cfg("shardkit.kernels.adam", "adamw_fp32")
    res = resources(cfg, cc)
    threads = cfg["num_warps"] * 32
    # fp32 AdamW reads p, g, m, v and writes p, m, v (shared/REFERENCE.md: 28 B/param). Every
    # thread moves 16 B per 128-bit access, so a BLOCK of elements needs this many of each:
    read_bytes, write_bytes = 4 * 4, 3 * 4
    assert read_bytes + write_bytes == cfg["bytes_per_element"]
    expect_ld = read_bytes * cfg["elements_per_program"] // (16 * threads)
    expect_st = write_bytes * cfg["elements_per_program"] // (16 * threads)
    assert res["global_loads"].get("ld.global.v4.b32") == expect_ld  # 8 at BLOCK=1024, 4 warps
    assert res["global_stores"] == {"st.global.v4.b32": expect_st}  # 6: no scalar data stores
    # The only non-vector loads are the per-program launch-table reads (uniform, 32/64-bit).
    scalar = {k: n for k, n in res["global_loads"].items() if k != "ld.global.v4.b32"}
    assert set(scalar) <= {"ld.global.b32", "ld.global.b64"}
    assert res["vec128_bytes_per_element"] == cfg["bytes_per_element"]


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
        "AOT_CONFIGS = lambda: [dict(kernel=None, name='newop_fp32', signature={'x_ptr': '*fp32'},\n"
        "    constexprs={'BLOCK': 1024}, num_warps=4, pointer_args=['x_ptr'],\n"
        "    elements_per_program=1024, bytes_per_element=8)]\n"
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
