"""An attempt that ends while a stop is being committed lands where the stop leaves it.

A stop's transaction takes the queue's row, then moves its envelopes (the broadcast),
and commits. An end that computed its target from the queue's row as it was before
that commit (RUNNING) and committed after the broadcast had read its row (RUNNING:
left to its attempt) left a retry DELAYED in a stopped queue — no later call moves a
DELAYED envelope of a stopped queue, and a terminate then stranded it (the conformance
driver's clean-up met it: "envelope 114 is delayed: only an ended envelope can be
discarded"). Every end now holds the queue's row before it computes its target.

Here the stop pauses inside its broadcast (a trigger of the test's, in a database of
its own: creating a trigger on a shared one would stall the other tests), and each
way of ending an attempt is tried meanwhile: it waits for the stop, and parks.
"""

from __future__ import annotations

import asyncio
import uuid

import pg_jobs
import pytest
from pg_support import create_database

import envq
from envq.postgres._queue import PgQueue
from envq.postgres._server import ThrowawayServer

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

#: Each way an attempt ends, as the nodes call it: ``$1`` its row, ``$2`` its token,
#: ``$3`` the queue; a failure retried in an hour. The state it ended in.
_ENDS = {
    "finish": (
        "SELECT envq.finish($1, $2, 'attempt_error', 'retry_after', NULL, false,"
        " clock_timestamp() + interval '1 hour')::text WHERE $3::text IS NOT NULL"
    ),
    "finish_many": (
        "SELECT state::text FROM envq.finish_many(ARRAY[$1::bigint], ARRAY[$2::uuid],"
        " ARRAY['attempt_error'::envq.envelope_event],"
        " ARRAY['retry_after'::envq.decision_kind], ARRAY[NULL::envq.cancel_cause],"
        " ARRAY[3600.0::float8], ARRAY[NULL::integer], ARRAY[NULL::jsonb])"
        " WHERE $3::text IS NOT NULL"
    ),
    "finish_and_claim": (
        "SELECT state::text FROM envq.finish_and_claim(ARRAY[$1::bigint], ARRAY[$2::uuid],"
        " ARRAY['attempt_error'::envq.envelope_event],"
        " ARRAY['retry_after'::envq.decision_kind], ARRAY[NULL::envq.cancel_cause],"
        " ARRAY[3600.0::float8], ARRAY[NULL::integer], ARRAY[NULL::jsonb],"
        " $3, 'elsewhere', 0, interval '30 s')"
    ),
    "expire": (
        "SELECT envq.expire($1, $2, 'retry_after', clock_timestamp() + interval '1 hour',"
        " NULL, NULL, NULL)::text WHERE $3::text IS NOT NULL"
    ),
}


@pytest.mark.parametrize("how", sorted(_ENDS))
async def test_an_end_during_a_stop_is_parked_by_it(pg_server: ThrowawayServer, how: str) -> None:
    name = f"stopping-{uuid.uuid4().hex[:10]}"
    database = f"stop_{uuid.uuid4().hex[:8]}"
    await create_database(pg_server, database)
    async with PgQueue(pg_server.dsn(database), name, workers=0, poll=30.0, lease=30.0) as q:
        db = q._db()
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="running"))
        # An expired lease for the reaper's end; a lease that holds for the others.
        lease = "0.001 s" if how == "expire" else "30 s"
        claimed = await db.fetchrow(
            f"SELECT seq, lease_token FROM envq.claim($1, 'elsewhere', 1, interval '{lease}')",
            name,
        )
        # The stop's broadcast has this one to park, and pauses on it.
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="delayed", delay=3600.0))
        await db.execute(
            "CREATE FUNCTION envq.a_pause() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN PERFORM pg_sleep(0.5); RETURN NEW; END $$;"
            " CREATE TRIGGER a_pause BEFORE UPDATE ON envq.envelopes FOR EACH ROW"
            " WHEN (NEW.event = 'stop') EXECUTE FUNCTION envq.a_pause()"
        )
        stopping = asyncio.create_task(q.stop(envq.StopMode.STOP, wait=False))
        await asyncio.sleep(0.2)  # the stop is in its broadcast, paused
        async with db.acquire() as ender:
            ended = await ender.fetchval(_ENDS[how], claimed["seq"], claimed["lease_token"], name)
        await stopping
        rows = {
            r["id"]: r["state"]
            for r in await db.fetch(
                "SELECT id #>> '{}' AS id, state::text AS state FROM envq.envelopes"
                " WHERE queue = $1",
                name,
            )
        }
    # Before: the end read the queue RUNNING, and its retry stayed DELAYED.
    assert ended == "parked"
    assert rows == {"running": "parked", "delayed": "parked"}
