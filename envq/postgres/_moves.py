"""Moves of many envelopes of a queue at once, on PostgreSQL, beside the ones the
schema's ``envq.broadcast`` makes: a type's ban (the queue's list of banned types,
the moves of the type's live envelopes by the tables' ``BLACKLIST`` event and the
relabelling of its attempts in flight, in one transaction; with the end of the
StopType attempt that banned it when the ban is an attempt's, :func:`end_banning`),
and a start's arming of calendar envelopes with the wait to their first fire
(:func:`arm_calendars`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeAlias

from envq._machine import LIVE_STATES, RELABEL, EnvEvent, EnvState, Outcome, moved_by, queue_move
from envq.postgres._codec import calendar, fire_wait
from envq.postgres._edges import lost
from envq.postgres._sql import LOCK_QUEUE
from envq.postgres.schema import event_label

if TYPE_CHECKING:
    import asyncpg

__all__ = ["arm_calendars", "blacklist", "end_banning"]

log = logging.getLogger("envq.postgres")

#: A pooled connection, as the pool lends it.
_Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"
#: A row of ``envq.envelopes`` as the driver returns it.
Row = Any


class Counts(Protocol):
    """Where a node counts its ends: by how they went, and by outcome."""

    counts_local: dict[str, int]
    outcomes: dict[Outcome, int]


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
        await conn.execute(LOCK_QUEUE, queue)  # the ends in progress first
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


#: How long a ban waits for a lock before it gives way and is tried again.
_BAN_WAIT_MS: Final = 200

#: The end of a StopType attempt (as the finisher ends it), fenced by its token.
_END_STOP_TYPE: Final = f"""
SELECT state::text FROM envq.finish_many(
    ARRAY[$1::bigint], ARRAY[$2::uuid],
    ARRAY['{event_label(Outcome.STOP_TYPE)}'::envq.envelope_event],
    ARRAY[NULL::envq.decision_kind], ARRAY[NULL::envq.cancel_cause],
    ARRAY[0.0::float8], ARRAY[NULL::integer], ARRAY[NULL::jsonb])
"""


async def end_banning(
    db: asyncpg.Pool, queue: str, row: Row, type_: str, give_up: float, counts: Counts
) -> None:
    """End a StopType attempt and blacklist its type in one transaction (the ban's
    moves first, as in one process), so that no attempt of the type ends as banned
    before the attempt that banned it. Tried again while the database is away, until
    ``give_up`` (``time.monotonic()``; the finisher's four leases from the claim: then a
    reaper ends it). If the attempt's token no longer holds (a late result), nothing is
    done: the type is not banned either.

    The end is counted in ``counts`` (the node's): ``finished`` or ``fenced``, and
    its outcome.
    """
    import asyncpg  # noqa: PLC0415

    pause = 0.05
    while True:
        try:
            async with db.acquire() as conn:
                transaction = conn.transaction()
                await transaction.start()
                try:
                    # Yields to a reaper sooner than the deadlock detector would pick
                    # one of the two (see below).
                    await conn.execute(f"SET LOCAL lock_timeout = '{_BAN_WAIT_MS}ms'")
                    await blacklist(conn, queue, type_)
                    ended = await conn.fetchval(_END_STOP_TYPE, row["seq"], row["lease_token"])
                except BaseException:
                    await transaction.rollback()
                    raise
                await (transaction.rollback() if ended is None else transaction.commit())
            break
        except lost(asyncpg, asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError) as err:
            # A reaper holds a running row of the type while its on_failure decides,
            # then waits for the queue's lock this ban holds, while the ban waits for
            # that row: the ban gives up its locks after _BAN_WAIT_MS (well before the
            # deadlock detector's second would end one of the two, maybe the reaper's,
            # which would have to decide again) and is tried again, as after a lost
            # session.
            if time.monotonic() > give_up:
                log.error("queue %r: could not end an attempt (%s)", queue, err)
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
    counts.counts_local["finished" if ended else "fenced"] += 1
    if ended:
        counts.outcomes[Outcome.STOP_TYPE] = counts.outcomes.get(Outcome.STOP_TYPE, 0) + 1


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
