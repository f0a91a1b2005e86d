"""One behavioural test per row of the runtime tables (``envq._machine``).

``scripts/mutate.py`` changes each row of each table in turn (target, action, dropped)
and runs the behavioural tests against the mutant; every row therefore needs a test
that *observes* it: the exact path of the envelope's events (``FROM>TO/OUTCOME``), the
queue's own events, the hooks called, the time things happen, ``statistics()`` — never
the table itself. Each test says which rows it pins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

import envq
from envq import EnvState, Outcome, QueueState, StopMode
from tests.support import now, settle

T = TypeVar("T")
ES = EnvState
QS = QueueState
STOP, DRAIN = StopMode.STOP, StopMode.DRAIN
#: Virtual seconds a test waits for something before failing (fast: virtual time).
PATIENCE = 1_000.0

#: No test here runs an envelope more often than this.
MAX_RUNS = 20

#: What an attempt does: a name, or ("sleep", seconds, then) / ("wait", event, then).
Step = Any


@pytest.fixture(autouse=True)
def no_internal_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A table row the runtime cannot perform shows up as envq's "internal error" log
    (the worker catches it); every test here fails on one."""
    caplog.set_level(logging.ERROR, logger="envq")
    yield
    bad = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert not bad, bad


async def within(aw: Awaitable[T], seconds: float = PATIENCE) -> T:
    """Await with a virtual-time bound: a mutant that hangs fails at once."""
    async with asyncio.timeout(seconds):
        return await aw


