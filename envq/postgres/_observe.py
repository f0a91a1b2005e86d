"""Seeing a shared queue: :class:`PgObservation` (``statistics()``, ``counts()``, part
of :class:`envq.postgres.PgQueue`'s API) and :class:`PgMetricsSource`, what
:func:`envq.prometheus_metrics` reads a shared queue's series from.

The numbers of the shared queue (its state, its envelopes by state, the capacity) are
the database's, read in one statement from the counts it keeps with every move (the
same cost at any backlog). The numbers of attempts (outcomes, work durations, retries,
attempts in flight) are this node's: every node exports its own, and Prometheus tells
them apart by the scrape's ``instance``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from envq._envelope import Envelope
from envq._machine import LIVE_STATES, OUTCOMES, EnvState, Outcome, QueueState
from envq._metrics import SCRAPE_TIMEOUT, Histogram, Snapshot
from envq._values import Rejection, Statistics
from envq.postgres._loop import on_its_loop

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres._node import Node

__all__ = ["PgMetricsSource", "PgObservation"]

#: The queue's row and its envelopes per state, from the counts the database keeps (a
#: row per state with envelopes; one row with NULLs when it has none).
_SNAPSHOT: Final = (
    "SELECT q.state::text AS queue_state, q.capacity, c.state, c.n FROM envq.queues AS q"
    " LEFT JOIN (SELECT state::text AS state, sum(n)::bigint AS n FROM envq.counts"
    "  WHERE queue = $1 GROUP BY state HAVING sum(n) <> 0) AS c ON true"
    " WHERE q.name = $1"
)
#: The outcomes whose end puts an envelope back for another run is a failure retry.
_FAILED_OUTCOMES: Final = frozenset(o for (_, o), row in OUTCOMES.items() if row.limited)
_PUT_BACK: Final = frozenset(s.value for s in (EnvState.READY, EnvState.DELAYED, EnvState.PARKED))


class PgObservation:
    """The calls of :class:`envq.postgres.PgQueue` that read the shared queue's numbers
    (part of its public API, kept beside its metrics)."""

    name: str
    _loop: asyncio.AbstractEventLoop | None
    _node: Node
    _dedups: int
    _rejections: dict[Rejection, int]

    def _db(self) -> asyncpg.Pool:
        raise NotImplementedError  # PgQueue's own

    @on_its_loop
    async def statistics(self) -> Statistics:
        """A snapshot, read in one statement. The queue's state, its envelopes by state
        (ended ones while their rows are kept: see ``retention``), those in flight and
        the capacity used are the shared queue's, from the database's kept counts; the
        outcomes, dedups, rejected sends and stuck threads are this process's."""
        rows = await self._db().fetch(_SNAPSHOT, self.name)
        if not rows:
            raise RuntimeError(f"queue {self.name!r}: its row is gone from envq.queues")
        by_state = {EnvState(r["state"]): r["n"] for r in rows if r["state"] is not None}
        return Statistics(
            state=QueueState(rows[0]["queue_state"]),
            by_state=MappingProxyType(by_state),
            in_flight=by_state.get(EnvState.RUNNING, 0),
            capacity_used=sum(n for state, n in by_state.items() if state in LIVE_STATES),
            capacity_limit=rows[0]["capacity"],
            outcomes=MappingProxyType(dict(self._node.outcomes)),
            dedups=self._dedups,
            rejections=MappingProxyType(dict(self._rejections)),
            stuck_threads=self._node.stuck_threads,
        )

    @on_its_loop
    async def counts(self) -> dict[str, int]:
        """How many envelopes of the queue are in each state now (the database's kept
        counts: the same cost at any backlog)."""
        rows = await self._db().fetch(_SNAPSHOT, self.name)
        return {r["state"]: r["n"] for r in rows if r["state"] is not None}

    def _metrics_source(self) -> PgMetricsSource:
        """What :func:`envq.prometheus_metrics` reads this queue's series from."""
        return PgMetricsSource(self)


class PgMetricsSource:
    """One shared queue's series for :func:`envq.prometheus_metrics`: the database's
    numbers read at each scrape, on the queue's loop (at most ``SCRAPE_TIMEOUT``
    seconds; the last snapshot otherwise), and this node's attempts, kept as they end.
    """

    def __init__(self, queue: PgObservation) -> None:
        self.queue = queue
        self.name = queue.name
        self.lock = threading.Lock()
        self.retries = 0
        self.work_hist = Histogram()
        self.last: Snapshot | None = None
        queue._node.watches.append(self._ended)

    def _ended(self, env: Envelope, outcome: Outcome, state: str, claimed_at: float) -> None:
        """A committed end of this node's (on the queue's loop)."""
        spent = max(0.0, time.monotonic() - claimed_at)
        with self.lock:
            self.work_hist.observe(spent)
            if outcome in _FAILED_OUTCOMES and state in _PUT_BACK:
                self.retries += 1

    async def take(self) -> Snapshot:
        """Read the queue's numbers; on the queue's loop."""
        stats = await self.queue.statistics()
        now = time.monotonic()
        ages = [max(0.0, now - f.claimed_at) for f in self.queue._node._flights.values()]
        with self.lock:
            snap = Snapshot(
                stats,
                None,
                self.retries,
                None,
                self.work_hist.copy(),
                sum(ages),
                max(ages, default=0.0),
                rows=True,
            )
            self.last = snap
        return snap

    def snapshot(self) -> Snapshot | None:
        """:meth:`take`, from the thread that scrapes; the last snapshot when the loop
        cannot answer in time, is this thread's, or is not running (None: never
        taken)."""
        loop = self.queue._loop
        if loop is None or loop.is_closed() or not loop.is_running() or _on(loop):
            return self.last
        fut = asyncio.run_coroutine_threadsafe(self.take(), loop)
        try:
            return fut.result(timeout=SCRAPE_TIMEOUT)
        except (concurrent.futures.TimeoutError, Exception):
            fut.cancel()
            with self.lock:
                return self.last

    def close(self) -> None:
        """Stop keeping this node's attempts."""
        watches = self.queue._node.watches
        if self._ended in watches:
            watches.remove(self._ended)


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
