"""docs/lifecycle.md: terminate() hands back everything still in the queue from every state,
nothing is lost, and terminate() cannot be called from inside the queue."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envq
from envq._machine import TERMINAL_STATES
from envq.testing import advance, run
from tests.support import QueueMaker, Trace, now, settle

QS = envq.QueueState
ES = envq.EnvState
DRAIN = envq.StopMode.DRAIN
STOP = envq.StopMode.STOP
TERMINAL = TERMINAL_STATES


Behaviour = str  # "ok", "fail", "stop", "no_retry", "retry"


def assert_nothing_lost(
    trace: Trace, admitted: list[envq.Envelope], left: list[envq.Envelope]
) -> None:
    """Each admitted envelope is handed back or ended, exactly once, and said so."""
    assert len({id(env) for env in left}) == len(left), "an envelope was handed back twice"
    assert all(any(env is a for a in admitted) for env in left), "handed back a stranger"
    order = [next(i for i, a in enumerate(admitted) if a is env) for env in left]
    assert order == sorted(order), "hand-back is not in admission order"
    for env in admitted:
        ends = [e for e in trace.for_env(env) if e.to_state in TERMINAL]
        assert len(ends) == 1, f"{env!r}: {trace.states(env)}"
        assert trace.for_env(env)[-1] is ends[0], f"{env!r}: moved after ending"
        handed_back = any(env is x for x in left)
        assert (ends[0].to_state is ES.RETURNED) == handed_back, f"{env!r}: {ends[0]}"
    assert len(trace.finished) == len(trace.starts), "an attempt outlived terminate()"


class TestHandBack:
    async def test_from_init_returns_buffered(self, make_queue: QueueMaker) -> None:
        """From INIT, terminate hands back the buffered envelopes in admission order."""
        trace = Trace()
        q = make_queue(trace)
        a, b = trace.env("a", delay=5), trace.env("b")
        q.send(a, b)
        assert await q.terminate() == [a, b]
        assert q.state is QS.TERMINATED
        assert q.capacity_used == 0
        assert trace.states(a) == [ES.BUFFERED, ES.RETURNED]

    async def test_from_running_returns_everything_held(self, make_queue: QueueMaker) -> None:
        """From RUNNING, terminate cancels in-flight attempts at once and hands back those
        and the ready, delayed and retry-delayed envelopes, in admission order."""
        trace = Trace()
        q = make_queue(trace, workers=2)
        e = trace.env("e", behaviour="retry")
        f, g = trace.env("f", 10), trace.env("g", 10)
        r, d = trace.env("r", 1), trace.env("d", delay=100)
        q.start()
        q.send(e, f, g, r, d)
        await advance(1)
        assert trace.last(e) is ES.DELAYED
        assert trace.last(r) is ES.READY
        left = await q.terminate()
        assert now() == 1.0
        assert left == [e, f, g, r, d]
        assert sorted(trace.cancels) == [("f", 1.0), ("g", 1.0)]
        for env in (f, g):
            [cancel] = [x for x in trace.for_env(env) if x.outcome is envq.Outcome.CANCELLED]
            assert cancel.from_state is ES.RUNNING
        for env in left:
            assert trace.last(env) is ES.RETURNED
        assert trace.started("r") == []
        assert q.capacity_used == 0
        assert q.state is QS.TERMINATED

    @pytest.mark.parametrize(
        ("mode", "cancel"),
        [(DRAIN, False), (STOP, False), (STOP, True)],
        ids=["drain", "stop", "stop-cancel"],
    )
    async def test_from_stopping_cancels_and_returns(
        self,
        mode: envq.StopMode,
        cancel: bool,
        make_queue: QueueMaker,
    ) -> None:
        """From STOPPING, terminate cancels what is in flight (escalating a DRAIN) and hands
        back the in-flight, ready and delayed envelopes."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, r, d = trace.env("f", 10), trace.env("r", 10), trace.env("d", delay=100)
        q.start()
        q.send(f, r, d)
        await advance(1)
        await q.stop(mode=mode, cancel=cancel, wait=False)
        assert q.state is QS.STOPPING
        left = await q.terminate()
        assert now() == 1.0
        assert left == [f, r, d]
        assert trace.cancels == [("f", 1.0)]
        assert trace.started("r") == []
        assert [trace.last(x) for x in (f, r, d)] == [ES.RETURNED] * 3
        assert q.capacity_used == 0
        await advance(200)
        assert trace.started("r") == []
        assert trace.started("d") == []

    async def test_from_stopping_releases_a_waiting_stop(self, make_queue: QueueMaker) -> None:
        """A stop() waiting on a DRAIN when terminate escalates it returns, not hangs."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, r = trace.env("f", 10), trace.env("r", 10)
        q.start()
        q.send(f, r)
        await advance(1)
        stopping = asyncio.create_task(q.stop())
        await settle()
        assert q.state is QS.STOPPING
        assert await q.terminate() == [f, r]
        await settle()
        assert stopping.done()
        assert isinstance(stopping.result(), envq.StopReport)
        assert now() == 1.0

    async def test_from_stopped_returns_parked(self, make_queue: QueueMaker) -> None:
        """From STOPPED, terminate hands back the parked envelopes; finished ones are not."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, r, d = trace.env("f", 10), trace.env("r", 10), trace.env("d", delay=100)
        q.start()
        q.send(f, r, d)
        await advance(1)
        await q.stop(mode=STOP)
        left = await q.terminate()
        assert left == [r, d]
        assert trace.last(f) is ES.SUCCEEDED
        assert trace.states(r)[-2:] == [ES.PARKED, ES.RETURNED]
        assert q.state is QS.TERMINATED

    async def test_from_stopped_returns_cancelled_attempts(self, make_queue: QueueMaker) -> None:
        """An attempt cancelled by a stop is parked and then handed back by terminate."""
        trace = Trace()
        q = make_queue(trace)
        f = trace.env("f", 10)
        q.start()
        q.send(f)
        await advance(1)
        report = await q.stop(mode=STOP, cancel=True)
        assert report.cancelled == (f,)
        assert await q.terminate() == [f]
        assert trace.states(f)[-2:] == [ES.PARKED, ES.RETURNED]

    async def test_from_terminated_returns_nothing(self, make_queue: QueueMaker) -> None:
        """A second terminate returns [] and changes nothing."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        d = trace.env("d", delay=5)
        q.send(d)
        assert await q.terminate() == [d]
        count = len(trace.events)
        assert await q.terminate() == []
        await settle()
        assert len(trace.events) == count
        assert q.state is QS.TERMINATED

    async def test_handed_back_envelopes_can_go_elsewhere(self, make_queue: QueueMaker) -> None:
        """Handed-back envelopes are no longer live: another queue accepts and runs them."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        f, d = trace.env("f", 10), trace.env("d", delay=100)
        q.send(f, d)
        await advance(1)
        left = await q.terminate()
        assert q.statistics().capacity_used == 0
        assert q.statistics().in_flight == 0
        other = envq.Queue("other", workers=2)
        other.start()
        other.send(*left)
        await advance(1)
        assert trace.started("f") == [0.0, 1.0]
        with pytest.raises(envq.QueueTerminated):
            q.send(envq.Envelope(invoke=trace.job()))
        await other.terminate()


