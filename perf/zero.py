"""ZeRO step-time and memory benchmark (thin wrapper): see :mod:`shardkit.bench.zero`.

Usage:
    .venv/bin/python perf/zero.py                      # ~20M-param TinyGPT, stages 1-3 + cpu offload rows
                                                       #   -> perf/results/zero_cpu.json + .png
    .venv/bin/python perf/zero.py --quick --out /tmp/  # smoke run on a tiny model
    .venv/bin/python perf/zero.py --stages 3 --offload none cpu --out /tmp/z3   # stage 3 and 3+cpu only
    .venv/bin/python perf/zero.py --stages 2 --offload none --configs shardkit torch.fully_shard

Same as ``shardkit bench zero`` from an installed package.
"""

import sys

from shardkit.bench.zero import main

if __name__ == "__main__":
    sys.exit(main())
