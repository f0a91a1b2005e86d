"""One process's workers on a PostgreSQL queue: claims, attempts, leases, reaping.

:class:`Node` is the working side of :class:`envq.postgres.PgQueue`. Its pump claims
READY envelopes (``envq.claim``: ``FOR UPDATE SKIP LOCKED``, a lease with a fencing
token each) and runs their attempts with envq's attempt runner; the outcome row of
each attempt is performed as far as a node decides (hooks, the failure decision, the
delay of a next run), and the finisher ends the attempts of the moment in one
statement (``envq.finish_many``), each fenced by its token. The keeper renews the
node's leases in one statement, moves due envelopes, reaps expired leases of any node
(the ``EXPIRED`` outcome), follows the lifecycle row and opens the listening session
again when it was lost. Where each envelope goes is the database's to compute from
the tables; nothing here writes a state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

import attrs

from envq._attempt import Runner, Threads, Worker, expire_limits
from envq._checks import is_async_callable
from envq._config import DeadLetter
from envq._crew import HOSTED
from envq._envelope import Envelope, Stamp
from envq._machine import (
    LIVE_STATES,
    RELABEL,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueState,
    moved_by,
    queue_move,
)
from envq._notify import to_dead_letter
from envq._timers import Deadlines
from envq._values import HookTimeout
from envq.postgres._codec import calendar, decode, fire_wait
from envq.postgres._edges import MAX_NODE_NAME, lost, redact
from envq.postgres._ends import (
    RETIRE_EVERY,
    Ended,
    Reaper,
    decide,
    error_json,
    report,
    spent,
    without_code,
)
from envq.postgres.schema import event_label

if TYPE_CHECKING:
    import asyncpg

__all__ = ["CHANNEL", "Host", "Node", "arm_calendars"]

log = logging.getLogger("envq.postgres")

#: The NOTIFY channel: the payload is the queue's name.
CHANNEL: Final = "envq"

#: A pooled connection, as the pool lends it.
_Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"

#: A row of ``envq.envelopes`` as the driver returns it.
Row = Any


class Host(Protocol):
    """What a node uses of its queue: the connections, and the end of a stop."""

    name: str
    #: Where the listening session connects (None: nowhere, the node polls).
    _listen_dsn: str | None

    def _db(self) -> asyncpg.Pool: ...

    def _session(self) -> AbstractAsyncContextManager[_Conn]: ...

    def _session_settings(self) -> dict[str, str]: ...

    async def _try_drained(self) -> None: ...


_FINISH_AND_CLAIM: Final = """
SELECT * FROM envq.finish_and_claim($1::bigint[], $2::uuid[], $3::envq.envelope_event[],
                                    $4::envq.decision_kind[], $5::envq.cancel_cause[],
                                    $6::float8[], $7::integer[], $8::jsonb[], $9, $10, $11,
                                    $12 * interval '1 second')
"""
_RUNNING: Final = EnvState.RUNNING.value
_CANCELLED: Final = RELABEL[EnvEvent.CANCEL].value

#: The keeper's due move: how many envelopes became due, and the seconds until the
#: next DELAYED one is (None: none is).
_DUE: Final = """
SELECT envq.due($1) AS moved,
       extract(epoch FROM (SELECT min(d.due_at) FROM envq.envelopes AS d
                            WHERE d.queue = $1 AND d.state = 'delayed'
                              AND d.due_at > clock_timestamp()) - clock_timestamp())::float8
           AS soon
"""

#: Renew the leases whose tokens the node knows it holds (never shortening one).
_RENEW: Final = "SELECT * FROM envq.renew($1, $2, $3 * interval '1 second', $4::uuid[])"
#: The attempts the node holds under its owner name but does not know of (a claim
#: whose reply was lost), their leases renewed.
_ADOPT: Final = "SELECT * FROM envq.adopt($1, $2, $3::uuid[], $4 * interval '1 second')"
#: Before a decision: the lease still holds (extended over the hook's budget); the
#: row's kind, or NULL.
_HOLD: Final = "SELECT envq.hold($1, $2, $3 * interval '1 second')::text"
#: Of the ends whose reply was lost, those that committed: their rows still name the
#: attempt's token as the last one ended by its node.
_ENDED: Final = """
SELECT seq, state::text AS state, kind::text AS kind FROM envq.envelopes
 WHERE seq = ANY($1::bigint[]) AND ended_token = ANY($2::uuid[])
