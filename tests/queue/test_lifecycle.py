"""docs/lifecycle.md: the queue lifecycle table, construction, restart, the pre-start buffer,
queue events and the async context manager."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import pytest

import envq
from envq._machine import TERMINAL_STATES
from envq.testing import VirtualTimeLoop, advance
from tests.support import Trace, now, settle

QS = envq.QueueState
ES = envq.EnvState
TERMINAL = TERMINAL_STATES


def snapshot(q: envq.Queue, trace: Trace) -> tuple[object, ...]:
    return (q.state, q.capacity_used, len(trace.events), len(trace.starts), len(trace.cancels))


async def in_state(
    state: envq.QueueState, trace: Trace, **queue_fields: Any
) -> tuple[envq.Queue, list[envq.Envelope]]:
    """A queue brought to ``state``; in STOPPING one attempt is in flight until t=10."""
    q = envq.Queue("lifecycle", **queue_fields)
    trace.watch(q)
    if state is QS.INIT:
        env = trace.env("buffered")
        q.send(env)
        return q, [env]
    q.start()
    if state is QS.RUNNING:
        return q, []
    long = trace.env("long", 10)
    q.send(long)
    await settle()
    if state is QS.STOPPING:
        await q.stop(mode=envq.StopMode.DRAIN, wait=False)
        assert q.state is QS.STOPPING
        return q, [long]
    await q.stop(mode=envq.StopMode.DRAIN)
    if state is QS.STOPPED:
        return q, [long]
    assert await q.terminate() == []
    return q, [long]


class TestConstruction:
    @pytest.mark.parametrize("name", ["", " ", "bad\nname", "tab\there", " lead", "trail "])
    def test_bad_name_is_rejected(self, name: str) -> None:
        """An empty name, a control character or surrounding whitespace raises ValueError."""
        with pytest.raises(ValueError, match="name"):
            envq.Queue(name)

    @pytest.mark.parametrize(
        "name", ["emails", "a:b_1", "Q", "0", "my-queue", "a b", "émails", "x/y", "q.1"]
    )
    def test_good_name_is_accepted(self, name: str) -> None:
        """A non-empty printable name without surrounding whitespace makes a queue in INIT."""
        q = envq.Queue(name)
        assert q.state is QS.INIT
        assert q.capacity_used == 0

    @pytest.mark.parametrize("workers", [0, -1])
    def test_workers_must_be_positive(self, workers: int) -> None:
        """workers <= 0 raises ValueError."""
        with pytest.raises(ValueError, match="workers"):
            envq.Queue("q", workers=workers)

    def test_error_classes(self) -> None:
        """The lifecycle errors are the subclasses the contract names."""
        assert issubclass(envq.QueueNotRunning, envq.EnvqError)
        assert issubclass(envq.QueueStopping, envq.QueueNotRunning)
        assert issubclass(envq.QueueTerminated, envq.QueueNotRunning)
        assert issubclass(envq.CapacityExceeded, envq.EnvqError)
        assert not issubclass(envq.QueueStopping, envq.QueueTerminated)

    def test_start_needs_a_running_loop(self) -> None:
        """start() without a running event loop raises RuntimeError and stays INIT."""
        q = envq.Queue("q")
        with pytest.raises(RuntimeError):
            q.start()
        assert q.state is QS.INIT


class TestInit:
    async def test_start_makes_buffered_envelopes_ready(self) -> None:
        """start() goes RUNNING and runs the envelopes buffered before it, at start time."""
        trace = Trace()
        q = envq.Queue("q", workers=2)
        trace.watch(q)
        a, b = trace.env("a"), trace.env("b")
        q.send(a, b)
        await advance(5)
        assert trace.starts == []
        q.start()
        assert q.state is QS.RUNNING
        await advance(1)
        assert trace.started("a") == [5.0]
        assert trace.started("b") == [5.0]
        assert trace.states(a)[:3] == [ES.BUFFERED, ES.READY, ES.RUNNING]
        assert trace.queue_states() == [QS.RUNNING]
        await q.stop()

    async def test_send_buffers_and_reserves_capacity(self) -> None:
        """send() in INIT buffers (nothing runs) and reserves capacity."""
        trace = Trace()
        q = envq.Queue("q", capacity=2)
        trace.watch(q)
        a, b = trace.env("a"), trace.env("b")
        q.send(a, b)
        assert q.capacity_used == 2
        with pytest.raises(envq.CapacityExceeded):
            q.send(trace.env("c"))
        await advance(100)
        assert trace.starts == []
        assert trace.states(a) == [ES.BUFFERED]
        assert [e.from_state for e in trace.events if e.envelope is a] == [ES.NEW]
        assert q.state is QS.INIT
        await q.terminate()

    async def test_stop_is_a_noop(self) -> None:
        """stop() in INIT changes nothing and returns an empty report."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        a = trace.env("a")
        q.send(a)
        report = await q.stop()
        assert report == envq.StopReport()
        assert report.complete is False
        assert now() == 0.0
        assert q.state is QS.INIT
        assert q.capacity_used == 1
        assert trace.queue_states() == []
        q.start()
        await advance(1)
        assert trace.started("a") == [0.0]
        await q.stop()

    async def test_terminate_returns_buffered(self) -> None:
        """terminate() in INIT goes TERMINATED and hands back the buffer in admission order."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        a, b, c = trace.env("a"), trace.env("b"), trace.env("c")
        q.send(b)
        q.send(a, c)
        left = await q.terminate()
        assert left == [b, a, c]
        assert q.state is QS.TERMINATED
        assert q.capacity_used == 0
        await settle()
        assert trace.queue_states() == [QS.TERMINATED]
        assert [e.from_state for e in trace.events if e.envelope is None] == [QS.INIT]
        for env in (a, b, c):
            assert trace.states(env) == [ES.BUFFERED, ES.RETURNED]
        await advance(10)
        assert trace.starts == []


class TestRunning:
    async def test_start_again_is_a_noop(self) -> None:
        """start() while RUNNING changes nothing (no second set of workers)."""
        trace = Trace()
        q = envq.Queue("q", workers=1)
        trace.watch(q)
        q.start()
        q.start()
        assert q.state is QS.RUNNING
        q.send(trace.env("a", 10), trace.env("b", 10))
        await advance(30)
        assert trace.started("a") == [0.0]
        assert trace.started("b") == [10.0]
        assert trace.queue_states() == [QS.RUNNING]
        await q.stop()

    async def test_send_admits(self) -> None:
        """send() while RUNNING admits: the envelope enters from NEW and runs at once."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        await advance(3)
        a = trace.env("a")
        q.send(a)
        await advance(1)
        assert trace.started("a") == [3.0]
        assert trace.states(a) == [ES.READY, ES.RUNNING, ES.SUCCEEDED]
        assert next(e.from_state for e in trace.events if e.envelope is a) is ES.NEW
        assert q.capacity_used == 0
        await q.stop()

    async def test_stop_goes_stopping_then_stopped(self) -> None:
        """stop() while RUNNING goes STOPPING then STOPPED and reports complete."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        q.send(trace.env("a", 4))
        await settle()
        report = await q.stop()
        assert q.state is QS.STOPPED
        assert report.complete is True
        assert now() == 4.0
        assert trace.queue_states() == [QS.RUNNING, QS.STOPPING, QS.STOPPED]

    async def test_terminate_cancels_and_ends(self) -> None:
        """terminate() while RUNNING cancels in-flight work and goes through the stop to
        TERMINATED."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        a = trace.env("a", 50)
        q.send(a)
        await advance(1)
        left = await q.terminate()
        assert left == [a]
        assert now() == 1.0
        assert trace.cancels == [("a", 1.0)]
        assert q.state is QS.TERMINATED
        await settle()
        assert trace.queue_states() == [QS.RUNNING, QS.STOPPING, QS.STOPPED, QS.TERMINATED]


