"""Periodic envelopes (docs/schedules.md timing, docs/outcomes.md periodic rows and
``attempt`` numbering).

Fixed-delay runs next ``interval`` after the previous attempt ends; ``FIXED_RATE`` runs
on the grid of the first scheduled start, skipping missed slots. A periodic failure
runs again after ``interval`` unless ``on_failure`` decides otherwise.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

import envq
from envq import EnvState, Outcome
from envq.testing import VirtualTimeLoop
from tests.support import Recorder, now, running


class Runs:
    """A periodic invoke: records each start; call i sleeps ``durations[i]`` (last repeats)
    and raises ``errors[i]`` if given."""

    def __init__(
        self,
        durations: list[float] | None = None,
        errors: list[BaseException | None] | None = None,
    ) -> None:
        self.starts: list[float] = []
        self.durations = durations or [0.0]
        self.errors = errors or []

    async def __call__(self, env: envq.Envelope) -> None:
        i = len(self.starts)
        self.starts.append(now())
        await asyncio.sleep(self.durations[min(i, len(self.durations) - 1)])
        error = self.errors[i] if i < len(self.errors) else None
        if error is not None:
            raise error

    async def wait(self, rec: Recorder, n: int) -> list[float]:
        await rec.until(lambda: len(self.starts) >= n)
        return self.starts[:n]


class TestFixedDelay:
    async def test_next_run_interval_after_attempt_end(self) -> None:
        """By default the next run starts interval seconds after the previous attempt ended."""
        runs = Runs([3])
        env = envq.Envelope(invoke=runs, interval=10)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 4) == pytest.approx([0, 13, 26, 39])

    async def test_schedule_constant_is_default(self) -> None:
        """schedule=FIXED_DELAY behaves like the default."""
        runs = Runs([3])
        env = envq.Envelope(invoke=runs, interval=10, schedule=envq.FIXED_DELAY)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([0, 13, 26])

    async def test_first_run_after_delay(self) -> None:
        """A periodic envelope with delay first runs delay seconds after admission."""
        runs = Runs([1])
        env = envq.Envelope(invoke=runs, interval=10, delay=5)
        async with running() as (q, rec):
            await asyncio.sleep(2)
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([7, 18, 29])

    async def test_error_default_runs_again_after_interval(self) -> None:
        """A periodic ERROR without on_failure runs again interval after the attempt ended."""
        runs = Runs([2], [ValueError("a"), ValueError("b"), None])
        env = envq.Envelope(invoke=runs, interval=10)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 4) == pytest.approx([0, 12, 24, 36])
            outs = [(e.outcome, e.to_state) for e in rec.ends(env)[:3]]
            assert outs == [
                (Outcome.ERROR, EnvState.DELAYED),
                (Outcome.ERROR, EnvState.DELAYED),
                (Outcome.OK, EnvState.DELAYED),
            ]

    async def test_timeout_default_runs_again_after_interval(self) -> None:
        """A periodic TIMEOUT without on_failure runs again interval after the deadline hit."""
        runs = Runs([100])
        env = envq.Envelope(invoke=runs, interval=10, deadline=4)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([0, 14, 28])
            assert all(e.outcome is Outcome.TIMEOUT for e in rec.ends(env))

    async def test_deadline_equal_to_interval_runs(self) -> None:
        """A periodic envelope whose deadline equals its interval is accepted and runs."""
        runs = Runs([1])
        env = envq.Envelope(invoke=runs, interval=5, deadline=5)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 2) == pytest.approx([0, 6])


class TestFixedRate:
    async def test_runs_on_the_grid(self) -> None:
        """FIXED_RATE starts runs every interval from the first scheduled start."""
        runs = Runs([3])
        env = envq.Envelope(invoke=runs, interval=10, schedule=envq.FIXED_RATE)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 4) == pytest.approx([0, 10, 20, 30])

    async def test_grid_is_anchored_at_first_start(self) -> None:
        """The FIXED_RATE grid starts at the first scheduled run (after delay)."""
        runs = Runs([1])
        env = envq.Envelope(invoke=runs, interval=10, delay=5, schedule=envq.FIXED_RATE)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([5, 15, 25])

    async def test_missed_slots_are_skipped_not_burst(self) -> None:
        """An attempt that overruns slots makes the next run the first grid point after it."""
        runs = Runs([25, 1, 34, 1])
        env = envq.Envelope(invoke=runs, interval=10, schedule=envq.FIXED_RATE)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 5) == pytest.approx([0, 30, 40, 80, 90])

    async def test_failure_keeps_the_grid(self) -> None:
        """A FIXED_RATE failure without on_failure runs again at the next grid point."""
        runs = Runs([3], [ValueError("x")] * 5)
        env = envq.Envelope(invoke=runs, interval=10, schedule=envq.FIXED_RATE)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([0, 10, 20])


class _CreepingClock(VirtualTimeLoop):
    """A virtual-time loop whose clock also creeps 1 µs at every read, as a real clock
    moves between two reads on the same step."""

    def time(self) -> float:
        self._now += 1e-6
        return self._now


class TestFixedRateDoesNotDrift:
    def test_grid_holds_while_the_clock_moves_between_reads(self) -> None:
        """2,000 FIXED_RATE runs stay on the grid of the first start: the time that
        passes while a run is rescheduled is not added to the next slot (it would
        accumulate, run after run)."""
        starts: list[float] = []

        async def tick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())

        async def main() -> None:
            q = envq.Queue("q")
            q.start()
            q.send(envq.Envelope(invoke=tick, interval=1, schedule=envq.FIXED_RATE))
            await asyncio.sleep(2000.5)
            await q.terminate()

        with asyncio.Runner(loop_factory=_CreepingClock) as runner:
            runner.run(main())
        assert len(starts) >= 2000
        first = starts[0]
        late = [start - (first + k) for k, start in enumerate(starts[:2000])]
        assert max(late) < 1e-4, f"drifted {max(late) * 1e3:.3f} ms over 2,000 runs"
        assert min(late) >= 0


class TestPeriodicDecisions:
    async def test_retry_now_runs_again_at_once(self) -> None:
        """on_failure's retry_now runs a periodic envelope again at once, not after interval."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return envq.retry_now()

        runs = Runs([1], [ValueError("x")])
        env = envq.Envelope(invoke=runs, interval=10, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([0, 1, 12])
            assert rec.ends(env)[0].to_state is EnvState.READY

    async def test_retry_after_runs_again_after_that_delay(self) -> None:
        """on_failure's retry_after(3) runs a periodic envelope again 3 s later."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return envq.retry_after(3)

        runs = Runs([1], [ValueError("x")])
        env = envq.Envelope(invoke=runs, interval=10, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([0, 4, 15])

    @pytest.mark.parametrize("decision", [None, envq.drop()])
    async def test_drop_fails_the_periodic(self, decision: envq.Decision | None) -> None:
        """on_failure returning drop() or None ends a periodic envelope FAILED."""

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            return decision

        runs = Runs([1], [None, ValueError("x")])
        env = envq.Envelope(invoke=runs, interval=10, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(100)
            assert final.to_state is EnvState.FAILED
            assert final.outcome is Outcome.ERROR
            assert len(runs.starts) == 2

    async def test_crashing_on_failure_counts_as_drop(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An on_failure that raises is logged and ends a periodic envelope FAILED."""
        caplog.set_level(logging.WARNING)
        crash = LookupError("crash")

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            raise crash

        runs = Runs([1], [ValueError("x")])
        env = envq.Envelope(invoke=runs, interval=10, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(100)
            assert final.to_state is EnvState.FAILED
            assert len(runs.starts) == 1
        assert any(r.exc_info is not None and r.exc_info[1] is crash for r in caplog.records)

    async def test_attempt_counts_consecutive_failures(self) -> None:
        """attempt for a periodic envelope is the consecutive failures since the last OK, + 1."""
        attempts: list[int] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            attempts.append(attempt)
            return envq.retry_after(1)

        bad = ValueError("x")
        runs = Runs([0], [bad, bad, bad, None, bad, bad, None, bad, envq.StopEnvelope()])
        env = envq.Envelope(invoke=runs, interval=10, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.STOP
        assert attempts == [1, 2, 3, 1, 2, 1]

    async def test_no_retry_reports_consecutive_failures(self) -> None:
        """DoNotRetry on a periodic envelope reports attempt = consecutive failures + 1."""
        attempts: list[int] = []

        async def on_failure(
            env: envq.Envelope, exc: BaseException, attempt: int
        ) -> envq.Decision | None:
            attempts.append(attempt)
            return envq.retry_after(1)

        runs = Runs([0], [None, None, ValueError("x"), envq.DoNotRetry()])
        env = envq.Envelope(invoke=runs, interval=10, on_failure=on_failure)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            assert final.outcome is Outcome.NO_RETRY
            assert final.to_state is EnvState.FAILED
        assert attempts == [1, 2]

    async def test_on_success_every_run(self) -> None:
        """on_success runs after every OK run of a periodic envelope."""
        successes: list[float] = []

        async def on_success(env: envq.Envelope) -> None:
            successes.append(now())

        runs = Runs([2])
        env = envq.Envelope(invoke=runs, interval=10, on_success=on_success)
        async with running() as (q, rec):
            q.send(env)
            await rec.attempts(env, 5)
            assert successes[:4] == pytest.approx([2, 14, 26, 38])

    async def test_on_success_raising_keeps_schedule(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """An on_success that raises is logged and the periodic envelope keeps running."""
        caplog.set_level(logging.WARNING)
        crash = LookupError("crash")

        async def on_success(env: envq.Envelope) -> None:
            raise crash

        runs = Runs([1])
        env = envq.Envelope(invoke=runs, interval=10, on_success=on_success)
        async with running() as (q, rec):
            q.send(env)
            assert await runs.wait(rec, 3) == pytest.approx([0, 11, 22])
            assert rec.final(env) is None
        assert any(r.exc_info is not None and r.exc_info[1] is crash for r in caplog.records)

    async def test_stop_from_before_ends_periodic(self) -> None:
        """StopEnvelope from before ends a periodic envelope STOPPED; it never runs again."""
        runs = Runs([1])
        calls: list[float] = []

        async def before(env: envq.Envelope) -> None:
            calls.append(now())
            if len(calls) == 3:
                raise envq.StopEnvelope()

        env = envq.Envelope(invoke=runs, interval=10, before=before)
        async with running() as (q, rec):
            q.send(env)
            final = await rec.ended(env)
            await asyncio.sleep(100)
            assert final.outcome is Outcome.STOP
            assert final.to_state is EnvState.STOPPED
        assert len(runs.starts) == 2
        assert calls == pytest.approx([0, 11, 22])
