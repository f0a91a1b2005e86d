"""A DELAYED envelope on a real server becomes READY at its due time, not at the
keeper's next round: the keeper sleeps until the next due time when it comes before
the end of its period.

The node below polls once a second; the envelopes fall due 0.2 s apart over 0.8 s, so a
keeper that only moved them once a period would move most of them late by a large
part of a second. The margin asserted (0.15 s) is generous for a due move.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import pg_jobs
import pytest
from pg_support import create_database

import envq
from envq.postgres import _ends
from envq.postgres._queue import PgQueue
from envq.postgres._server import ThrowawayServer

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

DELAYS = {"d0": 1.5, "d1": 1.7, "d2": 1.9, "d3": 2.1, "d4": 2.3}

_MOVES = """
SELECT e.id #>> '{}' AS id, j.to_state, j.event, extract(epoch FROM j.at)::float8 AS at
  FROM envq.journal AS j JOIN envq.envelopes AS e ON e.seq = j.seq
 WHERE j.queue = $1 ORDER BY j.n
"""


async def test_a_delayed_envelope_becomes_ready_at_its_due_time(pg_dsn: str) -> None:
    name = f"due-{uuid.uuid4().hex[:10]}"
    async with PgQueue(pg_dsn, name, workers=1, poll=1.0, lease=30.0) as q:
        db = q._db()
        await db.execute("UPDATE envq.queues SET journal = true WHERE name = $1", name)
        await q.start()
        for env_id, delay in DELAYS.items():
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id=env_id, delay=delay))
        async with asyncio.timeout(10):
            while (await q.counts()).get("succeeded", 0) < len(DELAYS):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        rows = await db.fetch(_MOVES, name)
        await q.terminate()
    delayed = {r["id"]: r["at"] for r in rows if r["to_state"] == "delayed"}
    late = {
        r["id"]: round(r["at"] - delayed[r["id"]] - DELAYS[r["id"]], 3)
        for r in rows
        if r["event"] == "due"
    }
    assert set(late) == set(DELAYS)
    # Not a poll (1 s) late: at its due time, give or take a loaded machine's delay.
    assert all(-0.01 <= s <= 0.5 for s in late.values()), late


# -- one instant per move ------------------------------------------------------------------

#: Each move into DELAYED, with the instant its due time was measured from: the
#: journal's time of the move must be that instant, to the microsecond, or a due move
#: looks early (or late) from the journal by the time between two readings of the clock.
_DELAYED_MOVES = """
SELECT e.id #>> '{}' AS id, j.event, e.due_at - j.at AS wait
  FROM envq.journal AS j JOIN envq.envelopes AS e ON e.seq = j.seq
 WHERE j.queue = $1 AND j.to_state = 'delayed'
   AND j.n = (SELECT max(k.n) FROM envq.journal AS k WHERE k.seq = j.seq)
 ORDER BY e.id #>> '{}'
