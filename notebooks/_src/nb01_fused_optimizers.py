"""Cells of notebooks/01_fused_optimizers.ipynb (built by notebooks/_build.py)."""

from __future__ import annotations

from nbformat.v4 import new_code_cell, new_markdown_cell

NAME = "01_fused_optimizers.ipynb"

CELLS = [
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
