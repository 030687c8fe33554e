"""``parallelize(fused_cross_entropy=True)``: the loss formed from the LM head's input, chunk by
chunk, trains like the unfused dense model (same losses, norms and parameters) over dp, tp (with
and without sequence parallelism), ZeRO-3 and the last pipeline stage; TinyGPT and HF GPT-2 follow
the same 50-step loss curve with and without it; the model called directly still gives logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.models import TinyGPT, lm_loss
from shardkit.parallel import parallelize
from shardkit.parallel.tensor import FusedCrossEntropyHead
from parallelize_cases import train_parallelized
from tolerances import FP32


@pytest.mark.parametrize(
    "world_size, tp, pp, tie, strategy, sp",
    [
        (2, 1, 1, True, "ddp", False),  # dp 2, the tied nn.Linear head
        (2, 2, 1, True, "ddp", False),  # tp 2: the vocab-parallel head, dhidden all-reduced
        (2, 2, 1, True, "ddp", True),  # tp 2 + sequence parallel: chunks gathered, dhidden reduce-scattered
        (4, 2, 1, True, "zero3", False),  # tp 2 x ZeRO-3 dp 2: the head's weight read from the root unit
        (2, 1, 2, True, "ddp", False),  # pp 2: the loss on the last stage, the head tied across stages
    ],
)
def test_fused_loss_trains_like_the_dense_model(dist_pool, world_size, tp, pp, tie, strategy, sp):
    dist_pool.run(train_parallelized, tp, pp, tie, "1f1b", False, strategy, sp, True, world_size=world_size, timeout=180)


def _lm_data(vocab: int, steps: int, b: int = 4, t: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):  # a learnable sequence: each token follows from the one before
        ids = torch.empty(b, t + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(vocab, (b,), generator=gen)
        for i in range(t):
            ids[:, i + 1] = (7 * ids[:, i] + 3) % vocab
        y = ids[:, 1:].clone()
        y[0, :5] = -100  # padding on one row
        out.append((ids[:, :-1], y))
    return out


def _curve(model: nn.Module, fused: bool, steps: int) -> list[float]:
    par = parallelize(model, None, dp="none", fused_cross_entropy=fused)
    if fused:
        assert isinstance(par.fused_heads[0], FusedCrossEntropyHead)
        par.fused_heads[0].chunk_tokens = 20  # 64 tokens a batch: several chunks, one uneven
    opt = torch.optim.AdamW(par.parameters(), lr=3e-3)
    losses = []
    for x, y in _lm_data(model_vocab(model), steps):
        opt.zero_grad()
        losses.append(float(par.forward_backward(x, y)))
        par.clip(1.0)
        par.step(opt)
    return losses


def model_vocab(model: nn.Module) -> int:
    return model.config.vocab_size


def test_tiny_gpt_trains_the_same_curve_with_dropout_and_padding():
    def build() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(61, d_model=32, n_layers=2, n_heads=4, seq_len=16, dropout=0.1)

    torch.manual_seed(1)
    plain = _curve(build(), False, 50)
    torch.manual_seed(1)  # the same dropout masks
    fused = _curve(build(), True, 50)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), **FP32)
    assert plain[-1] < plain[0] - 0.3  # it trained


@pytest.mark.parametrize("name", ["hf:gpt2", "hf:llama"])
def test_hf_models_train_the_same_curve_and_generate(name):
    """GPT-2 (head tied to the embedding) and Llama (untied head, RMSNorm, rotary)."""
    pytest.importorskip("transformers")
    from shardkit.hf_models import LogitsOnly, build_hf_model

    def build() -> LogitsOnly:
        torch.manual_seed(0)
        return LogitsOnly(build_hf_model(name, vocab_size=67, d_model=32, n_layers=2, n_heads=4, seq_len=16))

    steps = 50 if name == "hf:gpt2" else 20  # the 50-step curve on GPT-2; Llama shorter
    plain = _curve_hf(build(), False, steps)
    model = build()
    fused = _curve_hf(model, True, steps)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), **FP32)
    # the head keeps its names (and GPT-2's tie); called directly the model gives logits
    assert isinstance(model.hf.lm_head, FusedCrossEntropyHead)
    assert (model.hf.lm_head.weight is model.hf.get_input_embeddings().weight) == (name == "hf:gpt2")
    assert "hf.lm_head.weight" in model.state_dict()
    ids = torch.randint(67, (2, 5), generator=torch.Generator().manual_seed(0))
    assert model(ids).shape == (2, 5, 67)
    out = model.hf.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 8)


def _curve_hf(model: nn.Module, fused: bool, steps: int) -> list[float]:
    par = parallelize(model, None, dp="none", fused_cross_entropy=fused)
    if fused:
        par.fused_heads[0].chunk_tokens = 20
    opt = torch.optim.AdamW(par.parameters(), lr=3e-3)
    losses = []
    for x, y in _lm_data(67, steps):
        opt.zero_grad()
        losses.append(float(par.forward_backward(x, y)))
        par.step(opt)
    # evaluate goes through the fused loss too, and equals the unfused loss of the logits
    with torch.no_grad():
        x, y = _lm_data(67, 1)[0]
        assert abs(par.evaluate(x, y) - float(lm_loss(model(x), y))) < 1e-5
    return losses


def test_fused_cross_entropy_argument_errors():
    def build() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(61, d_model=32, n_layers=2, n_heads=4, seq_len=16)

    with pytest.raises(ValueError, match="loss_fn=None"):
        parallelize(build(), None, dp="none", fused_cross_entropy=True, loss_fn=lm_loss)
    with pytest.raises(TypeError, match="fused_cross_entropy"):
        parallelize(build(), None, dp="none", fused_cross_entropy=1)
    with pytest.raises(ValueError, match="no module 'nothing'"):
        parallelize(build(), None, dp="none", fused_cross_entropy="nothing")
    with pytest.raises(ValueError, match="nn.Linear"):
        parallelize(build(), None, dp="none", fused_cross_entropy="blocks.0.ln1")
    two_heads = nn.ModuleDict({"a": nn.ModuleDict({"head": nn.Linear(4, 5)}), "b": nn.ModuleDict({"head": nn.Linear(4, 5)})})
    with pytest.raises(ValueError, match="more than one"):
        parallelize(two_heads, None, dp="none", fused_cross_entropy=True)


def test_bf16_autocast_takes_the_same_dtypes_as_the_unfused_head():
    """Under autocast the head's matmul runs in bf16 either way (F.linear's autocast rule); the
    fused loss casts its operands as autocast would, and the fp32 params get fp32 gradients."""

    def build() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(61, d_model=32, n_layers=2, n_heads=4, seq_len=16)

    def bf16() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    curves = []
    for fused in (False, True):
        model = build()
        par = parallelize(model, None, dp="none", autocast=bf16, fused_cross_entropy=fused)
        opt = torch.optim.SGD(par.parameters(), lr=0.1)
        losses = []
        for x, y in _lm_data(61, 8):
            opt.zero_grad()
            losses.append(float(par.forward_backward(x, y)))
            assert model.tok_emb.weight.grad.dtype == torch.float32
            par.step(opt)
        curves.append(losses)
    # the same bf16 logits; the gradients' bf16 roundings differ only in the chunked sums
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=2e-3, atol=0)


def _checkpoint_body(tmp: str) -> None:
    """An untied fused head at tp 2 (its weight is a vocabulary shard no embedding registers):
    the checkpoint holds the dense tensors, loads into the unfused model at tp 2, and equals the
    state the same training gives without the fused loss."""
    import torch.distributed as dist

    from shardkit.comm import ParallelContext
    from shardkit.parallel import load_checkpoint, save_checkpoint
    from shardkit.parallel.tensor import gather_state_dict, gpt_plan

    def build() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT(61, d_model=32, n_layers=2, n_heads=4, seq_len=16, tie_embeddings=False)

    with ParallelContext.from_world(tp=dist.get_world_size()) as ctx:
        plan = gpt_plan(tie_embeddings=False)
        states = []
        for fused in (True, False):
            par = parallelize(build(), ctx, tp_plan=plan, dp="none", fused_cross_entropy=fused)
            opt = torch.optim.SGD(par.parameters(), lr=0.1)
            for x, y in _lm_data(61, 3):
                opt.zero_grad()
                par.forward_backward(x, y)
                par.step(opt)
            if fused:
                save_checkpoint(tmp, par, opt)
            states.append(gather_state_dict(par.module.state_dict(), plan, ctx))
        fresh = parallelize(build(), ctx, tp_plan=plan, dp="none")
        load_checkpoint(tmp, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
        loaded = gather_state_dict(fresh.module.state_dict(), plan, ctx)
        for key, value in states[1].items():
            torch.testing.assert_close(states[0][key], value, **FP32, msg=lambda m, key=key: f"{key}: {m}")
            torch.testing.assert_close(loaded[key], states[0][key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_untied_fused_head_checkpoints_at_tp2(dist_pool, tmp_path):
    dist_pool.run(_checkpoint_body, str(tmp_path / "ckpt"), world_size=2, timeout=120)


class _ScaledLogits(nn.Module):
    """A model that changes its logits after the head (as Granite's logits_scaling does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(61, 16), nn.Linear(16, 61, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)) / 8.0


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    par = parallelize(_ScaledLogits(), None, dp="none", fused_cross_entropy=True)
    x, y = _lm_data(61, 1)[0]
    with pytest.raises(ValueError, match="did not return its LM head's output"):
        par.forward_backward(x, y)
    with pytest.raises(ValueError, match="did not return its LM head's output"):
        par.evaluate(x, y)


def test_checkpointed_blocks_leave_the_fused_head_alone_and_flat_targets_work():
    """With activation checkpointing the block holding the head is not recomputed (its loss
    would be formed twice, and a backward outside loss_path would recompute logits); the loss
    takes flat targets as the unfused token loss does."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(61, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 61))

    x, y = _lm_data(61, 1)[0]
    ref = build()
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    par = parallelize(build(), None, dp="none", fused_cross_entropy="3", checkpointing=True, blocks=list)
    with par.loss_path(y.reshape(-1)):
        loss = par.loss_fn(par.module(x), y.reshape(-1))
    par.backward(loss)  # outside loss_path, as ParallelModel.backward's own example does
    torch.testing.assert_close(loss, ref_loss, **FP32)
    for p, r in zip(par.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, **FP32)


def _zero_bubble_body() -> None:
    import torch.distributed as dist

    from distributed import forbid_collectives
    from shardkit.comm import ParallelContext
    from shardkit.models import gpt_blocks

    with ParallelContext.from_world(pp=dist.get_world_size()) as ctx:
        model = TinyGPT(61, d_model=32, n_layers=2, n_heads=4, seq_len=16)
        patch = forbid_collectives()
        try:
            with pytest.raises(ValueError, match="zb-h1"):
                parallelize(
                    model, ctx, dp="ddp", fused_cross_entropy=True, pp={"microbatches": 2, "schedule": "zb-h1"}, blocks=gpt_blocks
                )
        finally:
            patch.stop()


def test_a_trained_model_with_a_fused_head_pickles_whole():
    """The head keeps only a weak reference to a step's loss: ``torch.save(model)`` works after
    training and the copy computes the same logits."""
    import io

    torch.manual_seed(0)
    model = TinyGPT(61, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    par = parallelize(model, None, dp="none", fused_cross_entropy=True)
    x, y = _lm_data(61, 1)[0]
    par.forward_backward(x, y)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(again(x), model(x), rtol=0, atol=0)


def test_zero_bubble_schedule_is_refused_before_any_collective(dist_pool):
    """ZB-H1 runs a loss's backward twice (input, then weight gradients); the fused loss forms
    its gradients once."""
    dist_pool.run(_zero_bubble_body, world_size=2, timeout=60)


def test_shardkit_train_refuses_fused_ce_with_zero_bubble_before_starting_workers():
    from shardkit.train.config import TrainConfig

    cfg = TrainConfig(pp=2, nproc=2, schedule="zb-h1", fused_ce=True)
    with pytest.raises(ValueError, match="--fused-ce with --schedule zb-h1"):
        cfg.validate()
    TrainConfig(pp=2, nproc=2, schedule="1f1b", fused_ce=True).validate()  # another schedule is fine
