"""The dowork-style task queue: :class:`TaskQueue` runs :class:`envq.Task` objects
(:mod:`envq._task`).

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
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Final, ParamSpec, TypeVar, overload

from envq import _checks
from envq._envelope import Envelope, is_async_callable
from envq._errors import (
    EnvqError,
    QueueShuttingDown,
    QueueTerminated,
)
from envq._limits import RateLimiter
from envq._machine import TERMINAL_STATES, EnvState, QueueState
from envq._queue import Queue
from envq._reports import Event
from envq._task import _INSIDE, AfterCallback, Task, TaskFn, check_task
from envq._values import StopMode

__all__ = ["AfterCallback", "Task", "TaskFn", "TaskQueue"]

log = logging.getLogger("envq")

T = TypeVar("T")
P = ParamSpec("P")

_BUSY: Final = frozenset({EnvState.READY, EnvState.RUNNING})


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
