"""The counts the database keeps (``envq.counts``): after any mix of moves — sends and
dedups, claims, ends of every kind, stops and starts, StopType bans, expiries, the
hand-back's deletes, a TRUNCATE — they equal a count of the rows, per queue and
state; a send's capacity check and ``counts()`` read them, not the rows."""

from __future__ import annotations

import asyncio
import itertools
import uuid

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

_names = itertools.count()


def _name() -> str:
    return f"counts{next(_names)}-{uuid.uuid4().hex[:6]}"


async def _drift(conn: asyncpg.Connection) -> list[tuple[str, str, int, int]]:
    """Every (queue, state) whose kept count differs from the rows' count."""
    rows = await conn.fetch(
        """
        SELECT coalesce(r.queue, k.queue) AS queue, coalesce(r.state, k.state)::text AS state,
               coalesce(r.n, 0) AS rows, coalesce(k.n, 0) AS kept
          FROM (SELECT queue, state, count(*) AS n FROM envq.envelopes GROUP BY 1, 2) AS r
          FULL JOIN (SELECT queue, state, sum(n) AS n FROM envq.counts GROUP BY 1, 2) AS k
            ON r.queue = k.queue AND r.state = k.state
         WHERE coalesce(r.n, 0) <> coalesce(k.n, 0)
        """
    )
    return [(r["queue"], r["state"], r["rows"], r["kept"]) for r in rows]


async def test_the_kept_counts_follow_every_kind_of_move(pg_dsn: str) -> None:
    name = _name()
    q = PgQueue(pg_dsn, name, workers=4, lease=1.0, poll=0.05, capacity=500)
    await q.install()
    conn = await asyncpg.connect(pg_dsn)
    try:
        async with q:
            # Buffered, with dedups.
            batch = [envq.Envelope(invoke=pg_jobs.noop, id=f"kb{i % 30}") for i in range(40)]
            assert await q.send(*batch) == 30
            assert await _drift(conn) == []
            await q.start()
            await q.send(
                *(envq.Envelope(invoke=pg_jobs.fail, id=f"kf{i}") for i in range(10)),
                *(
                    envq.Envelope(invoke=pg_jobs.noop, id=f"kr{i}", retry=envq.Retry(attempts=2))
                    for i in range(10)
                ),
                *(envq.Envelope(invoke=pg_jobs.noop, id=f"kd{i}", delay=0.3) for i in range(10)),
                envq.Envelope(invoke=pg_jobs.stop_type, id="kban", type="banned"),
                *(envq.Envelope(invoke=pg_jobs.noop, id=f"kt{i}", type="banned") for i in range(5)),
                envq.Envelope(invoke=pg_jobs.slow, id="kslow", payload="60"),
            )
            await asyncio.sleep(0.1)
            assert await _drift(conn) == []
            # An attempt claimed elsewhere and left to expire (the reaper's move). The
            # claim takes the oldest READY row: first let the node claim every one sent.
            loop = asyncio.get_running_loop()
            until = loop.time() + 30
            while "ready" in await q.counts():
                assert loop.time() < until, "the node did not claim what was sent"
                await asyncio.sleep(0.05)
            # Inserted and claimed in one transaction: the node, which has free
            # workers, never sees it READY (claimed first by the node, it would not be
            # this claim's).
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
                    " VALUES ($1, '\"ghost\"', 'pg_jobs:noop', 'one_off', 'ready', 'send')",
                    name,
                )
                ghost = await conn.fetch(
                    "SELECT id FROM envq.claim($1, 'elsewhere', 1, interval '0.2 s')", name
                )
            assert [r["id"] for r in ghost] == ['"ghost"']
            until = loop.time() + 30
            while loop.time() < until:
                counts = await q.counts()
                if counts.get("running", 0) == 1 and not {"ready", "delayed"} & set(counts):
                    break
                await asyncio.sleep(0.05)
            else:
                pytest.fail(f"only kslow running, nothing waiting: not reached in 30 s ({counts})")
            assert await _drift(conn) == []
            await q.stop(envq.StopMode.STOP, cancel=True)
            assert await _drift(conn) == []
            await q.start()
            await q.stop(envq.StopMode.STOP, cancel=True)
            slow = await conn.fetchrow(
                "SELECT state::text, history::text FROM envq.envelopes"
                " WHERE queue = $1 AND id = '\"kslow\"'",
                name,
            )
            handed = await q.terminate()
            # The parked ones were handed back (their rows deleted): kslow, cancelled twice.
            assert "kslow" in {e.id for e in handed}, (slow, handed)
            assert await _drift(conn) == []
            kept = await q.counts()
            rows = {
                r[0]: r[1]
                for r in await conn.fetch(
                    "SELECT state::text, count(*) FROM envq.envelopes WHERE queue = $1 GROUP BY 1",
                    name,
                )
            }
            assert kept == rows
            assert kept.get("failed", 0) >= 10
            assert kept.get("stopped", 0) >= 1  # the envelope that banned its type
    finally:
        await conn.close()


async def test_a_truncate_empties_the_counts(pg_server: object) -> None:
    from pg_support import create_database  # noqa: PLC0415

    db = f"truncate_{uuid.uuid4().hex[:8]}"
    await create_database(pg_server, db)  # type: ignore[arg-type]
    dsn = pg_server.dsn(db)  # type: ignore[attr-defined]
    q = PgQueue(dsn, "q", workers=0)
    async with q:
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id=1))
        assert await q.counts() == {"buffered": 1}
        await q._db().execute("TRUNCATE envq.envelopes")
        assert await q.counts() == {}


async def test_the_capacity_check_reads_the_kept_counts(pg_dsn: str) -> None:
    """A send is refused or admitted by the kept counts (a wrong count, made by hand
    here, decides it), not by a count of rows."""
    name = _name()
    q = PgQueue(pg_dsn, name, workers=0, capacity=3)
    await q.install()
    async with q:
        assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id="a")) == 1
        await q._db().execute(
            "INSERT INTO envq.counts (queue, state, slot, n) VALUES ($1, 'buffered', -1, 2)",
            name,
        )
        with pytest.raises(envq.CapacityExceeded, match="3 of 3 used"):
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="b"))
        await q._db().execute("DELETE FROM envq.counts WHERE queue = $1 AND slot = -1", name)
        assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id="b")) == 1
