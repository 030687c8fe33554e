"""The usage matrix: axes as data, the pairwise generator, and the cell runner.

A cell is one (model, usage, layout) triple: a model family trained the way people use it, on one
composition of the parallel strategies, against the dense single-process model built from the
same seed and trained on the whole global batch with ``torch.optim.SGD`` (momentum and weight
decay: a param stepped when it should not be, or by a wrong gradient, moves by far more than
:data:`tolerances.FP32`). SGD keeps another order of additions at ``lr * u * sum|g|`` (see
"Choosing a tolerance" in docs/testing.md), so the cells hold under the reduction-order guard.

``tests/compose/test_usage_matrix.py`` runs :func:`pairwise` cells in ``make test`` and the full product
under ``-m slow_matrix`` (``make test-matrix``); docs/testing.md, "The usage matrix", says how to
add an axis value.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tolerances import FP32

# ---- the axes ------------------------------------------------------------------------------------
#: model families: shardkit's demo GPT, HF GPT-2 (tied head, Conv1D), HF Llama with grouped-query
#: attention (untied head), HF Mixtral with top-1 routing over 8 per-expert modules (as
#: transformers < 5 stored them: an expert no token reached gets no gradient on that rank)
MODELS = ("tinygpt", "gpt2", "llama_gqa", "moe")

#: how the model is used around the training step (see :func:`run_cell` for each one's checks)
USAGES = (
    "train",  # plain steps with clipping
    "generate",  # the unwrapped module called directly, and generate(), after training
    "eval_between",  # evaluate() between steps; training continues in train mode
    "dropout",  # dropout on: eval disables it, replicas stay identical, it changes the loss
    "padded",  # right-padded batches: ignore_index targets (HF: and an attention mask)
    "write_ema",  # params written between steps (p *= 0.9) and an EMA copy swapped in at the end
    "two_models",  # two models (actor/critic) in one job, same layout, same nvme_dir
    "frozen_zero_size",  # frozen params and a trainable zero-size param; optimizer gets them all
    "grad_accum",  # two forward_backward calls per step (half batches), one step
)


@dataclass(frozen=True)
class Layout:
    """One composition of the strategies. ``dp_size`` x ``tp`` x (2 if ``pp`` else 1) x ``cp`` ranks."""

    dp: str  # parallelize's dp=: ddp | zero1 | zero2 | zero3
    dp_size: int
    tp: int = 1
    sp: bool = False
    pp: str | None = None  # the schedule: gpipe | 1f1b | interleaved | zb-h1
    offload: str | None = None  # cpu | nvme (ZeRO only)
    cp: int = 1  # context parallelism: each sequence over cp ranks
    cp_mode: str | None = None  # ring | ulysses | hybrid
    ulysses_size: int | None = None  # hybrid's all-to-all group

    @property
    def world(self) -> int:
        return self.dp_size * self.tp * (2 if self.pp else 1) * self.cp


#: Only valid compositions are values: parallelize refuses zero3 with pp (as DeepSpeed) and
#: offload belongs to ZeRO, so neither appears here (nothing to skip at run time).
LAYOUTS: dict[str, Layout] = {
    "ddp": Layout("ddp", 2),
    "zero1": Layout("zero1", 2),
    "zero2+cpu": Layout("zero2", 2, offload="cpu"),
    "zero3": Layout("zero3", 2),
    "zero3+nvme": Layout("zero3", 2, offload="nvme"),
    "tp": Layout("ddp", 1, tp=2),
    "tp*zero2": Layout("zero2", 2, tp=2),
    "sp*zero3": Layout("zero3", 2, tp=2, sp=True),
    "pp:gpipe": Layout("ddp", 1, pp="gpipe"),
    "pp:1f1b*zero1+nvme": Layout("zero1", 2, pp="1f1b", offload="nvme"),
    "pp:interleaved*ddp": Layout("ddp", 2, pp="interleaved"),
    "pp:zb-h1*tp": Layout("ddp", 1, tp=2, pp="zb-h1"),
    "cp:ulysses*zero2": Layout("zero2", 1, cp=2, cp_mode="ulysses"),
    "cp:ring*tp": Layout("ddp", 1, tp=2, cp=2, cp_mode="ring"),
    "cp:hybrid": Layout("ddp", 1, cp=4, cp_mode="hybrid", ulysses_size=2),
}

AXES: dict[str, tuple[str, ...]] = {"model": MODELS, "usage": USAGES, "layout": tuple(LAYOUTS)}

#: Combinations that cannot run, each with why. A predicate sees a possibly partial cell (the
#: pairwise generator asks about pairs) and must return False when an axis it reads is unset.
CONSTRAINTS: tuple[tuple[str, Callable[[Mapping[str, str]], bool]], ...] = (
    (
        "generate under pp: a pipeline runs its stages only inside step()/evaluate(); there is no "
        "module to call directly or to generate with",
        lambda c: c.get("usage") == "generate" and "layout" in c and LAYOUTS[c["layout"]].pp is not None,
    ),
    (
        "sequence parallel with an HF model: hf_gpt2_plan / llama_plan have no sequence-parallel variant",
        lambda c: c.get("model", "tinygpt") != "tinygpt" and "layout" in c and LAYOUTS[c["layout"]].sp,
    ),
    (
        "generate under cp: a model under a cp plan takes every input as this rank's shard of a sequence; "
        "generation runs on an unparallelized copy (docs/context_parallel.md)",
        lambda c: c.get("usage") == "generate" and "layout" in c and LAYOUTS[c["layout"]].cp > 1,
    ),
    (
        "dropout under ring or hybrid attention: every family here drops attention weights, which the "
        "ring's blockwise kernels do not do (refused by name; Ulysses applies it)",
        lambda c: c.get("usage") == "dropout" and "layout" in c and LAYOUTS[c["layout"]].cp_mode in ("ring", "hybrid"),
    ),
    (
        "an HF attention mask under cp: refused on every rank (right-padded rows with ignore_index targets "
        "need none; tinygpt's padded cell passes none and runs under cp)",
        lambda c: (
            c.get("usage") == "padded"
            and c.get("model", "tinygpt") != "tinygpt"
            and "layout" in c
            and LAYOUTS[c["layout"]].cp > 1
        ),
    ),
)


def impossible(cell: Mapping[str, str]) -> str | None:
    """Why ``cell`` (possibly partial) cannot run, or None."""
    for reason, applies in CONSTRAINTS:
        if applies(cell):
            return reason
    return None


# ---- the pairwise generator ----------------------------------------------------------------------
Pair = tuple[tuple[str, str], tuple[str, str]]


def _pairs(cell: Mapping[str, str], names: Sequence[str]) -> set[Pair]:
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}


def full_product(axes: Mapping[str, Sequence[str]], allowed: Callable[[Mapping[str, str]], bool]) -> list[dict[str, str]]:
    """Every allowed cell, in axis order."""
    names = list(axes)
    cells = (dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names)))
    return [c for c in cells if allowed(c)]


def pairwise(axes: Mapping[str, Sequence[str]], allowed: Callable[[Mapping[str, str]], bool]) -> list[dict[str, str]]:
    """An all-pairs cover: every pair of values of any two axes that some allowed cell holds
    appears in at least one returned cell, and every returned cell is allowed.

    Greedy (AETG-style) over the allowed product: repeatedly take the cell covering the most
    pairs not covered yet (ties: the first in axis order), until none is left. Deterministic.
    The product must fit in memory (thousands of cells, not millions).

    Example:
        >>> len(pairwise({"a": "xy", "b": "xy", "c": "xy"}, lambda c: True))
        4
    """
    names = list(axes)
    candidates = [(c, _pairs(c, names)) for c in full_product(axes, allowed)]
    uncovered = set().union(*(p for _, p in candidates)) if candidates else set()
    chosen: list[dict[str, str]] = []
    while uncovered:
        best, gain = None, 0
        for cell, pairs in candidates:
            n = len(pairs & uncovered)
            if n > gain:
                best, gain = (cell, pairs), n
        assert best is not None
        chosen.append(best[0])
        uncovered -= best[1]
    return chosen


def covered_pairs(cells: Sequence[Mapping[str, str]], names: Sequence[str]) -> set[Pair]:
    """The pairs the cells hold."""
    return set().union(*(_pairs(c, names) for c in cells)) if cells else set()


def cell_id(cell: Mapping[str, str]) -> str:
    return "-".join(cell[n] for n in AXES)


# ---- models ---------------------------------------------------------------------------------------
VOCAB, B, T, STEPS, CLIP = 61, 8, 8, 2, 0.5
N_EXPERTS = 8
SGD = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
MICROBATCHES = 2
COMM_TIMEOUT = timedelta(seconds=60)  # a hang fails the body well inside the harness timeout
PAD = 0


@functools.cache
def _hf_classes() -> dict[str, type]:
    """HF causal LMs whose ``forward(x)`` returns the logits (``x``: ids ``(B, T)`` or ids and
    attention mask stacked ``(B, 2, T)``), as parallelize's loss expects; keyword calls
    (``generate``, ``labels=``) go to HF's own forward unchanged."""
    import transformers

    def logits_lm(base: type) -> type:
        def forward(self: Any, x: torch.Tensor | None = None, **kwargs: Any) -> Any:
            if x is None or kwargs:
                return base.forward(self, input_ids=x, **kwargs) if x is not None else base.forward(self, **kwargs)
            if x.dim() == 3:
                return base.forward(self, input_ids=x[:, 0], attention_mask=x[:, 1]).logits
            return base.forward(self, input_ids=x).logits

        return type(base.__name__ + "Logits", (base,), {"forward": forward})

    return {
        "gpt2": logits_lm(transformers.GPT2LMHeadModel),
        "llama_gqa": logits_lm(transformers.LlamaForCausalLM),
        "moe": logits_lm(transformers.MixtralForCausalLM),
    }


