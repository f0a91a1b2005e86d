"""A DELAYED envelope on a real server becomes READY at its due time, not at the
keeper's next round: the keeper sleeps until the next due time when it comes before
the end of its period.

The node below polls once a second; the envelopes fall due 0.2 s apart over 0.8 s, so a
keeper that only moved them once a period would move most of them late by a large
part of a second. The margin asserted (0.15 s) is generous for a due move.
"""

from __future__ import annotations

import asyncio
import uuid

import pg_jobs
import pytest

import envq
from envq.postgres._queue import PgQueue

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
