"""Mutation testing for shardkit, one module at a time, in a throw-away copy of the repository.

Usage (``make mutate`` wraps it)::

    python tools/mutate.py                                  # the default parallel/ + comm/ modules
    python tools/mutate.py parallel/buckets.py              # one module, with the tests that cover it
    python tools/mutate.py parallel/data_parallel.py:180-290 --rev HEAD --sample 40

For each module it copies the repository (the working tree's tracked and untracked files, or a
committed ``--rev``) to a temporary directory, arranges for ``shardkit.*`` to import from that copy
(``<copy>/shardkit/{kernels,comm,parallel}`` are symlinks to the copy's folders and the copy is
first on ``PYTHONPATH``, ahead of the editable install's finder), and runs cosmic-ray there:
each mutant is written into the *copy's* file, the module's tests run, and the file is restored.
The working tree is never written. It prints the score and the diff of every surviving mutant.

Why cosmic-ray and not mutmut 3: mutmut 3 compiles every mutant into a trampoline selected by
the *module name derived from the file path* (``parallel.buckets``), while the tests import
``shardkit.parallel.buckets`` (pyproject's package-dir mapping), so no mutant would ever be
active; and it picks the tests per mutant from in-process coverage, which misses code run in the
distributed test workers. cosmic-ray rewrites the file and runs a plain command: both work.

Operators: cosmic-ray's full set replaces every arithmetic operator by eleven others (``+`` by
``>>``, ``|``, ...) and every comparison by seven; most of those are trivially killed and only
multiply the run time on 2 cores. :data:`KEEP` keeps the mutmut-like core: boundary (``<`` vs
``<=``) and negated comparisons, ``+``/``-`` and ``*``/``/`` swaps, ``and``/``or``, ``not``
added to a condition, ``True``/``False``, numbers off by one, zero-iteration loops,
``break``/``continue``, unary minus/not removed, decorators removed. ``|`` -> ``&`` is left out:
in this code base ``|`` is almost only the ``X | None`` of annotations, which ``from __future__
import annotations`` never evaluates (every such mutant is equivalent and costs a full run).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: module -> the test files that cover it (fastest first: ``pytest -x`` stops at the first failure).
MODULE_TESTS: dict[str, list[str]] = {
    "parallel/buckets.py": ["tests/data_parallel/test_bucket_plan.py", "tests/data_parallel/test_dp_comm_accounting.py"],
    "parallel/data_parallel.py": [
        "tests/data_parallel/test_dp_comm_accounting.py",
        "tests/data_parallel/test_dp_sgd_equivalence.py",
        "tests/data_parallel/test_data_parallel_unusual_models.py",
        "tests/data_parallel/test_data_parallel_trains_like_one_process.py",
    ],
    "parallel/loss_scaler.py": [
        "tests/data_parallel/test_loss_scale_schedule.py",
        "tests/data_parallel/test_loss_scaler_deepspeed.py",
    ],
    "parallel/grad_utils.py": [
        "tests/data_parallel/test_unscale_and_clip.py",
        "tests/data_parallel/test_loss_scale_schedule.py",
        "tests/data_parallel/test_data_parallel_trains_like_one_process.py",
    ],
    "comm/stats.py": ["tests/comm/test_collectives_and_context.py", "tests/data_parallel/test_dp_comm_accounting.py"],
    "comm/handle.py": ["tests/comm/test_collectives_and_context.py"],
    "comm/collectives.py": ["tests/comm/test_collectives_and_context.py"],
    "comm/context.py": ["tests/comm/test_collectives_and_context.py"],
    "parallel/reducer.py": [
        "tests/data_parallel/test_grad_reducer_phases.py",
        "tests/data_parallel/test_data_parallel_trains_like_one_process.py",
        "tests/zero/test_zero12_trains_like_one_process.py",
    ],
    "parallel/compose.py": ["tests/compose/test_parallelize.py"],
    "parallel/zero/stage3.py": [
        "tests/zero/test_zero3_trains_like_one_process.py",
        "tests/zero/test_zero3_memory_traffic_prefetch.py",
    ],
    "parallel/zero/sync_check.py": ["tests/zero/test_zero_sync_check.py", "tests/zero/test_zero3_memory_traffic_prefetch.py"],
    "parallel/zero/pipeline_sharded.py": ["tests/zero/test_zero_pipeline.py", "tests/pipeline/test_pipeline_fp16.py"],
    "parallel/pipeline/step_state.py": [
        "tests/pipeline/test_pipeline_trains_like_one_process.py",
        "tests/pipeline/test_pipeline_fp16.py",
    ],
    "parallel/checkpoint/tp.py": ["tests/checkpoint/test_checkpoint_parallel.py"],
    "parallel/zero/offload.py": ["tests/zero/test_zero_offload.py"],
    "parallel/zero/nvme.py": ["tests/zero/test_zero_offload.py"],
    "parallel/checkpoint/content.py": ["tests/checkpoint/test_checkpoint_resume_reshard_corruption.py"],
    "parallel/pipeline/schedules.py": ["tests/pipeline/test_pipeline_schedules.py"],
    "parallel/pipeline/simulator.py": ["tests/pipeline/test_pipeline_schedules.py"],
    "parallel/pipeline/actions.py": ["tests/pipeline/test_pipeline_schedules.py"],
    "parallel/pipeline/transfers.py": [
        "tests/pipeline/test_pipeline_prepost.py",
        "tests/pipeline/test_pipeline_trains_like_one_process.py",
        "tests/pipeline/test_pipeline_receives_ahead_and_teardown.py",
    ],
    "parallel/zero/sharded_bucket.py": [
        "tests/zero/test_zero12_trains_like_one_process.py",
        "tests/zero/test_zero3_trains_like_one_process.py",
    ],
    "parallel/pipeline/tied.py": ["tests/pipeline/test_pipeline_tied.py"],
    "parallel/tensor/sequence_parallel.py": ["tests/tensor/test_tp_layers_match_dense_layers.py"],
    "shardkit/engine/schedulers.py": ["tests/engine/test_engine_schedulers.py"],
    "shardkit/engine/config_reader.py": ["tests/engine/test_engine_config.py"],
    "shardkit/engine/deepspeed_keys.py": ["tests/engine/test_engine_config.py"],
}
#: ``make mutate`` with no MODULE: these, in sequence.
DEFAULT_MODULES = list(MODULE_TESTS)

_CMP = "ReplaceComparisonOperator_"
_BIN = "ReplaceBinaryOperator_"
#: operators kept (see the module docstring); matched against the full operator name
KEEP = re.compile(
    r"core/("
    rf"{_CMP}(Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Eq_NotEq|NotEq_Eq|Is_IsNot|IsNot_Is|Lt_GtE|Gt_LtE)"
    rf"|{_BIN}(Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|Mod_FloorDiv|Pow_Mul|LShift_RShift|RShift_LShift)"
    r"|ReplaceUnaryOperator_(Delete_USub|Delete_Not|USub_UAdd)"
    r"|AddNot|ReplaceTrueWithFalse|ReplaceFalseWithTrue|ReplaceAndWithOr|ReplaceOrWithAnd"
    r"|ReplaceBreakWithContinue|ReplaceContinueWithBreak|NumberReplacer|ZeroIterationForLoop"
    r"|RemoveDecorator|ExceptionReplacer"
    r")$"
)


def _copy_repo(dest: Path, rev: str | None) -> None:
    """The repository's files (tracked + untracked-not-ignored, or ``rev``'s tree) into ``dest``."""
    if rev is not None:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    listed = (
        subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _package_links(copy: Path) -> None:
    """``<copy>/shardkit`` becomes the whole ``shardkit`` package, as the editable install maps it."""
    for sub in ("kernels", "comm", "parallel"):
        link = copy / "shardkit" / sub
        if not link.exists():
            link.symlink_to(Path("..") / sub)


def _check_import_from_copy(copy: Path, env: dict[str, str]) -> None:
    code = "import shardkit.parallel, shardkit.comm, shardkit.kernels as k; print(k.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    where = out.stdout.strip()
    if out.returncode or not where.startswith(str(copy)):
        raise SystemExit(f"mutate: shardkit does not import from the copy {copy} (got {where!r}):\n{out.stderr}")


def _parse_module(spec: str) -> tuple[str, tuple[int, int] | None]:
    path, _, lines = spec.partition(":")
    if path not in MODULE_TESTS:
        raise SystemExit(f"mutate: no tests registered for {path!r}; known modules: {', '.join(MODULE_TESTS)}")
    if not lines:
        return path, None
    lo, _, hi = lines.partition("-")
    return path, (int(lo), int(hi or lo))


def run_module(
    spec: str,
    *,
    rev: str | None,
    sample: int | None,
    seed: int,
    timeout: float | None,
    keep: bool,
    tests: list[str] | None = None,
) -> dict:
    """Mutate one module in a fresh copy; return the counts and the surviving diffs."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    module, lines = _parse_module(spec)
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-mutate-"))
    copy = tmp / "repo"
    copy.mkdir()
    _copy_repo(copy, rev)
    _package_links(copy)
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    _check_import_from_copy(copy, env)
    tests = tests or MODULE_TESTS[module]
    pytest_cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    print(f"== {spec}: baseline ({' '.join(tests)})", flush=True)
    t0 = time.monotonic()
    base = subprocess.run(pytest_cmd, cwd=copy, env=env, capture_output=True, text=True)
    baseline_s = time.monotonic() - t0
    if base.returncode:
        raise SystemExit(f"mutate: the tests fail before any mutation:\n{base.stdout[-3000:]}")
    per_mutant = timeout or max(30.0, 3 * baseline_s)
    config = tmp / "cr.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{module}"\n'
        f"timeout = {per_mutant}\n"
        "excluded-modules = []\n"
        f"test-command = {shlex.join(pytest_cmd)!r}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    session = tmp / "session.sqlite"
    cr = [sys.executable, "-m", "cosmic_ray.cli"]
    subprocess.run([*cr, "init", str(config), str(session)], cwd=copy, env=env, check=True)
    skipped = {"operator": 0, "lines": 0, "sample": 0}
    with use_db(str(session), WorkDB.Mode.open) as db:
        todo = []
        for item in db.pending_work_items:
            m = item.mutations[0]
            if not KEEP.match(m.operator_name):
                why = "operator"
            elif lines is not None and not (lines[0] <= m.start_pos[0] <= lines[1]):
                why = "lines"
            else:
                todo.append(item)
                continue
            skipped[why] += 1
            db.set_result(item.job_id, WorkResult(output=f"skipped: {why}", worker_outcome=WorkerOutcome.SKIPPED))
        todo.sort(key=lambda it: it.job_id)
        if sample is not None and sample < len(todo):
            keep_ids = {it.job_id for it in random.Random(seed).sample(todo, sample)}
            for it in todo:
                if it.job_id not in keep_ids:
                    skipped["sample"] += 1
                    db.set_result(it.job_id, WorkResult(output="skipped: sample", worker_outcome=WorkerOutcome.SKIPPED))
        n = len(todo) if sample is None else min(sample, len(todo))
    print(
        f"== {spec}: {n} mutants to run (baseline {baseline_s:.1f} s, per-mutant timeout {per_mutant:.0f} s; "
        f"skipped by operator {skipped['operator']}, by lines {skipped['lines']}, by sample {skipped['sample']})",
        flush=True,
    )
    subprocess.run([*cr, "exec", str(config), str(session)], cwd=copy, env=env, check=True)
    killed = survived = timeouts = incompetent = 0
    survivors: list[str] = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in sorted(db.completed_work_items, key=lambda p: p[0].mutations[0].start_pos):
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.worker_outcome != WorkerOutcome.NORMAL:
                incompetent += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                survived += 1
                m = item.mutations[0]
                survivors.append(f"--- survivor {m.operator_name} at {module}:{m.start_pos[0]}\n{result.diff}")
            else:
                killed += 1
                timeouts += result.output == "timeout"
    for s in survivors:
        print(s)
    total = killed + survived
    print(
        f"== {spec}: killed {killed}/{total} ({timeouts} by timeout), survived {survived}, "
        f"incompetent {incompetent}" + (f" [rev {rev}]" if rev else ""),
        flush=True,
    )
    if keep:
        print(f"== session kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return dict(module=spec, killed=killed, total=total, survivors=survivors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="path[:first-last line]; default: " + " ".join(DEFAULT_MODULES))
    parser.add_argument("--rev", default=None, help="mutate this commit's tree (default: the working tree's files)")
    parser.add_argument("--sample", type=int, default=None, help="run a random subset of this many mutants")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per mutant (default 3x baseline, >= 30)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy and session")
    parser.add_argument("--tests", nargs="+", default=None, help="test files to run instead of the module's own")
    args = parser.parse_args(argv)
    results = [
        run_module(
            m,
            rev=args.rev,
            sample=args.sample,
            seed=args.seed,
            timeout=args.timeout,
            keep=args.keep,
            tests=args.tests,
        )
        for m in (args.modules or DEFAULT_MODULES)
    ]
    print("== summary")
    for r in results:
        print(f"{r['module']:40s} killed {r['killed']}/{r['total']}, survivors {len(r['survivors'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
