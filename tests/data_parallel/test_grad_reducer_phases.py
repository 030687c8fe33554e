"""``GradReducer``'s named phases without processes: training states, profiler labels, order.

The launch/finish callbacks record what the reducer asks for; a strategy's data path (all-reduce,
reduce-scatter) is tested in the DataParallel and ZeRO suites.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from shardkit.parallel.reducer import GradBucket, GradReducer, TrainingState


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.full((2,), v)) for v in (2.0, 3.0, 5.0)]


def _buckets(groups: list[list[torch.nn.Parameter]]) -> list[GradBucket]:
    return [
        GradBucket(index=i, params=ps, offsets=[0] * len(ps), buffer=torch.zeros(sum(p.numel() for p in ps)))
        for i, ps in enumerate(groups)
    ]


def _loss(params: list[torch.nn.Parameter]) -> torch.Tensor:
    a, b, c = params
    return (a * (b * (c * torch.ones(2)))).sum()


def test_training_states_follow_the_phases() -> None:
    a, b, c = params = _params()
    seen: list[tuple[str, TrainingState]] = []
    reducer: GradReducer

    def launch(bucket: GradBucket) -> int:
        seen.append((f"launch{bucket.index}", reducer.state))
        return bucket.index

    def finish(bucket: GradBucket, work: int) -> None:
        seen.append((f"finish{bucket.index}", reducer.state))

    def on_ready(bucket: GradBucket, j: int) -> None:
        seen.append(("ready", reducer.state))

    reducer = GradReducer(_buckets([[c], [b], [a]]), launch=launch, finish=finish, on_ready=on_ready)
    assert reducer.state is TrainingState.IDLE
    assert reducer.pre_forward() == []
    assert reducer.state is TrainingState.FORWARD
    loss = _loss(params)
    reducer.post_forward()
    assert reducer.state is TrainingState.IDLE
    loss.backward()
    # the first grad (a's) arrives in PRE_BACKWARD; launches happen in POST_BACKWARD, in order
    assert seen[0] == ("ready", TrainingState.PRE_BACKWARD)
    launches = [s for s in seen if s[0].startswith("launch")]
    assert [n for n, _ in launches] == ["launch0", "launch1", "launch2"]
    assert all(state is TrainingState.POST_BACKWARD for _, state in launches)
    assert [n for n, _ in seen if n.startswith("finish")] == ["finish0", "finish1", "finish2"]
    assert reducer.state is TrainingState.IDLE and not reducer.pending


def test_every_phase_runs_under_its_profiler_label() -> None:
    params = _params()
    reducer = GradReducer(_buckets([[params[2]], [params[1], params[0]]]), launch=lambda b: None, finish=lambda b, w: None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        reducer.pre_forward()
        loss = _loss(params)
        reducer.post_forward()
        loss.backward()
    names = [e.name for e in prof.events()]
    for phase, count in [
        ("pre_forward", 1),
        ("post_forward", 1),
        ("pre_backward", 1),
        ("post_backward", 2),
        ("finalize_backward", 1),
    ]:
        assert names.count(f"shardkit::{phase}") == count, (phase, sorted(set(names)))


def test_post_backward_refuses_a_bucket_out_of_launch_order() -> None:
    params = _params()
    buckets = _buckets([[params[2]], [params[1]], [params[0]]])
    reducer = GradReducer(buckets, launch=lambda b: None, finish=lambda b, w: None)
    with pytest.raises(RuntimeError, match="out of order"):
        reducer.post_backward(buckets[1])  # see [Note: bucket launch order]


def test_pre_forward_discards_a_backward_that_raised() -> None:
    a, b, c = params = _params()
    launched: list[int] = []
    fail = [True]

    def launch(bucket: GradBucket) -> str:
        launched.append(bucket.index)
        if bucket.index == 1 and fail[0]:
            raise RuntimeError("boom in backward")
        return f"work{bucket.index}"

    reducer = GradReducer(_buckets([[c], [b], [a]]), launch=launch, finish=lambda bk, w: None)
    with pytest.raises(RuntimeError, match="boom"):
        _loss(params).backward()
    assert reducer.pending  # outside backward: the last one raised
    abandoned = reducer.pre_forward()
    assert [(bk.index, w) for bk, w in abandoned] == [(0, "work0")]  # launched, never waited
    assert not reducer.pending and reducer.state is TrainingState.FORWARD
    reducer.post_forward()
    for p in params:
        p.grad = None
    launched.clear()
    fail[0] = False  # the next backward reduces normally
    _loss(params).backward()
    assert launched == [0, 1, 2] and not reducer.pending
