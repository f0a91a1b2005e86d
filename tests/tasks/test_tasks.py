"""The dowork-style task API on virtual time (docs/retries.md, "Tasks from async code"):
Task, TaskQueue, and the global ``submit``/``enqueue``/``shutdown`` from coroutines."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

import envq
from tests.support import gaps, now


def wall_now() -> dt.datetime:
    loop = asyncio.get_running_loop()
    wall = loop.wall_time()  # type: ignore[attr-defined]
    return dt.datetime.fromtimestamp(wall, tz=dt.UTC)


class Flaky:
    """An async task function that records its start times and fails the first ``fails``."""

    def __init__(self, fails: int = 0, value: Any = "done", takes: float = 0.0) -> None:
        self.fails = fails
        self.value = value
        self.takes = takes
        self.times: list[float] = []

    async def __call__(self) -> Any:
        self.times.append(now())
        if self.takes:
            await asyncio.sleep(self.takes)
        if len(self.times) <= self.fails:
            raise ValueError(f"failure {len(self.times)}")
        return self.value


async def noop() -> None:
    return None


# --------------------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------------------


class TestBuilder:
    def test_chain_returns_the_task(self) -> None:
        """Every builder method returns the task itself, so calls chain."""
        t = envq.Task(noop)
        same = (
            t.retries(5)
            .max_timeout(600)
            .within(10)
            .after(lambda e: None)
            .not_before(dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
            .no_jitter()
            .backoff(2)
        )
        assert same is t

    def test_defaults_are_doworks(self) -> None:
        """A new task: one attempt, backoff from 1 s capped at 30 minutes, jitter on."""
        r = envq.Task(noop).retry
        assert (r.attempts, r.base, r.cap, r.jitter) == (1, 1.0, 1800.0, True)

    def test_settings_become_the_retry_policy(self) -> None:
        """retries/backoff/max_timeout/no_jitter set the task's envq.Retry."""
        r = envq.Task(noop).retries(4).backoff(dt.timedelta(seconds=3)).max_timeout(60).no_jitter()
        assert (r.retry.attempts, r.retry.base, r.retry.cap, r.retry.jitter) == (
            4,
            3.0,
            60.0,
            False,
        )

    @pytest.mark.parametrize("cap", [0, None])
    def test_no_cap(self, cap: float | None) -> None:
        """max_timeout(0) or max_timeout(None) lets the backoff grow without a cap."""
        r = envq.Task(noop).retries(-1).max_timeout(cap).no_jitter().retry
        assert r.delay(40) == 2.0**39

    def test_fresh_state(self) -> None:
        """A new task has no attempts, is not done, and has no result yet."""
        t = envq.Task(noop)
        assert (t.attempts, t.done, t.next_attempt) == (0, False, None)
        with pytest.raises(RuntimeError, match="not ended"):
            _ = t.result
        assert not t.future.done()

    @pytest.mark.parametrize(
        ("method", "value"),
        [
            ("retries", 0),
            ("retries", -2),
            ("max_timeout", -1),
            ("max_timeout", float("inf")),
            ("within", float("nan")),
            ("within", -1),
            ("backoff", -1),
            ("not_before", dt.datetime(2030, 1, 1)),  # naive
        ],
    )
    def test_bad_values(self, method: str, value: Any) -> None:
        """Out-of-range builder values raise ValueError naming the method."""
        with pytest.raises(ValueError, match=method):
            getattr(envq.Task(noop), method)(value)

    @pytest.mark.parametrize(
        ("method", "value"),
        [
            ("retries", 2.0),
            ("retries", True),
            ("max_timeout", "600"),
            ("within", None),
            ("backoff", "1"),
            ("after", "not callable"),
            ("not_before", "tomorrow"),
        ],
    )
    def test_bad_types(self, method: str, value: Any) -> None:
        """Builder values of the wrong type raise TypeError naming the method."""
        with pytest.raises(TypeError, match=method):
            getattr(envq.Task(noop), method)(value)

    def test_fn_must_be_callable(self) -> None:
        """Task(fn) needs a callable."""
        with pytest.raises(TypeError, match="callable"):
            envq.Task(42)  # type: ignore[arg-type]

    async def test_settings_are_fixed_once_queued(self) -> None:
        """Configuring a task after it was queued raises RuntimeError."""
        t = envq.Task(noop)
        async with envq.TaskQueue() as q:
            q.enqueue(t)
            with pytest.raises(RuntimeError, match="after it was queued"):
                t.retries(3)


