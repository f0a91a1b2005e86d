"""Shared helpers of the tests: the clock, small invokes and hook factories, the
``Recorder`` of a queue's events, the ``Trace`` of attempts and hooks, and a running
queue (the queue fixtures built on them are in ``tests/conftest.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, Protocol

import envq
from envq._machine import TERMINAL_STATES

TERMINAL = TERMINAL_STATES
#: Enough virtual time for anything a test waits for; a miss fails fast with TimeoutError.
PATIENCE = 100_000.0

#: What an attempt of a ``Trace`` envelope does after its sleep.
Behaviour = str  # "ok", "fail", "stop", "no_retry", "retry"


# ---------------------------------------------------------------------------------------
# The clock
# ---------------------------------------------------------------------------------------


def now() -> float:
    """The running loop's (virtual) time."""
    return asyncio.get_running_loop().time()


async def settle() -> None:
    """Let every ready task run, without moving the clock."""
    for _ in range(50):
        await asyncio.sleep(0)


def gaps(times: list[float]) -> list[float]:
    """The time between each pair of consecutive ``times``."""
    return [b - a for a, b in itertools.pairwise(times)]


def assert_names(exc: BaseException, *parts: str) -> None:
    """The error message mentions every one of ``parts``."""
    message = str(exc)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ---------------------------------------------------------------------------------------
# Invokes and hooks
# ---------------------------------------------------------------------------------------


async def noop(env: envq.Envelope) -> None:
    """An invoke (or hook) that succeeds at once."""
    return


def raising(exc: BaseException) -> Callable[[envq.Envelope], Any]:
    """An invoke (or hook) that raises ``exc``."""

    async def invoke(env: envq.Envelope) -> None:
        raise exc

    return invoke


def sleeper(seconds: float, log: list[str] | None = None, name: str = "") -> Any:
    """An invoke that sleeps ``seconds``, logging ``"NAME start"``, then ``"NAME end"``
    (or ``"NAME cancelled"``) in ``log`` if given."""

    async def invoke(env: envq.Envelope) -> None:
        if log is not None:
            log.append(f"{name} start")
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            if log is not None:
                log.append(f"{name} cancelled")
            raise
        if log is not None:
            log.append(f"{name} end")

    return invoke


async def nap(env: envq.Envelope) -> None:
    """An invoke that lasts ``env.payload`` seconds (0 when no payload)."""
    await asyncio.sleep(env.payload or 0)


def lasting(seconds: float = 0, **kwargs: Any) -> envq.Envelope:
    """An envelope whose attempt lasts ``seconds``."""
    return envq.Envelope(invoke=nap, payload=seconds, **kwargs)


def gated(
    gate: asyncio.Event, calls: list[envq.Envelope] | None = None, **kwargs: Any
) -> envq.Envelope:
    """An envelope whose attempt lasts until ``gate`` is set; each attempt is logged in calls."""

    async def invoke(env: envq.Envelope) -> None:
        if calls is not None:
            calls.append(env)
        await gate.wait()

    return envq.Envelope(invoke=invoke, **kwargs)