async def advance(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def perform(step: Step) -> None:
    """Do one scripted attempt step."""
    if isinstance(step, tuple):
        how, arg, then = step
        if how == "sleep":
            await asyncio.sleep(arg)
        else:
            await arg.wait()
        await perform(then)
        return
    match step:
        case "ok":
            return
        case "error":
            raise ValueError("scripted error")
        case "hang":  # until the deadline or a cancel
            await asyncio.sleep(1e9)
        case "stop":
            raise envq.StopEnvelope()
        case "stop_type":
            raise envq.StopType()
        case "no_retry":
            raise envq.DoNotRetry()
        case _:
            raise AssertionError(f"unknown step {step!r}")


class World:
    """A queue with a log of its events and of the hooks it called."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("workers", 1)
        self.q = envq.Queue("rows", **options)
        self.events: list[envq.Event] = []
        self.hooks: list[tuple[Any, ...]] = []
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self.q.subscribe(self._on_event)

    def _on_event(self, event: envq.Event) -> None:
        self.events.append(event)
        for cond, fut in self._waiters:
            if not fut.done() and cond():
                fut.set_result(None)

    def env(
        self,
        name: str,
        *steps: Step,
        decisions: Iterator[envq.Decision | None] | None = None,
        hooks: bool = True,
        **fields: Any,
    ) -> envq.Envelope:
        """An envelope whose n-th attempt does ``steps[n]`` ("ok" once they run out).

        With ``hooks``, on_success / on_failure are recorded; on_failure answers the
        next of ``decisions`` (drop when they run out).
        """
        script = list(steps)
        answers = iter(decisions or ())

        async def invoke(env: envq.Envelope) -> None:
            self.hooks.append(("run", name, now()))
            if len(self.runs(name)) > MAX_RUNS:
                # A wrong row can re-run an envelope forever at one instant, which no
                # virtual-time bound ends: hang instead, so the test's bound fails it.
                await asyncio.sleep(1e9)
            await perform(script.pop(0) if script else "ok")

        async def on_success(env: envq.Envelope) -> None:
            self.hooks.append(("success", name))

        async def on_failure(
            env: envq.Envelope, exc: BaseException | None, attempt: int
        ) -> envq.Decision | None:
            self.hooks.append(("failure", name, type(exc).__name__, attempt))
            return next(answers, None)

        if hooks:
            fields.setdefault("on_success", on_success)
            fields.setdefault("on_failure", on_failure)
        return envq.Envelope(invoke=invoke, id=name, **fields)

    def path(self, env: envq.Envelope) -> list[str]:
        """The envelope's moves as ``FROM>TO`` or ``FROM>TO/OUTCOME``."""
        return [
            f"{e.from_state.name}>{e.to_state.name}" + (f"/{e.outcome.name}" if e.outcome else "")
            for e in self.events
            if e.envelope is env
        ]

    def timed(self, env: envq.Envelope) -> list[tuple[str, float]]:
        return [
            (f"{e.from_state.name}>{e.to_state.name}", e.time)
            for e in self.events
            if e.envelope is env
        ]

    def queue_path(self) -> list[str]:
        return [f"{e.from_state.name}>{e.to_state.name}" for e in self.events if e.envelope is None]

    def runs(self, name: str) -> list[float]:
        return [h[2] for h in self.hooks if h[0] == "run" and h[1] == name]

    def called(self) -> list[tuple[Any, ...]]:
        """The hook calls (not the runs)."""
        return [h for h in self.hooks if h[0] != "run"]

    def cause(self, env: envq.Envelope) -> BaseException | None:
        return [e for e in self.events if e.envelope is env][-1].cause

    async def until(self, cond: Callable[[], bool]) -> None:
        """Wait (at most PATIENCE virtual seconds) until an event makes ``cond`` true."""
        if cond():
            return
        entry = (cond, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await within(entry[1])
        finally:
            self._waiters.remove(entry)

    async def ended(self, env: envq.Envelope) -> None:
        terminal = {ES.SUCCEEDED, ES.FAILED, ES.STOPPED, ES.RETURNED}
        await self.until(
            lambda: any(e.envelope is env and e.to_state in terminal for e in self.events)
        )

    def by_state(self) -> dict[EnvState, int]:
        return {s: n for s, n in self.q.statistics().by_state.items() if n}


def reject_type(call: Callable[[], object], error: type[Exception]) -> None:
    """``call()`` raises exactly ``error`` (not a subclass or a sibling)."""
    with pytest.raises(envq.EnvqError) as info:
        call()
    assert type(info.value) is error, info.value


async def areject_type(aw: Awaitable[object], error: type[Exception]) -> None:
    with pytest.raises(envq.EnvqError) as info:
        await aw
    assert type(info.value) is error, info.value


# ---------------------------------------------------------------------------------------
# LIFECYCLE: one test per (state, call)
# ---------------------------------------------------------------------------------------


class TestLifecycleRows:
    async def test_init_send_buffers(self) -> None:
        """(INIT, SEND) BUFFER: held BUFFERED, the queue stays INIT, nothing runs."""
        w = World()
        a = w.env("a")
        w.q.send(a)
        await advance(10)
        assert w.q.state is QS.INIT
        assert w.path(a) == ["NEW>BUFFERED"]
        assert w.by_state() == {ES.BUFFERED: 1}
        assert w.runs("a") == []
        assert w.queue_path() == []
        await w.q.terminate()

    async def test_init_stop_is_a_no_op(self) -> None:
        """(INIT, STOP) NOTHING: stop() returns at once, changes nothing."""
        w = World()
        a = w.env("a")
        w.q.send(a)
        report = await within(w.q.stop(STOP, cancel=True), 0)
        assert report == envq.StopReport()
        assert w.q.state is QS.INIT
        assert w.queue_path() == []
        assert w.path(a) == ["NEW>BUFFERED"]
        w.q.start()
        await w.ended(a)
        assert w.path(a)[-1] == "RUNNING>SUCCEEDED/OK"
        await w.q.terminate()

    async def test_init_start_arms_buffered(self) -> None:
        """(INIT, START) ARM → RUNNING: buffered envelopes become READY or DELAYED."""
        w = World(workers=2)
        a, b = w.env("a"), w.env("b", delay=5)
        w.q.send(a, b)
        await advance(3)
        w.q.start()
        assert w.q.state is QS.RUNNING
        await w.ended(a)
        await w.ended(b)
        assert w.queue_path() == ["INIT>RUNNING"]
        assert w.path(a) == [
            "NEW>BUFFERED",
            "BUFFERED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        assert w.path(b)[:3] == ["NEW>BUFFERED", "BUFFERED>DELAYED", "DELAYED>READY"]
        assert w.runs("a") == [3.0]
        assert w.runs("b") == [8.0]
        await w.q.terminate()

    async def test_init_terminate_hands_back(self) -> None:
        """(INIT, TERMINATE) HAND_BACK → TERMINATED: buffered envelopes are returned."""
        w = World()
        a, b = w.env("a"), w.env("b")
        w.q.send(a, b)
        assert await within(w.q.terminate()) == [a, b]
        assert w.q.state is QS.TERMINATED
        assert w.queue_path() == ["INIT>TERMINATED"]
        assert w.path(a) == ["NEW>BUFFERED", "BUFFERED>RETURNED"]
        assert w.by_state() == {ES.RETURNED: 2}

    async def test_running_start_is_a_no_op(self) -> None:
        """(RUNNING, START) NOTHING: no new workers, no re-arming, no queue event."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 10, "ok")), w.env("b", delay=3)
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        w.q.start()
        c = w.env("c")
        w.q.send(c)
        await w.ended(c)
        assert w.queue_path() == ["INIT>RUNNING"]
        # One worker: b and c wait for a, in admission order.
        assert (w.runs("a"), w.runs("b"), w.runs("c")) == ([0.0], [10.0], [10.0])
        assert w.path(b) == [
            "NEW>DELAYED",
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        await w.q.terminate()

    async def test_running_send_admits(self) -> None:
        """(RUNNING, SEND) ADMIT: READY now, DELAYED with a delay."""
        w = World(workers=2)
        w.q.start()
        a, b = w.env("a"), w.env("b", delay=4)
        w.q.send(a, b)
        assert w.path(a) == ["NEW>READY"]
        assert w.path(b) == ["NEW>DELAYED"]
        await w.ended(b)
        assert w.runs("b") == [4.0]
        await w.q.terminate()

    async def test_running_stop_begins_stopping(self) -> None:
        """(RUNNING, STOP) BEGIN_STOP → STOPPING, then (STOPPING, DRAINED) FINISH_STOP →
        STOPPED when the last attempt ends."""
        w = World()
        a = w.env("a", ("sleep", 10, "ok"))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await w.q.stop(DRAIN, wait=False)
        assert report.complete is False
        assert w.q.state is QS.STOPPING
        final = await within(w.q.wait_stopped())
        assert now() == 10.0
        assert final.complete is True
        assert final.completed == (a,)
        assert w.q.state is QS.STOPPED
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        await w.q.terminate()

    async def test_running_terminate_stops_then_hands_back(self) -> None:
        """(RUNNING, TERMINATE) STOP_THEN_TERMINATE: cancel, park, hand everything back."""
        w = World(workers=1)
        a, b = w.env("a", "hang"), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        assert await within(w.q.terminate()) == [a, b]
        assert w.q.state is QS.TERMINATED
        assert w.queue_path() == [
            "INIT>RUNNING",
            "RUNNING>STOPPING",
            "STOPPING>STOPPED",
            "STOPPED>TERMINATED",
        ]
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>RETURNED/CANCELLED"]
        assert w.path(b) == ["NEW>READY", "READY>PARKED", "PARKED>RETURNED"]
        assert w.called() == []

    async def test_stopping_start_and_send_raise_queue_stopping(self) -> None:
        """(STOPPING, START) and (STOPPING, SEND): REJECT with QueueStopping."""
        w = World()
        w.q.start()
        w.q.send(w.env("a", ("sleep", 10, "ok")))
        await advance(1)
        await w.q.stop(wait=False)
        reject_type(w.q.start, envq.QueueStopping)
        b = w.env("b")
        reject_type(lambda: w.q.send(b), envq.QueueStopping)
        await areject_type(w.q.send_wait(b), envq.QueueStopping)
        assert w.q.state is QS.STOPPING
        assert w.path(b) == []
        await w.q.terminate()

    async def test_stopping_stop_waits_for_the_stop_under_way(self) -> None:
        """(STOPPING, STOP) AWAIT_STOP: a second stop() returns the final report when the
        first stop ends."""
        w = World()
        a = w.env("a", ("sleep", 10, "ok"))
        w.q.start()
        w.q.send(a)
        await advance(1)
        await w.q.stop(DRAIN, wait=False)
        report = await within(w.q.stop(STOP, cancel=True))
        assert now() == 10.0
        assert report.complete is True
        assert report.completed == (a,)
        assert w.path(a)[-1] == "RUNNING>SUCCEEDED/OK"
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        await w.q.terminate()

    async def test_stopping_terminate_escalates(self) -> None:
        """(STOPPING, TERMINATE) ESCALATE_THEN_TERMINATE: the DRAIN stop under way turns
        into a cancelling one (its waiter gets the final report); everything is handed
        back."""
        w = World(workers=1)
        a, b = w.env("a", "hang"), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        stopping = asyncio.ensure_future(w.q.stop(DRAIN))
        await settle()
        assert w.q.state is QS.STOPPING
        assert await within(w.q.terminate()) == [a, b]
        report = await within(stopping, 0)
        assert report.complete is True
        assert report.cancelled == (a,)
        assert w.q.state is QS.TERMINATED
        assert w.path(a)[-1] == "RUNNING>RETURNED/CANCELLED"
        assert w.path(b) == ["NEW>READY", "READY>PARKED", "PARKED>RETURNED"]
        assert w.queue_path()[-2:] == ["STOPPING>STOPPED", "STOPPED>TERMINATED"]

    async def test_stopped_start_rearms_parked(self) -> None:
        """(STOPPED, START) ARM → RUNNING: parked envelopes are re-armed."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        report = await within(w.q.stop(STOP))
        assert report.parked == (b,)
        assert w.q.state is QS.STOPPED
        await advance(5)
        w.q.start()
        assert w.q.state is QS.RUNNING
        await w.ended(b)
        assert w.runs("b") == [10.0]
        assert w.path(b) == [
            "NEW>READY",
            "READY>PARKED",
            "PARKED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        assert w.queue_path()[-1] == "STOPPED>RUNNING"
        await w.q.terminate()

    async def test_stopped_send_raises_queue_not_running(self) -> None:
        """(STOPPED, SEND): REJECT with QueueNotRunning."""
        w = World()
        w.q.start()
        await w.q.stop()
        b = w.env("b")
        reject_type(lambda: w.q.send(b), envq.QueueNotRunning)
        await areject_type(w.q.send_wait(b), envq.QueueNotRunning)
        assert w.path(b) == []
        await w.q.terminate()

    async def test_stopped_stop_is_a_no_op(self) -> None:
        """(STOPPED, STOP) NOTHING: returns the last final report; nothing changes."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        first = await w.q.stop(STOP)
        again = await within(w.q.stop(DRAIN), 0)
        assert again == first
        assert again.parked == (b,)
        assert w.q.state is QS.STOPPED
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        assert w.runs("b") == []
        await w.q.terminate()

    async def test_stopped_terminate_hands_back_parked(self) -> None:
        """(STOPPED, TERMINATE) HAND_BACK → TERMINATED."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b", delay=50)
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        await w.q.stop(STOP)
        assert await within(w.q.terminate()) == [b]
        assert w.q.state is QS.TERMINATED
        assert w.queue_path()[-1] == "STOPPED>TERMINATED"
        assert w.path(b) == ["NEW>DELAYED", "DELAYED>PARKED", "PARKED>RETURNED"]

    async def test_terminated_rejects_start_and_send(self) -> None:
        """(TERMINATED, START) and (TERMINATED, SEND): REJECT with QueueTerminated."""
        w = World()
        w.q.start()
        await w.q.terminate()
        reject_type(w.q.start, envq.QueueTerminated)
        b = w.env("b")
        reject_type(lambda: w.q.send(b), envq.QueueTerminated)
        await areject_type(w.q.send_wait(b), envq.QueueTerminated)
        assert w.q.state is QS.TERMINATED

    async def test_terminated_stop_and_terminate_are_no_ops(self) -> None:
        """(TERMINATED, STOP) and (TERMINATED, TERMINATE) NOTHING."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        await w.q.stop(STOP)
        last = w.q.statistics()
        assert await w.q.terminate() == [b]
        events = len(w.events)
        report = await within(w.q.stop(), 0)
        assert report.complete is True
        assert await within(w.q.terminate(), 0) == []
        assert w.q.state is QS.TERMINATED
        assert len(w.events) == events
        assert last.state is QS.STOPPED


class TestAbandonRows:
    """(state, ABANDON): a worker task cancelled by someone other than envq (the loop
    closing). The tests cancel the queue's worker tasks as ``asyncio.run`` would."""

    @staticmethod
    def workers(w: World) -> list[asyncio.Task[Any]]:
        prefix = f"envq:{w.q.name}:worker-"
        return [t for t in asyncio.all_tasks() if t.get_name().startswith(prefix)]

    async def test_running_abandon_stops_cancelling_and_parking(self) -> None:
        """(RUNNING, ABANDON) BEGIN_STOP → STOPPING (a cancelling STOP): the attempt
        in flight ends CANCELLED and parked, the ready envelope is parked unrun, the
        stop completes, and the worker ends cancelled."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 50, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        [task] = self.workers(w)
        task.cancel()
        await settle()
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/CANCELLED"]
        assert w.path(b) == ["NEW>READY", "READY>PARKED"]
        assert w.runs("b") == []
        assert task.cancelled()
        assert await w.q.terminate() == [a, b]

    async def test_stopping_abandon_escalates(self) -> None:
        """(STOPPING, ABANDON) ESCALATE: a DRAIN stop waiting for ready work that no
        worker will run any more becomes a cancelling STOP: the ready envelope is
        parked unrun and the stop completes."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 50, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        assert (await w.q.stop(DRAIN, wait=False)).complete is False
        waiting = asyncio.ensure_future(w.q.stop())  # waits for the stop under way
        [task] = self.workers(w)
        task.cancel()
        await settle()
        assert w.q.state is QS.STOPPED
        report = await within(waiting, 0)
        assert report.cancelled == (a,)
        assert report.parked == (a, b)
        assert w.path(a)[-1] == "RUNNING>PARKED/CANCELLED"
        assert w.path(b) == ["NEW>READY", "READY>PARKED"]
        assert w.runs("b") == []
        assert now() == 1.0
        assert await w.q.terminate() == [a, b]

    @pytest.mark.parametrize("then", ["stopped", "terminated"])
    async def test_stopped_and_terminated_abandon_change_nothing(self, then: str) -> None:
        """(STOPPED, ABANDON) and (TERMINATED, ABANDON) NOTHING: workers told to retire
        by a stop, and cancelled before they ran again (the loop closing right after
        ``stop()`` or ``terminate()``), end cancelled; the queue does not change."""
        w = World(workers=2)
        w.q.start()
        await settle()  # the workers wait for work
        workers = self.workers(w)
        assert len(workers) == 2
        await w.q.stop()
        if then == "terminated":
            assert await w.q.terminate() == []
        state = w.q.state
        events = len(w.events)
        for task in workers:
            task.cancel()  # before they run again
        await settle()
        assert all(task.cancelled() for task in workers)
        assert w.q.state is state
        assert len(w.events) == events


# ---------------------------------------------------------------------------------------
# OUTCOMES: every (kind, outcome) row, with hooks and a retry policy that must (not) act
# ---------------------------------------------------------------------------------------

FAILURES = [("error", Outcome.ERROR), ("hang", Outcome.TIMEOUT)]
RETRY = envq.Retry(attempts=3, base=2, jitter=False)


class TestOneOffRows:
    @pytest.mark.parametrize("schedule", [envq.FIXED_DELAY, envq.FIXED_RATE])
    async def test_ok_succeeds(self, schedule: envq.Schedule) -> None:
        """(ONE_OFF, OK) SUCCEED → SUCCEEDED, on_success once (a one-off's schedule
        plays no part)."""
        w = World()
        a = w.env("a", schedule=schedule)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>SUCCEEDED/OK"]
        assert w.called() == [("success", "a")]
        assert w.by_state() == {ES.SUCCEEDED: 1}
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_without_hook_or_policy_fails(self, step: str, outcome: Outcome) -> None:
        """(ONE_OFF, ERROR|TIMEOUT) DECIDE → FAILED: no decision, no policy: dropped."""
        w = World()
        a = w.env("a", step, hooks=False, deadline=2)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", f"RUNNING>FAILED/{outcome.name}"]
        assert w.runs("a") == [0.0]
        assert w.by_state() == {ES.FAILED: 1}
        # The failure does not blacklist the (empty) type.
        b = w.env("b", hooks=False)
        w.q.send(b)
        await w.ended(b)
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_asks_on_failure(self, step: str, outcome: Outcome) -> None:
        """(ONE_OFF, ERROR|TIMEOUT) DECIDE: on_failure's decisions (retry_now → READY,
        retry_after → DELAYED, drop → FAILED) win over the Retry policy; attempt numbers
        count every attempt."""
        w = World()
        decisions = iter([envq.retry_now(), envq.retry_after(7), envq.drop()])
        a = w.env("a", step, step, step, decisions=decisions, deadline=2, retry=RETRY)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>READY" + end,
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>FAILED" + end,
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t, 2 * t + 7]
        exc = "TimeoutError" if outcome is Outcome.TIMEOUT else "ValueError"
        assert w.called() == [("failure", "a", exc, n) for n in (1, 2, 3)]
        assert w.by_state() == {ES.FAILED: 1}
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_follows_the_retry_policy(self, step: str, outcome: Outcome) -> None:
        """(ONE_OFF, ERROR|TIMEOUT) DECIDE without on_failure: the Retry policy
        (retry_after its backoff) until exhausted, then FAILED with MaxRetriesExceeded."""
        w = World()
        a = w.env("a", step, step, step, hooks=False, deadline=2, retry=RETRY)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>FAILED" + end,
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t + 2, 2 * t + 6]
        assert isinstance(w.cause(a), envq.MaxRetriesExceeded)
        await w.q.terminate()

    async def test_no_retry_reports_and_fails(self) -> None:
        """(ONE_OFF, NO_RETRY) REPORT_FAILURE → FAILED: on_failure is told (attempt 1),
        its retry decision and the Retry policy are ignored."""
        w = World()
        a = w.env("a", "no_retry", decisions=iter([envq.retry_now()]), retry=RETRY)
        b = w.env("b", "no_retry", hooks=False, retry=RETRY)
        w.q.start()
        w.q.send(a, b)
        await w.ended(a)
        await w.ended(b)
        await advance(100)
        for env in (a, b):
            assert w.path(env) == ["NEW>READY", "READY>RUNNING", "RUNNING>FAILED/NO_RETRY"]
        assert w.called() == [("failure", "a", "DoNotRetry", 1)]
        assert w.by_state() == {ES.FAILED: 2}
        await w.q.terminate()

    async def test_stop_envelope_ends_stopped_quietly(self) -> None:
        """(ONE_OFF, STOP) END → STOPPED: no hook, no retry, the type not blacklisted."""
        w = World()
        a = w.env("a", "stop", decisions=iter([envq.retry_now()]), retry=RETRY, type="t")
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP"]
        assert w.called() == []
        b = w.env("b", type="t")
        w.q.send(b)
        await w.ended(b)
        assert w.path(b)[-1] == "RUNNING>SUCCEEDED/OK"
        await w.q.terminate()

    async def test_stop_type_blacklists_and_stops(self) -> None:
        """(ONE_OFF, STOP_TYPE) BLACKLIST → STOPPED: no hook; waiting envelopes of the
        type are stopped (READY|DELAYED, BLACKLIST) and the type is refused."""
        w = World(workers=1)
        a = w.env("a", "stop_type", decisions=iter([envq.retry_now()]), retry=RETRY, type="t")
        r, d = w.env("r", type="t"), w.env("d", type="t", delay=30)
        other = w.env("o", type="u")
        w.q.start()
        w.q.send(a, r, d, other)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP_TYPE"]
        assert w.path(r) == ["NEW>READY", "READY>STOPPED"]
        assert w.path(d) == ["NEW>DELAYED", "DELAYED>STOPPED"]
        assert w.path(other)[-1] == "RUNNING>SUCCEEDED/OK"
        assert w.called() == [("success", "o")]
        reject_type(lambda: w.q.send(w.env("x", type="t")), envq.TypeBlacklisted)
        assert w.by_state() == {ES.STOPPED: 3, ES.SUCCEEDED: 1}
        await w.q.terminate()

    async def test_cancelled_by_stop_is_parked(self) -> None:
        """(ONE_OFF, CANCELLED) SHELVE, cause STOP → PARKED; no hook; runs on restart."""
        w = World()
        a = w.env("a", "hang", decisions=iter([envq.retry_now()]), retry=RETRY)
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await within(w.q.stop(STOP, cancel=True))
        assert report.cancelled == (a,)
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/CANCELLED"]
        assert w.called() == []
        w.q.start()
        await w.ended(a)
        assert w.path(a)[3:] == ["PARKED>READY", "READY>RUNNING", "RUNNING>SUCCEEDED/OK"]
        await w.q.terminate()

    async def test_cancelled_by_terminate_is_returned(self) -> None:
        """(ONE_OFF, CANCELLED) SHELVE, cause TERMINATE → RETURNED directly."""
        w = World()
        a = w.env("a", "hang", decisions=iter([envq.retry_now()]), retry=RETRY)
        w.q.start()
        w.q.send(a)
        await advance(1)
        assert await within(w.q.terminate()) == [a]
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>RETURNED/CANCELLED"]
        assert w.called() == []


class TestPeriodicRows:
    async def test_ok_reschedules_after_the_interval(self) -> None:
        """(PERIODIC, OK) RESCHEDULE → DELAYED: on_success each run, next run one
        interval after the end."""
        w = World()
        a = w.env("a", ("sleep", 1, "ok"), ("sleep", 1, "ok"), interval=10)
        w.q.start()
        w.q.send(a)
        await advance(25)
        assert w.runs("a") == [0.0, 11.0, 22.0]
        assert w.path(a)[:6] == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED/OK",
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED/OK",
        ]
        assert w.called()[:2] == [("success", "a"), ("success", "a")]
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_without_hook_waits_an_interval(
        self, step: str, outcome: Outcome
    ) -> None:
        """(PERIODIC, ERROR|TIMEOUT) DECIDE_PERIODIC without on_failure → DELAYED by the
        interval (a Retry policy plays no part)."""
        w = World()
        a = w.env("a", step, step, hooks=False, interval=10, deadline=2, retry=RETRY)
        w.q.start()
        w.q.send(a)
        await advance(25)
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, t + 10, 2 * t + 20]
        assert w.path(a)[:4] == [
            "NEW>READY",
            "READY>RUNNING",
            f"RUNNING>DELAYED/{outcome.name}",
            "DELAYED>READY",
        ]
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), FAILURES)
    async def test_failure_asks_on_failure(self, step: str, outcome: Outcome) -> None:
        """(PERIODIC, ERROR|TIMEOUT) DECIDE_PERIODIC: on_failure decides; its attempt
        number counts the failures since the last success."""
        w = World()
        decisions = iter([envq.retry_now(), envq.retry_after(3), envq.drop()])
        a = w.env("a", "ok", step, step, step, decisions=decisions, interval=10, deadline=2)
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        end = f"/{outcome.name}"
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>DELAYED/OK",
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>READY" + end,
            "READY>RUNNING",
            "RUNNING>DELAYED" + end,
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>FAILED" + end,
        ]
        t = 2.0 if outcome is Outcome.TIMEOUT else 0.0
        assert w.runs("a") == [0.0, 10.0, 10 + t, 10 + 2 * t + 3]
        exc = "TimeoutError" if outcome is Outcome.TIMEOUT else "ValueError"
        assert w.called() == [("success", "a")] + [("failure", "a", exc, n) for n in (1, 2, 3)]
        await w.q.terminate()

    async def test_no_retry_reports_and_fails(self) -> None:
        """(PERIODIC, NO_RETRY) REPORT_FAILURE → FAILED: on_failure told (failures since
        the last success + 1), its decision ignored."""
        w = World()
        a = w.env("a", "ok", "no_retry", decisions=iter([envq.retry_now()]), interval=10)
        b = w.env("b", "no_retry", hooks=False, interval=10)
        w.q.start()
        w.q.send(a, b)
        await w.ended(a)
        await w.ended(b)
        await advance(100)
        assert w.path(a)[-2:] == ["READY>RUNNING", "RUNNING>FAILED/NO_RETRY"]
        assert w.path(b) == ["NEW>READY", "READY>RUNNING", "RUNNING>FAILED/NO_RETRY"]
        assert w.called() == [("success", "a"), ("failure", "a", "DoNotRetry", 1)]
        assert w.by_state() == {ES.FAILED: 2}
        await w.q.terminate()

    async def test_stop_envelope_ends_stopped_quietly(self) -> None:
        """(PERIODIC, STOP) END → STOPPED: no hook, no next run, no blacklist."""
        w = World()
        a = w.env("a", "stop", decisions=iter([envq.retry_now()]), interval=10, type="t")
        w.q.start()
        w.q.send(a)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP"]
        assert w.called() == []
        w.q.send(w.env("b", type="t"))
        await w.q.terminate()

    async def test_stop_type_blacklists_and_stops(self) -> None:
        """(PERIODIC, STOP_TYPE) BLACKLIST → STOPPED: no hook; the type is refused."""
        w = World(workers=1)
        a = w.env("a", "stop_type", decisions=iter([envq.retry_now()]), interval=10, type="t")
        d = w.env("d", type="t", delay=30, interval=5)
        w.q.start()
        w.q.send(a, d)
        await w.ended(a)
        await advance(100)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/STOP_TYPE"]
        assert w.path(d) == ["NEW>DELAYED", "DELAYED>STOPPED"]
        assert w.called() == []
        reject_type(lambda: w.q.send(w.env("x", type="t")), envq.TypeBlacklisted)
        await w.q.terminate()

    async def test_cancelled_is_parked_or_returned(self) -> None:
        """(PERIODIC, CANCELLED) SHELVE: PARKED by a cancelling stop, RETURNED by
        terminate; no hook."""
        w = World()
        a = w.env("a", "hang", "hang", interval=10)
        w.q.start()
        w.q.send(a)
        await advance(1)
        await within(w.q.stop(STOP, cancel=True))
        w.q.start()
        await advance(1)
        assert await within(w.q.terminate()) == [a]
        assert w.path(a) == [
            "NEW>READY",
            "READY>RUNNING",
            "RUNNING>PARKED/CANCELLED",
            "PARKED>READY",
            "READY>RUNNING",
            "RUNNING>RETURNED/CANCELLED",
        ]
        assert w.called() == []


