"""Tasks for synchronous programs, and the global task queue.

:class:`BackgroundQueue` hosts a :class:`envq.TaskQueue` on its own thread with its own
event loop: any thread may queue tasks (the hand-over is
``loop.call_soon_threadsafe``) and wait on a task's :attr:`Task.future`
(a :class:`concurrent.futures.Future`).

:func:`submit` and :func:`enqueue` use a global task queue, started lazily on first
use: called with no running event loop (plain synchronous code, any thread), it is a
:class:`BackgroundQueue`; called from a coroutine, it is a :class:`TaskQueue` on the
running loop, so async functions run on the loop they were written for.
:func:`shutdown` shuts queues down in parallel: it blocks in plain code and is awaited
in a coroutine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import concurrent.futures.thread  # imported before our exit hook is registered (see there)
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Final, ParamSpec, TypeVar, overload

from envq import _checks
from envq._errors import QueueShuttingDown
from envq._limits import RateLimiter
from envq._task import _INSIDE, Task, check_task
from envq._tasks import TaskQueue

__all__ = ["BackgroundQueue", "enqueue", "shutdown", "submit"]

log = logging.getLogger("envq")

T = TypeVar("T")
P = ParamSpec("P")

#: The global queue's name.
GLOBAL_NAME: Final = "envq_global"


class BackgroundQueue:
    """A :class:`envq.TaskQueue` on a background thread with its own event loop.

    For synchronous programs: ``enqueue``/``submit`` are thread-safe and never block
    (after the first call, which starts the thread); wait for a task with
    ``task.future.result()``. ``shutdown()`` refuses new tasks, waits for the queued
    ones, stops the loop and joins the thread. ``with BackgroundQueue() as q:`` shuts
    down on exit. A queue never shut down is shut down at interpreter exit, before
    ``concurrent.futures`` stops its threads (exit waits for the queued tasks, as it
    does for a ``ThreadPoolExecutor``'s).

    :param name: the underlying queue's name: any non-empty printable str without
        surrounding whitespace (``"my-tasks"``); it labels the queue's metrics.
    :param workers: how many tasks run at once.
    :param rate: a dispatch limiter, e.g. ``envq.TokenBucket(rate=5, burst=10)``.
    :param limiter: a failure-retry limiter, e.g. ``envq.default_limiter()``.
    :param threads: size of the thread pool for plain functions.
    :param loop_factory: makes the thread's event loop (default
        ``asyncio.new_event_loop``).
    :param log_unhandled: log a task that fails while nothing observes it (see
        :class:`envq.TaskQueue`).

    After ``os.fork()``, the child's copy of a started queue has no thread: it refuses
    new tasks with ``RuntimeError`` (make a new queue in the child), and the global
    queue of :func:`envq.submit` starts afresh there.
    """

    def __init__(
        self,
        name: str = "background",
        *,
        workers: int = 1,
        rate: RateLimiter | None = None,
        limiter: RateLimiter | None = None,
        threads: int | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        log_unhandled: bool = True,
    ) -> None:
        _checks.name("BackgroundQueue: name", name)
        where = f"BackgroundQueue {name!r}:"
        _checks.integer(f"{where} workers", workers, minimum=1)
        for label, lim in (("rate", rate), ("limiter", limiter)):
            if lim is not None:
                _checks.limiter(f"{where} {label}", lim)
        if threads is not None:
            _checks.integer(f"{where} threads", threads, minimum=1)
        if loop_factory is not None:
            _checks.plain_callable(
                f"{where} loop_factory",
                loop_factory,
                "it is called synchronously to make the thread's event loop",
            )
        #: The task queue the thread runs.
        self.tasks: Final = TaskQueue(
            name,
            workers=workers,
            rate=rate,
            limiter=limiter,
            threads=threads,
            log_unhandled=log_unhandled,
        )
        self.name: Final = name
        self._loop_factory = loop_factory
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Future[None] | None = None
        self._closing = False
        #: Resolved when the thread's loop has finished (after ``shutdown()``).
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        #: In a child process made by ``os.fork()``: the parent's pid (the queue's
        #: thread did not come along).
        self._forked_from: int | None = None

    def __repr__(self) -> str:
        state = (
            "closed"
            if self._done.done()
            else "closing"
            if self._closing
            else "running"
            if self._thread
            else "new"
        )
        return f"<envq.BackgroundQueue {self.name!r} {state}>"

    @property
    def shutting_down(self) -> bool:
        """Whether ``shutdown()`` was called: new tasks are refused."""
        return self._closing

    @property
    def closed(self) -> bool:
        """Whether the queue has shut down and its thread has ended."""
        return self._done.done()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread hosting the loop (None until the first task)."""
        return self._thread

    @overload
    def submit(
        self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Task[T]: ...

    @overload
    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Task[T]: ...

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Task[Any]:
        """Queue ``Task(fn, *args, **kwargs)`` and return it (thread-safe)."""
        return self.enqueue(Task(fn, *args, **kwargs))

    def enqueue(self, task: Task[T]) -> Task[T]:
        """Queue ``task`` and return it (thread-safe; starts the thread on first use).

        :raises QueueShuttingDown: after ``shutdown()``.
        :raises AlreadyComplete: the task has already ended.
        :raises BadEnvelopeType: not a task (a ``TypeError``).
        :raises BadEnvelope: queued in another task queue.
        """
        check_task(f"task queue {self.name!r}: enqueue()", task)
        if self._forked_from is not None:
            raise RuntimeError(
                f"task queue {self.name!r} was started in process {self._forked_from}; its "
                "thread does not exist in this forked child: make a new BackgroundQueue here"
            )
        with self._lock:
            if self._closing:
                raise QueueShuttingDown(f"task queue {self.name!r} is shutting down")
            loop = self._start()
            if task._claim(self.tasks):
                # In order: a shutdown requested after this sees the task queued.
                loop.call_soon_threadsafe(self.tasks._admit_claimed, task)
        return task

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new tasks, wait until every queued task has ended (retries
        included), stop the loop and join the thread. Safe to call more than once.

        From a coroutine, ``await envq.shutdown(queue)`` does the same without
        blocking the caller's loop.

        :param timeout: seconds to wait at most; on expiry ``TimeoutError`` is raised
            and the shutdown carries on in the background.
        :raises RuntimeError: from the queue's own thread or one of its tasks.
        """
        timeout = _checks.timeout(f"task queue {self.name!r}: shutdown() timeout", timeout)
        self._check_outside()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._begin_shutdown().result(timeout)
        thread = self._thread
        if thread is not None:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError(f"task queue {self.name!r}: thread still running")

    def __enter__(self) -> BackgroundQueue:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    # ----------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------

    def _after_fork(self, parent: int) -> None:
        """In a forked child: the thread is gone; this copy refuses tasks and counts
        as closed (so neither ``shutdown()`` nor interpreter exit waits for it)."""
        self._lock = threading.Lock()
        if self._thread is not None and not self._done.done():
            self._forked_from = parent
            self._closing = True
            self._done = concurrent.futures.Future()
            self._done.set_result(None)

    def _check_outside(self) -> None:
        if threading.current_thread() is self._thread or _INSIDE.get() is self.tasks:
            raise RuntimeError(
                f"task queue {self.name!r}: shutdown() from inside its own thread or "
                "tasks would wait for itself"
            )

    def _start(self) -> asyncio.AbstractEventLoop:
        """Start the thread if needed (with the lock held); its loop."""
        if self._thread is None:
            _register_exit(self)
            thread = threading.Thread(target=self._main, name=f"envq:{self.name}", daemon=True)
            self._thread = thread
            thread.start()
            self._ready.wait()
        if self._loop is None:  # the thread failed to start its loop
            self._done.result()
            raise RuntimeError(f"task queue {self.name!r}: the background loop did not start")
        return self._loop

    def _main(self) -> None:
        error: BaseException | None = None
        try:
            with asyncio.Runner(loop_factory=self._loop_factory) as runner:
                runner.run(self._serve())
        except BaseException as exc:
            log.exception("task queue %r: background loop failed", self.name)
            error = exc
        finally:
            # Forgotten as the global queue before anyone sees it closed: the next
            # submit() starts a fresh one.
            _forget_global(self)
            self._ready.set()
            if error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(error)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = loop.create_future()
        self.tasks.start()
        self._loop = loop
        self._ready.set()
        await self._stop
        await self.tasks.shutdown()

    def _request_stop(self) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)

    def _begin_shutdown(self) -> concurrent.futures.Future[None]:
        """Refuse new tasks and ask the loop to shut down; the future of the end."""
        with self._lock:
            if not self._closing:
                self._closing = True
                if self._loop is None:
                    if self._thread is None and not self._done.done():
                        _forget_global(self)
                        self._done.set_result(None)
                else:
                    self._loop.call_soon_threadsafe(self._request_stop)
        return self._done


# --------------------------------------------------------------------------------------
# Interpreter exit
# --------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[BackgroundQueue] = weakref.WeakSet()
_EXIT_LOCK = threading.Lock()
_exit_registered = False


def _register_exit(queue: BackgroundQueue | None) -> None:
    """Make sure the exit hook is registered (and ``queue`` known to it)."""
    global _exit_registered  # noqa: PLW0603 - one process-wide registration
    if queue is not None:
        _LIVE.add(queue)
    with _EXIT_LOCK:
        if _exit_registered:
            return
        _exit_registered = True
    # threading's own exit hooks run newest first, before non-daemon threads are
    # joined: registered after concurrent.futures.thread's (imported above), ours runs
    # while thread pools still accept work, so the queued tasks can finish.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_at_exit)
        else:  # pragma: no cover - every supported CPython has it
            import atexit  # noqa: PLC0415

            atexit.register(_at_exit)
    except RuntimeError:  # called while the interpreter is already shutting down
        log.warning("envq: background queues started during interpreter exit")


def _at_exit() -> None:
    _sweep_dead_loops(closed_only=False)
    queues = [q for q in list(_LIVE) if not q.closed]
    for q in queues:
        q._begin_shutdown()
    for q in queues:
        try:
            q.shutdown()
        except Exception:
            log.exception("envq: shutting down %r at exit failed", q)


def _after_fork_in_child(parent: int) -> None:
    global _background, _GLOBAL_LOCK, _EXIT_LOCK  # noqa: PLW0603 - a forked child's fresh start
    _GLOBAL_LOCK = threading.Lock()
    _EXIT_LOCK = threading.Lock()
    for queue in list(_LIVE):
        queue._after_fork(parent)
    _background = None  # the next submit() in the child starts its own
    _per_loop.clear()
    watchers = list(_LOOP_END.values())
    _LOOP_END.clear()
    for agen in watchers:  # the parent's loops: nothing to run here
        _close_watcher(agen)


# --------------------------------------------------------------------------------------
# The global queue
# --------------------------------------------------------------------------------------

_GLOBAL_LOCK = threading.Lock()
_background: BackgroundQueue | None = None
_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TaskQueue] = (
    weakref.WeakKeyDictionary()
)


def _forget_global(queue: BackgroundQueue) -> None:
    global _background  # noqa: PLW0603 - the lazily started global queue
    with _GLOBAL_LOCK:
        if _background is queue:
            _background = None


def _global_background() -> BackgroundQueue:
    global _background  # noqa: PLW0603 - the lazily started global queue
    with _GLOBAL_LOCK:
        if _background is None:
            _background = BackgroundQueue(GLOBAL_NAME)
        return _background


def _global_queue() -> TaskQueue | BackgroundQueue:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return _global_background()
    with _GLOBAL_LOCK:
        bg = _background
        if bg is not None and bg._loop is loop:
            return bg.tasks
        tq = _per_loop.get(loop)
        if tq is None or tq.closed:
            tq = _per_loop[loop] = TaskQueue(GLOBAL_NAME)
            tq.start()
            _LOOP_END[tq] = _watch_loop_end(tq)
            _register_exit(None)
        return tq


# --------------------------------------------------------------------------------------
# The end of a loop with a global task queue
# --------------------------------------------------------------------------------------

#: The watcher of each per-loop global queue (kept here: the loop holds it weakly).
_LOOP_END: dict[TaskQueue, AsyncGenerator[None, None]] = {}


async def _until_loop_ends(tq: TaskQueue) -> AsyncGenerator[None, None]:
    """Suspended while the loop lives. The loop's ``shutdown_asyncgens()``, which
    ``asyncio.run()`` and ``asyncio.Runner`` call before closing it, closes this
    generator, and closing it runs the queue's tasks to their end, as interpreter exit
    does for a :class:`BackgroundQueue`'s."""
    try:
        yield
    finally:
        if _LOOP_END.pop(tq, None) is not None:  # not swept: the loop is still running
            await _finish_at_loop_end(tq)


def _watch_loop_end(tq: TaskQueue) -> AsyncGenerator[None, None]:
    """Start a :func:`_until_loop_ends` on the running loop (the loop's asyncgen hook
    registers it for ``shutdown_asyncgens()``); run to its ``yield`` right here."""
    agen = _until_loop_ends(tq)
    with contextlib.suppress(StopIteration):
        agen.__anext__().send(None)
    return agen


async def _finish_at_loop_end(tq: TaskQueue) -> None:
    if not tq.shutting_down and tq.pending:
        log.info(
            "envq: the event loop is closing with %d task(s) of envq.submit() still "
            "queued; running them to their end first (await envq.shutdown() to wait "
            "for them yourself)",
            tq.pending,
        )
    try:
        await tq.shutdown()
    finally:
        loop = asyncio.get_running_loop()
        with _GLOBAL_LOCK:
            if _per_loop.get(loop) is tq:
                del _per_loop[loop]


def _close_watcher(agen: AsyncGenerator[None, None]) -> None:
    """Close a watcher without awaiting (its ``finally`` finds it swept)."""
    step = agen.aclose()
    try:
        step.send(None)
    except StopIteration:
        pass
    except RuntimeError:  # pragma: no cover - already running or closed
        step.close()


def _sweep_dead_loops(*, closed_only: bool) -> None:
    """End, with an error, the tasks of global task queues whose loop is closed (or,
    unless ``closed_only``, no longer running): nothing can run them any more, and
    their waiters must not wait for ever. Logged at ERROR."""
    with _GLOBAL_LOCK:
        dead = [
            (loop, tq)
            for loop, tq in list(_per_loop.items())
            if loop.is_closed() or (not closed_only and not loop.is_running())
        ]
        for loop, _ in dead:
            del _per_loop[loop]
    for loop, tq in dead:
        agen = _LOOP_END.pop(tq, None)
        if agen is not None:
            _close_watcher(agen)
        tasks = tq._abandon()
        if tasks:
            log.error(
                "envq: %d task(s) of envq.submit() never ran to their end: their event "
                "loop %r stopped without shutting down its asynchronous generators "
                "(use asyncio.run() or asyncio.Runner, or await envq.shutdown() before "
                "the loop ends): %s",
                len(tasks),
                loop,
                ", ".join(repr(t.name) for t in tasks),
            )


@overload
def submit(fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> Task[T]: ...


@overload
def submit(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Task[T]: ...


def submit(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Task[Any]:
    """Queue ``Task(fn, *args, **kwargs)`` (one attempt, no retry) on the global queue
    and return it: ``envq.submit(fetch, url, timeout=5)``.

    Usable from plain code (the global queue is then a :class:`BackgroundQueue`
    started on first use) and from coroutines (a task queue on the running loop).
    Wait for the result with ``task.future.result()`` or ``await task``.

    The global queue runs **one task at a time** (it has one worker); for more at
    once, make your own ``envq.TaskQueue(workers=n)`` or
    ``envq.BackgroundQueue(workers=n)``.
    """
    return enqueue(Task(fn, *args, **kwargs))


def enqueue(task: Task[T]) -> Task[T]:
    """Queue ``task`` on the global queue (see :func:`submit`) and return it.

    :raises QueueShuttingDown: while the global queue is shutting down (once it has
        shut down, the next call starts a fresh one).
    :raises AlreadyComplete: the task has already ended.
    :raises BadEnvelopeType: not a task (a ``TypeError``).
    """
    check_task("enqueue()", task)
    return _global_queue().enqueue(task)


class _Finished:
    """What :func:`shutdown` returns in plain code: it is already done."""

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()

    def __repr__(self) -> str:
        return "<envq shutdown: done>"


def shutdown(*queues: TaskQueue | BackgroundQueue, timeout: float | None = None) -> Awaitable[None]:
    """Shut down task queues in parallel; with none given, the global queue(s).

    Each refuses new tasks and waits until its queued tasks have ended. In plain code
    (no running event loop) this blocks until done and returns an already-finished
    awaitable you may ignore; in a coroutine, ``await`` it.

    :param timeout: seconds to wait at most (``TimeoutError`` on expiry).
    :raises RuntimeError: in plain code, for a :class:`TaskQueue` whose loop is not
        running in another thread.
    """
    timeout = _checks.timeout("shutdown: timeout", timeout)
    for i, q in enumerate(queues):
        if not isinstance(q, TaskQueue | BackgroundQueue):
            raise TypeError(
                f"shutdown: queues[{i}] must be a TaskQueue or a BackgroundQueue, "
                f"got {_checks.show(q)}"
            )
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    chosen = list(queues) if queues else _globals(loop)
    if loop is None and not queues:
        _sweep_dead_loops(closed_only=True)
    if loop is None:
        _shutdown_blocking(chosen, timeout)
        return _Finished()
    return _shutdown_async(chosen, timeout)


def _globals(loop: asyncio.AbstractEventLoop | None) -> list[TaskQueue | BackgroundQueue]:
    chosen: list[TaskQueue | BackgroundQueue] = []
    with _GLOBAL_LOCK:
        if _background is not None:
            chosen.append(_background)
        if loop is not None and loop in _per_loop:
            chosen.append(_per_loop[loop])
    return chosen


def _shutdown_blocking(queues: list[TaskQueue | BackgroundQueue], timeout: float | None) -> None:
    futures: list[concurrent.futures.Future[None]] = []
    for q in queues:
        if isinstance(q, BackgroundQueue):
            q._check_outside()
            futures.append(q._begin_shutdown())
            continue
        loop = q._loop
        if loop is None or not loop.is_running():
            raise RuntimeError(
                f"task queue {q.name!r} has no running event loop; await its shutdown() there"
            )
        futures.append(asyncio.run_coroutine_threadsafe(q.shutdown(), loop))
    _, pending = concurrent.futures.wait(futures, timeout)
    if pending:
        raise TimeoutError(f"{len(pending)} task queue(s) still shutting down after {timeout} s")
    for fut in futures:
        fut.result()
    for q in queues:
        if isinstance(q, BackgroundQueue):
            q.shutdown()  # joins the thread; the shutdown itself is over


async def _shutdown_async(queues: list[TaskQueue | BackgroundQueue], limit: float | None) -> None:
    async def one(q: TaskQueue | BackgroundQueue) -> None:
        if isinstance(q, BackgroundQueue):
            q._check_outside()
            await asyncio.wrap_future(q._begin_shutdown())
            thread = q.thread
            if thread is not None:
                await asyncio.to_thread(thread.join)
        elif q._loop is None or q._loop is asyncio.get_running_loop():
            await q.shutdown()
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(q.shutdown(), q._loop))

    async with asyncio.timeout(limit):
        await asyncio.gather(*(one(q) for q in queues))


if hasattr(os, "register_at_fork"):
    _parent_pid = os.getpid()

    def _before_fork() -> None:
        global _parent_pid  # noqa: PLW0603 - the pid a forked child reports
        _parent_pid = os.getpid()

    os.register_at_fork(
        before=_before_fork, after_in_child=lambda: _after_fork_in_child(_parent_pid)
    )
