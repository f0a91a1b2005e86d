"""The outcomes of attempts beyond the table rows (``test_table_rows.py`` drives every
row of the outcome table): failure classification, decisions, the retry policy, StopType,
hook and internal errors, and the statistics they leave."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable
from typing import Any

import pytest

import envq
from envq import EnvState, Kind, Outcome
from tests.support import TERMINAL, Starts, noop, now, raising, running


class TestCancelInAfter:
    async def test_cancel_in_after_keeps_ok(self) -> None:
        """A cancel that lands in after keeps the outcome OK (the one-off SUCCEEDS)."""
        in_after = asyncio.Event()

        async def after(env: envq.Envelope) -> None:
            in_after.set()
            await asyncio.sleep(0.5)

        env = envq.Envelope(invoke=noop, after=after)
        async with running(hook_timeout=envq.HookTimeout(floor=10)) as (q, rec):
            q.send(env)
            await in_after.wait()
            await q.stop(mode=envq.StopMode.STOP, cancel=True)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
            assert final.to_state is EnvState.SUCCEEDED

    async def test_cancel_in_after_keeps_stop(self) -> None:
        """A cancel that lands in after, following StopEnvelope, keeps the outcome STOP."""
        in_after = asyncio.Event()

        async def after(env: envq.Envelope) -> None:
            in_after.set()
            await asyncio.sleep(0.5)

        env = envq.Envelope(invoke=raising(envq.StopEnvelope()), after=after)
        async with running(hook_timeout=envq.HookTimeout(floor=10)) as (q, rec):
            q.send(env)
            await in_after.wait()
            await q.stop(mode=envq.StopMode.STOP, cancel=True)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED


class TestClassification:
    @pytest.mark.parametrize("deadline", [0, 50])
    async def test_user_timeout_error_is_error(self, deadline: float) -> None:
        """A TimeoutError raised by user code (deadline not expired) is ERROR, not TIMEOUT."""
        seen: list[BaseException] = []

        async def invoke(env: envq.Envelope) -> None:
            async with asyncio.timeout(1):
                await asyncio.sleep(10)

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append(exc)
            return None

        env = envq.Envelope(invoke=invoke, deadline=deadline, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert final.to_state is EnvState.FAILED
            assert len(seen) == 1
            assert isinstance(seen[0], TimeoutError)
            assert final.time == pytest.approx(1)

    async def test_user_cancelled_error_is_error(self) -> None:
        """A CancelledError raised by user code is ERROR and the queue keeps working."""
        env = envq.Envelope(invoke=raising(asyncio.CancelledError()))
        later = envq.Envelope(invoke=noop)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert final.to_state is EnvState.FAILED
            assert isinstance(final.cause, asyncio.CancelledError)
            assert q.state is envq.QueueState.RUNNING
            q.send(later)
            assert (await rec.ended(later)).to_state is EnvState.SUCCEEDED

    async def test_stamp_raising_when_applied_is_error(self) -> None:
        """A stamp that raises while the chain is built makes the attempt ERROR; invoke skips."""
        boom = RuntimeError("stamp")
        calls: list[str] = []

        def stamp(nxt: envq.Invoker) -> envq.Invoker:
            raise boom

        async def invoke(env: envq.Envelope) -> None:
            calls.append("invoke")

        async def after(env: envq.Envelope) -> None:
            calls.append("after")

        env = envq.Envelope(invoke=invoke, stamps=[stamp], after=after)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert final.cause is boom
            assert final.to_state is EnvState.FAILED
            assert calls == []

    async def test_queue_stamp_raising_when_applied_is_error(self) -> None:
        """A queue-level stamp raising when applied makes the attempt ERROR, not a send error."""

        def stamp(nxt: envq.Invoker) -> envq.Invoker:
            raise RuntimeError("queue stamp")

        env = envq.Envelope(invoke=noop)
        async with running(stamps=[stamp]) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert isinstance(final.cause, RuntimeError)

    async def test_stamp_raising_when_called_is_error(self) -> None:
        """A stamp's invoker that raises makes the attempt ERROR."""

        def stamp(nxt: envq.Invoker) -> envq.Invoker:
            async def wrapped(env: envq.Envelope) -> None:
                raise KeyError("inside")

            return wrapped

        env = envq.Envelope(invoke=noop, stamps=[stamp])
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert isinstance(final.cause, KeyError)

    async def test_before_error_is_error(self) -> None:
        """An exception from before makes the attempt ERROR and invoke never runs."""
        invoke = Starts()
        env = envq.Envelope(invoke=invoke, before=raising(OSError("before")))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
            assert isinstance(final.cause, OSError)
            assert invoke.times == []

    @pytest.mark.parametrize("where", ["before", "stamp"])
    async def test_do_not_retry_outside_invoke(self, where: str) -> None:
        """DoNotRetry raised by before or by a stamp's invoker is NO_RETRY."""

        def stamp(nxt: envq.Invoker) -> envq.Invoker:
            return raising(envq.DoNotRetry())

        env = (
            envq.Envelope(invoke=noop, before=raising(envq.DoNotRetry()))
            if where == "before"
            else envq.Envelope(invoke=noop, stamps=[stamp])
        )
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.NO_RETRY
            assert final.to_state is EnvState.FAILED

    async def test_stop_from_stamp_is_stop(self) -> None:
        """StopEnvelope raised in the invoker chain by a stamp is STOP."""

        def stamp(nxt: envq.Invoker) -> envq.Invoker:
            return raising(envq.StopEnvelope())

        env = envq.Envelope(invoke=noop, stamps=[stamp])
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED


