"""``FlatPiece``: pieces of a flattened 1-D tensor at arbitrary offsets, as DCP sees them.

A ZeRO rank holds, per original parameter, one contiguous run of its flattened elements (a
:class:`~shardkit.kernels.flatten.Segment`), which is generally not a rectangular block of the
N-d parameter. The checkpoint therefore stores every tensor as its full flattened 1-D tensor,
and each rank describes what it holds (or, on load, what it needs) as pieces ``[offset,
offset + numel)`` of it. ``torch.distributed.checkpoint`` (DCP) accepts such pieces through its
``_Checkpointable`` protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), as DTensor and torch's ``LocalShardsWrapper`` implement it; DCP then
reshards on load by intersecting the saved chunks with the requested ones. The wrapper has no
collective and no process-group dependency, so it works the same on gloo, NCCL and without
``torch.distributed`` (``ShardedTensor`` would all-gather metadata per tensor instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["FlatPiece"]


class FlatPiece(torch.Tensor):
    """A 1-D tensor of ``numel`` elements of which this process holds ``chunks``.

    Only a carrier for DCP: its size is the full size (what DCP checks against the saved
    metadata), its data the local chunks; no tensor operation is supported on it.

    Args:
        numel: elements of the full flattened tensor.
        chunks: ``(offset, tensor)`` pairs, each tensor 1-D and contiguous, non-overlapping;
            on save the data to write, on load the buffers DCP fills.

    Example:
        >>> piece = FlatPiece(4096, [(1024, shard_view)])   # elements 1024..1024+n of a param
        >>> dcp.save({"model.w": piece}, checkpoint_id=path)
    """

    _chunks: list[tuple[int, torch.Tensor]]

    @staticmethod
    def __new__(cls, numel: int, chunks: list[tuple[int, torch.Tensor]]) -> FlatPiece:
        if not chunks:
            raise ValueError("chunks: a FlatPiece needs at least one chunk (leave the key out instead)")
        first = chunks[0][1]
        for offset, t in chunks:
            if t.dim() != 1 or not t.is_contiguous() or offset < 0 or offset + t.numel() > numel:
                raise ValueError(f"chunks: ({offset}, {tuple(t.shape)}) is not a contiguous 1-D piece of [{numel}]")
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError("chunks: all chunks of one FlatPiece must share dtype and device")
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size([numel]), dtype=first.dtype, device=first.device)
        r._chunks = sorted(chunks, key=lambda c: c[0])
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"FlatPiece is only a DCP carrier; {func} is not supported")

    def __repr__(self) -> str:  # type: ignore[override]
        spans = ", ".join(f"[{o}:{o + t.numel()}]" for o, t in self._chunks)
        return f"FlatPiece(numel={self.shape[0]}, dtype={self.dtype}, chunks={spans})"

    # ---- DCP's _Checkpointable protocol ------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([t.numel()])),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.shape,
                ),
            )
            for offset, t in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([t.numel()])) for o, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offset, t in self._chunks:
            if index.offset is not None and offset == index.offset[0]:
                return t
        raise ValueError(f"FlatPiece {index.fqn!r}: no chunk at offset {index.offset}")
