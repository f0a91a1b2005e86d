"""One scenario, written once against :class:`envq.QueueProtocol`, run on both stores:
the in-process :class:`envq.Queue` and the shared :class:`envq.postgres.PgQueue`.

Every call the two share is awaited the same way and answers the same: send's count
(a dedup is not admitted), send_wait's, statistics, an operator's cancel, retry and
discard, stop's report (the parked envelopes, complete), wait_stopped's, a restart and
terminate's hand-back; the events of the envelopes reach a listener on either.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pg_jobs
import pytest

import envq
from envq import EnvState
from envq.postgres import PgQueue

pytestmark = pytest.mark.real_clock

HOUR = 3600.0


async def _until(q: envq.QueueProtocol, done: Callable[[envq.Statistics], bool]) -> None:
    """Poll the queue's statistics (real clock) until ``done`` says so; fail after 30 s."""
    async with asyncio.timeout(30):
        while not done(await q.statistics()):  # noqa: ASYNC110 - the database's state
            await asyncio.sleep(0.05)


def _ids(envelopes: tuple[envq.Envelope, ...] | list[envq.Envelope]) -> list[object]:
    return [env.id for env in envelopes]


async def scenario(q: envq.QueueProtocol) -> None:
    """The scenario: only calls of the Protocol, awaited."""
    events: list[envq.Event] = []
    unsubscribe = q.subscribe(events.append)
    await q.start()
    later = envq.Envelope(invoke=pg_jobs.noop, id="later", delay=HOUR)
    # A batch naming an id twice admits it once; the same id again is a dedup.
    assert await q.send(later, envq.Envelope(invoke=pg_jobs.noop, id="later", delay=HOUR)) == 1
    assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id="later", delay=HOUR)) == 0
    assert await q.send_wait(envq.Envelope(invoke=pg_jobs.noop, id="ok"), timeout=10) == 1
    assert await q.send(envq.Envelope(invoke=pg_jobs.fail, id="bad")) == 1
    await _until(
        q,
        lambda s: s.by_state.get(EnvState.SUCCEEDED) == 1 and s.by_state.get(EnvState.FAILED) == 1,
    )
    stats = await q.statistics()
    assert stats.state is envq.QueueState.RUNNING
    assert stats.capacity_used == 1  # "later", DELAYED
    assert stats.capacity_limit == 10
    # An operator's moves: cancel the delayed one, send the failed one back, forget it.
    assert await q.cancel("later") == 1
    assert await q.cancel("later") == 0  # not live any more
    assert await q.retry("bad") == 1
    await _until(q, lambda s: s.by_state.get(EnvState.FAILED) == 2 or s.capacity_used == 0)
    await _until(q, lambda s: s.capacity_used == 0)
    assert await q.discard("bad") == 1
    assert await q.retry("bad") == 0  # discarded: nothing to send back
    # A stop in STOP mode parks what waits; its report says so, as wait_stopped's.
    assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id="parked", delay=HOUR)) == 1
    report = await q.stop(envq.StopMode.STOP)
    assert isinstance(report, envq.StopReport)
    assert report.complete
    assert _ids(report.parked) == ["parked"]
    assert _ids((await q.wait_stopped()).parked) == ["parked"]
    assert (await q.statistics()).state is envq.QueueState.STOPPED
    # Restarted, then terminated: the parked envelope is handed back, once.
    await q.start()
    handed = await q.terminate()
    assert _ids(handed) == ["parked"]
    assert (await q.statistics()).state is envq.QueueState.TERMINATED
    unsubscribe()
    moves = {(ev.envelope.id, ev.to_state) for ev in events if ev.envelope is not None}
    assert ("ok", EnvState.SUCCEEDED) in moves
    assert ("bad", EnvState.FAILED) in moves
    assert ("later", EnvState.STOPPED) in moves


@asynccontextmanager
async def _memory() -> AsyncIterator[envq.QueueProtocol]:
    async with envq.Queue("one-api", capacity=10, workers=2) as q:
        yield q


@asynccontextmanager
async def _postgres(dsn: str) -> AsyncIterator[envq.QueueProtocol]:
    q = PgQueue(dsn, f"one-api-{uuid.uuid4().hex[:8]}", capacity=10, workers=2, poll=0.05)
    await q.install()
    async with q:
        yield q


async def test_the_scenario_in_one_process() -> None:
    async with _memory() as q:
        assert isinstance(q, envq.QueueProtocol)
        await scenario(q)


async def test_the_same_scenario_on_postgresql(pg_dsn: str) -> None:
    async with _postgres(pg_dsn) as q:
        assert isinstance(q, envq.QueueProtocol)
        await scenario(q)


async def test_the_in_process_answers_are_usable_without_await() -> None:
    """The in-process queue's answers may be awaited and need not be: a program that
    never awaits them works as before."""
    q = envq.Queue("plain-calls", capacity=10)
    assert not q.start()  # Done: falsy, like the None it replaces
    admitted = q.send(envq.Envelope(invoke=pg_jobs.noop, id="x", delay=HOUR))
    assert admitted == 1
    assert isinstance(admitted, int)
    assert q.send(envq.Envelope(invoke=pg_jobs.noop, id="x", delay=HOUR)) == 0
    assert repr(admitted) == "1"
    stats = q.statistics()
    assert stats is await stats  # the snapshot, awaited or not
    assert stats.capacity_used == 1
    assert q.cancel("x") == 1
    assert await q.cancel("x") == 0
    await q.terminate()


async def test_send_wait_times_out_the_same_way_on_both(pg_dsn: str) -> None:
    """No room within the timeout: SendTimeout, a CapacityExceeded and a TimeoutError."""
    async with _postgres(pg_dsn) as shared, envq.Queue("full", capacity=1) as local:
        for q in (local, shared):
            await q.send(envq.Envelope(invoke=pg_jobs.noop, delay=HOUR))
        await shared.send(*(envq.Envelope(invoke=pg_jobs.noop, delay=HOUR) for _ in range(9)))
        for q in (local, shared):
            with pytest.raises(envq.SendTimeout) as caught:
                await q.send_wait(envq.Envelope(invoke=pg_jobs.noop), timeout=0.2)
            assert isinstance(caught.value, envq.CapacityExceeded)
            assert isinstance(caught.value, TimeoutError)
        await shared.terminate()
