"""The optimizers `perf/optim.py` times: shardkit ``FusedAdamW`` and its peers.

Each peer is a :class:`Peer` (``step()`` runs one AdamW update of its own params) built by
:func:`build_peers` on identical fresh params and one shared set of gradients: shardkit
``FusedAdamW``, ``torch.optim.AdamW`` (foreach and fused), DeepSpeed's ``DeepSpeedCPUAdam`` (CPU,
when importable) and the hand-written CUDA C AdamW of ``perf/cuda/adamw.cu`` (CUDA, through CuPy),
plus :func:`cuda_source_to_ptx`, which compiles that source without a GPU. A peer that cannot run
here is returned with ``step=None`` and the reason. The peers live apart from the timing and the
report (as `perf/zero_peers.py` does for the ZeRO benchmark): adding or changing an
optimizer under test touches only this file.

Example:
    >>> from optim import model_shapes
    >>> peers = build_peers(list(PEERS), model_shapes(1 << 16), torch.device("cpu"))
    >>> [p.name for p in peers if p.step is not None][:3]
    ['shardkit.FusedAdamW', 'torch.AdamW(foreach)', 'torch.AdamW(fused)']
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CUDA_SRC", "HYPER", "PEERS", "SHARDKIT", "CudaToolUnavailable", "Peer", "build_peers", "cuda_source_to_ptx"]

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
SHARDKIT = "shardkit.FusedAdamW"
PEERS = (SHARDKIT, "torch.AdamW(foreach)", "torch.AdamW(fused)", "deepspeed.DeepSpeedCPUAdam", "cuda_c.adamw")
CUDA_SRC = Path(__file__).resolve().parent / "cuda" / "adamw.cu"  # perf/cuda/, beside this file


class CudaToolUnavailable(RuntimeError):
    """Neither CuPy's NVRTC nor nvcc can compile CUDA C here."""


@dataclass
class Peer:
    """One optimizer under test: ``step()`` runs one update, ``params`` are what it updates."""

    name: str
    step: Callable[[], None] | None = None
    params: list[torch.Tensor] = field(default_factory=list)
    reason: str = ""  # why it is unavailable


def _torch_peer(name: str, params: list[torch.Tensor], **kwargs: Any) -> Peer:
    opt = torch.optim.AdamW(params, **HYPER, **kwargs)
    return Peer(name, opt.step, params)


def _shardkit_peer(params: list[torch.Tensor]) -> Peer:
    from shardkit.kernels import FusedAdamW

    opt = FusedAdamW(params, **HYPER)
    return Peer(SHARDKIT, opt.step, params)


