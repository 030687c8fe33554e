"""Pipeline step-time and bubble benchmark (thin wrapper): see :mod:`shardkit.bench.pipeline`.

Usage:
    .venv/bin/python perf/pipeline.py            # the full run -> perf/results/pipeline_cpu.json (+ plots)
    .venv/bin/python perf/pipeline.py --help

Same as ``shardkit bench pipeline`` from an installed package.
"""

import sys

from shardkit.bench.pipeline import main

if __name__ == "__main__":
    main(sys.argv[1:])