# --------------------------------------------------------------------------------------
# Running tasks
# --------------------------------------------------------------------------------------


class TestOutcome:
    async def test_success(self) -> None:
        """A task that returns ends done, with result None and its value on the future."""
        fn = Flaky(value=42)
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn))
            assert await t == 42
        assert (t.done, t.attempts, t.result) == (True, 1, None)
        assert t.future.result() == 42

    async def test_plain_function_runs_in_a_thread(self) -> None:
        """A plain function runs off the loop's thread; its return value is the result."""
        async with envq.TaskQueue() as q:
            t = q.submit(threading.current_thread)
            thread = await t
        assert thread is not threading.current_thread()

    async def test_plain_function_returning_a_coroutine(self) -> None:
        """A plain function that returns an awaitable has it awaited on the loop."""

        async def send(x: int) -> int:
            await asyncio.sleep(1)
            return x * 2

        async with envq.TaskQueue() as q:
            t = q.submit(lambda: send(21))
            assert await t == 42
        assert now() == 1

    async def test_retries_with_exact_backoff_then_max_retries(self) -> None:
        """Failed attempts are retried after 1, 2, 4 s; when the attempts run out the task
        ends with MaxRetriesExceeded caused by the last error."""
        fn = Flaky(fails=99)
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn).retries(4).no_jitter())
            with pytest.raises(envq.MaxRetriesExceeded) as info:
                await t
        assert fn.times == [0, 1, 3, 7]
        assert t.attempts == 4
        assert isinstance(info.value.__cause__, ValueError)
        assert str(info.value.__cause__) == "failure 4"
        assert t.result is info.value

    async def test_single_attempt_failure_is_the_users_own_error(self) -> None:
        """With no retries configured a failure ends with the function's own error (not
        MaxRetriesExceeded wrapping it), in ``result``, ``after`` and the future."""
        seen: list[BaseException | None] = []
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(Flaky(fails=1)).after(seen.append))
            await q.dispatch()
        assert type(t.result) is ValueError
        assert str(t.result) == "failure 1"
        assert seen == [t.result]
        assert t.future.exception() is t.result
        assert t.attempts == 1

    async def test_success_after_retries(self) -> None:
        """A task that succeeds on a retry ends with result None and the value."""
        fn = Flaky(fails=2, value="ok")
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn).retries(5).no_jitter())
            assert await t == "ok"
        assert t.result is None
        assert fn.times == [0, 1, 3]

    async def test_dowork_backoff(self) -> None:
        """backoff(120) with the default cap gives dowork's 2, 4, 8, 16, 30, 30 minutes."""
        fn = Flaky(fails=99)
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn).retries(7).backoff(120).no_jitter())
            await q.shutdown()
        assert gaps(fn.times) == [120, 240, 480, 960, 1800, 1800]
        assert t.done

    async def test_max_timeout_caps_the_backoff(self) -> None:
        """max_timeout bounds every wait between attempts."""
        fn = Flaky(fails=99)
        async with envq.TaskQueue() as q:
            q.enqueue(envq.Task(fn).retries(6).max_timeout(5).no_jitter())
        assert gaps(fn.times) == [1, 2, 4, 5, 5]

    async def test_jitter_within_half_to_full_delay(self) -> None:
        """With jitter each wait is in [d/2, d]; a seeded rng makes it repeatable."""

        async def waits(seed: int) -> list[float]:
            fn = Flaky(fails=99)
            async with envq.TaskQueue() as q:
                q.enqueue(envq.Task(fn).rng(random.Random(seed)).retries(7).backoff(4))
            return gaps(fn.times)

        first, second = await waits(3), await waits(3)
        nominal = [4, 8, 16, 32, 64, 128]
        assert first == pytest.approx(second)
        assert all(d / 2 - 1e-9 <= got <= d + 1e-9 for got, d in zip(first, nominal, strict=True))
        assert first != pytest.approx(nominal)

    async def test_within_times_out_each_attempt(self) -> None:
        """within() bounds each attempt; an overrun fails with TimeoutError and is retried."""
        fn = Flaky(takes=10)
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn).retries(2).within(3).no_jitter())
        assert fn.times == [0, 4]
        assert isinstance(t.result, envq.MaxRetriesExceeded)
        assert isinstance(t.result.__cause__, TimeoutError)

    async def test_do_not_retry_ends_at_once(self) -> None:
        """DoNotRetry ends the task after one attempt, with that error as the result."""

        async def refuse() -> None:
            raise envq.DoNotRetry("bad input")

        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(refuse).retries(5))
        assert t.attempts == 1
        assert isinstance(t.result, envq.DoNotRetry)

    async def test_unlimited_retries(self) -> None:
        """retries(-1) attempts until the task succeeds."""
        fn = Flaky(fails=20)
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn).retries(-1).max_timeout(2).no_jitter())
        assert t.attempts == 21
        assert t.result is None

    async def test_stop_envelope_ends_the_task(self) -> None:
        """StopEnvelope raised by a task ends it, with the signal as its result."""

        async def stop() -> None:
            raise envq.StopEnvelope()

        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(stop).retries(3))
        assert t.done
        assert isinstance(t.result, envq.StopEnvelope)
        assert t.attempts == 1


