"""Admission: send's checks, the capacity count, and producers waiting for room.

``send()`` admits a batch whole or not at all: the checks run in order (the queue's
state, validation, the type blacklist, dedup and another queue, capacity) over the whole
batch before any envelope moves. ``send_wait()`` producers queue up first come, first
served; the head one is woken when its batch fits (or would be refused) and admits it
itself, so a producer cancelled or timed out after being woken has admitted nothing.
Each admitted envelope enters through the queue's ``enter`` callback, with the target
of the SEND row of ``QUEUE_MOVES`` (resolved once).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import NoReturn, cast

from envq._envelope import Enter, Envelope, _Rec
from envq._errors import (
    BadEnvelope,
    BadEnvelopeType,
    CapacityExceeded,
    EnvqError,
    SendTimeout,
    TypeBlacklisted,
)
from envq._first_run import first_delay_at, unschedulable
from envq._listeners import Listeners
from envq._machine import (
    INITIAL,
    KIND_OF,
    QUEUE_MOVES,
    Arrival,
    EnvEvent,
    LifeAction,
    LifeRow,
    QueueCall,
)
from envq._rules import Room, refusal, room
from envq._stats import Counters, Status, call_refused
from envq._values import Rejection

__all__ = ["Admission", "RoomWaiters", "Waiter", "new_envelopes"]

_EV_SEND = EnvEvent.SEND


class Waiter:
    """A producer waiting in ``send_wait``: its batch, and the future that wakes it."""

    __slots__ = ("envs", "fut")

    def __init__(self, envs: tuple[Envelope, ...], fut: asyncio.Future[None]) -> None:
        self.envs = envs
        self.fut = fut


class RoomWaiters:
    """The producers of one queue waiting for room in ``send_wait``, first come first
    served, and when the first of them may try again: once its batch fits, or would be
    refused.

    Made before the entry routines, which wake it as envelopes end; admission queues
    the producers and the lifecycle wakes it when the queue's state changes.

    :param capacity: the queue's capacity (0: none, and nobody waits).
    :param status: the queue's lifecycle state (a send it rejects wakes the waiter, to
        be refused).
    :param owner: the queue; ``live``, ``ids``, ``blacklist``: its live envelopes, those
        with an ``id`` by it, its blacklisted types (all lent, never replaced).
    """

    __slots__ = ("_blacklist", "_ids", "_live", "_owner", "_status", "capacity", "waiters")

    def __init__(
        self,
        capacity: int,
        status: Status,
        owner: object,
        live: dict[Envelope, _Rec],
        ids: dict[Hashable, Envelope],
        blacklist: set[str],
    ) -> None:
        self.capacity = capacity
        self._status = status
        self._owner = owner
        self._live = live
        self._ids = ids
        self._blacklist = blacklist
        #: The producers waiting, first come first served.
        self.waiters: deque[Waiter] = deque()

    def pump(self) -> None:
        """Wake the first waiting producer once its batch fits, or would be refused."""
        waiters = self.waiters
        if waiters:
            head = waiters[0]
            if not head.fut.done() and self._may_admit(head.envs):
                head.fut.set_result(None)

    def _may_admit(self, items: Sequence[Envelope]) -> bool:
        """Whether admitting ``items`` now would not wait for room: it fits, or one of
        send's checks refuses it."""
        capacity = self.capacity
        if not capacity or self._status.send_row.action is LifeAction.REJECT:
            return True
        blacklist = self._blacklist
        for env in items:
            if not isinstance(env, Envelope) or (blacklist and env.type in blacklist):
                return True
            owner = env._rec.owner
            if owner is not None and owner is not self._owner:
                return True
        return len(self._live) + len(new_envelopes(items, self._ids)) <= capacity


