"""A queue's two timers: the delay heap and the deadline timer.

Each is one loop timer (one ``asyncio.TimerHandle`` at a time) standing for many
expiries, so that the loop's own heap — whose entries compare with a Python
``__lt__`` and, when cancelled, stay in it until they come due — never holds one
handle per envelope or per attempt:

* :class:`DelayHeap` — every DELAYED envelope of the queue, as ``(due, tick, envelope)``
  tuples (they compare in C) under one timer for the earliest. Envelopes due together
  become READY in one callback, in the order they were delayed.
* :class:`Deadlines` — the time limit of whatever each worker runs now (an attempt's
  deadline, a hook's budget). The timer is armed only when a new limit is earlier than
  the one armed; when it fires, the queue cancels the workers that are overdue and the
  timer moves on to the earliest limit still running. With every attempt under the
  same deadline, it is re-armed once per deadline period, not once per attempt.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from envq._envelope import Envelope, _Rec

__all__ = ["STALE_SLACK", "Clock", "Deadlines", "DelayHeap"]

#: The delay heap is rebuilt once its stale entries (envelopes that left DELAYED early)
#: outnumber the live ones by this many: stale entries keep their envelopes alive.
STALE_SLACK: Final = 64


class Clock:
    """The event loop a queue (or a node of a shared queue) runs on, once known: its
    time and its timers.

    Made first and lent to every part that reads the time or sets a timer (the delay
    heap, the deadline timer, the entry routines, the attempt runner, the outcome
    interpreter); the queue names the loop once, on first use (:meth:`use`), and every
    part sees it from then on.
    """

    __slots__ = ("loop", "time")

    def __init__(self) -> None:
        #: The loop; None until :meth:`use`.
        self.loop: asyncio.AbstractEventLoop | None = None
        #: The loop's clock, ``loop.time`` (raises until :meth:`use`).
        self.time: Callable[[], float] = _unbound

    def use(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on ``loop`` from now on."""
        self.loop = loop
        self.time = loop.time


def _unbound() -> float:
    raise RuntimeError("the queue is not bound to an event loop yet")


def _resolution(loop: asyncio.AbstractEventLoop) -> float:
    # The loop runs a timer up to its clock resolution early; so do we.
    return getattr(loop, "_clock_resolution", 0.0)


class DelayHeap:
    """The DELAYED envelopes of one queue, under one loop timer.

    An entry is live while its envelope is in the owning queue with the same ``tick``
    (a record's tick is non-zero exactly while it is DELAYED); other entries are stale
    and skipped when popped. ``on_due(env, rec)`` is called for each live entry that
    comes due, earliest first.
    """

    __slots__ = ("_clock", "_heap", "_on_due", "_owner", "_stale", "_ticks", "_timer", "_timer_at")

    def __init__(
        self, owner: object, on_due: Callable[[Envelope, _Rec], None], clock: Clock
    ) -> None:
        self._owner = owner
        self._on_due = on_due
        self._clock = clock
        self._heap: list[tuple[float, int, Envelope]] = []
        self._ticks = 0
        self._stale = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return len(self._heap)

    @property
    def armed(self) -> bool:
        """Whether the loop timer is armed."""
        return self._timer is not None

    def push(self, env: Envelope, rec: _Rec, due: float) -> None:
        """``env`` waits until loop time ``due``."""
        tick = rec.tick = self._ticks = self._ticks + 1
        heappush(self._heap, (due, tick, env))
        if due < self._timer_at:
            self._arm(due)

    def drop(self, rec: _Rec) -> None:
        """A DELAYED envelope leaves early: its entry goes stale."""
        rec.tick = 0
        self._stale += 1
        heap = self._heap
        if self._stale > STALE_SLACK + (len(heap) - self._stale):
            heap[:] = [entry for entry in heap if self._is_live(entry[1], entry[2])]
            heapify(heap)
            self._stale = 0
            if not heap:
                self.clear()

    def clear(self) -> None:
        """Forget every entry and disarm the timer (the owner parked them all)."""
        self._heap.clear()
        self._stale = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf

    def _is_live(self, tick: int, env: Envelope) -> bool:
        rec = env._rec
        return rec.tick == tick and rec.owner is self._owner

    def _arm(self, due: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = due
        loop = self._clock.loop
        assert loop is not None
        self._timer = loop.call_at(due, self._fire)

    def _fire(self) -> None:
        """Every envelope due by now becomes READY, earliest first."""
        self._timer = None
        self._timer_at = math.inf
        heap = self._heap
        loop = self._clock.loop
        assert loop is not None
        # Read the clock once: an entry pushed by a READY entry's wake-up is never due.
        limit = loop.time() + _resolution(loop)
        on_due = self._on_due
        owner = self._owner
        while heap and heap[0][0] <= limit:
            _due, tick, env = heappop(heap)
            rec = env._rec
            if rec.tick != tick or rec.owner is not owner:
                self._stale -= 1
                continue
            rec.tick = 0
            on_due(env, rec)
        # An entry due at infinity (a calendar with no fire left) waits unarmed:
        # a timer there would move a virtual clock to infinity.
        if heap and self._timer is None and heap[0][0] < math.inf:
            self._arm(heap[0][0])


class Deadlines:
    """One loop timer for the time limits of a queue's workers.

    ``arm(at)`` says some worker must be stopped at loop time ``at``; the timer is
    (re)armed only if ``at`` is earlier than the one armed. When it fires,
    ``on_fire(limit)`` cancels every worker whose limit is ``<= limit`` and returns the
    earliest limit still running (``inf`` for none), which the timer moves on to.
    """

    __slots__ = ("_clock", "_handle", "_on_fire", "armed_at")

    def __init__(self, clock: Clock, on_fire: Callable[[float], float]) -> None:
        self._clock = clock
        self._on_fire = on_fire
        self._handle: asyncio.TimerHandle | None = None
        #: The loop time the timer is armed for (inf when disarmed); a limit earlier
        #: than this needs ``arm``, any other does not.
        self.armed_at = math.inf

    @property
    def armed(self) -> bool:
        """Whether the timer is armed."""
        return self._handle is not None

    def arm(self, at: float) -> None:
        """Some worker's limit is loop time ``at``."""
        if at < self.armed_at:
            if self._handle is not None:
                self._handle.cancel()
            self.armed_at = at
            loop = self._clock.loop
            assert loop is not None
            self._handle = loop.call_at(at, self._fire)

    def disarm(self) -> None:
        """No limit is running: cancel the timer (so that it cannot move a virtual
        clock for nothing)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.armed_at = math.inf

    def _fire(self) -> None:
        self._handle = None
        self.armed_at = math.inf
        loop = self._clock.loop
        assert loop is not None
        following = self._on_fire(loop.time() + _resolution(loop))
        if following < math.inf:
            self.arm(following)
