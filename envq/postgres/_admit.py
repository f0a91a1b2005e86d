"""A send's statements on PostgreSQL, in its transaction: the queue's row read under a
share lock (its lifecycle state, its banned types, its capacity), the lifecycle
table's verdict on the send, the capacity rule, and one INSERT of the whole batch,
each row in the state the tables lead a send to; then a NOTIFY, heard by the nodes
at the commit.

:class:`envq.postgres.PgQueue` calls :func:`admit_alone` (a transaction of its own,
whose lost COMMIT it then resolves) or :func:`admit_within` (the caller's
transaction, under a savepoint).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from envq._errors import QueueNotRunning, TypeBlacklisted
from envq._machine import (
    INITIAL,
    LIFECYCLE,
    LIVE_STATES,
    QUEUE_MOVES,
    Arrival,
    EnvEvent,
    Kind,
    LifeAction,
    QueueCall,
    QueueState,
)
from envq.postgres._codec import Encoded, first_wait
from envq.postgres._edges import CHANNEL, CommitUnheard, check_room, lost

if TYPE_CHECKING:
    import asyncpg

__all__ = ["admit_alone", "admit_within"]

#: A pooled connection, as the pool lends it.
_Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"

_SEND_TARGETS: Final = QUEUE_MOVES[(INITIAL, EnvEvent.SEND)].targets
#: The lifecycle action of a send, by the arrival it leads to.
_ARRIVAL: Final[Mapping[LifeAction, Arrival]] = {
    LifeAction.BUFFER: Arrival.BUFFER,
    LifeAction.ADMIT: Arrival.NOW,
}

_LIVE: Final = ", ".join(f"'{s.value}'" for s in sorted(LIVE_STATES, key=lambda s: s.value))

#: The send's instant, read once: the rows' time of arrival and what their due times
#: are measured from.
_NOW: Final = "now_ AS MATERIALIZED (SELECT clock_timestamp() AS t)"
#: With ids ($19, the batch's), the live envelopes of those ids are locked first (FOR
#: SHARE, found through the dedup index): one whose end is committing is waited for,
#: and is no longer live after it; one that is live stays live until the send commits,
#: so its row is a dedup (ON CONFLICT DO NOTHING). The instant is read after that: a
#: send is never timed before the end of an envelope it follows. The rows are locked
#: in seq order, as a batched end and a renewal lock theirs (no deadlock with either),
#: each found by an index probe per id and locked by its key: lateral subqueries the
#: planner cannot flatten into a join that scans the whole queue.
_HELD_NOW: Final = f"""held AS MATERIALIZED (
    SELECT h.seq
      FROM (SELECT p.seq FROM unnest($19::text[]) AS k(id),
                   LATERAL (SELECT e.seq FROM envq.envelopes AS e
                             WHERE e.queue = $1 AND e.id = k.id::jsonb
                               AND e.state IN ({_LIVE}) OFFSET 0) AS p
             ORDER BY p.seq) AS s,
           LATERAL (SELECT e.seq FROM envq.envelopes AS e
                     WHERE e.seq = s.seq AND e.state IN ({_LIVE})
                       FOR SHARE) AS h),
now_ AS MATERIALIZED (SELECT clock_timestamp() AS t FROM (SELECT count(*) FROM held) AS h)"""
_INSERT: Final = """
WITH {now}
INSERT INTO envq.envelopes
    (queue, id, type, invoke, payload, kind, state, event, interval_s, schedule,
     deadline_s, before_hook, after_hook, on_success, on_failure, retry, due_at, origin_at,
     wait, cron, cron_tz, updated_at)
SELECT $1, u.id::jsonb, u.type, u.invoke, u.payload::jsonb, u.kind::envq.envelope_kind,
       u.state::envq.envelope_state, 'send', u.interval_s, u.schedule::envq.schedule,
       u.deadline_s, u.before_hook, u.after_hook, u.on_success, u.on_failure,
       u.retry::jsonb, n.t + u.delay * interval '1 second',
       n.t + u.delay * interval '1 second', u.delay > 0, u.cron, u.cron_tz, n.t
  FROM now_ AS n, unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
              $8::float8[], $9::text[], $10::float8[], $11::text[], $12::text[],
              $13::text[], $14::text[], $15::text[], $16::float8[], $17::text[], $18::text[])
       WITH ORDINALITY
       AS u(id, type, invoke, payload, kind, state, interval_s, schedule, deadline_s,
            before_hook, after_hook, on_success, on_failure, retry, delay, cron, cron_tz, n)
 ORDER BY u.n
