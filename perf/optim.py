"""Optimizer step benchmark (thin wrapper): see :mod:`shardkit.bench.optim`.

Usage:
    .venv/bin/python perf/optim.py              # 10M, 100M params -> perf/results/optim_<device>.json + .png
    .venv/bin/python perf/optim.py --quick --out /tmp/   # smoke run on tiny sizes
    .venv/bin/python perf/optim.py --sizes 10M --repeats 20 --peers shardkit.FusedAdamW "torch.AdamW(fused)"

Same as ``shardkit bench optim`` from an installed package.
"""

import sys

from shardkit.bench.optim import main

if __name__ == "__main__":
    sys.exit(main())
