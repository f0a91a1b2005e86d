"""A schedule that cannot place an envelope's first run is the sender's error: send()
stays all or nothing (nothing admitted, nothing stuck in NEW, statistics and
terminate() keep working); a buffered envelope's schedule is tried at send, and a
start() whose schedule fails then moves nothing."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest

import envq
from tests.support import assert_names, noop

S = envq.EnvState
Q = envq.QueueState


class _Answers:
    """A schedule of one's own whose first run answers (or raises) what it is given."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def first_run(self, at: float, offset: float) -> float:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        return ended + 60


def _far_cron() -> envq.Envelope:
    pytest.importorskip("cronsim")
    return envq.Envelope(
        invoke=noop,
        id="far",
        schedule=envq.Cron("0 0 1 1 *"),
        not_before=dt.datetime(9999, 6, 1, tzinfo=dt.UTC),
    )


BAD = {
    "raises": (
        lambda: envq.Envelope(invoke=noop, id="bad", schedule=_Answers(KeyError("no"))),
        envq.BadEnvelope,
        ValueError,
    ),
    "str": (
        lambda: envq.Envelope(invoke=noop, id="bad", schedule=_Answers("soon")),
        envq.BadEnvelopeType,
        TypeError,
    ),
    "none": (
        lambda: envq.Envelope(invoke=noop, id="bad", schedule=_Answers(None)),
        envq.BadEnvelopeType,
        TypeError,
    ),
    "nan": (
        lambda: envq.Envelope(invoke=noop, id="bad", schedule=_Answers(float("nan"))),
        envq.BadEnvelope,
        ValueError,
    ),
    "year-9999": (_far_cron, envq.BadEnvelope, ValueError),
}


def _healthy(q: envq.Queue, used: int) -> None:
    """Capacity agrees with the statistics, which can be read (a NEW envelope made
    ``statistics()`` raise ``KeyError``)."""
    stats = q.statistics()
    assert q.capacity_used == used
    assert stats.capacity_used == used
    assert stats.by_state.get(S.NEW, 0) == 0


@pytest.mark.parametrize("case", sorted(BAD))
async def test_send_of_a_batch_with_an_unschedulable_envelope_admits_nothing(case: str) -> None:
    make, error, family = BAD[case]
    bad = make()
    seen: list[envq.Event] = []
    q = envq.Queue("q", capacity=5)
    q.subscribe(seen.append)
    q.start()
    good = envq.Envelope(invoke=noop, id="good")
    with pytest.raises(error) as info:
        q.send(good, bad)
    assert isinstance(info.value, family)
    assert_names(info.value, "'bad'" if case != "year-9999" else "'far'", "first run")
    assert len(str(info.value)) < 1000
    assert q.state_of(good) is None
    assert q.state_of(bad) is None
    _healthy(q, 0)
    assert q.statistics().rejections[envq.Rejection.INVALID] == 1
    await asyncio.sleep(1)
    assert [ev for ev in seen if ev.envelope is not None] == []
    q.send(good)  # the queue goes on
    await asyncio.sleep(1)
    assert q.statistics().by_state[S.SUCCEEDED] == 1
    assert await q.terminate() == []
    assert q.state is Q.TERMINATED


@pytest.mark.parametrize("case", sorted(BAD))
async def test_a_buffered_send_tries_the_schedule(case: str) -> None:
    """Before start() the first delay is worked out at start(); the schedule is tried
    once at send, so a schedule that can never start is refused there."""
    make, error, _family = BAD[case]
    q = envq.Queue("q")
    good = envq.Envelope(invoke=noop, id="good")
    with pytest.raises(error):
        q.send(good, make())
    _healthy(q, 0)
    assert await q.terminate() == []


class _FailsLater:
    """A schedule that works at send and fails at start()."""

    def __init__(self) -> None:
        self.calls = 0

    def first_run(self, at: float, offset: float) -> float:
        self.calls += 1
        if self.calls > 1:
            raise OverflowError("the calendar ran out")
        return at

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        return ended + 60


async def test_a_start_whose_schedule_fails_moves_nothing() -> None:
    """A buffered envelope whose schedule fails at start(): start() raises naming it,
    the queue stays INIT with everything BUFFERED, and terminate() hands all back."""
    q = envq.Queue("q")
    seen: list[envq.Event] = []
    q.subscribe(seen.append)
    good = envq.Envelope(invoke=noop, id="good")
    late = envq.Envelope(invoke=noop, id="late", schedule=_FailsLater())
    q.send(good, late)
    seen.clear()
    with pytest.raises(envq.BadEnvelope) as info:
        q.start()
    assert_names(info.value, "'late'", "start()", "OverflowError")
    assert q.state is Q.INIT
    assert (q.state_of(good), q.state_of(late)) == (S.BUFFERED, S.BUFFERED)
    assert seen == []
    _healthy(q, 2)
    assert await q.terminate() == [good, late]


async def test_a_restart_whose_calendar_fails_moves_nothing() -> None:
    """After a stop a parked calendar envelope's next fire is worked out again at
    start(); a schedule failing then leaves the queue STOPPED, terminate() works."""
    q = envq.Queue("q")
    late = envq.Envelope(invoke=noop, id="late", schedule=_FailsLater())
    q.start()
    q.send(late)
    await asyncio.sleep(1)
    await q.stop()
    assert q.state_of(late) is S.PARKED
    with pytest.raises(envq.BadEnvelope, match="'late'"):
        q.start()
    assert q.state is Q.STOPPED
    _healthy(q, 1)
    assert await q.terminate() == [late]
