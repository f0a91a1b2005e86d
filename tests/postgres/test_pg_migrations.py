"""Upgrades keep the queue: every migration, applied to the oldest schema envq migrates
from (``schemas/v<N>.sql``, the SQL that release installed, kept as it was), gives the
schema a fresh install makes, object by object; a database full of envelopes in every
state written by the old schema upgrades, and every envelope then ends as it would
have; a node refuses a schema it is too old or too new for, saying what to do.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue, migrations
from envq.postgres._server import ThrowawayServer
from envq.postgres.schema import COMPATIBLE_FROM, SCHEMA_VERSION, render

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

SCHEMAS = Path(__file__).resolve().parent / "schemas"
_names = itertools.count()


async def _database(server: ThrowawayServer, sql: str | None) -> str:
    """A new database holding ``sql`` (nothing when None); its DSN."""
    name = f"mig_{next(_names)}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(server.dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    if sql is not None:
        conn = await asyncpg.connect(server.dsn(name))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()
    return server.dsn(name)


#: Every object of the schema ``envq`` and what defines it (columns by name: an
#: upgrade appends a new column where a fresh install may place it elsewhere).
_CATALOG = {
    "columns": """
        SELECT c.relname || '.' || a.attname,
               format_type(a.atttypid, a.atttypmod) || ' notnull=' || a.attnotnull
               || ' default=' || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
               || ' identity=' || a.attidentity::text
               || ' comment=' || coalesce(col_description(c.oid, a.attnum), '')
          FROM pg_attribute AS a JOIN pg_class AS c ON c.oid = a.attrelid
          JOIN pg_namespace AS n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE n.nspname = 'envq' AND c.relkind IN ('r', 'p') AND a.attnum > 0
           AND NOT a.attisdropped""",
    "relations": """
        SELECT c.relname, c.relkind::text || ' ' || coalesce(obj_description(c.oid, 'pg_class'), '')
               || ' ' || coalesce(array_to_string(c.reloptions, ','), '')
          FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE n.nspname = 'envq' AND c.relkind IN ('r', 'p', 'S', 'v', 'm')""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'envq'""",
    "constraints": """
        SELECT t.relname || '.' || c.conname, pg_get_constraintdef(c.oid)
          FROM pg_constraint AS c JOIN pg_class AS t ON t.oid = c.conrelid
          JOIN pg_namespace AS n ON n.oid = t.relnamespace WHERE n.nspname = 'envq'""",
    "functions": """
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
               pg_get_function_result(p.oid) || ' ' || l.lanname || ' ' || p.provolatile::text
               || ' ' || p.proparallel::text || ' '
               || coalesce(obj_description(p.oid, 'pg_proc'), '')
               || E'\n' || p.prosrc
          FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
          JOIN pg_language AS l ON l.oid = p.prolang WHERE n.nspname = 'envq'""",
    "triggers": """
        SELECT t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger AS t JOIN pg_class AS c ON c.oid = t.tgrelid
          JOIN pg_namespace AS n ON n.oid = c.relnamespace
         WHERE n.nspname = 'envq' AND NOT t.tgisinternal""",
    "types": """
        SELECT t.typname, coalesce(obj_description(t.oid, 'pg_type'), '') || ' '
               || coalesce((SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                              FROM pg_enum AS e WHERE e.enumtypid = t.oid), '')
          FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
         WHERE n.nspname = 'envq' AND t.typtype = 'e'""",
    "schema": """
        SELECT nspname, coalesce(obj_description(oid, 'pg_namespace'), '')
          FROM pg_namespace WHERE nspname = 'envq'""",
    "version": """
        SELECT version::text, coalesce(to_jsonb(s) ->> 'compatible_from', '')
          FROM envq.schema_version AS s
         WHERE version = (SELECT max(version) FROM envq.schema_version)""",
}


async def _catalog(dsn: str) -> dict[str, dict[str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        return {kind: {r[0]: r[1] for r in await conn.fetch(sql)} for kind, sql in _CATALOG.items()}
    finally:
        await conn.close()


def _oldest() -> str:
    return (SCHEMAS / f"v{migrations.FIRST}.sql").read_text(encoding="utf-8")


def test_a_fixture_is_kept_for_the_oldest_schema_and_a_migration_for_each_version() -> None:
    assert (SCHEMAS / f"v{migrations.FIRST}.sql").is_file()
    for version in range(migrations.FIRST + 1, SCHEMA_VERSION + 1):
        assert migrations.migration(version).strip()
    with pytest.raises(ValueError, match="no migration"):
        migrations.migration(SCHEMA_VERSION + 1)
    assert migrations.steps(migrations.FIRST) == list(
        range(migrations.FIRST + 1, SCHEMA_VERSION + 1)
    )
    with pytest.raises(RuntimeError, match="earlier release"):
        migrations.steps(migrations.FIRST - 1)


async def test_the_migrations_give_the_schema_a_fresh_install_makes(
    pg_server: ThrowawayServer,
) -> None:
    fresh = await _database(pg_server, render())
    upgraded = await _database(pg_server, _oldest())
    conn = await asyncpg.connect(upgraded)
    try:
        assert await migrations.install(conn) == (migrations.FIRST, SCHEMA_VERSION)
        # Again: nothing left to do.
        assert await migrations.install(conn) == (SCHEMA_VERSION, SCHEMA_VERSION)
    finally:
        await conn.close()
    want, got = await _catalog(fresh), await _catalog(upgraded)
    for kind in _CATALOG:
        missing = sorted(set(want[kind]) - set(got[kind]))
        extra = sorted(set(got[kind]) - set(want[kind]))
        changed = sorted(
            k for k in want[kind].keys() & got[kind].keys() if want[kind][k] != got[kind][k]
        )
        assert (missing, extra, changed) == ([], [], []), kind
    assert got["version"] == {str(SCHEMA_VERSION): str(COMPATIBLE_FROM)}


async def test_the_comparison_can_fail(pg_server: ThrowawayServer) -> None:
    """The oldest schema itself differs from a fresh install (else the test above
    would prove nothing)."""
    fresh = await _database(pg_server, render())
    old = await _database(pg_server, _oldest())
    assert await _catalog(fresh) != await _catalog(old)


async def _until(check: Callable[[dict[str, int]], bool], q: PgQueue) -> None:
    """Until ``check`` holds of the queue's counts (a minute at most)."""
    from fault_support import until  # noqa: PLC0415

    async def holds() -> bool:
        return check(await q.counts())

    await until(holds, "the counts", timeout=60)