class TestTerminateRaces:
    async def test_terminate_cancels_a_caller_spared_by_its_own_stop(
        self, make_queue: QueueMaker
    ) -> None:
        """An attempt spared by the stop it called is still cancelled and handed back by a
        terminate() from outside."""
        trace = Trace()
        q = make_queue(trace)
        inner_reports: list[envq.StopReport] = []

        async def caller(env: envq.Envelope) -> None:
            await asyncio.sleep(1)
            inner_reports.append(await q.stop(mode=STOP, cancel=True))
            await trace.job(100)(env)

        c = envq.Envelope(invoke=caller, id="c")
        q.start()
        q.send(c)
        await advance(2)
        assert q.state is QS.STOPPING
        assert [r.complete for r in inner_reports] == [False]
        left = await q.terminate()
        assert now() == 2.0
        assert left == [c]
        assert trace.cancels == [("c", 2.0)]
        assert trace.last(c) is ES.RETURNED

    async def test_concurrent_terminates_hand_back_once(self, make_queue: QueueMaker) -> None:
        """Two terminate() calls at once hand back every envelope exactly once between them."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, r, d = trace.env("f", 10), trace.env("r", 10), trace.env("d", delay=100)
        q.start()
        q.send(f, r, d)
        await advance(1)
        first, second = await asyncio.gather(q.terminate(), q.terminate())
        assert now() == 1.0
        assert sorted([*first, *second], key=[f, r, d].index) == [f, r, d]
        assert_nothing_lost(trace, [f, r, d], [*first, *second])
        assert q.state is QS.TERMINATED

    async def test_wait_stopped_in_running_released_by_terminate(
        self, make_queue: QueueMaker
    ) -> None:
        """A wait_stopped() waiting in RUNNING returns when terminate() stops the queue."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        q.send(trace.env("f", 10))
        waiter = asyncio.create_task(q.wait_stopped())
        await advance(1)
        await q.terminate()
        await settle()
        assert waiter.done()
        assert isinstance(waiter.result(), envq.StopReport)

    async def test_wait_stopped_in_init_released_by_terminate(self, make_queue: QueueMaker) -> None:
        """A wait_stopped() waiting in INIT does not hang once the queue is terminated."""
        trace = Trace()
        q = make_queue(trace)
        waiter = asyncio.create_task(q.wait_stopped())
        await advance(1)
        await q.terminate()
        await settle()
        assert waiter.done()
        assert isinstance(waiter.result(), envq.StopReport)

    async def test_terminate_another_queue_from_inside_works(self, make_queue: QueueMaker) -> None:
        """An attempt may terminate a different queue; only its own queue is off limits."""
        trace = Trace()
        q = make_queue(trace)
        other = envq.Queue("other")
        d = trace.env("d", delay=100)
        handed: list[list[envq.Envelope]] = []

        async def inner(env: envq.Envelope) -> None:
            handed.append(await other.terminate())

        other.start()
        other.send(d)
        q.start()
        q.send(envq.Envelope(invoke=inner, id="c"))
        await advance(1)
        assert handed == [[d]]
        assert other.state is QS.TERMINATED
        assert q.state is QS.RUNNING
        await q.stop()


