"""An operator's moves on an in-process queue: cancel, retry, discard.

Each is a row of ``QUEUE_MOVES`` with one of the operator's events
(``envq._machine.OPERATOR_EVENTS``), looked up here and entered through the queue's
entry routine, as every other move is:

* ``cancel`` — a live envelope that is not running ends STOPPED (its row); a running
  one is relabelled (``RELABEL[CANCEL]``: its attempt's end is looked up in the
  ``CANCELLED`` row group, STOPPED whatever the outcome) and its attempt is asked to
  stop (cancelled, as a stop with ``cancel=True`` would);
* ``retry`` — an envelope that ended FAILED or STOPPED and that the queue keeps is sent
  back: checked as ``send()`` checks a batch (the lifecycle's SEND row, the blacklist,
  dedup by ``id``, the capacity), then moved by its RETRY row, keeping its story (its
  attempts, its last error);
* ``discard`` — a kept ended envelope leaves the queue's keeping (its DISCARD row: back
  to NEW, its story forgotten).

The queue keeps the envelopes that ended FAILED or STOPPED (the latest ``keep_ended``)
for these moves and for :meth:`envq.Queue.envelopes`; one that succeeded is not kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Final, TypeVar

from envq import _checks
from envq._admission import Admission
from envq._crew import Crew
from envq._entry import elsewhere, hand_over
from envq._envelope import Enter, Envelope, _Rec
from envq._errors import BadEnvelopeType
from envq._machine import (
    QUEUE_MOVES,
    RELABEL,
    Arrival,
    CancelCause,
    EnvEvent,
    EnvState,
    LifeAction,
)
from envq._protocol import Count, count
from envq._reports import LiveEnvelope
from envq._stats import Status
from envq._store import MemoryStore

__all__ = ["Operator", "OperatorCalls"]

_T = TypeVar("_T")

_CANCEL: Final = EnvEvent.CANCEL
_RETRY: Final = EnvEvent.RETRY
_DISCARD: Final = EnvEvent.DISCARD
_RUNNING: Final = EnvState.RUNNING


class Operator:
    """The operator's moves on one queue.

    :param store: the holding side (its live envelopes, ready deque, kept ended ones).
    :param enter: the queue's entry routine; ``move``: its move without a hold (a
        discard leaves the store).
    :param admission: send's checks (a retry passes them as a send does).
    :param crew: the workers (a running envelope's attempt is asked to stop).
    :param status: the queue's lifecycle state (the SEND row a retry is admitted by).
    """

    def __init__(
        self,
        name: str,
        *,
        store: MemoryStore,
        enter: Enter,
        move: Callable[[Envelope, _Rec, EnvEvent, EnvState], None],
        admission: Admission,
        crew: Crew,
        status: Status,
    ) -> None:
        self.name = name
        self._store = store
        self._enter = enter
        self._move = move
        self._admission = admission
        self._crew = crew
        self._status = status

    def _find(self, keys: Iterable[object], where: dict[Envelope, object]) -> list[Envelope]:
        """The envelopes of ``where`` that ``keys`` name: an envelope itself, or its
        ``id``; each once, in the order first named."""
        by_id: dict[Hashable, Envelope] | None = None
        found: dict[Envelope, None] = {}
        for key in keys:
            if isinstance(key, Envelope):
                if key in where:
                    found[key] = None
                continue
            try:
                hash(key)
            except TypeError:
                raise BadEnvelopeType(
                    f"queue {self.name!r}: an envelope or an id was expected, got "
                    f"{type(key).__name__}"
                ) from None
            if by_id is None:
                by_id = {env.id: env for env in where if env.id is not None}
            env = by_id.get(key)
            if env is not None:
                found[env] = None
        return list(found)

    def cancel(self, keys: Iterable[object]) -> int:
        """Cancel the live envelopes ``keys`` name; how many were (a running one is
        asked to stop and counts)."""
        store = self._store
        victims = self._find(keys, store.live)  # type: ignore[arg-type]
        if any(env._rec.state is EnvState.READY for env in victims):
            gone = set(victims)
            store.drop_ready(lambda env: env not in gone)
        for env in victims:
            rec = env._rec
            if rec.state is _RUNNING:
                rec.kind = RELABEL[_CANCEL]
                self._crew.cancel(env, CancelCause.STOP)
                continue
            row = QUEUE_MOVES[(rec.state, _CANCEL)]
            self._enter(env, rec, _CANCEL, row.targets[None])
        return len(victims)

    def retry(self, keys: Iterable[object]) -> int:
        """Send back the kept ended envelopes ``keys`` name (all or none, as a send);
        how many were. An id live again in the queue is a dedup (counted as one)."""
        store = self._store
        batch = self._find(keys, store.ended)  # type: ignore[arg-type]
        if not batch:
            return 0
        row = self._status.send_row
        admitted = self._admission.readmit(batch, row)
        arrival = Arrival.BUFFER if row.action is LifeAction.BUFFER else Arrival.NOW
        for env in admitted:
            rec = env._rec
            del store.ended[env]
            to = QUEUE_MOVES[(rec.state, _RETRY)].targets[arrival]
            self._enter(env, rec, _RETRY, to)
        return len(admitted)

    def discard(self, keys: Iterable[object]) -> int:
        """Forget the kept ended envelopes ``keys`` name; how many were."""
        store = self._store
        gone = self._find(keys, store.ended)  # type: ignore[arg-type]
        for env in gone:
            rec = env._rec
            del store.ended[env]
            self._move(env, rec, _DISCARD, QUEUE_MOVES[(rec.state, _DISCARD)].targets[None])
            rec.error = rec.story = None
            rec.attempts = rec.failures = 0
        return len(gone)


class OperatorCalls:
    """The calls of :class:`envq.Queue` that look at its envelopes and act on them as
    an operator would (a part of the queue's public API, kept beside the moves they
    make)."""

    name: str
    _operator: Operator
    _store: MemoryStore
    _loop: asyncio.AbstractEventLoop | None

    def _elsewhere(self) -> bool:
        return elsewhere(self._loop)

    def _from_elsewhere(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = self._loop
        assert loop is not None
        return hand_over(loop, fn, *args, **kwargs)

    def envelopes(
        self, state: EnvState | None = None, *, after: int = 0, limit: int = 100
    ) -> list[LiveEnvelope]:
        """Snapshots of the envelopes in admission order — the live ones, and the ended
        ones the queue keeps (``keep_ended``) with their story — those in ``state`` (any
        when None) after stay ``after`` (a :attr:`LiveEnvelope.seq`: the last one seen,
        for the next page), at most ``limit``. Read-only; it walks the live envelopes.

        :raises TypeError: ``state`` is not an :class:`EnvState`, or ``after`` /
            ``limit`` not an int.
        :raises ValueError: ``after`` is negative or ``limit`` below 1.
        """
        where = f"queue {self.name!r}: envelopes()"
        if state is not None:
            _checks.member(f"{where} state", state, EnvState)
        after = _checks.integer(f"{where} after", after, minimum=0)
        limit = _checks.integer(f"{where} limit", limit, minimum=1)
        if self._elsewhere():
            return self._from_elsewhere(self.envelopes, state, after=after, limit=limit)
        return self._store.snapshots(state, after, limit)

    def cancel(self, *envelopes: object) -> Count:
        """An operator's cancel of live envelopes, each named by itself or its ``id``:
        one not running ends STOPPED at once; a running one's attempt is asked to stop
        and ends STOPPED whatever its outcome, with no hook. The number cancelled (one
        not live here is skipped). Works from any thread."""
        return self._operate(self._operator.cancel, envelopes)

    def retry(self, *envelopes: object) -> Count:
        """An operator's retry of envelopes that ended FAILED or STOPPED and that the
        queue keeps (``keep_ended``), each named by itself or its ``id``: sent back as a
        ``send()`` of the batch would be (its checks, all or nothing; READY, or
        BUFFERED before the first start), keeping their story. The number sent back.

        :raises QueueStopping, QueueNotRunning, QueueTerminated, TypeBlacklisted,
            CapacityExceeded: as :meth:`send`.
        """
        return self._operate(self._operator.retry, envelopes)

    def discard(self, *envelopes: object) -> Count:
        """An operator's discard of ended envelopes the queue keeps, each named by itself
        or its ``id``: the queue forgets them and their story. The number discarded."""
        return self._operate(self._operator.discard, envelopes)

    def _operate(
        self, move: Callable[[tuple[object, ...]], int], keys: tuple[object, ...]
    ) -> Count:
        if self._elsewhere():
            return self._from_elsewhere(self._operate, move, keys)
        return count(move(keys))
