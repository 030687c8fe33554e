"""Cells of notebooks/06_from_deepspeed.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "06_from_deepspeed.ipynb"


CELLS = [
    new_markdown_cell("""# 06 — Coming from DeepSpeed: `shardkit.initialize`

A DeepSpeed user has a JSON config and a training loop written against `deepspeed.initialize`'s
engine: `engine(batch)`, `engine.backward(loss)`, `engine.step()`. `shardkit.initialize` has the
same signature and returns the same 4-tuple, and reads the same config (ZeRO stage, offload,
fp16 loss scaling, optimizer, LR scheduler, batch sizes, clipping): the loop changes only its
import. Details: `docs/engine.md`.

This notebook runs on CPU: 2 local processes with gloo, a `transformers` GPT-2 built from a
config (no download), and seed 002's ZeRO-2 config."""),
    new_markdown_cell("""## One script, two engines
DeepSpeed reads no `"auto"` (Hugging Face's Trainer fills them before calling it), so the
config's `"auto"` values are written in as numbers here. fp16 is switched off: this CPU run
compares the two engines exactly, in fp32. The shardkit script is the DeepSpeed script with one
line changed."""),
    new_code_cell("""from pathlib import Path
import difflib, importlib.util, json, os, subprocess, sys, tempfile
from shardkit.examples import config_path

work = Path(tempfile.mkdtemp())
config = json.loads(config_path("zero2_config_accelerate.json").read_text())
config["fp16"]["enabled"] = False
config["optimizer"]["params"].update(lr=3e-3, weight_decay=0.01)
config["scheduler"]["params"].update(warmup_min_lr=0, warmup_max_lr=3e-3, warmup_num_steps=3, total_num_steps=8)
config.update(gradient_clipping=1.0, train_micro_batch_size_per_gpu=4, train_batch_size=8)
(work / "ds_config.json").write_text(json.dumps(config, indent=1))

ds_script = Path("scripts/train_deepspeed.py").read_text()
sk_script = ds_script.replace("from deepspeed import initialize", "from shardkit import initialize")
(work / "train_deepspeed.py").write_text(ds_script)
(work / "train_shardkit.py").write_text(sk_script)
print("".join(difflib.unified_diff(ds_script.splitlines(True), sk_script.splitlines(True),
                                   "train_deepspeed.py", "train_shardkit.py", n=0)))"""),
    new_code_cell("""def torchrun(script, out):
    # DS_ACCELERATOR=cpu: DeepSpeed's CPU accelerator (shardkit ignores it)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(work / script), str(work / "ds_config.json"), str(work / out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((work / out).read_text())

ours = torchrun("train_shardkit.py", "shardkit.json")
theirs = torchrun("train_deepspeed.py", "deepspeed.json") if importlib.util.find_spec("deepspeed") else None
print("step | shardkit loss | deepspeed loss | lr")
for i, (loss, lr) in enumerate(zip(ours["loss"], ours["lr"])):
    print(f"{i:4d} | {loss:13.6f} | {theirs['loss'][i] if theirs else float('nan'):14.6f} | {lr:.2e}")
if theirs:
    assert max(abs(a - b) for a, b in zip(ours["loss"], theirs["loss"])) < 1e-5
    assert max(abs(a - b) for a, b in zip(ours["lr"], theirs["lr"])) < 1e-12

import matplotlib.pyplot as plt
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
ax1.plot(ours["loss"], "o-", label="shardkit")
if theirs:
    ax1.plot(theirs["loss"], "x--", label="DeepSpeed", ms=9)
ax1.set(xlabel="step", ylabel="loss", title="the same script, two engines")
ax1.legend()
ax2.plot(ours["lr"], "o-")
ax2.set(xlabel="step", ylabel="lr", title="WarmupDecayLR")
fig.tight_layout()
plt.show()"""),
    new_markdown_cell("""The losses agree (bitwise on this machine): the same ZeRO-2 gradient averaging, the same
AdamW update, the same global-norm clipping and DeepSpeed's WarmupDecayLR (log warmup to
3e-3 over 3 steps, then linear decay; the scheduler's value at construction, 0, is the first
step's lr, as in DeepSpeed)."""),
    new_markdown_cell("""## `shardkit config check`
What a config resolves to before anything runs — stage, offload, precision, batch sizes,
optimizer, scheduler, the keys accepted but ignored — and the planner's memory per rank. Both
seed-002 configs, as shipped (fp16), their `"auto"` values given on the command line."""),
    new_code_cell("""# `shardkit config check NAME ...` on the command line; here the same entry point, in this process
from shardkit.cli import main as shardkit

auto = [a for kv in ("lr=3e-4", "weight_decay=0.01", "warmup_num_steps=100", "total_num_steps=1000",
                     "gradient_clipping=1.0", "train_micro_batch_size_per_gpu=8", "hidden_size=768")
        for a in ("--auto", kv)]
for name in ("zero2_config_accelerate.json", "zero3_offload_config_accelerate.json"):
    assert shardkit(["config", "check", name, "--world-size", "2", "--params", "124M", *auto]) == 0, name
    print()"""),
    new_markdown_cell("""## The demo from a config: `shardkit train --config`
The same engine behind the command line: `--config` takes the JSON as shipped (fp16 here, with
its dynamic loss scale), the flags fill its `"auto"` values (`--lr`, `--weight-decay`,
`--warmup`, `--steps`, `--clip`, `--batch-size` → `train_micro_batch_size_per_gpu`), and
`--model hf:gpt2` trains a `transformers` GPT-2 built from the size flags on the built-in corpus.
The summary puts `engine.memory_report()` next to the planner's figure. One process here (the
command line's `--nproc 1` trains in the process that runs it, as this cell does); `--nproc 2`
runs the same flags on 2 ranks, which `tests/cli/test_train_engine.py` checks against one
process."""),
    new_code_cell("""# shardkit train --nproc 1 --config zero2_config_accelerate.json --model hf:gpt2 ...
assert shardkit(["train", "--nproc", "1", "--config", "zero2_config_accelerate.json",
                 "--model", "hf:gpt2", "--d-model", "64", "--n-layers", "2", "--n-heads", "4",
                 "--seq-len", "64", "--batch-size", "8", "--steps", "8", "--warmup", "2",
                 "--eval-every", "4", "--device", "cpu", "--log-json", str(work / "train.json"),
                 "--plot", str(work / "train.png")]) == 0
log = json.loads((work / "train.json").read_text())
assert log["eval"][-1][1] < log["eval"][0][1]
from IPython.display import Image, display
display(Image(filename=str(work / "train.png")))"""),
    new_markdown_cell("""## shardkit vs DeepSpeed: step time and memory
From `perf/engine.py` (committed results): the seed-002 ZeRO-2 config on a GPT-2 from config,
2 gloo ranks, both engines in the same processes, interleaved."""),
    new_code_cell("""res = json.loads(Path("../perf/results/engine_cpu.json").read_text())
print(res["model"]); print(res["config"])
for name, e in res["engines"].items():
    if e.get("available"):
        print(f"{name:9s}: median {e['median_ms']:.1f} ms, min {e['min_ms']:.1f} ms per step (n={e['n']}); "
              f"model state rank 0: {e['memory_per_rank'][0]['model_state'] / 2**20:.2f} MiB")
for k, v in res["ratios"]["shardkit / deepspeed"].items():
    print(f"shardkit / deepspeed {k}: {v:.3f}")
print("machine load:", res["machine"]["loadavg"])"""),
]
