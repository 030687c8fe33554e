"""Tensor-parallel step-time and cross-entropy benchmark (thin wrapper): see :mod:`shardkit.bench.tp`.

Usage:
    .venv/bin/python perf/tp.py            # the full run -> perf/results/tp_cpu.json (+ plots)
    .venv/bin/python perf/tp.py --help

Same as ``shardkit bench tp`` from an installed package.
"""

import sys

from shardkit.bench.tp import main

if __name__ == "__main__":
    main(sys.argv[1:])
