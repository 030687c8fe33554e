"""Cells of notebooks/03_zero.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "03_zero.ipynb"


CELLS = [
    new_markdown_cell("""# 03 — ZeRO: sharded data parallelism, what it saves, what fits

Plain data parallelism keeps the whole model state on every rank: for fp32 AdamW that is 4 bytes
of parameters, 4 of gradients and 8 of moments — **16 bytes per parameter per rank**, however many
ranks there are. ZeRO shards it over the N data-parallel ranks:

| stage | sharded | bytes per rank (fp32 AdamW) |
|---|---|---|
| DDP | nothing | 16Ψ |
| ZeRO-1 | optimizer state | 4Ψ + 4Ψ + 8Ψ/N |
| ZeRO-2 | + gradients | 4Ψ + 12Ψ/N |
| ZeRO-3 | + parameters (gathered per block, just in time) | 16Ψ/N |

and offload moves the optimizer state (and its step) to the CPU or to NVMe files. shardkit's
planner predicts those bytes *before* you allocate anything; below, 2 processes train TinyGPT at
each stage and report what they actually hold."""),
    new_code_cell("""from pathlib import Path
import subprocess, sys, json, os, tempfile

work = Path(tempfile.mkdtemp())
script = Path("scripts/zero_example.py").resolve()
env = dict(os.environ, OMP_NUM_THREADS="1")
run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script), str(work / "out.json")], capture_output=True, text=True, env=env, timeout=600)
assert run.returncode == 0, run.stderr[-3000:]
runs = json.loads((work / "out.json").read_text())
psi = runs["ZeRO-1"]["params"]
print(f"TinyGPT: {psi:,} parameters, dp = 2")
print(f"{'':24s} {'measured':>10s} {'planned':>10s}   (model-state bytes per rank)   offloaded")
for name, r in runs.items():
    m, p = r["measured"]["model_state"], r["planned"]["model_state"]
    print(f"{name:24s} {m:10,d} {p:10,d}   {m / (16 * psi):.3f} x DDP's 16Ψ            {r['measured']['offloaded']}")
    assert abs(m - p) <= 0.05 * p"""),
    new_markdown_cell("""Measured and planned agree (the test suite holds them within 5% for every category,
padding and buffers included). With 2 ranks ZeRO-3 holds about half of DDP's 16Ψ, and with cpu
offload the device keeps only the parameter and gradient shards.

## Plotted: every category"""),
    new_code_cell("""import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

cats = ["params", "grads", "master_params", "optimizer_state"]
fig, ax = plt.subplots(figsize=(8, 3.2))
names = list(runs)
bottom = [0] * len(names)
for c in cats:
    vals = [runs[n]["measured"][c] / 1e6 for n in names]
    ax.bar(names, vals, bottom=bottom, label=c)
    bottom = [b + v for b, v in zip(bottom, vals)]
ax.scatter(names, [runs[n]["planned"]["model_state"] / 1e6 for n in names], color="k", marker="_", s=800,
           label="planned total", zorder=3)
ax.axhline(16 * psi / 1e6, color="grey", ls="--", label="DDP 16Ψ")
ax.set_ylabel("MB per rank"); ax.legend(fontsize=7); fig.tight_layout()
png = work / "zero_memory.png"; fig.savefig(png, dpi=80); plt.close(fig)
display(Image(str(png)))"""),
    new_markdown_cell("""## What fits: the planner at scale
The same planner, for the ZeRO paper's 7.5B-parameter model on 64 GPUs with mixed-precision Adam
(Table 1 of Rajbhandari et al.: 120 GB for DDP; 31.4 / 16.6 / 1.88 GB for stages 1/2/3). From the
shell: `shardkit plan --params 7.5e9 --dp 64 --precision fp16`."""),
    new_code_cell("""from shardkit.parallel.zero import plan_table

table = plan_table(7_500_000_000, dp=64, precision="fp16", device_bytes=32 * 2**30)
print(table)
assert [round(p.model_state_bytes / 1e9, 2) for p in table.plans] == [120.0, 31.41, 16.64, 1.88]"""),
]
