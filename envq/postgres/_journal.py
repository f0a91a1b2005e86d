"""The events of a PostgreSQL queue, read back from its journal.

Theory of operation
-------------------
The schema's journal (``envq.journal``) holds every move of a queue whose
``envq.queues.journal`` flag is on, appended by the triggers in the transaction that
makes the move, whichever process makes it. A :class:`Follower` turns the flag on
for its queue when it starts and then reads the new rows every ``poll`` seconds (or
at once when this process made a move itself), turns each into an
:class:`envq.Event` and calls the listeners, in journal order (``n``).

``n`` is handed out when a move is made, not when it commits: a move that commits
late leaves a hole below rows already visible. The follower delivers nothing past a
hole until the hole fills or can no longer fill: the transactions that were in
progress when the hole was seen have all ended (the move rolled back), or the hole
was held for ``hold`` seconds (an unrelated long transaction keeps the first test
from settling). A row that shows up in a hole given up on is still delivered, late
and out of order, rather than lost. Rows of other queues' journals are read for
their ``n`` only, so that they are not taken for holes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from envq import _machine
from envq._envelope import Envelope
from envq._errors import MaxRetriesExceeded
from envq._listeners import Listener, Listeners
from envq._machine import (
    ENVELOPE_MOVES,
    LIFECYCLE,
    TERMINAL_STATES,
    EnvEvent,
    EnvState,
    Outcome,
    QueueCall,
    QueueState,
)
from envq._reports import Event
from envq._rules import exhausted
from envq.postgres._codec import decode

if TYPE_CHECKING:
    import asyncpg

__all__ = ["Follower"]

log = logging.getLogger("envq.postgres")

#: Seconds a hole in the journal is waited for at most (see the module's docstring).
HOLD: Final = 5.0
#: Seconds a given-up hole is still watched for a late row.
LATE_KEEP: Final = 600.0
#: Journal rows read per statement.
BATCH: Final = 1000

#: The failures that spend an attempt of a ``Retry`` policy.
_SPENDING: Final = frozenset({Outcome.ERROR, Outcome.TIMEOUT, Outcome.EXPIRED})

_READ: Final = """
SELECT j.n, j.queue = $1 AS mine,
       CASE WHEN j.queue = $1 THEN j.seq END AS seq,
       CASE WHEN j.queue = $1 THEN j.from_state END AS from_state,
       CASE WHEN j.queue = $1 THEN j.to_state END AS to_state,
       CASE WHEN j.queue = $1 THEN j.event END AS event,
       CASE WHEN j.queue = $1 THEN extract(epoch FROM j.at)::float8 END AS at
  FROM envq.journal AS j
 WHERE j.n > $2 OR j.n = ANY($3::bigint[])
 ORDER BY j.n
 LIMIT $4
