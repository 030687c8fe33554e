"""The vocabulary of pipeline schedules: action kinds, actions, per-rank lists, timed actions.

Pure Python. The schedules themselves and their Notes are in
:mod:`~shardkit.parallel.pipeline.schedules`; the simulator in
:mod:`~shardkit.parallel.pipeline.simulator`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["COMPUTE", "RECVS", "SENDS", "Action", "Key", "Kind", "Schedule", "TimedAction", "receive_for"]


class Kind(str, enum.Enum):
    """What an :class:`Action` does."""

    F = "F"  # forward of one stage on one micro-batch
    B = "B"  # full backward (input and weight gradients)
    BI = "BI"  # backward, input gradient only (zero bubble "B")
    BW = "BW"  # backward, weight gradient only (zero bubble "W")
    SEND_F = "SEND_F"  # send stage output to the next stage's rank
    RECV_F = "RECV_F"  # receive stage input from the previous stage's rank
    SEND_B = "SEND_B"  # send gradient of stage input to the previous stage's rank
    RECV_B = "RECV_B"  # receive gradient of stage output from the next stage's rank

    def __str__(self) -> str:
        return self.value


COMPUTE = (Kind.F, Kind.B, Kind.BI, Kind.BW)
SENDS = (Kind.SEND_F, Kind.SEND_B)
RECVS = (Kind.RECV_F, Kind.RECV_B)
Key = tuple[Kind, int, int]  # (kind, stage, micro-batch): an action's identity


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    Attributes:
        kind: the :class:`Kind`.
        stage: global stage index in ``[0, p * v)`` (see [Note: stages, chunks and ranks]).
        mb: micro-batch index in ``[0, m)``.
    """

    kind: Kind
    stage: int
    mb: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists for one step.

    Attributes:
        name: schedule name (a key of :data:`SCHEDULES`).
        num_ranks: ``p``, pp group size.
        virtual_stages: ``v``, stages per rank.
        microbatches: ``m``.
        actions: ``actions[r]`` is rank ``r``'s ordered tuple of :class:`Action`.
    """

    name: str
    num_ranks: int
    virtual_stages: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        """``S = p * v``."""
        return self.num_ranks * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        """The pp rank holding ``stage`` (``stage % p``)."""
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by ``rank``, in increasing order."""
        return list(range(rank, self.num_stages, self.num_ranks))

    def receive_for(self, a: Action) -> Action | None:
        """The receive that compute ``a`` consumes (waits for right before it runs), or None."""
        return receive_for(a, self.num_ranks, self.num_stages)


def receive_for(a: Action, p: int, num_stages: int) -> Action | None:
    """The receive compute ``a`` consumes, or None (an input from this rank or none: first
    stage's F, last stage's B, BW); see [Note: posting receives ahead] in
    :mod:`~shardkit.parallel.pipeline.schedules`.

    Example:
        >>> receive_for(Action(Kind.B, 0, 3), p=2, num_stages=2)
        RECV_B0.3
    """
    r = a.stage % p
    s, i = a.stage, a.mb
    if a.kind is Kind.F and s > 0 and (s - 1) % p != r:
        return Action(Kind.RECV_F, s, i)
    if a.kind in (Kind.B, Kind.BI) and s < num_stages - 1 and (s + 1) % p != r:
        return Action(Kind.RECV_B, s, i)
    return None


@dataclass(frozen=True)
class TimedAction:
    """An action with its start and end time (simulated units, or seconds when recorded).

    Attributes:
        action: the :class:`Action`.
        start, end: when it started and finished; a receive, from its posting to the end of
            its wait (see [Note: posting receives ahead] in
            :mod:`~shardkit.parallel.pipeline.schedules`), a send from its posting.
        wait: time spent blocked on P2P inside ``[start, end]``: for a receive, the time the
            compute consuming it waited for the data; 0 for everything else.
    """

    action: Action
    start: float
    end: float
    wait: float = 0.0
