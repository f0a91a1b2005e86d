"""One API for both stores: :class:`QueueProtocol`, the calls :class:`envq.Queue` and
:class:`envq.postgres.PgQueue` share, with one shape.

Every shared call is awaited. The in-process queue answers most of them without
waiting for anything, so its answers are awaitable values: :class:`Count` (an ``int``),
:class:`Done` and :class:`envq.Statistics` can be awaited and also used as they are,
which keeps ``queue.start()`` and ``n = queue.send(env)`` working for code that never
awaits them. See docs/decisions.md, "One API for both stores".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Final, Protocol, Self, runtime_checkable

from envq._envelope import Envelope
from envq._listeners import Listener
from envq._reports import StopReport
from envq._values import Statistics, StopMode

__all__ = ["Count", "Done", "QueueProtocol"]


class Count(int):
    """A number of envelopes (admitted, cancelled, sent back, discarded) that may be
    awaited too: ``await queue.send(env)`` and ``queue.send(env)`` give the same
    number, so one line of code serves :class:`envq.Queue` and
    :class:`envq.postgres.PgQueue`."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, int]:
        yield from ()
        return self

    def __repr__(self) -> str:
        return int.__repr__(self)


#: Counts 0..63, made once: a send of a small batch allocates nothing for its answer.
_SMALL: Final = tuple(Count(n) for n in range(64))


def count(n: int) -> Count:
    """``n`` as a :class:`Count`."""
    return _SMALL[n] if 0 <= n < 64 else Count(n)


class Done:
    """The answer of a call that is over when it returns (``Queue.start()``): awaiting
    it gives ``None`` at once."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, None]:
        yield from ()

    def __repr__(self) -> str:
        return "<envq.Done>"

    def __bool__(self) -> bool:
        return False


#: The one :class:`Done`.
DONE: Final = Done()


@runtime_checkable
class QueueProtocol(Protocol):
    """The calls :class:`envq.Queue` (one process) and
    :class:`envq.postgres.PgQueue` (a queue shared on PostgreSQL) both make, with the
    same shape and the same answers. Code written against it runs on either store::

        async def produce(queue: envq.QueueProtocol) -> None:
            await queue.start()
            admitted = await queue.send(*envelopes)
            report = await queue.stop()

    What differs, by design: the lifecycle state (``Queue.state`` is read without I/O,
    a property; ``PgQueue.state()`` reads the database; here it is
    ``(await queue.statistics()).state``); ``async with`` (one process's queue is
    stopped and terminated on exit; a shared queue is only left by this process, the
    other nodes go on); and each store's own calls (``Queue.run_until_empty``,
    ``Queue.stop_on_signals``; ``PgQueue.install``, ``connect``, ``close``,
    ``counts``, ``purge``).
    """

    @property
    def name(self) -> str:
        """The queue's name."""
        ...

    def start(self) -> Awaitable[None]:
        """Start (or restart) the queue."""
        ...

    def send(self, *envelopes: Envelope) -> Awaitable[int]:
        """Admit the batch, all or none; the number admitted (dedups are not)."""
        ...

    def send_wait(self, *envelopes: Envelope, timeout: float | None = None) -> Awaitable[int]:
        """:meth:`send`, waiting for room; :class:`envq.SendTimeout` on ``timeout``."""
        ...

    def stop(
        self, mode: StopMode | None = None, cancel: bool = False, wait: bool | None = None
    ) -> Awaitable[StopReport]:
        """Stop the queue; what the stop did."""
        ...

    def wait_stopped(self) -> Awaitable[StopReport]:
        """The final report once the queue is STOPPED or TERMINATED."""
        ...

    def terminate(self) -> Awaitable[list[Envelope]]:
        """End the queue for good; the envelopes handed back."""
        ...

    def statistics(self) -> Awaitable[Statistics]:
        """A snapshot of the queue."""
        ...

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` for every move; returns an unsubscribe function."""
        ...

    def cancel(self, *envelopes: object) -> Awaitable[int]:
        """Cancel live envelopes (by envelope or ``id``); the number cancelled."""
        ...

    def retry(self, *envelopes: object) -> Awaitable[int]:
        """Send envelopes that ended FAILED or STOPPED back; the number sent back."""
        ...

    def discard(self, *envelopes: object) -> Awaitable[int]:
        """Forget ended envelopes kept for an operator; the number discarded."""
        ...

    async def __aenter__(self) -> Self:
        """Enter the queue's block (see the class's note on what the exit does)."""
        ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave the queue's block."""
        ...
