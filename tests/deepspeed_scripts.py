"""Run a DeepSpeed-style training script on 2 gloo ranks, as written (DeepSpeed 0.19.8 on its
CPU accelerator) or with ``import deepspeed`` replaced by shardkit's facade.

The script gets ``--deepspeed --deepspeed_config ds_config.json --out NAME.json`` plus
``extra_args`` and writes its facts to ``--out`` on rank 0; :func:`run_script` returns them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SHARDKIT_IMPORT = "import shardkit.deepspeed as deepspeed\n"


def with_shardkit(script: str) -> str:
    """``script`` with its one ``import deepspeed`` line changed (and nothing else)."""
    assert script.count("import deepspeed\n") == 1, "the script must import deepspeed once, on its own line"
    return script.replace("import deepspeed\n", SHARDKIT_IMPORT)


def run_script(script: str, tmp_path: Path, name: str, config: dict, extra_args: Sequence[str] = (), nproc: int = 2) -> dict:
    """Write ``script`` to ``tmp_path/NAME.py`` and ``config`` to ``ds_config.json``, run it under
    torchrun on ``nproc`` processes and return what rank 0 wrote to ``NAME.json``."""
    (tmp_path / f"{name}.py").write_text(script)
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), f"{name}.py"]
    cmd += ["--deepspeed", "--deepspeed_config", "ds_config.json", "--out", f"{name}.json", *extra_args]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((tmp_path / f"{name}.json").read_text())
