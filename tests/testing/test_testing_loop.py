"""The virtual-time loop: time jumps when idle, never runs backwards, sees threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading
import time
from typing import Any

import pytest

import envq.testing
from envq.testing import VirtualTimeDeadlock, VirtualTimeLoop, advance, run


class TestVirtualClock:
    def test_sleep_is_instant_and_exact(self) -> None:
        """An hour of asyncio.sleep takes no real time and moves loop.time() by an hour."""

        async def main() -> float:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await asyncio.sleep(3600)
            return loop.time() - t0

        started = time.perf_counter()
        assert run(main()) == pytest.approx(3600)
        assert time.perf_counter() - started < 5

    def test_timers_fire_in_order(self) -> None:
        """Timers scheduled out of order fire in due-time order, each at its own time."""

        async def main() -> list[tuple[str, float]]:
            loop = asyncio.get_running_loop()
            seen: list[tuple[str, float]] = []
            done = asyncio.Event()
            for name, at in [("c", 30.0), ("a", 10.0), ("b", 20.0)]:
                loop.call_at(at, lambda n=name: seen.append((n, loop.time())))
            loop.call_at(31, done.set)
            await done.wait()
            return seen

        assert run(main()) == [("a", 10.0), ("b", 20.0), ("c", 30.0)]

    def test_timeout_uses_virtual_clock(self) -> None:
        """asyncio.timeout expires on virtual time."""

        async def main() -> float:
            loop = asyncio.get_running_loop()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(5):
                    await asyncio.sleep(100)
            return loop.time()

        assert run(main()) == pytest.approx(5)

    def test_time_does_not_move_while_busy(self) -> None:
        """Ready callbacks run before any clock jump."""

        async def main() -> float:
            loop = asyncio.get_running_loop()
            for _ in range(100):
                await asyncio.sleep(0)
            return loop.time()

        assert run(main()) == 0.0

    def test_wall_time_follows_virtual_time(self) -> None:
        """wall_time() starts at wall_start and moves with the virtual clock."""

        async def main() -> float:
            loop = asyncio.get_running_loop()
            assert isinstance(loop, VirtualTimeLoop)
            await advance(10)
            return loop.wall_time()

        assert run(main(), wall_start=1_000_000.0) == pytest.approx(1_000_010.0)


class TestThreads:
    def test_quick_thread_finishes_before_time_jumps(self) -> None:
        """A short executor call completes before a pending timer's virtual time."""

        async def main() -> tuple[str, float]:
            loop = asyncio.get_running_loop()

            def work() -> str:
                time.sleep(0.01)
                return "done"

            task = asyncio.ensure_future(loop.run_in_executor(None, work))
            await asyncio.wait({task}, timeout=60)
            return task.result(), loop.time()

        result, at = run(main())
        assert result == "done"
        assert at == 0.0

    def test_blocked_thread_lets_time_move_on(self) -> None:
        """A thread blocked beyond the grace period does not stop the virtual clock."""
        release = threading.Event()

        async def main() -> float:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(None, release.wait)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(10):
                    await asyncio.shield(fut)
            at = loop.time()
            release.set()
            await fut
            return at

        assert run(main(), thread_grace=0.05) == pytest.approx(10)

    def test_deadlock_is_reported(self) -> None:
        """Awaiting something that can never happen raises instead of hanging."""

        async def main() -> None:
            await asyncio.get_running_loop().create_future()

        with pytest.raises(VirtualTimeDeadlock):
            run(main(), idle_timeout=0.05)


async def test_plugin_runs_async_tests_on_virtual_time() -> None:
    """The pytest plugin runs coroutine tests on a VirtualTimeLoop."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    await asyncio.sleep(86400)
    assert loop.time() == pytest.approx(86400)


@pytest.mark.real_clock
async def test_real_clock_marker_uses_a_real_loop() -> None:
    """Tests marked real_clock run on a plain asyncio loop."""
    assert not isinstance(asyncio.get_running_loop(), VirtualTimeLoop)


class _SlowDelivery(concurrent.futures.Executor):
    """Runs each call in a fresh thread, then waits ``lag`` real seconds before
    handing over the result: the window between a thread returning and the loop
    seeing its result, stretched so a test can land in it."""

    def __init__(self, lag: float) -> None:
        self.lag = lag

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def work() -> None:
            try:
                value = fn(*args, **kwargs)
            except BaseException as exc:  # delivered, like a real executor
                time.sleep(self.lag)
                fut.set_exception(exc)
            else:
                time.sleep(self.lag)
                fut.set_result(value)

        threading.Thread(target=work, daemon=True).start()
        return fut


class TestThreadResultInFlight:
    def test_clock_waits_for_a_result_on_its_way(self) -> None:
        """A call that has returned in its thread but whose result has not reached the
        loop yet still holds the clock: a pending 100 s timer must not fire first."""

        async def main() -> float:
            loop = asyncio.get_running_loop()
            sleeper = asyncio.ensure_future(asyncio.sleep(100))
            t0 = loop.time()
            await loop.run_in_executor(_SlowDelivery(0.3), lambda: None)
            took = loop.time() - t0
            sleeper.cancel()
            return took

        assert run(main()) == 0.0


class TestWallTime:
    """``envq.testing.wall_time()``: the wall clock a loop gives envq, typed."""

    def test_on_a_virtual_loop_it_follows_virtual_time(self) -> None:
        async def main() -> tuple[float, float]:
            start = envq.testing.wall_time()
            await asyncio.sleep(3600)
            return start, envq.testing.wall_time()

        start, later = envq.testing.run(main(), wall_start=1_000_000.0)
        assert (start, later) == (1_000_000.0, 1_003_600.0)

    def test_an_aware_datetime_starts_the_wall_clock(self) -> None:
        when = dt.datetime(2026, 4, 5, 1, 30, tzinfo=dt.UTC)
        loop = envq.testing.VirtualTimeLoop(wall_start=when)
        try:
            assert envq.testing.wall_time(loop) == when.timestamp()
        finally:
            loop.close()
        with pytest.raises(ValueError, match="wall_start"):
            envq.testing.VirtualTimeLoop(wall_start=dt.datetime(2026, 4, 5))

    def test_on_any_other_loop_it_is_the_system_clock(self) -> None:
        async def main() -> float:
            return envq.testing.wall_time()

        before = time.time()
        got = asyncio.run(main())
        assert before <= got <= time.time()

    def test_outside_a_loop_it_needs_one(self) -> None:
        with pytest.raises(RuntimeError):
            envq.testing.wall_time()