# ---------------------------------------------------------------------------------------
# OUTCOMES, kind BLACKLISTED: an attempt in flight when its type was blacklisted
# ---------------------------------------------------------------------------------------


class TestBlacklistedRows:
    @pytest.mark.parametrize(
        ("step", "outcome"),
        [
            ("ok", Outcome.OK),
            ("error", Outcome.ERROR),
            ("stop", Outcome.STOP),
            ("stop_type", Outcome.STOP_TYPE),
            ("no_retry", Outcome.NO_RETRY),
        ],
    )
    @pytest.mark.parametrize("interval", [0, 50])
    async def test_any_outcome_ends_stopped(
        self, step: str, outcome: Outcome, interval: float
    ) -> None:
        """(BLACKLISTED, *) END → STOPPED: whatever the attempt does, no hook, no retry."""
        w = World(workers=2)
        gate = asyncio.Event()
        v = w.env(
            "v",
            ("wait", gate, step),
            decisions=iter([envq.retry_now()]),
            type="t",
            interval=interval,
            retry=None if interval else RETRY,
        )
        culprit = w.env("c", ("sleep", 1, "stop_type"), type="t")
        w.q.start()
        w.q.send(v, culprit)
        await w.ended(culprit)
        gate.set()
        await w.ended(v)
        await advance(200)
        assert w.path(v) == ["NEW>READY", "READY>RUNNING", f"RUNNING>STOPPED/{outcome.name}"]
        assert w.called() == []
        assert w.runs("v") == [0.0]
        assert w.by_state() == {ES.STOPPED: 2}
        await w.q.terminate()

    async def test_timeout_ends_stopped(self) -> None:
        """(BLACKLISTED, TIMEOUT) END → STOPPED."""
        w = World(workers=2)
        v = w.env("v", "hang", decisions=iter([envq.retry_now()]), type="t", deadline=5)
        culprit = w.env("c", ("sleep", 1, "stop_type"), type="t")
        w.q.start()
        w.q.send(v, culprit)
        await w.ended(v)
        await advance(100)
        assert w.path(v) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/TIMEOUT"]
        assert w.called() == []
        assert w.runs("v") == [0.0]
        await w.q.terminate()

    @pytest.mark.parametrize("by", ["stop", "terminate"])
    async def test_cancelled_ends_stopped(self, by: str) -> None:
        """(BLACKLISTED, CANCELLED) END → STOPPED: neither parked nor handed back."""
        w = World(workers=2)
        v = w.env("v", "hang", decisions=iter([envq.retry_now()]), type="t")
        culprit = w.env("c", ("sleep", 1, "stop_type"), type="t")
        w.q.start()
        w.q.send(v, culprit)
        await w.ended(culprit)
        if by == "stop":
            report = await within(w.q.stop(STOP, cancel=True))
            assert report.parked == ()
            assert report.cancelled == (v,)
            assert await w.q.terminate() == []
        else:
            assert await within(w.q.terminate()) == []
        assert w.path(v) == ["NEW>READY", "READY>RUNNING", "RUNNING>STOPPED/CANCELLED"]
        assert w.called() == []
        assert w.by_state() == {ES.STOPPED: 2}


