"""The holding side: where a queue's envelopes are while they are live.

envq separates *deciding* from *holding*. The deciding side — the tables of
:mod:`envq._machine` and their interpreters (admission's checks, the lifecycle, the
outcome interpreter, the entry routines of :mod:`envq._moves`) — chooses every next
state. The holding side keeps the envelopes where that choice puts them and does the
bookkeeping of each state it is asked to hold them in; it decides nothing.

:class:`MemoryStore` is the in-process holding side: the live set (an insertion-ordered
dict, so ``capacity_used`` is its length and cannot drift), the ready deque, the delay
heap under one loop timer, the time a parked or buffered envelope has left, and what a
termination hands back. A durable store keeps the same things in a database and is
asked the same questions.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable

from envq._envelope import Envelope, _Rec
from envq._machine import EnvState
from envq._reports import LiveEnvelope
from envq._timers import Clock, DelayHeap

__all__ = ["MemoryStore"]


class MemoryStore:
    """The live envelopes of one queue, in memory.

    :param owner: the queue (the delay heap skips entries of envelopes it no longer
        owns).
    :param on_due: called with ``(env, rec)`` when a delayed envelope's time comes.
    :param idle: the wake-up futures of idle workers (the crew's, lent): holding an
        envelope READY wakes one.
    :param clock: the queue's loop, once known (the delay heap's timer runs on it).

    The two holds every envelope goes through — READY (append to :attr:`ready`, wake
    one of :attr:`idle`) and the end (leave :attr:`live`, and the delay heap if it is
    there) — are done by the entry routines on these containers directly: a call each
    would cost every envelope about a tenth of a microsecond.
    """

    __slots__ = ("delays", "ended", "handed", "idle", "ids", "keep", "live", "ready")

    def __init__(
        self,
        owner: object,
        on_due: Callable[[Envelope, _Rec], None],
        idle: deque[asyncio.Future[bool]],
        clock: Clock,
        keep: int = 0,
    ) -> None:
        #: The live envelopes, in admission order.
        self.live: dict[Envelope, _Rec] = {}
        #: The live envelopes that have an ``id``, by it (the dedup key).
        self.ids: dict[Hashable, Envelope] = {}
        #: READY envelopes, in the order they became ready.
        self.ready: deque[Envelope] = deque()
        #: DELAYED envelopes, by due time.
        self.delays = DelayHeap(owner, on_due, clock)
        #: (admission number, envelope) handed back by the termination under way.
        self.handed: list[tuple[int, Envelope]] = []
        self.idle = idle
        #: The envelopes that ended FAILED or STOPPED, kept for an operator to look at,
        #: retry or discard: the latest ``keep`` (0: none), the oldest first.
        self.ended: dict[Envelope, None] = {}
        self.keep = keep

    def hold(self, env: Envelope, rec: _Rec) -> None:
        """``env`` was admitted: it is live from now on."""
        self.live[env] = rec

    def hold_delayed(self, env: Envelope, rec: _Rec, due: float) -> None:
        """``env`` is DELAYED until loop time ``due``."""
        rec.due = due
        self.delays.push(env, rec, due)

    def hold_waiting(self, rec: _Rec, time_left: float) -> None:
        """The envelope is PARKED or BUFFERED with ``time_left`` seconds still to wait
        once it is armed."""
        rec.due = max(0.0, time_left)

    def hand_back(self, env: Envelope, rec: _Rec) -> None:
        """``env`` is handed back by the termination under way."""
        self.handed.append((rec.seq, env))

    def keep_ended(self, env: Envelope) -> None:
        """``env`` ended FAILED or STOPPED: keep it (the oldest kept one goes when more
        than :attr:`keep` are)."""
        ended = self.ended
        ended.pop(env, None)
        ended[env] = None
        if len(ended) > self.keep:
            del ended[next(iter(ended))]

    def take_handed(self) -> list[Envelope]:
        """What the termination handed back, in admission order (and forget it)."""
        handed = sorted(self.handed, key=lambda pair: pair[0])
        self.handed = []
        return [env for _seq, env in handed]

    def drop_ready(self, keep: Callable[[Envelope], bool] | None = None) -> None:
        """Forget the ready order of every READY envelope (or of those ``keep`` does
        not keep)."""
        if keep is None:
            self.ready.clear()
            return
        kept = [env for env in self.ready if keep(env)]
        self.ready.clear()
        self.ready.extend(kept)

    def drop_delays(self) -> None:
        """No DELAYED envelope is left (a stop parked them all)."""
        self.delays.clear()

    def snapshots(self, state: EnvState | None, after: int, limit: int) -> list[LiveEnvelope]:
        """The envelopes in ``state`` (any when None; the live ones, then the kept ended
        ones) admitted after stay number ``after``, in admission order, at most
        ``limit``, as snapshots."""
        found: list[LiveEnvelope] = []
        # The live ones are in admission order (stop at the page's end); the kept
        # ended ones (at most ``keep``) in the order they ended.
        for group, ordered in ((self.live, True), (self.ended, False)):
            taken = 0
            for env in group:
                rec = env._rec
                if rec.seq <= after or (state is not None and rec.state is not state):
                    continue
                due = rec.due if rec.state is EnvState.DELAYED else None
                history = tuple(rec.story or ())
                snap = LiveEnvelope(
                    env, rec.seq, rec.state, rec.kind, rec.attempts, due, rec.error, history
                )
                found.append(snap)
                taken += 1
                if ordered and taken >= limit:
                    break
        found.sort(key=lambda snap: snap.seq)
        return found[:limit]
