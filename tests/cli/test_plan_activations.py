"""``shardkit plan --model tinygpt --seq-len S --cp N``: activations per rank next to the model states.

The expected bytes are written out by hand from docs/planner.md, "Activations", for the demo
TinyGPT (d_model 128, 4 layers, 4 heads, 59 tokens, fp32; 16 sequences of 512 tokens): the peak
falls in the last block's MLP backward at cp 1 and, with ring attention, at cp 2 too: the ring's
backward (its dq added into in place, its output gradient not copied) holds ad - 4H + 8 bytes per
token less than the MLP's, so cp 2 is exactly half of cp 1 ([Note: activation moments]).
"""

from __future__ import annotations

import re

import pytest
import torch

from shardkit.cli import main as cli_main
from shardkit.parallel.zero.planner import format_gb

_MB = 10**6


def _demo_peak(cp: int) -> int:
    """The larger of the mlp-backward and (ring, cp 2) attention-backward moments, by hand."""
    a, d, f, heads, layers, batch, seq = 4, 128, 512, 4, 4, 16, 512
    t = batch * seq // cp
    # LayerNorm inputs 2ad + stats 16 + linear inputs 2ad + q/k/v 3ad + output ad (fp32 under ring:
    # 4d) + lse 4H + GELU and fc2 inputs 2af; the projection's input is a view of the output (flash
    # attention's [B, S, H, D] layout at cp 1, and ring attention stores its output the same way)
    block = 2 * a * d + 16 + 2 * a * d + 3 * a * d + a * d + 4 * heads + 2 * a * f
    saved = 16 * t + 8 * (seq // cp) + layers * block * t
    mlp = saved + (a * d + a * f) * t  # the residual stream's gradient and the f-wide gradients
    if cp == 1:
        return mlp
    # the last block's MLP side freed (LayerNorm 2 input and stats, fc, GELU and fc2 inputs); its ring
    # backward holds dO ad (strided, not copied), delta 4H, fp32 dq ad, the key/value block and its
    # spare 4ad, the fp32 dk/dv accumulator and its spare 4ad, the step's dk/dv 2ad, the Triton
    # kernel's own dq ad, the residual ad
    attention = saved - (2 * a * d + 8 + 2 * a * f) * t + (14 * a * d + 4 * heads) * t
    return max(mlp, attention)


def _demo_mlp_peak(cp: int) -> int:
    a, d, f, heads, layers, batch, seq = 4, 128, 512, 4, 4, 16, 512
    t = batch * seq // cp
    block = 2 * a * d + 16 + 2 * a * d + 3 * a * d + a * d + 4 * heads + 2 * a * f
    return 16 * t + 8 * (seq // cp) + layers * block * t + (a * d + a * f) * t


def _activation_rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("cp  tokens/rank"))
    rows = {}
    for line in lines[start + 1 :]:
        if not re.match(r"^\d+ ", line):
            break
        rows[line.split()[0]] = line.split()[1:]
    return rows


def test_plan_prints_activations_at_cp1_and_cp2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--model", "tinygpt", "--seq-len", "512", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "activations per rank in MB (1e6)" in out and "batch 16 x 512 tokens" in out and "cp-mode ring" in out
    rows = _activation_rows(out)
    # columns: tokens/rank saved working peak ratio "peak at"
    assert rows["1"][0] == "8192" and rows["2"][0] == "4096"
    one, two = _demo_peak(1), _demo_peak(2)
    assert (one, two) == (290_590_720, 145_295_360)
    assert rows["1"][3] == format_gb(one, _MB) == "291" and rows["2"][3] == format_gb(two, _MB) == "145"
    assert rows["1"][4] == "1.00x" and rows["2"][4] == f"{two / one:.2f}x" == "0.50x"
    # ring's working buffers now stay under the MLP backward's: both peaks are there
    assert rows["1"][5:] == ["mlp", "backward"] and rows["2"][5:] == ["mlp", "backward"]
    assert _demo_peak(2) == _demo_mlp_peak(2)
    # model states over dp x cp = 2 ranks, then states + activations per stage
    assert "dp x cp = 1 x 2 = 2 ranks" in out and re.search(r"^Ψ = [\d,]+ params \([\d,]+ trainable\), dp = 2,", out, re.M)
    ddp_total = re.search(r"^0 DDP +(?:\S+ +){5}(\S+)", out, re.M).group(1)
    both = re.search(r"DDP (\S+) \+ (\S+) = (\S+) \|", out)
    assert both.group(1) == ddp_total and both.group(2) == "145"
    assert float(both.group(3)) == pytest.approx(float(ddp_total) + 145, abs=1)


def test_plan_activation_flags_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """--batch-size, --cp-mode, --device and --precision change the activations as documented."""
    argv = ["plan", "--model", "tinygpt", "--seq-len", "256", "--cp", "4", "--batch-size", "2"]
    assert cli_main([*argv, "--cp-mode", "ulysses", "--device", "cpu", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    rows = _activation_rows(out)
    assert rows["1"][0] == "512" and rows["4"][0] == "128"
    assert "2-byte activations" in out and "cp-mode ulysses" in out and "cpu attention kernels" in out
    assert cli_main([*argv, "--device", "cpu"]) == 0
    ring_cpu = _activation_rows(capsys.readouterr().out)["4"]
    assert cli_main(argv) == 0
    ring_cuda = _activation_rows(capsys.readouterr().out)["4"]
    assert float(ring_cpu[3]) > float(ring_cuda[3])  # the CPU path's slice copies
    assert ring_cpu[5:] == ["attention", "backward"]
    assert cli_main([*argv, "--cp-mode", "hybrid", "--cp-ulysses", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cp-mode hybrid 2x2" in out and float(_activation_rows(out)["4"][3]) > float(ring_cpu[3])  # + the all-to-all


def test_plan_without_cp_prints_the_cp1_row_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--model", "tinygpt", "--dp", "2", "--d-model", "64", "--n-layers", "2"]) == 0
    out = capsys.readouterr().out
    assert list(_activation_rows(out)) == ["1"] and "dp x cp" not in out


def test_plan_activations_check_the_device_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--model", "tinygpt", "--seq-len", "512", "--cp", "2", "--device-gb", "0.155"]) == 0
    out = capsys.readouterr().out
    assert "DDP 17.3 + 145 = 163 does NOT fit" in out and "ZeRO-3 10.4 + 145 = 156 does NOT fit" in out
    assert cli_main(["plan", "--model", "tinygpt", "--seq-len", "512", "--cp", "2", "--device-gb", "0.16"]) == 0
    assert "ZeRO-3 10.4 + 145 = 156 fits" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "tinygpt", "--cp", "0"], "--cp must be >= 1, got 0"),
        (["--model", "tinygpt", "--cp", "2", "--seq-len", "510"], "--seq-len 510 must be a multiple of 2 x cp = 4"),
        (["--model", "tinygpt", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["--model", "tinygpt", "--cp", "3", "--seq-len", "516", "--cp-mode", "ulysses"], "--cp-mode ulysses splits the 4 heads"),
        (["--params", "1B", "--cp", "2"], "--cp needs --model tinygpt"),
        (["--params", "1B", "--batch-size", "8"], "--batch-size needs --model tinygpt"),
        (["--params", "1B", "--cp-mode", "ring"], "--cp-mode needs --model tinygpt"),
        (["--model", "tinygpt", "--cp-mode", "tree"], "invalid choice: 'tree'"),
        (["--model", "tinygpt", "--cp", "4", "--cp-mode", "hybrid"], "--cp-mode hybrid needs --cp-ulysses U"),
        (["--model", "tinygpt", "--cp-mode", "hybrid", "--cp-ulysses", "2"], "--cp-mode hybrid needs --cp N > 1"),
        (["--model", "tinygpt", "--cp", "4", "--cp-ulysses", "2"], "--cp-ulysses 2 applies to --cp-mode hybrid only"),
        (["--params", "1B", "--cp-ulysses", "2"], "--cp-ulysses needs --model tinygpt"),
    ],
)
def test_plan_activation_usage_errors_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_plan_hpz_adds_the_pieces_to_stage_3_only(capsys: pytest.CaptureFixture[str]) -> None:
    """``--hpz B``: the stage-3 row's transient grows by the 1/B pieces plan_memory counts
    (zero/planner.py, written out in tests/zero/test_zero_plan_agreement.py against a
    measurement); stages 0-2 are unchanged; a non-divisor is refused."""
    from shardkit.models import TinyGPT
    from shardkit.parallel.zero import plan_memory
    from shardkit.data import ALPHABET

    def rows(argv: list[str]) -> dict[str, list[str]]:
        dims = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "64"]
        assert cli_main(["plan", "--model", "tinygpt", "--dp", "8", *dims, *argv]) == 0
        out = capsys.readouterr().out
        return {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"^[0-3] (DDP|ZeRO)", line)}

    flat, hpz = rows([]), rows(["--hpz", "4"])
    assert [flat[s] for s in "012"] == [hpz[s] for s in "012"]
    with torch.device("meta"):
        model = TinyGPT(len(ALPHABET), 64, 2, 4, 64)
    want = plan_memory(model, dp=8, stage=3, reshard_after_forward=4).transient
    assert want > plan_memory(model, dp=8, stage=3).transient
    assert hpz["3"][6] == format_gb(want, _MB) != flat["3"][6]  # the transient column
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", "tinygpt", "--dp", "8", "--hpz", "3"])
