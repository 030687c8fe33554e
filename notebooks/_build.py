"""Build the tutorial notebooks from the cell sources below (run: python notebooks/_build.py).

Keeping the sources here keeps diffs readable; `make test` executes the .ipynb files.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

NB01 = [
    new_markdown_cell("""# 01 — Fused optimizers: a drop-in `torch.optim` replacement

`shardkit.kernels` ships `FusedAdam`, `FusedAdamW`, `FusedSGD`, `FusedLion` and `FusedLAMB`.
Each takes the same arguments as its torch counterpart, keeps the same `state` keys (so state
dicts move both ways), and updates **all parameters of a launch group in one Triton kernel
launch** on CUDA. On CPU (this notebook) `backend="auto"` takes a fast path built on torch's own
fused CPU ops; `backend="triton"` runs the *same Triton source* through Triton's interpreter —
that is how the test suite proves the kernels on a machine without a GPU."""),
    new_code_cell("""import torch
from torch import nn
from shardkit.kernels import FusedAdamW, count_launches

def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

x, y = torch.randn(256, 32), torch.randn(256, 1)"""),
    new_markdown_cell("""## Drop-in use
Train the same model with `torch.optim.AdamW` and with `FusedAdamW` (interpreted Triton kernel)
and compare the parameters after 20 steps."""),
    new_code_cell("""ref, ours = make_model(), make_model()
opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
opt = FusedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, backend="triton")
for step in range(20):
    for model, o in ((ref, opt_ref), (ours, opt)):
        o.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
    opt_ref.step()
    with count_launches() as launches:
        opt.step()
max_diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
n_params = len(list(ours.parameters()))
print(f"max |torch - shardkit| after 20 steps: {max_diff:.2e}")
print(f"{n_params} parameter tensors, kernel launches per step: {dict(launches)}")
assert max_diff < 1e-5"""),
    new_markdown_cell("""## State dicts move both ways
A `FusedAdamW` checkpoint loads into `torch.optim.AdamW` (and back), and training continues
identically."""),
    new_code_cell("""import io

def checkpoint(obj):
    # state_dict() returns live references, as torch.optim's does: loading it in the same process
    # would make two optimizers share (and both advance) one set of tensors. A real checkpoint
    # round trip gives independent state.
    buf = io.BytesIO(); torch.save(obj, buf); buf.seek(0)
    return torch.load(buf)

a, b = make_model(), make_model()
opt_a = FusedAdamW(a.parameters(), lr=1e-2)
nn.functional.mse_loss(a(x), y).backward(); opt_a.step()
b.load_state_dict(checkpoint(a.state_dict()))
opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
opt_b.load_state_dict(checkpoint(opt_a.state_dict()))   # shardkit -> torch
print(sorted(opt_b.state[next(b.parameters())].keys()))
for model, o in ((a, opt_a), (b, opt_b)):
    for _ in range(5):
        o.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); o.step()
diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
print(f"max |shardkit - torch| after 5 more steps: {diff:.2e}")
assert diff < 1e-6"""),
    new_markdown_cell("""## Mixed precision with fp32 master weights
bf16 parameters with `master_weights=True`: the optimizer keeps an fp32 master copy and fp32
moments, updates them and writes the rounded bf16 parameter in the same pass."""),
    new_code_cell("""ref, low = make_model(), make_model().to(torch.bfloat16)
opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
opt_low = FusedAdamW(low.parameters(), lr=1e-2, master_weights=True)
for step in range(20):
    for model, o, dt in ((ref, opt_ref, torch.float32), (low, opt_low, torch.bfloat16)):
        o.zero_grad(); nn.functional.mse_loss(model(x.to(dt)).float(), y).backward(); o.step()
state = opt_low.state[next(low.parameters())]
print("state dtypes:", {k: v.dtype for k, v in state.items()})
master_dev = max((opt_low.state[q]["master_param"] - p).abs().max().item() for p, q in zip(ref.parameters(), low.parameters()))
print(f"max |fp32 reference - fp32 master| after 20 steps: {master_dev:.2e}  (forward/backward ran in bf16)")"""),
    new_markdown_cell("""## CPU step time vs the peers
`perf/optim.py` (also `shardkit bench optim`) times one optimizer step against torch's foreach
and fused AdamW (and DeepSpeedCPUAdam when installed) in the same run. The plot reads the
committed result file, `perf/results/optim_cpu.json`."""),
    new_code_cell("""import json
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

path = Path("../perf/results/optim_cpu.json")
res = json.loads(path.read_text())
print(json.dumps({k: res[k] for k in res if k not in ("results", "sizes")}, indent=1)[:800])
png = path.with_suffix(".png")
if png.exists():
    display(Image(filename=str(png)))"""),
]


DDP_SCRIPT = """
import json, sys, torch
from torch import nn
from shardkit.comm import ParallelContext
from shardkit.kernels import FusedAdamW
from shardkit.parallel import DataParallel

# the model stays on CPU, so gloo explicitly: on a GPU machine the default would be NCCL
ctx = ParallelContext.from_env(backend="gloo")    # reads torchrun's environment
rank, world = ctx.rank("dp"), ctx.size("dp")
torch.manual_seed(0)
model = DataParallel(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)), ctx, bucket_mb=0.01)
opt = FusedAdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)   # the global batch
mine = slice(rank * 64 // world, (rank + 1) * 64 // world)                  # this rank's rows
for step in range(20):
    opt.zero_grad()
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    opt.step()
if rank == 0:
    out = dict(params=[p.detach().flatten().tolist() for p in model.parameters()],
               buckets=model.bucket_bytes, comm=model.comm_stats.summary())
    json.dump(out, open(sys.argv[1], "w"))
ctx.destroy()
"""

NB02 = [
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
    new_code_cell(f"""from pathlib import Path
import subprocess, sys, json, os, tempfile

work = Path(tempfile.mkdtemp())
script = work / "ddp_example.py"
script.write_text('''{DDP_SCRIPT}''')
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
`make demo` runs `shardkit train --nproc 2 --strategy ddp`. The training loop sees only the
strategy interface of `shardkit.parallel.strategy` (`wrap`, `backward`, `clip`, `step`,
`report`); `--strategy` picks the implementation. Here a shorter run, compared with one process
on the same global batch (2 × 8 sequences): the eval losses agree."""),
    new_code_cell("""# --device cpu: the same CPU run (gloo) on any machine, GPU or not
common = ["--steps", "40", "--d-model", "64", "--n-layers", "2", "--seq-len", "64", "--eval-every", "20",
          "--device", "cpu"]
shardkit = [sys.executable, "-m", "shardkit.cli", "train"]
r2 = subprocess.run(shardkit + ["--nproc", "2", "--strategy", "ddp", "--batch-size", "8",
                    "--log-json", str(work / "ddp.json")] + common, capture_output=True, text=True, timeout=600)
print(r2.stdout[-1500:]); assert r2.returncode == 0, r2.stderr[-3000:]
r1 = subprocess.run(shardkit + ["--nproc", "1", "--batch-size", "16", "--log-json", str(work / "one.json")] + common,
                    capture_output=True, text=True, timeout=600)
assert r1.returncode == 0, r1.stderr[-3000:]
a, b = json.loads((work / "ddp.json").read_text()), json.loads((work / "one.json").read_text())
print("eval (ddp, 2 ranks):", a["eval"])
print("eval (1 process)   :", b["eval"])"""),
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


def write(name: str, cells: list) -> None:
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("01_fused_optimizers.ipynb", NB01)
    write("02_data_parallel.ipynb", NB02)
