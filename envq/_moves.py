"""The entry routines: every envelope move goes through here.

A move's target always comes from a table of :mod:`envq._machine` (looked up by the
caller: admission, the lifecycle, the workers, the outcome interpreter); :meth:`Mover.enter`
writes it, reports the move (checked against ``ENVELOPE_MOVES`` under ``STRICT``, and
as an :class:`envq.Event` to listeners), and asks the holding side
(:class:`envq._store.MemoryStore`) to hold the envelope as the state requires. An
envelope that ends leaves the store before its end is reported, so a listener sees the
statistics agree with the event and may send the envelope again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from envq import _machine
from envq._config import QueueConfig
from envq._envelope import Envelope, _Rec, is_async_callable
from envq._limits import forget_limiter
from envq._listeners import Listeners
from envq._machine import ENVELOPE_MOVES, EnvEvent, EnvState, Kind, Outcome
from envq._notify import to_dead_letter, unhandled_failure
from envq._reports import STORY_LIMIT, AttemptRecord, ErrorInfo, Event
from envq._stats import Counters, Status
from envq._store import MemoryStore
from envq._timers import Clock

if TYPE_CHECKING:
    from envq._admission import RoomWaiters

__all__ = ["Mover"]

_READY: Final = EnvState.READY
_DELAYED: Final = EnvState.DELAYED
_PARKED: Final = EnvState.PARKED
_BUFFERED: Final = EnvState.BUFFERED
_RETURNED: Final = EnvState.RETURNED
_FAILED: Final = EnvState.FAILED
_STOPPED: Final = EnvState.STOPPED
_OUTCOME: Final = Outcome
_DUE: Final = EnvEvent.DUE
_PERIODIC: Final = Kind.PERIODIC


class Mover:
    """The entry routines of one queue.

    :param store: the holding side.
    :param listeners: the queue's listeners (whether moves are observed, and who is
        told).
    :param now: the loop time for events.
    :param clock: the queue's loop, once known.
    :param status: the queue's lifecycle state (who waits for it to empty).
    :param room: the producers waiting for room, woken when an envelope ends.
    """

    def __init__(
        self,
        config: QueueConfig,
        store: MemoryStore,
        listeners: Listeners,
        counts: Counters,
        now: Callable[[], float],
        clock: Clock,
        status: Status,
        room: RoomWaiters,
    ) -> None:
        self.name = config.name
        self._store = store
        # The store's containers, read once (the hot path reads them per envelope).
        self._ready = store.ready
        self._idle = store.idle
        self._live = store.live
        self._ids = store.ids
        self._delays = store.delays
        self._listeners = listeners
        self._counts = counts
        self._now = now
        self._limiter = config.limiter
        self._dead_letter = config.dead_letter
        self._dead_async = config.dead_letter is not None and is_async_callable(config.dead_letter)
        self._log_unhandled = config.log_unhandled
        self._terminal = _machine.TERMINAL_STATES
        self._clock = clock
        #: Whether moves are observed (someone listens, or STRICT).
        self.observed = listeners.observed
        self._due_to = _machine.queue_move(_DELAYED, EnvEvent.DUE)
        self._status = status
        self._room = room

    def move(
        self,
        env: Envelope,
        rec: _Rec,
        event: EnvEvent | Outcome,
        to: EnvState,
        cause: BaseException | None = None,
    ) -> None:
        """Move ``env`` into ``to`` with no entry work (the caller holds it)."""
        frm = rec.state
        rec.state = to
        if self.observed:
            self.observe(env, frm, event, to, cause)

    def observe(
        self,
        env: Envelope,
        frm: EnvState,
        event: EnvEvent | Outcome,
        to: EnvState,
        cause: BaseException | None,
    ) -> None:
        """Check the move (under STRICT) and tell the listeners."""
        if _machine.STRICT:
            assert to in ENVELOPE_MOVES.get((frm, event), ()), (
                f"illegal envelope move {frm.name} --{event.name}--> {to.name}"
            )
        if self._listeners.listeners:
            outcome = event if isinstance(event, Outcome) else None
            self._listeners.emit(Event(self._now(), self.name, env, frm, to, outcome, cause))

    def enter(
        self,
        env: Envelope,
        rec: _Rec,
        event: EnvEvent | Outcome,
        to: EnvState,
        delay: float = 0.0,
        cause: BaseException | None = None,
        at: float | None = None,
    ) -> None:
        """Move ``env`` into state ``to`` and have the store hold it there (DELAYED:
        due ``delay`` seconds from now, or at loop time ``at`` when given).

        (An identity chain rather than ``match``: on Python 3.11 each ``case
        EnvState.X`` reads the member off the enum class, which is slow on this path.)
        """
        frm = rec.state
        rec.state = to
        store = self._store
        if cause is not None and event.__class__ is _OUTCOME:
            note_failure(rec, event, cause, self._clock.time())
        if to is _READY:
            if self.observed:
                self.observe(env, frm, event, to, cause)
            # The FIXED_RATE grid needs a periodic run's scheduled start: the time it
            # became READY, or (coming from DELAYED) the time it was due, kept in due.
            if rec.kind is _PERIODIC and event is not _DUE:
                rec.due = rec.origin = self._clock.time()
            # The store's READY hold, inline (the hot path): queue it, wake one worker.
            self._ready.append(env)
            idle = self._idle
            while idle:
                fut = idle.popleft()
                if not fut.done():
                    fut.set_result(True)
                    break
        elif to is _DELAYED:
            if self.observed:
                self.observe(env, frm, event, to, cause)
            if at is None:
                at = rec.origin = self._clock.time() + delay
            store.hold_delayed(env, rec, at)
        elif to in self._terminal:
            # The envelope leaves the queue before its end is reported: a listener may
            # send it again (here or elsewhere), and statistics() agrees with the event.
            # The store's release, inline (the hot path): it leaves the live set and
            # the delay heap.
            del self._live[env]
            ids = self._ids
            if ids and ids.get(env.id) is env:
                del ids[env.id]
            rec.owner = None
            if rec.tick:
                self._delays.drop(rec)
            self._counts.terminal[to] += 1
            if to is _RETURNED:
                store.hand_back(env, rec)
            elif (to is _FAILED or to is _STOPPED) and store.keep:
                store.keep_ended(env)
            if self._limiter is not None:
                forget_limiter(self.name, self._limiter, env)
            if self.observed:
                self.observe(env, frm, event, to, cause)
            if to is _FAILED:
                if self._dead_letter is not None:
                    to_dead_letter(
                        self.name, self._dead_letter, self._dead_async, env, cause, self._clock.loop
                    )
                elif (
                    self._log_unhandled and env.on_failure is None and not self._listeners.handlers
                ):
                    unhandled_failure(self.name, env, cause)
            status = self._status
            if status.empty_waiters and not self._live:
                status.wake_empty()
            room = self._room
            if room.waiters:
                room.pump()
        elif to is _PARKED or to is _BUFFERED:
            if self.observed:
                self.observe(env, frm, event, to, cause)
            store.hold_waiting(rec, delay)
        else:
            raise AssertionError(f"{to.name} is not entered through enter()")

    def due(self, env: Envelope, rec: _Rec) -> None:
        """The delay heap's call: ``env``'s time has come."""
        to = self._due_to
        assert to is not None
        self.enter(env, rec, _DUE, to)


def note_failure(rec: _Rec, outcome: Outcome, cause: BaseException, now: float) -> None:
    """Keep, in ``rec``, the error an attempt ended with and the attempt in its story
    (bounded: the latest ``STORY_LIMIT``). Only an attempt that ended with an error
    costs this (a success has none)."""
    error = rec.error = ErrorInfo.of(cause)
    story = rec.story
    if story is None:
        story = rec.story = []
    story.append(AttemptRecord(rec.attempts, outcome, now, error))
    if len(story) > STORY_LIMIT:
        del story[0]