"""

#: The calendar envelopes a start arms, with the wait a buffered one had left, and the
#: database's clock.
_ARMED_BY_START: Final = ", ".join(
    f"'{state.value}'" for state in sorted(moved_by(EnvEvent.START), key=lambda s: s.value)
)
_CALENDARS: Final = f"""
SELECT seq, cron, cron_tz, state::text AS state,
       extract(epoch FROM greatest(due_at - updated_at, interval '0'))::float8 AS wait_s,
       extract(epoch FROM clock_timestamp())::float8 AS now_s
  FROM envq.envelopes
 WHERE queue = $1 AND cron IS NOT NULL AND state IN ({_ARMED_BY_START})
   FOR UPDATE
"""


async def arm_calendars(conn: Any, queue: str) -> None:
    """Before a start's moves: give every calendar envelope it arms the wait to its
    first fire, read on the database's clock. A buffered one's first run is the first
    fire at or after its start plus the wait it was sent with (``delay``,
    ``not_before``); a parked one (a restart) waits for the first fire at or after the
    start: fires missed while the queue was stopped are skipped. The start measures
    the wait left from ``updated_at``, so both columns are set."""
    rows = await conn.fetch(_CALENDARS, queue)
    if not rows:
        return
    seqs, waits = [], []
    for row in rows:
        now = row["now_s"]
        at = now + row["wait_s"] if row["state"] == EnvState.BUFFERED.value else now
        seqs.append(row["seq"])
        waits.append(fire_wait(calendar(row["cron"], row["cron_tz"]).first_fire(at), now))
    await conn.execute(
        "UPDATE envq.envelopes AS e SET updated_at = to_timestamp(u.now_s),"
        " due_at = to_timestamp(u.now_s) + u.wait * interval '1 second'"
        " FROM unnest($1::bigint[], $2::float8[], $3::float8[]) AS u(seq, wait, now_s)"
        " WHERE e.seq = u.seq",
        seqs,
        waits,
        [row["now_s"] for row in rows],
    )


async def _returned(conn: object) -> None:
    """What the pool does with a session given back to it, beyond rolling back a
    transaction left open (which asyncpg always does): nothing. Its default sends a
    statement that undoes session state (``RESET ALL``, ``UNLISTEN *``, session
    advisory locks, open cursors), a round trip at every claim and every end; envq's
    pooled sessions hold none (their settings and advisory locks are the
    transaction's, and the listening session is not pooled)."""


async def _nap(wake: asyncio.Event, seconds: float) -> None:
    """Wait until ``wake`` is set or ``seconds`` have passed. Not ``wait_for``: on
    Python 3.11 its timeout racing a cancel can swallow the cancel, and a node's task
    would then outlive ``close()``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await wake.wait()


#: The result of an attempt's end the node could not commit (the database stayed
#: away for longer than four leases): another node reaps the attempt.
_GAVE_UP: Final = "gave up"


class _ClaimGate:
    """Claims run side by side; taking back the attempts of a lost claim (adopt) runs
    alone: a claim in flight holds leases whose tokens the node does not know yet,
    which adopt would take for lost ones."""

    __slots__ = ("_alone", "_changed", "_claims")

    def __init__(self) -> None:
        self._claims = 0
        self._alone = False
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def claiming(self) -> AsyncIterator[None]:
        """Around a statement that claims."""
        while self._alone:
            await self._changed.wait()
        self._claims += 1
        try:
            yield
        finally:
            self._claims -= 1
            self._notify()

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """Around adopt: no claim in flight, none starts."""
        while self._alone:
            await self._changed.wait()
        self._alone = True
        try:
            while self._claims:
                await self._changed.wait()
            yield
        finally:
            self._alone = False
            self._notify()


@attrs.define(slots=True)
class _Ending:
    """An attempt's end waiting for the finisher's next statement."""

    seq: int
    token: uuid.UUID
    outcome: str
    decision: str | None
    cause: str | None
    #: Seconds to the next run; None: the database computes it from the row's
    #: FIXED_DELAY / FIXED_RATE schedule.
    delay: float | None
    failures: int | None
    #: The error the attempt ended with, as JSON (``ErrorInfo``; None: none).
    error: str | None
    give_up: float
    #: The end as committed; None: refused (the lease had expired); _GAVE_UP.
    done: asyncio.Future[Ended | str | None]


_Cause: TypeAlias = BaseException | None


def _node_name() -> str:
    """``<host>-<pid>-<random>``, the host's name cut so that the whole fits
    ``application_name`` (:data:`envq.postgres._edges.MAX_NODE_NAME`)."""
    rest = f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    host = socket.gethostname().encode("ascii", "replace").decode()
    host = "".join(c if c.isprintable() and not c.isspace() else "-" for c in host) or "node"
    return host[: MAX_NODE_NAME - len(rest)] + rest


async def end_each(
    queue: str, end: Callable[[list[_Ending], int], Awaitable[list[Row]]], batch: list[_Ending]
) -> tuple[list[Row], list[_Ending]]:
    """End each attempt of ``batch`` in a statement of its own; one the database
    still refuses ends as a dropped failure would (the tables' move for a failed
    attempt dropped by its decision), logged at ERROR. ``(ended rows, ends to try
    again)``: the ends the database was lost for are tried again."""
    import asyncpg  # noqa: PLC0415

    found: list[Row] = []
    again: list[_Ending] = []
    for e in batch:
        try:
            found += await end([e], 0)
            continue
        except lost(asyncpg):
            again.append(e)
            continue
        except asyncpg.PostgresError as error:
            log.error(
                "queue %r: could not end the attempt of envelope %s (%s); it ends as "
                "a dropped failure",
                queue,
                e.seq,
                error,
            )
        dropped = _Ending(
            e.seq,
            e.token,
            event_label(Outcome.ERROR),
            DecisionKind.DROP.value,
            None,
            0.0,
            None,
            e.error,
            e.give_up,
            e.done,
        )
        try:
            found += await end([dropped], 0)
        except lost(asyncpg):
            again.append(e)
        except asyncpg.PostgresError as error:
            log.error(
                "queue %r: could not end the attempt of envelope %s as a dropped "
                "failure either (%s); its lease expires and a reaper ends it",
                queue,
                e.seq,
                error,
            )
            e.done.set_result(_GAVE_UP)
    return found, again


class _Flight:
    """One attempt in flight on this node: its row, its lease, its worker."""

    __slots__ = ("claimed_at", "freed", "lost", "row", "token", "worker")

    def __init__(self, row: Row, worker: Worker) -> None:
        self.row = row
        self.token: uuid.UUID = row["lease_token"]
        self.worker = worker
        self.lost = False
        self.freed = False
        self.claimed_at = time.monotonic()


#: The warning of a node that cannot open its listening session (and polls).
_DEAF: Final = (
    "queue %r: cannot open the session that listens for sends (%s); polling every %s s meanwhile"
)


async def _listening(
    dsn: str, settings: dict[str, str], notified: Callable[[Any, int, str, object], None]
) -> asyncpg.Connection:
    """A session of its own listening on :data:`CHANNEL` (the driver's error if it
    cannot be opened; nothing is left open then)."""
    import asyncpg  # noqa: PLC0415

    listener = await asyncpg.connect(dsn, server_settings=settings)
    try:
        await listener.add_listener(CHANNEL, notified)
    except BaseException:
        listener.terminate()
        raise
    return listener


class Node:
    """This process's workers on one queue (none run until :meth:`serve`).

    :param host: the queue (its connections, and the end of a stop).
    :param node: this process's name in the leases.
    :param workers: attempts at once.
    :param lease: seconds a lease lasts without renewal.
    :param poll: seconds between polls when no notification arrives.
    :param hook_timeout: the hooks' time budgets.
    """

    def __init__(
        self,
        host: Host,
        node: str,
        workers: int,
        lease: float,
        poll: float,
        hook_timeout: HookTimeout,
        dead_letter: DeadLetter | None = None,
        retention: float | None = None,
        stamps: tuple[Stamp, ...] = (),
    ) -> None:
        self._host = host
        self.name = host.name
        self.node = node
        self.workers = workers
        self.lease = lease
        self.poll = poll
        self._listener: asyncpg.Connection | None = None
        #: The listening session could not be opened (warned once until it opens).
        self._deaf = False
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._flights: dict[int, _Flight] = {}
        self._attempts: set[asyncio.Task[None]] = set()
        self._ending: list[_Ending] = []
        self._ending_ready = asyncio.Event()
        #: Attempts running their body or hooks (a slot each; their end may still be
        #: committing).
        self._busy = 0
        self._claim_floor = max(1, workers // 2)
        #: Claims run side by side, adopt alone.
        self._gate = _ClaimGate()
        #: A claim's reply was lost: its attempts may be held under this node's name
        #: without its knowing (the renewer takes them back).
        self._orphans = False
        self._hook_timeout = hook_timeout
        self.serving = False
        self._epoch = 0
        #: What this node did: attempts ended, refused by the fence, reaped.
        self.counts_local: dict[str, int] = {"finished": 0, "fenced": 0, "reaped": 0}
        #: The outcomes of the attempts this node ended (committed ends only).
        self.outcomes: dict[Outcome, int] = {}
        #: Called as ``watch(envelope, outcome, state, claimed_at)`` for each committed
        #: end (a stop's report, the metrics): ``state`` the row's, ``claimed_at`` on
        #: ``time.monotonic()``.
        self.watches: list[Callable[[Envelope, Outcome, str, float], None]] = []
        self._deadlines = Deadlines(self._expire_limits)
        self._runner = Runner(
            host.name,
            stamps,
            hook_timeout,
            Threads(max(1, workers), f"envq-pg-{host.name}"),
            self._deadlines,
            self._abandoned,
        )
        self._dead_letter_to = dead_letter
        #: Seconds an ended envelope (and a journal row) is kept; None: for ever.
        self.retention = retention
        self._reaper_of = Reaper(
            host.name,
            node,
            self._runner,
            lambda: self._epoch,
            self.counts_local,
            self._wake.set,
            None if dead_letter is None else self._dead_letter,
        )

    @property
    def stuck_threads(self) -> int:
        """Threads still running a call the node stopped waiting for."""
        return self._runner.threads.stuck

    def _dead_letter(self, env: Envelope, error: BaseException | None) -> None:
        """Hand an envelope this node ended FAILED to the queue's ``dead_letter`` (after
        the end committed; an ``async def`` one as a task)."""
        hook = self._dead_letter_to
        if hook is not None:
            loop = asyncio.get_running_loop()
            to_dead_letter(self.name, hook, is_async_callable(hook), env, error, loop)

    def wake(self) -> None:
        """Something changed: look at the queue now rather than at the next poll."""
        self._wake.set()

    async def leave(self) -> None:
        """Stop claiming, let the attempts in flight end (their ends commit), and stop
        the node's tasks."""
        self.serving = False
        self._wake.set()
        if self._attempts:
            await asyncio.gather(*self._attempts, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close()
            self._listener = None
        self._deadlines.disarm()

    async def reap_unserved(self) -> None:
        """Reap expired leases while waiting for them, when this process runs no keeper
        (a producer): with every node gone, nobody else would."""
        if self.serving:
            return
        loop = asyncio.get_running_loop()
        self._runner.bind(loop)
        self._deadlines.bind(loop)
        async with self._host._session() as conn:
            await self._reaper_of.reap(conn)

    async def serve(self) -> None:
        self.serving = True
        self._epoch += 1
        loop = asyncio.get_running_loop()
        self._runner.bind(loop)
        self._deadlines.bind(loop)
        await self._listen()
        self._tasks = [
            asyncio.create_task(self._pump(), name=f"envq-pg-pump-{self.name}"),
            asyncio.create_task(self._renewer(), name=f"envq-pg-renewer-{self.name}"),
            asyncio.create_task(self._keep(), name=f"envq-pg-keeper-{self.name}"),
            asyncio.create_task(self._reaper(), name=f"envq-pg-reaper-{self.name}"),
            asyncio.create_task(self._finisher(), name=f"envq-pg-finisher-{self.name}"),
        ]

    async def _listen(self) -> None:
        """Open the session that listens for sends unless it is open (the keeper opens
        a lost one again); without it, the node polls."""
        import asyncpg  # noqa: PLC0415

        dsn = self._host._listen_dsn
        if dsn is None or (self._listener is not None and not self._listener.is_closed()):
            return
        self._listener = None
        try:
            self._listener = await _listening(dsn, self._host._session_settings(), self._notified)
        except lost(asyncpg, asyncpg.PostgresError, ValueError) as error:
            if not self._deaf:  # once until it opens again: the keeper retries each round
                self._deaf = True
                reason = redact(dsn, f"{type(error).__name__}: {error}")
                log.warning(_DEAF, self.name, reason, self.poll)
            return
        self._deaf = False
        self._wake.set()  # a send may have come while nobody listened

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload == self.name:
            self._wake.set()

    async def sleep(self, seconds: float) -> None:
        self._wake.clear()
        await _nap(self._wake, seconds)

    async def _pump(self) -> None:
        """Claim ready envelopes while there is room, and start their attempts."""
        import asyncpg  # noqa: PLC0415

        backoff = 0.05
        while self.serving:
            free = self.workers - self._busy
            # While attempts run, claim in batches (half the workers at least): a
            # claim is a statement and a commit, whatever its size.
            if free <= 0 or (self._busy and free < self._claim_floor):
                self._room.clear()
                await self._room.wait()
                continue
            self._wake.clear()
            try:
                async with self._gate.claiming(), self._host._session() as conn:
                    try:
                        rows = await conn.fetch(
                            "SELECT * FROM envq.claim($1, $2, $3, $4 * interval '1 second')",
                            self.name,
                            self.node,
                            free,
                            self.lease,
                        )
                    except lost(asyncpg):
                        self._orphans = True  # it may have committed unheard
                        raise
                backoff = 0.05
            except lost(asyncpg, asyncpg.PostgresError) as error:
                log.warning("queue %r: claim failed (%s); retrying", self.name, error)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.poll)
                continue
            for row in rows:
                self._launch(row)
            if not rows:
                await _nap(self._wake, self.poll)

    def _launch(self, row: Row) -> None:
        """Start the attempt of a claimed row (a slot taken until its end commits)."""
        flight = _Flight(row, Worker(self._epoch))
        self._flights[row["seq"]] = flight
        self._busy += 1
        task = asyncio.create_task(self._run(flight))
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)

    async def _renewer(self) -> None:
        """Renew the leases of the attempts in flight, every third of a lease, on a
        task of its own: no hook, reap or lifecycle step ever makes a renewal wait.
        After a claim whose reply was lost, take back its attempts (adopt)."""
        import asyncpg  # noqa: PLC0415

        period = self.lease / 3
        while True:
            try:
                async with self._host._session() as conn:
                    await self._renew(conn)
                if self._orphans:
                    await self._adopt()
            except asyncio.CancelledError:
                raise
            except lost(asyncpg, asyncpg.PostgresError) as error:
                log.warning("queue %r: renewing leases failed (%s)", self.name, error)
            except Exception:
                log.exception("queue %r: renewing leases failed", self.name)
            await asyncio.sleep(period)

    async def _adopt(self) -> None:
        """Take back the attempts held under this node's name that it does not know of
        (a claim whose reply was lost), with no claim in flight (whose attempts would
        look the same), and start them.

        The gate first, then a session, as the pump takes them: holding a session while
        waiting for the claims in flight to end would deadlock with a claim waiting for
        a session of a pool that has none left."""
        async with self._gate.alone(), self._host._session() as conn:
            known = [flight.token for flight in self._flights.values()]
            rows = await conn.fetch(_ADOPT, self.name, self.node, known, self.lease)
            self._orphans = False
        for row in rows:
            log.warning(
                "queue %r: took back envelope %s, claimed by a statement whose reply was lost",
                self.name,
                row["seq"],
            )
            self._launch(row)

    async def _keep(self) -> None:
        """Move due envelopes and follow the lifecycle; open the listening session
        again when it was lost."""
        import asyncpg  # noqa: PLC0415

        period = min(self.lease / 3, self.poll)
        listening: list[asyncio.Task[None]] = []
        while True:
            soon: float | None = None
            listener = self._listener
            gone = self._host._listen_dsn is not None and (listener is None or listener.is_closed())
            if gone and all(t.done() for t in listening):
                # In its own task: connecting may take long.
                listening = [asyncio.create_task(self._listen())]
                self._tasks += listening
            try:
                async with self._host._session() as conn:
                    due = await conn.fetchrow(_DUE, self.name)
                    moved, soon = (0, None) if due is None else (due["moved"], due["soon"])
                    if moved:
                        self._wake.set()
                    await self._follow(conn)
            except asyncio.CancelledError:
                raise
            except lost(asyncpg, asyncpg.PostgresError) as error:
                log.warning("queue %r: keeper round failed (%s)", self.name, error)
            except Exception:
                log.exception("queue %r: keeper round failed", self.name)
            # Not a whole period past the next due time: a due move is late by the
            # statement's time only.
            await asyncio.sleep(period if soon is None else min(period, max(soon, 0.0)))

    async def _reaper(self) -> None:
        """End the attempts whose lease expired, on any node, on a task of its own: a
        reaped attempt's ``on_failure`` may take its whole budget. Now and then, remove
        what the queue's retention no longer keeps (:meth:`Reaper.retire`)."""
        import asyncpg  # noqa: PLC0415

        period = min(self.lease / 3, self.poll)
        retired = -math.inf
        while True:
            try:
                async with self._host._session() as conn:
                    await self._reaper_of.reap(conn)
                    if self.retention is not None and time.monotonic() - retired >= RETIRE_EVERY:
                        retired = time.monotonic()
                        await self._reaper_of.retire(conn, self.retention)
            except asyncio.CancelledError:
                raise
            except lost(asyncpg, asyncpg.PostgresError) as error:
                log.warning("queue %r: reaping failed (%s)", self.name, error)
            except Exception:
                log.exception("queue %r: reaping failed", self.name)
            await asyncio.sleep(period)

    async def _renew(self, db: asyncpg.Pool | _Conn) -> None:
        if not self._flights:
            return
        # Only the flights known before the statement: one claimed meanwhile holds a
        # lease the statement was not asked to renew.
        known = list(self._flights.values())
        held = {
            r["token"]: r["kind"]
            for r in await db.fetch(
                _RENEW, self.name, self.node, self.lease, [flight.token for flight in known]
            )
        }
        for flight in known:
            kind = held.get(flight.token)
            # A flight whose body ended is committing its end, which cleared the lease.
            if kind is None and not flight.lost and not flight.freed:
                # The lease expired: another node may reap it; stop the work (once the
                # attempt's code is over, its finish is refused by the fence instead).
                flight.lost = True
                _ask_to_stop(flight.worker, CancelCause.STOP)
            elif kind == _CANCELLED:  # an operator cancelled it: its end is STOPPED anyway
                _ask_to_stop(flight.worker, CancelCause.STOP)

    async def _follow(self, db: asyncpg.Pool | _Conn) -> None:
        found = await db.fetchrow(
            "SELECT state, cancel FROM envq.queues WHERE name = $1", self.name
        )
        if found is None:
            return
        state = QueueState(found["state"])
        if found["cancel"] is not None and state is not QueueState.RUNNING:
            cause = CancelCause(found["cancel"])
            for flight in self._flights.values():
                _ask_to_stop(flight.worker, cause)
        if state is QueueState.STOPPING:
            await self._host._try_drained()

    # -- one attempt ---------------------------------------------------------------------

    async def _run(self, flight: _Flight) -> None:
        """One attempt, then its end, fenced from start to finish: the decision
        (``on_failure``) runs only while the lease holds (:meth:`_decide`), the end
        commits only under the attempt's token, and the hooks that report an end
        (``on_success``, a failure nobody retries) run only once it has committed
        (:meth:`_report`). The slot stays taken until all of it is over: a node never
        runs more than ``workers`` attempts and hooks at once."""
        row = flight.row
        w = flight.worker
        w.task = asyncio.current_task()
        outcome: Outcome
        cause: BaseException | None
        env: Envelope | None
        missing: Exception | None = None
        try:
            env = decode(row)
        except Exception as error:  # its code is missing on this node
            env, missing = None, error
            outcome, cause = Outcome.ERROR, error
        else:
            w.env = env
            HOSTED.set((self._host, env, int(row["attempt"]), w))  # current_attempt()
            outcome, cause = await self._runner.attempt(w, env)
        try:
            if flight.lost:
                self.counts_local["fenced"] += 1
                return
            if env is None:
                assert missing is not None
                kind, delay, failures = without_code(
                    self.name, self.node, row, outcome, missing, flight.claimed_at, None
                )
                await self._finish(flight, outcome, kind, w.cancel_cause, delay, failures, missing)
                return
            decided = await decide(
                self._runner,
                w,
                env,
                row,
                outcome,
                cause,
                (flight.claimed_at, None),
                functools.partial(self._hold, flight, env),
            )
            if decided is None:  # the lease lapsed before the decision: the reaper's
                self.counts_local["fenced"] += 1
                return
            kind, delay, failures = decided
            if outcome is Outcome.STOP_TYPE and env.type:  # the ban commits with the end
                await end_banning(self, row, env.type, flight.claimed_at)
                return
            kept = spent(self.name, env, row, outcome, cause)
            ended = await self._finish(flight, outcome, kind, w.cancel_cause, delay, failures, kept)
            if ended is not None:
                for watch in self.watches:
                    watch(env, outcome, ended.state, flight.claimed_at)
                hand = None if self._dead_letter_to is None else self._dead_letter
                await report(self._runner, self.name, w, env, row, outcome, kept, ended, hand)
        finally:
            self._free(flight)
            # The end may have been committed with a claim of the same envelope (a retry
            # at once): the new flight under this seq is not this one's to forget.
            if self._flights.get(row["seq"]) is flight:
                del self._flights[row["seq"]]
            w.env = None

    def _free(self, flight: _Flight) -> None:
        if not flight.freed:
            flight.freed = True
            self._busy -= 1
            self._room.set()

    async def _finish(
        self,
        flight: _Flight,
        outcome: Outcome,
        decision: DecisionKind | None,
        cause: CancelCause | None,
        delay: float | None,
        failures: int | None,
        error: BaseException | None,
    ) -> Ended | None:
        """End the attempt in the database (batched with the other attempts ending now,
        one statement and one commit for all), fenced by its token, with the error it
        ended with (kept as the envelope's story); the end as committed, or None when
        it was refused or never committed."""
        row = flight.row
        ending = _Ending(
            row["seq"],
            flight.token,
            event_label(outcome),
            None if decision is None else decision.value,
            None if outcome is not Outcome.CANCELLED or cause is None else cause.value,
            delay,
            failures,
            None if outcome is Outcome.OK else error_json(error),
            flight.claimed_at + self.lease * 4,
            asyncio.get_running_loop().create_future(),
        )
        self._ending.append(ending)
        self._ending_ready.set()
        ended = await ending.done
        if ended is None:
            self.counts_local["fenced"] += 1
            log.warning(
                "queue %r: the lease of envelope %s expired before its attempt ended; its "
                "result was refused",
                self.name,
                row["seq"],
            )
            return None
        if not isinstance(ended, Ended):  # gave up: a reaper ends it
            return None
        self.counts_local["finished"] += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if ended.state == EnvState.READY.value:
            self._wake.set()
        return ended

    async def _finisher(self) -> None:
        """Commit the ends of the attempts that ended meanwhile, all in one statement.
        A statement whose reply was lost may have committed: before it is tried again,
        the ends it committed are read back from the database (their rows name their
        tokens as ended), never assumed either way."""
        import asyncpg  # noqa: PLC0415

        pause = 0.05
        while True:
            await self._ending_ready.wait()
            self._ending_ready.clear()
            batch, self._ending = self._ending, []
            unheard = False
            while batch:
                found: list[Row] = []
                retry: list[_Ending] = []
                try:
                    if unheard:
                        found = await self._committed(batch)
                        done = {r["seq"] for r in found}
                        rest = [e for e in batch if e.seq not in done]
                        unheard = False
                    else:
                        rest = batch
                    # The slots these ends free are taken again by as many claims in the
                    # same statement (while the node serves): one round trip, one commit.
                    how_many = len(rest) if self.serving else 0
                    if rest:
                        found += await self._end(rest, how_many)
                except lost(asyncpg) as err:
                    # Lost the database: try again while the leases may still hold.
                    unheard = True
                    for r in found:  # read back before the loss
                        e = next(e for e in batch if e.seq == r["seq"])
                        e.done.set_result(Ended(r["state"], r["kind"]))
                    now = time.monotonic()
                    for e in batch:
                        if now > e.give_up and not e.done.done():
                            log.error("queue %r: could not end an attempt (%s)", self.name, err)
                            e.done.set_result(_GAVE_UP)
                    batch = [e for e in batch if not e.done.done()]
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 1.0)
                    continue
                except asyncpg.PostgresError as err:
                    # One bad end (a next run the database cannot hold) fails the
                    # statement for all: end them one by one, so that it alone is hit.
                    log.warning(
                        "queue %r: ending %d attempts failed (%s); ending them one by one",
                        self.name,
                        len(batch),
                        err,
                    )
                    found, retry = await end_each(self.name, self._end, batch)
                    if self.serving:
                        self._wake.set()  # their slots are claimed again by the pump
                pause = 0.05
                ends: dict[int, Ended] = {}
                for r in found:
                    if r["state"] == _RUNNING:  # claimed (an end never leads to RUNNING)
                        self._launch(r)
                    else:
                        ends[r["seq"]] = Ended(r["state"], r["kind"])
                for e in batch:
                    if not e.done.done() and e not in retry:
                        e.done.set_result(ends.get(e.seq))
                batch = retry
                if batch:
                    await asyncio.sleep(pause)

    async def _committed(self, batch: list[_Ending]) -> list[Row]:
        """Of ``batch``, the ends a statement whose reply was lost committed."""
        async with self._host._session() as conn:
            return list(await conn.fetch(_ENDED, [e.seq for e in batch], [e.token for e in batch]))

    async def _end(self, batch: list[_Ending], how_many: int) -> list[Row]:
        """End the attempts of ``batch`` and claim up to ``how_many`` more, in one
        statement: the ended rows and the claimed ones."""
        import asyncpg  # noqa: PLC0415

        async with self._gate.claiming(), self._host._session() as conn:
            try:
                return list(
                    await conn.fetch(
                        _FINISH_AND_CLAIM,
                        [e.seq for e in batch],
                        [e.token for e in batch],
                        [e.outcome for e in batch],
                        [e.decision for e in batch],
                        [e.cause for e in batch],
                        [e.delay for e in batch],
                        [e.failures for e in batch],
                        [e.error for e in batch],
                        self.name,
                        self.node,
                        how_many,
                        self.lease,
                    )
                )
            except lost(asyncpg):
                if how_many:
                    self._orphans = True  # its claims may have committed unheard
                raise

    async def _hold(self, flight: _Flight, env: Envelope) -> Kind | None:
        """Fence a decision: the attempt's lease still holds (extended over the hook's
        budget, so that a loop blocked in the hook does not lose it); the row's kind,
        or None when the lease has lapsed (a reaper decides instead) or the database
        cannot be asked."""
        import asyncpg  # noqa: PLC0415

        budget = self._hook_timeout.budget(env.deadline)
        span = self.lease + (0.0 if budget is None else budget)
        try:
            async with self._host._session() as conn:
                found = await conn.fetchval(_HOLD, flight.row["seq"], flight.token, span)
        except lost(asyncpg):
            return None
        return None if found is None else Kind(found)

    # -- time limits and cancels ---------------------------------------------------------

    def _expire_limits(self, limit: float) -> float:
        return expire_limits((flight.worker for flight in self._flights.values()), limit)

    def _abandoned(self, w: Worker) -> None:
        """A worker cancelled by someone other than envq (the loop closing): its attempt
        ends CANCELLED and is parked or handed back by the lease's reaper."""
        w.abandoned = True


