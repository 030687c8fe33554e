"""Cells of notebooks/07_context_parallel.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "07_context_parallel.ipynb"


CELLS = [
    new_markdown_cell("""# 07 — Context parallelism: a sequence too long for one rank

Activation memory grows with the sequence length; past some length one rank cannot hold a single
sequence's activations, however small the batch. Context parallelism splits every sequence over
the ranks of the `cp` axis: each rank runs the embeddings, MLPs, norms and the loss on its own
`S/cp` tokens, and only attention looks across ranks. Two ways to do that attention exactly:

* **ring** — each rank keeps its queries; the key/value blocks travel around the ring of cp ranks,
  and each block's partial attention is merged into the running result with the log-sum-exp rule
  (exact, as online softmax is);
* **Ulysses** — an all-to-all turns "my tokens, all heads" into "all tokens, my heads", attention
  runs unchanged, and a second all-to-all turns it back.

Under a causal mask the last tokens attend to everything and the first to almost nothing, so
shardkit lays the sequence out "zigzag": cut into `2·cp` chunks, rank `r` holds chunks `r` and
`2cp−1−r` — one early and one late — and every rank does the same work."""),
    new_code_cell("""from shardkit.parallel.context import shard_positions

for r in range(2):
    print(f"cp rank {r} holds positions", shard_positions(16, cp=2, rank=r).tolist())"""),
    new_markdown_cell("""## Two ranks, one long sequence
`scripts/cp_example.py` runs on 2 processes (`torchrun --nproc-per-node 2`). It checks ring and
Ulysses attention against `F.scaled_dot_product_attention` on the whole sequence, measures the
peak memory of one training step of TinyGPT on a 1024-token sequence with the whole sequence on
one rank and with cp = 2, and trains three steps with cp = 2 next to the single-process model."""),
    new_code_cell("""from pathlib import Path
import subprocess, sys, json, os, tempfile

work = Path(tempfile.mkdtemp())
script = Path("scripts/cp_example.py").resolve()
env = dict(os.environ, OMP_NUM_THREADS="1")
run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script), str(work / "out.json"), "1024"], capture_output=True, text=True, env=env, timeout=600)
assert run.returncode == 0, run.stderr[-3000:]
cp = json.loads((work / "out.json").read_text())
print("attention over the shards vs the whole sequence, max |diff|: ring", cp["ring_max_diff"],
      "ulysses", cp["ulysses_max_diff"])
assert cp["ring_max_diff"] < 1e-5 and cp["ulysses_max_diff"] < 1e-5"""),
    new_markdown_cell("""## The memory cap
Say each rank may use 75% of what one training step of this sequence needs on one rank (the
cap stands in for a GPU's memory). Without context parallelism the step does not fit; with
cp = 2 each rank holds half of the sequence's activations:"""),
    new_code_cell("""MiB = 2**20
cap = 0.75 * cp["peak_cp1"]
print(f"per-rank cap: {cap / MiB:.1f} MiB")
print(f"one rank, whole sequence : {cp['peak_cp1'] / MiB:.1f} MiB -> {'fits' if cp['peak_cp1'] <= cap else 'does not fit'}")
print(f"cp = 2, per rank         : {cp['peak_cp2'] / MiB:.1f} MiB -> {'fits' if cp['peak_cp2'] <= cap else 'does not fit'}"
      f" ({cp['peak_cp2'] / cp['peak_cp1']:.2f}x of one rank)")
assert cp["peak_cp1"] > cap >= cp["peak_cp2"]
print()
print("cp = 2 losses     :", [f"{l:.5f}" for l in cp["losses"]])
print("one process losses:", [f"{l:.5f}" for l in cp["ref_losses"]])
assert max(abs(a - b) for a, b in zip(cp["losses"], cp["ref_losses"])) < 1e-4
print("ring attention's transfers:", {op: v["bytes"] for op, v in cp["comm"].items() if op == "ring_shift"})"""),
    new_markdown_cell("""## Memory and time against the sequence length
`perf/context_parallel.py` measures the per-rank peak memory of a training step at cp = 1, 2
(and 4) over a range of sequence lengths, and times the attention against PyTorch's ring
attention and DeepSpeed's Ulysses on the same shards."""),
    new_code_cell("""res = json.loads(Path("../perf/results/context_parallel_cpu.json").read_text())
import matplotlib.pyplot as plt

levels = sorted(res["model_level"].values(), key=lambda r: r["seq_len"])
print(res["model"])
for r in levels:
    parts = [f"{name} {c['peak_bytes'] / MiB:6.1f} MiB {c['median_ms']:7.0f} ms"
             for name, c in r["configs"].items() if c["available"]]
    print(f"S={r['seq_len']:>5}: " + " | ".join(parts))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
for name in levels[0]["configs"]:
    xs = [r["seq_len"] for r in levels if r["configs"][name]["available"]]
    ax1.plot(xs, [r["configs"][name]["peak_bytes"] / MiB for r in levels if r["configs"][name]["available"]], marker="o", label=name)
    ax2.plot(xs, [r["configs"][name]["median_ms"] for r in levels if r["configs"][name]["available"]], marker="o", label=name)
ax1.set(xlabel="sequence length (tokens)", ylabel="peak MiB per rank", xscale="log", yscale="log",
        title="one training step: memory per rank")
ax2.set(xlabel="sequence length (tokens)", ylabel="ms per step (median)", xscale="log", yscale="log", title="time")
ax1.legend()
fig.tight_layout()
plt.show()"""),
]
