"""Deterministic virtual time for asyncio.

:class:`VirtualTimeLoop` is a selector event loop whose clock only moves when the loop
would otherwise sleep: when every task is idle and the next timer is in the future, the
clock jumps straight to that timer instead of waiting for it. Timers, ``asyncio.sleep``,
``asyncio.timeout`` and everything envq schedules therefore run in order, instantly and
reproducibly.

Work handed to threads (``loop.run_in_executor``) is real work the loop cannot see
into, so while such a call is running the loop first waits up to ``thread_grace`` real
seconds for it before letting virtual time jump; a thread blocked for longer than that
behaves as a stuck thread would (the virtual clock moves on without it).

Usage::

    from envq.testing import run

    async def main() -> None:
        await asyncio.sleep(3600)          # returns at once; loop.time() is 3600 later

    run(main())

The pytest plugin :mod:`envq.pytest_plugin` runs the ``async def`` tests that ask for it
on this loop (marker ``virtual_time``, or the ini option ``envq_virtual_time = all``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import selectors
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import Any, Final, Self, TypeVar, TypeVarTuple, Unpack

from envq import _checks

__all__ = ["VirtualTimeDeadlock", "VirtualTimeLoop", "advance", "run", "wall_time"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: The virtual clock's value when a loop is created.
EPOCH: Final = 0.0


class VirtualTimeDeadlock(RuntimeError):
    """The virtual-time loop has nothing scheduled, no thread at work and no I/O.

    A real loop would hang here forever; the virtual one gives up after
    ``idle_timeout`` real seconds and raises this instead.
    """


class _Threads:
    """Counts executor calls that are queued or running (thread-safe)."""

    __slots__ = ("busy", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy = 0


class _Job:
    """One executor call, counted as busy until the loop has its result.

    The count drops when the loop has taken delivery (``on_done``), not when the
    thread returns: in between, the result is still on its way to the loop's
    self-pipe, and a loop that saw no busy thread then would jump the clock ahead
    of it. A call nobody waits for any more (its future was cancelled) counts until
    its thread returns; one that never started, not at all.
    """

    __slots__ = ("abandoned", "args", "dead", "finished", "fn", "started", "threads")

    def __init__(self, threads: _Threads, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.threads = threads
        self.fn = fn
        self.args = args
        self.started = False
        self.finished = False
        self.abandoned = False
        self.dead = False

    def run(self) -> Any:
        threads = self.threads
        with threads.lock:
            if self.dead:
                return None
            self.started = True
        try:
            return self.fn(*self.args)
        finally:
            with threads.lock:
                self.finished = True
                if self.abandoned:
                    threads.busy -= 1

    def on_done(self, fut: asyncio.Future[Any]) -> None:
        """In the loop's thread, once the awaiting future is done."""
        threads = self.threads
        with threads.lock:
            if not self.started:
                # Cancelled before a thread picked it up: it will never run.
                if not self.dead:
                    self.dead = True
                    threads.busy -= 1
            elif self.finished:
                threads.busy -= 1  # the result has reached the loop
            else:
                self.abandoned = True  # cancelled while running: counts until it returns


