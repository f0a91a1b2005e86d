"""A queue whose state lives in PostgreSQL, shared by any number of processes.

Theory of operation
-------------------
The rows are the queue: ``envq.queues`` holds the lifecycle of each named queue,
``envq.envelopes`` one row per envelope per stay. Every change of state is a move of
envq's tables, performed by a statement that names its event; the database's trigger
(generated from the tables, :mod:`envq.postgres.schema`) refuses any other. This
module decides what only a process can decide — the outcome of an attempt it ran,
the failure decision (``on_failure``, the retry policy), the next run of a periodic
envelope — and leaves the target of every move to the tables compiled into SQL.

A process that calls :meth:`PgQueue.start` is a *node*: it runs up to ``workers``
attempts at once. Its pump claims READY envelopes (``envq.claim``: ``FOR UPDATE SKIP
LOCKED``, a lease with a fencing token each) and starts their attempts with envq's
attempt runner; an attempt ends through ``envq.finish_and_claim``, which commits only
while the token holds. A renewer renews the leases of the tokens the node holds in
one statement; a keeper moves due DELAYED envelopes to READY and follows the
lifecycle row (a stop or terminate made by any node), finishing a stop once nothing
is left to drain; a reaper ends attempts whose lease expired on any node (the
``EXPIRED`` outcome, decided by the envelope's own policy like a timeout).
LISTEN/NOTIFY wakes the pump when envelopes arrive; polling is the fallback, so a node
without a listening session (behind a pooler in transaction mode,
``pooler="transaction"`` without ``listen_dsn``) costs latency, not correctness.

Every node reads the lifecycle from the one row, so ``stop()`` on any node stops the
queue everywhere, and ``terminate()`` hands back every envelope, re-created from its
row.

Listeners (:meth:`PgQueue.subscribe`) hear of the moves of every node: a subscription
turns the queue's journal on and reads it back (:mod:`envq.postgres._journal`); a
queue nobody subscribed to writes no journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from envq import _checks
from envq._config import DeadLetter
from envq._entry import elsewhere, hand_over
from envq._envelope import Envelope, Stamp
from envq._errors import (
    BadEnvelope,
    CapacityExceeded,
    QueueNotRunning,
    SendTimeout,
    TypeBlacklisted,
)
from envq._listeners import Listener
from envq._machine import (
    BROADCASTS,
    LIFECYCLE,
    SETTLED,
    CancelCause,
    EnvEvent,
    LifeAction,
    Outcome,
    QueueCall,
    QueueState,
    StopMode,
)
from envq._reports import StopReport
from envq._values import HookTimeout, Rejection
from envq.postgres._admit import admit_alone, admit_within
from envq.postgres._codec import Encoded, decode, encode
from envq.postgres._edges import (
    CHANNEL,
    AdmissionUnknown,
    CommitUnheard,
    NeverFits,
    StoreUnavailable,
    check_caller_connection,
    check_dsn,
    check_lease,
    check_node_name,
    check_pooler,
    check_queue_name,
    committed,
    lost,
)
from envq.postgres._journal import Follower
from envq.postgres._loop import on_its_loop
from envq.postgres._moves import arm_calendars
from envq.postgres._node import Node, _node_name
from envq.postgres._observe import PgObservation
from envq.postgres._operator import PgOperatorCalls
from envq.postgres._sessions import PgSessions
from envq.postgres._sql import LOCK_QUEUE
from envq.postgres.schema import event_label

if TYPE_CHECKING:
    import asyncpg

__all__ = ["CHANNEL", "AdmissionUnknown", "PgQueue", "StoreUnavailable"]

#: The reasons of :class:`envq.Statistics` ``rejections``, by the error a send raised
#: (the lifecycle's errors count as ``state``).
_REJECTIONS: Final[Mapping[type[Exception], Rejection]] = {
    CapacityExceeded: Rejection.CAPACITY,
    TypeBlacklisted: Rejection.BLACKLISTED,
    QueueNotRunning: Rejection.STATE,
}

#: A pooled connection, as the pool lends it.
_Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"

#: A row of ``envq.envelopes`` as the driver returns it.
Row = Any

log = logging.getLogger("envq.postgres")

#: How long a queue keeps its ended envelopes and its journal's rows by default.
RETENTION: Final = dt.timedelta(days=7)


#: Who cancels the attempts in flight after a lifecycle call (every node cancels
#: its own): terminate always, a stop only when asked to.
_CANCELS: Final[Mapping[QueueCall, CancelCause]] = {QueueCall.TERMINATE: CancelCause.TERMINATE}


class PgQueue(PgSessions, PgOperatorCalls, PgObservation):
    """A named queue stored in PostgreSQL, with envq's lifecycle and outcome tables.

    :param dsn: the database (``postgresql://...``); never logged.
    :param name: the queue's name; every process that names it shares it.
    :param workers: attempts this process runs at once once started (0: a producer
        only).
    :param capacity: the most live envelopes the queue holds (0: no limit); a batch
        that would exceed it is refused whole. The capacity is the queue's: the object
        that creates the queue's row sets it (None: 0), and one given a capacity other
        than the row's is refused by :meth:`connect` (None: the queue's, whatever it
        is).
    :param lease: seconds an attempt's lease lasts without renewal (from 0.1 to 86400);
        a node renews its leases every third of it, and an attempt whose node stops
        renewing is reaped by another node after it.
    :param node: this process's name (default: host-pid-random): its sessions'
        ``application_name`` is ``envq:<node>``, and its leases are held under
        :attr:`lease_owner`, the name and a suffix of this object's own.
    :param poll: seconds between polls when no notification arrives.
    :param stop_mode: how ``stop()`` treats ready envelopes by default.
    :param hook_timeout: the hooks' time budgets.
    :param event_poll: seconds between reads of the journal while listeners are
        subscribed (see :meth:`subscribe`).
    :param retention: how long an ended envelope (SUCCEEDED, FAILED, STOPPED) and a row
        of the event journal are kept (seconds or a timedelta; default 7 days; None: for
        ever): this process's node removes older ones, a batch a minute, off the hot
        path. Set it on every node of the queue (the shortest wins).
    :param dead_letter: called as ``dead_letter(env, error)`` for every envelope that
        ends FAILED on this node, with its last error (``MaxRetriesExceeded`` when its
        retries ran out), once the end committed; plain or ``async def``.
    :param stamps: this node's middleware around every attempt it runs, outermost
        first, as one process's ``Queue(stamps=...)`` (``envq.logging_stamp()``,
        ``envq.otel_stamp()``): code of this process, so it does not cross with the
        envelopes; :func:`envq.current_attempt` works in them.
    :param pooler: ``"transaction"`` when ``dsn`` reaches the database through a
        connection pooler in transaction mode (PgBouncer's ``pool_mode =
        transaction``): no named prepared statements (asyncpg's
        ``statement_cache_size=0``), and the node listens for sends on ``listen_dsn``
        only (else it polls every ``poll`` seconds). None (the default): a direct
        connection or a pool in session mode; :meth:`connect` refuses a transaction
        pooler it finds in front, naming this parameter.
    :param listen_dsn: where a node opens its session that listens for sends (never
        logged): the server itself or a pool in session mode. Default: ``dsn``, or no
        listening session with ``pooler="transaction"``.
    """

    def __init__(
        self,
        dsn: str,
        name: str = "default",
        *,
        workers: int = 10,
        capacity: int | None = None,
        lease: float = 30.0,
        node: str | None = None,
        poll: float = 1.0,
        stop_mode: StopMode = StopMode.DRAIN,
        hook_timeout: HookTimeout | None = None,
        event_poll: float = 0.1,
        dead_letter: DeadLetter | None = None,
        retention: float | dt.timedelta | None = RETENTION,
        stamps: Iterable[Stamp] | None = (),
        pooler: str | None = None,
        listen_dsn: str | None = None,
    ) -> None:
        where = "PgQueue()"
        check_dsn(where, dsn)
        self.pooler = check_pooler(where, pooler)
        if listen_dsn is not None:
            check_dsn(f"{where} listen_dsn", listen_dsn)
        #: Where the listening session connects (None: nowhere, the node polls).
        self._listen_dsn = listen_dsn if listen_dsn is not None or self.pooler is not None else dsn
        self.name = check_queue_name(where, name)
        self.workers = _checks.integer(f"{where} workers", workers, minimum=0)
        #: The capacity this object was given (None: the queue's, whatever it is).
        self._asked_capacity = (
            None if capacity is None else _checks.integer(f"{where} capacity", capacity, minimum=0)
        )
        #: The queue's capacity (0: no limit): the one given until :meth:`connect` reads
        #: the queue's row.
        self.capacity = self._asked_capacity or 0
        self.lease = check_lease(where, lease)
        if hook_timeout is not None:
            want = "an envq.HookTimeout or None"
            _checks.instance(f"{where} hook_timeout", hook_timeout, HookTimeout, want=want)
        self.poll = _checks.seconds(f"{where} poll", poll, positive=True)
        self.node = _node_name() if node is None else check_node_name(where, node)
        self.stop_mode = _checks.member(f"{where} stop_mode", stop_mode, StopMode)
        self.event_poll = _checks.seconds(f"{where} event_poll", event_poll, positive=True)
        if dead_letter is not None:
            _checks.callable_(f"{where} dead_letter", dead_letter)
        #: Called as ``dead_letter(env, error)`` for every envelope that ends FAILED on
        #: this node (after the end committed), as in one process.
        self.dead_letter = dead_letter
        #: Seconds an ended envelope and a journal row are kept (None: for ever).
        self.retention = (
            None
            if retention is None
            else _checks.seconds(f"{where} retention", retention, timedelta=True, positive=True)
        )
        self._dsn = dsn
        self._pool: asyncpg.Pool | None = None
        #: The loop that opened the connections: every call runs there.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dedups = 0
        self._rejections: dict[Rejection, int] = {}
        #: The owner of this object's leases: the node's name and a suffix of this
        #: object's own, so that a node restarted under the same name (or another
        #: object of this process) never renews the leases of its predecessor.
        self.lease_owner = f"{self.node}#{uuid.uuid4().hex[:8]}"
        self._node = Node(
            self,
            self.lease_owner,
            self.workers,
            self.lease,
            self.poll,
            hook_timeout or HookTimeout(),
            dead_letter,
            self.retention,
            _checks.stamps(f"{where} stamps", stamps),
        )
        self._events = Follower(self, self.event_poll)

    @property
    def counts_local(self) -> dict[str, int]:
        """What this process did: attempts it ended, ends refused by the fence (its
        lease had expired), expired attempts of any node it reaped."""
        return self._node.counts_local

    def __repr__(self) -> str:
        return f"<PgQueue {self.name!r} node={self.node!r} workers={self.workers}>"

    # -- the lifecycle -----------------------------------------------------------------

    async def _call(
        self, call: QueueCall, mode: StopMode | None = None, cancel: CancelCause | None = None
    ) -> LifeAction:
        """Perform a lifecycle call on the shared row, and its moves of the envelopes,
        in one transaction; the row's action."""
        await self._events.ready()
        async with self._db().acquire() as conn, conn.transaction():
            await conn.execute(LOCK_QUEUE, self.name)  # the ends in progress first
            state = await conn.fetchval(
                "SELECT state FROM envq.queues WHERE name = $1 FOR UPDATE", self.name
            )
            row = LIFECYCLE[(QueueState(state), call)]
            if row.action is LifeAction.REJECT:
                assert row.error is not None
                raise row.error(f"queue {self.name!r} is {state}: {call.value} is rejected")
            assert row.target is not None
            if row.action is LifeAction.AWAIT_STOP:
                mode = cancel = None  # a stop under way keeps its mode and its cancel
            if row.target.value != state or mode is not None:
                await conn.execute(
                    "UPDATE envq.queues SET state = $2, call = $3,"
                    " stop_mode = coalesce($4::envq.stop_mode, stop_mode),"
                    " cancel = CASE WHEN $3::envq.queue_call = 'start' THEN NULL"
                    "          ELSE coalesce($5::envq.cancel_cause, cancel) END"
                    " WHERE name = $1",
                    self.name,
                    row.target.value,
                    call.value,
                    None if mode is None else mode.value,
                    None if cancel is None else cancel.value,
                )
            for event in BROADCASTS.get(row.action, ()):
                if event is EnvEvent.START:
                    await arm_calendars(conn, self.name)
                await conn.execute(
                    "SELECT envq.broadcast($1, $2::envq.envelope_event)",
                    self.name,
                    event_label(event),
                )
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self.name)
        self._events.wake()
        return row.action

    @on_its_loop
    async def state(self) -> QueueState:
        """The shared queue's lifecycle state now."""
        value = await self._db().fetchval(
            "SELECT state FROM envq.queues WHERE name = $1", self.name
        )
        return QueueState(value)

    @on_its_loop
    async def start(self) -> None:
        """Start the shared queue (a no-op when it runs) and, with ``workers > 0``, run
        this process's workers on it until :meth:`close`.

        :raises QueueStopping: the queue is stopping; :class:`QueueTerminated`: it was
            terminated.
        """
        await self.connect()
        await self._call(QueueCall.START)
        if self.workers and not self._node.serving:
            await self._node.serve()

    @on_its_loop
    async def stop(
        self, mode: StopMode | None = None, cancel: bool = False, wait: bool | None = None
    ) -> StopReport:
        """Stop the shared queue on every node (→ STOPPING → STOPPED) and report what
        the stop did.

        :param mode: DRAIN runs the ready envelopes first, STOP parks them (default:
            ``stop_mode``).
        :param cancel: cancel the attempts in flight on every node (their envelopes
            are parked); only with STOP.
        :param wait: return once the queue is STOPPED (the attempts in flight have
            ended, or their leases expired and were reaped); None: True.

        The :class:`envq.StopReport`: ``parked``, the queue's parked envelopes (every
        node's, from their rows; one whose code is missing here is logged and left
        out); ``completed``, ``cancelled``: the attempts this node ended during the
        call; ``complete``: the queue was STOPPED or TERMINATED when it was made. A stop
        of a queue never started changes nothing and returns at once.
        """
        where = f"queue {self.name!r}: stop()"
        mode = self.stop_mode if mode is None else _checks.member(f"{where} mode", mode, StopMode)
        _checks.flag(f"{where} cancel", cancel)
        _checks.optional_flag(f"{where} wait", wait)
        if cancel and mode is StopMode.DRAIN:
            raise ValueError(f"{where}: cancel=True needs mode=StopMode.STOP (mode is DRAIN)")
        ended: list[tuple[Envelope, Outcome]] = []

        def watch(env: Envelope, outcome: Outcome, state: str, claimed_at: float) -> None:
            ended.append((env, outcome))

        self._node.watches.append(watch)
        try:
            action = await self._call(QueueCall.STOP, mode, CancelCause.STOP if cancel else None)
            self._node.wake()
            # A stop that the tables make a no-op (a queue never started, or one
            # already stopped) has nothing to wait for.
            if wait is not False and action is not LifeAction.NOTHING:
                await self._settled()
        finally:
            self._node.watches.remove(watch)
        return await _report(self.name, self._db(), ended)

    @on_its_loop
    async def wait_stopped(self) -> StopReport:
        """Wait until the shared queue is STOPPED or TERMINATED; the final report
        (its ``parked`` envelopes, as :meth:`stop`'s; no attempts)."""
        await self._settled()
        return await _report(self.name, self._db(), ())

    async def _settled(self) -> QueueState:
        """Wait until the shared queue is STOPPED or TERMINATED; that state."""
        while True:
            state = await self.state()
            if state in SETTLED:
                return state
            if state is QueueState.STOPPING:
                await self._node.reap_unserved()
                await self._try_drained()
            await self._node.sleep(min(self.poll, 0.2))

    @on_its_loop
    async def terminate(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - bounded by the leases
    ) -> list[Envelope]:
        """Terminate the shared queue: every node cancels its attempts in flight, and
        every envelope not ended is handed back — re-created from its row, once, to the
        caller. Waits for the attempts in flight to end (or their leases to expire).

        An envelope whose code this process cannot import is not lost: it is logged at
        ERROR and stays in the database, RETURNED, until ``terminate()`` is called again
        in a process that can import it (the queue is TERMINATED already; that call
        only hands back)."""
        timeout = _checks.timeout(f"queue {self.name!r}: terminate() timeout", timeout)
        await self.connect()
        loop = asyncio.get_running_loop()
        until = None if timeout is None else loop.time() + timeout
        state = await self.state()
        if state in (QueueState.RUNNING, QueueState.STOPPING):
            # As in one process: a running queue is stopped first, a stop under way
            # escalated (STOP mode, the attempts in flight cancelled for the
            # terminate); the queue is handed back once stopped.
            if state is QueueState.RUNNING:
                await self._call(QueueCall.STOP, StopMode.STOP, CancelCause.TERMINATE)
            async with self._db().acquire() as conn, conn.transaction():
                await conn.execute(LOCK_QUEUE, self.name)
                await conn.execute(
                    "UPDATE envq.queues SET stop_mode = 'stop', cancel = 'terminate'"
                    " WHERE name = $1 AND state = 'stopping'",
                    self.name,
                )
                for event in BROADCASTS[LifeAction.ESCALATE]:
                    await conn.execute(
                        "SELECT envq.broadcast($1, $2::envq.envelope_event)",
                        self.name,
                        event_label(event),
                    )
            self._node.wake()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._settled()
        await self._call(QueueCall.TERMINATE, cancel=CancelCause.TERMINATE)
        db = self._db()
        while True:
            await self._node.reap_unserved()
            # An attempt reaped meanwhile is parked: hand it back too.
            await db.execute(
                "SELECT envq.broadcast($1, $2::envq.envelope_event)",
                self.name,
                event_label(EnvEvent.TERMINATE),
            )
            running = await db.fetchval(
                "SELECT count(*) FROM envq.envelopes WHERE queue = $1 AND state = 'running'",
                self.name,
            )
            if not running or (until is not None and loop.time() >= until):
                break
            await self._node.sleep(min(self.poll, 0.2))
        # The subscriptions end with the queue: their listeners hear of every move up
        # to the hand-back first, while the handed-back rows are still there.
        await self._events.close()
        return await _hand_back(self.name, db)

    # -- events ------------------------------------------------------------------------

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` with an :class:`envq.Event` for every move of the
        queue and its envelopes, made by any process sharing the queue, in the order
        the database recorded them; returns an unsubscribe function. A listener that
        raises is logged and never breaks the queue.

        The events are read back from the database's journal: subscribing turns it on
        for this queue (every move of the queue then also writes a journal row, on
        every node, until an operator turns it off), and a task on this loop reads it
        every ``event_poll`` seconds while this object is connected. The queue's own
        calls made after ``subscribe`` are always reported; moves of other processes
        from the moment the journal is read. From another thread, the call (and the
        unsubscribe function's) is handed to the queue's loop while it runs.

        :raises TypeError: ``listener`` is not a plain callable (an ``async def`` one
            is refused: its coroutine would never be awaited).
        """
        _checks.plain_callable(
            f"queue {self.name!r}: subscribe() listener",
            listener,
            "listeners are called synchronously on the queue's loop, so an async def "
            "one's coroutine would never be awaited; start a task from a plain listener",
        )
        if elsewhere(self._loop):
            assert self._loop is not None
            return hand_over(self._loop, self.subscribe, listener)
        remove = self._events.add(listener)

        def unsubscribe() -> None:
            if elsewhere(self._loop):
                assert self._loop is not None
                hand_over(self._loop, remove)
            else:
                remove()

        return unsubscribe

    async def _try_drained(self) -> None:
        """A stop under way with nothing left to run or wait for ends (any node)."""
        db = self._db()
        async with db.acquire() as conn, conn.transaction():
            await conn.execute(LOCK_QUEUE, self.name)
            state = await conn.fetchval(
                "SELECT state FROM envq.queues WHERE name = $1 FOR UPDATE", self.name
            )
            if state != QueueState.STOPPING.value:
                return
            # An attempt's end that read the queue RUNNING and committed after the stop
            # moved the envelopes would have left its envelope where a running queue
            # puts it (DELAYED, READY). Ends hold the queue's lock now, so none does
            # unless it ran on a node of schema 4 (a rolling upgrade); the stop's moves
            # are applied again all the same, as to the others, before the stop ends.
            for event in BROADCASTS[LifeAction.BEGIN_STOP]:
                await conn.execute(
                    "SELECT envq.broadcast($1, $2::envq.envelope_event)",
                    self.name,
                    event_label(event),
                )
            busy = await conn.fetchval(
                "SELECT EXISTS (SELECT FROM envq.envelopes WHERE queue = $1"
                " AND state IN ('ready', 'running'))",
                self.name,
            )
            if busy:
                return
            target = LIFECYCLE[(QueueState.STOPPING, QueueCall.DRAINED)].target
            assert target is not None
            await conn.execute(
                "UPDATE envq.queues SET state = $2, call = 'drained' WHERE name = $1",
                self.name,
                target.value,
            )
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self.name)

    # -- sending -----------------------------------------------------------------------

    async def send(self, *envelopes: Envelope, connection: Any = None) -> int:
        """Admit envelopes, all or none, in one transaction; the number admitted (an
        envelope whose ``id`` is live in the queue already is a dedup, not admitted).

        With ``connection`` (an asyncpg connection inside a transaction of the
        caller's), the batch is admitted inside that transaction: it is admitted if and
        only if the caller commits, under the same checks (state, blacklist, dedup,
        capacity), and the nodes hear of it at the commit. The call runs on the
        caller's loop; a refusal leaves the caller's transaction usable (the batch's
        statements run under a savepoint). With a capacity, the queue's send lock is
        then held until the caller's transaction ends, and the transaction must be READ
        COMMITTED. See docs/postgres.md, *Transactional send*.

        :raises BadEnvelopeType: an envelope that cannot cross processes (the message
            names the field); :class:`CapacityExceeded`: the batch does not fit;
            :class:`TypeBlacklisted`; :class:`QueueStopping` / :class:`QueueNotRunning` /
            :class:`QueueTerminated` by the lifecycle; :class:`StoreUnavailable`: the
            database was lost (nothing admitted); :class:`AdmissionUnknown` (a kind of
            it): the connection was lost as the batch committed and the database could
            not be asked whether it did (admitted whole or not at all). A connection
            lost as the batch committed is resolved by asking the database: if it
            committed, ``send`` returns as usual.
        :raises TypeError: ``connection`` is not an asyncpg connection;
            :class:`ValueError`: it is not in a transaction, or (with a capacity) its
            transaction is not READ COMMITTED.
        """
        label = f"queue {self.name!r}: send()"
        if connection is not None:
            check_caller_connection(f"{label} connection", connection)
        try:
            rows = [encode(env, label) for env in envelopes]
        except BadEnvelope:
            self._rejections[Rejection.INVALID] = self._rejections.get(Rejection.INVALID, 0) + 1
            raise
        if not rows:
            return 0
        try:
            if connection is None:
                return await self._send_batch(rows, label)
            admitted, self.capacity = await admit_within(connection, self.name, rows)
        except tuple(_REJECTIONS) as error:
            reason = next(r for cls, r in _REJECTIONS.items() if isinstance(error, cls))
            self._rejections[reason] = self._rejections.get(reason, 0) + 1
            raise
        self._dedups += len(rows) - admitted
        return admitted

    @on_its_loop
    async def _send_batch(self, rows: Sequence[Encoded], label: str) -> int:
        """A send in a transaction of its own, on a session of the queue's pool."""
        import asyncpg  # noqa: PLC0415

        await self._events.ready()
        try:
            admitted, self.capacity = await admit_alone(self._session, self.name, rows)
        except lost(asyncpg) as error:
            raise StoreUnavailable(
                f"{label}: the connection was lost; nothing was admitted ({type(error).__name__})"
            ) from None
        except CommitUnheard as unheard:
            # The server may have committed before the connection went: ask it.
            done = await committed(self._session, unheard.xid, lost(asyncpg))
            if done is None:
                raise AdmissionUnknown(
                    f"{label}: the connection was lost as the batch committed, and the"
                    " database cannot tell whether it did: it was admitted whole or not at"
                    " all (sending it again is safe for envelopes with an id)"
                ) from None
            if not done:
                raise StoreUnavailable(
                    f"{label}: the connection was lost as the batch committed; the"
                    " database rolled it back: nothing was admitted"
                ) from None
            admitted = unheard.admitted
        self._dedups += len(rows) - admitted
        self._events.wake()
        return admitted

    @on_its_loop
    async def send_wait(
        self,
        *envelopes: Envelope,
        timeout: float | None = None,  # noqa: ASYNC109 - as envq's send_wait
    ) -> int:
        """:meth:`send`, waiting (polling) while the batch does not fit the capacity.

        :raises SendTimeout: no room within ``timeout`` seconds (a
            :class:`CapacityExceeded` and a ``TimeoutError``);
            :class:`CapacityExceeded`: at once, for a batch larger than the capacity.
        """
        timeout = _checks.timeout(f"queue {self.name!r}: send_wait() timeout", timeout)
        loop = asyncio.get_running_loop()
        until = None if timeout is None else loop.time() + timeout
        while True:
            try:
                return await self.send(*envelopes)
            except NeverFits:
                raise
            except CapacityExceeded:
                if until is not None and loop.time() >= until:
                    raise SendTimeout(
                        f"queue {self.name!r}: send_wait(): no room within {timeout} s"
                    ) from None
                await self._node.sleep(min(self.poll, 0.1))


async def _report(
    name: str, db: asyncpg.Pool, ended: Iterable[tuple[Envelope, Outcome]]
) -> StopReport:
    """A stop's report: the queue's parked envelopes, re-created from their rows in
    admission order (one whose code is missing here is logged and left out), and
    ``ended``, the attempts of this node that ended during the stop."""
    async with db.acquire() as conn:
        state = await conn.fetchval("SELECT state FROM envq.queues WHERE name = $1", name)
        rows = await conn.fetch(
            "SELECT * FROM envq.envelopes WHERE queue = $1 AND state = 'parked' ORDER BY seq",
            name,
        )
    parked: list[Envelope] = []
    for row in rows:
        try:
            parked.append(decode(row))
        except Exception as error:  # its code is missing in this process
            log.warning(
                "queue %r: stop()'s report leaves out parked envelope %s (%s); its row stays",
                name,
                row["seq"],
                error,
            )
    ends = list(ended)
    return StopReport(
        parked=tuple(parked),
        completed=tuple(env for env, outcome in ends if outcome is not Outcome.CANCELLED),
        cancelled=tuple(env for env, outcome in ends if outcome is Outcome.CANCELLED),
        complete=QueueState(state) in SETTLED,
    )


async def _hand_back(name: str, db: asyncpg.Pool) -> list[Envelope]:
    """Delete and return the envelopes handed back, each decoded first: a row whose
    code this process cannot import stays RETURNED in the database (logged), for a
    later ``terminate()`` in a process that can import it to hand back."""
    handed: list[Envelope] = []
    kept: list[int] = []
    async with db.acquire() as conn, conn.transaction():
        rows = await conn.fetch(
            "SELECT * FROM envq.envelopes WHERE queue = $1 AND state = 'returned'"
            " ORDER BY seq FOR UPDATE",
            name,
        )
        seqs: list[int] = []
        for row in rows:
            try:
                handed.append(decode(row))
            except Exception as error:  # its code is missing in this process
                kept.append(row["seq"])
                log.error(
                    "queue %r: terminate() cannot hand back envelope %s (%s); it stays "
                    "in the database, RETURNED",
                    name,
                    row["seq"],
                    error,
                )
            else:
                seqs.append(row["seq"])
        await conn.execute("DELETE FROM envq.envelopes WHERE seq = ANY($1::bigint[])", seqs)
    if kept:
        log.error(
            "queue %r: %d envelope(s) not handed back (seq %s): call terminate() again "
            "in a process that can import their code",
            name,
            len(kept),
            ", ".join(map(str, kept)),
        )
    return handed


if TYPE_CHECKING:
    from envq._protocol import QueueProtocol
    from envq._queue import Queue

    def _one_api(queue: Queue, shared: PgQueue) -> tuple[QueueProtocol, QueueProtocol]:
        """Both stores satisfy :class:`envq.QueueProtocol` (checked by mypy)."""
        return queue, shared