def _deepspeed_peer(params: list[torch.Tensor]) -> Peer:
    name = "deepspeed.DeepSpeedCPUAdam"
    if params[0].device.type != "cpu":
        return Peer(name, reason="CPU-only optimizer")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt = DeepSpeedCPUAdam(params, **HYPER, adamw_mode=True)  # JIT-builds its op once (~50 s)
    except Exception as exc:  # optional peer: not installed, or its C++ op fails to build
        return Peer(name, reason=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    return Peer(name, opt.step, params)


def cuda_source_to_ptx(source: str, arch: int = 80, compiler: str = "auto") -> tuple[str, str]:
    """Compile CUDA C to PTX without a GPU: CuPy's NVRTC if usable, else ``nvcc`` on PATH.

    Args:
        source: CUDA C source text.
        arch: virtual architecture, e.g. 80 for ``compute_80``.
        compiler: ``"auto"``, ``"nvrtc"`` or ``"nvcc"``.

    Returns:
        ``(ptx, tool)`` where ``tool`` names the compiler used.

    Raises:
        CudaToolUnavailable: the requested compiler (or, for auto, both) is not usable here.
        RuntimeError: the source does not compile (the log is in the message).

    Example:
        >>> ptx, tool = cuda_source_to_ptx(Path("perf/cuda/adamw.cu").read_text(), arch=90)
        >>> ".entry adamw_fp32_vec4" in ptx
        True
    """
    errors = []
    if compiler in ("auto", "nvrtc"):
        try:
            from cupy_backends.cuda.libs import nvrtc

            prog = nvrtc.createProgram(source, "adamw.cu", [], [])
        except Exception as exc:  # cupy missing, or libnvrtc not found (nvidia-cuda-nvrtc-cu12)
            errors.append(f"nvrtc: {type(exc).__name__}: {exc}")
        else:
            try:
                nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{arch}", "-std=c++17"])
                ptx = nvrtc.getPTX(prog)
            except Exception as exc:
                raise RuntimeError(f"NVRTC failed: {exc}\n{nvrtc.getProgramLog(prog)}") from exc
            finally:
                nvrtc.destroyProgram(prog)
            return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00"), "nvrtc"
    if compiler in ("auto", "nvcc"):
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            errors.append("nvcc: not on PATH")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                src, out = Path(tmp, "adamw.cu"), Path(tmp, "adamw.ptx")
                src.write_text(source)
                proc = subprocess.run(
                    [nvcc, "-ptx", f"-arch=compute_{arch}", str(src), "-o", str(out)], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"nvcc failed:\n{proc.stderr}")
                return out.read_text(), "nvcc"
    raise CudaToolUnavailable("; ".join(errors) or f"unknown compiler {compiler!r}")


def _cuda_c_peer(init: list[torch.Tensor], grads: list[torch.Tensor], cuda_src: Path) -> Peer:
    """The hand-written CUDA C AdamW on flat buffers holding the same values as the peers'."""
    name = "cuda_c.adamw"
    if init[0].device.type != "cuda":
        return Peer(name, reason="CUDA only")
    try:
        import cupy

        module = cupy.RawModule(code=cuda_src.read_text(), options=("-std=c++17",))
        vec4, scalar = module.get_function("adamw_fp32_vec4"), module.get_function("adamw_fp32")
    except Exception as exc:  # extra `cuda` not installed, or no source checkout
        return Peer(name, reason=f"{type(exc).__name__}: {str(exc).strip()[:200]}")
    p = torch.cat([t.reshape(-1) for t in init])
    g = torch.cat([t.reshape(-1) for t in grads])
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    n, n4 = p.numel(), p.numel() // 4  # torch's CUDA allocator aligns to >= 512 B: float4-safe
    cp = {k: cupy.asarray(t) for k, t in dict(p=p, g=g, m=m, v=v).items()}  # zero-copy views
    sms = torch.cuda.get_device_properties(p.device).multi_processor_count
    threads, state = 256, {"t": 0}
    tail = [cp[k][4 * n4 :] for k in "pgmv"]  # the n % 4 elements the float4 kernel leaves
    lr, (b1, b2), eps, wd = HYPER["lr"], HYPER["betas"], HYPER["eps"], HYPER["weight_decay"]

    def step() -> None:
        state["t"] += 1
        t = state["t"]
        hyper = [cupy.float32(x) for x in (lr, b1, b2, eps, wd, lr / (1 - b1**t), math.sqrt(1 - b2**t))]
        with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            if n4:
                blocks = min(-(-n4 // threads), sms * 16)  # grid-stride loop covers the rest
                vec4((blocks,), (threads,), (cp["p"], cp["g"], cp["m"], cp["v"], cupy.int64(n4), *hyper))
            if n % 4:
                scalar((1,), (threads,), (*tail, cupy.int64(n % 4), *hyper))

    return Peer(name, step, [p])


def build_peers(
    names: list[str], shapes: list[tuple[int, ...]], device: torch.device, seed: int = 0, cuda_src: Path = CUDA_SRC
) -> list[Peer]:
    """Create each named peer on identical fresh params; all share one set of grads.

    Example:
        >>> peers = build_peers(list(PEERS), model_shapes(1 << 16), torch.device("cpu"))
        >>> [p.name for p in peers if p.step is not None][:3]
        ['shardkit.FusedAdamW', 'torch.AdamW(foreach)', 'torch.AdamW(fused)']
    """
    gen = torch.Generator().manual_seed(seed)
    init = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]

    def fresh() -> list[torch.Tensor]:
        params = [torch.nn.Parameter(t.clone()) for t in init]
        for p, g in zip(params, grads):
            p.grad = g  # shared, read-only for AdamW
        return params

    factories: dict[str, Callable[[], Peer]] = {
        SHARDKIT: lambda: _shardkit_peer(fresh()),
        "torch.AdamW(foreach)": lambda: _torch_peer("torch.AdamW(foreach)", fresh(), foreach=True),
        "torch.AdamW(fused)": lambda: _torch_peer("torch.AdamW(fused)", fresh(), fused=True),
        "deepspeed.DeepSpeedCPUAdam": lambda: _deepspeed_peer(fresh()),
        "cuda_c.adamw": lambda: _cuda_c_peer(init, grads, cuda_src),
    }
    unknown = set(names) - set(factories)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; choose from {list(factories)}")
    return [factories[n]() for n in names]
