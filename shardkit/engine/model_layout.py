"""How :func:`shardkit.initialize` lays a model out over the ``tp`` and ``pp`` axes.

The config's ``tensor_parallel`` section names a plan (see
:class:`~shardkit.engine.TensorParallelConfig`); this module turns it into a plan of
:mod:`shardkit.parallel.tensor`, makes a vocabulary-parallel LM head return full logits when the
config asks for it, keeps the user's parameter groups across the conversion (the TP layers
replace the dense Parameters: groups are carried by name) and picks the pipeline blocks of a
model. Nothing here communicates except the gathered logits' forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.comm import ParallelContext
from shardkit.parallel.context import gpt_cp_plan, hf_gpt2_cp_plan, llama_cp_plan
from shardkit.parallel.param_groups import resolve_param_groups
from shardkit.parallel.tensor import (
    VocabParallelEmbedding,
    FusedCrossEntropyHead,
    VocabParallelLMHead,
    gather_from_tp_region,
    gpt_plan,
    hf_gpt2_plan,
    llama_plan,
)

from ._reader import Reader, to_int
from .config_reader import load_raw
from .resolved import TensorParallelConfig

__all__ = [
    "axis_sizes",
    "cp_plan_for",
    "default_blocks",
    "gather_head_logits",
    "groups_by_name",
    "regroup",
    "tp_plan_for",
    "vocab_sizes",
]

BlocksFn = Callable[[nn.Module], Sequence[nn.Module]]


def axis_sizes(config: str | Any, auto_values: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
    """``(tensor_parallel.size, pipeline.stages, sequence_parallel_size)`` of a config, read alone:
    the context's axes must exist before the whole config can be read (its batch rule needs
    dp = world / (tp × pp × cp)).

    Args:
        config: a JSON path or a dict.
        auto_values: what ``"auto"`` stands for (load_config's keywords).

    Raises:
        ValueError: a size that is not an integer >= 1, naming the dotted key.

    Example:
        >>> axis_sizes({"tensor_parallel": {"size": 2}, "sequence_parallel_size": 2})
        (2, 1, 2)
    """
    r = Reader(load_raw(config), auto_values or {})
    tp = r.section("tensor_parallel").get("size", to_int, 1, check=lambda v: v >= 1, must="be >= 1")
    pp = r.section("pipeline").get("stages", to_int, 1, check=lambda v: v >= 1, must="be >= 1")
    cp = r.get("sequence_parallel_size", to_int, 1, check=lambda v: v >= 1, must="be >= 1")
    return tp, pp, cp


def _is_tinygpt(model: nn.Module) -> bool:
    from shardkit.models import TinyGPT

    return isinstance(model, TinyGPT)


def tp_plan_for(model: nn.Module, cfg: TensorParallelConfig, tp_plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The TP plan ``initialize`` applies: ``tp_plan`` if given, else the one ``cfg.plan`` names.

    Args:
        model: the dense model (its type picks the plan for ``"auto"``; HF models' configs say
            whether the embeddings are tied).
        cfg: the config's ``tensor_parallel`` section.
        tp_plan: a plan of the caller's (``{module pattern: style}``), or None.

    Returns:
        ``{pattern: style}`` for :func:`shardkit.parallel.tensor_parallelize`.

    Raises:
        ValueError: ``"auto"`` on a model no built-in plan covers (naming
            ``tensor_parallel.plan`` and ``initialize(tp_plan=...)``).

    Example:
        >>> tp_plan_for(TinyGPT(59), TensorParallelConfig(size=2))["head"]
        VocabParallelHead(tied_to='tok_emb', sequence_parallel=False)
    """
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping):
            raise TypeError(f"tp_plan must be a mapping of module patterns to styles, got {type(tp_plan).__name__}")
        return dict(tp_plan)
    name = cfg.plan
    if name == "auto":
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if _is_tinygpt(model):
            name = "gpt"
        elif model_type in ("gpt2", "llama"):
            name = "hf_gpt2" if model_type == "gpt2" else "llama"
        else:
            raise ValueError(
                f"tensor_parallel.plan='auto': no built-in plan for a {type(model).__name__} (built in: shardkit's "
                "TinyGPT, transformers GPT-2 and Llama); pass initialize(tp_plan={...}) (docs/tensor_parallel.md)"
            )
    if name == "gpt":
        tied = getattr(getattr(model, "config", None), "tie_embeddings", True)
        return gpt_plan(tie_embeddings=bool(tied))
    return hf_gpt2_plan(model) if name == "hf_gpt2" else llama_plan(model)