class TestSchedule:
    async def test_not_before(self) -> None:
        """The first attempt waits until not_before (the loop's virtual wall clock)."""
        fn = Flaky()
        when = wall_now() + dt.timedelta(seconds=30)
        t = envq.Task(fn).not_before(when)
        assert t.next_attempt == when
        async with envq.TaskQueue() as q:
            q.enqueue(t)
            assert t.next_attempt is not None
            assert abs((t.next_attempt - when).total_seconds()) < 1e-3
        assert fn.times == [pytest.approx(30, abs=1e-3)]

    async def test_next_attempt_follows_the_backoff(self) -> None:
        """After a failure, next_attempt is when the retry is due; None once done."""
        fn = Flaky(fails=1)
        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(fn).retries(2).backoff(8).no_jitter())
            assert await q.dispatch() is True
            expected = wall_now() + dt.timedelta(seconds=8)
            assert t.next_attempt is not None
            assert abs((t.next_attempt - expected).total_seconds()) < 1e-3
            await t
            assert t.next_attempt is None

    async def test_next_attempt_none_while_running(self) -> None:
        """While an attempt runs, no next attempt is scheduled."""
        seen: list[dt.datetime | None] = []
        holder: list[envq.Task] = []

        async def look() -> None:
            seen.append(holder[0].next_attempt)

        t = envq.Task(look)
        holder.append(t)
        async with envq.TaskQueue() as q:
            q.enqueue(t)
        assert seen == [None]