class TestStopping:
    async def test_start_raises_queue_stopping(self) -> None:
        """start() while STOPPING raises QueueStopping and the stop goes on to STOPPED."""
        trace = Trace()
        q, _ = await in_state(QS.STOPPING, trace)
        before = snapshot(q, trace)
        with pytest.raises(envq.QueueStopping):
            q.start()
        assert snapshot(q, trace) == before
        await q.wait_stopped()
        assert q.state is QS.STOPPED

    async def test_send_raises_queue_stopping(self) -> None:
        """send() while STOPPING raises QueueStopping and admits nothing."""
        trace = Trace()
        q, _ = await in_state(QS.STOPPING, trace)
        used = q.capacity_used
        with pytest.raises(envq.QueueStopping):
            q.send(trace.env("late"))
        assert q.capacity_used == used
        await q.wait_stopped()
        assert trace.started("late") == []

    async def test_stop_waits_for_the_stop_under_way(self) -> None:
        """stop() while STOPPING waits for the stop under way and returns its final report."""
        trace = Trace()
        q, [long] = await in_state(QS.STOPPING, trace)
        report = await q.stop()
        assert now() == 10.0
        assert q.state is QS.STOPPED
        assert report.complete is True
        assert report.completed == (long,)
        assert await q.wait_stopped() == report

    async def test_terminate_cancels_and_hands_back(self) -> None:
        """terminate() while STOPPING cancels what is in flight and hands it back."""
        trace = Trace()
        q, [long] = await in_state(QS.STOPPING, trace)
        left = await q.terminate()
        assert left == [long]
        assert now() == 0.0
        assert trace.cancels == [("long", 0.0)]
        assert q.state is QS.TERMINATED
        assert q.capacity_used == 0


