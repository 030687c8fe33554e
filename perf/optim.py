"""Optimizer step benchmark: shardkit ``FusedAdamW`` against its peers, measured in one run.

One AdamW step (fp32 params, m, v) over a GPT-like set of tensors totalling N parameters:

* CPU: shardkit ``FusedAdamW`` (``backend="auto"``: the torch fused CPU fast path) vs
  ``torch.optim.AdamW(foreach=True)``, ``torch.optim.AdamW(fused=True)`` and DeepSpeed's
  ``DeepSpeedCPUAdam`` when importable (an optional peer, never a dependency).
* CUDA: shardkit (compiled Triton) vs torch foreach / fused vs a hand-written CUDA C AdamW
  (``perf/cuda/adamw.cu``, loaded with ``cupy.RawModule``; extra ``cuda``) on flat buffers of
  the same size, reported as GB/s = 28 B/param x N / time (read p, g, m, v + write p, m, v;
  docs/reference.md, "Optimizer bytes per parameter") and % of the HBM peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s).

Peers share one set of gradient tensors (read-only for Adam) and start from identical params,
so every peer does identical work; steps are timed interleaved (one step of each peer per
round, rotating the order) so background load hits all peers alike. Each peer's result is
checked against the others through ``||p||_2`` after the same number of steps. Ratios are
``peer time / fastest non-shardkit peer time`` (median and min). On a small shared CPU machine
OpenMP-parallel steps stall whenever another process holds a core (2-thread medians inflate
10-40x); ``--threads 1`` keeps the ratios stable there (``loadavg`` is recorded with the results).
The peers themselves are built in `perf/optim_peers.py`; this module times and reports.

Example:
    $ shardkit bench optim --sizes 10M 100M --repeats 10
    $ python perf/optim.py --quick --out /tmp/optim.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# the peers and the CUDA C compile helper live in optim_peers; re-exported here, where tests import them
from optim_peers import CUDA_SRC, HYPER, PEERS, SHARDKIT, CudaToolUnavailable, Peer, build_peers, cuda_source_to_ptx

__all__ = [
    "BYTES_PER_PARAM",
    "PEERS",
    "SHARDKIT",
    "CudaToolUnavailable",
    "model_shapes",
    "run_benchmark",
    "cuda_source_to_ptx",
    "main",
]

BYTES_PER_PARAM = 28  # fp32 AdamW: read p, g, m, v + write p, m, v (docs/reference.md)
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # HBM peak, SXM parts (docs/reference.md)


def model_shapes(total: int, layers: int = 4) -> list[tuple[int, ...]]:
    """Shapes of a GPT-like model with exactly ``total`` parameters.

    ``layers`` blocks of (qkv, proj, fc1, fc2 weights + biases, two LayerNorms) at hidden size
    ``h`` (a multiple of 16, ~80% of the params), an embedding filling the rest, and one odd-sized
    vector for the remainder.

    Example:
        >>> shapes = model_shapes(10_000_000)
        >>> sum(math.prod(s) for s in shapes), len(shapes)
        (10000000, 53)
    """
    h = max(16, int(math.sqrt(0.8 * total / (12 * layers))) // 16 * 16)
    block = [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,), (h,), (h,)]
    shapes = [s for _ in range(layers) for s in block] + [(h,), (h,)]
    rest = total - sum(math.prod(s) for s in shapes)
    if rest < 0:
        raise ValueError(f"total={total} is too small for {layers} layers at hidden size {h}")
    shapes += [s for s in [(rest // h, h), (rest % h,)] if math.prod(s) > 0]
    return shapes


def time_steps(peers: list[Peer], warmup: int, repeats: int, device: torch.device) -> dict[str, dict[str, list]]:
    """Warm up, then time ``repeats`` interleaved steps of each runnable peer (rotating order).

    Returns:
        ``{name: {"wall_ms": [...], "device_ms": [...]}}``; ``device_ms`` (CUDA events) is empty
        on CPU. Wall time includes a device sync before and after each step.

    Example:
        >>> time_steps(peers, warmup=2, repeats=5, device=torch.device("cpu"))[SHARDKIT]["wall_ms"]
        [5.1, 5.0, 5.2, 5.0, 5.1]
    """
    live = [p for p in peers if p.step is not None]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for peer in live:
        for _ in range(warmup):  # first step allocates state (and compiles kernels on CUDA)
            peer.step()
    sync()
    out: dict[str, dict[str, list]] = {p.name: {"wall_ms": [], "device_ms": []} for p in live}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for peer in live[r % len(live) :] + live[: r % len(live)]:
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    sync()
                    t0 = time.perf_counter()
                    start.record()
                    peer.step()
                    end.record()
                    sync()
                    out[peer.name]["device_ms"].append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    peer.step()
                out[peer.name]["wall_ms"].append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.enable()
    return out


def _peak_bytes_per_s(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BYTES_PER_S.items() if k in name and "PCIe" not in name), None)
    return name, peak


def _norm(params: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) ** 2 for p in params))


def bench_size(
    total: int, names: list[str], device: torch.device, warmup: int, repeats: int, cuda_src: Path = CUDA_SRC
) -> dict[str, Any]:
    """Benchmark every peer at ``total`` parameters; returns the JSON-ready result for this size.

    Example:
        >>> res = bench_size(1 << 16, list(PEERS), torch.device("cpu"), warmup=1, repeats=3)
        >>> res["peers"][SHARDKIT]["ratio_vs_fastest_peer"]
        0.97
    """
    shapes = model_shapes(total)
    peers = build_peers(names, shapes, device, cuda_src=cuda_src)
    times = time_steps(peers, warmup, repeats, device)
    _, peak = _peak_bytes_per_s(device)
    steps_done = warmup + repeats
    result: dict[str, Any] = {
        "params": total,
        "n_tensors": len(shapes),
        "bytes_per_step": BYTES_PER_PARAM * total,
        "peers": {},
    }
    for peer in peers:
        if peer.step is None:
            result["peers"][peer.name] = {"available": False, "reason": peer.reason}
            continue
        wall, dev = times[peer.name]["wall_ms"], times[peer.name]["device_ms"]
        basis = dev or wall  # bandwidth from device time on CUDA, wall time on CPU
        entry: dict[str, Any] = {
            "available": True,
            "min_ms": min(wall),
            "median_ms": statistics.median(wall),
            "spread": (statistics.median(wall) - min(wall)) / min(wall),
            "wall_ms": [round(t, 4) for t in wall],
            "gbps": BYTES_PER_PARAM * total / (statistics.median(basis) * 1e-3) / 1e9,
            "param_norm": _norm(peer.params),
            "steps": steps_done,
        }
        if dev:
            entry |= {
                "device_min_ms": min(dev),
                "device_median_ms": statistics.median(dev),
                "device_ms": [round(t, 4) for t in dev],
            }
        if peak:
            entry["pct_of_peak"] = 100 * entry["gbps"] * 1e9 / peak
        result["peers"][peer.name] = entry
    del peers
    gc.collect()
    _add_ratios(result)
    return result


def _add_ratios(result: dict[str, Any]) -> None:
    live = {k: v for k, v in result["peers"].items() if v["available"]}
    others = {k: v for k, v in live.items() if k != SHARDKIT}
    if not others:
        return
    key = "device_median_ms" if all("device_median_ms" in v for v in others.values()) else "median_ms"
    key_min = key.replace("median", "min")
    fastest = min(others, key=lambda k: others[k][key])
    ref_norm = live[fastest]["param_norm"]
    for v in live.values():
        v["ratio_vs_fastest_peer"] = v[key] / others[fastest][key]
        v["ratio_vs_fastest_peer_min"] = v[key_min] / others[fastest][key_min]
        v["param_norm_rel_diff"] = abs(v["param_norm"] - ref_norm) / ref_norm
    result["fastest_peer"], result["ratio_basis"] = fastest, key
    if SHARDKIT in live:
        result["shardkit_ratio"] = live[SHARDKIT]["ratio_vs_fastest_peer"]
        result["shardkit_ratio_min"] = live[SHARDKIT]["ratio_vs_fastest_peer_min"]


def machine_info(device: torch.device) -> dict[str, Any]:
    """Machine, library versions and load, recorded with every result file."""
    cpu = platform.processor()
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "shardkit", "deepspeed", "cupy"):
        module = sys.modules.get(mod)
        versions[mod] = getattr(module, "__version__", None) if module else None
    name, peak = _peak_bytes_per_s(device)
    info = {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "versions": versions,
    }
    if device.type == "cuda":
        info |= {"gpu": name, "peak_bytes_per_s": peak, "capability": list(torch.cuda.get_device_capability(device))}
    if hasattr(os, "getloadavg"):
        info["loadavg"] = list(os.getloadavg())
    return info


def run_benchmark(
    sizes: list[int], device: torch.device, peers: list[str], warmup: int, repeats: int, cuda_src: Path = CUDA_SRC
) -> dict[str, Any]:
    """Run every size and return the full JSON-ready report (machine info, settings, results).

    Example:
        >>> report = run_benchmark([1 << 16], torch.device("cpu"), list(PEERS), warmup=1, repeats=3)
        >>> sorted(report["results"][0]["peers"]) == sorted(PEERS)
        True
    """
    import triton  # noqa: F401  (versions recorded below)

    import shardkit  # noqa: F401

    t0, load_start = time.perf_counter(), list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results = [bench_size(n, peers, device, warmup, repeats, cuda_src) for n in sizes]
    info = machine_info(device) | {"loadavg_start": load_start}  # a busy machine makes noisy numbers
    return {
        "benchmark": "optim",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "machine": info,
        "settings": {
            "sizes": sizes,
            "warmup": warmup,
            "repeats": repeats,
            "dtype": "float32",
            "hyper": HYPER,
            "bytes_per_param": BYTES_PER_PARAM,
            "interleaved": True,
        },
        "results": results,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Median step time per peer and size (min as a tick), labelled with the ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        live = [(k, v) for k, v in res["peers"].items() if v["available"]]
        names = [k for k, _ in live]
        med = [v.get("device_median_ms", v["median_ms"]) for _, v in live]
        mins = [v.get("device_min_ms", v["min_ms"]) for _, v in live]
        colors = ["tab:red" if k == SHARDKIT else "tab:gray" for k in names]
        ax.barh(names, med, color=colors)
        ax.scatter(mins, names, marker="|", color="black", s=200, label="min")
        for i, (_, v) in enumerate(live):
            ax.annotate(f" {v.get('ratio_vs_fastest_peer', float('nan')):.2f}x", (med[i], i), va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(med) * 1.2)
        machine = report["machine"]
        where = machine.get("gpu") or f"CPU, {machine['torch_threads']} thread(s)"
        ax.set_title(f"{_fmt_params(res['params'])} params, {where}", fontsize=10)
    fig.suptitle("AdamW fp32: one optimizer step", fontsize=11)
    fig.supxlabel("ms per step (bar: median, tick: min; label: median ratio vs fastest peer)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_params(n: int) -> str:
    return next((f"{n / d:g}{u}" for d, u in ((1e9, "G"), (1e6, "M"), (1e3, "K")) if n >= d), str(n))


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 65536, 10M, 1.5G")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def format_table(report: dict[str, Any]) -> str:
    """Text table: one line per size and peer."""
    lines = [f"{'params':>8} {'peer':<28} {'min ms':>9} {'median ms':>10} {'GB/s':>7} {'% peak':>7} {'ratio':>6}"]
    for res in report["results"]:
        for name, v in res["peers"].items():
            if not v["available"]:
                lines.append(f"{_fmt_params(res['params']):>8} {name:<28} unavailable: {v['reason']}")
                continue
            pct = f"{v['pct_of_peak']:.1f}" if "pct_of_peak" in v else "-"
            lines.append(
                f"{_fmt_params(res['params']):>8} {name:<28} {v.get('device_min_ms', v['min_ms']):>9.3f} "
                f"{v.get('device_median_ms', v['median_ms']):>10.3f} {v['gbps']:>7.1f} {pct:>7} "
                f"{v.get('ratio_vs_fastest_peer', float('nan')):>6.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``shardkit bench optim``, ``perf/optim.py``).

    Example:
        >>> main(["--quick", "--out", "/tmp/optim.json"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="shardkit bench optim", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_parse_size, nargs="+", help="total params per run (default 10M 100M)")
    parser.add_argument("--repeats", type=int, help="timed steps per peer (default 10; --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps per peer first (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one thread, no DeepSpeed (smoke run)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--peers", nargs="+", choices=PEERS, metavar="PEER", help=f"default: all of {', '.join(PEERS)}")
    parser.add_argument("--cuda-src", type=Path, default=CUDA_SRC, help="CUDA C AdamW source (perf/cuda/adamw.cu)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; --quick 1)")
    parser.add_argument(
        "--out", default=None, help="JSON file or directory/ (default perf/results/optim_<device>.json); plot beside it"
    )
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    sizes = args.sizes or ([1 << 14, 1 << 16] if args.quick else [10_000_000, 100_000_000])
    repeats = args.repeats or (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    peers = list(args.peers or PEERS)
    threads, saved_threads = args.threads or (1 if args.quick else None), torch.get_num_threads()
    if threads:  # tiny tensors gain nothing from threads, and a busy machine stalls OpenMP barriers
        torch.set_num_threads(threads)
    try:
        run = [p for p in peers if not (args.quick and args.peers is None and p.startswith("deepspeed"))]
        report = run_benchmark(sizes, device, run, warmup, repeats, args.cuda_src)
    finally:
        torch.set_num_threads(saved_threads)
    for res in report["results"]:  # record the peers left out, so every peer has an entry
        for name in peers:
            reason = "skipped with --quick (DeepSpeedCPUAdam JIT-builds its op, ~50 s)"
            res["peers"].setdefault(name, {"available": False, "reason": reason})
    out = Path(args.out or "perf/results/")
    if out.is_dir() or (args.out or "/").endswith(("/", os.sep)):
        out = out / f"optim_{device.type}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    if not args.no_plot:
        write_plot(report, out.with_suffix(".png"))
    print(f"wrote {out}" + ("" if args.no_plot else f" and {out.with_suffix('.png')}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
