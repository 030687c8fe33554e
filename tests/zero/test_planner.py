"""The ZeRO memory planner against the ZeRO paper's Table 1, written-out formulas and real models.

Independent references: the numbers printed in Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models" (arXiv:1910.02054), Table 1 (§5), typed in below; the
per-stage formulas of docs/reference.md, "ZeRO memory and communication", written out by hand;
torch's own parameter and optimizer-state tensors for a real single-process run.
"""

from __future__ import annotations

import re
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.cli import main as cli_main
from shardkit.data import ALPHABET
from shardkit.models import Block, TinyGPT
from shardkit.parallel.strategy import make_strategy
from shardkit.parallel.zero.planner import format_gb
from shardkit.parallel.zero.planner import plan_table
from shardkit.parallel.zero.planner import count_parameters, optimizer_state_bytes, plan_memory, unit_sizes

# ---- the paper's Table 1 ------------------------------------------------------------------------
# "Per-device memory consumption of different optimizations in ZeRO-DP as a function of DP degree"
# (GB), mixed-precision Adam, K = 12. Columns P_os / P_os+g / P_os+g+p = stages 1 / 2 / 3.
# Rounding as printed: the 7.5B column rounds half up (41.25 -> 41.3, 1.875 -> 1.88, 0.46875 ->
# 0.47); the 128B and 1T columns truncate (513.5 -> 513, 257.75 -> 257, 4187.5 -> 4187).
TABLE_1 = {
    "7.5B": (
        7_500_000_000,
        ROUND_HALF_UP,
        {
            1: ("120", "120", "120"),
            4: ("52.5", "41.3", "30"),
            16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"),
            256: ("30.4", "15.4", "0.47"),
            1024: ("30.1", "15.1", "0.12"),
        },
    ),
    "128B": (
        128_000_000_000,
        ROUND_DOWN,
        {
            1: ("2048", "2048", "2048"),
            4: ("896", "704", "512"),
            16: ("608", "368", "128"),
            64: ("536", "284", "32"),
            256: ("518", "263", "8"),
            1024: ("513", "257", "2"),
        },
    ),
    "1T": (
        10**12,
        ROUND_DOWN,
        {
            1: ("16000", "16000", "16000"),
            4: ("7000", "5500", "4000"),
            16: ("4750", "2875", "1000"),
            64: ("4187", "2218", "250"),
            256: ("4046", "2054", "62.5"),
            1024: ("4011", "2013", "15.6"),
        },
    ),
}
CELLS = [
    (model, n, stage, printed)
    for model, (_, _, rows) in TABLE_1.items()
    for n, cells in rows.items()
    for stage, printed in zip((1, 2, 3), cells)
]


@pytest.mark.parametrize("model,n,stage,printed", CELLS, ids=[f"{m}-N{n}-s{s}" for m, n, s, _ in CELLS])
def test_reproduces_zero_paper_table_1(model: str, n: int, stage: int, printed: str) -> None:
    psi, rounding, _ = TABLE_1[model]
    plan = plan_memory(psi, dp=n, stage=stage, precision="fp16", optimizer="adam")
    exact = Decimal(plan.model_state_bytes) / 10**9
    digits = Decimal(1).scaleb(Decimal(printed).as_tuple().exponent)
    assert exact.quantize(digits, rounding=rounding) == Decimal(printed)
    assert abs(exact - Decimal(printed)) < digits  # within one unit of the last printed digit