class TestStopped:
    async def test_start_rearms_parked(self) -> None:
        """start() from STOPPED goes RUNNING and re-arms the parked envelopes."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        d = trace.env("d", delay=100)
        q.send(d)
        await q.stop()
        assert trace.states(d)[-1] is ES.PARKED
        await advance(30)
        q.start()
        assert q.state is QS.RUNNING
        await advance(200)
        assert trace.started("d") == [130.0]
        assert trace.states(d) == [
            ES.DELAYED,
            ES.PARKED,
            ES.DELAYED,
            ES.READY,
            ES.RUNNING,
            ES.SUCCEEDED,
        ]
        await q.stop()

    async def test_send_raises_queue_not_running(self) -> None:
        """send() in STOPPED raises QueueNotRunning itself (not a subclass)."""
        trace = Trace()
        q, _ = await in_state(QS.STOPPED, trace)
        before = snapshot(q, trace)
        with pytest.raises(envq.QueueNotRunning) as info:
            q.send(trace.env("late"))
        assert type(info.value) is envq.QueueNotRunning
        assert snapshot(q, trace) == before

    async def test_a_refused_send_names_what_it_was_given_briefly(self) -> None:
        """A send refused by the queue's state names the first things it was given, each
        shown bounded: a large object does not grow the message."""
        trace = Trace()
        q, _ = await in_state(QS.STOPPED, trace)
        huge = list(range(100_000))
        with pytest.raises(envq.QueueNotRunning) as info:
            q.send(huge)  # type: ignore[arg-type]
        message = str(info.value)
        assert "send() is not allowed" in message
        assert "[0, 1, 2" in message
        assert len(message) < 1000

    async def test_stop_returns_last_report(self) -> None:
        """stop() in STOPPED is a no-op returning the last final report."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        d = trace.env("d", delay=5)
        q.send(d)
        first = await q.stop()
        before = snapshot(q, trace)
        again = await q.stop()
        assert again == first
        assert again.parked == (d,)
        assert snapshot(q, trace) == before
        await q.terminate()

    async def test_terminate_returns_parked(self) -> None:
        """terminate() in STOPPED goes TERMINATED and hands back the parked envelopes."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        d1, d2 = trace.env("d1", delay=5), trace.env("d2", delay=1)
        q.send(d1, d2)
        await q.stop()
        left = await q.terminate()
        assert left == [d1, d2]
        assert q.state is QS.TERMINATED
        assert q.capacity_used == 0
        assert trace.states(d1)[-2:] == [ES.PARKED, ES.RETURNED]


class TestTerminated:
    async def test_start_raises_queue_terminated(self) -> None:
        """start() in TERMINATED raises QueueTerminated."""
        trace = Trace()
        q, _ = await in_state(QS.TERMINATED, trace)
        before = snapshot(q, trace)
        with pytest.raises(envq.QueueTerminated):
            q.start()
        assert snapshot(q, trace) == before

    async def test_send_raises_queue_terminated(self) -> None:
        """send() in TERMINATED raises QueueTerminated."""
        trace = Trace()
        q, _ = await in_state(QS.TERMINATED, trace)
        before = snapshot(q, trace)
        with pytest.raises(envq.QueueTerminated):
            q.send(trace.env("late"))
        assert snapshot(q, trace) == before

    async def test_stop_is_a_noop(self) -> None:
        """stop() in TERMINATED is a no-op returning the last final report."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.start()
        q.send(trace.env("a", 2))
        first = await q.stop()
        await q.terminate()
        before = snapshot(q, trace)
        assert await q.stop() == first
        assert snapshot(q, trace) == before

    async def test_terminate_again_returns_nothing(self) -> None:
        """terminate() in TERMINATED is a no-op returning []."""
        trace = Trace()
        q, _ = await in_state(QS.TERMINATED, trace)
        before = snapshot(q, trace)
        assert await q.terminate() == []
        assert snapshot(q, trace) == before


ALL_STATES = [QS.INIT, QS.RUNNING, QS.STOPPING, QS.STOPPED, QS.TERMINATED]