class TestDecisions:
    async def test_retry_now_runs_again_at_once(self) -> None:
        """retry_now puts the envelope back READY and it runs again at the same time."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return envq.retry_now()

        invoke = Starts(fails=1)
        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert rec.ends(env)[0].to_state is EnvState.READY
            assert invoke.times == pytest.approx([0, 0])

    async def test_retry_after_waits_exactly(self) -> None:
        """retry_after(7) parks the envelope DELAYED and it runs again exactly 7 s later."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return envq.retry_after(7)

        invoke = Starts(fails=2)
        env = envq.Envelope(invoke=invoke, on_failure=on_failure, delay=3)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert [e.to_state for e in rec.ends(env)[:2]] == [EnvState.DELAYED] * 2
            assert invoke.times == pytest.approx([3, 10, 17])

    @pytest.mark.parametrize("seconds", [0, -5])
    async def test_retry_after_non_positive_is_one_second(self, seconds: float) -> None:
        """retry_after with a non-positive delay retries after 1 s."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return envq.retry_after(seconds)

        invoke = Starts(fails=1)
        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            await rec.ended(env)
            assert invoke.times == pytest.approx([0, 1])

    @pytest.mark.parametrize("decision", [None, envq.drop()])
    async def test_drop_fails(self, decision: envq.Decision | None) -> None:
        """on_failure returning drop() or None ends the envelope FAILED after one attempt."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return decision

        invoke = Starts(fails=99)
        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(100)
            assert final.to_state is EnvState.FAILED
            assert final.outcome is Outcome.ERROR
            assert len(invoke.times) == 1

    async def test_on_failure_gets_env_error_and_attempt_number(self) -> None:
        """on_failure receives the envelope, the attempt's error and the 1-based attempt number."""
        seen: list[tuple[envq.Envelope, BaseException, int]] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append((env, exc, attempt))
            return envq.retry_after(1) if attempt < 3 else envq.drop()

        errors = [ValueError(str(i)) for i in range(5)]

        async def invoke(env: envq.Envelope) -> None:
            raise errors[len(seen)]

        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            await rec.ended(env)
            assert seen == [(env, errors[0], 1), (env, errors[1], 2), (env, errors[2], 3)]

    async def test_attempt_numbering_restarts_on_resend(self) -> None:
        """A one-off sent again after it ended FAILED counts its attempts from 1 again."""
        seen: list[int] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append(attempt)
            return envq.retry_now() if attempt < 2 else None

        env = envq.Envelope(invoke=raising(ValueError("x")), on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            await rec.ended(env)
            rec.events.clear()
            q.send(env)
            assert (await rec.ended(env)).to_state is EnvState.FAILED
        assert seen == [1, 2, 1, 2]

    async def test_no_retry_reports_attempt_number(self) -> None:
        """DoNotRetry on a later attempt reports that attempt's 1-based number to on_failure."""
        seen: list[int] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append(attempt)
            return envq.retry_now()

        async def invoke(env: envq.Envelope) -> None:
            raise envq.DoNotRetry() if len(seen) == 2 else ValueError("again")

        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.NO_RETRY
        assert seen == [1, 2, 3]

    async def test_timeout_is_decided_too(self) -> None:
        """A one-off TIMEOUT goes through on_failure's decision like an ERROR."""
        seen: list[BaseException] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append(exc)
            return envq.retry_now()

        calls: list[float] = []

        async def invoke(env: envq.Envelope) -> None:
            calls.append(now())
            if len(calls) == 1:
                await asyncio.sleep(100)

        env = envq.Envelope(invoke=invoke, deadline=2, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert len(seen) == 1
            assert isinstance(seen[0], TimeoutError)
            assert calls == pytest.approx([0, 2])


class TestRetryPolicy:
    async def test_exact_backoff_then_max_retries(self) -> None:
        """Without jitter, retries wait base·2^(k−1); when attempts are used up it FAILs."""
        invoke = Starts(fails=99)
        env = envq.Envelope(invoke=invoke, retry=envq.Retry(attempts=4, base=1, jitter=False))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert invoke.times == pytest.approx([0, 1, 3, 7])
            assert final.to_state is EnvState.FAILED
            assert final.outcome is Outcome.ERROR
            assert isinstance(final.cause, envq.MaxRetriesExceeded)
            assert final.time == pytest.approx(7)
            assert [e.to_state for e in rec.ends(env)[:3]] == [EnvState.DELAYED] * 3

    async def test_backoff_is_capped(self) -> None:
        """Retry delays never exceed cap."""
        invoke = Starts(fails=99)
        env = envq.Envelope(
            invoke=invoke, retry=envq.Retry(attempts=4, base=10, cap=15, jitter=False)
        )
        async with running() as (q, rec):
            q.send(env)
            await rec.ended(env)
            assert invoke.times == pytest.approx([0, 10, 25, 40])

    async def test_success_stops_retrying(self) -> None:
        """A retried envelope that then succeeds ends SUCCEEDED."""
        invoke = Starts(fails=2)
        env = envq.Envelope(invoke=invoke, retry=envq.Retry(attempts=5, base=2, jitter=False))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert invoke.times == pytest.approx([0, 2, 6])

    async def test_single_attempt(self) -> None:
        """Retry(attempts=1) allows only the first attempt, then MaxRetriesExceeded."""
        invoke = Starts(fails=99)
        env = envq.Envelope(invoke=invoke, retry=envq.Retry(attempts=1))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert len(invoke.times) == 1
            assert isinstance(final.cause, envq.MaxRetriesExceeded)

    async def test_unlimited_attempts(self) -> None:
        """Retry(attempts=-1) keeps retrying until the envelope succeeds."""
        invoke = Starts(fails=30)
        env = envq.Envelope(
            invoke=invoke, retry=envq.Retry(attempts=-1, base=1, cap=4, jitter=False)
        )
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert len(invoke.times) == 31
            gaps = [b - a for a, b in zip(invoke.times, invoke.times[1:], strict=False)]
            assert gaps == pytest.approx([1, 2] + [4] * 28)

    async def test_retry_applies_to_timeout(self) -> None:
        """The Retry policy also decides after a TIMEOUT."""
        calls: list[float] = []

        async def invoke(env: envq.Envelope) -> None:
            calls.append(now())
            await asyncio.sleep(100)

        env = envq.Envelope(
            invoke=invoke, deadline=2, retry=envq.Retry(attempts=2, base=3, jitter=False)
        )
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert calls == pytest.approx([0, 5])
            assert isinstance(final.cause, envq.MaxRetriesExceeded)

    async def test_jitter_within_bounds_and_seeded(self) -> None:
        """With jitter each delay is drawn from [d/2, d] and a seeded rng makes it repeatable."""

        async def delays(seed: int) -> list[float]:
            invoke = Starts(fails=99)
            retry = envq.Retry(attempts=6, base=8, cap=1800, rng=random.Random(seed))
            env = envq.Envelope(invoke=invoke, retry=retry)
            async with running() as (q, rec):
                q.send(env)
                await rec.ended(env)
            return [b - a for a, b in zip(invoke.times, invoke.times[1:], strict=False)]

        first = await delays(1234)
        second = await delays(1234)
        nominal = [8.0, 16.0, 32.0, 64.0, 128.0]
        assert len(first) == 5
        for got, d in zip(first, nominal, strict=True):
            assert d / 2 - 1e-9 <= got <= d + 1e-9
        assert first != pytest.approx(nominal)
        assert second == pytest.approx(first)


class TestStopType:
    async def test_later_sends_of_type_raise(self) -> None:
        """After StopType, sending that type raises TypeBlacklisted; other types still run."""
        env = envq.Envelope(invoke=raising(envq.StopType()), type="mail")
        other = envq.Envelope(invoke=noop, type="sms")
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP_TYPE
            assert final.to_state is EnvState.STOPPED
            with pytest.raises(envq.TypeBlacklisted):
                q.send(envq.Envelope(invoke=noop, type="mail"))
            q.send(other)
            assert (await rec.ended(other)).to_state is EnvState.SUCCEEDED

    async def test_ready_and_delayed_of_type_stop_at_once(self) -> None:
        """StopType stops every READY and DELAYED envelope of the type at once, never run."""
        gate = asyncio.Event()
        ran: list[str] = []

        async def stopper(env: envq.Envelope) -> None:
            await gate.wait()
            raise envq.StopType()

        async def mark(env: envq.Envelope) -> None:
            ran.append(str(env.id))

        killer = envq.Envelope(invoke=stopper, type="mail", id="killer")
        ready = envq.Envelope(invoke=mark, type="mail", id="ready")
        delayed = envq.Envelope(invoke=mark, type="mail", id="delayed", delay=50)
        periodic = envq.Envelope(invoke=mark, type="mail", id="periodic", interval=5, delay=50)
        bystander = envq.Envelope(invoke=mark, type="sms", id="sms")
        async with running(workers=1) as (q, rec):
            q.send(killer)
            await rec.until(lambda: EnvState.RUNNING in rec.states(killer))
            q.send(ready, delayed, periodic, bystander)
            assert rec.states(ready)[-1] is EnvState.READY
            assert rec.states(delayed)[-1] is EnvState.DELAYED
            gate.set()
            t_stop = (await rec.ended(killer)).time
            for env in (ready, delayed, periodic):
                final = await rec.ended(env)
                assert final.to_state is EnvState.STOPPED
                assert final.time == pytest.approx(t_stop)
            await rec.ended(bystander)
            await asyncio.sleep(200)
            assert ran == ["sms"]

    async def test_parked_of_type_stop_at_once(self) -> None:
        """StopType during a DRAIN stop turns a PARKED envelope of the type STOPPED."""
        gate = asyncio.Event()

        async def stopper(env: envq.Envelope) -> None:
            await gate.wait()
            raise envq.StopType()

        killer = envq.Envelope(invoke=stopper, type="mail")
        waiting = envq.Envelope(invoke=noop, type="mail", delay=50)
        async with running() as (q, rec):
            q.send(killer, waiting)
            await rec.until(lambda: EnvState.RUNNING in rec.states(killer))
            await q.stop(wait=False)
            await rec.until(lambda: EnvState.PARKED in rec.states(waiting))
            gate.set()
            final = await rec.ended(waiting)
            assert final.to_state is EnvState.STOPPED
            assert rec.states(waiting)[-2:] == [EnvState.PARKED, EnvState.STOPPED]
            assert (await rec.ended(killer)).outcome is Outcome.STOP_TYPE

    @pytest.mark.parametrize("fails", [False, True])
    async def test_running_of_type_stops_when_attempt_ends(self, fails: bool) -> None:
        """A RUNNING envelope of the blacklisted type ends STOPPED when its attempt ends,
        whatever the outcome, without on_success or on_failure."""
        hooks: list[str] = []
        gate = asyncio.Event()
        started = asyncio.Event()

        async def busy(env: envq.Envelope) -> None:
            started.set()
            await gate.wait()
            if fails:
                raise ValueError("after blacklist")

        async def on_success(env: envq.Envelope) -> None:
            hooks.append("on_success")

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            hooks.append("on_failure")
            return envq.retry_now()

        victim = envq.Envelope(
            invoke=busy, type="mail", on_success=on_success, on_failure=on_failure
        )
        killer = envq.Envelope(invoke=raising(envq.StopType()), type="mail")
        async with running(workers=2) as (q, rec):
            q.send(victim)
            await started.wait()
            q.send(killer)
            await rec.ended(killer)
            await asyncio.sleep(10)
            assert rec.final(victim) is None
            assert rec.states(victim)[-1] is EnvState.RUNNING
            gate.set()
            final = await rec.ended(victim)
            assert final.to_state is EnvState.STOPPED
            assert len(rec.ends(victim)) == 1
            assert hooks == []

    async def test_empty_type_acts_as_stop(self) -> None:
        """StopType on an envelope with an empty type stops only it; nothing is blacklisted."""
        calls: list[str] = []

        async def mark(env: envq.Envelope) -> None:
            calls.append("ran")

        env = envq.Envelope(invoke=raising(envq.StopType()))
        delayed = envq.Envelope(invoke=mark, delay=10)
        async with running() as (q, rec):
            q.send(env, delayed)
            final = await rec.ended(env)
            assert final.to_state is EnvState.STOPPED
            assert final.outcome in {Outcome.STOP, Outcome.STOP_TYPE}
            later = envq.Envelope(invoke=mark)
            q.send(later)
            assert (await rec.ended(delayed)).to_state is EnvState.SUCCEEDED
            assert (await rec.ended(later)).to_state is EnvState.SUCCEEDED
            assert calls == ["ran", "ran"]


class TestHookErrors:
    async def test_on_failure_raising_counts_as_drop(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An exception from on_failure is logged with its traceback and counts as drop."""
        caplog.set_level(logging.WARNING)
        crash = LookupError("on_failure crashed")

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            raise crash

        invoke = Starts(fails=99)
        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        later = envq.Envelope(invoke=noop)
        async with running(workers=1) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(100)
            assert final.to_state is EnvState.FAILED
            assert len(invoke.times) == 1
            q.send(later)
            assert (await rec.ended(later)).to_state is EnvState.SUCCEEDED
        assert any(r.exc_info is not None and r.exc_info[1] is crash for r in caplog.records)

    async def test_on_success_raising_is_logged(self, caplog: pytest.LogCaptureFixture) -> None:
        """An exception from on_success is logged; the envelope still SUCCEEDS and work goes on."""
        caplog.set_level(logging.WARNING)
        crash = LookupError("on_success crashed")

        async def on_success(env: envq.Envelope) -> None:
            raise crash

        env = envq.Envelope(invoke=noop, on_success=on_success)
        later = envq.Envelope(invoke=noop)
        async with running(workers=1) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert len([e for e in rec.of(env) if e.to_state in TERMINAL]) == 1
            q.send(later)
            assert (await rec.ended(later)).to_state is EnvState.SUCCEEDED
        assert any(r.exc_info is not None and r.exc_info[1] is crash for r in caplog.records)


class TestInternalErrors:
    """The queue's own failure while handling an envelope (docs/outcomes.md; the seed's
    "panic"): provoked by making the worker's private step — the queue's resolved
    outcome row for a one-off OK attempt — raise once."""

    @staticmethod
    def fail_once(queue: envq.Queue, crash: BaseException, *, after: bool) -> None:
        """Make the next one-off OK row raise ``crash``: at once (``after=False``), or
        once the row has been performed (``after=True``: the envelope has ended)."""
        rows = queue._settler.plan[Kind.ONE_OFF]
        real = rows[Outcome.OK]
        calls = 0

        async def then_raise(pending: Awaitable[None] | None) -> None:
            if pending is not None:
                await pending
            raise crash

        def perform(*args: Any) -> Awaitable[None] | None:
            nonlocal calls
            calls += 1
            if calls > 1:
                return real(*args)
            if not after:
                raise crash
            return then_raise(real(*args))

        rows[Outcome.OK] = perform

    async def test_envelope_ends_failed_and_frees_its_slot(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An internal error while handling an envelope ends it FAILED (outcome ERROR, the
        error as the event's cause), frees its capacity slot, is logged with its
        traceback, and the worker carries on with the next envelope."""
        caplog.set_level(logging.ERROR, logger="envq")
        crash = RuntimeError("envq bug")
        env = envq.Envelope(invoke=noop, id="victim")
        later = envq.Envelope(invoke=noop, id="later")
        async with running(workers=1, capacity=1) as (q, rec):
            self.fail_once(q, crash, after=False)
            q.send(env)
            final = await rec.ended(env)
            assert final.from_state is EnvState.RUNNING
            assert final.to_state is EnvState.FAILED
            assert final.outcome is Outcome.ERROR
            assert final.cause is crash
            assert rec.states(env) == [EnvState.READY, EnvState.RUNNING, EnvState.FAILED]
            assert q.capacity_used == 0
            stats = q.statistics()
            assert stats.in_flight == 0
            assert stats.by_state.get(EnvState.FAILED, 0) == 1
            assert q.state_of(env) is None
            q.send(later)  # the slot is free, and a worker takes it
            assert (await rec.ended(later)).to_state is EnvState.SUCCEEDED
        logged = [r for r in caplog.records if "internal error handling" in r.getMessage()]
        assert len(logged) == 1
        assert env.label() in logged[0].getMessage()
        assert logged[0].exc_info is not None
        assert logged[0].exc_info[1] is crash

    @pytest.mark.parametrize("hook", [False, True], ids=["no-hook", "on_success"])
    async def test_after_the_envelope_ended_it_keeps_its_one_end(
        self, caplog: pytest.LogCaptureFixture, hook: bool
    ) -> None:
        """An internal error raised after the envelope has already ended (here: once its
        outcome row, on_success included, was performed) is logged, and the envelope
        keeps the one terminal state it reached: it is not ended a second time."""
        caplog.set_level(logging.ERROR, logger="envq")
        crash = RuntimeError("envq bug after the end")
        successes: list[float] = []

        async def on_success(env: envq.Envelope) -> None:
            await asyncio.sleep(2)
            successes.append(now())

        env = envq.Envelope(invoke=noop, on_success=on_success if hook else None)
        budget = envq.HookTimeout(floor=100)
        async with running(workers=1, capacity=1, hook_timeout=budget) as (q, rec):
            self.fail_once(q, crash, after=True)
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(10)
            assert final.to_state is EnvState.SUCCEEDED
            assert [e.to_state for e in rec.of(env) if e.to_state in TERMINAL] == [
                EnvState.SUCCEEDED
            ]
            assert successes == ([2.0] if hook else [])
            assert q.capacity_used == 0
            q.send(envq.Envelope(invoke=noop))  # the worker is still serving
            assert q.statistics().by_state.get(EnvState.SUCCEEDED, 0) == 1
            await asyncio.sleep(1)
            assert q.statistics().by_state.get(EnvState.SUCCEEDED, 0) == 2
        logged = [r for r in caplog.records if "internal error handling" in r.getMessage()]
        assert [r.exc_info[1] if r.exc_info else None for r in logged] == [crash]


class TestCapacitySlot:
    @pytest.mark.parametrize("hook", ["on_success", "on_failure"])
    async def test_slot_held_until_hook_finished(self, hook: str) -> None:
        """The capacity slot stays taken while on_success/on_failure runs and frees after."""
        inside = asyncio.Event()
        gate = asyncio.Event()

        async def on_success(env: envq.Envelope) -> None:
            inside.set()
            await gate.wait()

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            inside.set()
            await gate.wait()
            return None

        env = (
            envq.Envelope(invoke=noop, on_success=on_success)
            if hook == "on_success"
            else envq.Envelope(invoke=raising(ValueError()), on_failure=on_failure)
        )
        async with running(capacity=1, hook_timeout=envq.HookTimeout(floor=100)) as (q, rec):
            q.send(env)
            await inside.wait()
            await asyncio.sleep(1)
            assert q.capacity_used == 1
            with pytest.raises(envq.CapacityExceeded):
                q.send(envq.Envelope(invoke=noop))
            gate.set()
            await rec.ended(env)
            await asyncio.sleep(0)
            assert q.capacity_used == 0
            assert q.statistics().capacity_used == 0
            q.send(envq.Envelope(invoke=noop))


class TestNoOverlap:
    async def test_one_envelope_never_runs_twice_at_once(self) -> None:
        """With many workers, retries and re-sends, one envelope never has two attempts at once."""
        active = 0
        peak = 0
        calls = 0

        async def invoke(env: envq.Envelope) -> None:
            nonlocal active, peak, calls
            calls += 1
            active += 1
            peak = max(peak, active)
            try:
                await asyncio.sleep(0.7)
                if calls % 2:
                    raise ValueError("odd")
            finally:
                active -= 1

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return envq.retry_now()

        env = envq.Envelope(invoke=invoke, interval=1, on_failure=on_failure)
        async with running(workers=8) as (q, rec):
            for _ in range(20):
                q.send(env)
                await asyncio.sleep(0.3)
            await rec.attempts(env, 15)
            assert q.statistics().dedups >= 19
        assert peak == 1
        assert calls >= 15


class TestStatistics:
    async def test_counts_outcomes_and_final_states(self) -> None:
        """statistics() counts each outcome and each terminal state; nothing is left in use."""
        envs = [
            envq.Envelope(invoke=noop),
            envq.Envelope(invoke=noop),
            envq.Envelope(invoke=raising(ValueError())),
            envq.Envelope(invoke=raising(envq.StopEnvelope())),
            envq.Envelope(invoke=raising(envq.DoNotRetry())),
        ]
        async with running(workers=3) as (q, rec):
            q.send(*envs)
            for env in envs:
                await rec.ended(env)
            stats = q.statistics()
            assert stats.outcomes.get(Outcome.OK, 0) == 2
            assert stats.outcomes.get(Outcome.ERROR, 0) == 1
            assert stats.outcomes.get(Outcome.STOP, 0) == 1
            assert stats.outcomes.get(Outcome.NO_RETRY, 0) == 1
            assert stats.by_state.get(EnvState.SUCCEEDED, 0) == 2
            assert stats.by_state.get(EnvState.FAILED, 0) == 2
            assert stats.by_state.get(EnvState.STOPPED, 0) == 1
            assert stats.in_flight == 0
            assert stats.capacity_used == 0
