"""PgQueue's API at its edges: who owns a lease, a stop before any start, a batch that
can never fit, text PostgreSQL cannot store, a database without envq's schema, and the
checks of the constructor's and the calls' parameters.

Every test uses its own queue name in the session's database holding the schema (the
schema tests make databases of their own). Waits are for conditions in the database,
with generous limits; no timing is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pg_jobs
import pytest
from pg_support import create_database

import envq
from envq._errors import BadEnvelopeType
from envq._rules import Room, refusal
from envq.postgres import AdmissionUnknown, PgQueue, StoreUnavailable
from envq.postgres import _admit as admit_module
from envq.postgres import node as node_command
from envq.postgres._edges import committed
from envq.postgres._server import ThrowawayServer

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

_names = itertools.count()


def _name() -> str:
    return f"api{next(_names)}-{uuid.uuid4().hex[:6]}"


async def _empty_database(server: ThrowawayServer, name: str) -> None:
    admin = await asyncpg.connect(server.dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()


# -- who owns a lease ----------------------------------------------------------------


async def test_a_node_restarted_under_the_same_name_does_not_keep_a_dead_lease_alive(
    pg_dsn: str,
) -> None:
    """The attempt of a dead node named like a live one is not renewed by it: each
    PgQueue object holds its leases under an owner of its own."""
    name = _name()
    q = PgQueue(pg_dsn, name, workers=1, lease=2.0, poll=0.1, node="worker-0")
    await q.install()
    async with q:
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.slow, id="own", payload="60"))
        conn = await asyncpg.connect(pg_dsn)
        try:
            # The predecessor's attempt: claimed under the same node name, never ended.
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
                " VALUES ($1, '\"ghost\"', 'pg_jobs:noop', 'one_off', 'ready', 'send')",
                name,
            )
            await conn.fetch(
                "SELECT * FROM envq.claim($1, 'worker-0', 1, interval '2 seconds')", name
            )
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while True:
                state = await conn.fetchval(
                    "SELECT state::text FROM envq.envelopes WHERE queue = $1 AND id = '\"ghost\"'",
                    name,
                )
                own = await conn.fetchval(
                    "SELECT state::text FROM envq.envelopes WHERE queue = $1 AND id = '\"own\"'",
                    name,
                )
                if state != "running" or loop.time() > end:
                    break
                await asyncio.sleep(0.1)
        finally:
            await conn.close()
        await q.terminate()
    assert own == "running", "the live node's own attempt ended before the check"
    assert state != "running", "the ghost's lease (2 s) was renewed by the live node"


async def test_the_lease_owner_names_the_node_and_is_unique_per_object(pg_dsn: str) -> None:
    name = _name()
    a = PgQueue(pg_dsn, name, workers=1, node="worker-0")
    b = PgQueue(pg_dsn, name, workers=1, node="worker-0")
    assert a.node == b.node == "worker-0"
    assert a.lease_owner != b.lease_owner
    assert a.lease_owner.startswith("worker-0")


async def test_renew_extends_only_the_leases_of_the_queue_named(pg_dsn: str) -> None:
    """Two queues whose nodes share an owner name: renewing one leaves the other's
    lease as it was."""
    first, second = _name(), _name()
    conn = await asyncpg.connect(pg_dsn)
    try:
        for queue in (first, second):
            await conn.execute("INSERT INTO envq.queues (name, state) VALUES ($1, 'init')", queue)
            await conn.execute(
                "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = $1",
                queue,
            )
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
                " VALUES ($1, '\"x\"', 'pg_jobs:noop', 'one_off', 'ready', 'send')",
                queue,
            )
            await conn.fetch(
                "SELECT * FROM envq.claim($1, 'shared', 1, interval '30 seconds')", queue
            )
        before = await conn.fetchval(
            "SELECT lease_expires_at FROM envq.envelopes WHERE queue = $1", second
        )
        tokens = [
            r[0]
            for r in await conn.fetch(
                "SELECT lease_token FROM envq.envelopes WHERE queue = ANY($1::text[])",
                [first, second],
            )
        ]
        renewed = await conn.fetch(
            "SELECT * FROM envq.renew($1, 'shared', interval '600 seconds', $2::uuid[])",
            first,
            tokens,
        )
        after = await conn.fetchval(
            "SELECT lease_expires_at FROM envq.envelopes WHERE queue = $1", second
        )
    finally:
        await conn.close()
    assert len(renewed) == 1
    assert after == before


# -- stop before any start -----------------------------------------------------------


async def test_stop_of_a_queue_never_started_returns(pg_dsn: str) -> None:
    """A stop of a queue in INIT changes nothing (as in one process), and returns."""
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        report = await asyncio.wait_for(q.stop(), 10)
        assert report == envq.StopReport(complete=False)  # not stopped: never started
        assert (await q.state()) is envq.QueueState.INIT


# -- a batch that can never fit ------------------------------------------------------


async def test_send_wait_of_a_batch_larger_than_the_capacity_fails_at_once(pg_dsn: str) -> None:
    q = PgQueue(pg_dsn, _name(), workers=0, capacity=2)
    await q.install()
    async with q:
        batch = [envq.Envelope(invoke=pg_jobs.noop) for _ in range(3)]
        with pytest.raises(envq.CapacityExceeded, match="never"):
            await asyncio.wait_for(q.send_wait(*batch), 10)
        # A plain send too, in the words both stores take from envq._rules.
        with pytest.raises(envq.CapacityExceeded) as caught:
            await q.send(*batch)
        assert refusal(Room.NEVER, 0, 3, 2) in str(caught.value)
        # A batch that fits an empty queue still waits for room.
        await q.send(envq.Envelope(invoke=pg_jobs.noop), envq.Envelope(invoke=pg_jobs.noop))
        with pytest.raises(TimeoutError):
            await q.send_wait(envq.Envelope(invoke=pg_jobs.noop), timeout=0.3)


async def test_the_capacity_is_the_queues_not_each_objects(pg_dsn: str) -> None:
    """The object that creates the queue's row sets its capacity; another object given
    another capacity is refused, one given none takes the queue's."""
    name = _name()
    first = PgQueue(pg_dsn, name, workers=0, capacity=1)
    await first.install()
    async with first:
        other = PgQueue(pg_dsn, name, workers=0, capacity=100)
        with pytest.raises(ValueError, match="capacity"):
            await other.connect()
        assert other._pool is None
        async with PgQueue(pg_dsn, name, workers=0) as follower:
            assert follower.capacity == 1
            await follower.send(envq.Envelope(invoke=pg_jobs.noop))
            with pytest.raises(envq.CapacityExceeded, match="1 of 1 used"):
                await follower.send(envq.Envelope(invoke=pg_jobs.noop))
            assert (await follower.statistics()).capacity_limit == 1
        with pytest.raises(envq.CapacityExceeded):
            await first.send(envq.Envelope(invoke=pg_jobs.noop))
        assert (await first.counts()) == {"buffered": 1}


