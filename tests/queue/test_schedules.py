"""Schedules over long virtual time: the clock reaches far timers in a few loop
iterations, and the FIXED_RATE grid stays on origin + n × interval."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

import envq
from envq.testing import VirtualTimeLoop

T = TypeVar("T")

DAY = 86_400.0


class _TooManyIterations(RuntimeError):
    pass


class _CountingLoop(VirtualTimeLoop):
    """A virtual-time loop that gives up after ``budget`` iterations (a loop that
    cannot reach its next timer would otherwise spin for ever)."""

    budget = 100_000

    def __init__(self) -> None:
        super().__init__(wall_start=0.0)
        self.iterations = 0

    def _run_once(self) -> None:
        self.iterations += 1
        if self.iterations > self.budget:
            raise _TooManyIterations(f"{self.iterations} iterations at loop time {self._now!r}")
        super()._run_once()  # type: ignore[misc]


def _run(coro: Coroutine[Any, Any, T], budget: int = 100_000) -> tuple[T, int]:
    """Run ``coro`` on a fresh counting loop: its result and the iterations it took."""
    loops: list[_CountingLoop] = []

    def factory() -> _CountingLoop:
        loop = _CountingLoop()
        loop.budget = budget
        loops.append(loop)
        return loop

    with asyncio.Runner(loop_factory=factory) as runner:
        result = runner.run(coro)
    return result, loops[0].iterations


async def _slept(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return asyncio.get_running_loop().time()


class TestFarTimers:
    @pytest.mark.parametrize("seconds", [2.0**24, 2.0**24 + 0.5, 3 * 365 * DAY, 1e15])
    def test_a_timer_past_two_to_the_24_fires(self, seconds: float) -> None:
        """A sleep that ends at or after 2**24 s of loop time returns, at its due time
        (the loop used to spin: now + 1e-9 rounds back to now at that magnitude)."""
        t, _iterations = _run(_slept(seconds), budget=1_000)
        assert t == seconds

    def test_the_clock_jumps_straight_to_a_far_timer(self) -> None:
        """A sleep of 1e12 s takes a handful of loop iterations, not one per day."""
        t, iterations = _run(_slept(1e12), budget=1_000)
        assert t == 1e12
        assert iterations < 20

    def test_timers_beyond_two_to_the_24_fire_in_order(self) -> None:
        """Timers one ulp apart past 2**24 s each fire, in order, at their own time."""

        async def main() -> list[float]:
            loop = asyncio.get_running_loop()
            seen: list[float] = []
            base = 2.0**30
            done = asyncio.Event()
            for k in (3, 1, 2):
                at = base + k * 2.0**-22
                loop.call_at(at, lambda: seen.append(loop.time()))
            loop.call_at(base + 1, done.set)
            await done.wait()
            return seen

        seen, _ = _run(main(), budget=1_000)
        assert seen == [2.0**30 + k * 2.0**-22 for k in (1, 2, 3)]

    def test_a_daily_job_over_a_year(self) -> None:
        """A daily FIXED_RATE envelope runs 400 times over 400 days of virtual time, on
        the grid, in a bounded number of loop iterations."""
        starts: list[float] = []

        async def tick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())

        async def main() -> None:
            q = envq.Queue("daily")
            q.start()
            q.send(
                envq.Envelope(invoke=tick, interval=dt.timedelta(days=1), schedule=envq.FIXED_RATE)
            )
            await asyncio.sleep(400 * DAY - 1)
            await q.terminate()

        _, iterations = _run(main(), budget=50_000)
        assert starts == [k * DAY for k in range(400)]
        assert iterations < 50 * 400

    def test_a_huge_interval(self) -> None:
        """interval=1e12 runs again 1e12 s later, in a few loop iterations."""
        starts: list[float] = []

        async def tick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())

        async def main() -> None:
            q = envq.Queue("huge")
            q.start()
            q.send(envq.Envelope(invoke=tick, interval=1e12))
            await asyncio.sleep(3.5e12)
            await q.terminate()

        _, iterations = _run(main(), budget=10_000)
        assert starts == [0.0, 1e12, 2e12, 3e12]
        assert iterations < 500


class TestFixedRateGrid:
    def test_no_drift_over_ten_thousand_runs(self) -> None:
        """10,000 FIXED_RATE runs from t = 1e6 start exactly at origin + n × interval
        (adding the interval to the previous slot drifted 0.47 µs)."""
        starts: list[float] = []
        origin, interval, n = 1e6, 0.1, 10_000

        async def tick(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())

        async def main() -> None:
            q = envq.Queue("grid")
            q.start()
            q.send(
                envq.Envelope(
                    invoke=tick, interval=interval, delay=origin, schedule=envq.FIXED_RATE
                )
            )
            await asyncio.sleep(origin + (n - 0.5) * interval)
            await q.terminate()

        _run(main(), budget=10**6)
        assert len(starts) == n
        assert starts == [origin + k * interval for k in range(n)]

    def test_an_attempt_ending_on_a_slot_skips_it(self) -> None:
        """An attempt from 2.1 to 5.1 with interval 1 runs next at 6.1: the slot it
        ends on is not run at once (the slot arithmetic floored 2.9999999999999996)."""
        starts: list[float] = []

        async def work(env: envq.Envelope) -> None:
            starts.append(asyncio.get_running_loop().time())
            if len(starts) == 1:
                await asyncio.sleep(3)

        async def main() -> None:
            q = envq.Queue("slot")
            q.start()
            q.send(envq.Envelope(invoke=work, interval=1, delay=2.1, schedule=envq.FIXED_RATE))
            await asyncio.sleep(7.5)
            await q.terminate()

        _run(main())
        assert starts == [2.1, 2.1 + 4 * 1.0, 2.1 + 5 * 1.0]


class TestTinyIntervals:
    @pytest.mark.parametrize("interval", [5e-324, 1e-300, 1e-12, 9.99e-7])
    def test_an_interval_the_clock_cannot_resolve_is_refused(self, interval: float) -> None:
        """A positive interval below a microsecond is refused, naming the value (it
        made a periodic envelope a busy loop)."""
        with pytest.raises(envq.BadEnvelope, match=re.escape(repr(interval))):
            envq.Envelope(invoke=print, interval=interval)

    def test_a_microsecond_is_accepted(self) -> None:
        """The smallest interval accepted is one microsecond."""
        assert envq.Envelope(invoke=print, interval=1e-6).interval == 1e-6

    def test_a_microsecond_timedelta_is_accepted(self) -> None:
        """A timedelta of one microsecond (its smallest unit) is accepted."""
        assert envq.Envelope(invoke=print, interval=dt.timedelta(microseconds=1)).periodic
