"""Ahead-of-time (AOT) compile of shardkit's Triton kernels for a GPU target, without a GPU.

Every kernel module may declare ``AOT_CONFIGS``: a list of config dicts, or a zero-argument
callable returning one (so building it does no work at import). A config has the keys

* ``kernel`` — the :class:`~shardkit.kernels.runtime.TritonKernel` (its ``.jit`` is compiled);
* ``name`` — unique within the module, e.g. ``"adamw_fp32"``;
* ``constexprs`` — ``{ARG: value}`` for every ``tl.constexpr`` argument;
* ``num_warps`` — the launcher's default;
* ``elements_per_program`` — elements one program instance handles (the kernel's ``BLOCK``);
* ``bytes_per_element`` — bytes moved per element by one launch, from the kernel's formula
  (e.g. 28 for fp32 AdamW: read p, g, m, v + write p, m, v; see ``docs/reference.md``,
  "Optimizer bytes per parameter");
* optional ``pointers`` — ``{arg: "*fp32" | "*bf16" | ...}`` for pointer arguments other than the
  multi-tensor table's (:data:`TABLE_POINTERS`);
* optional ``pointer_args`` — pointer arguments the launcher guarantees 16-byte aligned (they get
  the ``tt.divisibility=16`` hint a real launch would infer); default: every pointer argument;
* optional ``signature`` — the full ``{arg: type}`` of the runtime arguments, replacing the
  derived one (for kernels outside these conventions);
* optional ``expect_no_spills`` (default True) — tests assert zero spills unless False;
* optional ``report`` (default True) — False keeps a config out of ``perf/kernel_report.py``'s
  default table (e.g. test-only variants).

[Note: AOT signatures]
The runtime signature is derived from the kernel's own parameters (:func:`kernel_signature`),
never restated per config: ``tl.constexpr`` parameters take their values from ``constexprs``;
parameters named ``*_ptr`` are pointers, typed by the config's ``pointers`` or, for the launch
tables every multi-tensor kernel shares, by :data:`TABLE_POINTERS`; every other parameter is
annotated in the kernel (``n_tensors: tl.int32``, ``lr: tl.float32``), which also tells the
runtime JIT its type.

:func:`all_configs` discovers them by iterating the modules of the ``shardkit.kernels`` package
(``pkgutil``), so a new kernel module is covered by the AOT tests and ``perf/kernel_report.py``
with no change here. :func:`compile_config` compiles one for ``sm_<cc>``; :func:`kernel_resources`
reads what the hardware will see: registers, spills, shared memory, and the count and width of
global loads/stores (e.g. 128-bit ``ld.global.v4.b32`` means vectorized).

[Note: where the resource numbers come from]
``CompiledKernel.n_regs``/``n_spills`` need a CUDA driver (they are filled when the cubin is
loaded), so they are unavailable here. Instead:

* registers, stack, local and static shared memory: Triton's bundled
  ``cuobjdump --dump-resource-usage`` on the compiled cubin (the exact binary a launch would
  load; ~5 ms, independent of Triton's on-disk cache);
* spill stores/loads (bytes): the ``ptxas -v`` log. Triton prints it only when it really
  compiles (``TRITON_DUMP_PTXAS_LOG=1``, not on a cache hit, and to stdout), so we re-run the
  same ``ptxas`` Triton picks for the arch on the compiled PTX with Triton's flags (~60 ms) and
  cross-check its register count against the cubin's (``ptxas_matches_cubin``);
* global memory accesses: static counts of ``ld/st/atom/red.global`` instructions in the PTX,
  keyed by vector width and type (``"ld.global.v4.b32"``); cache-hint qualifiers are dropped.
  Triton's elementwise kernels are straight-line code per program, so static counts per thread
  times ``num_warps * 32`` threads are the accesses of one program.

[Note: FP fusion]
Triton 3.9 reads ``TRITON_DEFAULT_FP_FUSION`` (default on, with a warning when unset) to decide
whether ``a * b + c`` may contract to an FMA. The Makefile exports ``TRITON_DEFAULT_FP_FUSION=1``
for the runtime JIT; here we pass ``enable_fp_fusion=True`` explicitly, so AOT results do not
depend on the caller's environment and match what the runtime compiles. (Only
``TRITON_FORCE_DISABLE_FP_FUSION=1`` still overrides it, as it does at run time.)

Example:
    >>> from shardkit.kernels.aot import all_configs, compile_config, kernel_resources
    >>> cfg = next(c for c in all_configs() if c["name"] == "adamw_fp32")
    >>> res = kernel_resources(compile_config(cfg, 90), cfg)
    >>> res["registers"], res["spill_stores_bytes"], res["global_loads"]["ld.global.v4.b32"]
    (40, 0, 8)
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = [
    "REQUIRED_KEYS",
    "TABLE_POINTERS",
    "all_configs",
    "kernel_signature",
    "compile_config",
    "kernel_resources",
    "ptx_global_accesses",
    "ptx_instruction_count",
]

#: keys every ``AOT_CONFIGS`` entry must have (see the module docstring)
REQUIRED_KEYS = ("kernel", "name", "constexprs", "num_warps", "elements_per_program", "bytes_per_element")

#: pointer types of the multi-tensor launch tables
#: (:class:`~shardkit.kernels.runtime.MultiTensorTable`), shared by every multi-tensor kernel
TABLE_POINTERS = {"ptrs_ptr": "*i64", "numels_ptr": "*i64", "chunk_tensor_ptr": "*i32", "chunk_index_ptr": "*i32"}

_PACKAGE = "shardkit.kernels"
_COMPILED: dict[tuple, Any] = {}  # in-process cache: (config identity, cc) -> CompiledKernel


def all_configs(package: str = _PACKAGE) -> list[dict[str, Any]]:
    """Every ``AOT_CONFIGS`` entry of every module in ``package``, in module order.

    Each returned dict is a copy of the module's config with ``"module"`` (the module's full
    name) added. Imports the package's modules (that is the only work done).

    Args:
        package: the package to scan (``"shardkit.kernels"``; tests pass a scratch package).

    Raises:
        ValueError: a config lacks a required key, or a name repeats within a module.

    Example:
        >>> [(c["module"], c["name"]) for c in all_configs()][:2]
        [('shardkit.kernels.adam', 'adamw_fp32'), ('shardkit.kernels.adam', 'adamw_bf16_master')]
    """
    pkg = importlib.import_module(package)
    configs: list[dict[str, Any]] = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        declared = getattr(module, "AOT_CONFIGS", None)
        if declared is None:
            continue
        seen: set[str] = set()
        for i, cfg in enumerate(declared() if callable(declared) else declared):
            missing = [k for k in REQUIRED_KEYS if k not in cfg]
            if missing:
                raise ValueError(f"{module.__name__}.AOT_CONFIGS[{i}] lacks key(s) {missing}")
            if cfg["name"] in seen:
                raise ValueError(f"{module.__name__}.AOT_CONFIGS: duplicate name {cfg['name']!r}")
            seen.add(cfg["name"])
            configs.append({**cfg, "module": module.__name__})
    return configs


def kernel_signature(fn: Any, constexprs: Mapping[str, Any], pointers: Mapping[str, str] | None = None) -> dict[str, str]:
    """The compile signature of kernel ``fn``, derived from its parameters (see [Note: AOT signatures]).

    Args:
        fn: the kernel function (``TritonKernel.fn``).
        constexprs: values of its ``tl.constexpr`` parameters.
        pointers: types of ``*_ptr`` parameters not in :data:`TABLE_POINTERS`.

    Returns:
        ``{param: "constexpr" | "*fp32" | "i32" | ...}`` for every parameter, in order.

    Raises:
        ValueError: a constexpr without a value, a pointer without a type, an unannotated
            scalar, or a ``constexprs``/``pointers`` name that is not a matching parameter.

    Example:
        >>> kernel_signature(_ADAM.fn, constexprs, {"grad_scale_ptr": "*fp32"})["lr"]
        'fp32'
    """
    from triton.runtime.jit import _normalize_ty, type_canonicalisation_dict

    pointers = dict(pointers or {})
    params = inspect.signature(fn).parameters
    scalar_types = set(type_canonicalisation_dict.values())
    signature: dict[str, str] = {}
    for name, param in params.items():
        annotation = "" if param.annotation is inspect.Parameter.empty else _normalize_ty(param.annotation)
        if annotation == "constexpr":
            if name not in constexprs:
                raise ValueError(f"{fn.__name__}: constexpr {name} has no value in constexprs")
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            ty = pointers.get(name, TABLE_POINTERS.get(name))
            if ty is None or not ty.startswith("*"):
                raise ValueError(f"{fn.__name__}: pointer {name} needs a type in the config's pointers")
            signature[name] = ty
        elif annotation in scalar_types:
            signature[name] = annotation
        else:
            raise ValueError(f"{fn.__name__}: annotate scalar parameter {name} (e.g. tl.int32, tl.float32)")
    stray = [k for k in constexprs if signature.get(k) != "constexpr"]
    stray += [k for k in pointers if k not in params or not k.endswith("_ptr")]
    if stray:
        raise ValueError(f"{fn.__name__}: {sorted(stray)} are not constexpr / pointer parameters")
    return signature


def _runtime_signature(cfg: Mapping[str, Any]) -> dict[str, str]:
    if "signature" in cfg:
        return dict(cfg["signature"])
    derived = kernel_signature(cfg["kernel"].fn, cfg["constexprs"], cfg.get("pointers"))
    return {k: v for k, v in derived.items() if v != "constexpr"}


def _config_identity(cfg: Mapping[str, Any]) -> tuple:
    """A hashable key for everything that determines the compiled binary."""
    fn = cfg["kernel"].fn
    return (
        fn.__module__,
        fn.__qualname__,
        tuple(sorted((k, str(v)) for k, v in _runtime_signature(cfg).items())),
        tuple(sorted((k, repr(v)) for k, v in cfg["constexprs"].items())),
        int(cfg["num_warps"]),
        tuple(sorted(_pointer_args(cfg))),
    )


def _pointer_args(cfg: Mapping[str, Any]) -> list[str]:
    if "pointer_args" in cfg:
        return list(cfg["pointer_args"])
    return [k for k, v in _runtime_signature(cfg).items() if v.startswith("*")]


def compile_config(cfg: Mapping[str, Any], cc: int) -> Any:
    """Compile one AOT config for ``sm_<cc>`` (e.g. 80, 90) without a GPU.

    Results are cached in-process by everything that determines the binary (and Triton's
    on-disk cache makes a recompile in a new process cheap). Fp fusion is on explicitly; see
    [Note: FP fusion].

    Args:
        cfg: an ``AOT_CONFIGS`` entry (see the module docstring).
        cc: compute capability as an int, ``major * 10 + minor``.

    Returns:
        Triton's ``CompiledKernel``: ``.asm["ttir"|"ttgir"|"llir"|"ptx"|"cubin"]``, ``.metadata``.

    Raises:
        ValueError: the signature and constexprs do not cover the kernel's arguments exactly,
            or a ``pointer_args`` name is not an argument.

    Example:
        >>> compiled = compile_config(cfg, 80)
        >>> ".target sm_80" in compiled.asm["ptx"]
        True
    """
    key = (_config_identity(cfg), int(cc))
    if key in _COMPILED:
        return _COMPILED[key]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = cfg["kernel"].jit
    where = f"{cfg.get('module', '?')}:{cfg['name']}"
    constexprs, runtime_sig = dict(cfg["constexprs"]), _runtime_signature(cfg)
    unknown = (set(constexprs) | set(runtime_sig)) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{where}: {sorted(unknown)} are not arguments of {fn.__name__}")
    missing = [a for a in fn.arg_names if a not in constexprs and a not in runtime_sig]
    if missing:
        raise ValueError(f"{where}: arguments {missing} are in neither signature nor constexprs")
    signature = {a: "constexpr" if a in constexprs else runtime_sig[a] for a in fn.arg_names}
    aligned = _pointer_args(cfg)
    bad = [a for a in aligned if a not in runtime_sig or not runtime_sig[a].startswith("*")]
    if bad:
        raise ValueError(f"{where}: pointer_args {bad} are not pointer arguments")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", int(cc), 32),
        options={"num_warps": int(cfg["num_warps"]), "enable_fp_fusion": True},
    )
    _COMPILED[key] = compiled
    return compiled


# `@%p1 ld.global.L1::evict_last.v4.b32 {...}` -> op "ld", qualifiers ".global.L1::evict_last.v4.b32";
# atomics put semantics/scope first: `atom.acq_rel.gpu.global.add.f32`.
_ACCESS = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld|st|atom|red)((?:\.[\w:]+)+)", re.M)
_TYPE = re.compile(r"^[bfsu](8|16|32|64)$")
_VEC = ("v2", "v4", "v8")
_ATOMIC_OPS = ("add", "min", "max", "inc", "dec", "and", "or", "xor", "exch", "cas")


def ptx_global_accesses(ptx: str) -> dict[str, dict[str, int]]:
    """Static counts of global loads, stores and atomics in PTX, keyed by width and type.

    Keys keep the op, the vector width (``v2``/``v4``/``v8``, absent for scalar) and the element
    type, dropping cache qualifiers: ``"ld.global.v4.b32"`` is one 128-bit load per thread.

    Returns:
        ``{"global_loads": {...}, "global_stores": {...}, "global_atomics": {...}}``.

    Example:
        >>> ptx_global_accesses("@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];")
        {'global_loads': {'ld.global.v4.b32': 1}, 'global_stores': {}, 'global_atomics': {}}
    """
    counts: dict[str, Counter] = {"ld": Counter(), "st": Counter(), "atomic": Counter()}
    for op, quals in _ACCESS.findall(ptx):
        parts = quals.strip(".").split(".")
        if "global" not in parts:
            continue
        vec = [p for p in parts if p in _VEC]
        dtype = [p for p in parts if _TYPE.match(p)]
        atomic_op = [p for p in parts if op in ("atom", "red") and p in _ATOMIC_OPS]
        key = ".".join([op, "global", *atomic_op[-1:], *vec, *dtype[-1:]])
        counts["atomic" if op in ("atom", "red") else op][key] += 1
    return {
        "global_loads": dict(sorted(counts["ld"].items())),
        "global_stores": dict(sorted(counts["st"].items())),
        "global_atomics": dict(sorted(counts["atomic"].items())),
    }


_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?[a-z][\w.:]*[\s;]", re.M)


def ptx_instruction_count(ptx: str) -> int:
    """Static number of PTX instructions (directives, labels, declarations and comments excluded).

    Example:
        >>> ptx_instruction_count("\t.reg .b32 %r<4>;\n$L1:\n\tadd.s32 %r1, %r2, %r3;\n\tret;")
        2
    """
    return sum(1 for _ in _INSTRUCTION.finditer(ptx))


def _access_bits(key: str) -> int:
    """Bits moved per thread by one access, e.g. ``ld.global.v4.b32`` -> 128."""
    parts = key.split(".")
    lanes = next((int(p[1:]) for p in parts if p in _VEC), 1)
    width = next((int(_TYPE.match(p).group(1)) for p in parts if _TYPE.match(p)), 0)
    return lanes * width


def _nvidia_tool(name: str) -> str:
    import triton

    return getattr(triton.knobs.nvidia, name).path


@functools.lru_cache(maxsize=8)
def _ptxas_for(cc: int) -> tuple[str, str]:
    """(path, version line) of the ptxas Triton uses for ``sm_<cc>``."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(cc)
    return tool.path, str(tool.version)


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout + proc.stderr


