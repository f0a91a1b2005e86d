"""Helpers of the PostgreSQL tests: databases with the schema, rolled-back sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import asyncpg

from envq._machine import EnvState
from envq.postgres._server import ThrowawayServer
from envq.postgres.schema import render


async def create_database(
    server: ThrowawayServer, name: str, decide: Callable[..., EnvState | None] | None = None
) -> None:
    """Create database ``name`` and apply the generated schema to it (compiled from
    ``decide`` instead of the tables' ``target`` when given)."""
    admin = await asyncpg.connect(server.dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(server.dsn(name))
    try:
        await conn.execute(render() if decide is None else render(decide))
    finally:
        await conn.close()


@asynccontextmanager
async def session(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection inside a transaction that is rolled back at the end."""
    conn = await asyncpg.connect(dsn)
    transaction = conn.transaction()
    await transaction.start()
    try:
        yield conn
    finally:
        await transaction.rollback()
        await conn.close()