class TestAfter:
    async def test_called_once_with_none_on_success(self) -> None:
        """after(cb) runs once with None when the task succeeds."""
        got: list[BaseException | None] = []
        async with envq.TaskQueue() as q:
            q.enqueue(envq.Task(Flaky(fails=1)).retries(3).after(got.append))
        assert got == [None]

    async def test_called_once_with_the_final_error(self) -> None:
        """after(cb) runs once with MaxRetriesExceeded, whose cause is the last error."""
        got: list[BaseException | None] = []
        async with envq.TaskQueue() as q:
            q.enqueue(envq.Task(Flaky(fails=9)).retries(3).after(got.append))
        assert len(got) == 1
        assert isinstance(got[0], envq.MaxRetriesExceeded)
        assert str(got[0].__cause__) == "failure 3"

    async def test_sync_and_async_callbacks_in_order(self) -> None:
        """Several callbacks, plain and async, run in the order they were added."""
        order: list[str] = []

        async def second(err: BaseException | None) -> None:
            await asyncio.sleep(1)
            order.append("async")

        t = (
            envq.Task(noop)
            .after(lambda e: order.append("plain"))
            .after(second)
            .after(lambda e: order.append("last"))
        )
        async with envq.TaskQueue() as q:
            q.enqueue(t)
        assert order == ["plain", "async", "last"]

    async def test_future_resolves_after_the_callbacks(self) -> None:
        """By the time the task's future is done, its after callbacks have run."""
        ran: list[float] = []

        async def slow_cb(err: BaseException | None) -> None:
            await asyncio.sleep(5)
            ran.append(now())

        async with envq.TaskQueue() as q:
            t = q.enqueue(envq.Task(noop).after(slow_cb))
            await t
            assert ran == [5]
            assert t.done

    async def test_failing_callback_is_logged(self, caplog: pytest.LogCaptureFixture) -> None:
        """A callback that raises is logged; later callbacks and the future are unaffected."""
        got: list[BaseException | None] = []

        def bad(err: BaseException | None) -> None:
            raise RuntimeError("callback broke")

        with caplog.at_level(logging.ERROR, logger="envq"):
            async with envq.TaskQueue() as q:
                t = q.enqueue(envq.Task(Flaky(value=7)).after(bad).after(got.append))
                assert await t == 7
        assert got == [None]
        assert "after callback" in caplog.text


class TestOnce:
    async def test_completed_task_cannot_run_again(self) -> None:
        """Re-queueing a task that succeeded raises AlreadyComplete, here or elsewhere."""
        t = envq.Task(noop)
        async with envq.TaskQueue() as q:
            q.enqueue(t)
            await t
            with pytest.raises(envq.AlreadyComplete):
                q.enqueue(t)
        async with envq.TaskQueue("other") as other:
            with pytest.raises(envq.AlreadyComplete):
                other.enqueue(t)

    async def test_failed_task_cannot_run_again(self) -> None:
        """A task that failed for good has ended too: AlreadyComplete."""
        t = envq.Task(Flaky(fails=1))
        async with envq.TaskQueue() as q:
            q.enqueue(t)
            await q.dispatch()
            with pytest.raises(envq.AlreadyComplete):
                q.enqueue(t)

    async def test_queued_twice_runs_once(self) -> None:
        """Queueing a task that is already queued there leaves it as it is."""
        fn = Flaky()
        t = envq.Task(fn)
        async with envq.TaskQueue() as q:
            assert q.enqueue(t) is q.enqueue(t)
            assert q.pending == 1
        assert len(fn.times) == 1

    async def test_queued_in_two_queues(self) -> None:
        """A task queued in one task queue cannot be queued in another (BadEnvelope)."""
        t = envq.Task(Flaky(takes=5))
        async with envq.TaskQueue("a") as a, envq.TaskQueue("b") as b:
            a.enqueue(t)
            with pytest.raises(envq.BadEnvelope, match="already queued"):
                b.enqueue(t)

    async def test_not_a_task(self) -> None:
        """enqueue() of something that is not a Task raises BadEnvelopeType (a
        TypeError, and a BadEnvelope as before), with a hint for a function."""
        async with envq.TaskQueue() as q:
            with pytest.raises(envq.BadEnvelopeType, match=r"must be a Task.*submit\(fn"):
                q.enqueue(noop)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# The task queue
# --------------------------------------------------------------------------------------