# -- text PostgreSQL cannot store, a lost connection -----------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("payload", "nul\x00"),
        ("id", "x\x00"),
        ("payload", {"k": "\ud800"}),
        ("payload", {"k\x00": 1}),
        ("id", ("a", "\udfff")),
        ("type", "a\x00b"),
    ],
)
async def test_text_postgres_cannot_store_is_refused_as_bad_envelope(
    pg_dsn: str, field: str, value: object
) -> None:
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        good = envq.Envelope(invoke=pg_jobs.noop, id="good")
        with pytest.raises(BadEnvelopeType, match=field):
            await q.send(good, envq.Envelope(invoke=pg_jobs.noop, **{field: value}))  # type: ignore[arg-type]
        assert await q.counts() == {}


async def test_a_connection_killed_mid_send_raises_store_unavailable(pg_dsn: str) -> None:
    name = _name()
    q = PgQueue(pg_dsn, name, workers=0)
    await q.install()
    async with q:
        await q.start()
        admin = await asyncpg.connect(pg_dsn)
        try:
            # Hold the queue's row so that the send waits inside its transaction.
            lock = admin.transaction()
            await lock.start()
            await admin.execute("SELECT FROM envq.queues WHERE name = $1 FOR UPDATE", name)
            sending = asyncio.ensure_future(q.send(envq.Envelope(invoke=pg_jobs.noop, id=1)))
            killer = await asyncpg.connect(pg_dsn)
            try:
                loop = asyncio.get_running_loop()
                end = loop.time() + 10
                killed = False
                while not killed and loop.time() < end:
                    killed = bool(
                        await killer.fetchval(
                            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                            " WHERE application_name = $1 AND wait_event_type = 'Lock'",
                            f"envq:{q.node}",
                        )
                    )
                    await asyncio.sleep(0.05)
            finally:
                await killer.close()
            assert killed
            with pytest.raises(StoreUnavailable, match="nothing was admitted"):
                await asyncio.wait_for(sending, 10)
            await lock.rollback()
        finally:
            await admin.close()
        assert await q.counts() == {}


