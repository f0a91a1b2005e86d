"""``PgQueue.send(*envelopes, connection=conn)``: the batch is admitted inside the
caller's transaction — admitted if and only if the caller commits, with the checks of a
send (dedup, capacity) unchanged, and a refusal leaves the caller's transaction usable.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue

pytestmark = pytest.mark.real_clock
asyncpg = pytest.importorskip("asyncpg")

HOUR = 3600.0


@asynccontextmanager
async def _orders(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The application's own connection, with a table of its own (a temporary one)."""
    conn = await asyncpg.connect(pg_dsn)
    await conn.execute("CREATE TEMP TABLE orders (id int PRIMARY KEY)")
    try:
        yield conn
    finally:
        await conn.close()


async def _queue(dsn: str, **options: object) -> PgQueue:
    q = PgQueue(dsn, f"tx-{uuid.uuid4().hex[:8]}", workers=0, **options)  # type: ignore[arg-type]
    await q.install()
    await q.connect()
    return q


def _later(id_: object) -> envq.Envelope:
    return envq.Envelope(invoke=pg_jobs.noop, id=id_, delay=HOUR)


async def test_a_committed_transaction_admits_the_batch(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        q = await _queue(pg_dsn)
        try:
            await q.start()
            async with orders.transaction():
                await orders.execute("INSERT INTO orders VALUES (1)")
                assert await q.send(_later("mail-1"), _later("mail-2"), connection=orders) == 2
                # Not committed yet: the queue's own sessions do not see it.
                assert await q.counts() == {}
            assert await q.counts() == {"delayed": 2}
            assert await orders.fetchval("SELECT count(*) FROM orders") == 1
        finally:
            await q.terminate()
            await q.close()


async def test_a_rolled_back_transaction_admits_nothing(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        q = await _queue(pg_dsn)
        try:
            await q.start()
            tx = orders.transaction()
            await tx.start()
            await orders.execute("INSERT INTO orders VALUES (1)")
            assert await q.send(_later("mail-1"), connection=orders) == 1
            await tx.rollback()
            assert await q.counts() == {}
            assert await orders.fetchval("SELECT count(*) FROM orders") == 0
            # The id was never admitted: a plain send of it now is not a dedup.
            assert await q.send(_later("mail-1")) == 1
        finally:
            await q.terminate()
            await q.close()


async def test_a_node_runs_it_once_committed(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        name = f"tx-run-{uuid.uuid4().hex[:8]}"
        worker = PgQueue(pg_dsn, name, workers=1, poll=0.05)
        await worker.install()
        async with worker:
            await worker.start()
            async with orders.transaction():
                await worker.send(envq.Envelope(invoke=pg_jobs.noop, id="now"), connection=orders)
                await asyncio.sleep(0.3)  # a node polls meanwhile: nothing to claim yet
                assert await worker.counts() == {}
            async with asyncio.timeout(30):
                while await worker.counts() != {"succeeded": 1}:  # noqa: ASYNC110 - the database's state
                    await asyncio.sleep(0.05)
            await worker.terminate()


async def test_dedup_and_capacity_hold_and_a_refusal_keeps_the_transaction(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        q = await _queue(pg_dsn, capacity=2)
        try:
            await q.start()
            assert await q.send(_later("a")) == 1
            async with orders.transaction():
                assert await q.send(_later("a"), connection=orders) == 0  # a dedup
                with pytest.raises(envq.CapacityExceeded):
                    await q.send(_later("b"), _later("c"), connection=orders)
                # Refused under a savepoint: the caller's transaction goes on.
                await orders.execute("INSERT INTO orders VALUES (7)")
                assert await q.send(_later("b"), connection=orders) == 1
            assert await q.counts() == {"delayed": 2}
            assert await orders.fetchval("SELECT count(*) FROM orders") == 1
        finally:
            await q.terminate()
            await q.close()


async def test_a_stopped_queue_refuses_it_as_a_send(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        q = await _queue(pg_dsn)
        try:
            await q.start()
            await q.stop()
            async with orders.transaction():
                with pytest.raises(envq.QueueNotRunning):
                    await q.send(_later("x"), connection=orders)
        finally:
            await q.terminate()
            await q.close()


async def test_a_capacity_needs_read_committed(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        q = await _queue(pg_dsn, capacity=5)
        try:
            await q.start()
            async with orders.transaction(isolation="repeatable_read"):
                with pytest.raises(ValueError, match="READ COMMITTED"):
                    await q.send(_later("x"), connection=orders)
            assert await q.counts() == {}
        finally:
            await q.terminate()
            await q.close()


async def test_a_connection_outside_a_transaction_or_not_asyncpg_is_refused(pg_dsn: str) -> None:
    async with _orders(pg_dsn) as orders:
        q = await _queue(pg_dsn)
        try:
            with pytest.raises(ValueError, match="not in a transaction"):
                await q.send(_later("x"), connection=orders)
            with pytest.raises(TypeError, match="asyncpg connection"):
                await q.send(_later("x"), connection="postgresql://secret@db/app")
            with pytest.raises(TypeError) as caught:
                await q.send(_later("x"), connection="postgresql://user:hunter2@db/app")
            assert "hunter2" not in str(caught.value)
            assert await q.counts() == {}
        finally:
            await q.terminate()
            await q.close()
