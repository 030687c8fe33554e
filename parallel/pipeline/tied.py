"""Tied parameters across pipeline stages (the input embedding on stage 0 = the output projection
on the last stage).

[Note: tied weights across stages]
A *tie* is a set of parameter slots ``"<block index>.<name>"`` (``nn.Sequential(*blocks)``'s
keys) that must hold one value. Ties are found two ways, merged:

* **shared objects**: the same ``nn.Parameter`` reached from several blocks of the full model
  before the split (``head.weight = embed.weight``, the usual way to tie in PyTorch);
* **declared**: ``tied=[("0.weight", "7.weight")]``, for models whose blocks were built apart
  (distinct objects of the same shape, e.g. loaded per stage).

Each pp rank trains its own copy of the tied value (the processes hold separate objects). The
constructor makes the copies equal by broadcasting the member of the lowest block from its
owner (stage 0 for an embedding) to the other owning ranks, and every step all-reduces (sums) the
tie's fp32 gradient over the owning ranks, in ``finalize``, before the division by the token
count and before the optimizer step: every copy then receives the gradient of the single tied
parameter, and deterministic optimizers keep them equal. Members on one rank that are the same
object need nothing (autograd sums their uses); distinct objects on one rank are summed and
given the same gradient.

One process group per distinct set of owning pp ranks (the pp group itself when the tie spans
all of it, so pp = 2 creates nothing), built in the constructor with ``dist.new_group`` by every
rank of the world for every pp group of the mesh in the same order (new_group's contract), and
destroyed by :meth:`~shardkit.parallel.pipeline.PipelineParallel.close`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from shardkit.comm import CommStats, ParallelContext, all_reduce, broadcast

__all__ = ["TiedParameters", "find_ties"]

TiedSpec = Sequence[Sequence[str]]


def find_ties(blocks: Sequence[nn.Module], tied: TiedSpec = ()) -> list[tuple[str, ...]]:
    """The ties of a block sequence: shared ``nn.Parameter`` objects plus declared slot sets.

    Pure (no communication). See [Note: tied weights across stages].

    Args:
        blocks: the full model's blocks, in order.
        tied: sets of slots ``"<block index>.<parameter name>"`` declared tied, e.g.
            ``[("0.weight", "7.weight")]``; each slot must exist and all slots of a set must have
            one shape and dtype.

    Returns:
        Each tie as its slots in block order; ties sorted by their first slot's block. A
        parameter used twice inside one block and nowhere else is not a tie.

    Raises:
        ValueError: a declared slot that names no parameter, a set of fewer than two slots, or
            slots of different shapes/dtypes (each naming ``tied``).

    Example:
        >>> head.weight = embed.weight
        >>> find_ties([embed, block, head])
        [('0.weight', '2.weight')]
    """
    slots: dict[str, nn.Parameter] = {}
    by_id: dict[int, list[str]] = {}
    for j, blk in enumerate(blocks):
        for name, q in blk.named_parameters(remove_duplicate=False):
            key = f"{j}.{name}"
            slots[key] = q
            by_id.setdefault(id(q), []).append(key)
    parent = {k: k for k in slots}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: str, b: str) -> None:
        parent[root(a)] = root(b)

    for keys in by_id.values():
        for k in keys[1:]:
            union(keys[0], k)
    for n, tie in enumerate(tied):
        if isinstance(tie, str) or len(tie) < 2:
            raise ValueError(f"tied[{n}] must list at least two parameter slots, got {tie!r}")
        for k in tie:
            if k not in slots:
                raise ValueError(f"tied[{n}]: {k!r} is no parameter of the blocks (keys are '<block index>.<name>')")
        first = slots[tie[0]]
        for k in tie[1:]:
            q = slots[k]
            if q.shape != first.shape or q.dtype != first.dtype:
                raise ValueError(f"tied[{n}]: {tie[0]!r} is {_desc(first)} but {k!r} is {_desc(q)}")
            union(tie[0], k)
    sets: dict[str, list[str]] = {}
    for k in slots:
        sets.setdefault(root(k), []).append(k)
    out = []
    for keys in sets.values():
        blocks_used = {k.split(".", 1)[0] for k in keys}
        distinct = {id(slots[k]) for k in keys}
        if len(blocks_used) > 1 or len(distinct) > 1:
            out.append(tuple(sorted(keys, key=lambda k: (int(k.split(".", 1)[0]), k))))
    return sorted(out, key=lambda t: (int(t[0].split(".", 1)[0]), t[0]))


def _desc(q: torch.Tensor) -> str:
    return f"{str(q.dtype).removeprefix('torch.')}{list(q.shape)}"


def _param(blocks: Sequence[nn.Module], slot: str) -> nn.Parameter:
    j, name = slot.split(".", 1)
    return blocks[int(j)].get_parameter(name)


class _Tie:
    def __init__(self, slots: tuple[str, ...], ranks: tuple[int, ...], src: int, local: list[nn.Parameter]) -> None:
        self.slots, self.ranks, self.src, self.local = slots, ranks, src, local
        self.group: dist.ProcessGroup | None = None
        self.trainable = True


class TiedParameters:
    """The runtime side of [Note: tied weights across stages] for one pipeline rank.

    Collective on the world at construction when a tie spans only part of the pp group (its
    process groups are created then), and on each tie's owning ranks in :meth:`broadcast_values`
    and :meth:`sync_grads`.

    Args:
        blocks: the full model's blocks (every rank builds all of them).
        ties: from :func:`find_ties`.
        stage_blocks: block indices of every stage.
        num_ranks: pp size; stage ``s`` lives on pp rank ``s % num_ranks``.
        ctx: the context; its pp axis is the pipeline.
        stats: optional accounting of the broadcasts and all-reduces.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        ties: list[tuple[str, ...]],
        stage_blocks: list[range],
        num_ranks: int,
        ctx: ParallelContext,
        stats: CommStats | None = None,
    ) -> None:
        self.ctx, self.stats, p = ctx, stats, num_ranks
        me = ctx.rank("pp")
        stage_of = {j: s for s, rng in enumerate(stage_blocks) for j in rng}
        self.ties: list[_Tie] = []
        for slots in ties:
            ranks = tuple(sorted({stage_of[int(k.split(".", 1)[0])] % p for k in slots}))
            src = stage_of[int(slots[0].split(".", 1)[0])] % p
            local: dict[int, nn.Parameter] = {}
            for k in slots:
                if stage_of[int(k.split(".", 1)[0])] % p == me:
                    q = _param(blocks, k)
                    local.setdefault(id(q), q)
            if len(ranks) == 1 and len(local) <= 1:
                continue  # one object on one rank: autograd already sums its uses
            tie = _Tie(slots, ranks, src, list(local.values()))
            tie.trainable = all(_param(blocks, k).requires_grad for k in slots)  # same on every rank
            self.ties.append(tie)
        self._owned: list[dist.ProcessGroup] = []
        self._build_groups(p)

    def _build_groups(self, p: int) -> None:
        sets = sorted({t.ranks for t in self.ties if len(t.ranks) > 1})
        if not sets:
            return
        pp_group, me = self.ctx.group("pp"), self.ctx.rank("pp")
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in sets:
            if len(ranks) == p:
                groups[ranks] = pp_group
        partial = [r for r in sets if r not in groups]
        if partial:
            if self.ctx.world_size != dist.get_world_size():
                raise ValueError(
                    f"tied parameters between pp ranks {list(partial[0])} need a process group, which every rank "
                    f"of the world must create; ctx spans {self.ctx.world_size} of {dist.get_world_size()} ranks"
                )
            timeout = _timeout(pp_group, self.ctx.device)
            # every pp group of the mesh, as global ranks: [pp, dp, tp] -> [dp * tp, pp]
            lines = self.ctx.mesh.mesh.movedim(0, -1).reshape(-1, p).tolist()
            mine = dist.get_process_group_ranks(pp_group)
            for ranks in partial:
                for line in lines:
                    g = dist.new_group([line[r] for r in ranks], timeout=timeout, group_desc="shardkit_pp_tie")
                    if line == mine:
                        groups[ranks] = g
                        self._owned.append(g)
        for t in self.ties:
            if len(t.ranks) > 1 and me in t.ranks:
                t.group = groups[t.ranks]

    @torch.no_grad()
    def broadcast_values(self) -> None:
        """Make every copy of each tie equal to its lowest block's value (owned by ``src``)."""
        me = self.ctx.rank("pp")
        for t in self.ties:
            if not t.local:
                continue
            if t.group is not None:
                first = t.local[0] if me == t.src else None
                buf = first.detach().clone() if first is not None else torch.empty_like(t.local[0])
                broadcast(buf, src=t.ranks.index(t.src), group=t.group, stats=self.stats)
                for q in t.local:
                    q.copy_(buf)
            else:
                for q in t.local[1:]:
                    q.copy_(t.local[0])

    def sync_grads(self, grad_acc: dict[nn.Parameter, torch.Tensor]) -> None:
        """Sum each tie's fp32 accumulated gradient over its copies (local and on the other owning
        ranks) and give every local copy the sum; ``grad_acc`` maps a parameter to its step's
        fp32 gradient (a missing entry counts as zeros and is filled)."""
        for t in self.ties:
            if not t.local or not t.trainable:  # the same on every owner: built from one model
                continue
            parts = [grad_acc[q] for q in t.local if q in grad_acc]
            if parts:
                total = parts[0]
                for g in parts[1:]:
                    total = total + g
            else:
                total = torch.zeros(t.local[0].shape, dtype=torch.float32, device=t.local[0].device)
            if t.group is not None:
                all_reduce(total, group=t.group, stats=self.stats)
            for n, q in enumerate(t.local):
                grad_acc[q] = total if n == 0 else total.clone()  # finalize divides each in place

    def close(self) -> None:
        """Destroy the process groups created for the ties (never the pp group). Idempotent."""
        while self._owned:
            group = self._owned.pop()
            if dist.is_initialized():  # else they went with the world (ParallelContext.destroy)
                dist.destroy_process_group(group)


def _timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta | None:
    """The pp group's timeout, so a tie group hangs no longer than the pp group would."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
