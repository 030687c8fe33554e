"""``shardkit.initialize`` vs ``deepspeed.initialize``: seed 002's ZeRO-2 config, a Hugging Face GPT-2
built from config, 2 gloo ranks on the CPU — step time and model-state memory per rank.

Both engines get the same config dict (``shardkit/examples/zero2_config_accelerate.json``, its "auto"
values filled as Hugging Face's Trainer fills them; DeepSpeed reads no "auto"), the same model
(same seed) and the same batches; the loop is the DeepSpeed loop, only the engine differs:
``loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()``. Steps of
the two engines are interleaved over repeats, each timed between barriers; min and median per
engine, ratio = shardkit / DeepSpeed (target <= 1.00).

fp16 is switched off by default (``--precision fp32``): DeepSpeed's CPU accelerator has no fp16,
and CPU fp16 matmuls are not what a GPU run measures. ``--precision config`` keeps the config's
fp16 (shardkit only, if DeepSpeed refuses).

Usage:
    .venv/bin/python perf/engine.py                        # GPT-2 d=768, 4 layers -> perf/results/engine_cpu.json
    .venv/bin/python perf/engine.py --quick --out /tmp/    # tiny model (smoke)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench_workers import machine_info, run_workers, worker_env

from shardkit.examples import config_path

CONFIG = config_path("zero2_config_accelerate.json")
ENGINES = ("shardkit", "deepspeed")
CATEGORIES = ("params", "grads", "master_params", "optimizer_state")


def _auto(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        lr=1e-4, weight_decay=0.01, warmup_min_lr=0.0, warmup_num_steps=10, total_num_steps=1000,
        gradient_clipping=1.0, train_micro_batch_size_per_gpu=args.batch,
    )  # fmt: skip


def filled_config(args: argparse.Namespace) -> dict[str, Any]:
    """The seed config with every "auto" replaced (what HF's Trainer hands DeepSpeed)."""
    cfg = json.loads(CONFIG.read_text())
    auto = _auto(args)
    if args.precision == "fp32":
        cfg["fp16"]["enabled"] = False
    cfg["optimizer"]["params"].update(lr=auto["lr"], weight_decay=auto["weight_decay"])
    cfg["scheduler"]["params"].update(
        warmup_min_lr=auto["warmup_min_lr"], warmup_max_lr=auto["lr"],
        warmup_num_steps=auto["warmup_num_steps"], total_num_steps=auto["total_num_steps"],
    )  # fmt: skip
    cfg.update(gradient_clipping=auto["gradient_clipping"], train_micro_batch_size_per_gpu=args.batch)
    cfg["train_batch_size"] = args.batch * args.nproc * cfg["gradient_accumulation_steps"]
    return cfg


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=args.n_layers, n_embd=args.d_model, n_head=args.n_heads, n_positions=args.seq_len,
        vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def deepspeed_memory(engine: Any) -> dict[str, int]:
    """DeepSpeed ZeRO-2's model state on this rank, by the same categories as ours."""
    o = engine.optimizer
    grads = [getattr(o, "grads_in_partition", None), *(getattr(o, "ipg_buffer", None) or [])]
    grads += list((getattr(o, "averaged_gradients", None) or {}).values())
    flat = [t for g in grads for t in (g if isinstance(g, list) else [g])]
    state = [v for s in o.optimizer.state.values() for v in s.values()]
    mem = {
        "params": _bytes(engine.module.parameters()),
        "grads": _bytes([p.grad for p in engine.module.parameters()] + flat),
        "master_params": _bytes(getattr(o, "single_partition_of_fp32_groups", [])),
        "optimizer_state": _bytes(state),
    }
    mem["model_state"] = sum(mem.values())
    return mem


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    worker_env(rank, world, port, threads=args.threads)
    import torch.distributed as dist

    import shardkit
    from shardkit.comm import ParallelContext

    ctx = ParallelContext.from_env(backend="gloo")
    cfg = filled_config(args)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(args.vocab, (args.batch, args.seq_len), generator=gen)
    engines: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    engines["shardkit"], *_ = shardkit.initialize(model=build_model(args), config=cfg, ctx=ctx)
    if "deepspeed" in args.engines:
        ok = torch.ones(1)
        try:  # the optional peer: when it cannot run here, say why and go on
            import deepspeed

            model = build_model(args)
            engines["deepspeed"], *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        except Exception as exc:
            ok.zero_()
            unavailable["deepspeed"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            engines.pop("deepspeed", None)
            unavailable.setdefault("deepspeed", "failed on another rank")
    gas = cfg["gradient_accumulation_steps"]

    def step(engine: Any) -> float:
        for _ in range(gas):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        return loss.item()

    for e in engines.values():
        for _ in range(args.warmup):
            step(e)
    samples: dict[str, list[float]] = {k: [] for k in engines}
    for rep in range(args.repeats):  # interleaved, rotating the order, so load hits both alike
        order = list(engines.items())
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for name, e in order:
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(e)
                samples[name].append(time.perf_counter() - t0)
    memory = {"shardkit": {k: v for k, v in engines["shardkit"].memory_report().items() if isinstance(v, int)}}
    if "deepspeed" in engines:
        memory["deepspeed"] = deepspeed_memory(engines["deepspeed"])
    memories = [None] * world
    dist.all_gather_object(memories, memory)
    if rank == 0:
        n = sum(p.numel() for p in build_model(args).parameters())
        queue.put({"samples": samples, "unavailable": unavailable, "memory": memories, "n_params": n})
    dist.barrier()
    dist.destroy_process_group()


def _summary(samples: list[float]) -> dict[str, Any]:
    ms = [1e3 * s for s in samples]
    return {"min_ms": min(ms), "median_ms": statistics.median(ms), "n": len(ms)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--precision", choices=("fp32", "config"), default="fp32")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank (train_micro_batch_size_per_gpu)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cpu_count // nproc)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=Path("perf/results"))
    args = p.parse_args(argv)
    argv_used = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.d_model, args.n_layers, args.n_heads, args.vocab, args.seq_len, args.batch = 64, 2, 4, 128, 32, 2
        args.warmup, args.steps, args.repeats = 1, 1, 2

    try:
        raw = run_workers(_worker, args.nproc, args, timeout=args.timeout, what="engine benchmark")
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    engines: dict[str, Any] = {}
    for name in args.engines:
        if name in raw["samples"]:
            per_rank = [m[name] for m in raw["memory"]]
            engines[name] = {"available": True, **_summary(raw["samples"][name]), "memory_per_rank": per_rank}
        else:
            engines[name] = {"available": False, "reason": raw["unavailable"].get(name, "not run")}
    ratios = {}
    if engines.get("deepspeed", {}).get("available"):
        ours, peer = engines["shardkit"], engines["deepspeed"]
        ratios["shardkit / deepspeed"] = {
            "time_median": ours["median_ms"] / peer["median_ms"],
            "time_min": ours["min_ms"] / peer["min_ms"],
            "model_state_bytes_rank0": ours["memory_per_rank"][0]["model_state"] / peer["memory_per_rank"][0]["model_state"],
        }
    report = {
        "benchmark": "engine_zero2_config_step",
        "device": "cpu",
        "backend": "gloo",
        "nproc": args.nproc,
        "params": raw["n_params"],
        "model": f"transformers GPT2LMHeadModel from config: n_embd={args.d_model} n_layer={args.n_layers} "
        f"n_head={args.n_heads} vocab={args.vocab} seq_len={args.seq_len} (tied), batch/rank={args.batch}",
        "config": "shardkit/examples/zero2_config_accelerate.json (seed 002), auto values filled"
        + ("" if args.precision == "config" else ", fp16.enabled=false"),
        "settings": {"warmup": args.warmup, "steps": args.steps, "repeats": args.repeats, "precision": args.precision},
        "units": {
            "time": "ms per optimizer step (gradient_accumulation_steps × (forward + backward + engine.step))",
            "memory": "bytes of model state per rank, by category",
        },  # fmt: skip
        "engines": engines,
        "ratios": ratios,
        "notes": [
            "shardkit keeps fp32 gradient shards and reduces in fp32; the comparison is at fp32 on this CPU machine",
            "memory is model state (params, gradient buffers, fp32 masters, optimizer state), not process RSS: "
            "both engines run in the same processes",
        ],
        "machine": machine_info(),
        "command": " ".join(["perf/engine.py", *argv_used]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("engine_cpu" + ("_quick" if args.quick else "") + ".json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    for name, c in engines.items():
        line = (
            f"{c['min_ms']:8.1f} {c['median_ms']:8.1f} ms  model state rank0 {c['memory_per_rank'][0]['model_state'] / 2**20:.1f} MiB"
            if c["available"]
            else f"unavailable: {c['reason']}"
        )
        print(f"{name:10s} {line}")
    for name, r in ratios.items():
        print(f"{name}: median {r['time_median']:.2f}x, min {r['time_min']:.2f}x, memory {r['model_state_bytes_rank0']:.2f}x")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