class TestDispatch:
    async def test_runs_what_is_due_and_reports_more(self) -> None:
        """dispatch() runs the due tasks once and says whether tasks remain."""
        retried = Flaky(fails=1)
        later = Flaky()
        q = envq.TaskQueue()
        q.enqueue(envq.Task(retried).retries(2).backoff(10).no_jitter())
        q.enqueue(envq.Task(later).not_before(wall_now() + dt.timedelta(seconds=60)))
        q.enqueue(envq.Task(Flaky()))
        assert await q.dispatch() is True
        assert now() == 0
        assert (retried.times, later.times) == ([0], [])
        await asyncio.sleep(61)
        assert await q.dispatch() is False
        assert retried.times == [0, 10]
        assert later.times == [pytest.approx(60, abs=1e-3)]
        await q.shutdown()

    async def test_dispatch_loop(self) -> None:
        """The dowork pattern — dispatch, sleep, repeat — ends with every task done."""
        q = envq.TaskQueue(workers=2)
        tasks = [q.enqueue(envq.Task(Flaky(fails=n)).retries(4).no_jitter()) for n in range(4)]
        rounds = 0
        while await q.dispatch():
            rounds += 1
            await asyncio.sleep(1)
        assert all(t.done for t in tasks)
        assert [t.result is None for t in tasks] == [True, True, True, True]
        assert rounds > 0
        await q.shutdown()

    async def test_waits_for_the_attempts_and_callbacks(self) -> None:
        """dispatch() returns only after the due attempts and their after callbacks finished."""
        done: list[float] = []

        async def cb(err: BaseException | None) -> None:
            await asyncio.sleep(2)
            done.append(now())

        q = envq.TaskQueue()
        q.enqueue(envq.Task(Flaky(takes=3)).after(cb))
        assert await q.dispatch() is False
        assert done == [5]
        await q.shutdown()

    async def test_retries_due_at_once_run_in_the_same_dispatch(self) -> None:
        """With backoff 0 the retries are due at once, so one dispatch() runs them all."""
        fn = Flaky(fails=2)
        q = envq.TaskQueue()
        t = q.enqueue(envq.Task(fn).retries(3).backoff(0))
        assert await q.dispatch() is False
        assert fn.times == [0, 0, 0]
        assert t.result is None
        await q.shutdown()

    async def test_empty(self) -> None:
        """dispatch() on an empty queue returns False at once."""
        q = envq.TaskQueue()
        assert await q.dispatch() is False
        await q.shutdown()


class TestRun:
    async def test_runs_until_cancelled_and_resumes(self) -> None:
        """run() runs tasks until cancelled; held tasks keep their delay and resume on the
        next run(), and tasks queued meanwhile wait for it."""
        fn = Flaky(fails=1)
        q = envq.TaskQueue()
        q.enqueue(envq.Task(fn).retries(2).backoff(10).no_jitter())
        runner = asyncio.create_task(q.run())
        await asyncio.sleep(4)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        await q.queue.wait_stopped()
        late = Flaky()
        q.enqueue(envq.Task(late))
        await asyncio.sleep(100)
        assert (fn.times, late.times) == ([0], [])
        runner = asyncio.create_task(q.run())
        await asyncio.sleep(20)
        assert fn.times == [0, 110]
        assert late.times == [104]
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        await q.shutdown()

    async def test_returns_when_shut_down(self) -> None:
        """run() returns once shutdown() has finished."""
        q = envq.TaskQueue()
        runner = asyncio.create_task(q.run())
        q.enqueue(envq.Task(Flaky(takes=5)))
        await asyncio.sleep(1)
        await q.shutdown()
        await asyncio.wait_for(runner, 1)
        assert now() == 5

    async def test_only_once_at_a_time(self) -> None:
        """A second concurrent run() raises RuntimeError."""
        q = envq.TaskQueue()
        runner = asyncio.create_task(q.run())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already running"):
            await q.run()
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        await q.shutdown()


