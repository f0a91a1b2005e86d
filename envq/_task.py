"""The dowork-style task: :class:`Task`, a function plus a retry policy, built
fluently::

    task = envq.Task(fetch).retries(5).max_timeout(600).within(10).after(report)

A task becomes one one-off :class:`envq.Envelope` when a task queue
(:mod:`envq._tasks`) runs it; it ends exactly once, reports its end to ``after``
callbacks and to a :class:`concurrent.futures.Future`, and refuses to run again once
ended (:class:`envq.AlreadyComplete`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import datetime as dt
import functools
import inspect
import logging
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import TYPE_CHECKING, Any, Final, Generic, ParamSpec, Protocol, Self, TypeVar, overload

from envq import _checks
from envq._envelope import Envelope, is_async_callable
from envq._errors import AlreadyComplete, BadEnvelope, BadEnvelopeType
from envq._machine import EnvState
from envq._values import Retry, default_rng

if TYPE_CHECKING:
    from envq._queue import Queue

__all__ = ["AfterCallback", "Owner", "Task", "TaskFn", "check_task"]

log = logging.getLogger("envq")

#: A task's work: called with the arguments given to ``Task(fn, *args, **kwargs)``
#: (or ``submit``); ``async def``, or plain (runs in the task queue's thread pool; if
#: it returns an awaitable, that is awaited on the loop).
TaskFn = Callable[..., Any]
#: ``after(error)``: called once when the task ends, with ``None`` or the final error;
#: ``async def`` or plain (runs in the thread pool).
AfterCallback = Callable[[BaseException | None], Any]

#: The task queue whose task (attempt or ``after`` callback) the current context runs,
#: threads included: ``shutdown()`` from there would wait for itself.
_INSIDE: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "envq_task_queue", default=None
)

#: ``max_timeout(0)`` / ``max_timeout(None)``: no cap (the largest finite float).
_UNCAPPED: Final = sys.float_info.max

T = TypeVar("T")
P = ParamSpec("P")


def _loop_wall(loop: asyncio.AbstractEventLoop, loop_time: float) -> dt.datetime:
    """The wall-clock moment (aware, UTC) of ``loop_time`` on ``loop``'s clock."""
    wall = getattr(loop, "wall_time", None)
    now = wall() if callable(wall) else time.time()
    return dt.datetime.fromtimestamp(now + (loop_time - loop.time()), tz=dt.UTC)


class _TaskFuture(concurrent.futures.Future[T]):
    """A task's future; knows whether anyone waits on it or asked to be called back
    (``await task``, ``task.future.result()``, ``add_done_callback``…), so that a
    failure nobody observes can be logged.

    It cannot be cancelled: it reports the task's end, and the task belongs to its
    queue. A waiter that gives up (``asyncio.wait_for(task, t)`` timing out, a
    cancelled coroutine awaiting the task) ends its own wait, not the task."""

    observed = False

    def cancel(self) -> bool:
        """Refused: always False, and the future keeps following the task."""
        return False

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[Any]], object]) -> None:
        """As ``concurrent.futures.Future.add_done_callback``; marks it observed."""
        self.observed = True
        super().add_done_callback(fn)

    def result(self, timeout: float | None = None) -> T:
        """As ``concurrent.futures.Future.result``; marks it observed."""
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """As ``concurrent.futures.Future.exception``; marks it observed."""
        self.observed = True
        return super().exception(timeout)


class _TaskId:
    """A task's envelope ``id``: its dedup key is the task (ids compare by identity),
    and it reads as the task's name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return repr(self.name)

    def __str__(self) -> str:
        return self.name


class Owner(Protocol):
    """The task queue a task is queued in, as the task sees it: its name (in
    messages) and the engine queue that runs the task's envelope."""

    @property
    def name(self) -> str:
        """The task queue's name."""
        ...

    @property
    def queue(self) -> Queue:
        """The engine queue the task's envelope is sent to."""
        ...