def _ask_to_stop(w: Worker, cause: CancelCause) -> None:
    """Ask the attempt of ``w`` to stop (its code, not its hooks), once."""
    if w.task is not None and w.cancellable and w.cancel_cause is None:
        w.cancel_cause = cause
        w.owed = 1
        w.task.cancel()


#: A ban's relabelling, generated from the tables as the in-process
#: ``Settler.blacklist_type`` reads them: the live envelopes its ``BLACKLIST`` event does
#: not move (an attempt in flight) have their row group relabelled (``RELABEL``); the
#: others move by the trigger's ``envelope_target``, generated from the same table.
_BAN_RELABEL: Final = (
    f"UPDATE envq.envelopes SET kind = '{RELABEL[EnvEvent.BLACKLIST].value}'"
    " WHERE queue = $1 AND type = $2 AND state IN ("
    + ", ".join(
        f"'{s.value}'"
        for s in sorted(LIVE_STATES, key=lambda s: s.value)
        if queue_move(s, EnvEvent.BLACKLIST) is None
    )
    + ")"
)


async def blacklist(conn: _Conn, queue: str, type_: str) -> None:
    """Blacklist a type in the shared queue, in one transaction: its live envelopes are
    stopped, and the attempts of it in flight end STOPPED (their row group is
    relabelled)."""
    async with conn.transaction():
        await conn.execute(
            "UPDATE envq.queues SET blacklist = array_append(blacklist, $2)"
            " WHERE name = $1 AND NOT ($2 = ANY(blacklist))",
            queue,
            type_,
        )
        # The moves first, then the relabelling, each a statement of its own (a new
        # snapshot): an envelope a concurrent claim holds is skipped by the moves once
        # the claim commits it RUNNING, and the relabelling, which starts after that,
        # sees it RUNNING. In the other order a claim committing between the two was
        # READY to the relabelling and RUNNING to the moves: neither touched it.
        await conn.execute(
            "UPDATE envq.envelopes AS e"
            " SET state = envq.envelope_target(e.state, 'blacklist', e.kind, q.state,"
            "   false, NULL, NULL, q.stop_mode, false), event = 'blacklist'"
            " FROM envq.queues AS q WHERE q.name = $1 AND e.queue = $1 AND e.type = $2"
            " AND envq.envelope_target(e.state, 'blacklist', e.kind, q.state, false,"
            "   NULL, NULL, q.stop_mode, false) IS NOT NULL",
            queue,
            type_,
        )
        await conn.execute(_BAN_RELABEL, queue, type_)


