"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` as DeepSpeed scripts use them.

A :class:`PipelineModule` is a list of layers and the facts DeepSpeed's pipeline engine reads from
it (``num_stages``, ``loss_fn``, the stage cut, activation checkpointing). It runs nothing
distributed itself: :func:`shardkit.initialize` recognises it and trains its layers on shardkit's
pipeline (``parallelize``'s ``pp``, :class:`~shardkit.engine.pipeline_engine.PipelineEngine`),
``num_stages`` standing for the config's ``pipeline.stages``.

[Note: a PipelineModule built as DeepSpeed builds it]
DeepSpeed builds on each rank only the layers of that rank's stage; shardkit builds every layer
on every rank (the pipeline then keeps each rank's stages). So that a seeded script gets the
weights DeepSpeed gets, the constructor replays DeepSpeed's order of random draws:

1. ``partition_method="parameters"`` counts each layer's trainable parameters by building every
   :class:`LayerSpec` once and dropping it (DeepSpeed's ``_count_layer_params``);
2. each stage's specs are then built in order starting from the random state that step 1 left
   (every DeepSpeed rank starts there), ``seed_layers`` seeding ``base_seed + layer index`` first;
3. a :class:`TiedLayerSpec` key is built once per stage that holds it; the lowest stage's module
   owns the tied attributes (DeepSpeed broadcasts them from that stage) and the other stages'
   copies hold the owner's ``nn.Parameter`` objects for them, so shardkit's pipeline ties them
   ([Note: tied weights across stages] in shardkit/parallel/pipeline/tied.py: values broadcast
   from the lowest stage, gradients summed over the owning stages, as DeepSpeed's
   ``allreduce_tied_weight_gradients``). Other parameters of a tied module stay per stage, as in
   DeepSpeed.

Afterwards the random state is the one this rank's stage left in DeepSpeed (stage 0 without a
process group). The stage cut is DeepSpeed's own (``partitions()``): ``"uniform"`` (equal layer
counts, the first ones one more), ``"parameters"`` and ``"type:REGEX"`` (DeepSpeed's
``partition_balanced``: the cut minimising the heaviest minus the lightest stage, on trainable
parameter counts or on 1 per layer whose class name matches), handed to shardkit as explicit stage
sizes.

Example:
    >>> import shardkit.deepspeed as deepspeed                    # was: import deepspeed
    >>> from shardkit.deepspeed.pipe import PipelineModule        # was: from deepspeed.pipe import ...
    >>> net = PipelineModule(layers=[nn.Linear(8, 16), nn.ReLU(), lambda x: x * 2, nn.Linear(16, 4)],
    ...                      loss_fn=nn.CrossEntropyLoss(), num_stages=2)
    >>> engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
    ...                                        training_data=trainset)
    >>> loss = engine.train_batch()
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy
import torch
from torch import nn

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