def test_table_1_headline_figures_exactly() -> None:
    """Ψ = 7.5e9 divides by 64: no shard padding, so the formulas hold to the byte."""
    psi = 7_500_000_000
    t = plan_table(psi, dp=64, precision="fp16", optimizer="adamw")
    assert [p.model_state_bytes for p in t.plans] == [120 * 10**9, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert [format_gb(p.model_state_bytes) for p in t.plans] == ["120", "31.4", "16.6", "1.88"]
    assert t[0].params == t[1].params == t[2].params == 2 * psi
    assert (t[2].grads, t[3].params, t[1].optimizer_state) == (2 * psi // 64, 2 * psi // 64, 12 * psi // 64)


# ---- written-out formulas -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 8, 64])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_adam_formulas_per_stage(n: int, precision: str) -> None:
    psi = 1024 * 1000  # divisible by every n: no padding
    if precision == "fp32":  # docs/reference.md: no master copy, 4-byte grads, 8 bytes of moments
        expected = [16 * psi, 8 * psi + 8 * psi // n, 4 * psi + 12 * psi // n, 16 * psi // n]
    else:  # the paper's mixed precision: 2 + 2 + K, K = 12
        expected = [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 16 * psi // n]
    got = [plan_memory(psi, dp=n, stage=s, precision=precision).model_state_bytes for s in range(4)]
    assert got == expected


@pytest.mark.parametrize(
    "optimizer,precision,k",
    [
        ("adamw", "fp16", 12),
        ("adam", "fp32", 8),
        ("lamb", "bf16", 12),
        ("lion", "bf16", 8),
        ("lion", "fp32", 4),
        ("sgd_momentum", "fp32", 4),
        ("sgd_momentum", "fp16", 8),
        ("sgd", "fp32", 0),
        ("sgd", "bf16", 4),
        (20, "fp16", 20),
    ],
)
def test_optimizer_bytes_per_param(optimizer: str | int, precision: str, k: int) -> None:
    assert optimizer_state_bytes(optimizer, precision) == k
    assert plan_memory(1000, dp=1, stage=0, precision=precision, optimizer=optimizer).optimizer_state == k * 1000


def test_shards_are_padded_up() -> None:
    """Ψ = 10 over 4 ranks: flat buffers padded to 12, 3 elements per rank."""
    p = plan_memory(10, dp=4, stage=3, precision="fp32")
    assert (p.params, p.grads, p.optimizer_state) == (4 * 3, 4 * 3, 8 * 3)


def test_communication_in_the_papers_unit_and_commstats_payload() -> None:
    psi, n = 1_000_000, 8
    t = plan_table(psi, dp=n, precision="bf16")
    assert [p.comm_elements for p in t.plans] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]  # §7: 2Ψ, 2Ψ, 2Ψ, 3Ψ
    assert t[0].comm_payload_bytes == {"all_reduce": 2 * psi}  # CommStats counts an all-reduce once
    assert t[2].comm_payload_bytes == {"reduce_scatter": 2 * psi, "all_gather": 2 * psi}
    assert t[3].comm_payload_bytes == {"all_gather": 4 * psi, "reduce_scatter": 2 * psi}
    assert t[0].comm_bytes == 4 * psi and t[0].comm_wire_bytes == 4 * psi * (n - 1) // n
    fp32_grads = plan_memory(psi, dp=n, stage=2, precision="bf16", grad_dtype_bytes=4)
    assert fp32_grads.comm_payload_bytes == {"reduce_scatter": 4 * psi, "all_gather": 2 * psi}
    assert fp32_grads.grads == 4 * psi // n
    no_reshard = plan_memory(psi, dp=n, stage=3, precision="bf16", reshard_after_forward=False)
    assert no_reshard.comm_elements == 2 * psi
    assert all(not p.comm for p in plan_table(psi, dp=1).plans)  # dp = 1: the local path


def test_transient_buffers() -> None:
    psi, n, mib = 100 * 2**20, 4, 2**20
    assert plan_memory(psi, dp=n, stage=0).transient == 4 * psi  # DDP's flat buckets: one more copy
    assert plan_memory(psi, dp=n, stage=0, gradient_as_bucket_view=True).transient == 0
    # stages 1-2: max(buckets in flight, fp32 copies of the shards for G != 4, all-gather inputs)
    # stage 2 backward: two 25 MiB buckets packed in full (G = 4); the 1 MiB first one pairs smaller
    assert plan_memory(psi, dp=n, stage=2, bucket_mb=25).transient == 50 * mib
    assert plan_memory(psi, dp=16, stage=2, bucket_mb=25).transient == 50 * mib
    assert plan_memory(26 * 2**18, dp=16, stage=2, bucket_mb=25).transient == 26 * mib  # 1 + 25 MiB
    # stage 1 holds only the reduce-scatter outputs (G·T/N, two in flight); the all-gather after
    # the step holds two consecutive buckets' P·T/N inputs: the same bytes here (P = G = 4)
    assert plan_memory(psi, dp=16, stage=1, bucket_mb=25).transient == 4 * 2 * (25 * mib // 4) // 16
    assert plan_memory(psi, dp=16, stage=2, precision="bf16", bucket_mb=1).transient == 4 * psi // 16  # fp32 copies
    assert plan_memory(1000, dp=n, stage=2, bucket_mb=25).transient == 4 * 1000  # capped by the grads
    u = 10 * 2**20  # current + prefetched unit (bf16) + the current unit's bf16 grads
    assert plan_memory(psi, dp=n, stage=3, precision="bf16", largest_unit_params=u).transient == 2 * 2 * u + 2 * u
    assert plan_memory(psi, dp=n, stage=3, largest_unit_params=u, prefetch=0).transient == 4 * u + 4 * u
    assert plan_memory(psi, dp=n, stage=3, largest_unit_params=u, reshard_after_forward=False).transient == 4 * psi + 4 * u
    assert all(plan_memory(psi, dp=1, stage=s).transient == 0 for s in range(4))


def test_offload() -> None:
    psi, n = 8000, 4
    shard = psi // n
    cpu = plan_memory(psi, dp=n, stage=2, precision="bf16", offload="cpu")
    # host: K=12 (master + m + v), the fp32 gradient copy (4) and the bf16 staging buffer the
    # reduced bf16 shard lands in during backward (2): docs/offload.md, "Data path"
    assert (cpu.optimizer_state, cpu.cpu, cpu.nvme) == (0, 12 * shard + 4 * shard + 2 * shard, 0)
    assert (cpu.params, cpu.grads) == (2 * psi, 2 * shard)
    nvme = plan_memory(psi, dp=n, stage=3, precision="bf16", offload="nvme", nvme_subgroup_params=100)
    assert (nvme.optimizer_state, nvme.nvme, nvme.cpu) == (0, 12 * shard, 4 * shard + 2 * shard + 2 * 12 * 100)
    par = plan_memory(psi, dp=n, stage=3, precision="bf16", offload="cpu", offload_params=True)
    assert (par.params, par.cpu) == (0, 2 * shard + 12 * shard + 4 * shard + 2 * shard)
    t = plan_table(psi, dp=n, offload="cpu")
    assert t[0].offload is None and t[0].optimizer_state == 8 * psi and t[1].optimizer_state == 0
    assert "DDP cannot offload" in t.render()


def test_memory_report_keys_split_the_master_copy() -> None:
    psi, n = 8000, 4
    r = plan_memory(psi, dp=n, stage=2, precision="bf16").memory_report()
    assert r == {
        "unit": "bytes",
        "params": 2 * psi,
        "grads": 2 * psi // n,
        "master_params": 4 * psi // n,
        "optimizer_state": 8 * psi // n,
        "model_state": 2 * psi + 14 * psi // n,
        "peak_transient": max(2 * psi, 4 * psi // n),
    }
    assert plan_memory(psi, dp=n, stage=2, precision="fp32").memory_report()["master_params"] == 0


def test_fits() -> None:
    p = plan_memory(7_500_000_000, dp=64, stage=2, precision="fp16", device_bytes=32 * 10**9)
    assert p.fits is True and p.device_total == p.model_state_bytes + p.transient
    assert plan_memory(7_500_000_000, dp=64, stage=0, precision="fp16", device_bytes=32 * 10**9).fits is False
    assert plan_memory(10, dp=1, stage=0).fits is None
    q = plan_memory(1000, dp=1, stage=0, device_bytes=16 * 1000)
    assert q.fits is True and plan_memory(1000, dp=1, stage=0, device_bytes=16 * 1000 - 1).fits is False


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"dp": 0, "stage": 1}, "dp"),
        ({"dp": 2, "stage": 4}, "stage"),
        ({"dp": 2, "stage": 0, "offload": "cpu"}, "offload"),
        ({"dp": 2, "stage": 2, "offload": "disk"}, "offload"),
        ({"dp": 2, "stage": 2, "offload": "cpu", "offload_params": True}, "offload_params"),
        ({"dp": 2, "stage": 1, "precision": "fp8"}, "precision"),
        ({"dp": 2, "stage": 1, "optimizer": "rmsprop"}, "optimizer"),
        ({"dp": 2, "stage": 1, "bucket_mb": 0}, "bucket_mb"),
        ({"dp": 2, "stage": 3, "largest_unit_params": 11}, "largest_unit_params"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        plan_memory(10, **kwargs)


def test_bad_types() -> None:
    with pytest.raises(TypeError, match="num_params"):
        plan_memory(7.5e9, dp=2, stage=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        plan_memory(10, dp=2, stage=1, optimizer=True)  # type: ignore[arg-type]


# ---- properties ---------------------------------------------------------------------------------
settings_kw = {"max_examples": 60, "deadline": None}
precisions = st.sampled_from(["fp32", "bf16", "fp16"])
optimizers = st.sampled_from(["adamw", "sgd", "sgd_momentum", "lion", "lamb"])


@settings(**settings_kw)
@given(psi=st.integers(0, 10**13), dp=st.integers(1, 4096), precision=precisions, optimizer=optimizers)
def test_model_states_non_increasing_in_stage(psi: int, dp: int, precision: str, optimizer: str) -> None:
    t = plan_table(psi, dp=dp, precision=precision, optimizer=optimizer)
    states = [p.model_state_bytes for p in t.plans]
    assert states == sorted(states, reverse=True)
    for a, b in zip(t.plans, t.plans[1:]):  # and category by category
        assert b.params <= a.params and b.grads <= a.grads and b.optimizer_state <= a.optimizer_state


@settings(**settings_kw)
@given(
    psi=st.integers(0, 10**13), dp=st.integers(1, 4096), extra=st.integers(1, 4096), stage=st.integers(0, 3), precision=precisions
)
def test_model_states_non_increasing_in_dp_and_stage_0_independent_of_it(
    psi: int, dp: int, extra: int, stage: int, precision: str
) -> None:
    small = plan_memory(psi, dp=dp, stage=stage, precision=precision)
    big = plan_memory(psi, dp=dp + extra, stage=stage, precision=precision)
    assert big.model_state_bytes <= small.model_state_bytes
    if stage == 0:
        assert big.memory() | {"transient": 0} == small.memory() | {"transient": 0}


@settings(**settings_kw)
@given(psi=st.integers(0, 10**12), dp=st.integers(1, 1024), precision=precisions)
def test_shards_over_all_ranks_cover_the_model_with_less_than_one_element_of_padding_each(
    psi: int, dp: int, precision: str
) -> None:
    p = plan_memory(psi, dp=dp, stage=3, precision=precision)
    per_elem = p.bytes_per_param + p.bytes_per_grad + p.optimizer_bytes_per_param
    assert psi * per_elem <= dp * p.model_state_bytes < (psi + dp) * per_elem


# ---- models: counted, not allocated -------------------------------------------------------------
def _gpt(d: int, layers: int, heads: int, t: int, tie: bool = True) -> TinyGPT:
    return TinyGPT(len(ALPHABET), d, layers, heads, t, tie_embeddings=tie)


@settings(max_examples=12, deadline=None)
@given(heads=st.integers(1, 4), head_dim=st.integers(1, 8), layers=st.integers(1, 3), t=st.integers(1, 16), tie=st.booleans())
def test_meta_model_counts_equal_real_model_counts(heads: int, head_dim: int, layers: int, t: int, tie: bool) -> None:
    real = _gpt(heads * head_dim, layers, heads, t, tie)
    with torch.device("meta"):
        meta = _gpt(heads * head_dim, layers, heads, t, tie)
    assert all(p.is_meta for p in meta.parameters())  # nothing was allocated
    by_hand = sum(p.numel() for p in {id(p): p for p in real.parameters()}.values())
    assert count_parameters(meta) == count_parameters(real) == (by_hand, by_hand)
    for stage in range(4):
        assert plan_memory(meta, dp=4, stage=stage) == plan_memory(real, dp=4, stage=stage)
        assert plan_memory(meta, dp=4, stage=stage, exact=False) == plan_memory(by_hand, dp=4, stage=stage)


class _Tied(nn.Module):
    def __init__(self, v: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, v, bias=False)
        self.out.weight = self.emb.weight  # one Parameter reachable from two modules


@settings(max_examples=20, deadline=None)
@given(v=st.integers(1, 50), d=st.integers(1, 16), dp=st.integers(1, 8), stage=st.integers(0, 3))
def test_tied_weights_count_once(v: int, d: int, dp: int, stage: int) -> None:
    with torch.device("meta"):
        model = _Tied(v, d)
    psi = v * d + d * d + d  # embedding once, mid weight + bias
    assert count_parameters(model) == (psi, psi)
    formula = plan_memory(psi, dp=dp, stage=stage, precision="bf16")
    assert plan_memory(model, dp=dp, stage=stage, precision="bf16", exact=False) == formula
    # the exact layout (stages 1-2) adds only alignment padding: < 16 elements per tensor + 16·N
    exact = plan_memory(model, dp=dp, stage=stage, precision="bf16")
    assert formula.params <= exact.params < formula.params + 2 * 16 * (3 + dp)


def test_frozen_parameters_have_no_grads_or_optimizer_state() -> None:
    with torch.device("meta"):
        model = _Tied(10, 4)
    model.mid.requires_grad_(False)  # 4*4 + 4 = 20 frozen
    assert count_parameters(model) == (60, 40)
    p = plan_memory(model, dp=2, stage=1, precision="bf16", exact=False)
    assert (p.params, p.grads, p.optimizer_state) == (2 * 60, 2 * 40, 12 * 20)
    # exact layout: the 40 trainable elements padded to 16·N = 32 -> one bucket of 64, shards of
    # 32; frozen params stay outside it; rank 0 holds 32 real elements (the worst rank)
    p = plan_memory(model, dp=2, stage=1, precision="bf16")
    assert (p.params, p.grads, p.optimizer_state, p.master) == (2 * (64 + 20), 2 * 64, 4 * 32 + 8 * 32, 4 * 32)
    p3 = plan_memory(model, dp=2, stage=3, precision="bf16")
    assert (p3.params, p3.grads, p3.optimizer_state) == (2 * 30, 2 * 20, 12 * 20)
    assert p3.comm_payload_bytes == {"all_gather": 2 * 2 * 60, "reduce_scatter": 2 * 40}


def test_unit_sizes_of_tinygpt_blocks() -> None:
    d, layers = 16, 3
    with torch.device("meta"):
        model = _gpt(d, layers, 2, 8)
    sizes = unit_sizes(model, {Block})
    per_block = sum(p.numel() for p in Block(model.config).parameters())
    root = len(ALPHABET) * d + 8 * d + 2 * d  # tied embedding/head, positions, final LayerNorm
    assert sizes == [per_block] * layers + [root]
    assert sum(sizes) == count_parameters(model)[0]
    assert unit_sizes(model, lambda m: isinstance(m, Block)) == sizes


def test_plan_matches_a_real_single_process_run() -> None:
    """Stage 0, dp 1, fp32 AdamW: torch's own tensors after one step, via the strategy report."""
    torch.manual_seed(0)
    model = _gpt(32, 2, 4, 16)
    strategy = make_strategy("none")
    model = strategy.wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(len(ALPHABET), (2, 16))
    strategy.backward(model(x).float().logsumexp(-1).mean())
    strategy.step(opt)
    measured = strategy.report(opt).memory
    plan = plan_memory(model, dp=1, stage=0, precision="fp32", optimizer="adamw")
    assert measured["params"] == plan.params and measured["grads"] == plan.grads
    # torch adds a 4-byte fp32 `step` tensor per parameter tensor, which the plan leaves out
    n_tensors = len(list(model.parameters()))
    assert measured["optimizer_state"] == plan.optimizer_state + 4 * n_tensors
    assert abs(measured["optimizer_state"] - plan.optimizer_state) / plan.optimizer_state < 0.01


# ---- `shardkit plan` ----------------------------------------------------------------------------
def _rows(out: str) -> dict[str, list[str]]:
    return {m.group(1): line.split()[2:] for line in out.splitlines() if (m := re.match(r"^(\d) (DDP|ZeRO-\d)", line))}


def test_cli_plan_prints_table_1_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--params", "7.5e9", "--dp", "64", "--precision", "fp16", "--device-gb", "32"]) == 0
    rows = _rows(capsys.readouterr().out)
    psi, n = 7.5e9, 64
    # columns: params grads optim states transient total cpu nvme comm fits
    states = {"0": 16 * psi, "1": 4 * psi + 12 * psi / n, "2": 2 * psi + 14 * psi / n, "3": 16 * psi / n}
    assert {s: r[3] for s, r in rows.items()} == {"0": "120", "1": "31.4", "2": "16.6", "3": "1.88"}
    assert {s: float(r[3]) for s, r in rows.items()} == pytest.approx({s: v / 1e9 for s, v in states.items()}, rel=5e-3)
    assert [r[8] for r in rows.values()] == ["2.0Ψ", "2.0Ψ", "2.0Ψ", "3.0Ψ"]
    # default ZeRO-3 unit = the whole model (nothing to prefetch): gathered 2Ψ + its grads 2Ψ
    assert rows["3"][4] == f"{4 * psi / 1e9:.1f}" and rows["3"][5] == f"{(16 * psi / n + 4 * psi) / 1e9:.1f}"
    assert [r[9] for r in rows.values()] == ["NO", "yes", "yes", "yes"]


def test_cli_plan_stage_breakdown_offload_and_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--params", "1B", "--dp", "8", "--stage", "2", "--offload", "cpu", "--optimizer", "sgd"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["2"][:3] == ["4.00", "0.500", "0"]  # fp32: params 4Ψ, grads 4Ψ/8, optimizer on the host
    assert rows["2"][6] == "1.00"  # host: fp32 grad shard + the fp32 master the host step updates (4Ψ/8 each)
    assert "ZeRO-2 (stage 2)" in out and "cpu (offload)" in out


def test_cli_plan_tinygpt_counts_the_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--model", "tinygpt", "--dp", "2", "--d-model", "64", "--n-layers", "2"]) == 0
    out = capsys.readouterr().out
    psi = _gpt(64, 2, 4, 128).num_parameters()  # the demo's defaults: 4 heads, seq_len 128
    assert f"Ψ = {psi:,} params" in out
    assert _rows(out)["0"][3] == format_gb(16 * psi, 10**6)  # MB for a small model


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--params", "7.5x"], "not a parameter count"),
        (["--params", "10", "--dp", "0"], "dp must be"),
        (["--params", "10", "--stage", "1", "--offload-params", "--offload", "cpu"], "offload-params"),
        ([], "required"),
    ],
)
def test_cli_plan_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_plan_says_when_zero3_assumes_the_whole_model_gathered(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a unit size ZeRO-3's transient is the whole model's gather (it then looks no better
    than ZeRO-1): the output says so and how to give the real unit; with one, no note."""
    assert cli_main(["plan", "--params", "7.5e9", "--dp", "64", "--precision", "fp16"]) == 0
    assert "note: ZeRO-3's transient assumes the whole model is gathered" in capsys.readouterr().out
    assert cli_main(["plan", "--params", "7.5e9", "--dp", "64", "--precision", "fp16", "--unit-params", "2e8"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and float(_rows(out)["3"][4]) < 4 * 7.5e9 / 1e9 / 10  # per-unit, not the model
    assert cli_main(["plan", "--model", "tinygpt", "--dp", "2", "--d-model", "64", "--n-layers", "2"]) == 0
    assert "note:" not in capsys.readouterr().out  # the demo model's blocks are counted
