"""One bucket of the ZeRO data path: its flat parameter buffer and this rank's shard of it.

:class:`ShardedBucket` is the record every stage shares:
:class:`~shardkit.parallel.zero.flat_shards.FlatShards` (stages 1-2) and
:class:`~shardkit.parallel.zero.stage3_shards.Stage3Shards` (stage 3) build it, the ZeRO-3 units
and the optimizer read it. It holds only the buffers and the views into them (the layout is
described in :mod:`~shardkit.parallel.zero.flat_shards`); what is reduced or gathered, and when,
is the runtimes' business, so the record lives apart from either runtime.
:meth:`ShardedBucket.from_params` is the one place the flat buffer is laid out and the params
moved into it, for every stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardkit.kernels.flatten import ALIGN_ELEMENTS, Segment, flatten_into, shard_segments

from ..reducer import GradBucket

__all__ = ["ShardedBucket"]


@dataclass(eq=False)
class ShardedBucket:
    """One bucket's flat parameter buffer and this rank's shard of it.

    Attributes:
        grad_bucket: what the reducer sees (params, offsets; ``buffer`` is the full gradient in
            stage 1, a placeholder in stage 2).
        total, shard, start: bucket length, shard length and this rank's first element.
        segments: this rank's pieces of the params (:func:`~shardkit.kernels.flatten.shard_segments`), in param order.
        flat_param: ``[total]`` in the params' dtype; every param is a view of it.
        master: ``[shard]`` fp32 master weights, or None when the params are fp32 (the shard of
            ``flat_param`` is then the master).
        grad_full: stage 1: ``[total]`` persistent gradient; each ``p.grad`` is a view of it.
        grad_shard: stage 2: ``[shard]`` persistent reduced gradient.
        opt_grad: ``[shard]`` fp32 gradient the optimizer reads: a view of the reduced shard when
            the grads are fp32, else a transient cast made by the epilogue.
    """

    grad_bucket: GradBucket
    total: int
    shard: int
    start: int
    segments: list[Segment]
    flat_param: torch.Tensor
    master: torch.Tensor | None
    grad_full: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    opt_grad: torch.Tensor | None = None
    #: the shard holds no reduced gradient yet (since the last zero_grad)
    fresh: bool = True
    #: stage 1: this bucket was reduced in a backward since the last zero_grad
    reduced: bool = False
    shard_params: list[nn.Parameter] = field(default_factory=list)
    #: stage 3: ``[shard]`` persistent parameter shard (param dtype); ``flat_param`` is then
    #: allocated only while its unit is gathered
    param_shard: torch.Tensor | None = None
    #: stage 3 with a secondary block ([Note: hierarchical gathers] in ``stage3_shards.py``): this
    #: rank's ``[total / block]`` piece of the gathered params, kept from the unit's forward
    #: until its backward gathers from it; None otherwise
    secondary_shard: torch.Tensor | None = None
    #: stage 3: each param's view of ``flat_param`` (its ``.data`` while the bucket is gathered)
    param_views: list[torch.Tensor] = field(default_factory=list)
    #: per param (``grad_bucket.params`` order): it had a ``.grad`` on THIS rank when one of the
    #: bucket's reductions since the last zero_grad packed it ([Note: params without a gradient
    #: are not stepped] in ``flat_shards.py``)
    got_grad: list[bool] = field(default_factory=list)
    #: per param: some rank had a gradient for it this step (agreed over dp by
    #: ``ShardedDataParallel.finalize_gradients``); None: not agreed yet this step
    stepped: list[bool] | None = None

    def __post_init__(self) -> None:
        if not self.got_grad:
            self.got_grad = [False] * len(self.grad_bucket.params)

    @classmethod
    def from_params(cls, index: int, params: list[nn.Parameter], *, size: int, rank: int, backend: str) -> ShardedBucket:
        """Move ``params`` into one flat buffer, each param becoming a view of it, laid out for
        ``size`` equal shards (every param 16-byte aligned, the end padded); this rank's shard is
        the ``rank``-th. The one builder of the ZeRO buffers: the stage 1-2 and stage-3 runtimes
        add what they keep beside it (gradient buffers, the persistent parameter shard, masters).

        Args:
            index: the bucket's index (the reducer's launch order).
            params: its params, one dtype and device.
            size, rank: the dp group's size and this rank.
            backend: the flatten kernel's backend (:func:`~shardkit.kernels.runtime.resolve_backend`).

        Returns:
            The bucket, ``master`` None and ``param_views`` the params' views of ``flat_param``.

        Example:
            >>> sb = ShardedBucket.from_params(0, list(model.parameters()), size=2, rank=0, backend="torch")
            >>> sb.flat_param.numel() == 2 * sb.shard
            True
        """
        gb, total = GradBucket.laid_out(index, params, align=ALIGN_ELEMENTS, pad_to_multiple_of=size * ALIGN_ELEMENTS)
        numels, offsets = [p.numel() for p in params], gb.offsets
        shard = total // size
        start = rank * shard
        device = params[0].device
        flat = torch.zeros(total, dtype=params[0].dtype, device=device)  # gaps and padding stay zero
        flatten_into([p.detach().contiguous() for p in params], flat, offsets, backend=backend)
        views = [flat.narrow(0, o, p.numel()).view(p.shape) for p, o in zip(params, offsets)]
        for p, v in zip(params, views):
            p.data = v  # the param now lives in the bucket
        segments = shard_segments(offsets, numels, start=start, stop=start + shard)
        return cls(gb, total, shard, start, segments, flat, None, param_views=views)

    @property
    def reduced_shard(self) -> torch.Tensor:
        """This rank's reduced gradient (``[shard]``, grad dtype)."""
        return self.grad_shard if self.grad_full is None else self.grad_full.narrow(0, self.start, self.shard)

    def master_shard(self) -> torch.Tensor:
        """The fp32 weights the optimizer updates (``[shard]``)."""
        return self.local_param_shard() if self.master is None else self.master

    def local_param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameters (``[shard]``, param dtype, on the params' device):
        the persistent storage the post-step write-back and all-gather read."""
        return self.flat_param.narrow(0, self.start, self.shard) if self.param_shard is None else self.param_shard