#: ``partition_method`` values (``"type:REGEX"`` besides) and shardkit's name where it has one
PARTITION_METHODS = {"parameters": "params", "uniform": "layers"}


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)`` (DeepSpeed's ``LayerSpec``).

    Args:
        typename: an ``nn.Module`` subclass.
        *module_args, **module_kwargs: its constructor's arguments.

    Raises:
        TypeError: ``typename`` is not an ``nn.Module`` subclass.

    Example:
        >>> spec = LayerSpec(nn.Linear, 4, 8, bias=False)
        >>> spec.build()
        Linear(in_features=4, out_features=8, bias=False)
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """A new module from the spec (``log`` is DeepSpeed's and has no effect).

        Example:
            >>> LayerSpec(nn.ReLU).build()
            ReLU()
        """
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` parameters are shared by every spec with the same ``key``
    (DeepSpeed's ``TiedLayerSpec``), e.g. the input embedding and the output head.

    Args:
        key: the tie's name; specs with one key share one module per stage.
        typename, *module_args, **module_kwargs: as :class:`LayerSpec` (the first spec of a key
            builds the module).
        forward_fn: ``forward_fn(module, x)`` run instead of ``module(x)`` at this position
            (e.g. the head: ``lambda emb, x: x @ emb.weight.t()``).
        tied_weight_attr: the tied parameters' attribute names (dotted paths allowed); across
            stages only these are shared, as in DeepSpeed.

    Example:
        >>> layers = [TiedLayerSpec("emb", nn.Embedding, 100, 16), nn.Linear(16, 16),
        ...           TiedLayerSpec("emb", nn.Embedding, 100, 16, forward_fn=lambda emb, x: x @ emb.weight.t())]
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty str without '.', got {key!r}")
        if forward_fn is not None and not callable(forward_fn):
            raise TypeError(f"TiedLayerSpec: forward_fn must be callable (module, x) -> y or None, got {forward_fn!r}")
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        if not attrs or not all(isinstance(a, str) and a for a in attrs):
            raise ValueError(f"TiedLayerSpec: tied_weight_attr must name one or more attributes, got {tied_weight_attr!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = attrs


class _Function(nn.Module):
    """A callable layer (a lambda, ``torch.flatten``...) as a block: no parameters, no state."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


class _TiedForward(nn.Module):
    """A tied module run through its spec's ``forward_fn(module, x)``."""

    def __init__(self, module: nn.Module, forward_fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        self.module = module
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        return self.forward_fn(self.module, x)


class _Chunk(nn.Sequential):
    """``activation_checkpoint_interval`` consecutive layers of one stage, run as one block; a
    custom ``activation_checkpoint_func`` (DeepSpeed's ``func(run, *inputs)``) recomputes it."""

    def __init__(self, layers: Sequence[nn.Module], func: Callable[..., Any] | None = None) -> None:
        super().__init__(*layers)
        self.checkpoint_func = func

    def forward(self, x: Any) -> Any:
        if self.checkpoint_func is None or not torch.is_grad_enabled():
            return super().forward(x)
        return self.checkpoint_func(super().forward, x)


# ---- DeepSpeed's partitions (deepspeed/runtime/utils.py), as bounds [0, ..., n] -----------------
def _partition_uniform(num_items: int, num_parts: int) -> list[int]:
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def _partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's ``partition_balanced``: the contiguous cut minimising (heaviest − lightest part),
    ties to the last candidate, by the same dynamic programme."""
    n, m = len(weights), num_parts
    if n <= m:
        return _partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], run), min(dp_min[k][j - 1], run)
                cost = hi - lo  # nan for an unreachable (k, j - 1): never taken, as in numpy
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


# ---- the random state DeepSpeed's ranks build under ---------------------------------------------
def _rng_state() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), numpy.random.get_state()


def _set_rng_state(state: tuple[Any, ...]) -> None:
    cpu, cuda, py, np_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    numpy.random.set_state(np_state)


def _set_random_seed(seed: int) -> None:
    """DeepSpeed's ``set_random_seed``: python's, numpy's and torch's generators."""
    random.seed(seed)
    numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def _resolve(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    *parents, name = path.split(".")
    for p in parents:
        module = getattr(module, p)
    return module, name


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: layers run in sequence, cut into ``num_stages`` pipeline stages.

    Every rank builds every layer (see [Note: a PipelineModule built as DeepSpeed builds it]);
    :func:`shardkit.initialize` gives it to shardkit's pipeline with ``num_stages`` as
    ``pipeline.stages``, these layers as the blocks, ``loss_fn`` as the loss and DeepSpeed's stage
    cut. Called directly, ``forward`` runs all layers in order (the unsplit model).

    Args:
        layers: ``nn.Module``\\ s, :class:`LayerSpec`\\ s, :class:`TiedLayerSpec`\\ s and callables
            (e.g. ``lambda x: torch.flatten(x, 1)``), in order; each takes the previous one's output
            (shardkit's pipeline passes one tensor between stages).
        num_stages: pipeline stages; must divide the world size. Or give ``topology``.
        topology: DeepSpeed's ``ProcessTopology``: ``num_stages = topology.get_dim("pipe")``.
        loss_fn: ``loss_fn(outputs, labels) -> 0-d loss`` on the last stage; None: the last
            layer's output is the loss (as DeepSpeed).
        seed_layers: seed ``base_seed + layer index`` (``seed_fn`` or python's, numpy's and
            torch's generators) before building each spec. DeepSpeed also reseeds in its forward
            for each micro-batch; shardkit does not (it changes random layers' draws only).
        seed_fn: ``seed_fn(seed)`` replacing the default seeding.
        base_seed: the first layer's seed with ``seed_layers``.
        partition_method: ``"parameters"`` (balance trainable parameter counts), ``"uniform"``
            (layer counts) or ``"type:REGEX"`` (balance the layers whose class name matches
            REGEX, case-insensitive); DeepSpeed's cut in each case (:meth:`partitions`).
        activation_checkpoint_interval: > 0 recomputes each run of that many layers of a stage
            in the backward pass (as DeepSpeed's runs, from each stage's first layer); a config's
            ``pipeline.activation_checkpoint_interval`` > 0 replaces it, as in DeepSpeed.
        activation_checkpoint_func: ``func(run, *inputs)`` that recomputes; default (None or
            ``shardkit.deepspeed.checkpointing.checkpoint``): shardkit's ``checkpoint_blocks``
            (``torch.utils.checkpoint``, non-reentrant, random state replayed).
        checkpointable_layers: class names; a run is checkpointed when all its layers are of
            them. None: when one of its modules has parameters (DeepSpeed's rule).
        dynamic_shape: DeepSpeed's; accepted, no effect (shardkit's pipeline agrees shapes per step).

    Attributes:
        num_stages, loss_fn, partition_method, activation_checkpoint_interval: as given.
        tied_modules: ``nn.ModuleDict`` of each tie key's module (its lowest stage's).

    Raises:
        ValueError: an unknown ``partition_method`` or one that matches no layer, more stages than
            layers, no ``num_stages``/``topology``, a bad interval — each naming the argument.
        TypeError: a layer that is neither a module, a spec nor a callable (naming
            ``layers[i]``), a nested PipelineModule.

    Example:
        >>> net = PipelineModule(layers=[*features, nn.Flatten(), *classifier], num_stages=2,
        ...                      loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")
        >>> net.partitions()                   # DeepSpeed's bounds: stage s holds layers [b[s], b[s+1])
        [0, 5, 9]
        >>> engine, _, _, _ = shardkit.deepspeed.initialize(args=args, model=net,
        ...     model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=trainset)
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        if topology is not None:
            if not hasattr(topology, "get_dim"):
                raise TypeError(f"PipelineModule: topology must be a ProcessTopology (get_dim('pipe')), got {topology!r}")
            from_topology = topology.get_dim("pipe")
            if num_stages is not None and num_stages != from_topology:
                raise ValueError(f"PipelineModule: num_stages={num_stages} but topology has {from_topology} pipe stages")
            num_stages = from_topology
        if num_stages is None:
            raise ValueError("PipelineModule: num_stages is required (or topology=, a ProcessTopology with a 'pipe' axis)")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineModule: num_stages must be an int >= 1, got {num_stages!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"PipelineModule: loss_fn must be callable (outputs, labels) -> loss or None, got {loss_fn!r}")
        _check_interval("activation_checkpoint_interval", activation_checkpoint_interval)
        if activation_checkpoint_func is not None and not callable(activation_checkpoint_func):
            raise TypeError(f"PipelineModule: activation_checkpoint_func must be callable, got {activation_checkpoint_func!r}")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(f"PipelineModule: checkpointable_layers must be a list of class names, got {checkpointable_layers!r}")
        if seed_fn is not None and not callable(seed_fn):
            raise TypeError(f"PipelineModule: seed_fn must be callable seed -> None, got {seed_fn!r}")
        specs = list(layers)
        for i, layer in enumerate(specs):
            if isinstance(layer, PipelineModule):
                raise TypeError(f"PipelineModule: layers[{i}] is a PipelineModule; nested pipelines are not supported")
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(
                    f"PipelineModule: layers[{i}] must be an nn.Module, a LayerSpec or a callable, got {type(layer).__name__}"
                )
        if num_stages > len(specs):
            raise ValueError(
                f"PipelineModule: num_stages={num_stages} but layers has {len(specs)} entries; every stage needs a layer"
            )
        if not isinstance(partition_method, str):
            raise TypeError(f"PipelineModule: partition_method must be a str, got {partition_method!r}")
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self._layer_specs = specs
        self.parts = self._partition(specs, num_stages, partition_method)
        self.tied_modules = nn.ModuleDict()
        self.tied_stage_copies = nn.ModuleDict()  # a tie's module on a later stage, when it has untied parameters
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build(specs)

    # ---- construction ----------------------------------------------------------------------------
    @staticmethod
    def _partition(specs: list[Any], num_stages: int, method: str) -> list[int]:
        low = method.lower()
        if low == "uniform":
            return _partition_uniform(len(specs), num_stages)
        if low == "parameters":
            weights = [
                _trainable_count(s.build())
                if isinstance(s, LayerSpec)
                else _trainable_count(s)
                if isinstance(s, nn.Module)
                else 0
                for s in specs
            ]
            return _partition_balanced(weights, num_stages)
        if low.startswith("type:"):
            pattern = low.split(":")[1]  # DeepSpeed's reading of the method
            try:
                regex = re.compile(pattern, re.IGNORECASE)
            except re.error as e:
                raise ValueError(f"PipelineModule: partition_method={method!r}: {pattern!r} is not a regular expression ({e})")
            names = [_layer_name(s) for s in specs]
            weights = [1 if name is not None and regex.search(name) else 0 for name in names]
            if not any(weights):
                raise ValueError(f"PipelineModule: partition_method={method!r} matches no layer (class names: {names})")
            return _partition_balanced(weights, num_stages)
        raise ValueError(
            f"PipelineModule: partition_method={method!r} is not supported; use 'parameters', 'uniform' or 'type:REGEX'"
        )

    def _build(self, specs: list[Any]) -> None:
        """Build the layers stage by stage from one random state (see [Note: a PipelineModule
        built as DeepSpeed builds it])."""
        import torch.distributed as dist

        start = _rng_state()
        ends: list[tuple[Any, ...]] = []
        self._funcs: list[nn.Module] = []  # not registered: the layers are registered below
        for s in range(self.num_stages):
            _set_rng_state(start)
            local: dict[str, nn.Module] = {}  # this stage's module of each tie key
            for idx in range(self.parts[s], self.parts[s + 1]):
                layer = specs[idx]
                if self.seed_layers:  # before every layer, as DeepSpeed's _build
                    (self.seed_fn or _set_random_seed)(self.base_seed + idx)
                if isinstance(layer, TiedLayerSpec):
                    if layer.key not in local:
                        local[layer.key] = self._tied_module(layer, s)
                    mod = local[layer.key]
                    self._funcs.append(mod if layer.forward_fn is None else _TiedForward(mod, layer.forward_fn))
                elif isinstance(layer, (LayerSpec, nn.Module)):
                    mod = layer.build() if isinstance(layer, LayerSpec) else layer
                    self.add_module(str(idx), mod)
                    self._funcs.append(mod)
                else:
                    self._funcs.append(_Function(layer))
            ends.append(_rng_state())
        stage = 0
        if dist.is_initialized() and dist.get_world_size() % self.num_stages == 0:
            stage = dist.get_rank() // (dist.get_world_size() // self.num_stages)  # pipe outermost, as DeepSpeed's topology
        _set_rng_state(ends[stage])

    def _tied_module(self, spec: TiedLayerSpec, stage: int) -> nn.Module:
        """This stage's module of ``spec.key``: built (DeepSpeed builds it on every stage holding the
        key), its tied attributes the owner's Parameters; the owner itself when nothing else is
        left to it."""
        built = spec.build()
        owner = self.tied_modules[spec.key] if spec.key in self.tied_modules else None
        if owner is None:
            for attr in spec.tied_weight_attr:
                parent, name = _resolve(built, attr)
                if not isinstance(getattr(parent, name, None), nn.Parameter):
                    raise TypeError(
                        f"TiedLayerSpec({spec.key!r}): tied_weight_attr {attr!r} is not an nn.Parameter of {type(built).__name__}"
                    )
            self.tied_modules[spec.key] = built
            self.tied_weight_attrs[spec.key] = list(spec.tied_weight_attr)
            return built
        for attr in self.tied_weight_attrs[spec.key]:
            parent, name = _resolve(built, attr)
            setattr(parent, name, getattr(*_resolve(owner, attr)))
        shared = {id(t) for t in (*owner.parameters(), *owner.buffers())}
        if all(id(t) in shared for t in (*built.parameters(), *built.buffers())):
            return owner  # e.g. an embedding: one module for every stage
        self.tied_stage_copies[f"{spec.key}_stage{stage}"] = built  # its untied parameters are this stage's own
        return built

    # ---- what DeepSpeed's engine and shardkit.initialize read ------------------------------------
    def partitions(self) -> list[int]:
        """DeepSpeed's stage bounds: stage ``s`` holds layers ``[b[s], b[s + 1])``.

        Example:
            >>> PipelineModule([nn.Linear(2, 2)] * 3, num_stages=2, partition_method="uniform").partitions()
            [0, 2, 3]
        """
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        """The stage that holds layer ``layer_idx``.

        Example:
            >>> net.stage_owner(0)
            0
        """
        if not 0 <= layer_idx < len(self._layer_specs):
            raise ValueError(f"layer_idx={layer_idx} out of range for {len(self._layer_specs)} layers")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])

    def pipeline_blocks(self, activation_checkpoint_interval: int | None = None) -> tuple[list[nn.Module], list[int]]:
        """The blocks shardkit's pipeline runs and how many of them each stage holds.

        Without checkpointing a block is a layer; with an interval ``k > 0`` (default: the
        module's) each stage's layers are grouped in runs of ``k`` from its first layer, and the
        checkpointable runs recompute in backward.

        Args:
            activation_checkpoint_interval: replaces the module's when given (a config's
                ``pipeline.activation_checkpoint_interval``).

        Returns:
            ``(blocks, stage sizes)``: the sizes sum to ``len(blocks)``.

        Example:
            >>> blocks, sizes = net.pipeline_blocks()
            >>> sizes
            [5, 4]
        """
        k = self.activation_checkpoint_interval if activation_checkpoint_interval is None else activation_checkpoint_interval
        _check_interval("activation_checkpoint_interval", k)
        bounds = self.parts
        if k == 0:
            return list(self._funcs), [bounds[s + 1] - bounds[s] for s in range(self.num_stages)]
        from shardkit.parallel import checkpoint_blocks

        from .checkpointing import checkpoint

        func = self.activation_checkpoint_func
        custom = func is not None and func is not checkpoint
        blocks, sizes = [], []
        for s in range(self.num_stages):
            runs = range(bounds[s], bounds[s + 1], k)
            for a in runs:
                idx = range(a, min(a + k, bounds[s + 1]))
                chunk = _Chunk([self._funcs[j] for j in idx], func if custom and self._checkpointable(idx) else None)
                if not custom and self._checkpointable(idx):
                    checkpoint_blocks([chunk])
                blocks.append(chunk)
            sizes.append(len(runs))
        return blocks, sizes

    def _checkpointable(self, idx: range) -> bool:
        """DeepSpeed's ``_is_checkpointable`` on the layers ``idx``: its forward list holds the
        modules, and a function or ``partial`` (not modules) for callables and ``forward_fn`` ties."""
        if self.checkpointable_layers is not None:
            return all(_layer_class(self._layer_specs[j]) in self.checkpointable_layers for j in idx)
        modules = [self._funcs[j] for j in idx if not isinstance(self._funcs[j], (_Function, _TiedForward))]
        return any(any(True for _ in m.parameters()) for m in modules)

    def forward(self, forward_input: Any) -> Any:
        """All layers in order (the unsplit model; the pipeline runs them as blocks instead).

        Example:
            >>> logits = net(torch.randn(4, 8))
        """
        x = forward_input
        for f in self._funcs:
            x = f(x)
        return x


def _layer_class(layer: Any) -> str:
    """The class name DeepSpeed's forward list holds for a layer (a partial for a forward_fn)."""
    if isinstance(layer, TiedLayerSpec):
        return layer.typename.__name__ if layer.forward_fn is None else "partial"
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def _check_interval(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"PipelineModule: {name} must be an int >= 0, got {value!r}")