# -- a database full of envelopes in every state, upgraded --------------------------------

_QUEUE = "old"


async def _fill_old(conn: Any) -> dict[str, str]:
    """Envelopes in every state, written by the oldest schema's own statements: the
    expected end of each after the upgrade, by id."""
    await conn.execute("INSERT INTO envq.queues (name) VALUES ($1)", _QUEUE)

    async def send(ident: str, state: str, **extra: Any) -> None:
        columns = {"queue": _QUEUE, "id": json.dumps(ident), "kind": "one_off"}
        columns |= {"invoke": "pg_jobs:noop", "state": state, "event": "send", **extra}
        names = ", ".join(columns)
        marks = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
        await conn.execute(
            f"INSERT INTO envq.envelopes ({names}) VALUES ({marks})", *columns.values()
        )

    # Sent before any start: buffered.
    await send("buffered", "buffered")
    await conn.execute(
        "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = $1", _QUEUE
    )
    await conn.execute("SELECT envq.broadcast($1, 'start')", _QUEUE)
    await send("ready", "ready")
    await send("delayed", "delayed", wait=True, due_at=None)
    await conn.execute(
        "UPDATE envq.envelopes SET due_at = clock_timestamp() + interval '1 second'"
        " WHERE id = '\"delayed\"'"
    )
    await send("claimed-by-a-dead-node", "ready")
    await send("to-succeed", "ready")
    await send("to-fail", "ready")
    await send("to-stop", "ready")
    rows = await conn.fetch(
        "SELECT seq, id, lease_token FROM envq.claim($1, 'old-node', 10, interval '1 second')",
        _QUEUE,
    )
    by_id = {json.loads(r["id"]): r for r in rows}
    # Every ready one was claimed (oldest first): put back what must stay ready.
    for ident, outcome, decision in (
        ("to-succeed", "attempt_ok", None),
        ("to-fail", "attempt_error", "drop"),
        ("to-stop", "attempt_stop", None),
        ("ready", "attempt_error", "retry_now"),
        ("buffered", "attempt_error", "retry_now"),
    ):
        r = by_id[ident]
        await conn.execute(
            "SELECT envq.finish($1, $2, $3::envq.envelope_event, $4::envq.decision_kind)",
            r["seq"],
            r["lease_token"],
            outcome,
            decision,
        )
    # A parked one: a stop parks the delayed; then the queue runs again, stopped once
    # more so that the parked one stays parked (armed by the next start).
    await send("parked", "delayed", wait=True)
    await conn.execute(
        "UPDATE envq.envelopes SET due_at = clock_timestamp() + interval '1 second'"
        " WHERE id = '\"parked\"'"
    )
    await conn.execute(
        "UPDATE envq.queues SET state = 'stopping', call = 'stop', stop_mode = 'stop'"
        " WHERE name = $1",
        _QUEUE,
    )
    await conn.execute("SELECT envq.broadcast($1, 'stop')", _QUEUE)
    states = {
        json.loads(r["id"]): r["state"]
        for r in await conn.fetch(
            "SELECT id, state::text FROM envq.envelopes WHERE queue = $1", _QUEUE
        )
    }
    assert states == {
        "buffered": "parked",
        "ready": "parked",
        "delayed": "parked",
        "parked": "parked",
        "claimed-by-a-dead-node": "running",
        "to-succeed": "succeeded",
        "to-fail": "failed",
        "to-stop": "stopped",
    }, states
    # A returned one: in a second queue, terminated.
    await conn.execute("INSERT INTO envq.queues (name) VALUES ('old-ended')")
    await conn.execute(
        "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
        " VALUES ('old-ended', '\"returned\"', 'pg_jobs:noop', 'one_off', 'buffered', 'send')"
    )
    await conn.execute(
        "UPDATE envq.queues SET state = 'terminated', call = 'terminate' WHERE name = 'old-ended'"
    )
    await conn.execute("SELECT envq.broadcast('old-ended', 'terminate')")
    return {
        "buffered": "succeeded",
        "ready": "succeeded",
        "delayed": "succeeded",
        "parked": "succeeded",
        # The dead node's lease expires; the reaper ends it EXPIRED, dropped (no policy).
        "claimed-by-a-dead-node": "failed",
        "to-succeed": "succeeded",
        "to-fail": "failed",
        "to-stop": "stopped",
    }


