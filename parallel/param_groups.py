"""Parameter groups given with a module's own parameters (or their names), checked and resolved.

ZeRO's optimizer (which steps flat shard views) and the DeepSpeed-style engine both take the
user's groups in terms of the ORIGINAL parameters; this is the one place that validates them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["resolve_param_groups"]


def resolve_param_groups(module: nn.Module, params: Iterable[Any] | None, *, arg: str = "params") -> list[dict[str, Any]]:
    """``params`` as group dicts of ``module``'s Parameter objects, names resolved.

    Args:
        module: the module the parameters belong to.
        params: None (every trainable parameter, one group), a parameter or name, an iterable
            of them, or of group dicts whose ``"params"`` are parameters or names (other keys
            are kept: per-group lr, weight decay, ...).
        arg: the caller's argument name, for the error messages.

    Returns:
        Copies of the group dicts whose ``"params"`` are lists of ``module``'s Parameters.

    Raises:
        ValueError: an empty list, a group without ``"params"``, an unknown name, a tensor that
            is not a parameter of ``module``, or one in two groups.

    Frozen parameters (``requires_grad=False``) are accepted, as ``torch.optim`` accepts them:
    they stay members of their group (a checkpoint records them) and, never getting a gradient,
    are never stepped (``AdamW(model.parameters())`` works on a partly frozen model).

    Example:
        >>> resolve_param_groups(model, [{"params": ["0.weight"], "weight_decay": 0.1}])
        [{'params': [Parameter(...)], 'weight_decay': 0.1}]
    """
    by_name = dict(module.named_parameters(remove_duplicate=False))
    names = {p: n for n, p in reversed(list(by_name.items()))}
    if params is None:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    if isinstance(params, (torch.Tensor, str)):
        params = [params]
    items = list(params)
    if not items:
        raise ValueError(f"{arg}: empty parameter list (give parameters or param-group dicts, or None for all)")
    groups = [dict(g) for g in items] if isinstance(items[0], Mapping) else [{"params": items}]
    seen: set[nn.Parameter] = set()
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"{arg}: group {i} is not a dict with a 'params' key")
        ps = [g["params"]] if isinstance(g["params"], (torch.Tensor, str)) else list(g["params"])
        resolved = []
        for p in ps:
            if isinstance(p, str):
                if p not in by_name:
                    raise ValueError(f"{arg}: group {i} names {p!r}, which is not a parameter of the module")
                p = by_name[p]
            if not isinstance(p, torch.Tensor) or p not in names:
                what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
                raise ValueError(f"{arg}: group {i} holds {what}, which is not a parameter of the module")
            if p in seen:
                raise ValueError(f"{arg}: {names[p]!r} is in more than one group (or twice)")
            seen.add(p)
            resolved.append(p)
        g["params"] = resolved
    return groups