def _cubin_resources(cubin: bytes, function: str) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = _run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", path])
    match = re.search(rf"Function {re.escape(function)}:\s*\n\s*(.*)", out)
    if not match:
        raise RuntimeError(f"cuobjdump printed no resource usage for {function}:\n{out}")
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", match.group(1)))
    return {k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}


def _ptxas_log(ptx: str, cc: int, fp_fusion: bool, extra: str | None) -> dict[str, int]:
    arch = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    if not arch:
        raise RuntimeError("PTX has no .target line")
    ptxas, _ = _ptxas_for(cc)
    # Triton's own ptxas flags (triton/backends/nvidia/compiler.py, make_cubin, 3.9).
    flags = ["-lineinfo", "--regAllocOptLevel=2", *([] if fp_fusion else ["--fmad=false"]), *(extra or "").split()]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = _run([ptxas, "-v", *flags, f"--gpu-name={arch.group(1)}", src, "-o", src + ".o"])
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    if not spill or not regs:
        raise RuntimeError(f"unexpected ptxas -v log:\n{log}")
    return {"spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2)), "registers": int(regs.group(1))}


def kernel_resources(compiled: Any, cfg: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Registers, spills, shared memory and global access widths of a compiled kernel.

    See [Note: where the resource numbers come from]. Needs no GPU or driver.

    Args:
        compiled: a ``CompiledKernel`` from :func:`compile_config` (or ``triton.compile``).
        cfg: its AOT config; when given, adds ``name``/``module``, ``elements_per_program``,
            ``bytes_per_element`` (the config's formula) and ``vec128_bytes_per_element``
            (bytes per element moved by 128-bit accesses, = ``bytes_per_element`` when every data
            access is vectorized).

    Returns:
        A JSON-ready dict: ``target`` ("sm_90"), ``num_warps``, ``registers``,
        ``spill_stores_bytes``, ``spill_loads_bytes``, ``stack_bytes``, ``local_bytes``,
        ``shared_mem_bytes`` (Triton's launch-time allocation), ``static_shared_bytes``,
        ``ptx_instructions`` (static count, both arms of every branch: code size, not work),
        ``global_loads``/``global_stores``/``global_atomics`` (``{access: count}``),
        ``ptxas_matches_cubin``, plus the ``cfg`` fields above.

    Example:
        >>> res = kernel_resources(compile_config(cfg, 90), cfg)
        >>> res["global_stores"]
        {'st.global.v4.b32': 6}
    """
    meta = compiled.metadata
    cc = int(meta.target.arch)
    num_warps = int(meta.num_warps)
    cubin = _cubin_resources(compiled.asm["cubin"], meta.name)
    log = _ptxas_log(compiled.asm["ptx"], cc, bool(getattr(meta, "enable_fp_fusion", True)), getattr(meta, "ptx_options", None))
    accesses = ptx_global_accesses(compiled.asm["ptx"])
    res: dict[str, Any] = {
        "kernel": meta.name,
        "target": f"sm_{cc}",
        "num_warps": num_warps,
        "registers": cubin["REG"],
        "spill_stores_bytes": log["spill_stores"],
        "spill_loads_bytes": log["spill_loads"],
        "stack_bytes": cubin["STACK"],
        "local_bytes": cubin["LOCAL"],
        "shared_mem_bytes": int(meta.shared),
        "static_shared_bytes": cubin["SHARED"],
        **accesses,
        "ptx_instructions": ptx_instruction_count(compiled.asm["ptx"]),
        "ptxas_matches_cubin": log["registers"] == cubin["REG"],
        "ptxas": _ptxas_for(cc)[1],
    }
    if cfg is not None:
        threads = num_warps * 32
        per_program = int(cfg["elements_per_program"])
        vec128 = sum(n for kind in ("global_loads", "global_stores") for k, n in accesses[kind].items() if _access_bits(k) == 128)
        res = {"module": cfg.get("module"), "name": cfg["name"], **res}
        res["elements_per_program"] = per_program
        res["bytes_per_element"] = cfg["bytes_per_element"]
        res["vec128_bytes_per_element"] = vec128 * 16 * threads / per_program
    return res
