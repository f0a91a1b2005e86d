"""The dowork-style task API: :class:`Task` and :class:`TaskQueue`.

A :class:`Task` is a function plus a retry policy, built fluently::

    task = envq.Task(fetch).retries(5).max_timeout(600).within(10).after(report)

A :class:`TaskQueue` runs tasks on an :class:`envq.Queue`: each task becomes one
one-off :class:`envq.Envelope` whose ``retry`` is the task's policy, so scheduling,
deadlines, backoff, rate limits, stop/park and events are the engine's own. The task
queue adds what dowork users expect on top: a task ends exactly once, reports its end
to ``after`` callbacks and to a :class:`concurrent.futures.Future`, refuses to run
again once ended (:class:`envq.AlreadyComplete`), and a shut-down queue refuses new
tasks (:class:`envq.QueueShuttingDown`).

The thread-hosted variant for synchronous programs and the global ``submit`` /
``enqueue`` / ``shutdown`` live in :mod:`envq._background`.
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
from types import TracebackType
from typing import Any, Final, Generic, ParamSpec, Self, TypeVar, overload

from envq import _checks
from envq._envelope import Envelope, is_async_callable
from envq._errors import (
    AlreadyComplete,
    BadEnvelope,
    BadEnvelopeType,
    EnvqError,
    QueueShuttingDown,
    QueueTerminated,
)
from envq._limits import RateLimiter
from envq._machine import TERMINAL_STATES, EnvState, QueueState
from envq._queue import Queue
from envq._reports import Event
from envq._values import Retry, StopMode, default_rng

__all__ = ["AfterCallback", "Task", "TaskFn", "TaskQueue"]

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
_INSIDE: contextvars.ContextVar[TaskQueue | None] = contextvars.ContextVar(
    "envq_task_queue", default=None
)

#: ``max_timeout(0)`` / ``max_timeout(None)``: no cap (the largest finite float).
_UNCAPPED: Final = sys.float_info.max
_BUSY: Final = frozenset({EnvState.READY, EnvState.RUNNING})

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
        self._owner: TaskQueue | None = None
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

    def _claim(self, owner: TaskQueue) -> bool:
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

    def _envelope(self, queue: TaskQueue) -> Envelope:
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


def _resolve(fut: concurrent.futures.Future[Any], error: BaseException | None, value: Any) -> None:
    if not fut.done():
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)


class TaskQueue:
    """A dowork-style task queue over an :class:`envq.Queue`.

    Use it from one event loop. ``start()`` (or ``run()``, ``dispatch()``, ``async
    with``) starts it; from then on due tasks run on their own while the loop runs.

    :param name: the underlying queue's name: any non-empty printable str without
        surrounding whitespace (``"my-tasks"``); it labels the queue's metrics.
    :param workers: how many tasks run at once.
    :param capacity: most tasks queued at once; 0 = unlimited (``enqueue`` raises
        :class:`envq.CapacityExceeded` beyond it).
    :param rate: a dispatch limiter, e.g. ``envq.TokenBucket(rate=5, burst=10)``.
    :param limiter: a failure-retry limiter, e.g. ``envq.default_limiter()``: every
        retry waits at least what it says.
    :param threads: size of the thread pool for plain functions and callbacks
        (default ``min(32, workers + 4)``).
    :param log_unhandled: log a task that fails while nothing observes it (no
        ``after`` callback, nobody waiting on its future) once, at WARNING with the
        error's traceback, through the ``envq`` logger.
    """

    def __init__(
        self,
        name: str = "tasks",
        *,
        workers: int = 1,
        capacity: int = 0,
        rate: RateLimiter | None = None,
        limiter: RateLimiter | None = None,
        threads: int | None = None,
        log_unhandled: bool = True,
    ) -> None:
        _checks.name("TaskQueue: name", name)
        where = f"TaskQueue {name!r}:"
        _checks.integer(f"{where} workers", workers, minimum=1)
        _checks.integer(f"{where} capacity", capacity, minimum=0)
        for label, lim in (("rate", rate), ("limiter", limiter)):
            if lim is not None:
                _checks.limiter(f"{where} {label}", lim)
        if threads is not None:
            _checks.integer(f"{where} threads", threads, minimum=1)
        _checks.flag(f"{where} log_unhandled", log_unhandled)
        #: The engine the tasks run on (for ``statistics()``, ``subscribe()``…). The
        #: task queue reports failed tasks itself, so the engine does not.
        self.queue: Final = Queue(
            name,
            workers=workers,
            capacity=capacity,
            rate=rate,
            limiter=limiter,
            threads=threads,
            log_unhandled=False,
        )
        self.name: Final = name
        self.log_unhandled: Final = log_unhandled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[Envelope, Task[Any]] = {}
        self._held: list[Envelope] = []
        self._busy = 0
        self._delayed: set[Envelope] = set()
        self._finishing: set[asyncio.Task[None]] = set()
        self._quiet_waiters: list[asyncio.Future[None]] = []
        self._poked = False
        self._running = False
        self._closing: asyncio.Task[None] | None = None
        self._closed = False
        #: Its loop ended with tasks queued (see ``_abandon``).
        self._abandoned = False
        self._finished: asyncio.Future[None] | None = None
        self.queue._listen(self._on_event, handles_failures=False)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "closing" if self._closing else "open"
        return f"<envq.TaskQueue {self.name!r} {state} {len(self._tasks)} pending>"

    @property
    def pending(self) -> int:
        """Tasks queued here that have not ended."""
        return len(self._tasks)

    @property
    def shutting_down(self) -> bool:
        """Whether ``shutdown()`` was called (or the queue's event loop ended): new
        tasks are refused."""
        return self._closing is not None or self._abandoned

    @property
    def closed(self) -> bool:
        """Whether ``shutdown()`` has finished."""
        return self._closed

    # ----------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------

    @overload
    def submit(
        self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Task[T]: ...

    @overload
    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Task[T]: ...

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Task[Any]:
        """Queue ``Task(fn, *args, **kwargs)`` (one attempt, no retry) and return it."""
        return self.enqueue(Task(fn, *args, **kwargs))

    def enqueue(self, task: Task[T]) -> Task[T]:
        """Queue ``task`` and return it; a task already queued here is left as it is.

        :raises QueueShuttingDown: after ``shutdown()``.
        :raises AlreadyComplete: the task has already ended.
        :raises BadEnvelopeType: not a task (a ``TypeError``).
        :raises BadEnvelope: queued in another task queue.
        :raises CapacityExceeded: the queue is full.
        :raises RuntimeError: called from a thread other than the queue's loop's.
        """
        check_task(f"task queue {self.name!r}: enqueue()", task)
        self._check_thread()
        self._check_open()
        if task._claim(self):
            self._admit(task)
        return task

    def start(self) -> None:
        """Start running tasks on the running event loop (a no-op when running).

        :raises QueueShuttingDown: after ``shutdown()``.
        :raises envq.QueueStopping: while a cancelled ``run()`` is still stopping.
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise RuntimeError(f"task queue {self.name!r} is bound to another event loop")
        self._loop = loop
        self.queue.start()
        self._flush_held()

    async def run(self) -> None:
        """Run tasks until cancelled (or until ``shutdown()`` finishes).

        When cancelled, in-flight attempts are cancelled and every task is held (its
        remaining delay kept) until the queue is started again.

        :raises RuntimeError: ``run()`` is already running.
        """
        if self._running:
            raise RuntimeError(f"task queue {self.name!r} is already running run()")
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        if self.queue.state is QueueState.STOPPING:
            await self.queue.wait_stopped()
        self.start()
        self._running = True
        try:
            await asyncio.shield(self._finished_future())
        except asyncio.CancelledError:
            if self._closing is None and self.queue.state is QueueState.RUNNING:
                # Not waited for: whoever cancelled us may be tearing the loop down.
                await self.queue.stop(mode=StopMode.STOP, cancel=True, wait=False)
            raise
        finally:
            self._running = False

    async def dispatch(self) -> bool:
        """Run every task that is due now and wait for those attempts (and the
        ``after`` callbacks of tasks that ended); return whether tasks remain.

        Starts the queue if it is not running; it keeps running afterwards, so
        tasks that become due later run on their own while the loop runs.
        """
        if self._closing is None:
            if self.queue.state is QueueState.STOPPING:
                await self.queue.wait_stopped()
            if self.queue.state is not QueueState.RUNNING:
                self.start()
        await self._quiet()
        return bool(self._tasks)

    async def shutdown(self) -> None:
        """Refuse new tasks (:class:`envq.QueueShuttingDown`), run every queued task
        to its end (retries included) and wait for their ``after`` callbacks, then
        stop the queue for good. Safe to call more than once.

        :raises RuntimeError: from inside one of this queue's tasks.
        """
        if _INSIDE.get() is self:
            raise RuntimeError(
                f"task queue {self.name!r}: shutdown() from inside one of its own tasks "
                "would wait for itself"
            )
        if self._abandoned:
            return
        if self._closing is None:
            _ = self._finished_future()
            self._closing = asyncio.get_running_loop().create_task(
                self._close(), name=f"envq:{self.name}:shutdown"
            )
        await asyncio.shield(self._closing)

    async def __aenter__(self) -> TaskQueue:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    # ----------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing is not None or self._abandoned:
            raise QueueShuttingDown(f"task queue {self.name!r} is shutting down")

    def _check_thread(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is not loop:
            raise RuntimeError(
                f"task queue {self.name!r} belongs to another event loop's thread; "
                "use envq.BackgroundQueue to queue tasks from other threads"
            )

    def _admit(self, task: Task[Any]) -> None:
        """Send the claimed ``task``'s envelope (held while the queue is stopped)."""
        env = task._envelope(self)
        self._tasks[env] = task
        try:
            if self.queue.state in (QueueState.STOPPED, QueueState.STOPPING):
                self._held.append(env)
            else:
                self.queue.send(env)
        except BaseException:
            del self._tasks[env]
            task._release()
            raise

    def _admit_claimed(self, task: Task[Any]) -> None:
        """On the loop: admit a task claimed in another thread; an error ends it."""
        try:
            self._admit(task)
        except Exception as exc:
            log.exception("task queue %r: could not queue task %r", self.name, task.name)
            task._end(exc)
            self._spawn_finish(task)

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        if held:
            self.queue.send(*held)

    def _finished_future(self) -> asyncio.Future[None]:
        if self._finished is None:
            self._finished = asyncio.get_running_loop().create_future()
        return self._finished

    def _on_event(self, event: Event) -> None:
        env = event.envelope
        if env is None:
            if event.to_state is QueueState.TERMINATED:
                self._end_held()
            return
        task = self._tasks.get(env)
        if task is None:
            return
        frm, to = event.from_state, event.to_state
        if frm in _BUSY:
            self._busy -= 1
        if to in _BUSY:
            self._busy += 1
        if to is EnvState.DELAYED:
            self._delayed.add(env)
        else:
            self._delayed.discard(env)
        if to in TERMINAL_STATES:
            del self._tasks[env]
            error: BaseException | None = None
            if to is EnvState.RETURNED:
                # Handed back by a terminate() of the engine (the user's own, or a
                # shutdown's): the engine never runs again, so the task ends here.
                error = self._terminated_error(task)
            elif to is not EnvState.SUCCEEDED:
                error = event.cause or EnvqError(f"task {task.name!r} ended {to.name}")
            task._end(error)
            self._spawn_finish(task)
        self._poke()

    def _terminated_error(self, task: Task[Any]) -> QueueTerminated:
        return QueueTerminated(
            f"task {task.name!r}: its task queue {self.name!r} was terminated before it ended"
        )

    def _end_held(self) -> None:
        """The engine was terminated: end the tasks held while it was stopped."""
        held, self._held = self._held, []
        for env in held:
            task = self._tasks.pop(env, None)
            if task is not None:
                task._end(self._terminated_error(task))
                self._spawn_finish(task)

    def _spawn_finish(self, task: Task[Any]) -> None:
        loop = self._queue_loop()
        fin = loop.create_task(self._finish(task), name=f"envq:{self.name}:after")
        self._finishing.add(fin)
        fin.add_done_callback(lambda fin: self._finish_done(fin, task))

    def _finish_done(self, fin: asyncio.Task[None], task: Task[Any]) -> None:
        self._finishing.discard(fin)
        if fin.cancelled() and not task._future.done():
            # Cancelled from outside, typically by asyncio.run() cancelling every task
            # as the loop ends (the finisher may not even have started). Once, it
            # starts again (a shutdown waits for it); a second cancel only resolves
            # the future, so that no waiter waits for ever.
            task._finish_cancels += 1
            loop = self._queue_loop()
            if task._finish_cancels == 1 and not loop.is_closed():
                self._spawn_finish(task)
            else:
                skipped = task._after[task._afters_started :]
                if skipped:
                    log.warning(
                        "task %r: its after callbacks %r were cancelled and will not run",
                        task.name,
                        skipped,
                    )
                _resolve(task._future, *task._outcome())
        self._poke()

    async def _finish(self, task: Task[Any]) -> None:
        _INSIDE.set(self)  # this finisher's own context
        error, value = task._outcome()
        if not task._afters_started:
            self._log_unobserved(task, error)
        # Resumes after the last callback started, should a cancelled finisher be
        # started again (see _finish_done).
        while task._afters_started < len(task._after):
            callback = task._after[task._afters_started]
            task._afters_started += 1
            try:
                if is_async_callable(callback):
                    await callback(error)
                else:
                    await self.queue._threads.call(callback, error)
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except BaseException:
                log.exception("task %r: after callback %r failed", task.name, callback)
        _resolve(task._future, error, value)

    def _log_unobserved(self, task: Task[Any], error: BaseException | None) -> None:
        if (
            error is not None
            and self.log_unhandled
            and not task._after
            and not task._future.observed
        ):
            log.warning(
                "task %r failed and nothing observes it (no after callback, nobody "
                "waiting on its future): %r",
                task.name,
                error,
                exc_info=error,
            )

    def _abandon(self) -> list[Task[Any]]:
        """The queue's loop has ended (closed, or never to run again) with tasks still
        queued: refuse new tasks, end those with an :class:`envq.EnvqError`, call their
        ``after`` callbacks here (an ``async def`` one on a loop of its own) and resolve
        their futures. Called from plain code, never on the dead loop; the ended tasks."""
        self._closed = self._abandoned = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        self._held.clear()
        # Nothing can terminate the engine without its loop, and its envelopes are
        # these tasks, reported here: it need not warn about them when collected.
        self.queue._live.clear()
        self.queue._store.ids.clear()
        for task in tasks:
            error = EnvqError(
                f"task {task.name!r}: the event loop of task queue {self.name!r} ended "
                "before the task did"
            )
            task._end(error)
            for callback in task._after:
                try:
                    if is_async_callable(callback):
                        asyncio.run(callback(error))
                    else:
                        callback(error)
                except Exception:
                    log.exception("task %r: after callback %r failed", task.name, callback)
            _resolve(task._future, error, None)
        return tasks

    def _queue_loop(self) -> asyncio.AbstractEventLoop:
        loop = self.queue.loop
        if loop is None:
            loop = asyncio.get_running_loop()
        return loop

    def _poke(self) -> None:
        if self._quiet_waiters and not self._poked:
            self._poked = True
            self._queue_loop().call_soon(self._check_quiet)

    def _is_quiet(self) -> bool:
        """Nothing due now is left to run: no task READY or RUNNING, none DELAYED
        whose time has come (its timer not run yet), no ``after`` callbacks pending."""
        if self._busy or self._finishing:
            return False
        if self._delayed:
            now = self._queue_loop().time()
            dues = (self.queue.due(env) for env in self._delayed)
            return all(due is None or due > now for due in dues)
        return True

    def _check_quiet(self) -> None:
        self._poked = False
        if self._is_quiet():
            waiters, self._quiet_waiters = self._quiet_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def _quiet(self) -> None:
        if self._is_quiet():
            return
        fut = asyncio.get_running_loop().create_future()
        self._quiet_waiters.append(fut)
        await fut

    async def _close(self) -> None:
        queue = self.queue
        try:
            if queue.state is QueueState.STOPPING:
                await queue.wait_stopped()
            if queue.state is QueueState.STOPPED:
                queue.start()
            if queue.state is not QueueState.TERMINATED:  # the user may have terminated it
                self._flush_held()
                await queue.run_until_empty()
                # The after callbacks may still need the engine's thread pool, which
                # terminate() shuts down.
                await self._after_callbacks()
                await queue.terminate()  # hands back nothing, unless someone stopped it
            self._end_held()
            await self._after_callbacks()
            queue._threads.shutdown()  # again: the after callbacks may have restarted it
            stuck = queue.statistics().stuck_threads
            if stuck:
                log.warning(
                    "task queue %r: %d task thread(s) still running; not waiting for them",
                    self.name,
                    stuck,
                )
        finally:
            self._closed = True
            finished = self._finished
            if finished is not None and not finished.done():
                finished.set_result(None)

    async def _after_callbacks(self) -> None:
        """Wait until no task's ``after`` callbacks are running."""
        finishing = self._finishing
        while finishing:
            batch = list(finishing)
            await asyncio.gather(*batch, return_exceptions=True)
            # Removed here, not only by their done callbacks: a gather of finished
            # tasks may complete without yielding (CPython 3.12+), so those callbacks
            # might never get to run inside this loop.
            finishing.difference_update(batch)