class _VirtualSelector(selectors.BaseSelector):
    """Wraps the real selector; turns would-be sleeps into clock jumps."""

    def __init__(self, real: selectors.BaseSelector) -> None:
        self._real = real
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        assert loop is not None
        ready = self._real.select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if loop._threads.busy:
            grace = loop.thread_grace if timeout is None else min(timeout, loop.thread_grace)
            # A thread that finishes wakes the loop through its self-pipe, so this
            # returns as soon as the thread is done.
            ready = self._real.select(grace)
            if ready:
                return ready
        if timeout is None:
            ready = self._real.select(loop.idle_timeout)
            if not ready:
                raise VirtualTimeDeadlock(
                    f"virtual-time loop idle for {loop.idle_timeout} real seconds with no "
                    "timer, thread or I/O pending: the awaited result can never arrive"
                )
            return ready
        # Jump to the earliest timer itself: ``now + timeout`` can round short of it,
        # and asyncio caps ``timeout`` at one day.
        scheduled = loop._scheduled
        target = scheduled[0].when() if scheduled else loop._now + timeout
        loop._now = max(loop._now, target)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a virtual clock.

    ``loop.time()`` starts at 0 and only moves when the loop is idle and a timer is
    due in the future: it then jumps to that timer. ``wall_time()`` is a matching
    virtual wall clock (seconds since the epoch), which envq uses to turn an
    envelope's ``not_before`` into a delay.

    :param wall_start: the wall-clock value at virtual time 0, as seconds since the
        epoch or an aware datetime (default: real now).
    :param thread_grace: real seconds to wait for a running executor call before
        letting virtual time jump past it.
    :param idle_timeout: real seconds of total idleness before
        :class:`VirtualTimeDeadlock` is raised.
    """

    def __new__(
        cls,
        *,
        wall_start: float | dt.datetime | None = None,
        thread_grace: float = 2.0,
        idle_timeout: float = 30.0,
    ) -> Self:
        # Checked before the object exists: a half-made loop would complain when
        # collected (BaseEventLoop.__del__ needs the state its __init__ makes).
        _check_clock_args("VirtualTimeLoop", wall_start, thread_grace, idle_timeout)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        wall_start: float | dt.datetime | None = None,
        thread_grace: float = 2.0,
        idle_timeout: float = 30.0,
    ) -> None:
        wall_start, thread_grace, idle_timeout = _check_clock_args(
            "VirtualTimeLoop", wall_start, thread_grace, idle_timeout
        )
        selector = _VirtualSelector(selectors.DefaultSelector())
        self._now = EPOCH
        self._threads = _Threads()
        self.thread_grace = thread_grace
        self.idle_timeout = idle_timeout
        self._wall_start = time.time() if wall_start is None else wall_start
        super().__init__(selector)
        selector.loop = self

    # Read by asyncio on every iteration: it runs the timers due before
    # ``time() + _clock_resolution``. Past 2**24 s a fixed 1e-9 rounds away
    # (``now + 1e-9 == now``), so a timer due now would never run and the loop would
    # spin; one ulp of the clock's value keeps the bound strictly after now.
    _scheduled: list[asyncio.TimerHandle]

    @property
    def _clock_resolution(self) -> float:
        return max(self._base_resolution, math.ulp(self._now))

    @_clock_resolution.setter
    def _clock_resolution(self, value: float) -> None:
        self._base_resolution = value

    def time(self) -> float:
        """The virtual monotonic clock, in seconds."""
        return self._now

    def wall_time(self) -> float:
        """The virtual wall clock: ``wall_start`` plus the virtual time elapsed."""
        return self._wall_start + (self._now - EPOCH)

    async def shutdown_default_executor(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """As the base loop's, but without a timeout: the join happens in real time,
        and a timeout on the virtual clock would expire at once (``asyncio.Runner``
        passes one since Python 3.12)."""
        await super().shutdown_default_executor()

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[Unpack[Ts]], T], *args: *Ts
    ) -> asyncio.Future[T]:
        """As the base loop's, but the loop knows the call is at work in a thread."""
        with self._threads.lock:
            self._threads.busy += 1
        job = _Job(self._threads, func, args)
        try:
            fut: asyncio.Future[T] = super().run_in_executor(executor, job.run)
        except BaseException:
            with self._threads.lock:
                self._threads.busy -= 1
            raise
        fut.add_done_callback(job.on_done)
        return fut


def _check_clock_args(
    what: str, wall_start: object, thread_grace: object, idle_timeout: object
) -> tuple[float | None, float, float]:
    if isinstance(wall_start, dt.datetime):
        wall_start = _checks.aware_datetime(f"{what}: wall_start", wall_start).timestamp()
    return (
        None if wall_start is None else _checks.finite(f"{what}: wall_start", wall_start),
        _checks.seconds(f"{what}: thread_grace", thread_grace),
        _checks.seconds(f"{what}: idle_timeout", idle_timeout, positive=True),
    )


def wall_time(loop: asyncio.AbstractEventLoop | None = None) -> float:
    """The wall clock as ``loop`` (default: the running loop) sees it, in seconds since
    the Unix epoch: a :class:`VirtualTimeLoop`'s virtual wall clock (``wall_start``
    plus the virtual time elapsed), the system's clock on any other loop. What
    ``envq.Cron`` and ``not_before`` read; typed, unlike ``loop.wall_time()`` on an
    ``asyncio.AbstractEventLoop``.

    :raises RuntimeError: no ``loop`` given and no loop running.
    """
    if loop is None:
        loop = asyncio.get_running_loop()
    if isinstance(loop, VirtualTimeLoop):
        return loop.wall_time()
    return time.time()


async def advance(seconds: float) -> None:
    """Let ``seconds`` of loop time pass (instantly on a virtual-time loop)."""
    await asyncio.sleep(_checks.seconds("advance: seconds", seconds))


def run(
    coro: Coroutine[Any, Any, T],
    *,
    wall_start: float | dt.datetime | None = None,
    thread_grace: float = 2.0,
    idle_timeout: float = 30.0,
) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop`, then close it."""
    if not isinstance(coro, Coroutine):
        raise TypeError(f"run: coro must be a coroutine, got {_checks.show(coro)}")
    try:
        wall_start, thread_grace, idle_timeout = _check_clock_args(
            "run", wall_start, thread_grace, idle_timeout
        )
    except (TypeError, ValueError):
        coro.close()  # it will never run: no "was never awaited" warning
        raise

    def factory() -> asyncio.AbstractEventLoop:
        return VirtualTimeLoop(
            wall_start=wall_start, thread_grace=thread_grace, idle_timeout=idle_timeout
        )

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