#: The end of a StopType attempt (as the finisher ends it), fenced by its token.
_END_STOP_TYPE: Final = f"""
SELECT state::text FROM envq.finish_many(
    ARRAY[$1::bigint], ARRAY[$2::uuid],
    ARRAY['{event_label(Outcome.STOP_TYPE)}'::envq.envelope_event],
    ARRAY[NULL::envq.decision_kind], ARRAY[NULL::envq.cancel_cause],
    ARRAY[0.0::float8], ARRAY[NULL::integer], ARRAY[NULL::jsonb])
"""


async def end_banning(node: Node, row: Row, type_: str, claimed_at: float) -> None:
    """End a StopType attempt and blacklist its type in one transaction (the ban's
    moves first, as in one process), so that no attempt of the type ends as banned
    before the attempt that banned it. Tried again while the database is away, for as
    long as the finisher would (four leases from the claim; then a reaper ends it). If
    the attempt's token no longer holds (a late result), nothing is done: the type is
    not banned either."""
    import asyncpg  # noqa: PLC0415

    pause = 0.05
    while True:
        try:
            async with node._host._db().acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    await blacklist(conn, node.name, type_)
                    ended = await conn.fetchval(_END_STOP_TYPE, row["seq"], row["lease_token"])
                except BaseException:
                    await transaction.rollback()
                    raise
                await (transaction.rollback() if ended is None else transaction.commit())
            break
        except lost(asyncpg) as err:
            if time.monotonic() > claimed_at + node.lease * 4:
                log.error("queue %r: could not end an attempt (%s)", node.name, err)
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
    node.counts_local["finished" if ended else "fenced"] += 1
    if ended:
        node.outcomes[Outcome.STOP_TYPE] = node.outcomes.get(Outcome.STOP_TYPE, 0) + 1