async def retry_in_3(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
    """An ``on_failure`` hook: retry three seconds later."""
    return envq.retry_after(3)


class Starts:
    """An invoke that records the loop time of every call and fails the first ``fails``."""

    def __init__(self, fails: int = 0, exc: type[BaseException] = ValueError) -> None:
        self.times: list[float] = []
        self.fails = fails
        self.exc = exc

    async def __call__(self, env: envq.Envelope) -> None:
        self.times.append(now())
        if len(self.times) <= self.fails:
            raise self.exc(f"failure {len(self.times)}")


# ---------------------------------------------------------------------------------------
# What a queue did
# ---------------------------------------------------------------------------------------


class Recorder:
    """Collects a queue's events (with the loop time each was delivered at) and lets a
    test await a condition on them."""

    #: How long (virtual seconds) :meth:`until` waits before it fails.
    patience = PATIENCE

    def __init__(self, queue: envq.Queue) -> None:
        self.events: list[envq.Event] = []
        self.delivered_at: list[float] = []
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self.unsubscribe = queue.subscribe(self._on_event)

    def _on_event(self, event: envq.Event) -> None:
        self.events.append(event)
        self.delivered_at.append(now())
        for cond, fut in self._waiters:
            if not fut.done() and cond():
                fut.set_result(None)

    def of(self, env: envq.Envelope) -> list[envq.Event]:
        """The events of ``env``."""
        return [e for e in self.events if e.envelope is env]

    def states(self, env: envq.Envelope) -> list[Any]:
        """The states ``env`` moved to, in order."""
        return [e.to_state for e in self.of(env)]

    def moves(self, env: envq.Envelope) -> list[tuple[Any, Any, Any]]:
        """(from, to, outcome) of each event of ``env``."""
        return [(e.from_state, e.to_state, e.outcome) for e in self.of(env)]

    def times(self, env: envq.Envelope) -> list[float]:
        """The times of the events of ``env``."""
        return [e.time for e in self.of(env)]

    def queue_moves(self) -> list[tuple[Any, Any]]:
        """(from, to) of the queue's own events."""
        return [(e.from_state, e.to_state) for e in self.events if e.envelope is None]

    def ends(self, env: envq.Envelope) -> list[envq.Event]:
        """The events that ended an attempt of ``env`` (they carry an outcome)."""
        return [e for e in self.of(env) if e.outcome is not None]

    def final(self, env: envq.Envelope) -> envq.Event | None:
        """The event that ended ``env``, if it has ended."""
        return next((e for e in self.of(env) if e.to_state in TERMINAL), None)

    async def until(self, cond: Callable[[], bool]) -> None:
        """Return once ``cond()`` holds (checked at each event)."""
        if cond():
            return
        entry = (cond, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.patience):
                await entry[1]
        finally:
            self._waiters.remove(entry)

    async def ended(self, env: envq.Envelope) -> envq.Event:
        """The event that ended ``env``, once it has."""
        await self.until(lambda: self.final(env) is not None)
        event = self.final(env)
        assert event is not None
        return event

    async def attempts(self, env: envq.Envelope, n: int) -> list[envq.Event]:
        """The events that ended the first ``n`` attempts of ``env``, once they have."""
        await self.until(lambda: len(self.ends(env)) >= n)
        return self.ends(env)


class Trace:
    """Records what a test's envelopes did: the events of the queues it watches, each
    attempt's start, end and cancellation (envelopes made by :meth:`env`), and the order
    hooks and stamps ran in (made by :meth:`hook`, :meth:`stamp`, :meth:`envelope`)."""

    def __init__(self) -> None:
        self.events: list[envq.Event] = []
        self.starts: list[tuple[Hashable, float]] = []
        #: Attempts that returned from their sleep (whether or not they then raised).
        self.ends: list[tuple[Hashable, float]] = []
        #: Every attempt that stopped, however (cancelled included).
        self.finished: list[tuple[Hashable, float]] = []
        self.cancels: list[tuple[Hashable, float]] = []
        #: The names of the hooks and stamps, as they ran.
        self.log: list[str] = []

    def watch(self, q: envq.Queue) -> None:
        """Record the events of ``q``."""
        q.subscribe(self.events.append)

    # Attempts -----------------------------------------------------------------------

    def job(
        self, seconds: float = 0.0, behaviour: Behaviour = "ok", *, fail: bool = False
    ) -> Callable[[envq.Envelope], Awaitable[None]]:
        """An invoke that sleeps ``seconds``, then does ``behaviour`` (``fail=True``:
        raise, as ``"fail"``)."""
        if fail:
            behaviour = "fail"

        async def invoke(env: envq.Envelope) -> None:
            self.starts.append((env.id, now()))
            try:
                await asyncio.sleep(seconds)
            except asyncio.CancelledError:
                self.cancels.append((env.id, now()))
                raise
            finally:
                self.finished.append((env.id, now()))
            self.ends.append((env.id, now()))
            if behaviour in ("fail", "retry"):
                raise RuntimeError(f"{env.id} failed")
            if behaviour == "stop":
                raise envq.StopEnvelope
            if behaviour == "no_retry":
                raise envq.DoNotRetry

        return invoke

    def env(
        self,
        id: Hashable,
        seconds: float = 0.0,
        behaviour: Behaviour = "ok",
        *,
        fail: bool = False,
        **fields: Any,
    ) -> envq.Envelope:
        """An envelope running :meth:`job` (``"retry"``: retried three seconds later)."""
        if behaviour == "retry":
            fields["on_failure"] = retry_in_3
        return envq.Envelope(invoke=self.job(seconds, behaviour, fail=fail), id=id, **fields)

    def started(self, id: Hashable) -> list[float]:
        """When each attempt of the envelope ``id`` started."""
        return [t for i, t in self.starts if i == id]

    def for_env(self, env: envq.Envelope) -> list[envq.Event]:
        """The events of ``env``."""
        return [e for e in self.events if e.envelope is env]

    def states(self, env: envq.Envelope) -> list[envq.EnvState | envq.QueueState]:
        """The states ``env`` moved to, in order."""
        return [e.to_state for e in self.for_env(env)]

    def last(self, env: envq.Envelope) -> envq.EnvState | envq.QueueState:
        """The state ``env`` moved to last."""
        return self.states(env)[-1]

    def queue_states(self) -> list[envq.EnvState | envq.QueueState]:
        """The states the watched queues moved to, in order."""
        return [e.to_state for e in self.events if e.envelope is None]

    def queue_moves(self) -> list[tuple[object, object]]:
        """(from, to) of the watched queues' own events."""
        return [(e.from_state, e.to_state) for e in self.events if e.envelope is None]

    def live(self, envs: list[envq.Envelope]) -> int:
        """How many of ``envs`` were admitted and have not ended."""
        return sum(1 for env in envs if self.for_env(env) and self.last(env) not in TERMINAL)

    # Hooks and stamps -----------------------------------------------------------------

    def hook(self, name: str, exc: BaseException | None = None) -> Callable[[envq.Envelope], Any]:
        """A hook (or invoke) that logs ``name``, then raises ``exc`` if given."""

        async def run(env: envq.Envelope) -> None:
            self.log.append(name)
            if exc is not None:
                raise exc

        return run

    def on_failure(self, decision: envq.Decision | None = None) -> Any:
        """An ``on_failure`` hook that logs its name and returns ``decision``."""

        async def run(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision | None:
            self.log.append("on_failure")
            return decision

        return run

    def stamp(self, name: str) -> envq.Stamp:
        """A stamp that logs ``NAME>`` before the invoke it wraps and ``NAME<`` after."""

        def apply(nxt: envq.Invoker) -> envq.Invoker:
            async def wrapped(env: envq.Envelope) -> None:
                self.log.append(f"{name}>")
                await nxt(env)
                self.log.append(f"{name}<")

            return wrapped

        return apply

    def envelope(self, invoke_exc: BaseException | None = None, **fields: Any) -> envq.Envelope:
        """An envelope whose invoke and hooks all log their names (``fields`` override)."""
        options: dict[str, Any] = {
            "invoke": self.hook("invoke", invoke_exc),
            "before": self.hook("before"),
            "after": self.hook("after"),
            "on_success": self.hook("on_success"),
            "on_failure": self.on_failure(),
        }
        options.update(fields)
        return envq.Envelope(**options)


class Watcher(Protocol):
    """Anything that records a queue's events once told to (``Trace``, for one)."""

    def watch(self, q: envq.Queue) -> None: ...


class QueueMaker:
    """Makes queues for one test, and terminates them on the test's loop when it ends."""

    def __init__(self) -> None:
        self.made: list[envq.Queue] = []

    def __call__(self, *watchers: Watcher, name: str = "test", **options: Any) -> envq.Queue:
        """A new queue (not started) named ``name``, watched by each of ``watchers``."""
        q = envq.Queue(name, **options)
        for watcher in watchers:
            watcher.watch(q)
        self.made.append(q)
        return q

    async def aclose(self) -> None:
        """Terminate every queue made (terminating an ended queue is harmless)."""
        for q in reversed(self.made):
            await q.terminate()


@contextlib.asynccontextmanager
async def running(name: str = "test", **options: Any) -> AsyncIterator[tuple[envq.Queue, Recorder]]:
    """A started queue under a :class:`Recorder`, terminated on the way out."""
    queue = envq.Queue(name, **options)
    recorder = Recorder(queue)
    queue.start()
    try:
        yield queue, recorder
    finally:
        await queue.terminate()