# ---------------------------------------------------------------------------------------
# DECISION_TARGET, SHELVE_TARGET, PARK_INSTEAD
# ---------------------------------------------------------------------------------------


class TestDecisionTargets:
    async def test_each_decision(self) -> None:
        """DECISION_TARGET: drop → FAILED, retry_now → READY (at once, no DELAYED step),
        retry_after(s) → DELAYED for s."""
        w = World(workers=3)
        d = w.env("d", "error", decisions=iter([envq.drop()]))
        n = w.env("n", "error", decisions=iter([envq.retry_now()]))
        a = w.env("a", "error", decisions=iter([envq.retry_after(4)]))
        w.q.start()
        w.q.send(d, n, a)
        for env in (d, n, a):
            await w.ended(env)
        assert w.path(d) == ["NEW>READY", "READY>RUNNING", "RUNNING>FAILED/ERROR"]
        assert w.timed(n)[2:4] == [("RUNNING>READY", 0.0), ("READY>RUNNING", 0.0)]
        assert w.timed(a)[2:4] == [("RUNNING>DELAYED", 0.0), ("DELAYED>READY", 4.0)]
        assert w.by_state() == {ES.FAILED: 1, ES.SUCCEEDED: 2}
        await w.q.terminate()


class TestParkInstead:
    async def test_retry_now_during_stop_is_parked(self) -> None:
        """PARK_INSTEAD[READY]: a retry_now decided while STOPPING parks the envelope
        (it does not run again during the stop); it runs on restart."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "error"), decisions=iter([envq.retry_now()]))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await within(w.q.stop(DRAIN))
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/ERROR"]
        assert w.runs("a") == [0.0]
        await advance(10)
        w.q.start()
        await w.ended(a)
        assert w.timed(a)[3:5] == [("PARKED>READY", 15.0), ("READY>RUNNING", 15.0)]
        await w.q.terminate()

    async def test_retry_after_during_stop_is_parked_with_its_delay(self) -> None:
        """PARK_INSTEAD[DELAYED]: a retry_after decided while STOPPING parks the
        envelope, which keeps its delay for the restart."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "error"), decisions=iter([envq.retry_after(3)]))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await within(w.q.stop(DRAIN))
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/ERROR"]
        await advance(10)
        w.q.start()
        await w.ended(a)
        assert w.timed(a)[3:5] == [("PARKED>DELAYED", 15.0), ("DELAYED>READY", 18.0)]
        await w.q.terminate()

    @pytest.mark.parametrize(("step", "outcome"), [("ok", Outcome.OK), *FAILURES])
    async def test_periodic_next_run_during_stop_is_parked(
        self, step: str, outcome: Outcome
    ) -> None:
        """PARK_INSTEAD[DELAYED] for a periodic run ending while STOPPING (OK, ERROR,
        TIMEOUT): parked with the interval still to wait."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 1, step), hooks=False, interval=10, deadline=2)
        w.q.start()
        w.q.send(a)
        await settle()
        report = await within(w.q.stop(DRAIN))
        assert report.parked == (a,)
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", f"RUNNING>PARKED/{outcome.name}"]
        end = now()
        assert end == (2.0 if outcome is Outcome.TIMEOUT else 1.0)
        w.q.start()
        await advance(11)
        assert w.timed(a)[3:5] == [("PARKED>DELAYED", end), ("DELAYED>READY", end + 10)]
        await w.q.terminate()


# ---------------------------------------------------------------------------------------
# ENVELOPE_MOVES: the queue-side moves not shown above
# ---------------------------------------------------------------------------------------


class TestEnvelopeMoves:
    async def test_stop_parks_ready_and_delayed_restart_rearms(self) -> None:
        """(READY, STOP) and (DELAYED, STOP) → PARKED; (PARKED, START) → READY, or
        DELAYED with the delay that was left."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "ok"))
        r, d = w.env("r"), w.env("d", delay=10)
        w.q.start()
        w.q.send(a, r, d)
        await advance(1)
        report = await within(w.q.stop(STOP))
        assert report.parked == (r, d)
        await advance(100 - now())
        w.q.start()
        await w.ended(d)
        assert w.timed(r)[1:3] == [("READY>PARKED", 1.0), ("PARKED>READY", 100.0)]
        assert w.timed(d)[1:4] == [
            ("DELAYED>PARKED", 1.0),
            ("PARKED>DELAYED", 100.0),
            ("DELAYED>READY", 109.0),
        ]
        await w.q.terminate()

    async def test_blacklist_stops_parked(self) -> None:
        """(PARKED, BLACKLIST) → STOPPED: a StopType during a stop."""
        w = World(workers=1)
        c = w.env("c", ("sleep", 5, "stop_type"), type="t")
        p = w.env("p", type="t")
        w.q.start()
        w.q.send(c, p)
        await advance(1)
        report = await within(w.q.stop(STOP))
        assert report.parked == ()
        assert w.path(p) == ["NEW>READY", "READY>PARKED", "PARKED>STOPPED"]
        assert await w.q.terminate() == []


