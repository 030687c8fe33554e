"""Context parallelism vs PyTorch's ring attention and DeepSpeed-Ulysses: the attention op, and a
TinyGPT training step's time and peak activation memory per rank, against sequence length.

Spawns ``--nproc`` local gloo ranks (one torch thread each on 2 cores) and measures, in one run:

1. **Attention op**, forward + backward, causal, fp32, ``[B, H, S, D]`` inputs (default B=1, H=8,
   D=64) at each full sequence length ``S`` in ``--seqs``, per rank at each cp in ``--cps``
   (default 2; 2 and 4 with ``--nproc 4``). Each rank holds ``S/cp`` tokens of q, k, v and of the
   upstream gradient (from one full tensor, the same seed on every rank). Methods:

   * ``sdpa_full_cp1`` (the baseline row): ``F.scaled_dot_product_attention`` over the whole
     sequence on one process (cp=1). Every rank runs it at once, each on its own core(s), so it
     sees the same machine as the cp methods do; its time is what one rank would spend without
     cp.
   * ``shardkit_ring_zigzag``: ``context_parallel_attention(mode="ring", layout="zigzag")``, vs
     ``torch_ring_load_balanced``: PyTorch's ring attention
     (``torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention``
     and ``_templated_ring_attention_backward``, driven with the CPU flash-attention ops, its
     head-tail load balancing on (``_cp_options.enable_load_balance=True``: the zigzag layout)
     and its default kv rotation (``_cp_options.rotate_method``, recorded in the JSON).
   * ``shardkit_ulysses_contiguous`` and ``shardkit_ulysses_zigzag``:
     ``context_parallel_attention(mode="ulysses")`` in each layout, vs ``deepspeed_ulysses``:
     DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention`` around ``F.scaled_dot_product_attention``
     (inputs ``[b, s/p, h, d]``, ``batch_dim_idx=0``, ``scatter_idx=2``, ``gather_idx=1``: the
     contiguous layout), as ``tests/context/test_context_parallel_attention.py`` drives both peers.

   Each method is first run once and its output and input gradients gathered to the full
   sequence (``gather_sequence``) and compared with the baseline's: the max abs differences are
   in the JSON (``max_abs_diff_vs_sdpa``, and between each shardkit method and its peer), and a
   difference above ``TOLERANCE`` stops the run. Then all methods are timed interleaved, repeat
   by repeat (the order rotated each repeat), each call after a barrier; a repeat's time is the
   slowest rank's. Peak memory per rank: the first settled of up to ``MEMORY_TRIES`` profiled
   calls per method (``MEMORY_METHOD``).

2. **Model level**: one training step's forward + backward (``par.forward_backward(x, y)``, no
   optimizer step) of TinyGPT (``shardkit.models``; default d_model=128, 2 layers, 8 heads,
   vocab 256, batch 1, dropout 0, tied embeddings, position table = the sequence length) at each
   ``--model-seqs`` length. Configurations: ``cp1`` is ``parallelize(model, None, dp="none")``
   on each rank (the whole sequence, no communication); ``cp{N}_ring`` is
   ``parallelize(model, ctx, dp="ddp", cp={"plan": gpt_cp_plan(), "mode": "ring"})`` at each cp
   of ``--cps`` (each rank its ``S/cp`` tokens, zigzag; gradients averaged over dp_cp), the
   configuration the issue's goal is about; ``cp{N}_ulysses`` is the same with
   ``"mode": "ulysses"`` (``--model-modes``), which runs the stock SDPA kernel on whole
   sequences of fewer heads, so it shows how much of ring's numbers are its attention kernels;
   ``cp{N}_hybrid`` (at cp >= 4) is ``"mode": "hybrid", "ulysses_size": 2``: all-to-all within
   pairs of cp ranks, the ring across the pairs (Megatron-Core's ``a2a+p2p``).
   Step time: min/median over interleaved repeats (slowest rank per repeat). Peak activation
   memory: the profiler peak of a ``forward_backward`` above its start, the first settled of up
   to ``MEMORY_TRIES`` calls (``MEMORY_METHOD``; the
   gradients of an earlier step are already allocated and accumulated into, so this is
   activations and temporaries), the max over ranks. Reported: per-rank memory over cp1's at the
   same length (``memory_ratio_vs_cp1``; ideal ``1/cp``) and that times cp
   (``memory_over_ideal``; the goal is at most 1.10). Every configuration's loss must equal
   cp1's, and its gradients (averaged over dp_cp) too (``max_abs_grad_diff_vs_cp1``).

Results: ``perf/results/context_parallel_cpu.json`` and ``context_parallel_cpu.png`` (``--out``
to write elsewhere; ``--quick`` runs add ``_quick`` to the names, ``--nproc N`` other than 2 adds
``_nprocN``: the README's table reads the 2-rank file). Timings on a shared machine are noisy;
the interleaving is what keeps the ratios fair.

    python perf/context_parallel.py                          # full run (~11 min measured on 2 busy shared cores)
    python perf/context_parallel.py --quick --out /tmp/cp    # smoke run: tiny sizes (used by the tests; 30-90 s, mostly start-up)
    python perf/context_parallel.py --nproc 4                # also cp=4: context_parallel_cpu_nproc4.json (times need >= 4 cores to mean anything; memory does not)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardkit.comm import ParallelContext
from shardkit.models import TinyGPT
from shardkit.parallel import parallelize
from shardkit.parallel.profiled_peak import settled_peak_bytes
from shardkit.parallel.context import context_parallel_attention, gather_sequence, gpt_cp_plan, shard_sequence

from bench_workers import machine_info, reporting_errors, run_workers, worker_env
from tp import summarize

BASELINE = "sdpa_full_cp1"
RING = "shardkit_ring_zigzag"
TORCH_RING = "torch_ring_load_balanced"
ULYSSES_CONTIGUOUS = "shardkit_ulysses_contiguous"
ULYSSES_ZIGZAG = "shardkit_ulysses_zigzag"
DEEPSPEED = "deepspeed_ulysses"
METHODS = (BASELINE, RING, TORCH_RING, ULYSSES_CONTIGUOUS, ULYSSES_ZIGZAG, DEEPSPEED)
#: (shardkit method, its peer): the ratios the JSON reports besides the ones vs the baseline
PEER_OF = {RING: TORCH_RING, ULYSSES_CONTIGUOUS: DEEPSPEED, ULYSSES_ZIGZAG: DEEPSPEED}
#: column labels of the printed table
SHORT = {
    BASELINE: "sdpa cp=1",
    RING: "sk ring zz",
    TORCH_RING: "torch ring",
    ULYSSES_CONTIGUOUS: "sk ulysses ct",
    ULYSSES_ZIGZAG: "sk ulysses zz",
    DEEPSPEED: "ds ulysses",
}
#: max abs difference (output and input gradients, fp32) from the cp=1 SDPA that stops the run
TOLERANCE = 1e-3
#: the all-to-all group size of the model rows' hybrid mode (cp 4: 2 x 2)
HYBRID_ULYSSES = 2
#: most profiled calls per method until every rank has had a settled one (MEMORY_METHOD)
MEMORY_TRIES = 24

MEMORY_METHOD = (
    "torch.profiler(profile_memory=True) records every allocation and free of torch's CPU allocator "
    "(including temporaries inside ATen ops and the tensors the collectives send and receive); the events "
    "are replayed in time order and the peak of the running sum above the start of the measured call is "
    "reported (shardkit.parallel.profiled_peak), per rank, then the max over ranks. Attention: the inputs (this "
    "rank's q, k, v, upstream gradient) exist before the call and are not counted; the output, the input "
    "gradients and everything saved or temporary are. Model: the batch and the gradients of an earlier "
    "step exist before the call (backward accumulates into them), so the peak is activations plus "
    "temporaries. gloo's own staging buffers are not torch allocations and are not seen. The trace holds "
    "only the profiling thread's frees: a collective's tensor that gloo's worker thread releases last is "
    "freed unseen and would count as alive to the end of the call. So calls are profiled (separate from "
    "the timed calls) until each rank has had a settled one, a call that frees everything it allocated, "
    "at most MEMORY_TRIES each (shardkit.parallel.profiled_peak.settled_peak_bytes); each rank reports "
    "its first settled call's peak (memory_settled_call_per_rank: its number, or -MEMORY_TRIES with the "
    "smallest peak when none settled)."
)
TIMING_METHOD = (
    "wall time of one call (forward + backward) per method per repeat, each call after a barrier over "
    "all ranks; a repeat's time is the slowest rank's; methods interleaved repeat by repeat, the order "
    "rotated by one each repeat; min and median over repeats. Every method's first call (the correctness "
    "check) is untimed and warms it up (plus --warmup untimed calls). Repeats per (cp, length): as many as "
    "fit --round-budget-s given the first calls' time (the slowest rank's), at least --repeats and at most "
    "--max-repeats (recorded as `repeats`)"
)


# ---------------------------------------------------------------------------------------------
# helpers


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Per name, this rank's seconds per repeat (the names run round-robin, order rotated)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(_timed(fns[name]))
    return samples


def _repeats(round_s: float, least: int, args: argparse.Namespace) -> int:
    """Timed repeats for a set of methods whose untimed first calls took ``round_s`` seconds on
    this rank (the same answer on every rank: the slowest rank's time decides)."""
    t = torch.tensor([round_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(least, min(args.max_repeats, int(args.round_budget_s / max(t.item(), 1e-9))))


def _over_ranks(
    samples: dict[str, list[float]], peaks: dict[str, tuple[int, int]]
) -> tuple[dict[str, list[list[float]]], dict[str, list[tuple[int, int]]]]:
    """Every rank's samples and peaks (collective over the world)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (samples, peaks))
    return (
        {k: [g[0][k] for g in gathered] for k in samples},
        {k: [g[1][k] for g in gathered] for k in peaks},
    )


def _settled_peaks(fns: dict[str, Callable[[], Any]]) -> dict[str, tuple[int, int]]:
    """``{name: (peak bytes, settled call)}`` on this rank (collective over the world: every rank
    profiles each method equally often; see MEMORY_METHOD)."""
    return {name: settled_peak_bytes(fn, tries=MEMORY_TRIES, group=dist.group.WORLD) for name, fn in fns.items()}


def _row(per_rank: list[list[float]], peaks: list[tuple[int, int]] | None) -> dict[str, Any]:
    """Min/median over repeats of the slowest rank's time per repeat, and the peak memory."""
    slowest = [max(r) for r in zip(*per_rank)]
    out: dict[str, Any] = {"available": True, **summarize(slowest)}
    out["samples_ms"] = [round(1e3 * s, 3) for s in slowest]
    out["median_ms_per_rank"] = [1e3 * statistics.median(r) for r in per_rank]
    if peaks is not None:
        out["peak_bytes"] = max(p for p, _ in peaks)
        out["peak_bytes_per_rank"] = [p for p, _ in peaks]
        out["memory_settled_call_per_rank"] = [c for _, c in peaks]
    return out


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# 1. attention op


def _deepspeed() -> tuple[Any, str | None]:
    """DeepSpeed's DistributedAttention class and version, or (None, why not)."""
    try:
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")  # adopts the initialized default group
        return DistributedAttention, deepspeed.__version__
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        return None, f"{type(exc).__name__}: {exc}"


def _attention_methods(
    ctx: ParallelContext, S: int, args: argparse.Namespace, ds_cls: Any
) -> tuple[dict[str, tuple[str | None, Callable[[], tuple[torch.Tensor, ...]]]], dict[str, str]]:
    """``{name: (layout or None for the full sequence, fn)}``; ``fn()`` runs forward + backward and
    returns ``(out, dq, dk, dv)`` as ``[B, H, S or S/cp, D]``. And ``{name: why}`` for the peers
    that cannot run."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    aten = torch.ops.aten
    B, H, D = args.batch, args.heads, args.head_dim
    g = torch.Generator().manual_seed(S)
    full = [torch.randn(B, H, S, D, generator=g) for _ in range(4)]  # q, k, v, dout: the same on every rank
    shards = {lay: [shard_sequence(t, ctx, dim=2, layout=lay).contiguous() for t in full] for lay in ("zigzag", "contiguous")}
    group = ctx.group("cp")

    def leaves(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.detach().requires_grad_() for t in ts[:3]]  # no copy: fresh leaves on the same storage

    def sdpa_full() -> tuple[torch.Tensor, ...]:
        q, k, v = leaves(full)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(full[3])
        return out.detach(), q.grad, k.grad, v.grad

    def shardkit(mode: str, layout: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            q, k, v = leaves(shards[layout])
            out = context_parallel_attention(q, k, v, ctx=ctx, mode=mode, causal=True, layout=layout)
            out.backward(shards[layout][3])
            return out.detach(), q.grad, k.grad, v.grad

        return run

    def torch_ring() -> tuple[torch.Tensor, ...]:
        q, k, v, dout = shards["zigzag"]
        out, lse = torch_cp._templated_ring_attention(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True
        )[:2]
        dq, dk, dv = torch_cp._templated_ring_attention_backward(
            group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default, grad_out=dout,
            grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=True, dropout_p=0.0,
        )[:3]  # fmt: skip
        return out, dq, dk, dv

    methods: dict[str, tuple[str | None, Callable[[], tuple[torch.Tensor, ...]]]] = {
        BASELINE: (None, sdpa_full),
        RING: ("zigzag", shardkit("ring", "zigzag")),
        TORCH_RING: ("zigzag", torch_ring),
        ULYSSES_CONTIGUOUS: ("contiguous", shardkit("ulysses", "contiguous")),
        ULYSSES_ZIGZAG: ("zigzag", shardkit("ulysses", "zigzag")),
    }
    missing: dict[str, str] = {}
    if isinstance(ds_cls, str):
        missing[DEEPSPEED] = ds_cls
    else:

        def local_attention(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:  # [b, s, h/p, d]
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qh, kh, vh)), is_causal=True).transpose(1, 2)

        peer = ds_cls(local_attention, group, scatter_idx=2, gather_idx=1)
        bshd = [t.transpose(1, 2).contiguous() for t in shards["contiguous"]]  # [b, s/p, h, d], made once

        def deepspeed_ulysses() -> tuple[torch.Tensor, ...]:
            q, k, v = leaves(bshd)
            out = peer(q, k, v, batch_dim_idx=0)
            out.backward(bshd[3])
            return tuple(t.transpose(1, 2) for t in (out.detach(), q.grad, k.grad, v.grad))

        methods[DEEPSPEED] = ("contiguous", deepspeed_ulysses)
    return methods, missing


def attention_bench(ctx: ParallelContext, S: int, args: argparse.Namespace, ds_cls: Any) -> dict[str, Any]:
    """Every method at cp = ``ctx.size("cp")`` and full length ``S`` (collective over the world)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

    saved = torch_cp._cp_options.enable_load_balance
    torch_cp._cp_options.enable_load_balance = True  # head-tail = zigzag
    try:
        methods, missing = _attention_methods(ctx, S, args, ds_cls)
        # correctness, once: every method's output and gradients against the cp=1 SDPA's
        t0 = time.perf_counter()
        full = [t.detach() for t in methods[BASELINE][1]()]
        round_s = time.perf_counter() - t0
        diffs: dict[str, dict[str, float]] = {}
        gathered: dict[str, list[torch.Tensor]] = {}
        for name, (layout, fn) in methods.items():
            if layout is None:
                continue
            t0 = time.perf_counter()
            result = fn()
            round_s += time.perf_counter() - t0
            gathered[name] = [gather_sequence(t.detach().contiguous(), ctx, dim=2, layout=layout) for t in result]
            del result
            diffs[name] = {k: _max_abs(a, b) for k, a, b in zip(("out", "dq", "dk", "dv"), gathered[name], full)}
        del full
        peer_diffs = {
            f"{ours}_vs_{peer}": max(_max_abs(a, b) for a, b in zip(gathered[ours], gathered[peer]))
            for ours, peer in PEER_OF.items()
            if peer in gathered
        }
        del gathered
        bad = {k: v for k, v in diffs.items() if max(v.values()) > TOLERANCE}
        if bad:
            raise AssertionError(
                f"cp={ctx.size('cp')} S={S}: outputs differ from full-sequence SDPA by more than {TOLERANCE}: {bad}"
            )
        fns = {name: fn for name, (_, fn) in methods.items()}
        repeats = _repeats(round_s, args.repeats, args)
        samples = _interleaved(fns, args.warmup, repeats)
        peaks = _settled_peaks(fns)
    finally:
        torch_cp._cp_options.enable_load_balance = saved
    per_rank, peaks_per_rank = _over_ranks(samples, peaks)
    rows: dict[str, Any] = {name: _row(per_rank[name], peaks_per_rank[name]) for name in fns}
    rows.update({name: {"available": False, "why": why} for name, why in missing.items()})
    for name, (layout, _) in methods.items():
        rows[name]["layout"] = layout or "full sequence"
    ratios: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        if row["available"] and name != BASELINE:
            base = rows[BASELINE]
            ratios[f"{name}/{BASELINE}"] = {"median": row["median_ms"] / base["median_ms"], "min": row["min_ms"] / base["min_ms"]}
    for ours, peer in PEER_OF.items():
        if rows[peer]["available"]:
            a, b = rows[ours], rows[peer]
            ratios[f"{ours}/{peer}"] = {
                "median": a["median_ms"] / b["median_ms"],
                "min": a["min_ms"] / b["min_ms"],
                "peak_bytes": a["peak_bytes"] / b["peak_bytes"],
            }
    return {
        "seq_len": S,
        "tokens_per_rank": S // ctx.size("cp"),
        "repeats": repeats,
        "shape": [args.batch, args.heads, S, args.head_dim],
        "methods": rows,
        "ratios": ratios,
        "max_abs_diff_vs_sdpa": diffs,
        "max_abs_diff_vs_peer": peer_diffs,
    }


# ---------------------------------------------------------------------------------------------
# 2. model level


def model_bench(ctxs: dict[int, ParallelContext], S: int, args: argparse.Namespace) -> dict[str, Any]:
    """TinyGPT forward + backward at cp = 1 and every cp of ``ctxs`` in every ``--model-modes``
    mode (collective over the world). Configurations are named ``cp1`` and ``cp{cp}_{mode}``."""
    torch.manual_seed(0)  # the same weights on every rank and every configuration
    dense = TinyGPT(args.vocab, args.d_model, args.layers, args.model_heads, S, dropout=0.0)
    n_params = sum(p.numel() for p in dense.parameters())
    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    x = torch.randint(args.vocab, (args.model_batch, S), generator=g)
    y = torch.randint(args.vocab, (args.model_batch, S), generator=g)
    configs: dict[str, tuple[int, str | None]] = {"cp1": (1, None)}
    pars = {"cp1": parallelize(copy.deepcopy(dense), None, dp="none")}
    for cp, ctx in ctxs.items():
        for mode in args.model_modes:
            if mode == "hybrid" and cp < 2 * HYBRID_ULYSSES:
                continue  # hybrid with one all-to-all group is Ulysses, with groups of one rank ring
            opts = {"plan": gpt_cp_plan(), "mode": mode, **({"ulysses_size": HYBRID_ULYSSES} if mode == "hybrid" else {})}
            configs[f"cp{cp}_{mode}"] = (cp, mode)
            pars[f"cp{cp}_{mode}"] = parallelize(copy.deepcopy(dense), ctx, dp="ddp", cp=opts)
    del dense
    # first step, untimed (it warms up): every configuration's loss and (dp_cp-averaged) gradients are cp=1's
    losses, grads, round_s = {}, {}, 0.0
    for name, par in pars.items():
        t0 = time.perf_counter()
        losses[name] = par.forward_backward(x, y).item()
        round_s += time.perf_counter() - t0
        grads[name] = [p.grad.detach().clone() for p in par.parameters()]
    grad_diff = {name: max(_max_abs(a, b) for a, b in zip(grads[name], grads["cp1"])) for name in pars if name != "cp1"}
    del grads
    for name, value in losses.items():
        assert abs(value - losses["cp1"]) <= 1e-4 * abs(losses["cp1"]), f"S={S}: {name} loss {value}, cp=1 loss {losses['cp1']}"
    fns = {name: (lambda par=par: par.forward_backward(x, y)) for name, par in pars.items()}
    repeats = _repeats(round_s, args.model_repeats, args)
    samples = _interleaved(fns, args.warmup, repeats)
    peaks = _settled_peaks(fns)
    per_rank, peaks_per_rank = _over_ranks(samples, peaks)
    rows = {name: _row(per_rank[name], peaks_per_rank[name]) for name in fns}
    for name, (cp, mode) in configs.items():
        rows[name].update(cp=cp, mode=mode, tokens_per_rank=S // cp, loss=losses[name])
    base = rows["cp1"]
    others = [name for name in rows if name != "cp1"]
    out: dict[str, Any] = {"seq_len": S, "params": n_params, "repeats": repeats, "configs": rows}
    out["memory_ratio_vs_cp1"] = {name: rows[name]["peak_bytes"] / base["peak_bytes"] for name in others}
    out["memory_over_ideal"] = {name: rows[name]["cp"] * out["memory_ratio_vs_cp1"][name] for name in others}
    out["time_ratio_vs_cp1"] = {
        name: {"median": rows[name]["median_ms"] / base["median_ms"], "min": rows[name]["min_ms"] / base["min_ms"]}
        for name in others
    }
    out["max_abs_grad_diff_vs_cp1"] = grad_diff
    return out


# ---------------------------------------------------------------------------------------------
# driver


def worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    worker_env(rank, world, port)
    ctxs: dict[int, ParallelContext] = {}
    try:
        with reporting_errors(rank, queue):
            first = ParallelContext.from_env(cp=args.cps[0], backend="gloo")  # initializes the world
            ctxs = {args.cps[0]: first, **{cp: ParallelContext.from_world(cp=cp) for cp in args.cps[1:]}}
            ds_cls, ds_version = (None, "not selected (--no-deepspeed)") if args.no_deepspeed else _deepspeed()
            if ds_cls is None:
                ds_cls = ds_version
            from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp

            results: dict[str, Any] = {
                "deepspeed": ds_version,
                "torch_rotate_method": torch_cp._cp_options.rotate_method.name,
                "attention": {},
                "model": {},
            }
            for cp, ctx in ctxs.items():
                results["attention"][f"cp{cp}"] = {}
                for S in args.seqs:
                    results["attention"][f"cp{cp}"][str(S)] = attention_bench(ctx, S, args, ds_cls)
                    if rank == 0:
                        _print_attention(cp, results["attention"][f"cp{cp}"][str(S)])
            for S in args.model_seqs:
                results["model"][str(S)] = model_bench(ctxs, S, args)
                if rank == 0:
                    _print_model(results["model"][str(S)])
            if rank == 0:
                queue.put(results)
            dist.barrier()
    finally:
        for ctx in reversed(list(ctxs.values())):
            ctx.destroy(wait_for_peers=False)
        if dist.is_initialized():
            dist.destroy_process_group()


def _print_attention(cp: int, e: dict[str, Any]) -> None:
    print(f"attention cp={cp} S={e['seq_len']} ({e['tokens_per_rank']} tokens/rank), fwd+bwd per rank:", flush=True)
    base = e["methods"][BASELINE]
    for name in METHODS:
        m = e["methods"][name]
        if not m["available"]:
            print(f"  {name:<28} unavailable: {m['why'][:80]}", flush=True)
            continue
        line = f"  {name:<28} min {m['min_ms']:9.1f} ms  median {m['median_ms']:9.1f} ms  peak {m['peak_bytes'] / 2**20:8.1f} MiB"
        line += f"  x{m['median_ms'] / base['median_ms']:.3f} of cp=1"
        if name in PEER_OF and f"{name}/{PEER_OF[name]}" in e["ratios"]:
            r = e["ratios"][f"{name}/{PEER_OF[name]}"]
            line += f"  x{r['median']:.3f} of {PEER_OF[name]} (min x{r['min']:.3f})"
        if name in e["max_abs_diff_vs_sdpa"]:
            line += f"  maxdiff {max(e['max_abs_diff_vs_sdpa'][name].values()):.1e}"
        print(line, flush=True)


def _print_model(e: dict[str, Any]) -> None:
    print(f"model S={e['seq_len']} ({e['params'] / 1e6:.2f}M params), forward+backward per rank:", flush=True)
    for name, c in e["configs"].items():
        line = (
            f"  {name:<12} {c['tokens_per_rank']:>6} tokens/rank  min {c['min_ms']:9.1f} ms  median {c['median_ms']:9.1f} ms  "
            f"peak {c['peak_bytes'] / 2**20:8.1f} MiB"
        )
        if name != "cp1":
            line += (
                f"  memory x{e['memory_ratio_vs_cp1'][name]:.3f} of cp1 (x{e['memory_over_ideal'][name]:.3f} of 1/cp)"
                f"  time x{e['time_ratio_vs_cp1'][name]['median']:.3f}"
            )
        print(line, flush=True)


def _table(report: dict[str, Any]) -> str:
    """The whole run as a plain-text table."""
    lines = ["Attention fwd+bwd per rank (causal fp32, median ms; ratio = median / median):"]
    head = f"{'cp':>3} {'S':>6} " + " ".join(f"{SHORT[n]:>13}" for n in METHODS)
    head += f" {'ring/torch':>10} {'ulyCt/DS':>8} {'ulyZz/DS':>8} {'ring/cp1':>8}"
    lines.append(head)
    for cp, per_s in report["attention"].items():
        for S, e in per_s.items():
            cells = [f"{e['methods'][n]['median_ms']:13.1f}" if e["methods"][n]["available"] else f"{'n/a':>13}" for n in METHODS]
            r = e["ratios"]

            def ratio(key: str, width: int, r: dict = r) -> str:
                return f"{r[key]['median']:{width}.3f}" if key in r else f"{'n/a':>{width}}"

            row = f"{cp[2:]:>3} {S:>6} " + " ".join(cells)
            row += f" {ratio(f'{RING}/{TORCH_RING}', 10)} {ratio(f'{ULYSSES_CONTIGUOUS}/{DEEPSPEED}', 8)}"
            row += f" {ratio(f'{ULYSSES_ZIGZAG}/{DEEPSPEED}', 8)} {ratio(f'{RING}/{BASELINE}', 8)}"
            lines.append(row)
    lines.append("")
    lines.append(
        "TinyGPT forward+backward per rank (zigzag): median ms | peak MiB | memory vs cp1 (ideal 1/cp) | that x cp (goal <= 1.10)"
    )
    for S, e in report["model"].items():
        for name, c in e["configs"].items():
            row = f"  S={S:>6} {name:<12} {c['median_ms']:9.1f} ms  {c['peak_bytes'] / 2**20:8.1f} MiB"
            if name != "cp1":
                row += (
                    f"  x{e['memory_ratio_vs_cp1'][name]:.3f} (ideal {1 / c['cp']:.3f})  x{e['memory_over_ideal'][name]:.3f}"
                    f"  time x{e['time_ratio_vs_cp1'][name]['median']:.3f}"
                )
            lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (cp=4 runs too when 4 divides it)")
    p.add_argument("--cps", type=int, nargs="+", default=None, help="cp sizes (default: 2, and 4 when --nproc allows)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="attention: full sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=0, help="untimed calls per method besides the first (the check)")
    p.add_argument("--repeats", type=int, default=3, help="attention: least timed repeats per method")
    p.add_argument("--model-seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model-heads", type=int, default=8)
    p.add_argument("--model-batch", type=int, default=1)
    p.add_argument(
        "--model-modes",
        nargs="+",
        default=["ring", "ulysses", "hybrid"],
        choices=["ring", "ulysses", "hybrid"],
        help="cp modes of the model rows (ring is the one the goal is about; ulysses shows what the attention kernels "
        "cost; hybrid: all-to-all groups of HYBRID_ULYSSES ranks, the ring across them, at cp >= 2 x HYBRID_ULYSSES)",
    )
    p.add_argument("--model-repeats", type=int, default=3, help="model: least timed repeats per configuration")
    p.add_argument("--max-repeats", type=int, default=7, help="most timed repeats per (cp, length)")
    p.add_argument("--round-budget-s", type=float, default=25.0, help="seconds of timed repeats aimed at per (cp, length)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed's DistributedAttention out")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, seconds)")
    p.add_argument("--out", type=Path, default=Path("perf/results"), help="output directory (default perf/results)")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.batch, args.heads, args.head_dim = [128], 1, 4, 16
        args.model_seqs, args.vocab, args.d_model, args.layers, args.model_heads = [128], 64, 32, 1, 4
        args.warmup, args.repeats, args.model_repeats, args.max_repeats = 0, 2, 2, 2
    if args.cps is None:
        args.cps = [cp for cp in (2, 4) if args.nproc % cp == 0]
    for cp in args.cps:
        if cp < 2 or args.nproc % cp:
            raise SystemExit(f"--cps: each cp must be >= 2 and divide --nproc {args.nproc}, got {cp}")
        for S in [*args.seqs, *args.model_seqs]:
            if S % (2 * cp):
                raise SystemExit(f"sequence length {S} must be a multiple of 2*cp = {2 * cp} (zigzag)")
        if args.heads % cp or args.model_heads % cp:
            raise SystemExit(f"heads ({args.heads}, model {args.model_heads}) must divide by cp={cp} (Ulysses)")
    try:
        raw = run_workers(worker, args.nproc, args, timeout=3600, what="context-parallel benchmark")
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    if "error" in raw:
        raise SystemExit(f"benchmark worker failed: {raw['error']}")
    report: dict[str, Any] = {
        "benchmark": "context_parallel",
        "device": "cpu",
        "backend": "gloo",
        "nproc": args.nproc,
        "cps": args.cps,
        "attention_shape": f"B={args.batch} H={args.heads} D={args.head_dim}, causal, fp32, S = full sequence length",
        "model": (
            f"TinyGPT vocab={args.vocab} d={args.d_model} layers={args.layers} heads={args.model_heads} "
            f"batch={args.model_batch} dropout=0 (tied), cp modes {'/'.join(args.model_modes)}, layout zigzag, dp=ddp (cp=1: one process, dp=none)"
        ),
        "attention": raw["attention"],
        "model_level": raw["model"],
        "peers": {
            TORCH_RING: f"torch {torch.__version__} _templated_ring_attention (CPU flash ops), enable_load_balance=True, "
            f"rotate_method={raw['torch_rotate_method']}",
            DEEPSPEED: f"deepspeed {raw['deepspeed']} sequence.layer.DistributedAttention around F.scaled_dot_product_attention",
        },
        "tolerance": TOLERANCE,
        "timing_method": TIMING_METHOD,
        "memory_method": MEMORY_METHOD,
        "memory_tries": MEMORY_TRIES,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "deepspeed": raw["deepspeed"],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads_per_rank": max(1, (os.cpu_count() or 2) // args.nproc),
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "context_parallel_cpu" + ("" if args.nproc == 2 else f"_nproc{args.nproc}") + ("_quick" if args.quick else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(_table({"attention": report["attention"], "model": report["model_level"]}))
    _plot(report, args.out / f"{stem}.png")
    print(f"wrote {args.out / (stem + '.json')} and .png")
    return report


def _plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (ax_t, ax_r), (ax_m, ax_s) = axes
    styles = ["-", "--", ":"]
    for i, (cp, per_s) in enumerate(report["attention"].items()):
        seqs = sorted(per_s, key=int)
        x = [int(s) for s in seqs]
        for name in METHODS:
            if not per_s[seqs[0]]["methods"][name]["available"] or (i and name == BASELINE):
                continue
            ax_t.plot(
                x,
                [per_s[s]["methods"][name]["median_ms"] for s in seqs],
                "o" + styles[i % 3],
                label=name if name == BASELINE else f"{name} ({cp})",
            )
        for key in (
            f"{RING}/{TORCH_RING}",
            f"{ULYSSES_CONTIGUOUS}/{DEEPSPEED}",
            f"{ULYSSES_ZIGZAG}/{DEEPSPEED}",
            f"{RING}/{BASELINE}",
        ):
            if key in per_s[seqs[0]]["ratios"]:
                ax_r.plot(x, [per_s[s]["ratios"][key]["median"] for s in seqs], "o" + styles[i % 3], label=f"{key} ({cp})")
    ax_t.set_ylabel("attention fwd+bwd per rank, median ms")
    ax_r.set_ylabel("ratio of medians")
    ax_r.axhline(1.0, color="grey", lw=0.8)
    model = report["model_level"]
    seqs = sorted(model, key=int)
    x = [int(s) for s in seqs]
    for name, c in model[seqs[0]]["configs"].items():
        style = "o--" if c["mode"] == "ulysses" else "o-"
        ax_m.plot(x, [model[s]["configs"][name]["peak_bytes"] / 2**20 for s in seqs], style, label=name)
        ax_s.plot(x, [model[s]["configs"][name]["median_ms"] for s in seqs], style, label=name)
    for cp in report["cps"]:
        ideal = [model[s]["configs"]["cp1"]["peak_bytes"] / 2**20 / cp for s in seqs]
        ax_m.plot(x, ideal, "k:", lw=0.8, label=f"cp1 / {cp} (ideal)")
    ax_m.set_ylabel("TinyGPT fwd+bwd peak activation MiB per rank")
    ax_s.set_ylabel("TinyGPT fwd+bwd per rank, median ms")
    for ax in (ax_t, ax_r, ax_m, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("full sequence length")
        ax.legend(fontsize=6)
    for ax in (ax_t, ax_r, ax_m, ax_s):
        ax.set_yscale("log")
    fig.suptitle(
        f"context parallelism, {report['nproc']} gloo ranks, {report['threads_per_rank']} thread(s)/rank, CPU fp32\n"
        f"attention {report['attention_shape']}\n{report['model']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
