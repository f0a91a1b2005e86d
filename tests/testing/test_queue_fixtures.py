"""The suite's own queue fixtures (``tests/conftest.py``): every queue ``make_queue``
made is terminated when the test ends, on the test's own loop, even when it fails."""

from __future__ import annotations

import asyncio

import pytest

import envq
from tests.conftest import _closing
from tests.support import QueueMaker, Trace

QS = envq.QueueState


def test_made_queues_are_terminated_when_the_test_ends() -> None:
    maker = QueueMaker()
    made: list[envq.Queue] = []
    trace = Trace()

    async def body() -> None:
        q = maker(trace, name="held", workers=1)
        made.append(q)
        q.start()
        q.send(trace.env("long", 100))
        await asyncio.sleep(1)
        assert q.state is QS.RUNNING

    _closing(body, maker, real=False)()
    [q] = made
    assert q.name == "held"
    assert q.state is QS.TERMINATED
    # The attempt in flight was cancelled by the terminate, at the test's end (t=1).
    assert trace.cancels == [("long", 1.0)]
    assert trace.queue_states()[-1] is QS.TERMINATED


def test_made_queues_are_terminated_when_the_test_fails() -> None:
    maker = QueueMaker()
    made: list[envq.Queue] = []

    async def body() -> None:
        q = maker()
        made.append(q)
        q.start()
        raise RuntimeError("the test failed")

    with pytest.raises(RuntimeError, match="the test failed"):
        _closing(body, maker, real=True)()
    assert made[0].state is QS.TERMINATED


async def test_the_queue_fixture_is_a_fresh_queue(queue: envq.Queue) -> None:
    assert queue.name == "test"
    assert queue.state is QS.INIT
    queue.start()
    assert queue.state is QS.RUNNING


async def test_make_queue_makes_queues_watched_by_the_watchers(make_queue: QueueMaker) -> None:
    first, second = Trace(), Trace()
    q = make_queue(first, second, name="watched", capacity=3)
    q.start()
    assert q.name == "watched"
    assert first.queue_states() == second.queue_states() == [QS.RUNNING]
    assert make_queue.made == [q]