class TestCancelWithDrain:
    @pytest.mark.parametrize("state", ALL_STATES)
    async def test_default_drain_rejects_cancel(self, state: envq.QueueState) -> None:
        """stop(cancel=True) on a DRAIN queue raises ValueError and changes nothing."""
        trace = Trace()
        q, envs = await in_state(state, trace)
        before = snapshot(q, trace)
        with pytest.raises(ValueError, match=r"(?i)cancel|drain"):
            await q.stop(cancel=True)
        assert snapshot(q, trace) == before
        if state is QS.STOPPING:
            report = await q.wait_stopped()
            assert report.cancelled == ()
            assert report.completed == tuple(envs)
            assert now() == 10.0
        await q.terminate()

    @pytest.mark.parametrize("state", ALL_STATES)
    async def test_explicit_drain_rejects_cancel(self, state: envq.QueueState) -> None:
        """stop(mode=DRAIN, cancel=True) on a STOP queue raises ValueError, changes nothing."""
        trace = Trace()
        q, _ = await in_state(state, trace, stop_mode=envq.StopMode.STOP)
        before = snapshot(q, trace)
        with pytest.raises(ValueError, match=r"(?i)cancel|drain"):
            await q.stop(mode=envq.StopMode.DRAIN, cancel=True)
        assert snapshot(q, trace) == before
        if state is QS.STOPPING:
            report = await q.wait_stopped()
            assert report.cancelled == ()
        await q.terminate()

    async def test_stop_mode_allows_cancel(self) -> None:
        """stop(cancel=True) on a STOP queue is accepted and cancels in-flight work."""
        trace = Trace()
        q = envq.Queue("q", stop_mode=envq.StopMode.STOP)
        trace.watch(q)
        q.start()
        a = trace.env("a", 10)
        q.send(a)
        await advance(1)
        report = await q.stop(cancel=True)
        assert report.cancelled == (a,)
        assert trace.cancels == [("a", 1.0)]
        await q.terminate()


class TestRestart:
    async def test_start_stop_start_repeatedly(self) -> None:
        """A queue can be started and stopped again and again; work runs only while RUNNING."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        p = trace.env("p", interval=10)
        q.start()
        q.send(p)
        await advance(25)
        await q.stop()
        await advance(100)
        q.start()
        await advance(20)
        await q.stop()
        await advance(100)
        q.start()
        await advance(16)
        report = await q.stop()
        assert now() == 261.0
        assert trace.started("p") == [0.0, 10.0, 20.0, 130.0, 140.0, 250.0, 260.0]
        assert report.parked == (p,)
        assert trace.queue_states() == [QS.RUNNING, QS.STOPPING, QS.STOPPED] * 3
        assert q.capacity_used == 1
        await q.terminate()


class TestPreStartBuffer:
    async def test_delay_counts_from_start(self) -> None:
        """A buffered envelope's delay counts from start(), not from send()."""
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        a = trace.env("a", delay=5)
        q.send(a)
        await advance(100)
        q.start()
        await advance(50)
        assert trace.started("a") == [105.0]
        assert trace.states(a)[:3] == [ES.BUFFERED, ES.DELAYED, ES.READY]
        await q.stop()

    @pytest.mark.parametrize(
        ("delay", "not_before", "start_at", "expected"),
        [
            (0, 50, 10, 50.0),
            (0, 50, 80, 80.0),
            (60, 50, 10, 70.0),
            (20, 50, 10, 50.0),
            (0, -30, 10, 10.0),
        ],
    )
    async def test_not_before_is_armed_at_start(
        self, delay: float, not_before: float, start_at: float, expected: float
    ) -> None:
        """A buffered envelope first runs at max(start + delay, not_before), not_before
        read on the loop's wall clock."""
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        at = dt.datetime.fromtimestamp(loop.wall_time() + not_before, tz=dt.UTC)
        trace = Trace()
        q = envq.Queue("q")
        trace.watch(q)
        q.send(trace.env("a", delay=delay, not_before=at))
        await advance(start_at)
        q.start()
        await advance(200)
        [started] = trace.started("a")
        assert started == pytest.approx(expected, abs=1e-3)
        await q.stop()

    async def test_not_before_when_sent_to_running_queue(self) -> None:
        """An envelope sent to a running queue with not_before runs at that wall time."""
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        at = dt.datetime.fromtimestamp(loop.wall_time() + 50, tz=dt.UTC)
        trace = Trace()
        q = envq.Queue("q")
        q.start()
        await advance(10)
        q.send(trace.env("a", not_before=at))
        await advance(100)
        [started] = trace.started("a")
        assert started == pytest.approx(50.0, abs=1e-3)
        await q.stop()


