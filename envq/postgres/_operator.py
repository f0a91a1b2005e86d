"""An operator's moves on a PostgreSQL queue: cancel, retry, discard, purge.

Each is a statement that names its event (``cancel``, ``retry``) or a delete (a
discard), checked by the database's triggers against the tables, as every other move
is: nothing here writes a state it did not ask ``envq.envelope_target`` for. The
envelopes are named by their ``id`` (the dedup key; for an ended one, the latest row
with that id) or by their row's ``seq`` (what ``python -m envq.postgres list`` shows).

* **cancel**: a live envelope that is not running ends STOPPED; a running one's row
  group is relabelled CANCELLED (its end is STOPPED whatever its outcome, no hook) and
  its node, told at its next renewal, asks the attempt to stop;
* **retry**: an envelope that ended FAILED or STOPPED goes back to READY (BUFFERED
  before the first start), checked as a send is (the lifecycle's SEND row, the
  blacklist, dedup by ``id``, the capacity; all or nothing), keeping its story;
* **discard** / **purge**: ended rows leave the table (by name, or by age).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final

from envq import _checks
from envq._envelope import Envelope
from envq._errors import TypeBlacklisted
from envq._machine import (
    KIND_OF,
    LIFECYCLE,
    LIVE_STATES,
    QUEUE_MOVES,
    RELABEL,
    EnvEvent,
    EnvState,
    LifeAction,
    QueueCall,
    QueueState,
)
from envq.postgres._edges import CHANNEL, check_capacity
from envq.postgres._loop import on_its_loop
from envq.postgres.schema import discardable

if TYPE_CHECKING:
    import asyncpg

__all__ = ["PgOperatorCalls", "keys_of"]

_LIVE: Final = [s.value for s in LIVE_STATES]
_RETRIABLE: Final = [s.value for (s, e) in QUEUE_MOVES if e is EnvEvent.RETRY]
_ENDED: Final = [s.value for s in discardable()]
_CANCEL: Final = EnvEvent.CANCEL.value
_CANCELLED: Final = RELABEL[EnvEvent.CANCEL].value
_RUNNING: Final = EnvState.RUNNING.value
#: The rows an operator names: by id (JSON text) or by seq.
_NAMED: Final = "(e.seq = ANY($2::bigint[]) OR e.id = ANY($3::jsonb[]))"
#: How many ended rows one statement of a purge deletes.
PURGE_BATCH: Final = 10_000


def keys_of(
    where: str, keys: Iterable[object], seqs: Iterable[object]
) -> tuple[list[int], list[str]]:
    """``(seqs, ids as JSON)`` of what an operator named: envelopes (by their ``id``)
    or ids, and row numbers.

    :raises TypeError: a key that is not JSON, an envelope without an ``id``, a seq
        that is not an int.
    """
    ids: list[str] = []
    for named in keys:
        key = named
        if isinstance(named, Envelope):
            if named.id is None:
                raise TypeError(f"{where}: {named.label()} has no id: name it by its row's seq")
            key = named.id
        if not isinstance(key, Hashable):
            raise TypeError(f"{where}: an id must be hashable, got {type(key).__name__}")
        try:
            ids.append(json.dumps(key, separators=(",", ":")))
        except (TypeError, ValueError):
            raise TypeError(f"{where}: an id must be JSON, got {_checks.show(key)}") from None
    numbers = [_checks.integer(f"{where} seqs", seq, minimum=1) for seq in seqs]
    return numbers, ids


class PgOperatorCalls:
    """The calls of :class:`envq.postgres.PgQueue` that act on its envelopes as an
    operator would (part of its public API, kept beside the moves they make)."""

    name: str
    _loop: asyncio.AbstractEventLoop | None

    def _db(self) -> asyncpg.Pool:
        raise NotImplementedError  # PgQueue's own

    async def _operate(self, statements: Callable[[Any], Awaitable[int]]) -> int:
        """Run ``statements`` on a pooled session, in one transaction; their count."""
        async with self._db().acquire() as conn, conn.transaction():
            return await statements(conn)

    @on_its_loop
    async def cancel(self, *ids: object, seqs: Sequence[int] = ()) -> int:
        """Cancel the live envelopes named (by ``id``, an envelope, or a row's ``seq``):
        one not running ends STOPPED; a running one is relabelled (STOPPED whatever its
        attempt's outcome, no hook) and its node asks its attempt to stop. The number
        cancelled."""
        numbers, named = keys_of(f"queue {self.name!r}: cancel()", ids, seqs)

        async def run(conn: Any) -> int:
            moved = await conn.execute(
                "UPDATE envq.envelopes AS e SET state = envq.envelope_target("
                "e.state, $4::envq.envelope_event, e.kind, q.state, false, NULL, NULL,"
                " q.stop_mode, false), event = $4::envq.envelope_event"
                " FROM envq.queues AS q WHERE q.name = e.queue AND e.queue = $1"
                f" AND {_NAMED} AND envq.envelope_target(e.state,"
                " $4::envq.envelope_event, e.kind, q.state, false, NULL, NULL, q.stop_mode,"
                " false) IS NOT NULL",
                self.name,
                numbers,
                named,
                _CANCEL,
            )
            asked = await conn.execute(
                f"UPDATE envq.envelopes AS e SET kind = $4 WHERE e.queue = $1 AND {_NAMED}"
                " AND e.state = 'running' AND e.kind <> $4",
                self.name,
                numbers,
                named,
                _CANCELLED,
            )
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self.name)
            return _count(moved) + _count(asked)

        return await self._operate(run)

    @on_its_loop
    async def retry(self, *ids: object, seqs: Sequence[int] = ()) -> int:
        """Send back envelopes that ended FAILED or STOPPED (named by ``id`` — the
        latest row with it — an envelope, or a row's ``seq``), all or none, checked as
        :meth:`send` checks a batch; each keeps its story. The number sent back (an id
        live again in the queue is a dedup).

        :raises QueueStopping, QueueNotRunning, QueueTerminated, TypeBlacklisted,
            CapacityExceeded: as :meth:`send`.
        """
        numbers, named = keys_of(f"queue {self.name!r}: retry()", ids, seqs)

        async def run(conn: Any) -> int:
            found = await conn.fetchrow(
                "SELECT state, blacklist, capacity FROM envq.queues WHERE name = $1 FOR SHARE",
                self.name,
            )
            if found is None:
                return 0
            state = QueueState(found["state"])
            row = LIFECYCLE[(state, QueueCall.SEND)]
            if row.action is LifeAction.REJECT:
                assert row.error is not None
                raise row.error(f"queue {self.name!r} is {state.value}: retry is rejected")
            rows = await conn.fetch(
                "SELECT e.seq, e.id, e.type, e.interval_s, e.cron FROM envq.envelopes AS e"
                " WHERE e.seq IN (SELECT DISTINCT ON (coalesce(x.id::text, x.seq::text))"
                " x.seq FROM envq.envelopes AS x WHERE x.queue = $1"
                " AND (x.seq = ANY($2::bigint[]) OR x.id = ANY($3::jsonb[]))"
                " AND x.state = ANY($4::envq.envelope_state[])"
                " ORDER BY coalesce(x.id::text, x.seq::text), x.seq DESC)"
                " AND e.state = ANY($4::envq.envelope_state[]) ORDER BY e.seq FOR UPDATE",
                self.name,
                numbers,
                named,
                _RETRIABLE,
            )
            banned = set(found["blacklist"])
            for r in rows:
                if r["type"] and r["type"] in banned:
                    raise TypeBlacklisted(f"queue {self.name!r}: type {r['type']!r} is blacklisted")
            live_ids = {
                x["id"]
                for x in await conn.fetch(
                    "SELECT id FROM envq.envelopes WHERE queue = $1 AND id = ANY($2::jsonb[])"
                    " AND state = ANY($3::envq.envelope_state[])",
                    self.name,
                    [r["id"] for r in rows if r["id"] is not None],
                    _LIVE,
                )
            }
            fresh = [r for r in rows if r["id"] is None or r["id"] not in live_ids]
            if fresh and found["capacity"]:
                await check_capacity(conn, self.name, len(fresh), found["capacity"])
            for r in fresh:
                own = KIND_OF[r["interval_s"] > 0 or r["cron"] is not None].value
                await conn.execute(
                    "UPDATE envq.envelopes AS e SET state = envq.envelope_target(e.state,"
                    " 'retry', e.kind, q.state, false, NULL, NULL, q.stop_mode, false),"
                    " event = 'retry', kind = $2::envq.envelope_kind, due_at = NULL"
                    " FROM envq.queues AS q WHERE q.name = e.queue AND e.seq = $1",
                    r["seq"],
                    own,
                )
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, self.name)
            return len(fresh)

        return await self._operate(run)

    @on_its_loop
    async def discard(self, *ids: object, seqs: Sequence[int] = ()) -> int:
        """Remove ended envelopes (SUCCEEDED, FAILED, STOPPED) named by ``id``, an
        envelope, or a row's ``seq`` from the table; a live one is left alone. The
        number removed."""
        numbers, named = keys_of(f"queue {self.name!r}: discard()", ids, seqs)

        async def run(conn: Any) -> int:
            return _count(
                await conn.execute(
                    f"DELETE FROM envq.envelopes AS e WHERE e.queue = $1 AND {_NAMED}"
                    " AND e.state = ANY($4::envq.envelope_state[])",
                    self.name,
                    numbers,
                    named,
                    _ENDED,
                )
            )

        return await self._operate(run)

    @on_its_loop
    async def purge(self, older_than: float | dt.timedelta) -> int:
        """Remove the queue's ended envelopes whose end is older than ``older_than``
        (seconds or a timedelta), in batches; the number removed."""
        seconds = _checks.seconds(
            f"queue {self.name!r}: purge() older_than", older_than, timedelta=True
        )
        total = 0
        while True:

            async def run(conn: Any) -> int:
                return _count(
                    await conn.execute(
                        "DELETE FROM envq.envelopes WHERE seq IN ("
                        " SELECT seq FROM envq.envelopes WHERE queue = $1"
                        " AND state = ANY($2::envq.envelope_state[])"
                        " AND updated_at < clock_timestamp() - $3 * interval '1 second'"
                        " LIMIT $4)",
                        self.name,
                        _ENDED,
                        seconds,
                        PURGE_BATCH,
                    )
                )

            done = await self._operate(run)
            total += done
            if done < PURGE_BATCH:
                return total


def _count(status: str) -> int:
    """The row count of a command's status (``UPDATE 3``)."""
    return int(status.rsplit(" ", 1)[-1])
