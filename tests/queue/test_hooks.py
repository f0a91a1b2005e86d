"""Hooks around an attempt: order, which run for which outcome, and budgets
(docs/outcomes.md, docs/concepts.md).

One attempt runs ``before → stamps → invoke → after``; ``on_success`` / ``on_failure``
follow. Every hook has a budget ``max(fraction × deadline, floor)``.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

import envq
from envq import EnvState, Outcome
from tests.support import Trace, noop, now, running, sleeper


class TestOrder:
    async def test_ok_runs_everything_in_order(self) -> None:
        """On OK: before, queue stamps in order, envelope stamps, invoke, after, on_success."""
        t = Trace()
        env = t.envelope(stamps=[t.stamp("e1"), t.stamp("e2")])
        async with running(stamps=[t.stamp("q1"), t.stamp("q2")]) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
        assert t.log == [
            "before",
            "q1>",
            "q2>",
            "e1>",
            "e2>",
            "invoke",
            "e2<",
            "e1<",
            "q2<",
            "q1<",
            "after",
            "on_success",
        ]

    async def test_error_skips_after(self) -> None:
        """On ERROR after and on_success do not run; on_failure does."""
        t = Trace()
        env = t.envelope(invoke_exc=ValueError("x"), stamps=[t.stamp("e1")])
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.ERROR
        assert t.log == ["before", "e1>", "invoke", "on_failure"]

    async def test_before_error_skips_everything_else(self) -> None:
        """An error in before skips invoke and after; only on_failure follows."""
        t = Trace()
        env = t.envelope(before=t.hook("before", ValueError("x")))
        async with running() as (q, rec):
            q.send(env)
            assert (await rec.ended(env)).outcome is Outcome.ERROR
        assert t.log == ["before", "on_failure"]

    async def test_timeout_skips_after(self) -> None:
        """On TIMEOUT after and on_success do not run; on_failure does."""
        t = Trace()
        env = t.envelope(invoke=sleeper(100, t.log, "invoke"), deadline=4)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
        assert t.log == ["before", "invoke start", "invoke cancelled", "on_failure"]

    async def test_stop_from_invoke_runs_after(self) -> None:
        """On STOP from invoke, after still runs; on_success and on_failure do not."""
        t = Trace()
        env = t.envelope(invoke_exc=envq.StopEnvelope())
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED
        assert t.log == ["before", "invoke", "after"]

    async def test_stop_from_before_runs_after(self) -> None:
        """On STOP from before, invoke is skipped but after still runs; on_success does not."""
        t = Trace()
        env = t.envelope(before=t.hook("before", envq.StopEnvelope()))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED
        assert t.log == ["before", "after"]

    @pytest.mark.parametrize("exc", [ValueError("after"), envq.DoNotRetry("after")])
    async def test_after_result_ignored_on_stop(self, exc: BaseException) -> None:
        """On STOP from invoke, whatever after raises is ignored: the outcome stays STOP."""
        t = Trace()
        env = t.envelope(invoke_exc=envq.StopEnvelope(), after=t.hook("after", exc))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED
        assert "on_failure" not in t.log

    @pytest.mark.parametrize("interval", [0, 10])
    async def test_stop_from_after_turns_ok_into_stop(self, interval: float) -> None:
        """StopEnvelope from after turns an OK attempt into STOP: STOPPED, no on_success."""
        t = Trace()
        env = t.envelope(after=t.hook("after", envq.StopEnvelope()), interval=interval)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(50)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED
            assert len(rec.ends(env)) == 1
        assert t.log == ["before", "invoke", "after"]

    async def test_stop_type_from_after_blacklists(self) -> None:
        """StopType from after ends the attempt STOP_TYPE and blacklists the type."""
        t = Trace()
        env = t.envelope(after=t.hook("after", envq.StopType()), type="mail")
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP_TYPE
            assert final.to_state is EnvState.STOPPED
            with pytest.raises(envq.TypeBlacklisted):
                q.send(envq.Envelope(invoke=noop, type="mail"))
        assert "on_success" not in t.log

    async def test_after_error_is_logged_and_ignored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An after error other than StopEnvelope is logged; the attempt stays OK."""
        caplog.set_level(logging.WARNING)
        crash = LookupError("after crashed")
        t = Trace()
        env = t.envelope(after=t.hook("after", crash))
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
            assert final.to_state is EnvState.SUCCEEDED
        assert t.log == ["before", "invoke", "after", "on_success"]
        assert any(
            r.levelno >= logging.WARNING
            and (
                (r.exc_info is not None and r.exc_info[1] is crash)
                or "after crashed" in r.getMessage()
            )
            for r in caplog.records
        )

    async def test_stamp_may_skip_invoke(self) -> None:
        """A stamp that does not call the next invoker ends the attempt OK without invoke."""
        t = Trace()

        def gate(nxt: envq.Invoker) -> envq.Invoker:
            async def wrapped(env: envq.Envelope) -> None:
                t.log.append(f"gate {env.id}")

            return wrapped

        env = t.envelope(stamps=[gate], id=7)
        async with running() as (q, rec):
            q.send(env)
            assert (await rec.ended(env)).outcome is Outcome.OK
        assert t.log == ["before", "gate 7", "after", "on_success"]

    async def test_periodic_stop_skips_on_success(self) -> None:
        """A periodic envelope's STOP runs after but never on_success."""
        t = Trace()
        env = t.envelope(invoke_exc=envq.StopEnvelope(), interval=5)
        async with running() as (q, rec):
            q.send(env)
            assert (await rec.ended(env)).outcome is Outcome.STOP
            await asyncio.sleep(50)
        assert t.log == ["before", "invoke", "after"]


