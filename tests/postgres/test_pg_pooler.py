"""Behind a connection pooler: PgBouncer (Debian's ``pgbouncer``) in front of the tests'
throwaway server.

In transaction mode PgBouncer hands each transaction of a client to whichever server
session is free: asyncpg's named prepared statements are then missing, or another
client's, and ``LISTEN`` is heard by nobody. ``PgQueue(..., pooler="transaction")``
(``--pooler transaction`` for the node command) runs through it; without the setting,
``connect()`` refuses, naming it. A node listens on ``listen_dsn`` (a direct session)
when given one, and otherwise polls.

The node runs as a real process (``python -m envq.postgres.node``) whose sessions, and
its jobs' (``fault_jobs``), all go through PgBouncer; the history tables of the fault
tests (``fault_support``) account for every envelope afterwards.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

import envq
from envq.postgres._server import ThrowawayServer

if TYPE_CHECKING:
    from bouncer import Bouncer
    from fault_support import Cluster

pytestmark = pytest.mark.real_clock

#: Long enough that a loaded machine (CI runs suites beside each other) never lets a
#: healthy node's lease lapse: no attempt here is meant to be reaped.
LEASE = 6.0
POLL = 0.2


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("ENVQ_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"ENVQ_REQUIRE_POSTGRES=1, but {reason}", pytrace=False)
    pytest.skip(f"pooler tests skipped: {reason}")


@pytest.fixture(scope="module")
def pgbouncer() -> str:
    """The ``pgbouncer`` program (skips, or fails under ENVQ_REQUIRE_POSTGRES=1, when
    it is not installed)."""
    from bouncer import find_pgbouncer  # noqa: PLC0415

    program = find_pgbouncer()
    if program is None:
        _unavailable("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    return program


def _start(program: str, server: ThrowawayServer, mode: str) -> Bouncer:
    from bouncer import Bouncer  # noqa: PLC0415

    bouncer = Bouncer(program, server.socket_dir, mode=mode)
    try:
        bouncer.start()
    except (OSError, RuntimeError) as error:
        _unavailable(f"pgbouncer does not start here: {error}")
    return bouncer


@pytest.fixture(scope="module")
def bouncer(pg_server: ThrowawayServer, pgbouncer: str) -> Iterator[Bouncer]:
    """A PgBouncer in transaction mode in front of the session's server."""
    found = _start(pgbouncer, pg_server, "transaction")
    try:
        yield found
    finally:
        found.stop()


def _through(bouncer: Bouncer, direct: str) -> str:
    """The DSN of the database ``direct`` names, through ``bouncer``."""
    return bouncer.dsn(urllib.parse.unquote(urllib.parse.urlsplit(direct).path.lstrip("/")))


@pytest.fixture
def pooled_dsn(bouncer: Bouncer, fault_dsn: str) -> str:
    """The test's database through the transaction pooler."""
    return _through(bouncer, fault_dsn)


