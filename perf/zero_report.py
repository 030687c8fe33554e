"""The ZeRO benchmark's report (`perf/zero.py`): rows, the step-0 loss check, JSON, table, plot.

A *row* is one ZeRO stage with or without optimizer offload: ``"1"``, ``"2"``, ``"3"`` (ours vs
`zero_peers.PEERS`) and ``"2+cpu"``, ``"3+cpu"`` (ours with
``offload="cpu"`` vs DeepSpeed with ``offload_optimizer: {device: cpu}``). Each row of the
JSON's ``stages`` is ``{"built", "stage", "offload", "configs", "ratios", "fastest_peer"}``;
the keys ``"1"``/``"2"`` keep the layout of earlier results, so ``perf/report.py`` reads both.

Example:
    >>> rows = bench_rows([2, 3], ["none", "cpu"])
    >>> [r[0] for r in rows]
    ['2', '2+cpu', '3', '3+cpu']
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from zero_peers import HYPER, OFFLOAD_PEERS, PEERS, SHARDKIT

__all__ = ["LOSS_RTOL", "bench_rows", "build_report", "check_losses", "format_table", "row_configs", "write_plot"]

#: relative tolerance of the step-0 loss check: the same weights and batch in fp32 give the
#: same forward up to summation order (DeepSpeed's and FSDP2's gathers are exact copies)
LOSS_RTOL = 1e-6


def bench_rows(stages: list[int], offload: list[str]) -> list[tuple[str, int, str | None]]:
    """``(key, stage, offload)`` of every row to run: offload rows for stages 2 and 3 only.

    Args:
        stages: ZeRO stages (1, 2, 3).
        offload: ``"none"`` and/or ``"cpu"``.

    Example:
        >>> bench_rows([1, 3], ["cpu"])
        [('3+cpu', 3, 'cpu')]
    """
    rows: list[tuple[str, int, str | None]] = []
    for stage in sorted(stages):
        if "none" in offload:
            rows.append((str(stage), stage, None))
        if "cpu" in offload and stage >= 2:
            rows.append((f"{stage}+cpu", stage, "cpu"))
    return rows


def row_configs(stage: int, offload: str | None) -> tuple[str, ...]:
    """Ours first, then the peers of the row (``PEERS[stage]``, or ``OFFLOAD_PEERS``)."""
    return (SHARDKIT, *(PEERS[stage] if offload is None else OFFLOAD_PEERS))


def check_losses(losses: dict[str, list[list[float]]], rtol: float = LOSS_RTOL) -> dict[str, Any]:
    """Step-0 losses must agree across every configuration, on every rank.

    Args:
        losses: ``"row/kind"`` -> per rank, the losses of the first steps (step 0 first).
        rtol: allowed relative difference at step 0.

    Returns:
        ``{"step0_max_rel_diff", "step1_max_rel_diff"}`` over all configurations (step 1 follows
        one optimizer step: recorded, not asserted; fused vs unfused AdamW round differently).

    Raises:
        SystemExit: a step-0 loss differs by more than ``rtol`` (names the configurations).

    Example:
        >>> check_losses({"2/shardkit": [[4.5, 4.4]], "2/deepspeed": [[4.5, 4.4]]})["step0_max_rel_diff"]
        0.0
    """
    out: dict[str, Any] = {}
    keys = sorted(losses)
    if not keys:
        return out
    ref = keys[0]
    for step in (0, 1):
        worst, who = 0.0, ref
        for key in keys:
            for rank, (a, b) in enumerate(zip(losses[ref], losses[key])):
                if len(a) > step and len(b) > step:
                    d = abs(a[step] - b[step]) / max(abs(a[step]), 1e-30)
                    if d > worst:
                        worst, who = d, f"{key} (rank {rank})"
        out[f"step{step}_max_rel_diff"] = worst
        if step == 0 and worst > rtol:
            raise SystemExit(f"zero benchmark: step-0 loss of {who} differs from {ref} by {worst:.3g} (rtol {rtol:g})")
    return out


def _summary(samples: list[float]) -> dict[str, Any]:
    ms = [1e3 * s for s in samples]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "n": len(ms)}


def _machine() -> dict[str, Any]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("shardkit", "deepspeed"):
        try:
            versions[mod] = getattr(__import__(mod), "__version__", None)
        except Exception:  # optional: absent or broken
            versions[mod] = None
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "versions": versions}
    if hasattr(os, "getloadavg"):
        info["loadavg"] = list(os.getloadavg())
    return info


def _row(raw: dict[str, Any], key: str, stage: int, offload: str | None) -> dict[str, Any]:
    configs: dict[str, Any] = {}
    for kind in row_configs(stage, offload):
        name = f"{key}/{kind}"
        if name not in raw["samples"]:
            configs[kind] = {"available": False, "reason": raw["unavailable"].get(name, "not run")}
            continue
        per_rank = raw["memory"][name]
        for m in per_rank:  # persistent state plus what is gathered from forward to backward
            m["model_state_in_step"] = m["model_state"] + m["params_in_step"] - m["params"]
        worst = max(per_rank, key=lambda m: m["model_state"])  # the rank that runs out first
        configs[kind] = {"available": True, **_summary(raw["samples"][name]), "memory": worst, "memory_per_rank": per_rank}
        configs[kind]["loss_first_steps_rank0"] = raw["losses"][name][0]
        if raw["profiles"]:
            configs[kind]["profile_rank0"] = raw["profiles"][name]
    ours = configs[SHARDKIT]
    ratios: dict[str, Any] = {}
    for peer in row_configs(stage, offload)[1:]:
        c = configs[peer]
        if not (c["available"] and ours["available"]):
            continue
        ratios[peer] = {"time_median": ours["median_ms"] / c["median_ms"], "time_min": ours["min_ms"] / c["min_ms"]}
        if offload is None:  # with offload the peers count host memory differently: time only
            for m in ("model_state", "params_in_step", "model_state_in_step"):
                ratios[peer][m] = ours["memory"][m] / c["memory"][m]
    best = min(ratios, key=lambda p: configs[p]["median_ms"]) if ratios else None
    return {"built": True, "stage": stage, "offload": offload, "configs": configs, "ratios": ratios, "fastest_peer": best}


def build_report(raw: dict[str, Any], args: argparse.Namespace, load_start: list[float] | None) -> dict[str, Any]:
    """The JSON report from rank 0's ``raw`` results (samples, memory, losses, unavailable).

    Raises:
        SystemExit: the step-0 losses disagree (:func:`check_losses`).
    """
    loss_check = check_losses(raw["losses"])
    stages = {key: _row(raw, key, stage, off) for key, stage, off in bench_rows(args.stages, args.offload)}
    n = raw["n_params"]
    return {
        "benchmark": "zero_step",
        "device": "cpu",
        "backend": "gloo",
        "nproc": args.nproc,
        "params": n,
        "model": f"TinyGPT d_model={args.d_model} n_layers={args.n_layers} n_heads={args.n_heads} "
        f"vocab={args.vocab} seq_len={args.seq_len} tied, batch/rank={args.batch}",
        "optimizer": {
            "ours": "ZeroOptimizer(sdp, FusedAdamW)",
            "peers": f"torch.optim.AdamW(fused={args.peer_fused}) / DeepSpeed AdamW(torch_adam=True)",
            **HYPER,
        },
        "settings": {
            "warmup": args.warmup,
            "steps": args.steps,
            "repeats": args.repeats,
            "bucket_mb": args.bucket_mb,
            "threads_per_rank": args.threads or max(1, (os.cpu_count() or 2) // args.nproc),
        },
        "units": {
            "time": "ms per step (zero_grad + forward + backward + step)",
            "memory": "bytes per rank: `memory` is the rank with the most model state, `memory_per_rank` all",
        },
        "formulas_bytes": {
            "ddp": 16 * n,
            "stage1": 4 * n + 4 * n + 8 * n // args.nproc,
            "stage2": 4 * n + 12 * n // args.nproc,
            "stage3": 16 * n // args.nproc,
        },
        "loss_check": {"rtol_step0": LOSS_RTOL, **loss_check},
        "stages": stages,
        "notes": [
            "ratio = shardkit / peer (< 1: faster or smaller); memory ratios on model_state (at rest), "
            "params_in_step and model_state_in_step (= model_state + params_in_step - params: the persistent "
            "state plus the most params gathered at once, sampled at every block's forward start and after "
            "forward; transient buckets excluded, ours in peak_transient)",
            "stage 2: torch.fully_shard(reshard_after_forward=False) is ZeRO-2's communication, but FSDP2 "
            "reshards after backward: at rest it holds sharded params (stage-3 memory); params_in_step shows "
            "the gathered params it holds from forward to the end of backward",
            "stage 3: ours and FSDP2 have the same units (each transformer block + the root); DeepSpeed ZeRO-3 "
            "runs with its default stage3_param_persistence_threshold (params under 1e5 elements stay whole "
            "on every rank) and max_reuse_distance",
            "rows 2+cpu / 3+cpu: ours offload='cpu' vs DeepSpeed offload_optimizer {device: cpu} (torch AdamW "
            "on the CPU partition); on a CPU-only machine offload moves nothing off a device, so these rows "
            "time the offload machinery and carry no memory ratio",
            "every configuration starts from the same weights and batches: step-0 losses are asserted equal (loss_check)",
            "DeepSpeed keeps an fp32 master partition even for fp32 models (master_params)",
        ],
        "machine": _machine() | {"loadavg_start": load_start},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["shardkit bench zero", *args.argv]),
    }


def _label(key: str, kind: str) -> str:
    short = {"torch.ZeroRedundancyOptimizer": "ZRO+DDP", "torch.fully_shard": "FSDP2"}
    return f"ZeRO-{key}\n{short.get(kind, kind)}"


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Two panels: median step time (every row) and per-rank model-state memory (rows without offload)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional: the JSON carries everything
        return
    bars = [
        (_label(s, k), c, st.get("offload"))
        for s, st in report["stages"].items()
        if st["built"]
        for k, c in st["configs"].items()
        if c["available"]
    ]
    mem_bars = [(lab, c) for lab, c, off in bars if off is None]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [b[0] for b in bars]
    ax_t.bar(
        labels, [c["median_ms"] for _, c, _ in bars], color=["tab:blue" if SHARDKIT in lab else "tab:gray" for lab in labels]
    )
    ax_t.set_ylabel("median step time (ms)")
    if mem_bars:
        mlabels = [b[0] for b in mem_bars]
        colors = ["tab:blue" if SHARDKIT in lab else "tab:gray" for lab in mlabels]
        ax_m.bar(mlabels, [c["memory"]["model_state"] / 2**20 for _, c in mem_bars], color=colors, label="model state at rest")
        ax_m.scatter(
            mlabels,
            [c["memory"]["model_state_in_step"] / 2**20 for _, c in mem_bars],
            color="tab:red",
            marker="_",
            s=300,
            label="model state during step (+ gathered params)",
        )
        ax_m.set_ylim(top=1.3 * max(c["memory"]["model_state_in_step"] for _, c in mem_bars) / 2**20)  # legend room
        ax_m.legend(fontsize=7)
    ax_m.set_ylabel("MiB per rank")
    for ax in (ax_t, ax_m):
        ax.tick_params(axis="x", labelsize=6)
    fig.suptitle(f"{report['model']}, {report['params'] / 1e6:.1f}M params, {report['nproc']} ranks gloo", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(report: dict[str, Any]) -> str:
    """A plain-text summary: one line per configuration, ratios against each peer."""
    lines = [f"{report['model']}, {report['params'] / 1e6:.1f}M params, {report['nproc']} ranks gloo"]
    for s, st in report["stages"].items():
        if not st["built"]:
            lines.append(f"ZeRO-{s}: {st['reason']}")
            continue
        for k, c in st["configs"].items():
            if not c["available"]:
                lines.append(f"ZeRO-{s:<5} {k:<30} unavailable: {c['reason'][:120]}")
                continue
            m = c["memory"]
            lines.append(
                f"ZeRO-{s:<5} {k:<30} median {c['median_ms']:9.1f} ms  min {c['min_ms']:9.1f} ms  "
                f"model state {m['model_state'] / 2**20:8.1f} MiB  in step {m['model_state_in_step'] / 2**20:8.1f} MiB"
            )
            if "profile_rank0" in c:
                phases = c["profile_rank0"]["phases_ms_per_step"]
                lines.append("    " + "  ".join(f"{k.split('::')[-1]} {v:.1f} ms" for k, v in phases.items()))
        for peer, r in st["ratios"].items():
            mem = f"  model state {r['model_state']:.3f}x  in step {r['model_state_in_step']:.3f}x" if "model_state" in r else ""
            lines.append(f"ZeRO-{s:<5} ours/{peer:<26} time {r['time_median']:.3f}x (min {r['time_min']:.3f}x){mem}")
    if "loss_check" in report:
        lc = report["loss_check"]
        lines.append(
            f"step-0 losses equal across configurations (max rel diff {lc.get('step0_max_rel_diff', 0):.2g}); "
            f"after one step: {lc.get('step1_max_rel_diff', 0):.2g}"
        )
    return "\n".join(lines)
