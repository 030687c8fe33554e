"""The configurations the ZeRO benchmark times (`perf/zero.py`): ours and its peers.

Each is a small runner with ``step(x, y)`` (``zero_grad`` + forward + loss + backward + step;
returns the loss) and ``memory(x, y)`` (one step, counting params, grads, master params and
optimizer state as distinct tensor storages, the same way for every configuration; ours from
``sdp.memory_report()``). Peers: torch ``ZeroRedundancyOptimizer`` over DDP (stage 1), FSDP2
``fully_shard`` with one unit per transformer block plus the root
(``reshard_after_forward=False`` for stage 2, ``True`` for stage 3) and DeepSpeed ZeRO of the
same stage (``deepspeed.initialize`` with a config dict, CPU accelerator, gloo), optionally with
``offload_optimizer: {device: cpu}`` against our ``offload="cpu"``.

``params_in_step`` is the largest total of parameter storages (shards + gathered) seen at the
start of every block's forward and right after the forward: the stage-3 units gathered at once
(FSDP2 and DeepSpeed hold the root's params, ours the root and the prefetched unit).

Example:
    >>> runner = build_runner("shardkit", 2, args, ctx)  # args as parsed by perf/zero.py
    >>> runner.step(x, y); runner.memory(x, y)["model_state"]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from shardkit.parallel.memory_report import storage_bytes  # the peers' bytes counted as ours

__all__ = [
    "CATEGORIES",
    "HYPER",
    "OFFLOAD_PEERS",
    "PEERS",
    "SHARDKIT",
    "Runner",
    "build_model",
    "build_runner",
    "storage_bytes",
]

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHARDKIT = "shardkit"
#: the peers of each stage (DeepSpeed optional: recorded as unavailable with a reason)
PEERS = {
    1: ("torch.ZeroRedundancyOptimizer", "deepspeed"),
    2: ("torch.fully_shard", "deepspeed"),
    3: ("torch.fully_shard", "deepspeed"),
}
#: the peers of an ``offload="cpu"`` row: DeepSpeed's ``offload_optimizer: {device: cpu}``
OFFLOAD_PEERS = ("deepspeed",)
CATEGORIES = ("params", "grads", "master_params", "optimizer_state")


def _state_tensors(state: Any) -> list[torch.Tensor]:
    return [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class Runner:
    """One configuration: ``step(x, y)`` runs a full training step; ``memory`` measures one."""

    name: str
    model: torch.nn.Module

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from shardkit.models import lm_loss

        loss = lm_loss(self.model(x), y)
        loss.backward()
        return loss.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.zero_grad()
        loss = self.forward_backward(x, y)
        self.opt.step()
        return loss

    def forward_sampled(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Forward, and the most parameter bytes alive at any block's start or after it.

        The hooks are registered after the wrappers' own, so each sample sees the unit its
        wrapper has just gathered.
        """
        seen = [0]

        def sample(*_: Any) -> None:
            seen[0] = max(seen[0], self.param_bytes_now())

        handles = [b.register_forward_pre_hook(sample) for b in self._blocks()]
        try:
            out = self.model(x)
        finally:
            for h in handles:
                h.remove()
        sample()
        return out, seen[0]

    def memory(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
        from shardkit.models import lm_loss

        self.zero_grad()
        logits, in_step = self.forward_sampled(x)
        lm_loss(logits, y).backward()
        grads = self._grads()
        self.opt.step()
        mem = {
            "params": storage_bytes(self._params()),
            "grads": grads,
            "master_params": self._master(),
            "optimizer_state": storage_bytes(_state_tensors(self._opt_state())),
        }
        mem["model_state"] = sum(mem[k] for k in CATEGORIES)
        mem["params_in_step"] = max(in_step, mem["params"])
        return mem

    # the peers' tensors (overridden where they live elsewhere)
    def _blocks(self) -> list[torch.nn.Module]:
        return list(self.model.module.blocks if hasattr(self.model, "module") else self.model.blocks)

    def param_bytes_now(self) -> int:
        """Parameter storages alive now: shards plus whatever is gathered (FSDP2's DTensor
        shards stay alive beside the unsharded params it registers while a unit is gathered)."""
        return storage_bytes([*self._params(), *self.model.parameters()])

    def _params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def _grads(self) -> int:
        return storage_bytes(p.grad for p in self.model.parameters())

    def _master(self) -> int:
        return 0

    def _opt_state(self) -> Any:
        return self.opt.state


class _Shardkit(Runner):
    def __init__(self, model: torch.nn.Module, ctx: Any, stage: int, bucket_mb: float, offload: str | None) -> None:
        from shardkit.kernels import FusedAdamW
        from shardkit.parallel import ShardedDataParallel, ZeroOptimizer

        self.name = SHARDKIT
        self.stage = stage
        # stage 3: wrap=None makes each block of the ModuleList a unit, the root holds the rest
        self.model = ShardedDataParallel(model, ctx, stage=stage, bucket_mb=bucket_mb, offload=offload)
        self.opt = ZeroOptimizer(self.model, FusedAdamW, **HYPER)

    def param_bytes_now(self) -> int:
        # gathered stage-3 units only: the persistent shards are memory_report()'s, and a freed
        # param points at a one-element placeholder (not a buffer)
        live = [p for p in self.model.module.parameters() if p.untyped_storage().nbytes() > p.element_size()]
        return storage_bytes(live) if self.stage == 3 else 0

    def memory(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
        from shardkit.models import lm_loss

        self.zero_grad()
        logits, gathered = self.forward_sampled(x)
        lm_loss(logits, y).backward()
        self.opt.step()
        rep = self.model.memory_report()
        mem = {k: rep[k] for k in CATEGORIES}
        mem["model_state"] = sum(mem.values())
        assert mem["model_state"] == rep["model_state"], rep  # the report's own sum, nothing left out
        mem["params_in_step"] = rep["params"] + gathered  # stages 1-2 never gather params
        mem["peak_transient"] = rep["peak_transient"]
        if rep["offloaded"]:  # off the device (on this CPU-only machine: elsewhere in host memory)
            mem["offloaded"] = rep["offloaded"]
        return mem


class _TorchZero(Runner):
    def __init__(self, model: torch.nn.Module, bucket_mb: float, fused: bool) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.name = "torch.ZeroRedundancyOptimizer"
        # grads as views of DDP's buckets: one gradient copy, not two (DDP's lean setting)
        self.model = DistributedDataParallel(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
        self.opt = ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=torch.optim.AdamW, **HYPER, fused=fused)

    def _opt_state(self) -> Any:
        return self.opt.optim.state  # this rank's partition only


class _FSDP2(Runner):
    def __init__(self, model: torch.nn.Module, ctx: Any, fused: bool, reshard_after_forward: bool) -> None:
        from torch.distributed.fsdp import fully_shard

        self.name = "torch.fully_shard"
        mesh = ctx.mesh["dp"]
        for block in model.blocks:  # one unit per block, the root holds embeddings/head/ln_f
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.model = fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        self.opt = torch.optim.AdamW(self.model.parameters(), **HYPER, fused=fused)
        self._sharded = list(self.model.parameters())  # the DTensor shards (stay registered)

    def _params(self) -> list[torch.Tensor]:
        return self._sharded

    def _grads(self) -> int:
        return storage_bytes(p.grad for p in self._sharded)


class _DeepSpeed(Runner):
    def __init__(self, model: torch.nn.Module, stage: int, batch: int, world: int, bucket_mb: float, offload: str | None) -> None:
        import deepspeed

        self.name = "deepspeed"
        self.stage = stage
        bucket = int(bucket_mb * 2**20 / 4)  # elements, as DeepSpeed counts them
        zero: dict[str, Any] = {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "overlap_comm": False,
            "contiguous_gradients": True,
        }
        if stage == 3:  # its prefetch bucket sized like the others; persistence/reuse left at its defaults
            zero["stage3_prefetch_bucket_size"] = bucket
        if offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "train_batch_size": batch * world,
            "optimizer": {"type": "AdamW", "params": {**HYPER, "torch_adam": True, "adam_w_mode": True}},
            # with offload: torch's AdamW on the CPU partition (DeepSpeedCPUAdam needs a compiled extension)
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": zero,
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.model = self.engine

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from shardkit.models import lm_loss

        loss = lm_loss(self.engine(x), y)
        self.engine.backward(loss)
        return loss.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.forward_backward(x, y)
        self.engine.step()
        return loss

    def _params(self) -> list[torch.Tensor]:
        # stage 3: the partition (ds_tensor) beside the param, whose data is empty unless gathered
        ps = list(self.engine.module.parameters())
        return ps + [getattr(p, "ds_tensor", None) for p in ps]

    def param_bytes_now(self) -> int:
        return storage_bytes(self._params())

    def memory(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
        from shardkit.models import lm_loss

        logits, in_step = self.forward_sampled(x)
        self.engine.backward(lm_loss(logits, y))
        o = self.opt
        extra = [
            getattr(o, "ipg_buffer", None) or [],
            [getattr(o, "grads_in_partition", None), getattr(o, "grad_partitions_flat_buffer", None)],
            list((getattr(o, "averaged_gradients", None) or {}).values()),
        ]
        flat_extra = [t for group in extra for item in group for t in (item if isinstance(item, list) else [item])]
        grads = storage_bytes([p.grad for p in self.engine.module.parameters()] + flat_extra)
        self.engine.step()
        masters = getattr(o, "single_partition_of_fp32_groups", None) or getattr(o, "fp32_partitioned_groups_flat", [])
        mem = {
            "params": storage_bytes(self._params()),
            "grads": grads,
            "master_params": storage_bytes(masters),
            "optimizer_state": storage_bytes(_state_tensors(o.optimizer.state)),
        }
        mem["model_state"] = sum(mem[k] for k in CATEGORIES)
        mem["params_in_step"] = max(in_step, mem["params"])
        return mem


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmark's TinyGPT (tied embeddings), seeded so every configuration starts alike.

    Args:
        args: parsed flags with ``vocab``, ``d_model``, ``n_layers``, ``n_heads``, ``seq_len``.

    Example:
        >>> build_model(argparse.Namespace(vocab=128, d_model=64, n_layers=2, n_heads=4, seq_len=32))
    """
    from shardkit.models import TinyGPT

    torch.manual_seed(0)  # every configuration starts from the same weights
    return TinyGPT(args.vocab, args.d_model, args.n_layers, args.n_heads, args.seq_len)


def build_runner(kind: str, stage: int, args: argparse.Namespace, ctx: Any, offload: str | None = None) -> Runner:
    """Wrap a fresh :func:`build_model` as configuration ``kind`` at ZeRO ``stage`` (collective).

    Args:
        kind: ``"shardkit"`` or a name of :data:`PEERS` (:data:`OFFLOAD_PEERS` with ``offload``).
        stage: 1, 2 or 3 (``torch.fully_shard``: 2 or 3, ``torch.ZeroRedundancyOptimizer``: 1).
        args: parsed flags (model sizes, ``bucket_mb``, ``peer_fused``, ``batch``, ``nproc``).
        ctx: the ``ParallelContext`` over the gloo world.
        offload: None or ``"cpu"`` (ours: ``offload="cpu"``; DeepSpeed: ``offload_optimizer``).

    Raises:
        ValueError: unknown ``kind``, a stage or offload the configuration does not have.

    Example:
        >>> runner = build_runner("torch.fully_shard", 3, args, ctx)
        >>> runner = build_runner("deepspeed", 3, args, ctx, offload="cpu")
    """
    if offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', got {offload!r}")
    if offload is not None and kind not in (SHARDKIT, *OFFLOAD_PEERS):
        raise ValueError(f"configuration {kind!r} has no offload={offload!r} row")
    if stage not in PEERS:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if kind in {k for v in PEERS.values() for k in v} and kind not in PEERS[stage]:
        raise ValueError(f"configuration {kind!r} is not a stage-{stage} peer")
    if kind == SHARDKIT:
        return _Shardkit(build_model(args), ctx, stage, args.bucket_mb, offload)
    if kind == "torch.ZeroRedundancyOptimizer":
        return _TorchZero(build_model(args), args.bucket_mb, fused=args.peer_fused)
    if kind == "torch.fully_shard":
        # stage 2 = ZeRO-2's communication (no re-gather in backward), stage 3 = free after forward
        return _FSDP2(build_model(args), ctx, fused=args.peer_fused, reshard_after_forward=stage == 3)
    if kind == "deepspeed":
        return _DeepSpeed(build_model(args), stage, args.batch, args.nproc, args.bucket_mb, offload)
    raise ValueError(f"unknown configuration {kind!r}")