@pytest.fixture
def cluster(pooled_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    """The test's node processes, connected through the pooler; all killed at the end."""
    from fault_support import Cluster  # noqa: PLC0415

    nodes = Cluster(pooled_dsn, tmp_path)
    try:
        yield nodes
    finally:
        nodes.close()


def job(queue: str, key: str, *, gate: bool = False) -> envq.Envelope:
    """An envelope running ``fault_jobs.work`` (which records its run)."""
    import fault_jobs  # noqa: PLC0415

    return envq.Envelope(
        invoke=fault_jobs.work, id=key, payload={"queue": queue, "sleep": 0.0, "gate": gate}
    )


async def _count(dsn: str, queue: str, state: str) -> int:
    from fault_support import states  # noqa: PLC0415

    return (await states(dsn, queue)).get(state, 0)


def test_the_pooler_parameter_is_checked() -> None:
    """Only ``"transaction"`` (or None) is a pooler envq runs behind; ``listen_dsn`` is a
    DSN."""
    from envq.postgres import PgQueue  # noqa: PLC0415

    dsn = "postgresql://app@db/app"
    with pytest.raises(ValueError, match=r"pooler must be 'transaction' or None.*'statement'"):
        PgQueue(dsn, pooler="statement")
    with pytest.raises(TypeError, match=r"pooler"):
        PgQueue(dsn, pooler=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"listen_dsn"):
        PgQueue(dsn, pooler="transaction", listen_dsn=" ")
    assert PgQueue(dsn, pooler="transaction", listen_dsn=dsn).pooler == "transaction"


async def test_connect_through_a_transaction_pooler_is_refused_without_the_setting(
    pooled_dsn: str, cluster: Cluster
) -> None:
    """Without ``pooler="transaction"``, ``connect()`` finds the pooler (a session that
    moves between server sessions) and refuses, naming the setting, and keeps no
    connection; the node command exits with the message, not a traceback."""
    from envq.postgres import PgQueue  # noqa: PLC0415

    queue = PgQueue(pooled_dsn, "refused", workers=0)
    with pytest.raises(ValueError, match=r"pooler='transaction'") as refused:
        await queue.connect()
    assert "listen_dsn" in str(refused.value)
    with pytest.raises(RuntimeError, match="not connected"):
        await queue.state()

    node = cluster.spawn("refused", "unset", lease=LEASE, poll=POLL)
    code = await asyncio.to_thread(node.proc.wait, 120)
    assert code == 1, node.stderr()
    assert "--pooler transaction" in node.stderr(), node.stderr()
    assert "Traceback" not in node.stderr(), node.stderr()


async def test_a_session_pool_needs_no_setting(
    pg_server: ThrowawayServer, pgbouncer: str, fault_dsn: str
) -> None:
    """A pooler in session mode keeps one server session per client: nothing to set,
    and ``connect()`` does not refuse it."""
    from envq.postgres import PgQueue  # noqa: PLC0415

    session_pool = _start(pgbouncer, pg_server, "session")
    try:
        async with PgQueue(_through(session_pool, fault_dsn), "session", workers=0) as q:
            await q.start()
            assert await q.send(job("session", "s1")) == 1
            assert await q.counts() == {"ready": 1}
    finally:
        session_pool.stop()


async def test_install_and_the_operator_command_through_the_pooler(
    pg_server: ThrowawayServer, bouncer: Bouncer
) -> None:
    """``install()`` and ``python -m envq.postgres status`` work through the pooler."""
    import asyncpg  # noqa: PLC0415

    from envq.postgres import PgQueue  # noqa: PLC0415
    from envq.postgres.__main__ import main  # noqa: PLC0415

    name = f"pooled_install_{os.getpid()}"
    admin = await asyncpg.connect(pg_server.dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = bouncer.dsn(name)
    queue = PgQueue(dsn, "installed", workers=0, pooler="transaction")
    await queue.install()
    await queue.install()  # a second time: nothing to do
    async with queue:
        await queue.start()
        await queue.send(job("installed", "i1"))
    out = io.StringIO()
    assert await asyncio.to_thread(main, ["status", "--dsn", dsn, "--json"], out) == 0
    queues = json.loads(out.getvalue())["queues"]
    assert [(x["name"], x["counts"]) for x in queues] == [("installed", {"ready": 1})]


@pytest.mark.parametrize("listen", ["direct", "polling"])
async def test_a_node_runs_through_a_transaction_pooler(
    listen: str, fault_dsn: str, pooled_dsn: str, cluster: Cluster
) -> None:
    """A producer and a node process, both through PgBouncer in transaction mode with
    ``pooler="transaction"``, the node listening on a direct session (``listen_dsn``) or
    polling: the envelopes run to completion, a stop, a start again and a terminate
    reach the node, the terminate hands back every envelope not ended, and the history
    accounts for every envelope (one committed end per attempt); a subscriber hears of
    every success; no statement ever ran into another's prepared statement."""
    from fault_support import check_history, fetch, until  # noqa: PLC0415

    from envq.postgres import PgQueue  # noqa: PLC0415

    q = f"pooled_{listen}"
    env = {"ENVQ_LISTEN_DSN": fault_dsn} if listen == "direct" else {}
    (node,) = cluster.start(
        q,
        [f"pooled-{listen}"],
        workers=4,
        lease=LEASE,
        poll=POLL,
        options=["--pooler", "transaction"],
        env=env,
    )
    succeeded: set[object] = set()

    def heard(event: envq.Event) -> None:
        if event.to_state is envq.EnvState.SUCCEEDED and event.envelope is not None:
            succeeded.add(event.envelope.id)

    async def listening() -> int:
        rows = await fetch(
            fault_dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
            " AND query ILIKE 'LISTEN%'",
            f"envq:{node.name}",
        )
        return int(rows[0][0])

    async def listens_directly() -> bool:
        return await listening() == 1

    async def heard_every_success() -> bool:
        return len(succeeded) == 120

    producer = PgQueue(pooled_dsn, q, workers=0, lease=LEASE, poll=POLL, pooler="transaction")
    async with producer:
        unsubscribe = producer.subscribe(heard)
        await producer.start()
        first = [f"a{i}" for i in range(100)]
        assert await producer.send(*(job(q, key) for key in first)) == 100
        await until(
            lambda: _succeeded(fault_dsn, q, 100), "the first batch to succeed", cluster=cluster
        )
        if listen == "direct":
            await until(listens_directly, "the node's direct listening session")
        else:
            assert await listening() == 0

        await producer.stop(envq.StopMode.DRAIN)
        assert await producer.state() is envq.QueueState.STOPPED
        await producer.start()
        second = [f"b{i}" for i in range(20)]
        gated = [f"g{i}" for i in range(10)]
        await producer.send(*(job(q, key) for key in second))
        await producer.send(*(job(q, key, gate=True) for key in gated))
        await until(lambda: _succeeded(fault_dsn, q, 120), "the second batch", cluster=cluster)

        async def four_held() -> bool:
            rows = await fetch(
                fault_dsn,
                "SELECT count(*) FROM fault_runs WHERE queue = $1 AND ended_at IS NULL",
                q,
            )
            return int(rows[0][0]) == 4

        await until(four_held, "four gated attempts to run", cluster=cluster)
        handed = await producer.terminate()
        assert sorted(str(e.id) for e in handed) == sorted(gated)
        assert await producer.state() is envq.QueueState.TERMINATED
        await until(heard_every_success, "the subscriber to hear every success")
        unsubscribe()
    assert succeeded == set(first + second)
    await check_history(fault_dsn, q, first + second)
    assert await _count(fault_dsn, q, "returned") == 0
    node.leave()
    log = node.stderr()
    assert "prepared statement" not in log, log[-3000:]
    for sign in ("never retrieved", "ERROR:", "CRITICAL:", "Traceback"):
        assert sign not in log, log[-3000:]


async def _succeeded(dsn: str, queue: str, count: int) -> bool:
    return await _count(dsn, queue, "succeeded") == count
