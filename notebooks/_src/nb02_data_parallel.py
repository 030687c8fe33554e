"""Cells of notebooks/02_data_parallel.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "02_data_parallel.ipynb"


CELLS = [
    new_markdown_cell("""# 02 — Data parallelism with `shardkit.parallel.DataParallel`

Every rank holds the full model and trains on its own slice of the global batch. During
`backward()` the gradients are packed into flat buckets (one multi-tensor flatten kernel launch
per bucket) in reverse registration order, and each bucket's all-reduce starts as soon as its
last gradient is ready — overlapping communication with the rest of backward. When backward
ends, every bucket is copied back into `p.grad` with the 1/dp averaging fused into the copy.

This notebook runs on CPU: 2 local processes with gloo. On GPUs the same code uses NCCL and the
compiled Triton kernels."""),
    new_markdown_cell("""## The API in a script
Processes are started by `torchrun`; a notebook cell can't be a worker, so we write the script
to a file and launch it."""),
    new_code_cell("""from pathlib import Path
import subprocess, sys, json, os, tempfile

work = Path(tempfile.mkdtemp())
script = Path("scripts/ddp_example.py").resolve()
print(script.read_text())
env = dict(os.environ, OMP_NUM_THREADS="1")
run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script), str(work / "out.json")], capture_output=True, text=True, env=env, timeout=300)
assert run.returncode == 0, run.stderr[-3000:]
ddp = json.loads((work / "out.json").read_text())
print("bucket bytes:", ddp["buckets"])
print("comm:", json.dumps(ddp["comm"], indent=1)[:600])"""),
    new_markdown_cell("""## Same result as one process on the whole batch
Averaging the per-rank gradients of equal slices gives the full-batch gradient, so 2-rank DDP
must match single-process training on the concatenated batch (up to summation order)."""),
    new_code_cell("""import torch
from torch import nn
from shardkit.kernels import FusedAdamW

torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = FusedAdamW(ref.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
for step in range(20):
    opt.zero_grad(); nn.functional.mse_loss(ref(x), y).backward(); opt.step()
dev = max((p.detach().flatten() - torch.tensor(q)).abs().max().item() for p, q in zip(ref.parameters(), ddp["params"]))
print(f"max |single process - DDP| after 20 steps: {dev:.2e}")
assert dev < 1e-5"""),
    new_markdown_cell("""## The demo trainer: `shardkit train`
`make demo` runs `shardkit train --nproc 2 --strategy zero2`; here `--strategy ddp`. The
training loop talks only to the `ParallelModel` that `parallelize()` returns
(`forward_backward`, `clip`, `step`, `report`); `--strategy` picks the data-parallel plug-in
behind it. A short run, compared with one process on the same global batch (2 × 8 sequences):
the eval losses agree. `--plot` draws the run: loss curves, and each rank's memory next to the
planner's figure."""),
    new_code_cell("""# --device cpu: the same CPU run (gloo) on any machine, GPU or not
import contextlib, io
common = ["--steps", "10", "--d-model", "64", "--n-layers", "2", "--seq-len", "64", "--eval-every", "5",
          "--device", "cpu"]
shardkit = [sys.executable, "-m", "shardkit.cli", "train"]
r2 = subprocess.run(shardkit + ["--nproc", "2", "--strategy", "ddp", "--batch-size", "8",
                    "--log-json", str(work / "ddp.json"), "--plot", str(work / "ddp.png")] + common,
                    capture_output=True, text=True, timeout=600)
print(r2.stdout[-1500:]); assert r2.returncode == 0, r2.stderr[-3000:]
# --nproc 1 trains in the process that runs the command line: here, the same entry point in this one
from shardkit.cli import main as shardkit_cli
with contextlib.redirect_stdout(io.StringIO()):
    assert shardkit_cli(["train", "--nproc", "1", "--batch-size", "16", "--log-json", str(work / "one.json")] + common) == 0
a, b = json.loads((work / "ddp.json").read_text()), json.loads((work / "one.json").read_text())
print("eval (ddp, 2 ranks):", a["eval"])
print("eval (1 process)   :", b["eval"])
assert max(abs(x[1] - y[1]) for x, y in zip(a["eval"], b["eval"])) < 1e-4
from IPython.display import Image, display
display(Image(filename=str(work / "ddp.png")))"""),
    new_markdown_cell("""## shardkit DataParallel vs torch DDP, and bucket size
From `perf/ddp.py` (committed results): step time of both wrappers on the same model in the
same run, and a bucket-size sweep."""),
    new_code_cell("""from IPython.display import Image, display
res = json.loads(Path("../perf/results/ddp_cpu.json").read_text())
print(f"{res['model']}: shardkit {res['shardkit']['median_ms']:.1f} ms, torch DDP {res['torch_ddp']['median_ms']:.1f} ms "
      f"(ratio {res['ratio_median']:.2f}, median of {res['shardkit']['n']})")
png = Path("../perf/results/ddp_cpu.png")
if png.exists():
    display(Image(filename=str(png)))"""),
]
