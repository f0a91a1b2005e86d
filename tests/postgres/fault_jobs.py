"""The job the node processes of the fault tests run (imported by name, ``fault_jobs``).

Each attempt records itself in the table ``fault_runs`` of the test's database, through
a pool of its own (``$ENVQ_DSN``): the envelope's row, its attempt number and the lease
token it runs under (read from the row, which the node holds), the node (from
``$ENVQ_FAULT_NODE``), and its start and end on the database's clock, so that the test
can compare what ran with what the database committed.

The payload says what the attempt does: ``queue`` (the queue's name, to find the row),
``sleep`` (seconds of work), ``gate`` (wait until the test opens the gate of this
envelope's id in ``fault_gates``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from typing import Any

import asyncpg

_pool: asyncpg.Pool | None = None


async def _db() -> asyncpg.Pool:
    global _pool  # noqa: PLW0603 - one pool per node process
    if _pool is None:
        pool = await asyncpg.create_pool(
            os.environ["ENVQ_DSN"],
            min_size=0,
            max_size=4,
            server_settings={"application_name": "fault-job"},
        )
        if _pool is None:
            _pool = pool
        else:
            await pool.close()
    return _pool


async def work(env: Any) -> None:
    """One attempt: record its start, work (sleep, or wait for the gate), record its end
    (``ok``; ``cancelled`` when it was cut short)."""
    spec = env.payload
    node = os.environ["ENVQ_FAULT_NODE"]
    db = await _db()
    run = await db.fetchval(
        "INSERT INTO fault_runs (queue, key, seq, attempt, token, node, started_at)"
        " SELECT e.queue, $2, e.seq, e.attempt, e.lease_token, $3, clock_timestamp()"
        "   FROM envq.envelopes AS e"
        "  WHERE e.queue = $1 AND e.id = $4::jsonb AND e.state = 'running'"
        "    AND regexp_replace(e.lease_owner, '#[0-9a-f]{8}$', '') = $3"
        " RETURNING run",
        spec["queue"],
        env.id,
        node,
        json.dumps(env.id),
    )
    if run is None:
        raise RuntimeError(f"{env.id!r}: no running row held by {node!r}")
    try:
        if spec.get("gate"):
            while not await db.fetchval(  # noqa: ASYNC110 - the gate is a row of another process
                "SELECT EXISTS (SELECT FROM fault_gates WHERE key = $1)", env.id
            ):
                await asyncio.sleep(0.05)
        await asyncio.sleep(float(spec.get("sleep", 0.0)))
        # Not recorded, not done: the attempt fails (and its policy decides).
        await _end(db, run, "ok")
    except BaseException:
        with contextlib.suppress(Exception):
            await _end(db, run, "cancelled")
        raise


async def _end(db: asyncpg.Pool, run: int, how: str) -> None:
    await db.execute(
        "UPDATE fault_runs SET ended_at = clock_timestamp(), how = $2 WHERE run = $1", run, how
    )