def cp_plan_for(model: nn.Module, cp_plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The context-parallel plan ``initialize`` applies with ``sequence_parallel_size`` > 1:
    ``cp_plan`` if given, else the built-in plan of the model's type.

    Args:
        model: the dense model (shardkit's TinyGPT, a ``transformers`` GPT-2 or Llama, or any
            model with ``cp_plan``).
        cp_plan: ``{module pattern: "attention" | "positions"}`` of the caller's, or None.

    Raises:
        ValueError: no ``cp_plan`` and no built-in plan for the model's type (naming
            ``initialize(cp_plan=...)``).

    Example:
        >>> cp_plan_for(TinyGPT(59))
        {'blocks.*.attn': 'attention', 'pos_emb': 'positions'}
    """
    if cp_plan is not None:
        if not isinstance(cp_plan, Mapping):
            raise TypeError(f"cp_plan must be a mapping of module patterns to styles, got {type(cp_plan).__name__}")
        return dict(cp_plan)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if _is_tinygpt(model):
        return gpt_cp_plan()
    if model_type == "gpt2":
        return hf_gpt2_cp_plan()
    if model_type == "llama":
        return llama_cp_plan()
    raise ValueError(
        f"sequence_parallel_size > 1: no built-in context-parallel plan for a {type(model).__name__} (built in: "
        "shardkit's TinyGPT, transformers GPT-2 and Llama); pass initialize(cp_plan={...}) (docs/context_parallel.md)"
    )


def gather_head_logits(model: nn.Module, ctx: ParallelContext) -> int:
    """Make every :class:`~shardkit.parallel.tensor.VocabParallelLMHead` (and tensor-parallel
    :class:`~shardkit.parallel.tensor.FusedCrossEntropyHead` when it returns logits) of ``model``
    return the full ``[..., V]`` logits: its ``[..., V/tp]`` shards all-gathered over tp, the padding past
    ``V`` cut off. The backward keeps this rank's columns of the gradient, which is exact
    because every tp rank computes the same loss from the same full logits.

    A forward hook, so module names and ``state_dict`` keys stay the plan's.

    Returns:
        The number of heads changed.

    Example:
        >>> tensor_parallelize(model, ctx, gpt_plan()); gather_head_logits(model, ctx)
        1
    """
    group = ctx.group("tp")

    def hook(module: VocabParallelLMHead | FusedCrossEntropyHead, args: Any, out: torch.Tensor) -> torch.Tensor:
        if getattr(module, "armed", None) is not None or getattr(module, "deferred", False):
            return out  # a fused head's loss (or its input), not logits
        return gather_from_tp_region(out, group=group)[..., : module.vocab_size]

    heads = [m for m in model.modules() if isinstance(m, (VocabParallelLMHead, FusedCrossEntropyHead)) and m.ctx is not None]
    for head in heads:
        head.register_forward_hook(hook)
    return len(heads)


def vocab_sizes(model: nn.Module) -> dict[str, int]:
    """``{state_dict key: V}`` of the vocabulary-split weights (their padding past ``V`` is
    dropped when the TP shards are gathered back into the dense layout).

    Example:
        >>> vocab_sizes(tensor_parallelize(TinyGPT(59), ctx, gpt_plan()))
        {'tok_emb.weight': 59, 'head.weight': 59}
    """
    out = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, VocabParallelEmbedding):
            out[prefix + "weight"] = m.num_embeddings
        elif isinstance(m, VocabParallelLMHead) or (isinstance(m, FusedCrossEntropyHead) and m.group is not None):
            out[prefix + "weight"] = m.vocab_size
    return out


def groups_by_name(model: nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Resolved param groups with parameter *names* instead of Parameters (a tied Parameter by its
    first name, as ``named_parameters`` lists it), to re-resolve after a conversion.

    Example:
        >>> groups_by_name(model, resolve_param_groups(model, None))[0]["params"][:1]
        ['tok_emb.weight']
    """
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    return [{**g, "params": [names[id(p)] for p in g["params"]]} for g in groups]


def regroup(model: nn.Module, named: list[dict[str, Any]], keep: Sequence[nn.Parameter] | None = None) -> list[dict[str, Any]]:
    """``named`` (from :func:`groups_by_name`) resolved on the converted ``model``; with ``keep``
    (a pipeline rank's parameters), only those, dropping groups left empty.

    Raises:
        ValueError: ``keep`` leaves no parameter at all.

    Example:
        >>> regroup(model, named, keep=pipe.parameters())
    """
    current = dict(model.named_parameters(remove_duplicate=False))
    named = [{**g, "params": [n for n in g["params"] if n in current]} for g in named]
    groups = resolve_param_groups(model, [g for g in named if g["params"]], arg="model_parameters")
    if keep is None:
        return groups
    mine = {id(p) for p in keep}
    out = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in groups]
    out = [g for g in out if g["params"]]
    if not out:
        raise ValueError("model_parameters: none of the given parameters is on this rank's pipeline stages")
    return out


def default_blocks(model: nn.Module, blocks: BlocksFn | None) -> BlocksFn | None:
    """The pipeline's cut points: ``blocks`` if given, shardkit's ``gpt_blocks`` for a TinyGPT,
    None for an ``nn.Sequential`` / ``nn.ModuleList`` (its children are the blocks).

    Raises:
        ValueError: any other model without ``blocks`` (naming ``initialize(blocks=...)``).
        TypeError: ``blocks`` not callable.

    Example:
        >>> default_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), None) is None
        True
    """
    if blocks is not None:
        if not callable(blocks):
            raise TypeError(f"blocks must be callable (model -> sequence of blocks) or None, got {type(blocks).__name__}")
        return blocks
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return None
    if _is_tinygpt(model):
        from shardkit.models import gpt_blocks

        return gpt_blocks
    raise ValueError(
        f"pipeline.stages > 1 needs a model cut into blocks: pass an nn.Sequential, or initialize(blocks=fn) with "
        f"fn(model) -> [first block, ..., last block] whose composition is {type(model).__name__}.forward"
    )
