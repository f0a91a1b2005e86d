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
import time
from typing import Any

import asyncpg

import envq

_pool: asyncpg.Pool | None = None


async def _db() -> asyncpg.Pool:
    global _pool  # noqa: PLW0603 - one pool per node process
    if _pool is None:
        pool = await asyncpg.create_pool(
            os.environ["ENVQ_DSN"],
            min_size=0,
            max_size=4,
            server_settings={"application_name": "fault-job"},
            # Named prepared statements do not survive a pooler in transaction mode
            # (the pooler tests run the jobs through PgBouncer).
            statement_cache_size=0,
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


async def blocking(env: Any) -> None:
    """An attempt that blocks its node's loop for ``block`` seconds (a stall no
    renewal can run through; only on the node ``stall_on`` names, when given), then
    fails if ``fail`` is set."""
    where = env.payload.get("stall_on")
    if where is None or where == os.environ["ENVQ_FAULT_NODE"]:
        time.sleep(float(env.payload["block"]))  # noqa: ASYNC251 - the stall is the point
    if env.payload.get("fail"):
        raise RuntimeError("failed after the stall")


async def _hook(env: Any, hook: str, cause: BaseException | None) -> None:
    db = await _db()
    await db.execute(
        "INSERT INTO fault_hooks (queue, key, node, hook, cause) VALUES ($1, $2, $3, $4, $5)",
        env.payload["queue"],
        env.id,
        os.environ["ENVQ_FAULT_NODE"],
        hook,
        None if cause is None else type(cause).__name__,
    )


async def success_recorded(env: Any) -> None:
    """``on_success``: records its call in ``fault_hooks``."""
    await _hook(env, "on_success", None)


async def failure_recorded(env: Any, cause: BaseException | None, attempt: int) -> envq.Decision:
    """``on_failure``: records its call (and its cause's type), then drops; after
    ``hook_sleep`` seconds when the payload says so."""
    await _hook(env, "on_failure", cause)
    await asyncio.sleep(float(env.payload.get("hook_sleep", 0.0)))
    return envq.drop()