ON CONFLICT DO NOTHING
"""
_INSERT_PLAIN: Final = _INSERT.replace("{now}", _NOW)
_INSERT_IDS: Final = _INSERT.replace("{now}", _HELD_NOW)


async def admit_within(conn: _Conn, name: str, rows: Sequence[Encoded]) -> tuple[int, int]:
    """A send inside the caller's transaction, under a savepoint (a refusal leaves the
    caller's transaction usable): the number admitted and the queue's capacity."""
    async with conn.transaction():
        admitted, _, capacity = await _admit(conn, name, rows, caller=True)
    return admitted, capacity


async def admit_alone(
    session: Callable[[], AbstractAsyncContextManager[_Conn]], name: str, rows: Sequence[Encoded]
) -> tuple[int, int]:
    """A send in a transaction of its own: the number admitted and the capacity.

    :raises CommitUnheard: the connection was lost after COMMIT was sent.
    """
    import asyncpg  # noqa: PLC0415

    admitted, xid = -1, ""
    try:
        async with session() as conn, conn.transaction():
            admitted, xid, capacity = await _admit(conn, name, rows)
    except lost(asyncpg):
        if admitted < 0:
            raise  # lost before COMMIT: the server rolls the transaction back
        raise CommitUnheard(xid, admitted) from None
    return admitted, capacity


async def _admit(
    conn: _Conn, name: str, rows: Sequence[Encoded], *, caller: bool = False
) -> tuple[int, str, int]:
    """The statements of a send, in its transaction: the number of rows inserted, the
    transaction's id, and the queue's capacity as its row says now. ``caller``: the
    transaction is the caller's (a transactional send), whose isolation is checked
    where the capacity needs it."""
    found = await conn.fetchrow(
        "SELECT state, blacklist, capacity,"
        " extract(epoch FROM clock_timestamp())::float8 AS now,"
        " current_setting('transaction_isolation') AS isolation"
        " FROM envq.queues WHERE name = $1 FOR SHARE",
        name,
    )
    if found is None:
        raise QueueNotRunning(f"queue {name!r} does not exist")
    if caller and found["capacity"] and found["isolation"] != "read committed":
        # The room is read from counts the transaction's snapshot may predate.
        raise ValueError(
            f"queue {name!r}: send(connection=...) to a queue with a capacity needs a READ"
            f" COMMITTED transaction (this one is {found['isolation']})"
        )
    state = QueueState(found["state"])
    row = LIFECYCLE[(state, QueueCall.SEND)]
    if row.action is LifeAction.REJECT:
        assert row.error is not None
        raise row.error(f"queue {name!r} is {state.value}: send is rejected")
    banned = set(found["blacklist"])
    for enc in rows:
        if enc.type and enc.type in banned:
            raise TypeBlacklisted(f"queue {name!r}: type {enc.type!r} is blacklisted")
    capacity = found["capacity"]
    if capacity:
        await check_room(conn, name, rows, capacity)
    arrival = _ARRIVAL[row.action]
    if arrival is Arrival.NOW:  # a calendar's first run: its first fire from now on
        rows = [first_wait(enc, found["now"]) for enc in rows]
    states = [
        _SEND_TARGETS[Arrival.LATER if arrival is Arrival.NOW and enc.delay > 0 else arrival].value
        for enc in rows
    ]
    # Not in a caller's transaction: the lock would last as long as it does, and a
    # running envelope's lease renewals and end would wait for it.
    ids = [] if caller else [e.id for e in rows if e.id is not None]
    status = await conn.execute(
        _INSERT_IDS if ids else _INSERT_PLAIN,
        name,
        [e.id for e in rows],
        [e.type for e in rows],
        [e.invoke for e in rows],
        [e.payload for e in rows],
        [(Kind.PERIODIC if e.periodic else Kind.ONE_OFF).value for e in rows],
        states,
        [e.interval for e in rows],
        [e.schedule for e in rows],
        [e.deadline for e in rows],
        [e.hooks[0] for e in rows],
        [e.hooks[1] for e in rows],
        [e.hooks[2] for e in rows],
        [e.hooks[3] for e in rows],
        [e.retry for e in rows],
        [e.delay for e in rows],
        [e.cron for e in rows],
        [e.cron_tz for e in rows],
        *((ids,) if ids else ()),
    )
    xid = await conn.fetchval(
        "SELECT pg_current_xact_id()::text FROM pg_notify($1, $2)", CHANNEL, name
    )
    return int(status.rsplit(" ", 1)[-1]), str(xid), capacity