class PerExpertMLPs(nn.Module):
    """Mixtral's experts as one module per expert (transformers < 5's layout: ``w1``/``w3``/``w2``)
    built from the fused ``gate_up_proj``/``down_proj``; runs only the experts a token reached,
    so an expert nobody on this rank routed to gets no gradient here."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        inter = fused.intermediate_dim
        self.act_fn = fused.act_fn
        self.experts = nn.ModuleList()
        for e in range(fused.num_experts):
            mlp = nn.Module()
            mlp.w1 = nn.Linear(fused.hidden_dim, inter, bias=False)
            mlp.w3 = nn.Linear(fused.hidden_dim, inter, bias=False)
            mlp.w2 = nn.Linear(inter, fused.hidden_dim, bias=False)
            with torch.no_grad():
                mlp.w1.weight.copy_(fused.gate_up_proj[e, :inter])
                mlp.w3.weight.copy_(fused.gate_up_proj[e, inter:])
                mlp.w2.weight.copy_(fused.down_proj[e])
            self.experts.append(mlp)

    def forward(self, h: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, mlp in enumerate(self.experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            y = mlp.w2(self.act_fn(mlp.w1(h[token])) * mlp.w3(h[token]))
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


def build_model(family: str, *, seed: int = 0, dropout: bool = False) -> nn.Module:
    """The model of ``family``, initialized from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    p = 0.1 if dropout else 0.0
    if family == "tinygpt":
        from shardkit.models import TinyGPT

        return TinyGPT(VOCAB, d_model=32, n_layers=2, n_heads=4, seq_len=T, dropout=p)
    import transformers

    common = dict(vocab_size=VOCAB, bos_token_id=PAD, eos_token_id=PAD, pad_token_id=PAD, attn_implementation="sdpa")
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=2 * T, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, **common
        )
    elif family == "llama_gqa":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2 * T, attention_dropout=p, **common,
        )  # fmt: skip
    else:
        cfg = transformers.MixtralConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=N_EXPERTS, num_experts_per_tok=1, max_position_embeddings=2 * T, attention_dropout=p,
            **common,
        )  # fmt: skip
    model = _hf_classes()[family](cfg)
    if family == "moe":
        for layer in model.model.layers:
            layer.mlp.experts = PerExpertMLPs(layer.mlp.experts)
            # three rarely chosen experts (small router rows, no ties): at the first step some get
            # tokens on one dp rank only, some on none (test_moe_routes_experts_unevenly)
            with torch.no_grad():
                layer.mlp.gate.weight[N_EXPERTS - 3 :] *= 0.1
    return model


