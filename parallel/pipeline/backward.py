"""Backward split into input gradient and weight gradient (zero-bubble's B and W).

[Note: splitting backward without re-walking the graph]
``torch.autograd.grad(y, x, retain_graph=True)`` gives the input gradient (B), but a later
``torch.autograd.grad(y, weights)`` would run the whole stage backward again. Instead, before B
we find the *intermediates*: the autograd nodes on the way from ``y`` to ``x`` where a path up
from a weight joins it (for ``x @ W.T`` that is the matmul's node, reached from ``W`` through
``TBackward``). B captures, with a pre-hook, the gradient each intermediate receives; it is
complete then, because every node between ``y`` and an intermediate is on the way to ``x`` and
so runs in B. W starts from the intermediates (``GradientEdge``) with the captured gradients and
asks for the weights only, so autograd runs just the weight side of each. When an intermediate
lies below another, pre-hooks during W replace what arrives at it by its captured gradient, so
nothing is counted twice (as ``torch.distributed.pipelining``'s ``stage_backward_weight`` does).
That clamp keeps the sum right but not the work: the call starting at the upper intermediate
also runs every node on the way down to the lower one (their input gradients included), and a
node that is some other group's intermediate then runs in two of W's calls — under activation
checkpointing W's calls share one recomputation, whose saved tensors can be unpacked once, so
that raised ``CheckpointError``. Such *nested* groups are rare and cheap (the sequence-parallel
norms and row biases, whose one coalesced node joins the way to ``x`` at every norm of the
stage; a weight applied twice), so B computes their gradients too, in its own walk from ``y``
(zero-bubble's B likewise keeps the norms' gradients): W then runs only the weight side of each
remaining group, and no node twice. Custom Functions computing several gradients in one node
ask the engine which of them the pass uses ([Note: only the gradients this backward pass uses]
in :mod:`~shardkit.parallel.tensor.functions`), so a column-parallel linear's ``dX`` and its
collective run in B only, its ``dW`` in W only.
If ``y`` does not depend on ``x`` (or on some weight only apart from ``x``), W falls back to
``torch.autograd.grad(y, weights)`` from the stage output; the executor also uses that on the
first stage, whose input (token ids) takes no gradient: there all of the backward is W.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class _Group:
    params: list[int]  # indices into the stage's parameter list
    nodes: list[Node]  # their intermediates


@dataclass
class WeightWork:
    """What :func:`backward_weight` needs, kept from :func:`backward_input`."""

    params: list[torch.Tensor]
    output: torch.Tensor | None = None  # fallback: re-walk from the stage output
    grad_output: torch.Tensor | None = None
    groups: list[_Group] = field(default_factory=list)
    captured: dict[Node, tuple] = field(default_factory=dict)
    #: gradients B computed already (nested groups, see the Note), by index into ``params``
    #: (None: unused); ``early_in_grad``: B added them to ``.grad`` itself (values all None)
    early: dict[int, torch.Tensor | None] = field(default_factory=dict)
    early_in_grad: bool = False


def _groups(y: torch.Tensor, x: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[list[_Group], set[Node]] | None:
    """Weights grouped by the intermediates (see the Note) their paths up join; weights that
    share an intermediate share a group. Also the nodes on the way from ``y`` to ``x``. None
    when a used weight never joins the way to ``x``."""
    root = y.grad_fn
    if root is None:
        return None
    up: dict[Node, list[Node]] = defaultdict(list)  # reverse edges: towards y
    leaf: dict[int, Node] = {}  # id(tensor) -> its AccumulateGrad node
    seen, todo = {root}, [root]
    while todo:
        node = todo.pop()
        var = getattr(node, "variable", None)
        if var is not None:
            leaf[id(var)] = node
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            up[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    if id(x) not in leaf:
        return None
    on_path, todo = {leaf[id(x)]}, [leaf[id(x)]]
    while todo:
        for n in up[todo.pop()]:
            if n not in on_path:
                on_path.add(n)
                todo.append(n)
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}
    for idx, q in enumerate(params):
        if id(q) not in leaf:
            continue  # not used by this output: its gradient is None
        joins: dict[Node, None] = {}
        seen, todo = {leaf[id(q)]}, [leaf[id(q)]]
        while todo:
            for n in up[todo.pop()]:
                if n in on_path:
                    joins[n] = None
                elif n not in seen:
                    seen.add(n)
                    todo.append(n)
        if not joins:
            return None
        group = _Group([idx], list(joins))
        for other in {id(owner[n]): owner[n] for n in joins if n in owner}.values():
            groups.remove(other)
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in joins]
        groups.append(group)
        for n in group.nodes:
            owner[n] = group
    return groups, on_path


def _nested(group: _Group, on_path: set[Node]) -> bool:
    """Whether one of ``group``'s intermediates lies below another on the way to ``x`` (W's
    call for it would re-walk the input path between them; see the Note)."""
    if len(group.nodes) < 2:
        return False
    mine = set(group.nodes)
    # one walk down the input path from all of them: a node seen before led to none of them
    seen: set[Node] = set()
    todo = [nxt for n in group.nodes for nxt, _ in n.next_functions if nxt in on_path]
    while todo:
        node = todo.pop()
        if node in mine:
            return True
        if node in seen:
            continue
        seen.add(node)
        todo += [nxt for nxt, _ in node.next_functions if nxt in on_path]
    return False


def backward_input(
    y: torch.Tensor,
    x: torch.Tensor,
    grad_output: torch.Tensor | None,
    params: Sequence[torch.Tensor],
    *,
    accumulate: bool = False,
) -> tuple[torch.Tensor, WeightWork]:
    """Gradient of ``y`` w.r.t. the stage input ``x`` only; keeps what W needs.

    Weights whose intermediates are nested (see the Note) get their gradient here too.

    Args:
        y: stage output (or scalar loss), with its graph.
        x: stage input, ``requires_grad``.
        grad_output: gradient of ``y`` (None for a scalar loss), same shape and dtype as ``y``.
        params: the stage's trainable parameters.
        accumulate: the weights B computes go into their ``.grad`` (as with
            :func:`backward_weight`'s ``accumulate``); otherwise :func:`backward_weight` returns
            them with the others.

    Returns:
        ``(dx, work)``: ``dx`` shaped like ``x`` (zeros if ``y`` does not depend on ``x``);
        ``work`` for :func:`backward_weight`. See [Note: splitting backward without re-walking
        the graph].

    Example:
        >>> dx, work = backward_input(y, x, dy, list(stage.parameters()))
        >>> send(dx); dw = backward_weight(work)
    """
    found = _groups(y, x, params)
    groups, on_path = found if found is not None else ([], set())
    nested = [g for g in groups if _nested(g, on_path)]
    early = [i for g in nested for i in g.params]  # B computes these: see the Note
    groups = [g for g in groups if all(g is not n for n in nested)]
    consumers = [n for g in groups for n in g.nodes]
    captured: dict[Node, tuple] = {}

    def hook(node: Node):
        def fn(grad_outputs: tuple) -> None:
            captured[node] = tuple(grad_outputs)

        return fn

    handles = [n.register_prehook(hook(n)) for n in consumers]
    wrt = [x, *(params[i] for i in early)]
    done: dict[int, torch.Tensor | None] = {}
    in_grad = False
    try:
        if early and accumulate and x.is_leaf:  # the weights' gradients straight into .grad
            kept, x.grad = x.grad, None
            torch.autograd.backward(y, grad_tensors=grad_output, inputs=wrt, retain_graph=True)
            dx, x.grad = x.grad, kept
            done, in_grad = dict.fromkeys(early), True
        else:
            dx, *got = torch.autograd.grad(y, wrt, grad_outputs=grad_output, retain_graph=True, allow_unused=True)
            done = dict(zip(early, got, strict=True))
    finally:
        for h in handles:
            h.remove()
    dx = torch.zeros_like(x) if dx is None else dx
    if consumers and len(captured) == len(consumers):
        return dx, WeightWork(list(params), groups=groups, captured=captured, early=done, early_in_grad=in_grad)
    return dx, WeightWork(list(params), output=y, grad_output=grad_output, early=done, early_in_grad=in_grad)


def backward_weight(work: WeightWork, *, accumulate: bool = False) -> tuple[torch.Tensor | None, ...]:
    """Weight gradients for ``work.params`` (None for a parameter the output does not use).

    Frees the graph kept by :func:`backward_input`.

    Args:
        work: from :func:`backward_input`.
        accumulate: add the gradients into each parameter's ``.grad`` as autograd computes them
            (``torch.autograd.backward(..., inputs=params)``) and return ``()``.

    Raises:
        ValueError: ``accumulate=False`` after ``backward_input(accumulate=True)`` put some
            gradients into ``.grad`` already.
    """
    if not work.params:
        return ()
    out: list[torch.Tensor | None] = [None] * len(work.params)
    if work.early_in_grad and not accumulate:
        raise ValueError("backward_input(accumulate=True) put some gradients in .grad: call backward_weight(accumulate=True)")
    for i, g in work.early.items():  # computed by B (nested groups)
        if g is not None and accumulate and not work.early_in_grad:
            q = work.params[i]
            with torch.no_grad():
                q.grad = g.detach().clone() if q.grad is None else q.grad.add_(g)
        out[i] = g
    if work.output is not None:
        rest = [i for i in range(len(work.params)) if i not in work.early]
        wanted = [work.params[i] for i in rest]
        if wanted and accumulate:
            torch.autograd.backward(work.output, grad_tensors=work.grad_output, inputs=wanted)
        elif wanted:
            got = torch.autograd.grad(work.output, wanted, grad_outputs=work.grad_output, allow_unused=True)
            for i, g in zip(rest, got, strict=True):
                out[i] = g
        return () if accumulate else tuple(out)
    # One autograd call per group, so no call walks into another group's subgraph (which a
    # single call over all intermediates would do: the way to x links them).
    try:
        for n_group, group in enumerate(work.groups):
            edges, grads = [], []
            for node in group.nodes:
                for k, g in enumerate(work.captured[node]):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(g)
            if not edges:
                continue
            handles = []
            if len(group.nodes) > 1:  # clamp: see the Note
                handles = [n.register_prehook(lambda _go, gs=work.captured[n]: gs) for n in group.nodes]
            wanted = [work.params[i] for i in group.params]
            keep = n_group < len(work.groups) - 1
            try:
                if accumulate:
                    torch.autograd.backward(edges, grad_tensors=grads, retain_graph=keep, inputs=wanted)
                    continue
                got = torch.autograd.grad(edges, wanted, grad_outputs=grads, retain_graph=keep, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            for i, g in zip(group.params, got, strict=True):
                out[i] = g
    finally:
        work.captured.clear()
        work.groups.clear()
    return () if accumulate else tuple(out)
