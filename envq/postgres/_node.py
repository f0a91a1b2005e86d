"""One process's workers on a PostgreSQL queue: claims, attempts, leases, reaping.

:class:`Node` is the working side of :class:`envq.postgres.PgQueue`. Its pump claims
READY envelopes (``envq.claim``: ``FOR UPDATE SKIP LOCKED``, a lease with a fencing
token each) and runs their attempts with envq's attempt runner; the outcome row of
each attempt is performed as far as a node decides (hooks, the failure decision, the
delay of a next run), and the finisher ends the attempts of the moment in one
statement (``envq.finish_and_claim``, which claims their successors too), each fenced
by its token. Three background tasks keep the rest, none waiting for another: the
renewer renews the leases of the tokens the node holds in one statement; the keeper
moves due envelopes, follows the lifecycle row and opens the listening session again
when it was lost; the reaper ends expired attempts of any node (the ``EXPIRED``
outcome). Where each envelope goes is the database's to compute from
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
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

from envq._attempt import Runner, Threads, Worker, expire_limits
from envq._checks import is_async_callable
from envq._config import DeadLetter
from envq._crew import HOSTED
from envq._envelope import Envelope, Stamp
from envq._machine import (
    RELABEL,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueState,
)
from envq._notify import to_dead_letter
from envq._timers import Clock, Deadlines
from envq._values import HookTimeout
from envq.postgres._codec import decode
from envq.postgres._edges import CHANNEL, MAX_NODE_NAME, lost, redact
from envq.postgres._ends import (
    REAP_FLOOR,
    RETIRE_EVERY,
    Ended,
    Reaper,
    decide,
    error_json,
    report,
    spent,
    without_code,
)
from envq.postgres._flights import GAVE_UP, ClaimGate, Ending, Flight, end_each
from envq.postgres._moves import end_banning
from envq.postgres.schema import event_label

if TYPE_CHECKING:
    import asyncpg

__all__ = ["Host", "Node"]

log = logging.getLogger("envq.postgres")


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


_Cause: TypeAlias = BaseException | None


def _node_name() -> str:
    """``<host>-<pid>-<random>``, the host's name cut so that the whole fits
    ``application_name`` (:data:`envq.postgres._edges.MAX_NODE_NAME`)."""
    rest = f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    host = socket.gethostname().encode("ascii", "replace").decode()
    host = "".join(c if c.isprintable() and not c.isspace() else "-" for c in host) or "node"
    return host[: MAX_NODE_NAME - len(rest)] + rest


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
        self._flights: dict[int, Flight] = {}
        self._attempts: set[asyncio.Task[None]] = set()
        self._ending: list[Ending] = []
        self._ending_ready = asyncio.Event()
        #: Attempts running their body or hooks (a slot each; their end may still be
        #: committing).
        self._busy = 0
        self._claim_floor = max(1, workers // 2)
        #: Claims run side by side, adopt alone.
        self._gate = ClaimGate()
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
        #: The loop the node serves on, once known (its attempts' time limits run on it).
        self._clock = Clock()
        self._deadlines = Deadlines(self._clock, self._expire_limits)
        self._runner = Runner(
            host.name,
            stamps,
            hook_timeout,
            Threads(max(1, workers), f"envq-pg-{host.name}"),
            self._clock,
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
        self._clock.use(asyncio.get_running_loop())
        async with self._host._session() as conn:
            await self._reaper_of.reap(conn)

    async def serve(self) -> None:
        self.serving = True
        self._epoch += 1
        self._clock.use(asyncio.get_running_loop())
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
        flight = Flight(row, Worker(self._epoch))
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

        period = min(self.lease / 3, max(self.poll, REAP_FLOOR))
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

    async def _run(self, flight: Flight) -> None:
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
                give_up = flight.claimed_at + self.lease * 4
                await end_banning(self._host._db(), self.name, row, env.type, give_up, self)
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

    def _free(self, flight: Flight) -> None:
        if not flight.freed:
            flight.freed = True
            self._busy -= 1
            self._room.set()

    async def _finish(
        self,
        flight: Flight,
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
        ending = Ending(
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
                retry: list[Ending] = []
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
                            e.done.set_result(GAVE_UP)
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

    async def _committed(self, batch: list[Ending]) -> list[Row]:
        """Of ``batch``, the ends a statement whose reply was lost committed."""
        async with self._host._session() as conn:
            return list(await conn.fetch(_ENDED, [e.seq for e in batch], [e.token for e in batch]))

    async def _end(self, batch: list[Ending], how_many: int) -> list[Row]:
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

    async def _hold(self, flight: Flight, env: Envelope) -> Kind | None:
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
