"""The DeepSpeed-config engine's ``fused_cross_entropy`` section: a Hugging Face script's
``engine(input_ids=x, labels=x).loss`` comes from the fused head (no logits formed) and trains
like the plain-torch dense model (HF's own ``labels=`` loss), at tp 1 and 2 and ZeRO-0/3."""

from __future__ import annotations

import logging

import pytest
import torch

from shardkit.comm import ParallelContext
from tolerances import FP32
from engine_cases import GAS, STEPS, dense_gpt2_run, gpt2_batch, tiny_gpt2, tp_config

pytest.importorskip("transformers")


def _body(tp: int, stage: int) -> list[float]:
    import shardkit
    from shardkit.parallel.tensor import FusedCrossEntropyHead

    with ParallelContext.from_world(tp=tp) as ctx:
        config = tp_config(stage, tp) | {"fused_cross_entropy": {"enabled": True, "chunk_tokens": 7}}
        engine, *_ = shardkit.initialize(model=tiny_gpt2(), config=config, ctx=ctx)
        head = engine.module.lm_head
        assert isinstance(head, FusedCrossEntropyHead) and head.chunk_tokens == 7
        assert head.weight is engine.module.transformer.wte.weight  # the tie survives the swap
        losses = []
        for step in range(STEPS):
            for micro in range(GAS):
                x = gpt2_batch(step, micro)
                out = engine(input_ids=x, labels=x)
                assert out.logits is None and out.loss.dim() == 0  # no logits were formed
                engine.backward(out.loss)
                engine.step()
                losses.append(float(out.loss))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense_gpt2_run()[1]), **FP32)
        # without labels= the model gives logits, gathered to the whole vocabulary, with a warning
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("shardkit.engine").addHandler(handler)
        try:
            with torch.no_grad():
                logits = engine(input_ids=gpt2_batch(0, 0)).logits
                engine(input_ids=gpt2_batch(0, 0))
        finally:
            logging.getLogger("shardkit.engine").removeHandler(handler)
        assert logits.shape[-1] == tiny_gpt2().config.vocab_size
        # HF's num_items_in_batch (the sum over that many items) and return_dict=False
        x = gpt2_batch(7, 0)
        with torch.no_grad():
            dense = tiny_gpt2()
            want = dense(input_ids=x, labels=x, num_items_in_batch=torch.tensor(5)).loss
            got = engine(input_ids=x, labels=x, num_items_in_batch=torch.tensor(5)).loss
            plain = engine(input_ids=x, labels=x)
            as_tuple = engine(input_ids=x, labels=x, return_dict=False)
        ratio = float(want / dense(input_ids=x, labels=x).loss)
        torch.testing.assert_close(float(got / plain.loss), ratio, **FP32)  # the trained model: compare the ratio
        assert as_tuple[1] is None and torch.equal(as_tuple[0], plain.loss)
        assert len([r for r in records if "fused_cross_entropy" in r.getMessage()]) == 1  # once
        return losses


@pytest.mark.parametrize("tp, stage", [(1, 0), (2, 0), (2, 3)], ids=["tp1", "tp2", "tp2-zero3"])
def test_hf_labels_loss_comes_from_the_fused_head(dist_pool, tp, stage):
    out = dist_pool.run(_body, tp, stage, world_size=tp, timeout=120)
    assert len({tuple(o) for o in out}) == 1


def test_fused_cross_entropy_section_errors():
    from shardkit.engine import load_config

    base = tp_config(0, 1)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        load_config(base | {"fused_cross_entropy": {"enabled": True, "chunk_tokens": 0}}, world_size=1)
    with pytest.raises(ValueError, match="pipeline.stages > 1"):
        load_config(base | {"fused_cross_entropy": {"enabled": True}, "pipeline": {"stages": 2}}, world_size=2)
    with pytest.raises(ValueError, match="fused_cross_entropy.enable"):
        load_config(base | {"fused_cross_entropy": {"enable": True}}, world_size=1)
