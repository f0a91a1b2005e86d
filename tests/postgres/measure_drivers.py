"""Round trips per second of psycopg 3 and asyncpg against a throwaway local server.

Not a test (pytest does not collect it): the measurement behind the choice of driver
recorded in docs/decisions.md. Each job is three statements, each its own
transaction, as a worker's would be: insert a row, claim it (``FOR UPDATE SKIP
LOCKED``), mark it done. Needs both drivers (``pip install asyncpg "psycopg[binary]"``;
only asyncpg is in the extras). Run: ``python -m tests.postgres.measure_drivers [N]
[ROUNDS]``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import asyncpg
import psycopg

from envq.postgres._server import ThrowawayServer

SETUP = "CREATE TABLE IF NOT EXISTS jobs (id bigserial PRIMARY KEY, state text, payload jsonb)"
INSERT = "INSERT INTO jobs (state, payload) VALUES ('ready', $1::jsonb)"
CLAIM = """UPDATE jobs SET state = 'running' WHERE id = (
    SELECT id FROM jobs WHERE state = 'ready' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED
) RETURNING id"""
DONE = "UPDATE jobs SET state = 'done' WHERE id = $1"


async def with_asyncpg(dsn: str, n: int) -> float:
    """Jobs per second through asyncpg (prepared statements, binary protocol)."""
    conn = await asyncpg.connect(dsn)
    await conn.execute(SETUP)
    await conn.execute("TRUNCATE jobs")
    start = time.perf_counter()
    for _ in range(n):
        await conn.execute(INSERT, '{"a": 1}')
        job = await conn.fetchval(CLAIM)
        await conn.execute(DONE, job)
    elapsed = time.perf_counter() - start
    await conn.close()
    return n / elapsed


async def with_psycopg(dsn: str, n: int) -> float:
    """Jobs per second through psycopg 3 (async, autocommit, server-side prepared)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, prepare_threshold=0)
    await conn.execute(SETUP)
    await conn.execute("TRUNCATE jobs")
    insert, done = INSERT.replace("$1", "%s"), DONE.replace("$1", "%s")
    start = time.perf_counter()
    for _ in range(n):
        await conn.execute(insert, ('{"a": 1}',))
        row = await (await conn.execute(CLAIM)).fetchone()
        assert row is not None
        await conn.execute(done, (row[0],))
    elapsed = time.perf_counter() - start
    await conn.close()
    return n / elapsed


def main() -> None:
    """Measure both drivers in alternating rounds, with fsync off (the driver's own
    cost) and on (the server's default durability); print the median and best."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    for fast in (True, False):
        rates: dict[str, list[float]] = {"asyncpg": [], "psycopg": []}
        with ThrowawayServer(fast=fast) as server:
            for _ in range(rounds if fast else 2):
                for name, run in (("asyncpg", with_asyncpg), ("psycopg", with_psycopg)):
                    rates[name].append(asyncio.run(run(server.dsn(), n if fast else n // 10)))
        for name, found in rates.items():
            print(
                f"fsync {'off' if fast else 'on '} {name:8} median "
                f"{statistics.median(found):6.0f} best {max(found):6.0f} jobs/s"
            )


if __name__ == "__main__":
    main()