"""


class Host(Protocol):
    """What a follower uses of its queue."""

    name: str

    def _db(self) -> asyncpg.Pool: ...


def _running_loop(name: str) -> asyncio.AbstractEventLoop:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            f"queue {name!r}: subscribe() must be called on the thread running the "
            "queue's event loop"
        ) from None


@attrs.define
class _Hole:
    """A journal number not visible yet, above rows that are."""

    seen: float
    #: The transactions in progress when it was seen (one of them may fill it).
    xids: list[str]
    final: bool = False


class Follower:
    """The listeners of one :class:`envq.postgres.PgQueue` and the task that feeds
    them from the journal.

    :param host: the queue.
    :param poll: seconds between reads of the journal.
    :param hold: seconds a hole in the journal is waited for at most.
    """

    def __init__(self, host: Host, poll: float, hold: float = HOLD) -> None:
        self._host = host
        self.name = host.name
        self.poll = poll
        self.hold = hold
        self.listeners = Listeners(host.name, False, self._observed)
        self._task: asyncio.Task[None] | None = None
        self._stopped: list[asyncio.Task[None]] = []
        #: One read of the journal at a time (the task's, or a catch-up's).
        self._reading = asyncio.Lock()
        self._ready: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._connected = False
        # Journal numbers: every n <= floor is settled; rows above it wait in
        # _buffer behind a hole; _top is the highest n read.
        self._floor = 0
        self._top = 0
        self._buffer: dict[int, Any] = {}
        self._holes: dict[int, _Hole] = {}
        self._late: dict[int, float] = {}
        #: Rows of holes given up on that showed up after all, for the next delivery.
        self._late_rows: list[Any] = []
        #: Envelopes by row, re-created once each (None: the row was gone or its
        #: callables do not resolve here).
        self._envelopes: dict[int, Envelope | None] = {}

    # -- subscriptions -------------------------------------------------------------------

    def add(self, listener: Listener) -> Callable[[], None]:
        """Subscribe ``listener``; the function that unsubscribes it."""
        if self._connected:
            _running_loop(self.name)
        return self.listeners.add(listener, handles_failures=True)

    def _observed(self, observed: bool) -> None:
        if observed and self._connected:
            self._begin()
        elif not observed:
            self._end()

    def connected(self) -> None:
        """The queue is connected: follow the journal if anyone listens."""
        self._connected = True
        if self.listeners.listeners:
            self._begin()

    def _begin(self) -> None:
        if self._task is not None:
            return
        loop = _running_loop(self.name)
        self._ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._follow(), name=f"envq-pg-events-{self.name}")

    def _end(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            self._stopped.append(task)
        self._ready = None

    async def ready(self) -> None:
        """Wait until the journal is on and the follower knows where it starts (a call
        of this process made after a subscribe is then always reported)."""
        ready, task = self._ready, self._task
        if ready is None or task is None or ready.is_set():
            return
        waiter = asyncio.ensure_future(ready.wait())
        try:
            await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    def wake(self) -> None:
        """This process made a move: read the journal now rather than at the next poll."""
        if self._wake is not None:
            self._wake.set()

    async def close(self, *, catch_up: bool = True) -> None:
        """Deliver what the journal holds (with ``catch_up``), then stop the task (the
        listeners stay subscribed: a new connection follows again). An illegal move
        seen under ``STRICT`` is raised here."""
        import asyncpg  # noqa: PLC0415

        from envq.postgres._edges import lost  # noqa: PLC0415

        self._connected = False
        gone = lost(asyncpg, TimeoutError)
        try:
            if catch_up and self._task is not None and not self._task.done():
                try:
                    # Bounded: a database gone away must not hold the close up.
                    async with asyncio.timeout(2 * self.hold + self.poll):
                        await self.catch_up()
                except gone as error:
                    log.warning(
                        "queue %r: events: the last moves could not be read (%s)", self.name, error
                    )
        finally:
            self._end()
            stopped, self._stopped = self._stopped, []
            results = await asyncio.gather(*stopped, return_exceptions=True)
        for result in results:
            if isinstance(result, AssertionError):
                raise result

    async def catch_up(self) -> None:
        """Deliver every move committed so far (waiting for holes to settle, at most
        ``hold`` seconds)."""
        if self._task is None:
            return
        await self.ready()
        until = time.monotonic() + self.hold + self.poll
        while True:
            await self._round()
            if not self._buffer or time.monotonic() >= until:
                return
            await asyncio.sleep(self.poll)

    # -- the task --------------------------------------------------------------------------

    async def _follow(self) -> None:
        import asyncpg  # noqa: PLC0415

        from envq.postgres._edges import lost  # noqa: PLC0415

        while True:
            try:
                await self._start()
                break
            except lost(asyncpg) as error:
                log.warning("queue %r: events: cannot read the journal (%s)", self.name, error)
                await asyncio.sleep(self.poll)
            except Exception:
                log.exception("queue %r: events: cannot turn the journal on", self.name)
                return
        assert self._ready is not None
        assert self._wake is not None
        self._ready.set()
        wake = self._wake
        loop = asyncio.get_running_loop()
        while True:
            wake.clear()
            try:
                await self._round()
            except lost(asyncpg) as error:
                log.warning("queue %r: events: cannot read the journal (%s)", self.name, error)
            except AssertionError:
                raise  # an illegal move under STRICT: raised by close()
            except Exception:
                log.exception("queue %r: events: reading the journal failed", self.name)
            # Not wait_for: its timeout racing a cancel can swallow the cancel.
            alarm = loop.call_later(self.poll, wake.set)
            try:
                await wake.wait()
            finally:
                alarm.cancel()

    async def _start(self) -> None:
        """Turn the journal on and start after its last row."""
        db = self._host._db()
        async with db.acquire() as conn:
            await conn.execute(
                "UPDATE envq.queues SET journal = true WHERE name = $1 AND NOT journal",
                self.name,
            )
            top = await conn.fetchval("SELECT coalesce(max(n), 0) FROM envq.journal")
        self._floor = self._top = int(top)
        self._buffer.clear()
        self._holes.clear()
        self._late.clear()
        self._late_rows.clear()

    async def _round(self) -> None:
        """One read of the journal, and the delivery of what it settles."""
        async with self._reading:
            await self._read_and_deliver()

    async def _read_and_deliver(self) -> None:
        db = self._host._db()
        now = time.monotonic()
        async with db.acquire() as conn:
            await self._settle_holes(conn, now)
            while True:
                rows = await conn.fetch(
                    _READ, self.name, self._top, [*self._holes, *self._late], BATCH
                )
                self._note_late(self._take(rows))
                if len(rows) < BATCH:
                    break
            if any(n not in self._buffer and n not in self._holes for n in self._gaps()):
                xids = await conn.fetchval(
                    "SELECT array_agg(x::text) FROM pg_snapshot_xip(pg_current_snapshot()) AS x"
                )
                for n in self._gaps():
                    if n not in self._buffer and n not in self._holes:
                        self._holes[n] = _Hole(now, list(xids or ()))
            ready = [*self._late_rows, *self._advance(now)]
            self._late_rows = []
            try:
                await self._fetch_envelopes(conn, [r for r in ready if r["seq"] is not None])
            except BaseException:
                self._late_rows[:0] = ready  # delivered by the next round
                raise
        for row in ready:
            event = self._event(row)
            if self.listeners.listeners:
                self.listeners.emit(event)
        for n in [n for n, until in self._late.items() if until < now]:
            del self._late[n]

    async def _settle_holes(self, conn: Any, now: float) -> None:
        """Mark the holes that can no longer fill: every transaction in progress when
        they were seen has ended, or they were held too long."""
        open_ = [h for h in self._holes.values() if not h.final]
        if not open_:
            return
        xids = sorted({x for h in open_ for x in h.xids})
        running: set[str] = set()
        if xids:
            found = await conn.fetch(
                "SELECT x::text FROM unnest($1::text[]) AS u(x)"
                " WHERE pg_xact_status(u.x::xid8) = 'in progress'",
                xids,
            )
            running = {r[0] for r in found}
        for hole in open_:
            if now - hole.seen >= self.hold or not running.intersection(hole.xids):
                hole.final = True

    def _take(self, rows: list[Any]) -> list[Any]:
        """Put the rows read into the buffer; the ones of holes given up on, which are
        delivered at once."""
        late = []
        for row in rows:
            n = row["n"]
            if n in self._late:
                del self._late[n]
                late.append(row)
                continue
            self._holes.pop(n, None)
            if n > self._floor:
                self._buffer[n] = row
            self._top = max(self._top, n)
        return late

    def _gaps(self) -> range:
        return range(self._floor + 1, self._top + 1)

    def _advance(self, now: float) -> list[Any]:
        """The rows settled in journal order (this queue's only), moving the floor up
        to the first hole still open."""
        ready = []
        while self._floor < self._top:
            n = self._floor + 1
            row = self._buffer.pop(n, None)
            if row is None:
                hole = self._holes.get(n)
                if hole is None or not hole.final:
                    break
                del self._holes[n]
                self._late[n] = now + LATE_KEEP
            elif row["mine"]:
                ready.append(row)
            self._floor = n
        return ready

    def _note_late(self, rows: list[Any]) -> None:
        for row in rows:
            if row["mine"]:
                log.info(
                    "queue %r: events: journal row %s committed after a later one was "
                    "reported; reported out of order",
                    self.name,
                    row["n"],
                )
                self._late_rows.append(row)

    async def _fetch_envelopes(self, conn: Any, rows: list[Any]) -> None:
        """Re-create the envelopes of ``rows`` not known yet, from their rows."""
        wanted = sorted({r["seq"] for r in rows if r["seq"] not in self._envelopes})
        if not wanted:
            return
        found = {
            r["seq"]: r
            for r in await conn.fetch("SELECT * FROM envq.envelopes WHERE seq = ANY($1)", wanted)
        }
        for seq in wanted:
            row = found.get(seq)
            env: Envelope | None = None
            if row is not None:
                try:
                    env = decode(row)
                except Exception as error:
                    log.warning(
                        "queue %r: events: envelope row %s cannot be re-created here (%s); "
                        "its events carry no envelope",
                        self.name,
                        seq,
                        error,
                    )
            self._envelopes[seq] = env

    # -- events ----------------------------------------------------------------------------

    def _event(self, row: Any) -> Event:
        """The event of one journal row of this queue (checked against the tables under
        ``STRICT``)."""
        label: str = row["event"]
        if row["seq"] is None:
            frm_q, to_q = QueueState(row["from_state"]), QueueState(row["to_state"])
            if _machine.STRICT:
                found = LIFECYCLE.get((frm_q, QueueCall(label)))
                assert (None if found is None else found.target) is to_q, (
                    f"queue {self.name!r}: illegal lifecycle move {frm_q.name} "
                    f"--{label}--> {to_q.name} in the journal"
                )
            return Event(row["at"], self.name, None, frm_q, to_q)
        seq = row["seq"]
        frm = EnvState.NEW if row["from_state"] is None else EnvState(row["from_state"])
        to = EnvState(row["to_state"])
        move: EnvEvent | Outcome = (
            Outcome(label.removeprefix("attempt_"))
            if label.startswith("attempt_")
            else EnvEvent(label)
        )
        if _machine.STRICT:
            assert to in ENVELOPE_MOVES.get((frm, move), ()), (
                f"queue {self.name!r}: illegal envelope move {frm.name} --{move.name}--> "
                f"{to.name} in the journal (row {seq})"
            )
        env = self._envelopes.get(seq)
        if to in TERMINAL_STATES:
            self._envelopes.pop(seq, None)
        outcome = move if isinstance(move, Outcome) else None
        return Event(row["at"], self.name, env, frm, to, outcome, self._cause(env, outcome, to))

    def _cause(
        self, env: Envelope | None, outcome: Outcome | None, to: EnvState
    ) -> Exception | None:
        """The error behind a move, as far as the journal tells: a one-off envelope
        whose ``Retry`` policy is spent fails with ``MaxRetriesExceeded``, as in one
        process; the attempt's own error stays on the node that ran it."""
        if (
            env is not None
            and outcome in _SPENDING
            and to is EnvState.FAILED
            and not env.periodic
            and env.retry is not None
            and env.on_failure is None
        ):
            # Ended FAILED by its policy: at the last attempt the policy allows.
            error = exhausted(
                f"queue {self.name!r}", env.label(), env.retry, env.retry.attempts, None
            )
            return error if isinstance(error, MaxRetriesExceeded) else None
        return None
