"""The pages' source for queues stored in PostgreSQL.

Every read is SQL on ``envq.queues``, ``envq.envelopes`` and ``envq.journal``, through
a small pool of this app's own (sessions named ``envq-web``, so that they are not
taken for a node's), made when first needed. The list of envelopes pages by keyset
on ``seq``, newest first (the primary key's index), so a page costs the same at the
first envelope and the hundred-thousandth. An envelope's page shows its row's
``last_error`` (with the traceback) and ``history`` (its failed attempts) as the nodes
wrote them.

The actions go through :class:`envq.postgres.PgQueue` — the same calls as the Python
API and ``python -m envq.postgres`` (``stop``, ``start``, ``retry``, ``cancel``,
``discard``): the app's own queue when it was given one, else a ``PgQueue(dsn, name,
workers=0)`` connected for the action and closed after it (kept, it would hold a
session named as a node's, which the nodes list would count).

A database that cannot be reached raises :class:`SourceUnavailable` with the driver's
reason, the DSN and its password left out; the next request tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar

from envq._errors import EnvqError
from envq._machine import (
    LIVE_STATES,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    QueueCall,
    QueueState,
)
from envq.postgres._edges import redact
from envq.web._memory import SHOWN
from envq.web._rows import envelope_row, operator_events, queue_row
from envq.web._source import (
    STORED,
    Action,
    AttemptShown,
    Bucket,
    EnvelopeDetail,
    EnvelopePage,
    EnvelopeQuery,
    EnvelopeRow,
    ErrorShown,
    Lease,
    Move,
    NotFound,
    QueueSummary,
    Refused,
    SourceUnavailable,
    not_allowed,
    refused,
)

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres import PgQueue

__all__ = ["PgSource"]

_T = TypeVar("_T")

#: The slices of the ends' chart, and how many (ten minutes).
SLICE: Final = 10
SLICES: Final = 60
#: Seconds an action's stop waits for the queue to be STOPPED before it answers.
STOP_WAIT: Final = 5.0
#: Journal rows shown per envelope.
KEPT_MOVES: Final = 200
_LIVE: Final = [s.value for s in LIVE_STATES]

_COLUMNS: Final = (
    "seq, id::text AS id, type, state::text AS state, kind::text AS kind, attempt,"
    " interval_s, schedule::text AS schedule, cron, cron_tz,"
    " extract(epoch FROM due_at)::float8 AS due,"
    " extract(epoch FROM due_at - updated_at)::float8 AS wait_left, lease_owner"
)


def _epoch(value: dt.datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _schedule(row: Any) -> str:
    if row["cron"] is not None:
        return f"cron {row['cron']} ({row['cron_tz']})"
    if row["interval_s"] > 0:
        return f"every {row['interval_s']:g}s ({row['schedule'].upper()})"
    return ""


def _row(row: Any) -> EnvelopeRow:
    state = EnvState(row["state"])
    due: float | None = None
    note = ""
    if state is EnvState.DELAYED:
        due = row["due"]
    elif state is EnvState.READY:
        note = "ready now"
    elif state is EnvState.RUNNING:
        note = "running"
    elif state in (EnvState.PARKED, EnvState.BUFFERED) and row["wait_left"]:
        note = f"{max(row['wait_left'], 0):.0f} s after the queue starts"
    elif state in (EnvState.PARKED, EnvState.BUFFERED):
        note = "when the queue starts"
    return EnvelopeRow(
        key=row["seq"],
        id="" if row["id"] is None else str(row["id"])[:200],
        type=row["type"],
        state=state,
        kind=row["kind"].upper(),
        attempts=row["attempt"],
        schedule=_schedule(row),
        due=due,
        due_note=note,
        owner=row["lease_owner"] or "",
    )


class PgSource:
    """A :class:`envq.web._source.Source` for the queues of one PostgreSQL database.

    :param dsn: the database; never shown.
    :param only: serve this queue alone (the app of one :class:`PgQueue`).
    :param queue: the :class:`PgQueue` whose calls perform the actions on ``only``.
    """

    kind = "PostgreSQL"

    def __init__(self, dsn: str, *, only: str | None = None, queue: PgQueue | None = None) -> None:
        self._dsn = dsn
        self._only = only
        self._queue = queue
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()

    # -- connections ------------------------------------------------------------------

    def _redact(self, text: str) -> str:
        return redact(self._dsn, text)[:500]

    def _down(self, error: BaseException) -> SourceUnavailable:
        reason = self._redact(str(error))
        return SourceUnavailable(
            f"the database cannot be reached: {type(error).__name__}"
            + (f": {reason}" if reason else "")
        )

    async def _db(self) -> asyncpg.Pool:
        import asyncpg  # noqa: PLC0415 - the postgres extra

        async with self._opening:
            if self._pool is None:
                try:
                    pool = await asyncpg.create_pool(
                        self._dsn,
                        min_size=0,
                        max_size=4,
                        timeout=5,
                        command_timeout=10,
                        server_settings={"application_name": "envq-web"},
                    )
                except (OSError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
                    raise self._down(e) from None
                assert pool is not None
                self._pool = pool
            return self._pool

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[Any]]:
        pool = await self._db()
        async with pool.acquire() as conn:
            yield conn

    async def _read(self, fn: Callable[[Any], Awaitable[_T]]) -> _T:
        """``fn(conn)``, once more on a fresh session when the first one was lost (a
        pooled session dies with a server restart, and is only found dead when used)."""
        import asyncpg  # noqa: PLC0415

        lost = (
            OSError,
            asyncio.TimeoutError,
            asyncpg.InterfaceError,
            asyncpg.PostgresConnectionError,
            asyncpg.exceptions.OperatorInterventionError,
            asyncpg.exceptions.InternalClientError,
        )
        for again in (True, False):
            try:
                async with self._conn() as conn:
                    if await conn.fetchval("SELECT to_regclass('envq.queues')") is None:
                        raise SourceUnavailable(
                            "the database has no envq schema (PgQueue.install() creates it)"
                        )
                    return await fn(conn)
            except lost as error:
                if not again:
                    raise self._down(error) from None
                pool, self._pool = self._pool, None
                if pool is not None:
                    pool.terminate()
        raise AssertionError("unreachable")

    def _names(self, name: str | None) -> tuple[str, list[Any]]:
        if self._only is not None and name is not None and name != self._only:
            raise NotFound(f"there is no queue named {name!r}")
        wanted = self._only if name is None else name
        return ("", []) if wanted is None else (" WHERE name = $1", [wanted])

    # -- Source -----------------------------------------------------------------------

    async def queues(self) -> list[QueueSummary]:
        return await self._summaries(None)

    async def queue(self, name: str) -> QueueSummary:
        found = await self._summaries(name)
        if not found:
            raise NotFound(f"there is no queue named {name!r}")
        return found[0]

    async def _summaries(self, name: str | None) -> list[QueueSummary]:
        where, args = self._names(name)

        async def read(conn: Any) -> list[QueueSummary]:
            queues = await conn.fetch(
                "SELECT name, state::text AS state, capacity, journal, blacklist"
                f" FROM envq.queues{where} ORDER BY name",
                *args,
            )
            if not queues:
                return []
            names = [q["name"] for q in queues]
            # The counts kept with every move (envq.counts): the same cost at any backlog.
            counts = await conn.fetch(
                "SELECT queue, state::text AS state, sum(n)::bigint AS n FROM envq.counts"
                " WHERE queue = ANY($1::text[]) GROUP BY queue, state HAVING sum(n) <> 0",
                names,
            )
            ends = await conn.fetch(
                "SELECT queue, floor(extract(epoch FROM updated_at) / $2)::bigint AS slice,"
                " count(*) FILTER (WHERE state = 'succeeded') AS ok,"
                " count(*) FILTER (WHERE state = 'failed') AS failed"
                " FROM envq.envelopes WHERE queue = ANY($1::text[])"
                " AND state IN ('succeeded', 'failed')"
                " AND updated_at > clock_timestamp() - $3 * interval '1 second'"
                " GROUP BY 1, 2",
                names,
                SLICE,
                SLICE * SLICES,
            )
            leases = await conn.fetch(
                "SELECT queue, lease_owner, count(*) AS n,"
                " extract(epoch FROM min(lease_expires_at))::float8 AS expiry"
                " FROM envq.envelopes WHERE state = 'running' AND queue = ANY($1::text[])"
                " GROUP BY queue, lease_owner ORDER BY queue, lease_owner",
                names,
            )
            now = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
            return self._summarise(queues, counts, ends, leases, now)

        return await self._read(read)

    @staticmethod
    def _summarise(
        queues: list[Any], counts: list[Any], ends: list[Any], leases: list[Any], now: float
    ) -> list[QueueSummary]:
        by: dict[str, dict[EnvState, int]] = {q["name"]: dict.fromkeys(STORED, 0) for q in queues}
        for c in counts:
            by[c["queue"]][EnvState(c["state"])] = c["n"]
        first = int(now // SLICE) - SLICES + 1
        series: dict[str, dict[int, tuple[int, int]]] = {}
        for e in ends:
            series.setdefault(e["queue"], {})[e["slice"]] = (e["ok"], e["failed"])
        held: dict[str, list[Lease]] = {}
        for lease in leases:
            held.setdefault(lease["queue"], []).append(
                Lease(lease["lease_owner"] or "(none)", lease["n"], lease["expiry"])
            )
        out = []
        for q in queues:
            mine = series.get(q["name"], {})
            out.append(
                QueueSummary(
                    name=q["name"],
                    state=QueueState(q["state"]),
                    counts=by[q["name"]],
                    capacity=q["capacity"],
                    series=[
                        Bucket(float(s * SLICE), *mine.get(s, (0, 0)))
                        for s in range(first, first + SLICES)
                    ],
                    leases=held.get(q["name"], []),
                    journal=q["journal"],
                    blacklist=tuple(q["blacklist"]),
                )
            )
        return out

    async def nodes(self) -> list[tuple[str, int, float | None]]:
        """The nodes connected now (sessions named ``envq:<node>``): name, sessions,
        when the first connected."""

        async def read(conn: Any) -> list[tuple[str, int, float | None]]:
            rows = await conn.fetch(
                "SELECT substr(application_name, 6) AS node, count(*) AS n,"
                " extract(epoch FROM min(backend_start))::float8 AS since"
                " FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE 'envq:%' GROUP BY 1 ORDER BY 1"
            )
            return [(r["node"], r["n"], r["since"]) for r in rows]

        return await self._read(read)

    async def _exists(self, conn: Any, name: str) -> None:
        self._names(name)
        if not await conn.fetchval("SELECT EXISTS (SELECT FROM envq.queues WHERE name = $1)", name):
            raise NotFound(f"there is no queue named {name!r}")

    async def envelopes(self, name: str, query: EnvelopeQuery) -> EnvelopePage:
        conditions = ["queue = $1"]
        args: list[Any] = [name]

        def arg(value: Any) -> str:
            args.append(value)
            return f"${len(args)}"

        if query.state is not None:
            conditions.append(f"state = {arg(query.state.value)}::envq.envelope_state")
        if query.type is not None:
            conditions.append(f"type = {arg(query.type)}")
        if query.id is not None:
            # The id as JSON when it reads as JSON (42, "a", [1, 2]), and as a string.
            conditions.append(
                f"(id = to_jsonb({arg(query.id)}::text) OR id::text = {arg(query.id)})"
            )
        if query.scheduled:
            live = arg(_LIVE)
            conditions.append("(interval_s > 0 OR cron IS NOT NULL)")
            conditions.append(f"state = ANY({live}::envq.envelope_state[])")
        order = "DESC"
        if query.after is not None:
            conditions.append(f"seq > {arg(query.after)}")
            order = "ASC"
        elif query.before is not None:
            conditions.append(f"seq < {arg(query.before)}")
        sql = (
            f"SELECT {_COLUMNS} FROM envq.envelopes WHERE {' AND '.join(conditions)}"
            f" ORDER BY seq {order} LIMIT {arg(query.limit + 1)}"
        )

        async def read(conn: Any) -> list[Any]:
            await self._exists(conn, name)
            return list(await conn.fetch(sql, *args))

        found = await self._read(read)
        more = len(found) > query.limit
        rows = [_row(r) for r in found[: query.limit]]
        if query.after is not None:
            rows.reverse()
            newer = rows[0].key if rows and more else None
            return EnvelopePage(rows, rows[-1].key if rows else None, newer)
        older = rows[-1].key if rows and more else None
        newer = rows[0].key if rows and query.before is not None else None
        return EnvelopePage(rows, older, newer)

    async def envelope(self, name: str, key: int) -> EnvelopeDetail:
        async def read(conn: Any) -> tuple[Any, list[Any], bool]:
            await self._exists(conn, name)
            row = await conn.fetchrow(
                f"SELECT {_COLUMNS}, invoke, deadline_s, failures, before_hook, after_hook,"
                " on_success, on_failure, retry::text AS retry, created_at, updated_at,"
                " lease_expires_at, left(jsonb_pretty(payload), $3) AS payload,"
                " length(payload::text) AS payload_length, last_error::text AS last_error,"
                " history::text AS history"
                " FROM envq.envelopes WHERE queue = $1 AND seq = $2",
                name,
                key,
                SHOWN,
            )
            if row is None:
                raise NotFound(f"queue {name!r} has no envelope {key}")
            journal = await conn.fetchval("SELECT journal FROM envq.queues WHERE name = $1", name)
            moves = await conn.fetch(
                "SELECT seq, from_state, to_state, event, decision::text AS decision,"
                " cause::text AS cause, extract(epoch FROM at)::float8 AS at, node"
                " FROM envq.journal WHERE queue = $1 AND seq = $2 ORDER BY n DESC LIMIT $3",
                name,
                key,
                KEPT_MOVES,
            )
            return row, list(reversed(moves)), bool(journal)

        row, journal, on = await self._read(read)
        shown_row = _row(row)
        periodic = row["interval_s"] > 0 or row["cron"] is not None
        base = Kind.PERIODIC if periodic else Kind.ONE_OFF
        moves = [self._move(j, base) for j in journal]
        if row["kind"] == Kind.BLACKLISTED.value:
            # Relabelled while it ran: its last attempt's end was looked up there.
            for i in range(len(journal) - 1, -1, -1):
                if journal[i]["event"].startswith("attempt_"):
                    moves[i] = self._move(journal[i], Kind.BLACKLISTED)
                    break
        fields: list[tuple[str, str]] = [
            ("seq", str(row["seq"])),
            ("id", row["id"] or "(none)"),
            ("type", row["type"] or "(none)"),
            ("state", shown_row.state.name),
            ("kind", shown_row.kind),
            ("attempts", str(row["attempt"])),
            ("failures in a row", str(row["failures"])),
            ("schedule", shown_row.schedule or "one-off"),
            ("deadline", f"{row['deadline_s']:g} s" if row["deadline_s"] else "none"),
            ("retry", row["retry"] or "none"),
            ("invoke", row["invoke"]),
        ]
        for hook in ("before_hook", "after_hook", "on_success", "on_failure"):
            if row[hook]:
                fields.append((hook, row[hook]))
        if row["lease_owner"]:
            fields.append(("lease owner", row["lease_owner"]))
            expiry = row["lease_expires_at"]
            fields.append(("lease expires", expiry.isoformat() if expiry else ""))
        fields += [
            ("created", row["created_at"].isoformat()),
            ("last move", row["updated_at"].isoformat()),
        ]
        length = row["payload_length"] or 0
        note = (
            f"From envq.journal, in the order the database recorded them (the last {KEPT_MOVES})."
            if on
            else "The journal of this queue is off: its moves are not recorded. A "
            "subscription (PgQueue.subscribe) turns it on, as does "
            "UPDATE envq.queues SET journal = true WHERE name = …"
        )
        return EnvelopeDetail(
            row=shown_row,
            fields=fields,
            payload="null" if row["payload"] is None else row["payload"],
            payload_cut=length > SHOWN,
            moves=moves,
            moves_note=note,
            error=_error(row["last_error"]),
            history=_history(row["history"]),
            actions=operator_events(shown_row.state),
        )

    @staticmethod
    def _move(j: Any, kind: Kind) -> Move:
        event: str = j["event"]
        source, to = j["from_state"], j["to_state"]
        outcome = Outcome(event.removeprefix("attempt_")) if event.startswith("attempt_") else None
        decision = DecisionKind(j["decision"]) if j["decision"] else None
        cause = CancelCause(j["cause"]) if j["cause"] else None
        label = outcome.name if outcome is not None else event.upper()
        try:
            from_state = EnvState.NEW if source is None else EnvState(source)
            row = envelope_row(
                from_state,
                EnvState(to),
                outcome=outcome,
                kind=kind,
                decision=decision,
                cause=cause,
                event=None if outcome is not None else _event(event),
            )
        except ValueError:  # a queue's move (seq NULL) never gets here; be safe anyway
            row = queue_row(QueueState(source), QueueState(to), QueueCall(event))
            from_state = EnvState.NEW
        return Move(j["at"], (source or "new").upper(), to.upper(), label, row, j["node"] or "")

    @contextlib.asynccontextmanager
    async def _acting(self, name: str) -> AsyncIterator[PgQueue]:
        """The :class:`PgQueue` whose calls act on queue ``name``: the app's own, or one
        connected for this action (closed after it); its errors as the pages answer
        them (a refusal 409, a database lost 503), without the DSN."""
        from envq.postgres import PgQueue, StoreUnavailable  # noqa: PLC0415

        queue = self._queue
        own = queue is None or queue.name != name
        if own:
            queue = PgQueue(self._dsn, name, workers=0)
        assert queue is not None
        try:
            if own:
                await queue.connect()
            yield queue
        except StoreUnavailable as error:
            raise SourceUnavailable(self._redact(str(error))) from None
        except EnvqError as error:
            raise Refused(self._redact(str(error))) from None
        finally:
            if own:
                await queue.close()

    async def act(self, name: str, action: Action) -> None:
        async def check(conn: Any) -> None:
            await self._exists(conn, name)

        await self._read(check)
        async with self._acting(name) as queue:
            if action is Action.START:
                await queue.start()
            else:
                await queue.stop(wait=False)
                # A stop ends on whichever node sees nothing left to run; with no node
                # serving the queue, the waiting caller is that node. Bounded: the
                # attempts in flight may run long, the page shows the rest.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STOP_WAIT):
                        await queue.wait_stopped()

    async def state_of(self, name: str, key: int) -> EnvState:
        async def read(conn: Any) -> EnvState:
            await self._exists(conn, name)
            state = await conn.fetchval(
                "SELECT state::text FROM envq.envelopes WHERE queue = $1 AND seq = $2",
                name,
                key,
            )
            if state is None:
                raise NotFound(f"queue {name!r} has no envelope {key}")
            return EnvState(state)

        return await self._read(read)

    async def operate(self, name: str, key: int, event: EnvEvent) -> int | None:
        state = await self.state_of(name, key)
        if event not in operator_events(state):
            raise not_allowed(key, state, event)
        from envq.postgres import StoreUnavailable  # noqa: PLC0415

        async with self._acting(name) as queue:
            call = {
                EnvEvent.RETRY: queue.retry,
                EnvEvent.CANCEL: queue.cancel,
                EnvEvent.DISCARD: queue.discard,
            }
            try:
                done = await call[event](seqs=[key])
            except StoreUnavailable:
                raise
            except EnvqError as error:
                raise refused(key, event, error, self._redact) from None
        if not done:
            raise Refused(
                f"the {event.value} of envelope {key} moved nothing (its state changed, "
                "or an envelope with its id is live in the queue)"
            )
        return None if event is EnvEvent.DISCARD else key

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


def _event(label: str) -> EnvEvent | None:
    """The queue-side event a journal's move names (None: not one)."""
    try:
        return EnvEvent(label)
    except ValueError:
        return None


