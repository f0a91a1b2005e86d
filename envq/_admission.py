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
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, cast

from envq._envelope import Enter, Envelope, _Rec
from envq._errors import (
    BadEnvelope,
    BadEnvelopeType,
    CapacityExceeded,
    EnvqError,
    TypeBlacklisted,
)
from envq._machine import (
    INITIAL,
    KIND_OF,
    QUEUE_MOVES,
    Arrival,
    EnvEvent,
    LifeAction,
    LifeRow,
)
from envq._stats import Counters
from envq._values import Rejection

__all__ = ["Admission", "Waiter", "calendar_delay", "first_delay", "wall_offset"]

_EV_SEND = EnvEvent.SEND


class Waiter:
    """A producer waiting in ``send_wait``: its batch, and the future that wakes it."""

    __slots__ = ("envs", "fut")

    def __init__(self, envs: tuple[Envelope, ...], fut: asyncio.Future[None]) -> None:
        self.envs = envs
        self.fut = fut


class Admission:
    """The admission side of one queue.

    :param owner: the queue (what an admitted envelope's record names as its owner).
    :param live: the queue's live envelopes; ``blacklist``: its blacklisted types;
        ``counts``: its counters (all lent, never replaced).
    :param enter: the queue's entry routine.
    :param first_delay: seconds an envelope waits before its first run.
    :param send_row: the lifecycle row of a send in the queue's current state.
    :param refuse_state: raise the error of a rejecting send row.
    """

    def __init__(
        self,
        name: str,
        capacity: int,
        *,
        owner: object,
        live: dict[Envelope, _Rec],
        blacklist: set[str],
        counts: Counters,
        enter: Enter,
        first_delay: Callable[[Envelope], float],
        send_row: Callable[[], LifeRow],
        refuse_state: Callable[[LifeRow, Sequence[Envelope]], object],
    ) -> None:
        self.name = name
        self.capacity = capacity
        self.owner = owner
        self.live = live
        self.blacklist = blacklist
        self._counts = counts
        self._enter = enter
        self._first_delay = first_delay
        self._send_row = send_row
        self._refuse_state = refuse_state
        #: Producers waiting for room, first come first served.
        self.waiters: deque[Waiter] = deque()
        #: Admissions so far (an envelope's ``seq``: hand-back order).
        self._seq = 0
        # The SEND row, resolved once: buffered, or armed by whether it must wait.
        arrive = QUEUE_MOVES[(INITIAL, EnvEvent.SEND)].targets
        self._buffered_to = arrive[Arrival.BUFFER]
        self._admitted_to = {False: arrive[Arrival.NOW], True: arrive[Arrival.LATER]}

    def admit(self, items: Sequence[Envelope], waiting: bool, buffer: bool = False) -> bool:
        """Run send's checks and admit the batch (into the pre-start buffer when
        ``buffer``); False if a waiter must keep waiting."""
        if waiting:
            row = self._send_row()
            if row.action is LifeAction.REJECT:
                self._refuse_state(row, items)
            buffer = row.action is LifeAction.BUFFER
        dedups = 0
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
        # Usually every envelope is new and the batch is admitted as it came.
        fresh = items
        if dedups:
            fresh = [env for env in fresh if env._rec.owner is None]
        # A batch may name an envelope twice: the second is a dedup, found below as
        # already owned (cheaper than making the batch unique up front).
        if fresh and self.capacity:
            count = len(fresh)
            if count > 1 and len(self.live) + count > self.capacity:
                count = len(set(fresh))
            over = len(self.live) + count > self.capacity
            if waiting:
                if over:
                    return False
            elif over or self.waiters:
                why = "producers are waiting in send_wait" if not over else "no room"
                self.reject(
                    Rejection.CAPACITY,
                    CapacityExceeded,
                    f"{why} for {count} envelope(s): {len(self.live)} of "
                    f"{self.capacity} used ({fresh[0].label()})",
                )
        live = self.live
        seq = self._seq
        enter = self._enter
        admitted_to = self._admitted_to
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
            rec.owner = self.owner
            live[env] = rec
            if buffer:
                enter(env, rec, _EV_SEND, self._buffered_to)
            else:
                delay = self._first_delay(env) if env._timed else env.delay
                enter(env, rec, _EV_SEND, admitted_to[delay > 0], delay)
        self._seq = seq
        if dedups:
            self._counts.dedups += dedups
        return True

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
        if not capacity or self._send_row().action is LifeAction.REJECT:
            return True
        blacklist = self.blacklist
        fresh: set[Envelope] = set()
        for env in items:
            if not isinstance(env, Envelope) or (blacklist and env.type in blacklist):
                return True
            owner = env._rec.owner
            if owner is None:
                fresh.add(env)
            elif owner is not self.owner:
                return True
        return len(self.live) + len(fresh) <= capacity

    async def wait(
        self,
        batch: tuple[Envelope, ...],
        timeout: float | None,  # noqa: ASYNC109 - send_wait's own timeout, passed on
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        """Wait (first come, first served) until ``batch`` is admitted; raise what
        ``send()`` would raise if the queue changes state meanwhile, and
        ``CapacityExceeded`` on ``timeout``."""
        distinct = {
            id(env)
            for env in batch
            if not (isinstance(env, Envelope) and env._rec.owner is self.owner)
        }
        if self.capacity and len(distinct) > self.capacity:
            self._counts.rejections[Rejection.CAPACITY] += 1
            raise CapacityExceeded(
                f"queue {self.name!r}: a batch of {len(distinct)} envelopes can never fit "
                f"capacity {self.capacity}"
            )
        # Woken (first come, first served) when the batch fits or would be refused, the
        # producer admits it itself: a producer cancelled or timed out after being woken
        # has admitted nothing, and the next one is woken instead.
        waiter = Waiter(batch, loop.create_future())
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await waiter.fut
                    if self.admit(batch, True):
                        return
                    waiter.fut = loop.create_future()
        except TimeoutError:
            self._counts.rejections[Rejection.CAPACITY] += 1
            raise CapacityExceeded(
                f"queue {self.name!r}: no room for {len(batch)} envelope(s) within "
                f"{timeout!r} s (capacity {self.capacity})"
            ) from None
        finally:
            self.waiters.remove(waiter)
            self.pump()


def wall_offset(loop: asyncio.AbstractEventLoop) -> float:
    """The wall clock minus ``loop``'s time: the loop's ``wall_time()`` if it has one
    (the virtual-time loop), else ``time.time()``."""
    wall = getattr(loop, "wall_time", None)
    return (wall() if callable(wall) else time.time()) - loop.time()


def calendar_delay(env: Envelope, delay: float, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds from now to the first run of ``env``'s calendar schedule, armed to run
    ``delay`` seconds from now on."""
    now = loop.time()
    schedule = cast("Any", env.schedule)
    at: float = schedule.first_run(now + max(0.0, delay), wall_offset(loop))
    return at - now


def first_delay(env: Envelope, loop: asyncio.AbstractEventLoop) -> float:
    """Seconds ``env`` waits before its first run: its ``delay``, or longer to reach
    ``not_before`` (by the loop's wall clock when it has one, as the virtual-time loop
    does, else the system's), and then to its calendar's first fire."""
    delay = env.delay
    if env.not_before is not None:
        wall = getattr(loop, "wall_time", None)
        now = wall() if callable(wall) else time.time()
        delay = max(delay, env.not_before.timestamp() - now)
    if env._calendar:
        delay = calendar_delay(env, delay, loop)
    return delay
