"""Cells of notebooks/04_tensor_parallel.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "04_tensor_parallel.ipynb"


CELLS = [
    new_markdown_cell("""# 04 — Tensor parallelism: Megatron layers, a vocab-parallel loss, declarative plans

Each rank of the tp axis holds a slice of every large matrix. A column-parallel linear splits the
weight `A [out, in]` by rows, so each rank computes its slice of the output features; the
row-parallel linear that follows splits by columns and sums the partial outputs with one
all-reduce. Per transformer layer that is 2 all-reduces in forward (after attention and after the
MLP) and 2 in backward — the conjugate operators *f* (identity forward, all-reduce backward) and
*g* (all-reduce forward, identity backward).

The LM head's vocabulary is split too: the loss is computed from each rank's logits shard (max,
sum-exp and the target logit, three small all-reduces) by a Triton kernel that writes the
gradient in place — no rank ever holds the full `[tokens, vocab]` logits."""),
    new_code_cell("""from pathlib import Path
import subprocess, sys, json, os, tempfile

work = Path(tempfile.mkdtemp())
script = Path("scripts/tp_example.py").resolve()
env = dict(os.environ, OMP_NUM_THREADS="1")
run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script), str(work / "out.json")], capture_output=True, text=True, env=env, timeout=300)
assert run.returncode == 0, run.stderr[-3000:]
tp = json.loads((work / "out.json").read_text())
print("MLP, |TP - dense| max:", tp["mlp_max_diff"])
print("MLP collectives (one forward):", tp["mlp_comm"])
print("cross-entropy, vocab-parallel vs F.cross_entropy:", tp["ce"])
assert tp["mlp_max_diff"] < 1e-5 and abs(tp["ce"][0] - tp["ce"][1]) < 1e-5"""),
    new_markdown_cell("""The forward of the MLP issued exactly one all-reduce (the row-parallel output) of
`4 × 16` fp32 values; the column-parallel input needs none in forward.

## A whole model from a plan
`gpt_plan()` is data — `{"blocks.*.attn.qkv": Colwise(fused_chunks=3), "blocks.*.attn.proj":
Rowwise(), ..., "tok_emb": VocabParallel(), "head": VocabParallelHead(tied_to="tok_emb")}` — and
`parallelize(model, ctx, tp_plan=gpt_plan())` converts TinyGPT in place, picks the vocab-parallel
loss because the head is vocab-parallel, and clips by the global norm (sharded parameters add
over tp, replicated ones count once). Against one process training the dense model:"""),
    new_code_cell("""import torch
from shardkit.models import TinyGPT, lm_loss

torch.manual_seed(0)
ref = TinyGPT(59, d_model=32, n_layers=2, n_heads=4, seq_len=16)
opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
gen = torch.Generator().manual_seed(3)
ref_losses = []
for step in range(5):
    x, y = torch.randint(59, (8, 16), generator=gen), torch.randint(59, (8, 16), generator=gen)
    opt.zero_grad(); loss = lm_loss(ref(x), y); loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3); opt.step(); ref_losses.append(loss.item())
print("dense, 1 process:", [f"{l:.5f}" for l in ref_losses])
print("tp = 2          :", [f"{l:.5f}" for l in tp["losses"]])
print(f"parameters per rank: {tp['params_per_rank']:,} of {ref.num_parameters():,}")
assert max(abs(a - b) for a, b in zip(tp["losses"], ref_losses)) < 1e-5"""),
    new_markdown_cell("""## Measured
`perf/tp.py`: a TinyGPT training step and a stack of blocks against PyTorch DTensor tensor
parallelism, and the cross-entropy against gathering the logits (time and peak memory)."""),
    new_code_cell("""res = json.loads(Path("../perf/results/tp_cpu.json").read_text())
step = res["step"]
print(res["model"])
print(f"step: shardkit {step['shardkit']['median_ms']:.1f} ms, DTensor {step['dtensor']['median_ms']:.1f} ms "
      f"(ratio {step['ratio_median']:.2f})")
for vocab, r in res["cross_entropy"].items():
    t = r["time"]
    print(f"cross-entropy V={vocab}: {t['shardkit']['median_ms']:.0f} ms vs gather + F.cross_entropy "
          f"{t['gather_F_cross_entropy']['median_ms']:.0f} ms; peak memory x{r['ratio_peak_bytes']:.2f}")

import matplotlib.pyplot as plt
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
names = ["shardkit", "DTensor"]
ax1.bar(names, [step["shardkit"]["median_ms"], step["dtensor"]["median_ms"]], color=["C0", "C7"])
ax1.set(ylabel="ms per step (median)", title=f"training step, tp={res['nproc']}")
vocabs = list(res["cross_entropy"])
xs = range(len(vocabs))
ours = [res["cross_entropy"][v]["time"]["shardkit"]["median_ms"] for v in vocabs]
gathered = [res["cross_entropy"][v]["time"]["gather_F_cross_entropy"]["median_ms"] for v in vocabs]
ax2.bar([x - 0.2 for x in xs], ours, 0.4, label="vocab-parallel (shardkit)")
ax2.bar([x + 0.2 for x in xs], gathered, 0.4, label="gather + F.cross_entropy", color="C7")
ax2.set_xticks(list(xs), [f"V={v}" for v in vocabs])
ax2.set(ylabel="ms (median)", title="cross-entropy fwd+bwd")
ax2.legend()
fig.tight_layout()
plt.show()"""),
]
