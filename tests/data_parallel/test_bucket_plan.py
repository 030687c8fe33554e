"""``plan_buckets`` against hand-worked plans, and ``BucketedGradReducer`` without processes.

Both are pure enough to test in one process: the planner is a function of byte counts and keys,
and the reducer only calls the ``launch``/``finish`` callbacks it is given, so the callbacks here
record what happens instead of communicating. The DataParallel tests cannot catch a wrong plan
(any plan gives the same averaged gradients), so the plans are checked here, by hand.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.parallel.buckets import FIRST_BUCKET_BYTES, BucketedGradReducer, GradBucket, plan_buckets


# ---- plan_buckets: hand-worked plans ----------------------------------------------------------
# Parameters are visited last to first; a bucket closes when the next parameter would push it
# past its cap (equal to the cap still fits) or has another key.
@pytest.mark.parametrize(
    "nbytes, keys, cap, first_cap, expected",
    [
        # first bucket capped at 250: 100+100 fits, +100 = 300 does not; later buckets use 1000
        ([100] * 5, "aaaaa", 1000, 250, [[4, 3], [2, 1, 0]]),
        # first_cap None: every bucket uses cap_bytes (300 = three params exactly)
        ([100] * 4, "aaaa", 300, None, [[3, 2, 1], [0]]),
        # exact fit: 100 + 100 == 200 stays in one bucket
        ([100] * 4, "aaaa", 200, None, [[3, 2], [1, 0]]),
        # closing on time: 100 + 150 = 250 > 200, so param 1 opens a new bucket (not one late)
        ([100, 150, 100], "aaa", 200, None, [[2], [1], [0]]),
        ([50, 100, 100], "aaa", 200, None, [[2, 1], [0]]),
        # one byte over the cap closes, in the first bucket and after a reset
        ([101, 100], "aa", 200, None, [[1], [0]]),
        ([100, 100, 101, 100], "aaaa", 200, None, [[3], [2], [1, 0]]),
        # a parameter larger than the cap gets a bucket of its own, and the next one starts fresh
        ([100, 5000, 100], "aaa", 1000, None, [[2], [1], [0]]),
        ([5000], "a", 1000, None, [[0]]),
        # oversize as the very first visit, with a first cap
        ([100, 100, 5000], "aaa", 1000, 300, [[2], [1, 0]]),
        # key changes close a bucket even with room left; keys never mix
        ([100] * 4, "aaba", 10_000, None, [[3], [2], [1, 0]]),
        ([100] * 4, "abab", 10_000, None, [[3], [2], [1], [0]]),
        # the first cap applies to the first bucket only, even when it is a key change that
        # closes it: bucket 1 then has the full 300
        ([100, 100, 100, 100], "aaab", 300, 100, [[3], [2, 1, 0]]),
        # a first cap above cap_bytes is honoured as given (DataParallel passes min(first, cap))
        ([100] * 6, "aaaaaa", 200, 1000, [[5, 4, 3, 2, 1, 0]]),
        ([], "", 100, None, []),
    ],
)
def test_plan_buckets_hand_worked(nbytes, keys, cap, first_cap, expected) -> None:
    assert plan_buckets(nbytes, list(keys), cap_bytes=cap, first_cap_bytes=first_cap) == expected


def test_plan_buckets_default_first_cap_is_one_mib() -> None:
    mib = 1 << 20
    assert FIRST_BUCKET_BYTES == mib  # torch DDP's first bucket
    # 25 MiB buckets: the first closes after 1 MiB, the rest hold 25 MiB each
    plan = plan_buckets([mib // 2] * 6, ["f32"] * 6, cap_bytes=25 * mib)
    assert plan == [[5, 4], [3, 2, 1, 0]]


def test_plan_buckets_docstring_example() -> None:
    assert plan_buckets([400, 400, 400], ["f32"] * 3, cap_bytes=800, first_cap_bytes=None) == [[2, 1], [0]]


@pytest.mark.parametrize("cap", [0, -1])
def test_plan_buckets_rejects_bad_cap(cap: int) -> None:
    with pytest.raises(ValueError, match="cap_bytes"):
        plan_buckets([4], ["a"], cap_bytes=cap)


def test_plan_buckets_caps_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        plan_buckets([4], ["a"], 8)  # type: ignore[misc]


def test_plan_buckets_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="nbytes and keys"):
        plan_buckets([4, 4], ["a"], cap_bytes=8)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
    key_seed=st.lists(st.integers(min_value=0, max_value=1), min_size=12, max_size=12),
    cap=st.integers(min_value=1, max_value=600),
    first_cap=st.one_of(st.none(), st.integers(min_value=1, max_value=600)),
)
def test_plan_buckets_is_the_greedy_plan(sizes, key_seed, cap, first_cap) -> None:
    """The properties that define the greedy plan, checked on any input: the buckets list every
    index once, last to first; one key per bucket; no bucket over its cap unless it is a single
    parameter; and every bucket was closed only because the next parameter had another key or
    did not fit (so a bucket is never closed early nor late)."""
    keys = key_seed[: len(sizes)]
    plan = plan_buckets(sizes, keys, cap_bytes=cap, first_cap_bytes=first_cap)
    assert [i for b in plan for i in b] == list(reversed(range(len(sizes))))
    for n, bucket in enumerate(plan):
        limit = first_cap if (n == 0 and first_cap) else cap
        assert bucket, "empty bucket"
        assert len({keys[i] for i in bucket}) == 1
        total = sum(sizes[i] for i in bucket)
        assert len(bucket) == 1 or total <= limit, (n, bucket, total, limit)
        if n + 1 < len(plan):
            nxt = plan[n + 1][0]
            assert keys[nxt] != keys[bucket[0]] or total + sizes[nxt] > limit, (n, bucket, nxt)


# ---- BucketedGradReducer with recording callbacks ------------------------------------------------
def _chain() -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    """Three scalar-ish params used as ``a * (b * (c * x))``: backward produces a's grad first,
    then b's, then c's — the reverse of the launch order of buckets ``[[c], [b], [a]]``."""
    a, b, c = (torch.nn.Parameter(torch.full((2,), v)) for v in (2.0, 3.0, 5.0))
    return [a, b, c], torch.ones(2)


def _buckets(groups: list[list[torch.nn.Parameter]]) -> list[GradBucket]:
    out = []
    for i, ps in enumerate(groups):
        offsets = [sum(p.numel() for p in ps[:j]) for j in range(len(ps))]
        out.append(GradBucket(index=i, params=ps, offsets=offsets, buffer=torch.zeros(sum(p.numel() for p in ps))))
    return out


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def launch(self, bucket: GradBucket) -> str:
        # which grads exist when the bucket launches: all of its own must
        self.events.append(("launch", bucket.index, [p.grad is not None for p in bucket.params]))
        return f"work{bucket.index}"

    def finish(self, bucket: GradBucket, work: str) -> None:
        self.events.append(("finish", bucket.index, work, bucket.used))


def test_reducer_launches_in_bucket_order_when_grads_arrive_reversed() -> None:
    (a, b, c), x = _chain()
    rec = _Recorder()
    seen: list[str] = []
    for name, p in zip("abc", (a, b, c)):
        p.register_post_accumulate_grad_hook(lambda _p, n=name: seen.append(n))
    reducer = BucketedGradReducer(_buckets([[c], [b], [a]]), launch=rec.launch, finish=rec.finish)
    (a * (b * (c * x))).sum().backward()
    assert seen == ["a", "b", "c"]  # grads arrive in the reverse of the launch order
    assert rec.events == [
        ("launch", 0, [True]),
        ("launch", 1, [True]),
        ("launch", 2, [True]),
        ("finish", 0, "work0", None),
        ("finish", 1, "work1", None),
        ("finish", 2, "work2", None),
    ]
    assert not reducer.pending
    # the next backward starts from a clean slate: the same sequence again
    rec.events.clear()
    (a * (b * (c * x))).sum().backward()
    assert [e[:2] for e in rec.events] == [
        ("launch", 0),
        ("launch", 1),
        ("launch", 2),
        ("finish", 0),
        ("finish", 1),
        ("finish", 2),
    ]


def test_reducer_launches_a_bucket_as_soon_as_its_grads_are_ready() -> None:
    """With grads arriving in launch order, bucket 0 launches before bucket 1's grads exist
    (overlap), not at the end of backward."""
    (a, b, c), x = _chain()
    rec = _Recorder()
    BucketedGradReducer(_buckets([[a], [b, c]]), launch=rec.launch, finish=rec.finish)
    (a * (b * (c * x))).sum().backward()
    assert rec.events[0] == ("launch", 0, [True])
    assert rec.events[1] == ("launch", 1, [True, True])
    assert [e[0] for e in rec.events] == ["launch", "launch", "finish", "finish"]


def test_reducer_disabled_launches_nothing_and_next_backward_launches_all() -> None:
    (a, b, c), x = _chain()
    rec = _Recorder()
    reducer = BucketedGradReducer(_buckets([[c], [b, a]]), launch=rec.launch, finish=rec.finish)
    with reducer.disabled():
        (a * (b * (c * x))).sum().backward()
        assert not reducer.enabled
    assert reducer.enabled
    assert rec.events == [] and not reducer.pending
    (a * (b * (c * x))).sum().backward()
    assert [e[:2] for e in rec.events] == [("launch", 0), ("launch", 1), ("finish", 0), ("finish", 1)]


def test_reducer_unused_params_launch_at_end_in_order() -> None:
    """A bucket whose param got no grad is launched by the end-of-backward callback, in order,
    after the buckets before it, and every bucket is finished in order after the last launch."""
    (a, b, c), x = _chain()
    unused = torch.nn.Parameter(torch.zeros(3))
    rec = _Recorder()
    BucketedGradReducer(_buckets([[unused, c], [b], [a]]), launch=rec.launch, finish=rec.finish)
    (a * (b * (c * x))).sum().backward()
    assert rec.events[:3] == [("launch", 0, [False, True]), ("launch", 1, [True]), ("launch", 2, [True])]
    assert [e[:3] for e in rec.events[3:]] == [("finish", 0, "work0"), ("finish", 1, "work1"), ("finish", 2, "work2")]


def test_reducer_reset_after_a_failed_backward() -> None:
    (a, b, c), x = _chain()
    rec = _Recorder()

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    reducer = BucketedGradReducer(_buckets([[a], [b], [c]]), launch=rec.launch, finish=rec.finish)
    with pytest.raises(RuntimeError, match="boom"):
        # a's grad arrives (bucket 0 launches), then the Function between b and c raises
        (a * Boom.apply(b * (c * x))).sum().backward()
    assert reducer.pending
    assert [e[:2] for e in rec.events] == [("launch", 0)]
    abandoned = reducer.reset()
    assert [(bk.index, w) for bk, w in abandoned] == [(0, "work0")]
    assert not reducer.pending
    assert all(not bk.ready for bk in reducer.buckets)
    rec.events.clear()
    for p in (a, b, c):
        p.grad = None
    (a * (b * (c * x))).sum().backward()
    assert [e[:2] for e in rec.events] == [
        ("launch", 0),
        ("launch", 1),
        ("launch", 2),
        ("finish", 0),
        ("finish", 1),
        ("finish", 2),
    ]


def test_reducer_on_ready_sees_each_param_once_before_its_launch() -> None:
    (a, b, c), x = _chain()
    rec = _Recorder()

    def on_ready(bucket: GradBucket, j: int) -> None:
        rec.events.append(("ready", bucket.index, j))

    BucketedGradReducer(_buckets([[c], [b, a]]), launch=rec.launch, finish=rec.finish, on_ready=on_ready)
    (a * (b * (c * x))).sum().backward()
    assert [e[:3] for e in rec.events[:5]] == [
        ("ready", 1, 1),  # a
        ("ready", 1, 0),  # b: bucket 1 complete but waits for bucket 0
        ("ready", 0, 0),  # c
        ("launch", 0, [True]),
        ("launch", 1, [True, True]),
    ]


def test_reducer_remove_stops_it() -> None:
    (a, b, c), x = _chain()
    rec = _Recorder()
    reducer = BucketedGradReducer(_buckets([[c], [b], [a]]), launch=rec.launch, finish=rec.finish)
    reducer.remove()
    (a * (b * (c * x))).sum().backward()
    assert rec.events == []


def test_grad_bucket_grads_or_zeros_and_nbytes() -> None:
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((3,), 7.0)
    bucket = GradBucket(index=0, params=[p, q], offsets=[0, 3], buffer=torch.zeros(5, dtype=torch.float64))
    assert bucket.nbytes == 5 * 8
    got = bucket.grads_or_zeros()
    assert got[0] is p.grad
    assert torch.equal(got[1], torch.zeros(2, dtype=torch.float64))
    # identity semantics: buckets key dicts/sets (strategies map bucket -> work/shard), and two
    # buckets with equal fields are still different buffers
    twin = GradBucket(index=0, params=[p, q], offsets=[0, 3], buffer=bucket.buffer)
    assert bucket != twin and len({bucket, twin}) == 2