class TestBudgets:
    async def test_before_overrunning_floor_is_timeout(self) -> None:
        """With no deadline, before overrunning the 0.8 s floor ends the attempt TIMEOUT."""
        t = Trace()
        seen: list[BaseException] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            seen.append(exc)
            return None

        env = t.envelope(before=sleeper(100), on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert final.to_state is EnvState.FAILED
            assert final.time == pytest.approx(0.8)
        assert "invoke" not in t.log
        assert len(seen) == 1
        assert isinstance(seen[0], TimeoutError)

    @pytest.mark.parametrize(
        ("hook_timeout", "deadline", "cut"),
        [
            (envq.HookTimeout(fraction=0.5, floor=0.8), 10, 5.0),
            (envq.HookTimeout(fraction=0.5, floor=0.8), 1, 0.8),
            (envq.HookTimeout(fraction=0.25, floor=0.8), 20, 5.0),
            (envq.HookTimeout(fraction=0.5, floor=3), 0, 3.0),
            (envq.HookTimeout(fraction=1.0, floor=50), 4, 4.0),
            (envq.HookTimeout(fraction=0.5, floor=None), 10, 5.0),
        ],
    )
    async def test_before_budget(
        self, hook_timeout: envq.HookTimeout, deadline: float, cut: float
    ) -> None:
        """before is cut off at min(max(fraction×deadline, floor), deadline), as TIMEOUT."""
        env = envq.Envelope(invoke=noop, before=sleeper(100), deadline=deadline)
        async with running(hook_timeout=hook_timeout) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.TIMEOUT
            assert final.time == pytest.approx(cut)

    async def test_no_floor_and_no_deadline_means_no_budget(self) -> None:
        """HookTimeout(floor=None) with deadline 0 lets a hook run as long as it takes."""
        calls: list[float] = []

        async def invoke(env: envq.Envelope) -> None:
            calls.append(now())

        env = envq.Envelope(invoke=invoke, before=sleeper(1000))
        async with running(hook_timeout=envq.HookTimeout(floor=None)) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
            assert calls == pytest.approx([1000])

    async def test_after_overrunning_budget_is_ignored(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """after overrunning its budget is cut off at the budget, logged, and the attempt is OK."""
        caplog.set_level(logging.WARNING)
        log: list[str] = []
        successes: list[float] = []

        async def on_success(env: envq.Envelope) -> None:
            successes.append(now())

        env = envq.Envelope(invoke=noop, after=sleeper(100, log, "after"), on_success=on_success)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
            assert final.to_state is EnvState.SUCCEEDED
        assert log == ["after start", "after cancelled"]
        assert successes == pytest.approx([0.8])
        assert any(r.levelno >= logging.WARNING for r in caplog.records)

    async def test_after_overrunning_deadline_is_ignored(self) -> None:
        """after is cut off by the envelope deadline and the attempt stays OK."""
        log: list[str] = []
        successes: list[float] = []

        async def on_success(env: envq.Envelope) -> None:
            successes.append(now())

        env = envq.Envelope(
            invoke=sleeper(8),
            after=sleeper(100, log, "after"),
            on_success=on_success,
            deadline=10,
        )
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.OK
            assert final.to_state is EnvState.SUCCEEDED
        assert log == ["after start", "after cancelled"]
        assert successes == pytest.approx([10])

    async def test_on_failure_gets_own_budget_after_deadline(self) -> None:
        """on_failure gets its own budget after the deadline expired; its decision holds."""
        calls: list[float] = []
        finished: list[float] = []

        async def invoke(env: envq.Envelope) -> None:
            calls.append(now())
            if len(calls) == 1:
                await asyncio.sleep(100)

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            await asyncio.sleep(0.9)
            finished.append(now())
            return envq.retry_after(10)

        env = envq.Envelope(invoke=invoke, deadline=2, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
        assert rec.ends(env)[0].outcome is Outcome.TIMEOUT
        assert finished == pytest.approx([2.9])
        assert len(calls) == 2
        assert 12 - 1e-9 <= calls[1] <= 12.9 + 1e-9

    async def test_on_success_gets_own_budget_after_deadline(self) -> None:
        """on_success runs to completion under its own budget even past the deadline."""
        finished: list[float] = []

        async def on_success(env: envq.Envelope) -> None:
            await asyncio.sleep(0.9)
            finished.append(now())

        env = envq.Envelope(invoke=sleeper(1.9), deadline=2, on_success=on_success)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
        assert finished == pytest.approx([2.8])

    async def test_on_failure_overrunning_budget_counts_as_drop(self) -> None:
        """on_failure overrunning its budget is cut off and counts as drop: FAILED, no retry."""
        calls: list[float] = []

        async def invoke(env: envq.Envelope) -> None:
            calls.append(now())
            raise ValueError("x")

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            await asyncio.sleep(100)
            return envq.retry_now()

        env = envq.Envelope(invoke=invoke, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(200)
            assert final.to_state is EnvState.FAILED
            assert final.time == pytest.approx(0.8)
        assert len(calls) == 1

    async def test_on_success_overrunning_budget_still_succeeds(self) -> None:
        """on_success overrunning its budget is cut off; the envelope still SUCCEEDED."""
        log: list[str] = []
        env = envq.Envelope(invoke=noop, on_success=sleeper(100, log, "on_success"))
        async with running(capacity=1) as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.to_state is EnvState.SUCCEEDED
            assert final.time == pytest.approx(0.8)
            assert q.capacity_used == 0
        assert log == ["on_success start", "on_success cancelled"]