class Admission:
    """The admission side of one queue.

    :param owner: the queue (what an admitted envelope's record names as its owner).
    :param live: the queue's live envelopes; ``ids``: those with an ``id``, by it (the
        dedup key); ``blacklist``: its blacklisted types;
        ``counts``: its counters (all lent, never replaced).
    :param enter: the queue's entry routine.
    :param first_delay: seconds an envelope waits before its first run.
    :param status: the queue's lifecycle state (its SEND row).
    :param room: the producers waiting for room.
    :param listeners: the queue's listeners (a batch's events reach them once it is
        admitted whole).
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        owner: object,
        live: dict[Envelope, _Rec],
        ids: dict[Hashable, Envelope],
        blacklist: set[str],
        counts: Counters,
        enter: Enter,
        first_delay: Callable[[Envelope], float],
        status: Status,
        room: RoomWaiters,
        listeners: Listeners,
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.owner = owner
        self.live = live
        self.ids = ids
        self.blacklist = blacklist
        self._counts = counts
        self._enter = enter
        self._first_delay = first_delay
        self._status = status
        self._room = room
        self._listeners = listeners
        #: Producers waiting for room, first come first served (the room's, lent).
        self.waiters = room.waiters
        #: Admissions so far (an envelope's ``seq``: hand-back order).
        self._seq = 0
        # The SEND row, resolved once: buffered, or armed by whether it must wait.
        arrive = QUEUE_MOVES[(INITIAL, EnvEvent.SEND)].targets
        self._buffered_to = arrive[Arrival.BUFFER]
        self._admitted_to = {False: arrive[Arrival.NOW], True: arrive[Arrival.LATER]}

    def admit(self, items: Sequence[Envelope], waiting: bool, buffer: bool = False) -> int:
        """Run send's checks and admit the batch (into the pre-start buffer when
        ``buffer``); the number admitted, or -1 if a waiter must keep waiting.

        The batch's events reach the listeners once all of it is admitted: a listener
        that sends (or cancels) then finds the whole batch live, its capacity taken and
        its seqs given."""
        if waiting:
            status = self._status
            row = status.send_row
            if row.action is LifeAction.REJECT:
                raise call_refused(
                    self.name, status.state, row, QueueCall.SEND, items, self._counts
                )
            buffer = row.action is LifeAction.BUFFER
        dedups = 0
        careful = False
        blacklist = self.blacklist
        for env in items:
            # One pass for the common case; anything wrong → the ordered checks.
            if env.__class__ is not Envelope and not isinstance(env, Envelope):
                self.refuse(items)
            if blacklist and env.type in blacklist:
                self.refuse(items)
            owner = env._rec.owner
            if owner is not None:
                if owner is not self.owner:
                    self.refuse(items)
                dedups += 1
            if env._careful:
                careful = True
        # Usually every envelope is new and the batch is admitted as it came.
        fresh = items
        delays: dict[Envelope, float] = {}
        if careful:
            # Dedup by id, and every first delay worked out before anything moves (a
            # schedule that cannot place its first run refuses the whole batch).
            fresh = new_envelopes(items, self.ids)
            dedups = len(items) - len(fresh)
            delays = self.first_delays(fresh, probe=buffer)
        elif dedups:
            fresh = [env for env in fresh if env._rec.owner is None]
        # A batch may name an envelope twice: the second is a dedup, found below as
        # already owned (cheaper than making the batch unique up front).
        if fresh and self.capacity:
            count = len(fresh)
            if count > 1 and not careful and len(self.live) + count > self.capacity:
                count = len(set(fresh))
            over = len(self.live) + count > self.capacity
            if waiting:
                if over:
                    return -1
            elif over or self.waiters:
                live_n = len(self.live)
                verdict = room(live_n, count, self.capacity, waiting=bool(self.waiters))
                why = refusal(verdict, live_n, count, self.capacity)
                self.reject(Rejection.CAPACITY, CapacityExceeded, f"{why} ({fresh[0].label()})")
        live = self.live
        first = seq = self._seq
        enter = self._enter
        admitted_to = self._admitted_to
        listeners = self._listeners
        hold = listeners.aside is None and bool(listeners.listeners)
        if hold:
            listeners.aside = []
        try:
            for env in fresh:
                # The envelope's own record, reset for this stay (no allocation per send).
                rec = env._rec
                if rec.owner is self.owner:  # named twice in this batch
                    dedups += 1
                    continue
                seq += 1
                rec.state = INITIAL
                rec.kind = KIND_OF[env._periodic]
                rec.seq = seq
                rec.attempts = 0
                rec.failures = 0
                rec.error = rec.story = None
                rec.owner = self.owner
                live[env] = rec
                if careful and env.id is not None:
                    self.ids[env.id] = env
                if buffer:
                    enter(env, rec, _EV_SEND, self._buffered_to)
                else:
                    delay = delays[env] if env._timed else env.delay
                    enter(env, rec, _EV_SEND, admitted_to[delay > 0], delay)
        finally:
            self._seq = seq
            if hold:
                held, listeners.aside = listeners.aside, None
                for event in held or ():
                    listeners.emit(event)
        if dedups:
            self._counts.dedups += dedups
        return seq - first

    def readmit(self, batch: Sequence[Envelope], row: LifeRow) -> list[Envelope]:
        """An operator's retry of ``batch`` (envelopes that ended here): send's checks
        (the lifecycle's SEND row, the blacklist, dedup by id, the capacity; all or
        nothing), then each admitted again as live, its story kept (no reset of its
        attempts or its last error); the envelopes admitted, for the caller to move."""
        if row.action is LifeAction.REJECT:
            status = self._status
            raise call_refused(self.name, status.state, row, QueueCall.SEND, batch, self._counts)
        if self.blacklist and any(env.type in self.blacklist for env in batch):
            self.refuse(batch)
        fresh = new_envelopes(batch, self.ids)
        verdict = room(len(self.live), len(fresh), self.capacity)
        if verdict is not Room.FITS:
            why = refusal(verdict, len(self.live), len(fresh), self.capacity, doing="retry")
            self.reject(Rejection.CAPACITY, CapacityExceeded, f"{why} ({fresh[0].label()})")
        self._counts.dedups += len(batch) - len(fresh)
        for env in fresh:
            rec = env._rec
            self._seq += 1
            rec.seq = self._seq
            rec.kind = KIND_OF[env._periodic]  # a cancel or a ban relabelled its last stay
            rec.owner = self.owner
            self.live[env] = rec
            if env.id is not None:
                self.ids[env.id] = env
        return fresh

    def first_delays(self, fresh: Sequence[Envelope], probe: bool) -> dict[Envelope, float]:
        """The first delay of every envelope of ``fresh`` that needs working out; a
        schedule that cannot give one refuses the batch, naming the envelope. With
        ``probe`` (a send into the pre-start buffer: the delays are worked out at
        ``start()``) each is tried once on the system's clocks, so that a schedule that
        can never start is the sender's error."""
        delays: dict[Envelope, float] = {}
        for env in fresh:
            if env._timed:
                try:
                    if probe:
                        first_delay_at(env, time.monotonic(), time.time())
                    else:
                        delays[env] = self._first_delay(env)
                except Exception as exc:
                    self._counts.rejections[Rejection.INVALID] += 1
                    raise unschedulable(f"queue {self.name!r}", env, exc) from exc
        return delays

    def refuse(self, items: Sequence[object]) -> NoReturn:
        """Raise the error of the earliest failing check over the whole batch:
        validation, then the blacklist, then dedup / another queue."""
        for item in items:
            if not isinstance(item, Envelope):
                self.reject(Rejection.INVALID, BadEnvelopeType, f"not an Envelope: {item!r}")
        batch = cast("Sequence[Envelope]", items)
        for env in batch:
            if env.type in self.blacklist:
                self.reject(
                    Rejection.BLACKLISTED,
                    TypeBlacklisted,
                    f"type {env.type!r} is blacklisted ({env.label()})",
                )
        for env in batch:
            owner = env._rec.owner
            if owner is not None and owner is not self.owner:
                self.reject(
                    Rejection.FOREIGN, BadEnvelope, f"{env.label()} is live in queue {owner.name!r}"
                )
        raise AssertionError("refuse called on a valid batch")

    def reject(self, reason: Rejection, error: type[EnvqError], message: str) -> NoReturn:
        self._counts.rejections[reason] += 1
        raise error(f"queue {self.name!r}: {message}")

    async def wait(
        self,
        batch: tuple[Envelope, ...],
        timeout: float | None,  # noqa: ASYNC109 - send_wait's own timeout, passed on
        loop: asyncio.AbstractEventLoop,
    ) -> int:
        """Wait (first come, first served) until ``batch`` is admitted (the number
        admitted); raise what
        ``send()`` would raise if the queue changes state meanwhile, and
        ``CapacityExceeded`` on ``timeout``."""
        if all(isinstance(env, Envelope) for env in batch):
            distinct = len(new_envelopes(batch, self.ids))
        else:  # refused once woken, by the checks of send()
            distinct = len({id(env) for env in batch})
        if room(0, distinct, self.capacity) is Room.NEVER:
            self._counts.rejections[Rejection.CAPACITY] += 1
            why = refusal(Room.NEVER, len(self.live), distinct, self.capacity)
            raise CapacityExceeded(f"queue {self.name!r}: {why}")
        # Woken (first come, first served) when the batch fits or would be refused, the
        # producer admits it itself: a producer cancelled or timed out after being woken
        # has admitted nothing, and the next one is woken instead.
        waiter = Waiter(batch, loop.create_future())
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await waiter.fut
                    admitted = self.admit(batch, True)
                    if admitted >= 0:
                        return admitted
                    waiter.fut = loop.create_future()
        except TimeoutError:
            self._counts.rejections[Rejection.CAPACITY] += 1
            raise SendTimeout(
                f"queue {self.name!r}: no room for {len(batch)} envelope(s) within "
                f"{timeout!r} s (capacity {self.capacity})"
            ) from None
        finally:
            self.waiters.remove(waiter)
            self._room.pump()


def new_envelopes(items: Sequence[Envelope], ids: dict[Hashable, Envelope]) -> list[Envelope]:
    """The envelopes of ``items`` to admit: neither live in the queue (``ids``: its live
    envelopes that have an ``id``, by it) nor named earlier in the batch, each by its
    dedup key (its ``id`` if it has one, else itself)."""
    seen: set[Hashable] = set()
    found: list[Envelope] = []
    for env in items:
        if env._rec.owner is not None:
            continue
        key: Hashable = env.id
        if key is None:
            key = _Identity(env)
        elif key in ids:
            continue
        if key in seen:
            continue
        seen.add(key)
        found.append(env)
    return found


class _Identity:
    """An envelope without an ``id`` as a dedup key: the object itself (an envelope's
    own hash is by identity too, but a key must not compare equal to an ``id``)."""

    __slots__ = ("env",)

    def __init__(self, env: Envelope) -> None:
        self.env = env

    def __hash__(self) -> int:
        return id(self.env)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.env is self.env