"""


async def test_a_move_into_delayed_is_journalled_at_the_instant_its_due_time_counts_from(
    pg_dsn: str,
) -> None:
    name = f"instant-{uuid.uuid4().hex[:10]}"
    far = envq.Retry(attempts=3, base=40.0, cap=40.0, jitter=False)
    async with PgQueue(pg_dsn, name, workers=1, poll=0.2, lease=30.0) as q:
        db = q._db()
        await db.execute("UPDATE envq.queues SET journal = true WHERE name = $1", name)
        # Sent to a stopped queue: armed by the start's broadcast, from the start's instant.
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="armed", delay=50.0))
        await q.start()
        # Sent to a running queue: delayed from the send's instant.
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="sent", delay=60.0))
        # Its attempt fails: the end delays it by the Retry's backoff, from the end's.
        await q.send(envq.Envelope(invoke=pg_jobs.fail, id="retried-later", retry=far))
        async with asyncio.timeout(10):
            while (await q.counts()).get("delayed", 0) < 3:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        # An expired attempt's end (the reaper's statement), from the expiry's instant:
        # sent, claimed with no lease and expired in one transaction (the node's own
        # workers and reaper never see it before).
        async with db.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
                " VALUES ($1, '\"expired\"', 'pg_jobs:noop', 'one_off', 'ready', 'send')",
                name,
            )
            row = await conn.fetchrow(
                "SELECT seq, lease_token FROM envq.claim($1, 'elsewhere', 1, interval '0 s')",
                name,
            )
            ended = await conn.fetchval(
                _ends._EXPIRE, row["seq"], row["lease_token"], "retry_after", 70.0, None, None
            )
        assert ended == "delayed"
        rows = await db.fetch(_DELAYED_MOVES, name)
        await q.terminate()
    waits = {r["id"]: (r["event"], r["wait"]) for r in rows}
    assert waits == {
        "armed": ("start", dt.timedelta(seconds=50)),
        "expired": ("attempt_expired", dt.timedelta(seconds=70)),
        "retried-later": ("attempt_error", dt.timedelta(seconds=40)),
        "sent": ("send", dt.timedelta(seconds=60)),
    }


async def test_a_stop_that_waited_for_a_move_is_journalled_after_it(pg_dsn: str) -> None:
    """A stop's broadcast reads the clock when it starts; one of its rows may be moved
    by another session meanwhile (here: a due move holding the row), and the stop's
    park then comes after that move. Its time must too: an envelope's moves never go
    back in time in the journal (the stop is stamped when it moves the row)."""
    name = f"order-{uuid.uuid4().hex[:10]}"
    async with PgQueue(pg_dsn, name, workers=0, poll=30.0, lease=30.0) as q:
        db = q._db()
        await db.execute("UPDATE envq.queues SET journal = true WHERE name = $1", name)
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="held", delay=600.0))
        seq = await db.fetchval("SELECT seq FROM envq.envelopes WHERE queue = $1", name)
        async with db.acquire() as mover:
            holding = mover.transaction()
            await holding.start()
            await mover.execute("SELECT FROM envq.envelopes WHERE seq = $1 FOR UPDATE", seq)
            stopping = asyncio.create_task(q.stop(envq.StopMode.STOP))
            await asyncio.sleep(0.3)  # the stop's broadcast waits for the row
            await mover.execute(
                "UPDATE envq.envelopes SET state = 'ready', event = 'due' WHERE seq = $1", seq
            )
            await holding.commit()
        await stopping
        rows = await db.fetch(
            "SELECT to_state, extract(epoch FROM at)::float8 AS at FROM envq.journal"
            " WHERE seq = $1 ORDER BY n",
            seq,
        )
    assert [r["to_state"] for r in rows] == ["delayed", "ready", "parked"]
    times = [r["at"] for r in rows]
    assert times == sorted(times), times


async def test_a_send_that_waited_for_an_end_of_its_id_is_journalled_after_it(
    pg_server: ThrowawayServer,
) -> None:
    """A send of an ``id`` whose live envelope is ending in another transaction waits
    for that end (the dedup index), and is admitted after it or is a dedup; its moves
    are never journalled before the end they waited for (the conformance check saw "an
    attempt ended that never started": the new stay's admission timed before the old
    stay's end). Here the send pauses inside its statement (a trigger of the test's,
    before envq's) while the end commits. In a database of its own: creating and
    dropping a trigger on the envelopes table would stall the other tests' statements
    on a shared one."""
    name = f"resend-{uuid.uuid4().hex[:10]}"
    database = f"pause_{uuid.uuid4().hex[:8]}"
    await create_database(pg_server, database)
    pg_dsn = pg_server.dsn(database)
    async with PgQueue(pg_dsn, name, workers=0, poll=30.0, lease=30.0) as q:
        db = q._db()
        await db.execute("UPDATE envq.queues SET journal = true WHERE name = $1", name)
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
        claimed = await db.fetchrow(
            "SELECT seq, lease_token FROM envq.claim($1, 'elsewhere', 1, interval '30 s')", name
        )
        pause = f"a_pause_{name.replace('-', '_')}"
        await db.execute(
            f"CREATE FUNCTION envq.{pause}() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(0.5); RETURN NEW; END $$;"
            f" CREATE TRIGGER {pause} BEFORE INSERT ON envq.envelopes FOR EACH ROW"
            f" WHEN (NEW.queue = '{name}') EXECUTE FUNCTION envq.{pause}()"
        )
        try:
            sending = asyncio.create_task(q.send(envq.Envelope(invoke=pg_jobs.noop, id="x")))
            await asyncio.sleep(0.2)  # the send is in its statement, paused
            async with db.acquire() as ender, ender.transaction():
                ended = await ender.fetch(
                    "SELECT * FROM envq.finish_many(ARRAY[$1::bigint], ARRAY[$2::uuid],"
                    " ARRAY['attempt_ok'::envq.envelope_event], ARRAY[NULL::envq.decision_kind],"
                    " ARRAY[NULL::envq.cancel_cause], ARRAY[0.0::float8], ARRAY[NULL::integer],"
                    " ARRAY[NULL::jsonb])",
                    claimed["seq"],
                    claimed["lease_token"],
                )
                await asyncio.sleep(0.5)  # the send's insert waits for this commit
            admitted = await sending
        finally:
            await db.execute(
                f"DROP TRIGGER {pause} ON envq.envelopes; DROP FUNCTION envq.{pause}()"
            )
        rows = await db.fetch(
            "SELECT j.n, j.seq, j.to_state, extract(epoch FROM j.at)::float8 AS at"
            " FROM envq.journal AS j WHERE j.queue = $1 AND j.seq IS NOT NULL ORDER BY j.n",
            name,
        )
    assert [r["state"] for r in ended] == ["succeeded"]
    # Each stay admitted is journalled once, a dedup never.
    stays = {r["seq"] for r in rows}
    assert len(stays) == 1 + admitted
    assert sum(
        1
        for r in rows
        if r["to_state"] == "ready" and r["n"] == min(k["n"] for k in rows if k["seq"] == r["seq"])
    ) == len(stays)
    by_time = sorted(rows, key=lambda r: (r["at"], r["n"]))
    assert [r["n"] for r in by_time] == [r["n"] for r in rows], [
        (r["seq"], r["to_state"], round(r["at"] % 100, 4)) for r in by_time
    ]


async def test_a_send_locks_the_live_rows_of_its_ids_in_the_order_an_end_does(
    pg_dsn: str,
) -> None:
    """A batched end locks its rows in seq order; a send of ids takes its locks on the
    live rows of those ids in the same order, whatever the order of the ids, so the
    two never wait for each other both ways (a deadlock, one of them refused)."""
    name = f"order-ids-{uuid.uuid4().hex[:10]}"
    async with PgQueue(pg_dsn, name, workers=0, poll=30.0, lease=30.0) as q:
        db = q._db()
        await q.start()
        await q.send(
            envq.Envelope(invoke=pg_jobs.noop, id="first"),
            envq.Envelope(invoke=pg_jobs.noop, id="second"),
        )
        seqs = [
            r["seq"]
            for r in await db.fetch(
                "SELECT seq FROM envq.envelopes WHERE queue = $1 ORDER BY seq", name
            )
        ]
        async with db.acquire() as ender, ender.transaction():
            # As an end of both would: the lower seq first.
            await ender.execute("SELECT FROM envq.envelopes WHERE seq = $1 FOR UPDATE", seqs[0])
            # The ids in the other order: locked in that order, the send would hold the
            # second row while it waits for the first.
            sending = asyncio.create_task(
                q.send(
                    envq.Envelope(invoke=pg_jobs.noop, id="second"),
                    envq.Envelope(invoke=pg_jobs.noop, id="first"),
                )
            )
            await asyncio.sleep(0.3)
            await ender.execute("SET LOCAL lock_timeout = '3s'")
            await ender.execute("SELECT FROM envq.envelopes WHERE seq = $1 FOR UPDATE", seqs[1])
        assert await sending == 0  # both live: a dedup of each