class TestShutdown:
    async def test_refuses_new_tasks_and_waits_for_queued_ones(self) -> None:
        """shutdown() refuses new tasks at once and returns when every queued task (its
        retries included) has ended."""
        fn = Flaky(fails=2)
        q = envq.TaskQueue()
        q.start()
        t = q.enqueue(envq.Task(fn).retries(3).backoff(50).no_jitter())
        closing = asyncio.create_task(q.shutdown())
        await asyncio.sleep(0)
        assert q.shutting_down
        with pytest.raises(envq.QueueShuttingDown):
            q.submit(noop)
        await closing
        assert t.done
        assert t.result is None
        assert fn.times == [0, 50, 150]
        assert q.closed
        assert q.queue.state is envq.QueueState.TERMINATED

    async def test_waits_for_after_callbacks(self) -> None:
        """shutdown() also waits for the after callbacks of tasks that ended."""
        ran: list[float] = []

        async def cb(err: BaseException | None) -> None:
            await asyncio.sleep(7)
            ran.append(now())

        q = envq.TaskQueue()
        q.enqueue(envq.Task(noop).after(cb))
        await q.shutdown()
        assert ran == [7]

    async def test_idempotent(self) -> None:
        """A second shutdown() returns at once; enqueue still refuses."""
        q = envq.TaskQueue()
        await q.shutdown()
        await q.shutdown()
        with pytest.raises(envq.QueueShuttingDown):
            q.enqueue(envq.Task(noop))
        with pytest.raises(envq.QueueShuttingDown):
            q.start()

    async def test_shutdown_of_a_never_started_queue_runs_its_tasks(self) -> None:
        """Tasks queued before any start still run when the queue shuts down."""
        fn = Flaky()
        q = envq.TaskQueue()
        q.enqueue(envq.Task(fn))
        await q.shutdown()
        assert fn.times == [0]

    async def test_shutdown_after_a_cancelled_run_runs_held_tasks(self) -> None:
        """Tasks held by a cancelled run() are run by shutdown(), nothing is lost."""
        fn = Flaky(fails=1)
        q = envq.TaskQueue()
        q.enqueue(envq.Task(fn).retries(2).backoff(10).no_jitter())
        runner = asyncio.create_task(q.run())
        await asyncio.sleep(1)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        await q.shutdown()
        assert fn.times == [0, 10]

    async def test_shutdown_runs_tasks_enqueued_while_stopped(self) -> None:
        """Tasks enqueued while the queue is stopped (after a cancelled run()) are held,
        not run; shutdown() runs them to their end (after callbacks and futures
        included) before it returns: none is silently dropped."""
        first, second = Flaky(value=1), Flaky(fails=1, value=2)
        called: list[tuple[str, BaseException | None, float]] = []

        async def after(err: BaseException | None) -> None:
            called.append(("a", err, now()))

        q = envq.TaskQueue()
        runner = asyncio.create_task(q.run())
        await asyncio.sleep(1)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        assert q.queue.state is envq.QueueState.STOPPED
        a = q.enqueue(envq.Task(first).after(after))
        b = q.enqueue(envq.Task(second).retries(2).backoff(3).no_jitter())
        await asyncio.sleep(10)
        assert first.times == second.times == []  # held while stopped
        assert q.pending == 2
        await q.shutdown()
        assert first.times == [11.0]
        assert second.times == [11.0, 14.0]
        assert a.done
        assert b.done
        assert (a.result, b.result) == (None, None)
        assert (await a, await b) == (1, 2)
        assert called == [("a", None, 11.0)]
        assert q.pending == 0
        assert q.queue.state is envq.QueueState.TERMINATED

    async def test_from_inside_a_task(self) -> None:
        """shutdown() from one of the queue's own tasks raises RuntimeError."""
        q = envq.TaskQueue()
        errors: list[BaseException] = []

        async def inner() -> None:
            try:
                await q.shutdown()
            except RuntimeError as exc:
                errors.append(exc)

        q.enqueue(envq.Task(inner))
        await q.shutdown()
        assert len(errors) == 1
        assert "would wait for itself" in str(errors[0])

    async def test_many_in_parallel(self) -> None:
        """envq.shutdown(a, b) shuts queues down in parallel."""
        a, b = envq.TaskQueue("a"), envq.TaskQueue("b")
        a.enqueue(envq.Task(Flaky(takes=10)))
        b.enqueue(envq.Task(Flaky(takes=15)))
        await envq.shutdown(a, b)
        assert now() == 15
        assert a.closed
        assert b.closed