# -- a connection lost as a send commits ---------------------------------------------

_SENDING: contextvars.ContextVar[bool] = contextvars.ContextVar("sending", default=False)


def _lose_send_commits(
    monkeypatch: pytest.MonkeyPatch,
    q: PgQueue,
    cut: Callable[[Any, Callable[[], Awaitable[None]]], Awaitable[None]],
) -> None:
    """Make the COMMIT of ``q``'s sends go through ``cut(connection, commit)``, which
    loses the connection around the real commit."""
    admit = admit_module._admit

    async def admitting(conn: Any, name: str, rows: Any) -> tuple[int, str, int]:
        found = await admit(conn, name, rows)
        _SENDING.set(True)  # the send's task commits next
        return found

    real = asyncpg.transaction.Transaction._Transaction__commit

    async def commit(tx: Any) -> None:
        if not _SENDING.get():
            await real(tx)
            return
        _SENDING.set(False)
        await cut(tx._connection, lambda: real(tx))

    monkeypatch.setattr(admit_module, "_admit", admitting)
    monkeypatch.setattr(asyncpg.transaction.Transaction, "_Transaction__commit", commit)


async def test_a_send_whose_commit_went_through_unheard_returns_as_usual(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server committed; its answer was lost with the connection. The send asks
    the database, finds its transaction committed, and returns the count."""

    async def unheard(conn: Any, commit: Callable[[], Awaitable[None]]) -> None:
        await commit()
        conn.terminate()
        raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")

    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        await q.start()
        _lose_send_commits(monkeypatch, q, unheard)
        sent = [envq.Envelope(invoke=pg_jobs.noop, id=i) for i in range(3)]
        assert await q.send(*sent) == 3
        assert await q.counts() == {"ready": 3}


async def test_a_send_whose_commit_was_cut_says_nothing_was_admitted(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session was terminated before its COMMIT reached the server: the server
    rolled back, the database says so, and the error is the plain one."""

    async def terminated(conn: Any, commit: Callable[[], Awaitable[None]]) -> None:
        killer = await asyncpg.connect(pg_dsn)
        try:
            await killer.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())
        finally:
            await killer.close()
        await commit()

    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        await q.start()
        _lose_send_commits(monkeypatch, q, terminated)
        with pytest.raises(
            StoreUnavailable, match="rolled it back: nothing was admitted"
        ) as caught:
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
        assert not isinstance(caught.value, AdmissionUnknown)
        assert await q.counts() == {}


