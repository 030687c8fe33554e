# shardkit — every target sets itself up from nothing: a fresh clone needs only `make test` / `make demo`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardkit-installed
# Triton 3.9 warns unless this is set; 1 keeps FMA contraction (the documented default).
export TRITON_DEFAULT_FP_FUSION ?= 1
export PYTHONUNBUFFERED := 1
NPROC  ?= 2
# pytest-xdist workers for make test (0: the tests run in the pytest process itself). 3 on 2 cores:
# the tests mostly wait on their rank processes (docs/testing.md, "Workers")
TEST_WORKERS ?= 3
# DeepSpeed (the peer the tests and notebook 06 drive) JIT-builds a C++ op on its first
# init_distributed. Built here once, in the install step, into a directory of this venv: a build
# that a test timeout kills leaves a `lock` file behind, and in the shared ~/.cache every later
# run on the machine would wait on that lock forever.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
PY_SOURCES := kernels comm parallel shardkit perf tests tools notebooks/_build.py notebooks/_src notebooks/scripts
STEPS  ?= 200

.PHONY: all test test-matrix demo demo-restart bench install clean test-gpu mutate

all: test

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# CPU torch, pinned: a looser requirement would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	@echo "building DeepSpeed's CPU shared-memory op once (about a minute on 2 cores)"
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null
	@touch $@

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check $(PY_SOURCES)
	$(BIN)/ruff format --check $(PY_SOURCES)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load -m "not slow_matrix" --durations=15 tests
	# The reduction-order guard: the equality tests again, every cross-rank sum moved within the
	# bound another order of additions allows (tests/reduction_order.py, docs/testing.md).
	SHARDKIT_TEST_REDUCTION_ORDER=perturb $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load -m "reduction_order and not slow_matrix" tests

# The full product of the usage matrix (tests/compose/test_usage_matrix.py; make test runs its pairwise
# cover): every model family x usage pattern x layout against the dense model (docs/testing.md).
test-matrix: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load -m slow_matrix tests/compose/test_usage_matrix.py

demo: $(STAMP)
	$(BIN)/shardkit train --nproc $(NPROC) --strategy zero2 --steps $(STEPS)

# A restart drill (docs/operations.md): rank 1 is killed at step 50; torchrun starts the workers
# again and they resume from the step-40 checkpoint, ending as an uninterrupted run would.
demo-restart: $(STAMP)
	rm -rf .demo-restart-ckpt
	$(BIN)/shardkit train --nproc $(NPROC) --strategy zero2 --steps 100 --eval-every 50 \
		--ckpt-dir .demo-restart-ckpt --save-every 20 --resume auto --max-restarts 1 --inject-fault 1:50:kill

# On a CUDA machine: GPU-only tests (`-m cuda`: aligned/unaligned kernels, fp16, NCCL DataParallel on 2
# GPUs, ...) then the optimizer and DDP benchmarks on CUDA, results in perf/results/*_cuda.json.
# The venv's torch must be a CUDA build: create it first, e.g.
#   python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# ($(STAMP)'s `pip install torch==2.13.0` then finds 2.13.0+cu128 already satisfying the pin).
test-gpu: $(STAMP)
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'make test-gpu: no CUDA device or a CPU-only torch ' + torch.__version__ + ' (see the comment above test-gpu)')"
	$(BIN)/python -m pytest -q -m cuda tests
	$(BIN)/python perf/optim.py --device cuda --out perf/results/
	@gpus=$$($(BIN)/python -c "import torch; print(torch.cuda.device_count())"); \
	if [ $$gpus -ge 2 ]; then $(BIN)/python perf/ddp.py --device cuda --nproc $$gpus --out perf/results; \
	else echo "perf/ddp.py skipped: $$gpus GPU (DataParallel over NCCL needs 2)"; fi

bench: $(STAMP)
	$(BIN)/shardkit bench optim

# Mutation testing in a temporary copy of the repository (tools/mutate.py, cosmic-ray; the
# working tree is never written). MODULE=parallel/buckets.py (optionally :FIRST-LAST lines) runs
# one module against the tests that cover it; the default runs the parallel/ and comm/ modules in
# sequence. MUTATE_ARGS: e.g. --rev HEAD, --sample 40, --timeout 120. See docs/testing.md.
MODULE      ?=
MUTATE_ARGS ?=
mutate: $(STAMP)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check cosmic-ray==8.7.0
	$(BIN)/python tools/mutate.py $(MODULE) $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
