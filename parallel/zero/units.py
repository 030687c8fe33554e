"""Stage-3 units: which modules gather their parameters together (a pure function of the model).

A *unit* is a module whose parameters are gathered just before its forward and freed after it
(FSDP2's ``fully_shard`` target). :func:`select_units` picks them from ``wrap`` and assigns
every parameter to exactly one unit: the innermost chosen module that holds it, or the *root
unit* (the whole model) for whatever no chosen module holds — embeddings, the final norm, the
head — and for a parameter that two units share (tied weights, see [Note: tied parameters
live in the root unit]).

[Note: tied parameters live in the root unit]
One Parameter used by two units (a token embedding tied to the output projection) must be
gathered whenever either unit runs and get the sum of both uses' gradients. Keeping it in
both units would gather and reduce it twice; giving it to one of them would free it while the
other still needs it. It goes to the root unit instead, which is gathered from the start of
``forward`` to the end of backward (as FSDP2 keeps its root unsharded), so every user finds it
gathered and autograd sums its gradient before the one reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..buckets import plan_buckets

__all__ = ["UnitSpec", "check_wrap", "select_units", "unit_buckets"]


@dataclass(eq=False)
class UnitSpec:
    """One unit: its module, its qualified name ("" for the root) and the params it owns.

    Attributes:
        name: qualified module name in the wrapped model ("" = root unit).
        module: the module whose forward gathers the unit (the model itself for the root).
        params: the parameters this unit owns, in registration order (no duplicates).
    """

    name: str
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)


def check_wrap(wrap: Any) -> Callable[[str, nn.Module], bool] | None:
    """Validate ``wrap`` and turn it into a predicate ``(name, module) -> bool`` (None: default).

    Raises:
        TypeError: ``wrap`` is neither None, a collection of ``nn.Module`` subclasses nor a callable.
    """
    if wrap is None:
        return None
    if isinstance(wrap, type) and issubclass(wrap, nn.Module):
        wrap = {wrap}
    if isinstance(wrap, Collection) and not isinstance(wrap, (str, bytes)):
        classes = tuple(wrap)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not classes:
            raise TypeError(f"wrap must hold nn.Module subclasses, got {bad or 'an empty collection'}")
        return lambda name, m: isinstance(m, classes)
    if callable(wrap):
        return wrap
    raise TypeError(f"wrap must be None, a set of nn.Module classes or a callable (name, module) -> bool, got {wrap!r}")


def _default_choice(module: nn.Module) -> set[int]:
    """Each direct child of a ModuleList/Sequential, outermost containers only (blocks)."""
    chosen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for child in m.children():
                chosen.add(id(child))
            return
        for child in m.children():
            visit(child)

    visit(module)
    return chosen


def select_units(module: nn.Module, wrap: Any = None) -> list[UnitSpec]:
    """Choose the stage-3 units of ``module`` and give each parameter to one of them.

    Args:
        module: the model.
        wrap: None (default: each child of a ``ModuleList``/``Sequential``, outermost ones
            only), a set of module classes (every instance is a unit; units may nest: an inner
            unit's params are not the outer one's), or ``callable(name, module) -> bool``.

    Returns:
        The root unit first, then the others in module pre-order (registration order, which is
        the forward order of a typical model). Units that own no parameter are dropped, except
        the root (which may be empty).

    Example:
        >>> [u.name for u in select_units(TinyGPT(59, n_layers=2))]
        ['', 'blocks.0', 'blocks.1']
    """
    pred = check_wrap(wrap)
    default = _default_choice(module) if pred is None else set()
    specs = [UnitSpec("", module)]
    owner: dict[int, UnitSpec] = {}  # id(module) -> the unit that owns its direct params

    def visit(name: str, m: nn.Module, current: UnitSpec) -> None:
        if m is not module and (id(m) in default or (pred is not None and pred(name, m))):
            current = UnitSpec(name, m)
            specs.append(current)
        owner.setdefault(id(m), current)
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, current)

    visit("", module, specs[0])
    users: dict[nn.Parameter, list[UnitSpec]] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            users.setdefault(p, [])
            if owner[id(m)] not in users[p]:
                users[p].append(owner[id(m)])
    for p, us in users.items():  # registration order of first appearance
        (us[0] if len(us) == 1 else specs[0]).params.append(p)  # [Note: tied parameters live in the root unit]
    return [specs[0]] + [u for u in specs[1:] if u.params]


def unit_buckets(spec: UnitSpec, *, bucket_mb: float) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """One unit's non-empty params in buckets: the trainable ones, then the frozen ones, each
    kind bucketed by parameter bytes up to ``bucket_mb`` MiB (one dtype and device per bucket,
    no smaller first bucket: a unit's buckets launch together at its post-backward).

    The one bucketing of stage 3: the runtime builds these buckets and the planner
    (:func:`~shardkit.parallel.zero.plan_layout.stage3_layout`) lays them out.

    Example:
        >>> [spec] = select_units(nn.Linear(4, 2))
        >>> trainable, frozen = unit_buckets(spec, bucket_mb=25)
        >>> [len(b) for b in trainable], frozen
        ([2], [])
    """
    cap = int(bucket_mb * 2**20)
    kinds = []
    for want in (True, False):
        ps = [p for p in spec.params if p.requires_grad == want and p.numel() > 0]
        plan = plan_buckets(
            [p.numel() * p.element_size() for p in ps], [(p.device, p.dtype) for p in ps], cap_bytes=cap, first_cap_bytes=None
        )
        kinds.append([[ps[i] for i in idx] for idx in plan])
    return kinds[0], kinds[1]