async def test_a_send_whose_commit_cannot_be_confirmed_is_admission_unknown(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database cannot be asked after the loss: the error says the outcome is
    unknown, not that nothing was admitted; a second send of the same ids is safe."""
    q = PgQueue(pg_dsn, _name(), workers=0)

    @contextlib.asynccontextmanager
    async def unreachable() -> AsyncIterator[Any]:
        raise OSError("connection refused")
        yield  # pragma: no cover - never reached

    async def unheard(conn: Any, commit: Callable[[], Awaitable[None]]) -> None:
        await commit()
        conn.terminate()
        monkeypatch.setattr(q, "_session", unreachable)
        raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle")

    monkeypatch.setattr(
        "envq.postgres._queue.committed", functools.partial(committed, patience=0.3)
    )
    await q.install()
    async with q:
        await q.start()
        _lose_send_commits(monkeypatch, q, unheard)
        sent = [envq.Envelope(invoke=pg_jobs.noop, id=i) for i in range(2)]
        with pytest.raises(AdmissionUnknown, match="admitted whole or not at all"):
            await q.send(*sent)
        monkeypatch.undo()
        assert await q.counts() == {"ready": 2}
        assert await q.send(*sent) == 0  # both still live: dedups
        assert await q.counts() == {"ready": 2}


# -- a database without envq's schema ----------------------------------------------


async def test_connect_without_the_schema_says_so_and_stays_unconnected(
    pg_server: ThrowawayServer, pg_dsn: str
) -> None:
    db = f"noschema_{uuid.uuid4().hex[:8]}"
    await _empty_database(pg_server, db)
    q = PgQueue(pg_server.dsn(db), "q", workers=0)
    with pytest.raises(RuntimeError, match="install"):
        await q.connect()
    assert q._pool is None
    with pytest.raises(RuntimeError, match="install"):
        await q.connect()
    await q.close()


async def test_connect_to_a_schema_of_another_version_is_refused(
    pg_server: ThrowawayServer, pg_dsn: str
) -> None:
    db = f"oldschema_{uuid.uuid4().hex[:8]}"
    await create_database(pg_server, db)
    dsn = pg_server.dsn(db)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE envq.schema_version SET version = 1")
    finally:
        await conn.close()
    q = PgQueue(dsn, "q", workers=0)
    with pytest.raises(RuntimeError, match="version 1"):
        await q.connect()
    assert q._pool is None


async def test_install_over_an_empty_envq_schema_says_so(
    pg_server: ThrowawayServer, pg_dsn: str
) -> None:
    db = f"emptyschema_{uuid.uuid4().hex[:8]}"
    await _empty_database(pg_server, db)
    dsn = pg_server.dsn(db)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE SCHEMA envq")
    finally:
        await conn.close()
    q = PgQueue(dsn, "q", workers=0)
    with pytest.raises(RuntimeError, match="schema 'envq'"):
        await q.install()


# -- parameters ----------------------------------------------------------------------


def test_hook_timeout_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="hook_timeout"):
        PgQueue("postgresql://u@/d", "q", hook_timeout="x")  # type: ignore[arg-type]


@pytest.mark.parametrize("lease", [1e-6, 0.01, 1e16, 1e7])
def test_a_lease_out_of_bounds_is_refused(lease: float) -> None:
    with pytest.raises(ValueError, match="lease"):
        PgQueue("postgresql://u@/d", "q", lease=lease)


def test_an_empty_dsn_is_a_value_error_and_a_non_str_a_type_error() -> None:
    with pytest.raises(ValueError, match="dsn"):
        PgQueue("", "q")
    with pytest.raises(TypeError, match="dsn"):
        PgQueue(b"postgresql://u@/d", "q")  # type: ignore[arg-type]


async def test_a_malformed_dsn_is_store_unavailable_without_the_password() -> None:
    q = PgQueue("postgresql://user:s3cret@[nothost/db?sslmode=bogus", "q", workers=0)
    with pytest.raises(StoreUnavailable) as caught:
        await q.connect()
    assert "s3cret" not in str(caught.value)
    assert "s3cret" not in repr(caught.value.__cause__)
    assert q._pool is None


@pytest.mark.parametrize(
    ("bad", "error"), [("1", TypeError), (math.nan, ValueError), (-1, ValueError)]
)
async def test_send_wait_and_terminate_check_their_timeout(
    pg_dsn: str, bad: object, error: type[Exception]
) -> None:
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        with pytest.raises(error, match="timeout"):
            await q.send_wait(envq.Envelope(invoke=pg_jobs.noop), timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(error, match="timeout"):
            await q.terminate(timeout=bad)  # type: ignore[arg-type]
        assert await q.counts() == {}
        assert (await q.state()) is envq.QueueState.INIT


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "x"],
        ["--workers", "-1"],
        ["--lease", "nan"],
        ["--lease", "0"],
        ["--queue", ""],
        ["--log", "LOUD"],
        ["--poll", "-1"],
    ],
)
def test_the_node_command_refuses_bad_arguments_with_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        node_command.main(["--dsn", "postgresql://u@/d", *argv])
    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err