class Task(Generic[T]):
    """One piece of work with a retry policy, dowork style.

    ``Task(fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)``; ``T`` is what it
    returns (awaited, for an ``async def`` ``fn``): ``await task`` and
    ``task.future.result()`` give a ``T``, and type checkers check the arguments
    against ``fn``'s signature. The task's own settings are builder methods, never
    keywords of the constructor, so every keyword goes to ``fn``.

    Build it fluently, then hand it to :func:`envq.enqueue`, :meth:`TaskQueue.enqueue`
    or :meth:`envq.BackgroundQueue.enqueue`; a task's settings are fixed once it is
    queued. A task runs until one attempt succeeds or its attempts are used up, and
    ends exactly once.

    :param fn: the work (positional only): ``async def``, or plain (it then runs in
        the task queue's thread pool; an awaitable it returns is awaited on the loop,
        so ``Task(lambda: send(x))`` works for an ``async def send``). Raise
        :class:`envq.DoNotRetry` to fail at once.
    :param args: positional arguments for ``fn``, given to every attempt.
    :param kwargs: keyword arguments for ``fn``, given to every attempt; any name,
        ``rng`` or ``retries`` included, is ``fn``'s.
    :raises TypeError: ``fn`` is not callable, or the arguments do not fit its
        signature.

    Defaults, as dowork's: one attempt (no retries), backoff capped at 30 minutes,
    jitter on, no per-attempt deadline. The backoff after the k-th failure is
    ``min(max_timeout, base·2^(k−1))`` (``base`` 1 s, see :meth:`backoff`), drawn
    uniformly from ``[d/2, d]`` unless :meth:`no_jitter`.
    """

    @overload
    def __init__(
        self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> None: ...

    @overload
    def __init__(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> None: ...

    def __init__(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        _checks.callable_("Task: fn", fn)
        name = getattr(fn, "__qualname__", None) or repr(fn)
        _check_arguments(name, fn, args, kwargs)
        #: The function, as given.
        self.fn: Final = fn
        #: Its positional arguments, as given.
        self.args: Final = args
        #: Its keyword arguments, as given.
        self.kwargs: Final = kwargs
        self.name: Final[str] = name
        self._call: Callable[[], Any] = (
            functools.partial(fn, *args, **kwargs) if args or kwargs else fn
        )
        self._rng = default_rng
        self._attempts_max = 1
        self._base = 1.0
        self._cap = 1800.0
        self._within = 0.0
        self._not_before: dt.datetime | None = None
        self._jitter = True
        self._after: list[AfterCallback] = []
        self._lock = threading.Lock()
        self._owner: Owner | None = None
        self._frozen = False
        self._attempts = 0
        self._done = False
        self._error: BaseException | None = None
        self._value: tuple[int, Any] = (0, None)
        #: How many ``after`` callbacks have been started, and how often the task's
        #: finisher was cancelled (see ``TaskQueue._finish_done``).
        self._afters_started = 0
        self._finish_cancels = 0
        self._env: Envelope | None = None
        #: Resolved once the task has ended and its ``after`` callbacks have run: with
        #: ``fn``'s return value, or with the final error as its exception.
        self._future: _TaskFuture[T] = _TaskFuture()
        self.future: Final[concurrent.futures.Future[T]] = self._future

    # ----------------------------------------------------------------------------------
    # Builder
    # ----------------------------------------------------------------------------------

    def _check_mutable(self, what: str) -> None:
        if self._frozen:
            raise RuntimeError(f"task {self.name!r}: {what}() after it was queued")

    def retries(self, n: int) -> Self:
        """At most ``n`` attempts in all, the first included (dowork's ``Retries``);
        ``-1`` = until it succeeds. The default is 1: no retry."""
        self._check_mutable("retries")
        self._attempts_max = _checks.integer("Task.retries: n", n, minimum=1, unlimited=True)
        return self

    def max_timeout(self, seconds: float | dt.timedelta | None) -> Self:
        """Cap the backoff between attempts (default 1800 s, dowork's 30 minutes);
        ``0`` or ``None`` = no cap."""
        self._check_mutable("max_timeout")
        cap = 0.0
        if seconds is not None:
            cap = _checks.seconds("Task.max_timeout: seconds", seconds, timedelta=True)
        self._cap = cap if cap > 0 else _UNCAPPED
        return self

    def backoff(self, base: float | dt.timedelta) -> Self:
        """The backoff after the first failure (default 1 s; it doubles after each
        further failure). ``backoff(120)`` reproduces dowork's 2, 4, 8… minutes."""
        self._check_mutable("backoff")
        self._base = _checks.seconds("Task.backoff: base", base, timedelta=True)
        return self

    def within(self, seconds: float | dt.timedelta) -> Self:
        """A deadline for each attempt; an attempt that overruns it fails with
        ``TimeoutError`` (and may be retried). ``0`` = none (the default)."""
        self._check_mutable("within")
        self._within = _checks.seconds("Task.within: seconds", seconds, timedelta=True)
        return self

    def after(self, callback: AfterCallback) -> Self:
        """Call ``callback(error)`` once when the task ends: ``error`` is ``None`` on
        success, else the final error (:class:`envq.MaxRetriesExceeded` with the last
        error as ``__cause__`` when the attempts ran out). Several callbacks run in the
        order they were added; one that raises is logged."""
        self._check_mutable("after")
        self._after.append(_checks.callable_("Task.after: callback", callback))
        return self

    def not_before(self, when: dt.datetime) -> Self:
        """The earliest time of the first attempt (an aware datetime)."""
        self._check_mutable("not_before")
        self._not_before = _checks.aware_datetime("Task.not_before: when", when)
        return self

    def rng(self, rng: random.Random) -> Self:
        """Draw the backoff jitter from ``rng`` (default: envq's shared generator), e.g.
        a seeded ``random.Random(7)`` for repeatable delays."""
        self._check_mutable("rng")
        self._rng = _checks.instance("Task.rng: rng", rng, random.Random)
        return self

    def no_jitter(self) -> Self:
        """Use the exact backoff delays, without randomness."""
        self._check_mutable("no_jitter")
        self._jitter = False
        return self

    # ----------------------------------------------------------------------------------
    # State
    # ----------------------------------------------------------------------------------

    @property
    def attempts(self) -> int:
        """How many attempts have started."""
        return self._attempts

    @property
    def done(self) -> bool:
        """Whether the task has ended, successfully or not."""
        return self._done

    @property
    def next_attempt(self) -> dt.datetime | None:
        """When the next attempt is due (an aware datetime), or ``None`` when none is
        scheduled: an attempt is running, the queue is stopped, or the task has ended.
        Before the task is queued or while its queue has not started: its
        ``not_before``."""
        owner, env = self._owner, self._env
        if owner is None or env is None:
            return None if self._frozen else self._not_before
        queue = owner.queue
        state = queue.state_of(env)
        loop = queue.loop
        if loop is None or state is EnvState.BUFFERED:
            return self._not_before
        due = queue.due(env)
        if due is not None:
            return _loop_wall(loop, due)
        if state is EnvState.READY:
            return _loop_wall(loop, loop.time())
        return None

    @property
    def result(self) -> BaseException | None:
        """The final error, or ``None`` if the task succeeded (dowork's ``Result``).

        :raises RuntimeError: the task has not ended yet.
        """
        if not self._done:
            raise RuntimeError(f"task {self.name!r} has not ended yet")
        return self._error

    @property
    def retry(self) -> Retry:
        """The task's retry policy as an :class:`envq.Retry`."""
        return Retry(
            attempts=self._attempts_max,
            base=self._base,
            cap=self._cap,
            jitter=self._jitter,
            rng=self._rng,
        )

    def __await__(self) -> Generator[Any, None, T]:
        """``await task``: wait for it to end; its return value, or raise its error."""
        return asyncio.wrap_future(self.future).__await__()

    def __repr__(self) -> str:
        state = "done" if self._done else "queued" if self._owner else "new"
        return f"<envq.Task {self.name} {state} attempts={self._attempts}>"

    # ----------------------------------------------------------------------------------
    # Used by the task queues
    # ----------------------------------------------------------------------------------

    def _claim(self, owner: Owner) -> bool:
        """Reserve the task for ``owner``; False if it is already queued there.

        :raises AlreadyComplete: the task has ended.
        :raises BadEnvelope: the task is queued in another task queue.
        """
        with self._lock:
            if self._done:
                raise AlreadyComplete(f"task {self.name!r} has already ended")
            if self._owner is owner:
                return False
            if self._owner is not None:
                raise BadEnvelope(f"task {self.name!r} is already queued in {self._owner.name!r}")
            self._owner = owner
            self._frozen = True
            return True

    def _release(self) -> None:
        with self._lock:
            self._owner = None
            self._env = None

    def _envelope(self, queue: Owner) -> Envelope:
        if is_async_callable(self._call):
            fn = self._call

            async def invoke(env: Envelope) -> None:
                n = self._begin()
                token = _INSIDE.set(queue)
                try:
                    self._value = (n, await fn())
                finally:
                    _INSIDE.reset(token)

        else:
            engine = queue.queue

            async def invoke(env: Envelope) -> None:
                n = self._begin()
                token = _INSIDE.set(queue)
                try:
                    # In the engine's thread pool; an awaitable it returns is awaited.
                    self._value = (n, await engine._threads.call(self._call))
                finally:
                    _INSIDE.reset(token)

        env = self._env = Envelope(
            invoke=invoke,
            # Unique to this task (two tasks of one function are two runs), shown as
            # the task's name in logs.
            id=_TaskId(self.name),
            deadline=self._within,
            # With one attempt there is nothing to retry: the task ends with its own
            # error, not MaxRetriesExceeded.
            retry=self.retry if self._attempts_max != 1 else None,
            not_before=self._not_before,
        )
        return env

    def _begin(self) -> int:
        with self._lock:
            self._attempts += 1
            return self._attempts

    def _end(self, error: BaseException | None) -> None:
        with self._lock:
            self._done = True
            self._error = error
            self._owner = None
            self._env = None

    def _outcome(self) -> tuple[BaseException | None, Any]:
        n, value = self._value
        return self._error, value if n == self._attempts else None


def _check_arguments(
    name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Refuse, at once, arguments that do not fit ``fn``'s signature (when it has one
    Python can read): the mistake shows where the task is made, not at its first
    attempt."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a readable signature
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"Task: the arguments do not fit {name}{signature}: {exc}") from None


def check_task(where: str, task: object) -> Task[Any]:
    """``task`` if it is a :class:`Task`; else :class:`envq.BadEnvelopeType` (a
    ``TypeError`` and a ``BadEnvelope``), with a hint when it is a function."""
    if not isinstance(task, Task):
        hint = " (to run a function, use submit(fn, *args) or enqueue(Task(fn)))"
        raise BadEnvelopeType(
            f"{where}: task must be a Task, got {_checks.show(task)}"
            + (hint if callable(task) else "")
        )
    return task
