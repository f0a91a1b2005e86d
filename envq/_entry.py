"""Calls into a queue from outside its loop: the entry from other threads.

A queue belongs to one event loop. Its synchronous methods (``send``, ``statistics``,
``subscribe``, ``start``) may be called from any thread: a caller outside the loop while
the loop runs hands the call to it (:func:`hand_over`) and blocks until it has run
there, so listeners and hooks only ever run on the loop's thread. Its coroutine
methods run on that loop only (:func:`check_own_loop`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, Final, TypeVar

__all__ = ["check_own_loop", "elsewhere", "hand_over", "keep_alive"]

_T = TypeVar("_T")
#: The running event loop of the calling thread, or None (asyncio's C accelerated
#: helper: the thread check on ``send``'s path costs one call).
running_loop: Final = asyncio._get_running_loop


def elsewhere(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether the caller runs outside ``loop`` while that loop runs (in another
    thread): a synchronous method must then hand itself to the loop."""
    return loop is not None and running_loop() is not loop and loop.is_running()


def hand_over(
    loop: asyncio.AbstractEventLoop, fn: Callable[..., _T], *args: Any, **kwargs: Any
) -> _T:
    """Run ``fn(*args, **kwargs)`` on ``loop`` for a caller in another thread (or on
    another loop), and return its result or raise its error there.

    The caller blocks until the loop has run it. Should the loop stop running before
    it gets to the call, the call runs in place: a loop that is not running lets nobody
    else touch the queue."""
    done: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def call() -> None:
        if done.set_running_or_notify_cancel():
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                done.set_exception(exc)

    try:
        loop.call_soon_threadsafe(call)
    except RuntimeError:  # closed meanwhile
        return fn(*args, **kwargs)
    while not concurrent.futures.wait([done], timeout=0.05).done:
        if not loop.is_running() and done.cancel():
            return fn(*args, **kwargs)
    return done.result()


def check_own_loop(loop: asyncio.AbstractEventLoop | None, name: str, method: str) -> None:
    """Coroutine methods run on the queue's loop only (or, once that loop is closed,
    anywhere: nothing else can touch the queue then, and ``terminate()`` can still hand
    back what it holds)."""
    if loop is not None and not loop.is_closed() and asyncio.get_running_loop() is not loop:
        raise RuntimeError(
            f"queue {name!r} belongs to another event loop: await {method}() on "
            f"that loop, e.g. asyncio.run_coroutine_threadsafe(queue.{method}(...), "
            "queue.loop) from another thread"
        )


_TASKS: set[asyncio.Task[Any]] = set()


def keep_alive(task: asyncio.Task[Any]) -> None:
    """Hold ``task`` until it is done (the loop holds tasks only weakly)."""
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