def _error(text: str | None) -> ErrorShown | None:
    """A row's ``last_error`` (``{type, message, traceback}``), as a page shows it."""
    if text is None:
        return None
    error = json.loads(text)
    if not isinstance(error, dict):
        return ErrorShown("(unreadable)", str(error)[:SHOWN])
    return ErrorShown(
        str(error.get("type", "")),
        str(error.get("message", ""))[:SHOWN],
        str(error.get("traceback") or "")[-SHOWN:],
    )


def _history(text: str | None) -> list[AttemptShown]:
    """A row's ``history`` (its failed attempts, oldest first), as a page shows it;
    the outcome is the journal's event label (``attempt_error``), shown as the
    outcome's name (``ERROR``)."""
    if text is None:
        return []
    found = json.loads(text)
    shown = []
    for h in found if isinstance(found, list) else []:
        if not isinstance(h, dict):
            continue
        error = h.get("error")
        what = f"{error.get('type', '')}: {error.get('message', '')}" if error else ""
        started, ended = h.get("started"), h.get("ended")
        shown.append(
            AttemptShown(
                attempt=int(h.get("attempt") or 0),
                outcome=str(h.get("outcome") or "").removeprefix("attempt_").upper(),
                started=float(started) if isinstance(started, int | float) else None,
                ended=float(ended) if isinstance(ended, int | float) else None,
                node=str(h.get("node") or ""),
                error=what[:SHOWN],
            )
        )
    return shown