class TestQueueOptions:
    async def test_capacity(self) -> None:
        """Beyond capacity enqueue raises CapacityExceeded and the task stays free."""
        t = envq.Task(noop)
        async with envq.TaskQueue(capacity=1) as q:
            q.enqueue(envq.Task(Flaky(takes=5)))
            with pytest.raises(envq.CapacityExceeded):
                q.enqueue(t)
        async with envq.TaskQueue("other") as other:
            other.enqueue(t)
        assert t.done

    async def test_limiter_spaces_retries(self) -> None:
        """TaskQueue(limiter=...) makes every retry wait at least what the limiter says."""
        fn = Flaky(fails=3)
        async with envq.TaskQueue(limiter=envq.FastSlow(fast=0, slow=60, fast_attempts=1)) as q:
            q.enqueue(envq.Task(fn).retries(5).no_jitter())
        assert gaps(fn.times) == [1, 60, 60]

    async def test_rate_throttles_tasks(self) -> None:
        """TaskQueue(rate=TokenBucket(...)) limits how fast tasks start."""
        starts: list[float] = []

        async def work() -> None:
            starts.append(now())

        async with envq.TaskQueue(rate=envq.TokenBucket(rate=2, burst=1), workers=4) as q:
            for _ in range(5):
                q.submit(work)
        assert starts == [0, 0.5, 1.0, 1.5, 2.0]

    async def test_workers_run_tasks_concurrently(self) -> None:
        """With workers=3, three slow tasks run side by side."""
        async with envq.TaskQueue(workers=3) as q:
            for _ in range(3):
                q.enqueue(envq.Task(Flaky(takes=10)))
        assert now() == 10

    async def test_other_thread_is_refused(self) -> None:
        """Queueing into a started TaskQueue from another thread raises RuntimeError."""
        errors: list[BaseException] = []
        async with envq.TaskQueue() as q:

            def other() -> None:
                try:
                    q.submit(noop)
                except RuntimeError as exc:
                    errors.append(exc)

            await asyncio.to_thread(other)
        assert len(errors) == 1
        assert "BackgroundQueue" in str(errors[0])

    def test_bad_options(self) -> None:
        """Bad queue options raise ValueError."""
        with pytest.raises(ValueError, match="name"):
            envq.TaskQueue("bad\nname")
        with pytest.raises(ValueError, match="threads"):
            envq.TaskQueue(threads=0)


# --------------------------------------------------------------------------------------
# The global queue from coroutines
# --------------------------------------------------------------------------------------


class TestGlobalAsync:
    async def test_submit_runs_on_the_running_loop(self) -> None:
        """envq.submit() from a coroutine runs async work on the caller's event loop."""
        loop = asyncio.get_running_loop()

        async def where() -> asyncio.AbstractEventLoop:
            return asyncio.get_running_loop()

        t = envq.submit(where)
        assert await t is loop
        await envq.shutdown()

    async def test_enqueue_and_shutdown_wait(self) -> None:
        """envq.enqueue() queues a configured task; envq.shutdown() waits for it."""
        fn = Flaky(fails=2)
        t = envq.enqueue(envq.Task(fn).retries(3).no_jitter())
        await envq.shutdown()
        assert t.done
        assert t.result is None
        assert fn.times == [0, 1, 3]

    async def test_refused_while_shutting_down_then_fresh(self) -> None:
        """While the global queue shuts down it refuses tasks; afterwards a fresh one starts."""
        envq.submit(Flaky(takes=5))
        closing = asyncio.ensure_future(envq.shutdown())
        await asyncio.sleep(1)
        with pytest.raises(envq.QueueShuttingDown):
            envq.submit(noop)
        await closing
        t = envq.submit(Flaky(value=3))
        assert await t == 3
        await envq.shutdown()

    async def test_shutdown_with_nothing_started(self) -> None:
        """envq.shutdown() with no global queue started returns at once."""
        await envq.shutdown()
        assert now() == 0


def test_exports_are_documented() -> None:
    """Every name this issue adds to envq has a docstring."""
    names: list[Callable[..., Any] | type] = [
        envq.Task,
        envq.TaskQueue,
        envq.BackgroundQueue,
        envq.submit,
        envq.enqueue,
        envq.shutdown,
        envq.MaxOf,
        envq.FastSlow,
        envq.default_limiter,
    ]
    for obj in names:
        assert obj.__doc__, obj
    for cls in (envq.Task, envq.TaskQueue, envq.BackgroundQueue):
        for name, member in vars(cls).items():
            if not name.startswith("_") and (callable(member) or isinstance(member, property)):
                assert member.__doc__, f"{cls.__name__}.{name}"