class TestQueueEvents:
    @pytest.mark.parametrize(
        ("state", "tail"),
        [
            (QS.INIT, [(QS.INIT, QS.TERMINATED)]),
            (
                QS.RUNNING,
                [
                    (QS.INIT, QS.RUNNING),
                    (QS.RUNNING, QS.STOPPING),
                    (QS.STOPPING, QS.STOPPED),
                    (QS.STOPPED, QS.TERMINATED),
                ],
            ),
            (
                QS.STOPPING,
                [
                    (QS.INIT, QS.RUNNING),
                    (QS.RUNNING, QS.STOPPING),
                    (QS.STOPPING, QS.STOPPED),
                    (QS.STOPPED, QS.TERMINATED),
                ],
            ),
            (
                QS.STOPPED,
                [
                    (QS.INIT, QS.RUNNING),
                    (QS.RUNNING, QS.STOPPING),
                    (QS.STOPPING, QS.STOPPED),
                    (QS.STOPPED, QS.TERMINATED),
                ],
            ),
        ],
    )
    async def test_terminate_queue_events(
        self,
        state: envq.QueueState,
        tail: list[tuple[object, object]],
        make_queue: QueueMaker,
    ) -> None:
        """terminate() reaches TERMINATED through the states the lifecycle table names."""
        trace = Trace()
        q = make_queue(trace)
        if state is not QS.INIT:
            q.start()
            q.send(trace.env("f", 10))
            await settle()
        if state is QS.STOPPING:
            await q.stop(wait=False)
        if state is QS.STOPPED:
            await q.stop()
        assert q.state is state
        await q.terminate()
        await settle()
        assert trace.queue_moves() == tail