def tp_plan(family: str, model: nn.Module, sp: bool) -> dict:
    from shardkit.parallel.tensor import gpt_plan, hf_gpt2_plan, llama_plan

    if family == "tinygpt":
        return gpt_plan(sequence_parallel=sp)
    if family == "gpt2":
        return hf_gpt2_plan(model)
    plan = llama_plan(model)
    if family == "moe":  # attention split over tp; router and experts replicated
        plan = {k: v for k, v in plan.items() if ".mlp." not in k}
    return plan


def cp_plan(family: str) -> dict:
    """The family's context-parallel plan (Mixtral's attention and rotary embedding are named as
    Llama's)."""
    from shardkit.parallel.context import gpt_cp_plan, hf_gpt2_cp_plan, llama_cp_plan

    return {"tinygpt": gpt_cp_plan, "gpt2": hf_gpt2_cp_plan}.get(family, llama_cp_plan)()


class _HFEmbed(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.gpt2 = hasattr(model, "transformer")
        if self.gpt2:
            self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop
        else:
            self.embed_tokens = model.model.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.gpt2:
            return self.embed_tokens(ids)
        return self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))[None])


class _HFLayer(nn.Module):
    """One decoder layer as a pipeline block: the causal mask (and Llama's rotary embedding)
    computed from the hidden states, as the HF model computes them once for all layers."""

    def __init__(self, model: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.config = layer, model.config
        self.rotary = None if hasattr(model, "transformer") else model.model.rotary_emb

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
        if self.rotary is None:
            return self.layer(h, attention_mask=mask)
        return self.layer(h, attention_mask=mask, position_embeddings=self.rotary(h, position_ids=pos), position_ids=pos)


class _HFHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm = model.transformer.ln_f if hasattr(model, "transformer") else model.model.norm
        self.lm_head = model.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """``[embedding, *layers, head]`` whose composition is the model (the user's ``blocks=``)."""
    from shardkit.models import TinyGPT, gpt_blocks

    if isinstance(model, TinyGPT):
        return gpt_blocks(model)
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return [_HFEmbed(model), *(_HFLayer(model, layer) for layer in layers), _HFHead(model)]


def _first_layer(model: nn.Module) -> nn.Module:
    if hasattr(model, "blocks"):
        return model.blocks[0]
    return model.transformer.h[0] if hasattr(model, "transformer") else model.model.layers[0]


def _frozen_names(family: str) -> tuple[str, ...]:
    return {
        "tinygpt": ("pos_emb.weight", "blocks.0.ln1.weight"),
        "gpt2": ("transformer.wpe.weight", "transformer.h.0.ln_1.weight"),
    }.get(family, ("model.layers.0.input_layernorm.weight", "model.norm.weight"))


def _freeze_and_add_empty(model: nn.Module, family: str) -> None:
    """Frozen params, and a trainable zero-size param in the first layer that the forward uses
    (a hook adds its empty sum), so it gets a (zero-size) gradient."""
    params = dict(model.named_parameters())
    for name in _frozen_names(family):
        params[name].requires_grad_(False)
    layer = _first_layer(model)
    layer.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    layer.register_forward_hook(_add_empty)


def _add_empty(module: nn.Module, args: Any, out: Any) -> Any:
    return out + module.empty.sum() if torch.is_tensor(out) else out


# ---- batches -------------------------------------------------------------------------------------
def batch(step: int, *, padded: bool = False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Global ``(ids, targets, attention_mask or None)``; padded: rows right-padded from a random
    length in [2, T] (pad id, ignore_index targets, mask 0); one row of targets entirely ignored."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    y = torch.randint(1, VOCAB, (B, T), generator=g)
    if not padded:
        return ids, y, None
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, PAD)
    y = y.masked_fill(mask == 0, -100)
    y[1] = -100  # a row with nothing to learn: its replica must not divide by zero
    return ids, y, mask


def model_input(family: str, ids: torch.Tensor, mask: torch.Tensor | None, pp: bool) -> torch.Tensor:
    """What the model is called with: HF gets the attention mask stacked with the ids (not under
    a pipeline, whose blocks pass one tensor: right padding under a causal mask changes no
    valid position, so the logits that count are the same)."""
    if mask is None or family == "tinygpt" or pp:
        return ids
    return torch.stack([ids, mask], dim=1)


def _ce(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), reduction=reduction)