class TestQueueEvents:
    async def test_queue_events_carry_name_states_and_time(self) -> None:
        """Queue state changes reach subscribers as events with the name, states and time."""
        q = envq.Queue("events:q_1")
        events: list[envq.Event] = []
        q.subscribe(events.append)
        await advance(3)
        q.start()
        await advance(4)
        await q.stop()
        await advance(2)
        await q.terminate()
        await settle()
        moves = [(e.from_state, e.to_state, e.time) for e in events if e.envelope is None]
        assert moves == [
            (QS.INIT, QS.RUNNING, 3.0),
            (QS.RUNNING, QS.STOPPING, 7.0),
            (QS.STOPPING, QS.STOPPED, 7.0),
            (QS.STOPPED, QS.TERMINATED, 9.0),
        ]
        assert {e.queue for e in events} == {"events:q_1"}

    async def test_unsubscribe_stops_delivery(self) -> None:
        """After calling the handle subscribe() returned, the listener gets nothing."""
        q = envq.Queue("q")
        events: list[envq.Event] = []
        unsubscribe = q.subscribe(events.append)
        q.start()
        await settle()
        assert len(events) == 1
        unsubscribe()
        await q.stop()
        await settle()
        assert len(events) == 1


class TestContextManager:
    async def test_enter_starts(self) -> None:
        """`async with Queue(...) as q` gives the queue, started."""
        queue = envq.Queue("ctx")
        async with queue as q:
            assert q is queue
            assert q.state is QS.RUNNING
        assert queue.state is QS.TERMINATED

    async def test_exit_drains_terminates_and_keeps_leftovers(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """On exit a DRAIN queue runs its ready work, terminates, keeps what was handed
        back in leftovers and logs a warning with their count."""
        caplog.set_level(logging.WARNING)
        trace = Trace()
        a = trace.env("a", 5)
        d1, d2 = trace.env("d1", delay=100), trace.env("d2", delay=200)
        async with envq.Queue("ctx") as q:
            trace.watch(q)
            q.send(a, d1, d2)
            await settle()
        assert now() == 5.0
        assert q.state is QS.TERMINATED
        assert q.leftovers == [d1, d2]
        assert trace.ends == [("a", 5.0)]
        warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "2" in warnings[0].getMessage()

    async def test_exit_uses_queue_stop_mode(self, caplog: pytest.LogCaptureFixture) -> None:
        """On exit a STOP queue parks ready work (handed back) and lets in-flight work end."""
        caplog.set_level(logging.WARNING)
        trace = Trace()
        f, r = trace.env("f", 5), trace.env("r", 5)
        async with envq.Queue("ctx", workers=1, stop_mode=envq.StopMode.STOP) as q:
            q.send(f, r)
            await advance(1)
        assert now() == 5.0
        assert q.leftovers == [r]
        assert trace.started("r") == []
        assert trace.ends == [("f", 5.0)]
        warnings = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "1" in warnings[0].getMessage()

    async def test_no_leftovers_no_warning(self, caplog: pytest.LogCaptureFixture) -> None:
        """When nothing is handed back, leftovers is empty and no warning is logged."""
        caplog.set_level(logging.WARNING)
        trace = Trace()
        async with envq.Queue("ctx") as q:
            q.send(trace.env("a", 1))
        assert q.leftovers == []
        assert trace.ends == [("a", 1.0)]
        assert [rec for rec in caplog.records if rec.levelno >= logging.WARNING] == []

    async def test_exit_on_error_still_terminates(self) -> None:
        """An exception in the body propagates, and the queue is still terminated."""
        trace = Trace()
        d = trace.env("d", delay=100)
        queue = envq.Queue("ctx")

        async def body() -> None:
            async with queue as q:
                q.send(d)
                raise KeyError("boom")

        with pytest.raises(KeyError):
            await body()
        assert queue.state is QS.TERMINATED
        assert queue.leftovers == [d]
        assert queue.capacity_used == 0


@pytest.mark.real_clock
async def test_real_clock_smoke() -> None:
    """On a real loop, a queue starts, runs an envelope, stops and terminates."""
    done = asyncio.Event()

    async def work(env: envq.Envelope) -> None:
        await asyncio.sleep(0.01)
        done.set()

    async with asyncio.timeout(30):
        q = envq.Queue("real")
        q.start()
        q.send(envq.Envelope(invoke=work))
        await done.wait()
        report = await q.stop()
        assert report.complete is True
        assert q.state is QS.STOPPED
        assert await q.terminate() == []
        assert q.statistics().state is QS.TERMINATED