class TestNothingLost:
    @pytest.mark.parametrize("at", [0, 0.5, 1.5, 2.5, 4.5, 6.5, 11.5, 31.5, 60.5])
    async def test_mixed_work_terminated_at(self, at: float, make_queue: QueueMaker) -> None:
        """Terminated at any moment, every admitted envelope is handed back or has ended in
        exactly one terminal event."""
        trace = Trace()
        q = make_queue(trace, workers=2)
        admitted = [
            trace.env("ok", 2),
            trace.env("fail", 1, "fail"),
            trace.env("stop", 1, "stop"),
            trace.env("no_retry", 1, "no_retry"),
            trace.env("retry", 1, "retry"),
            trace.env("periodic", 1, interval=4),
            trace.env("periodic_fail", 1, "fail", interval=5),
            trace.env("delayed", 1, delay=10),
            trace.env("long", 30),
        ]
        q.send(*admitted[:4])
        q.start()
        q.send(*admitted[4:])
        await advance(at)
        await settle()
        assert q.capacity_used == trace.live(admitted)
        left = await q.terminate()
        await settle()
        assert now() == at
        assert_nothing_lost(trace, admitted, left)
        assert q.capacity_used == 0
        assert any(env.id == "periodic" for env in left)

    async def test_nothing_lost_across_stop_and_restart(self, make_queue: QueueMaker) -> None:
        """Work parked by stops and re-armed by starts is still handed back or ended."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        admitted = [
            trace.env("a", 3),
            trace.env("b", 3, "retry"),
            trace.env("p", 2, interval=6),
            trace.env("d", 1, delay=20),
        ]
        q.start()
        q.send(*admitted)
        await advance(2)
        await q.stop(mode=STOP)
        q.start()
        await advance(4)
        await q.stop(mode=STOP, cancel=True)
        q.start()
        await advance(1)
        left = await q.terminate()
        await settle()
        assert_nothing_lost(trace, admitted, left)


# A random walk of lifecycle calls, then terminate: nothing may be lost.

_SPECS = st.tuples(
    st.integers(0, 8),
    st.integers(0, 20),
    st.sampled_from([0, 0, 3, 7]),
    st.sampled_from(["ok", "fail", "stop", "no_retry", "retry"]),
)
_OPS = st.one_of(
    st.tuples(st.just("advance"), st.integers(0, 15)),
    st.tuples(st.just("send"), _SPECS),
    st.tuples(st.just("start")),
    st.tuples(
        st.just("stop"),
        st.sampled_from([(DRAIN, False), (STOP, False), (STOP, True)]),
        st.booleans(),
    ),
)


async def walk(ops: list[tuple[Any, ...]], workers: int) -> None:
    trace = Trace()
    admitted: list[envq.Envelope] = []
    q = envq.Queue("terminate", workers=workers)
    trace.watch(q)
    for n, op in enumerate(ops):
        match op:
            case ("advance", seconds):
                await advance(seconds)
                await settle()
                assert q.capacity_used == trace.live(admitted)
            case ("send", (seconds, delay, interval, behaviour)):
                if q.state in (QS.INIT, QS.RUNNING):
                    env = trace.env(n, seconds, behaviour, delay=delay, interval=interval)
                    q.send(env)
                    admitted.append(env)
            case ("start",):
                if q.state in (QS.INIT, QS.STOPPED):
                    q.start()
            case ("stop", (mode, cancel), wait):
                await q.stop(mode=mode, cancel=cancel, wait=wait)
    left = await q.terminate()
    await settle()
    assert q.state is QS.TERMINATED
    assert q.capacity_used == 0
    assert_nothing_lost(trace, admitted, left)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(_OPS, max_size=14), workers=st.integers(1, 3))
def test_random_lifecycle_walk_loses_nothing(ops: list[tuple[Any, ...]], workers: int) -> None:
    """After any sequence of sends, starts, stops and waits, terminate() leaves every
    admitted envelope handed back or ended in exactly one terminal event."""
    run(walk(ops, workers))


def test_a_worker_of_an_earlier_run_takes_no_work() -> None:
    """A stop that ends before its workers ever ran, then a start: the first run's
    workers take no envelope (the second run's do), so terminate() waits for, cancels
    and hands back what is in flight, and nothing is lost."""
    ops = [
        ("start",),
        ("send", (1, 0, 0, "ok")),
        ("stop", (envq.StopMode.STOP, False), False),
        ("start",),
        ("advance", 0),
    ]
    run(walk(ops, 1))


class TestFromInside:
    async def test_terminate_from_attempt_raises(self, make_queue: QueueMaker) -> None:
        """terminate() from an attempt raises RuntimeError and the queue keeps running."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []

        async def inner(env: envq.Envelope) -> None:
            try:
                await q.terminate()
            except RuntimeError as exc:
                errors.append(exc)

        c = envq.Envelope(invoke=inner, id="c")
        q.start()
        q.send(c)
        await advance(1)
        assert len(errors) == 1
        assert q.state is QS.RUNNING
        assert trace.last(c) is ES.SUCCEEDED
        await q.stop()

    async def test_terminate_from_spawned_task_raises(self, make_queue: QueueMaker) -> None:
        """terminate() from a task an attempt spawned raises RuntimeError."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []

        async def terminator() -> None:
            try:
                await q.terminate()
            except RuntimeError as exc:
                errors.append(exc)

        async def inner(env: envq.Envelope) -> None:
            await asyncio.create_task(terminator())

        c = envq.Envelope(invoke=inner, id="c")
        q.start()
        q.send(c)
        await advance(1)
        assert len(errors) == 1
        assert q.state is QS.RUNNING
        assert trace.last(c) is ES.SUCCEEDED
        await q.stop()

    async def test_terminate_from_after_hook_raises(self, make_queue: QueueMaker) -> None:
        """terminate() from an after hook raises RuntimeError and the attempt stays OK."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []

        async def after(env: envq.Envelope) -> None:
            try:
                await q.terminate()
            except RuntimeError as exc:
                errors.append(exc)

        c = trace.env("c", 1, after=after)
        q.start()
        q.send(c)
        await advance(2)
        assert len(errors) == 1
        assert q.state is QS.RUNNING
        assert trace.last(c) is ES.SUCCEEDED
        await q.stop()

    async def test_terminate_while_stopping_from_attempt_raises(
        self, make_queue: QueueMaker
    ) -> None:
        """terminate() from an attempt during a stop raises RuntimeError; the stop ends."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []

        async def inner(env: envq.Envelope) -> None:
            await asyncio.sleep(5)
            try:
                await q.terminate()
            except RuntimeError as exc:
                errors.append(exc)

        q.start()
        q.send(envq.Envelope(invoke=inner, id="c"))
        await advance(1)
        report = await q.stop()
        assert len(errors) == 1
        assert report.complete is True
        assert q.state is QS.STOPPED
        assert now() == 5.0


@pytest.mark.real_clock
async def test_real_clock_terminate_cancels_promptly() -> None:
    """On a real loop, terminate() cancels a long attempt at once and hands it back."""
    started = asyncio.Event()

    async def work(env: envq.Envelope) -> None:
        started.set()
        await asyncio.sleep(3600)

    async with asyncio.timeout(30):
        q = envq.Queue("real")
        q.start()
        env = envq.Envelope(invoke=work)
        q.send(env)
        await started.wait()
        t0 = time.monotonic()
        assert await q.terminate() == [env]
        assert time.monotonic() - t0 < 10
        assert q.state is QS.TERMINATED
