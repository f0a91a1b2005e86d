"""Deadlines and threads (docs/outcomes.md, Deadlines): what a deadline bounds, and plain callables.

A deadline bounds ``before``, the invoker chain and ``after`` of one attempt and is
measured on the loop's (virtual) clock. Plain ``def`` callables run in the queue's
thread pool; a deadline stops waiting for them, reports TIMEOUT and counts the thread
as stuck.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

import envq
from envq import EnvState, Outcome
from tests.support import running, sleeper


async def settle_threads(queue: envq.Queue) -> int:
    """Give finished executor calls a chance to be noticed; return the stuck count."""
    for _ in range(200):
        if queue.statistics().stuck_threads == 0:
            break
        await asyncio.to_thread(lambda: None)
    return queue.statistics().stuck_threads


class TestDeadline:
    async def test_overrun_is_timeout_at_the_deadline(self) -> None:
        """An invoke overrunning the deadline is cancelled; the attempt is TIMEOUT right then."""
        log: list[str] = []
        env = envq.Envelope(invoke=sleeper(100, log, "invoke"), deadline=5)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert isinstance(final.cause, TimeoutError)
            assert final.time == pytest.approx(5)
        assert log == ["invoke start", "invoke cancelled"]

    async def test_finishing_inside_the_deadline_is_ok(self) -> None:
        """An invoke that returns just before the deadline is OK."""
        env = envq.Envelope(invoke=sleeper(4.99), deadline=5)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK

    async def test_zero_deadline_is_unbounded(self) -> None:
        """deadline=0 puts no bound on the invoker chain."""
        env = envq.Envelope(invoke=sleeper(10_000))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
            assert final.time == pytest.approx(10_000)

    async def test_deadline_covers_before_and_invoke(self) -> None:
        """The deadline bounds before and invoke together, not each on its own."""
        log: list[str] = []
        env = envq.Envelope(
            invoke=sleeper(3, log, "invoke"), before=sleeper(3, log, "before"), deadline=5
        )
        hook_timeout = envq.HookTimeout(fraction=1.0, floor=50)
        async with running(hook_timeout=hook_timeout) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert final.time == pytest.approx(5)
        assert log == ["before start", "before end", "invoke start", "invoke cancelled"]

    async def test_deadline_covers_stamps(self) -> None:
        """Time spent in stamps counts against the deadline."""

        def slow_stamp(nxt: envq.Invoker) -> envq.Invoker:
            async def wrapped(env: envq.Envelope) -> None:
                await asyncio.sleep(3)
                await nxt(env)

            return wrapped

        env = envq.Envelope(invoke=sleeper(3), stamps=[slow_stamp], deadline=5)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert final.time == pytest.approx(5)

    async def test_deadline_is_per_attempt(self) -> None:
        """Each attempt gets the full deadline again."""
        calls: list[float] = []

        async def invoke(env: envq.Envelope) -> None:
            calls.append(asyncio.get_running_loop().time())
            await asyncio.sleep(100)

        env = envq.Envelope(
            invoke=invoke, deadline=5, retry=envq.Retry(attempts=2, base=1, jitter=False)
        )
        async with running() as (q, rec):
            q.send(env)
            await rec.ended(env)
            ends = rec.ends(env)
            assert [e.outcome for e in ends] == [Outcome.TIMEOUT, Outcome.TIMEOUT]
            assert [e.time for e in ends] == pytest.approx([5, 11])
        assert calls == pytest.approx([0, 6])

    async def test_swallowed_deadline_cancel_is_still_timeout(self) -> None:
        """An invoke that swallows the deadline's cancellation and returns is still TIMEOUT."""
        log: list[str] = []

        async def stubborn(env: envq.Envelope) -> None:
            try:
                await asyncio.sleep(100)
            except asyncio.CancelledError:
                log.append("swallowed")

        async def after(env: envq.Envelope) -> None:
            log.append("after")

        env = envq.Envelope(invoke=stubborn, after=after, deadline=5)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert final.time == pytest.approx(5)
        assert log == ["swallowed"]

    async def test_swallowed_before_budget_cancel_is_still_timeout(self) -> None:
        """A before that swallows its budget's cancellation and returns is still TIMEOUT."""
        calls: list[str] = []

        async def stubborn(env: envq.Envelope) -> None:
            try:
                await asyncio.sleep(100)
            except asyncio.CancelledError:
                calls.append("swallowed")

        async def invoke(env: envq.Envelope) -> None:
            calls.append("invoke")

        env = envq.Envelope(invoke=invoke, before=stubborn)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert final.time == pytest.approx(0.8)
        assert calls == ["swallowed"]

    async def test_user_timeout_error_is_error(self) -> None:
        """A TimeoutError raised by user code before the deadline is ERROR with that cause."""
        mine = TimeoutError("mine")

        async def invoke(env: envq.Envelope) -> None:
            await asyncio.sleep(1)
            raise mine

        env = envq.Envelope(invoke=invoke, deadline=5)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert final.cause is mine

    async def test_on_failure_sees_timeout_error(self) -> None:
        """After envq's deadline expires, on_failure is handed a TimeoutError."""
        seen: list[tuple[BaseException, int]] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append((exc, attempt))
            return None

        env = envq.Envelope(invoke=sleeper(100), deadline=3, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            assert (await rec.ended(env)).to_state is EnvState.FAILED
        assert len(seen) == 1
        assert isinstance(seen[0][0], TimeoutError)
        assert seen[0][1] == 1


class TestThreads:
    async def test_plain_invoke_runs_in_a_thread(self) -> None:
        """A plain-def invoke runs off the event loop's thread and its success is OK."""
        loop_thread = threading.get_ident()
        threads: list[int] = []

        def invoke(env: envq.Envelope) -> None:
            threads.append(threading.get_ident())

        env = envq.Envelope(invoke=invoke)
        async with running() as (q, rec):
            q.send(env)
            assert (await rec.ended(env)).outcome is Outcome.OK
        assert len(threads) == 1
        assert threads[0] != loop_thread

    async def test_plain_hooks_run_in_threads_in_order(self) -> None:
        """Plain-def before, after, on_success and on_failure run in threads, in order."""
        loop_thread = threading.get_ident()
        log: list[tuple[str, int]] = []

        def hook(name: str, exc: BaseException | None = None) -> Callable[[envq.Envelope], None]:
            def run(env: envq.Envelope) -> None:
                log.append((name, threading.get_ident()))
                if exc is not None:
                    raise exc

            return run

        def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> None:
            log.append(("on_failure", threading.get_ident()))

        ok = envq.Envelope(
            invoke=hook("invoke"),
            before=hook("before"),
            after=hook("after"),
            on_success=hook("on_success"),
        )
        bad = envq.Envelope(
            invoke=hook("invoke!", ValueError("x")),
            after=hook("after!"),
            on_failure=on_failure,
        )
        async with running() as (q, rec):
            q.send(ok)
            assert (await rec.ended(ok)).outcome is Outcome.OK
            q.send(bad)
            assert (await rec.ended(bad)).outcome is Outcome.ERROR
        assert [name for name, _ in log] == [
            "before",
            "invoke",
            "after",
            "on_success",
            "invoke!",
            "on_failure",
        ]
        assert all(ident != loop_thread for _, ident in log)

    async def test_plain_on_failure_decision_is_honoured(self) -> None:
        """A plain-def on_failure's retry_after decision schedules the retry."""
        calls: list[float] = []
        loop = asyncio.get_running_loop()

        async def invoke(env: envq.Envelope) -> None:
            calls.append(loop.time())
            if len(calls) == 1:
                raise ValueError("first")

        def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
            return envq.retry_after(5)

        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            assert (await rec.ended(env)).to_state is EnvState.SUCCEEDED
        assert calls == pytest.approx([0, 5])

    @pytest.mark.parametrize(
        ("exc", "outcome"),
        [
            (ValueError("x"), Outcome.ERROR),
            (TimeoutError("mine"), Outcome.ERROR),
            (envq.StopEnvelope(), Outcome.STOP),
            (envq.DoNotRetry(), Outcome.NO_RETRY),
            (asyncio.CancelledError(), Outcome.ERROR),
        ],
    )
    async def test_plain_invoke_exceptions_classify(
        self, exc: BaseException, outcome: Outcome
    ) -> None:
        """Exceptions from a plain-def invoke are classified like those from async code."""

        def invoke(env: envq.Envelope) -> None:
            raise exc

        env = envq.Envelope(invoke=invoke)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is outcome
            assert final.cause is exc

    async def test_blocked_plain_invoke_times_out_and_counts_stuck(self) -> None:
        """A blocked plain invoke is TIMEOUT at the deadline and counted as a stuck thread."""
        release = threading.Event()
        done = threading.Event()

        def blocked(env: envq.Envelope) -> None:
            try:
                release.wait(30)
            finally:
                done.set()

        env = envq.Envelope(invoke=blocked, deadline=2)
        later = envq.Envelope(invoke=sleeper(1))
        async with running(workers=1) as (q, rec):
            try:
                q.send(env)
                final = await rec.ended(env)
                assert final.outcome is Outcome.TIMEOUT
                assert isinstance(final.cause, TimeoutError)
                assert final.time == pytest.approx(2)
                assert q.statistics().stuck_threads == 1
                assert not done.is_set()
                q.send(later)
                assert (await rec.ended(later)).outcome is Outcome.OK
                assert q.statistics().stuck_threads == 1
            finally:
                release.set()
                await asyncio.to_thread(done.wait, 5)
            assert await settle_threads(q) == 0

    async def test_blocked_plain_before_overrun_is_timeout(self) -> None:
        """A blocked plain before overrunning its budget is TIMEOUT and counted as stuck."""
        release = threading.Event()
        done = threading.Event()
        calls: list[str] = []

        def blocked(env: envq.Envelope) -> None:
            try:
                release.wait(30)
            finally:
                done.set()

        async def invoke(env: envq.Envelope) -> None:
            calls.append("invoke")

        env = envq.Envelope(invoke=invoke, before=blocked)
        async with running() as (q, rec):
            try:
                q.send(env)
                final = await rec.ended(env)
                assert final.outcome is Outcome.TIMEOUT
                assert final.time == pytest.approx(0.8)
                assert q.statistics().stuck_threads == 1
            finally:
                release.set()
                await asyncio.to_thread(done.wait, 5)
            assert await settle_threads(q) == 0
        assert calls == []