# ---- one job: a parallel model and its dense twin ------------------------------------------------
class _Job:
    """``par`` (the layout) and ``dense`` (one process, whole batch), trained in lockstep."""

    def __init__(self, family: str, usage: str, layout: Layout, ctx: Any, *, seed: int, nvme_dir: str | None) -> None:
        from shardkit.parallel import parallelize

        self.family, self.usage, self.layout, self.ctx = family, usage, layout, ctx
        dropout = usage == "dropout"
        model = build_model(family, seed=seed, dropout=dropout)
        self.dense = build_model(family, seed=seed, dropout=dropout)
        if usage == "frozen_zero_size":
            _freeze_and_add_empty(model, family)
            _freeze_and_add_empty(self.dense, family)
        self.dense.train()
        self.plan = tp_plan(family, self.dense, layout.sp) if layout.tp > 1 else None
        kwargs: dict[str, Any] = {"dp": layout.dp}
        if self.plan is not None:
            kwargs["tp_plan"] = tp_plan(family, model, layout.sp)
        if layout.pp:
            pp = {"schedule": layout.pp, "microbatches": MICROBATCHES}
            if layout.pp == "interleaved":
                pp["virtual_stages"] = 2
            kwargs.update(pp=pp, blocks=model_blocks)
        if layout.offload:
            kwargs["dp_options"] = {"offload": layout.offload, "nvme_dir": nvme_dir}
        if layout.cp > 1:
            kwargs["cp"] = {"plan": cp_plan(family), "mode": layout.cp_mode}
            if layout.ulysses_size is not None:
                kwargs["cp"]["ulysses_size"] = layout.ulysses_size
        self.par = parallelize(model, ctx, **kwargs)
        # the documented recipe: everything the module holds, frozen params included
        params = list(self.par.module.parameters()) if usage == "frozen_zero_size" else self.par.parameters()
        self.opt = self.par.make_optimizer(torch.optim.SGD, params, **SGD)
        self.dense_opt = torch.optim.SGD(self.dense.parameters(), **SGD)
        self.dp, self.r = ctx.size("dp"), ctx.rank("dp")
        self.rows = slice(self.r * B // self.dp, (self.r + 1) * B // self.dp)
        self.ema: list[torch.Tensor] | dict[str, torch.Tensor] | None = None
        self.dense_ema: dict[str, torch.Tensor] | None = None

    # -- the module as the user sees it
    def inner(self) -> nn.Module:
        """The user's (TP-converted) model, unwrapped."""
        return getattr(self.par.module, "module", self.par.module)

    def x(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return model_input(self.family, ids, mask, self.layout.pp is not None)

    # -- one step on both
    def step(self, step: int, *, seed: int) -> tuple[float, float]:
        ids, y, mask = batch(step, padded=self.usage == "padded", seed=seed)
        halves = [slice(0, B // 2), slice(B // 2, B)] if self.usage == "grad_accum" else [slice(0, B)]
        self.opt.zero_grad(set_to_none=True)
        for k, part in enumerate(halves):  # this replica's rows of each part
            i, t, m = ids[part], y[part], None if mask is None else mask[part]
            n = i.shape[0]
            mine = slice(self.r * n // self.dp, (self.r + 1) * n // self.dp)
            x = self.x(i, m)
            if self.usage != "dropout":
                with torch.no_grad():
                    want = float(_ce(self._dense_logits(x[mine]), t[mine]))
            # accumulation as with torch DDP/FSDP: every part but the last under no_sync()
            with contextlib.nullcontext() if k == len(halves) - 1 else self.par.no_sync():
                loss = float(self.par.forward_backward(x[mine], t[mine]))
            if self.usage != "dropout" and not (want != want and loss != loss):  # an all-ignored slice: NaN both
                assert abs(loss - want) <= 1e-5 * max(1.0, abs(want)), (step, loss, want)
        norm = float(self.par.clip(CLIP))
        self.par.step(self.opt)
        # the dense twin: the layout's objective on the whole batch
        self.dense_opt.zero_grad()
        for part in halves:
            i, t, m = ids[part], y[part], None if mask is None else mask[part]
            x, n = self.x(i, m), i.shape[0]
            logits = self._dense_logits(x)
            if self.layout.pp:  # token-weighted over the whole part (the pipeline's default loss)
                obj = _ce(logits, t, "sum") / (t != -100).sum().clamp(min=1)
            else:  # the mean of the replicas' means (DDP / FSDP semantics)
                parts = [slice(r * n // self.dp, (r + 1) * n // self.dp) for r in range(self.dp)]
                means = [_ce(logits[s], t[s]) for s in parts]
                obj = sum(v for v in means if not torch.isnan(v)) / self.dp
            obj.backward()
        dense_norm = float(torch.nn.utils.clip_grad_norm_([p for p in self.dense.parameters() if p.requires_grad], CLIP))
        self.dense_opt.step()
        if self.usage != "dropout":
            assert abs(norm - dense_norm) <= 1e-4 * dense_norm + 1e-6, (step, norm, dense_norm)
        return loss, norm

    def _dense_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)

    # -- checks
    def evaluate_matches(self, seed: int) -> None:
        g = torch.Generator().manual_seed(99 + seed)
        xv, yv = torch.randint(1, VOCAB, (B, T), generator=g), torch.randint(1, VOCAB, (B, T), generator=g)
        got = self.par.evaluate(xv[self.rows], yv[self.rows])
        was = self.dense.training
        self.dense.eval()
        with torch.no_grad():
            want = float(_ce(self.dense(xv[self.rows]), yv[self.rows]))
        self.dense.train(was)
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), ("evaluate", got, want)

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """This rank's params under the dense model's names (TP shards as the plan cuts them);
        None for tp x pp (stage keys are block indices of TP shards: losses, norms and evaluate
        cover it)."""
        if self.layout.pp:
            return None if self.layout.tp > 1 else self.par.pipeline.full_state_dict()
        if self.layout.dp == "zero3":
            return self.par.module.full_state_dict()
        return {k: v.detach() for k, v in self.inner().state_dict().items()}

    def expected_state(self) -> dict[str, torch.Tensor]:
        from shardkit.parallel.tensor import shard_state_dict

        if self.layout.pp:
            return nn.Sequential(*model_blocks(self.dense)).state_dict()
        state = self.dense.state_dict()
        return shard_state_dict(state, self.plan, self.ctx) if self.plan is not None else state

    def state_matches(self) -> None:
        got = self.full_state()
        if got is None:
            return
        want = self.expected_state()
        assert set(got) <= set(want), sorted(set(got) - set(want))
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], **FP32, msg=lambda m, key=key: f"{key}: {m}")

    # -- writes (write_ema)
    def _local_params(self) -> list[nn.Parameter]:
        return [p for p in self.par.parameters() if p.requires_grad]

    @torch.no_grad()
    def write_params(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``p = fn(p)`` elementwise on every trainable param, as a user writes it: in place on
        the params this rank holds; ZeRO-3 through its full state dict."""
        if self.layout.dp == "zero3" and not self.layout.pp:
            full = self.par.module.full_state_dict()
            self.par.module.load_full_state_dict({k: fn(v) if k in self._trainable() else v for k, v in full.items()})
        else:
            for p in self._local_params():
                p.copy_(fn(p))
        for p in self.dense.parameters():
            if p.requires_grad:
                p.copy_(fn(p))

    def _trainable(self) -> set[str]:
        """Trainable param names, a tied param under each of its names (full_state_dict has both)."""
        return {n for n, p in self.dense.named_parameters(remove_duplicate=False) if p.requires_grad}

    @torch.no_grad()
    def update_ema(self, decay: float = 0.5) -> None:
        dense = {n: p.detach() for n, p in self.dense.named_parameters() if p.requires_grad}
        if self.layout.dp == "zero3" and not self.layout.pp:
            mine: Any = {k: v for k, v in self.par.module.full_state_dict().items() if k in self._trainable()}
        else:
            mine = [p.detach() for p in self._local_params()]
        if self.ema is None:
            self.ema = {k: v.clone() for k, v in mine.items()} if isinstance(mine, dict) else [v.clone() for v in mine]
            self.dense_ema = {k: v.clone() for k, v in dense.items()}
            return
        pairs = zip(self.ema.values(), mine.values()) if isinstance(mine, dict) else zip(self.ema, mine)
        for e, v in pairs:
            e.lerp_(v, 1 - decay)
        for k, v in dense.items():
            self.dense_ema[k].lerp_(v, 1 - decay)

    @torch.no_grad()
    def swap_in_ema(self) -> None:
        if isinstance(self.ema, dict):
            full = self.par.module.full_state_dict()
            full.update(self.ema)
            self.par.module.load_full_state_dict(full)
        else:
            for p, e in zip(self._local_params(), self.ema):
                p.copy_(e)
        for n, p in self.dense.named_parameters():
            if n in self.dense_ema:
                p.copy_(self.dense_ema[n])

    # -- generate (direct calls)
    @torch.no_grad()
    def direct_calls_match(self) -> None:
        ids, _, _ = batch(77)
        module, dense = self.inner(), self.dense
        module.eval(), dense.eval()
        try:
            got, want = module(ids[:2]), dense(ids[:2])
            if self.layout.tp > 1:  # a vocab-parallel head: this rank's vocabulary slice
                vs = -(-VOCAB // self.layout.tp)
                r = self.ctx.rank("tp")
                n = min(vs, VOCAB - r * vs)
                got, want = got[..., :n], want[..., r * vs : r * vs + n]
            torch.testing.assert_close(got, want, **FP32)
            if self.layout.tp == 1:  # generate needs the whole vocabulary's logits
                prompt = ids[:2, :3]
                if self.family == "tinygpt":
                    out, ref = module.generate(prompt, 4, temperature=0), dense.generate(prompt, 4, temperature=0)
                else:
                    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=PAD)
                    out, ref = module.generate(prompt, **kw), dense.generate(prompt, **kw)
                torch.testing.assert_close(out, ref, rtol=0, atol=0)
        finally:
            module.train(), dense.train()

    def replicas_agree(self) -> None:
        """Every dp replica (and every cp rank of one) holds the same params (a fingerprint
        compared over dp x cp)."""
        state = self.full_state()
        if state is None:
            state = {str(i): p.detach() for i, p in enumerate(self.par.parameters())}
        fp = torch.tensor([float(v.double().abs().sum()) + 1e-3 * float(v.double().sum()) for v in state.values()])
        group = self.ctx.group("dp_cp")
        if group.size() > 1:
            out = [torch.empty_like(fp) for _ in range(group.size())]
            dist.all_gather(out, fp, group=group)
            for other in out:
                assert torch.equal(other, fp), "dp/cp replicas diverged"


def run_cell(model: str, usage: str, layout_name: str) -> None:
    """One cell, on every rank of a world of ``LAYOUTS[layout_name].world`` ranks."""
    from shardkit.comm import ParallelContext

    layout = LAYOUTS[layout_name]
    nvme_dir = tempfile.mkdtemp(prefix="shardkit-matrix-") if layout.offload == "nvme" else None
    ctx = ParallelContext.from_world(
        dp=layout.dp_size, tp=layout.tp, pp=2 if layout.pp else 1, cp=layout.cp, timeout=COMM_TIMEOUT
    )
    jobs: list[_Job] = []
    try:
        jobs.append(_Job(model, usage, layout, ctx, seed=0, nvme_dir=nvme_dir))
        if usage == "two_models":  # the critic: another seed, the same layout and nvme_dir
            jobs.append(_Job(model, usage, layout, ctx, seed=1, nvme_dir=nvme_dir))
        job = jobs[0]
        if usage == "dropout":
            job.evaluate_matches(0)  # eval mode turns dropout off, on every stage and shard
            first, _ = job.step(0, seed=0)
            job.step(1, seed=0)
            job.replicas_agree()
            with torch.no_grad():  # dropout changed the training loss
                ids, y, _ = batch(0)
                plain = build_model(model, seed=0)
                want = float(_ce(plain(ids[job.rows]), y[job.rows]))
            # Mixtral has attention dropout only: a small change (1.3e-5 seen), far above the rounding
            assert abs(first - want) > 2e-6, ("dropout changed nothing", first, want)
            return
        for step in range(STEPS):
            for i, j in enumerate(jobs):
                j.step(step, seed=i)
                if usage == "eval_between":
                    j.evaluate_matches(step)
                if usage == "write_ema":
                    j.update_ema()
                    if step == 0:
                        j.write_params(lambda p: p * 0.9)
        if usage == "write_ema":
            job.swap_in_ema()
        if usage == "generate":
            job.direct_calls_match()
        for j in jobs:
            j.state_matches()
            j.evaluate_matches(STEPS)
    finally:
        for j in jobs:
            j.par.close()
        ctx.destroy()
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
