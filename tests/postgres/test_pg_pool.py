"""A queue's pooled sessions: given back to the pool without a reset statement.

asyncpg's pool sends ``RESET ALL; UNLISTEN *; CLOSE ALL; pg_advisory_unlock_all()``
when a session is given back unless told otherwise: one more round trip at every claim
and every end of a node. envq's pooled sessions hold no session state, so its pool
only rolls back a transaction left open (which asyncpg always does).
"""

from __future__ import annotations

import uuid

import pytest

from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock


async def test_a_session_given_back_is_not_reset(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, f"pool-{uuid.uuid4().hex[:8]}", workers=0) as q:
        pool = q._db()
        async with pool.acquire() as conn:
            pid = conn.get_server_pid()
            # A session-level setting: the default reset statement (RESET ALL) clears it.
            await conn.execute("SET envq_test.mark = 'kept'")
        async with pool.acquire() as conn:
            assert conn.get_server_pid() == pid
            assert await conn.fetchval("SELECT current_setting('envq_test.mark', true)") == "kept"


async def test_a_transaction_left_open_is_still_rolled_back(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, f"pool-{uuid.uuid4().hex[:8]}", workers=0) as q:
        pool = q._db()
        async with pool.acquire() as conn:
            pid = conn.get_server_pid()
            tx = conn.transaction()
            await tx.start()
            await conn.execute("CREATE TEMP TABLE left_open (x int)")
            assert conn.is_in_transaction()
        async with pool.acquire() as conn:
            assert conn.get_server_pid() == pid
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SELECT to_regclass('pg_temp.left_open')") is None