# ---------------------------------------------------------------------------------------
# DISPATCHING, TERMINAL_STATES, LIVE_STATES
# ---------------------------------------------------------------------------------------


class TestDispatching:
    async def test_drain_stop_runs_ready_envelopes(self) -> None:
        """STOPPING dispatches: a DRAIN stop runs what is READY."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        report = await within(w.q.stop(DRAIN))
        assert report.completed == (a, b)
        assert w.runs("b") == [5.0]
        await w.q.terminate()

    async def test_workers_of_a_stopped_queue_retire(self) -> None:
        """STOPPED does not dispatch: the worker that ended the stop retires, so after a
        restart there is still one worker (one attempt at a time), not two."""
        w = World(workers=1)
        a = w.env("a", ("sleep", 5, "ok"))
        w.q.start()
        w.q.send(a)
        await advance(1)
        await within(w.q.stop(STOP))
        w.q.start()
        await settle()  # the new worker goes idle
        b, c = w.env("b", ("sleep", 5, "ok")), w.env("c", ("sleep", 5, "ok"))
        w.q.send(b, c)
        await w.ended(c)
        assert (w.runs("b"), w.runs("c")) == ([5.0], [10.0])
        await w.q.terminate()


class TestStatistics:
    async def test_by_state_counts_every_live_and_terminal_state(self) -> None:
        """``by_state`` has exactly the live and terminal states as keys, at every stage."""
        keys = {ES.BUFFERED, ES.READY, ES.DELAYED, ES.RUNNING, ES.PARKED}
        keys |= {ES.SUCCEEDED, ES.FAILED, ES.STOPPED, ES.RETURNED}
        w = World(workers=1)

        def full() -> dict[EnvState, int]:
            by_state = dict(w.q.statistics().by_state)
            assert set(by_state) == keys
            return {s: n for s, n in by_state.items() if n}

        assert full() == {}
        w.q.send(w.env("b0"))
        assert full() == {ES.BUFFERED: 1}
        w.q.start()
        w.q.send(
            w.env("a", ("sleep", 5, "ok")),
            w.env("r"),
            w.env("d", delay=50),
            w.env("f", "error"),
            w.env("s", "stop"),
        )
        await settle()
        assert full() == {ES.SUCCEEDED: 1, ES.RUNNING: 1, ES.READY: 3, ES.DELAYED: 1}
        await advance(6)
        assert full() == {ES.DELAYED: 1, ES.SUCCEEDED: 3, ES.FAILED: 1, ES.STOPPED: 1}
        await w.q.stop(STOP)
        assert full() == {ES.PARKED: 1, ES.SUCCEEDED: 3, ES.FAILED: 1, ES.STOPPED: 1}
        await w.q.terminate()
        assert full() == {ES.RETURNED: 1, ES.SUCCEEDED: 3, ES.FAILED: 1, ES.STOPPED: 1}