async def test_a_full_database_of_the_oldest_schema_upgrades_and_every_envelope_ends(
    pg_server: ThrowawayServer,
) -> None:
    dsn = await _database(pg_server, _oldest())
    conn = await asyncpg.connect(dsn)
    try:
        expected = await _fill_old(conn)
        # The STOPPING queue finishes its stop as the old nodes would have.
        await conn.execute(
            "UPDATE envq.queues SET state = 'stopped', call = 'drained' WHERE name = $1", _QUEUE
        )
    finally:
        await conn.close()
    q = PgQueue(dsn, _QUEUE, workers=4, lease=1.0, poll=0.05)
    with pytest.raises(RuntimeError, match="migrate"):
        await q.connect()
    await q.install()  # the upgrade
    async with q:
        await q.start()
        await _until(lambda c: set(c) <= {"succeeded", "failed", "stopped"}, q)
        ended = {
            json.loads(r["id"]): r["state"]
            for r in await q._db().fetch(
                "SELECT id, state::text FROM envq.envelopes WHERE queue = $1", _QUEUE
            )
        }
        returned = await q._db().fetchval(
            "SELECT state::text FROM envq.envelopes WHERE queue = 'old-ended'"
        )
        # And a new envelope runs as usual.
        assert await q.send(envq.Envelope(invoke=pg_jobs.noop, id="new")) == 1
        await _until(lambda c: c.get("succeeded", 0) >= 6, q)
        new = await q._db().fetchval(
            "SELECT state::text FROM envq.envelopes WHERE queue = $1 AND id = '\"new\"'", _QUEUE
        )
        await q.terminate()
    assert ended == expected
    assert returned == "returned"
    assert new == "succeeded"


# -- versions a node refuses ----------------------------------------------------------------


async def _set_version(dsn: str, version: int, compatible_from: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO envq.schema_version (version, compatible_from) VALUES ($1, $2)",
            version,
            compatible_from,
        )
    finally:
        await conn.close()


async def test_a_newer_schema_this_envq_is_too_old_for_is_refused_saying_so(
    pg_server: ThrowawayServer,
) -> None:
    dsn = await _database(pg_server, render())
    await _set_version(dsn, SCHEMA_VERSION + 1, SCHEMA_VERSION + 1)
    q = PgQueue(dsn, "q", workers=0)
    with pytest.raises(RuntimeError, match="upgrade envq in this process"):
        await q.connect()
    with pytest.raises(RuntimeError, match="upgrade envq in this process"):
        await q.install()  # nothing to migrate down to


async def test_a_newer_schema_compatible_with_this_envq_is_used(
    pg_server: ThrowawayServer,
) -> None:
    """A rolling upgrade: a node of this envq on a newer schema that still serves it."""
    dsn = await _database(pg_server, render())
    await _set_version(dsn, SCHEMA_VERSION + 1, SCHEMA_VERSION)
    q = PgQueue(dsn, "q", workers=1, poll=0.05)
    await q.install()  # leaves it as it is
    async with q:
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
        await _until(lambda c: c.get("succeeded") == 1, q)
        assert await q.counts() == {"succeeded": 1}
        await q.terminate()


async def test_an_older_schema_is_refused_at_connect_saying_how_to_migrate(
    pg_server: ThrowawayServer,
) -> None:
    dsn = await _database(pg_server, _oldest())
    q = PgQueue(dsn, "q", workers=0)
    with pytest.raises(RuntimeError, match=r"version 3.*python -m envq.postgres migrate"):
        await q.connect()
    assert q._pool is None


async def test_installs_at_once_upgrade_once(pg_server: ThrowawayServer) -> None:
    """Four processes' installs at once (here, four connections): one upgrades under
    the lock, the others find it done."""
    dsn = await _database(pg_server, _oldest())
    results = await asyncio.gather(*(PgQueue(dsn, f"q{i}", workers=0).install() for i in range(4)))
    assert results == [None] * 4
    conn = await asyncpg.connect(dsn)
    try:
        versions = [
            r[0] for r in await conn.fetch("SELECT version FROM envq.schema_version ORDER BY 1")
        ]
    finally:
        await conn.close()
    assert versions == list(range(migrations.FIRST, SCHEMA_VERSION + 1))
