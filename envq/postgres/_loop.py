"""Calls into a PostgreSQL queue from another thread or event loop.

A :class:`~envq.postgres.PgQueue`'s connections belong to the event loop that opened
them (asyncpg's pool cannot be used from another loop). Its coroutine methods may be
awaited on any loop, in any thread: a call made outside the queue's loop is handed to
that loop (:func:`asyncio.run_coroutine_threadsafe`) and its caller awaits the result
there, so the node's work, hooks and listeners all run on the queue's own loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["on_its_loop"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


class _Owned(Protocol):
    name: str
    _loop: asyncio.AbstractEventLoop | None


_Q = TypeVar("_Q", bound=_Owned)


def on_its_loop(
    method: Callable[Concatenate[_Q, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[_Q, _P], Coroutine[Any, Any, _T]]:
    """Run ``method`` on the queue's loop whatever loop awaits it.

    :raises RuntimeError: called from another loop while the queue's loop is not
        running (its connections cannot be used from here).
    """

    @functools.wraps(method)
    async def handed(self: _Q, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        home = self._loop
        if home is None or asyncio.get_running_loop() is home:
            return await method(self, *args, **kwargs)
        if home.is_closed() or not home.is_running():
            raise RuntimeError(
                f"queue {self.name!r}: {method.__name__.lstrip('_').removesuffix('_batch')}()"
                " was called from another event "
                "loop while the loop that connected the queue is not running; call it "
                "from that loop, or keep that loop running (in its thread)"
            )

        async def there() -> _T:
            return await method(self, *args, **kwargs)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(there(), home))

    return handed
