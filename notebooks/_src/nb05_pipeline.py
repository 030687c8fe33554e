"""Cells of notebooks/05_pipeline.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "05_pipeline.ipynb"


CELLS = [
    new_markdown_cell("""# 05 — Pipeline parallelism: schedules as data, one executor

Consecutive blocks of the model live on consecutive ranks; a global batch is cut into `m`
micro-batches that flow through the stages. While the first micro-batch is still on stage 0, the
other stages idle: that idle time is the **bubble**. Schedules differ in how they order the
forwards (F) and backwards (B) of the micro-batches to keep it small and to bound the activations
each stage holds.

In shardkit a schedule is *data*: `build_schedule(name, num_ranks=p, microbatches=m)` returns, per
rank, the ordered list of actions (`F` stage.microbatch, `B`, the split backward `BI`/`BW`, sends
and receives). A unit-time simulator runs them without processes, and one executor,
`PipelineParallel`, runs any of them over point-to-point transfers."""),
    new_code_cell("""from shardkit.parallel.pipeline import build_schedule, simulate

s = build_schedule("1f1b", num_ranks=4, microbatches=8)
for r, actions in enumerate(s.actions):
    compute = [str(a) for a in actions if a.kind.value in ("F", "B")]
    print(f"rank {r}:", " ".join(compute))"""),
    new_markdown_cell("""## Bubble: simulated vs the formula
With equal forward and backward times, GPipe and 1F1B idle for `(p − 1)/m` of their compute
time, interleaving with `v` chunks per rank for `(p − 1)/(v·m)`, and ZB-H1 (backward split into
input- and weight-gradient halves) for one third of 1F1B's. The simulator reproduces each
formula exactly (the test suite checks it for every p ≤ 8, m ≤ 32, v ≤ 4)."""),
    new_code_cell("""p, m = 4, 8
rows = []
for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]:
    sched = build_schedule(name, num_ranks=p, microbatches=m, virtual_stages=v)
    # F = 1, full backward = 2 (BI = BW = 1), as in the ZB paper's T_F = T_B = T_W
    sim = simulate(sched, t_f=1.0, t_b=1.0, t_w=1.0)
    formula = {"gpipe": (p - 1) / m, "1f1b": (p - 1) / m, "interleaved": (p - 1) / (v * m),
               "zb-h1": (p - 1) / m / 3}[name]
    rows.append((name, v, sim.bubble_fraction, formula))
    print(f"{name:12s} v={v}  simulated bubble {sim.bubble_fraction:.4f}   formula {formula:.4f}")
assert all(abs(a - b) < 1e-9 for *_, a, b in rows)"""),
    new_code_cell("""from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

fig, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True)
colors = {"F": "tab:blue", "B": "tab:orange", "BI": "tab:orange", "BW": "tab:green"}
for ax, name in zip(axes, ["1f1b", "zb-h1"]):
    sim = simulate(build_schedule(name, num_ranks=p, microbatches=m))
    for r, timeline in enumerate(sim.timeline):
        for t in timeline:
            if t.action.kind.value in colors:
                ax.barh(r, t.end - t.start, left=t.start, color=colors[t.action.kind.value], edgecolor="k", lw=0.3)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)]); ax.invert_yaxis(); ax.set_title(name)
axes[-1].set_xlabel("time (units of one forward)")
import tempfile
png = Path(tempfile.mkdtemp()) / "pipeline_schedules.png"
fig.tight_layout(); fig.savefig(png, dpi=80); plt.close(fig)
display(Image(str(png)))"""),
    new_markdown_cell("""## Training through the executor
`parallelize(model, ctx, pp=..., blocks=gpt_blocks)` cuts TinyGPT into `[embedding, 4 blocks,
head]`, keeps this rank's stages and returns a step whose loss is the token-weighted mean over the
global batch — the same number for any `m` and `p`. Two processes (gloo), each schedule, against
one process training the whole model on the same batches."""),
    new_code_cell("""from pathlib import Path
import subprocess, sys, json, os, tempfile

work = Path(tempfile.mkdtemp())
script = Path("scripts/pp_example.py").resolve()
env = dict(os.environ, OMP_NUM_THREADS="1")
out = work / "runs.json"
run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script), str(out), "gpipe", "1f1b", "zb-h1"], capture_output=True, text=True, env=env, timeout=300)
assert run.returncode == 0, run.stderr[-3000:]
runs = json.loads(out.read_text())
print("stages (block indices):", runs["1f1b"]["stage_blocks"])"""),
    new_code_cell("""import torch
from shardkit.models import TinyGPT, lm_loss

torch.manual_seed(0)
ref = TinyGPT(59, d_model=32, n_layers=4, n_heads=4, seq_len=16, tie_embeddings=False)
opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
gen = torch.Generator().manual_seed(3)
ref_losses = []
for step in range(5):
    x, y = torch.randint(59, (8, 16), generator=gen), torch.randint(59, (8, 16), generator=gen)
    opt.zero_grad(); loss = lm_loss(ref(x), y); loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3); opt.step(); ref_losses.append(loss.item())
print("one process :", [f"{l:.5f}" for l in ref_losses])
for name, r in runs.items():
    print(f"{name:12s}:", [f"{l:.5f}" for l in r["losses"]])
    assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < 1e-5"""),
    new_markdown_cell("""## Measured
`perf/pipeline.py` times each schedule against `torch.distributed.pipelining` on the same model
and reports the measured bubble next to the formula (see the README's performance table; for
zb-h1 the reference is the simulator run with the measured T_F, T_B, T_W, since on CPU the weight
pass is slower than the formula assumes). On gloo the executor posts each receive two computes
before the compute that consumes it, so gloo's send-after-ready handshake overlaps compute."""),
    new_code_cell("""res_path = Path("../perf/results/pipeline_cpu.json")
if res_path.exists():
    res = json.loads(res_path.read_text())
    print(f"{res['model']}, pp={res['pp']}, m={res['microbatches']}, {res['device']}/{res['backend']}")
    for name, r in res["results"].items():
        ours, peer = r["ours"], r["torch"]
        print(f"{name:12s} ours {ours['median_ms']:7.1f} ms   torch {peer['median_ms']:7.1f} ms "
              f"({r['torch_peer']})   ratio {ours['median_ms'] / peer['median_ms']:.2f}   "
              f"bubble {ours['bubble']:.3f} = {ours['bubble_over_formula']:.2f}x the {r['bubble_reference']} "
              f"(best repeat {ours['bubble_min_over_formula']:.2f}x)")"""),
]
