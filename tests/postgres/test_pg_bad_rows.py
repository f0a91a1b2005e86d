"""One bad row must not lose envelopes or wedge a PostgreSQL queue's nodes.

A send refuses times the database cannot compute a next run from; a row that gets
past that (an ``on_failure`` decision, a row written by an older version: the send
check is switched off here to make one) is isolated by the finisher and the reaper:
its end is retried alone and, when the database still refuses it, it ends as a
dropped failure while every other attempt ends as usual. ``terminate()`` never deletes
a row it cannot hand back, and a node that cannot import an envelope's code counts a
failed attempt under the envelope's retry policy rather than failing it for good.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pg_jobs
import pytest

import envq
from envq._errors import BadEnvelope
from envq.postgres import PgQueue, _codec

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

#: Longer than PostgreSQL's timestamps reach from now (about 31.7 million years).
FAR = 1e15


async def _leave(q: PgQueue) -> None:
    """Close, bounded: a wedged node would never finish leaving."""
    try:
        await asyncio.wait_for(q.close(), 10)
    except Exception:
        if q._pool is not None:
            q._pool.terminate()
        raise


def _name() -> str:
    return f"bad-{uuid.uuid4().hex[:8]}"


async def _until(q: PgQueue, state: str, n: int, limit: float) -> None:
    """Wait for ``n`` envelopes of ``q`` to be in ``state`` (TimeoutError after ``limit``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while (await q.counts()).get(state, 0) < n:
        if loop.time() > end:
            raise TimeoutError(f"{n} envelope(s) not {state} within {limit} s: {await q.counts()}")
        await asyncio.sleep(0.1)


@pytest.fixture
def unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a send admit times the database cannot compute with (as a row written before
    the send checked them would be)."""
    monkeypatch.setattr(_codec, "_storable", lambda field, value, label: None, raising=False)


def far_retry(env: envq.Envelope, exc: BaseException | None, attempt: int) -> envq.Decision:
    """on_failure: retry after longer than the database's timestamps reach."""
    return envq.retry_after(FAR)


# -- the send refuses what the database cannot hold ----------------------------------------


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("interval", {"interval": FAR}),
        ("deadline", {"deadline": FAR}),
        ("delay", {"delay": FAR}),
        ("retry.base", {"retry": envq.Retry(attempts=3, base=FAR, cap=FAR, jitter=False)}),
        ("retry.cap", {"retry": envq.Retry(attempts=3, base=1.0, cap=FAR, jitter=False)}),
        ("not_before", {"not_before": dt.datetime(9999, 1, 1, tzinfo=dt.UTC)}),
    ],
)
async def test_a_time_the_database_cannot_hold_is_refused_at_send(
    pg_dsn: str, field: str, fields: dict[str, object]
) -> None:
    q = PgQueue(pg_dsn, _name(), workers=0)
    await q.install()
    async with q:
        await q.start()
        env = envq.Envelope(invoke=pg_jobs.noop, **fields)  # type: ignore[arg-type]
        with pytest.raises(BadEnvelope, match=rf"{field}=.*at most") as caught:
            await q.send(env)
        assert not isinstance(caught.value, TypeError)
        assert await q.counts() == {}


async def test_the_longest_time_a_send_allows_is_stored_and_ends(pg_dsn: str) -> None:
    """At the bound itself: admitted, and its next run can be written (a periodic
    envelope of that interval runs once and is rescheduled)."""
    q = PgQueue(pg_dsn, _name(), workers=2, lease=5.0, poll=0.1)
    await q.install()
    await q.connect()
    try:
        await q.start()
        longest = _codec.MAX_SECONDS
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="far", interval=longest))
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="later", delay=longest))
        await _until(q, "delayed", 2, 20)
        assert (await q.counts()).get("failed", 0) == 0
        assert len(await asyncio.wait_for(q.terminate(), 20)) == 2
    finally:
        await _leave(q)


# -- the finisher isolates a bad end ------------------------------------------------------


@pytest.mark.usefixtures("unchecked")
async def test_a_periodic_envelope_whose_next_run_overflows_does_not_wedge_the_node(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its end cannot be written; it alone ends as a dropped failure (FAILED), logged at
    ERROR, and the node's later attempts end."""
    caplog.set_level(logging.ERROR, logger="envq")
    q = PgQueue(pg_dsn, _name(), workers=2, lease=5.0, poll=0.1)
    await q.install()
    await q.connect()
    try:
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="far", interval=FAR))
        await q.send(*[envq.Envelope(invoke=pg_jobs.noop, id=f"ok-{i}") for i in range(3)])
        await _until(q, "failed", 1, 20)
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="healthy"))
        await _until(q, "succeeded", 4, 20)
        assert await q.counts() == {"failed": 1, "succeeded": 4}
        assert any("dropped failure" in r.getMessage() for r in caplog.records)
        await asyncio.wait_for(q.terminate(), 20)
    finally:
        await _leave(q)


@pytest.mark.usefixtures("unchecked")
async def test_a_retry_backoff_that_overflows_does_not_wedge_the_node(pg_dsn: str) -> None:
    q = PgQueue(pg_dsn, _name(), workers=2, lease=5.0, poll=0.1)
    await q.install()
    await q.connect()
    try:
        await q.start()
        policy = envq.Retry(attempts=3, base=FAR, cap=FAR, jitter=False)
        await q.send(envq.Envelope(invoke=pg_jobs.fail, id="bad", retry=policy))
        await _until(q, "failed", 1, 20)
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="healthy"))
        await _until(q, "succeeded", 1, 20)
        await asyncio.wait_for(q.terminate(), 20)
    finally:
        await _leave(q)


async def test_an_on_failure_delay_that_overflows_does_not_wedge_the_node(pg_dsn: str) -> None:
    """A decision's delay is not known at send: the finisher isolates it."""
    q = PgQueue(pg_dsn, _name(), workers=2, lease=5.0, poll=0.1)
    await q.install()
    await q.connect()
    try:
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.fail, id="bad", on_failure=far_retry))
        await _until(q, "failed", 1, 20)
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="healthy"))
        await _until(q, "succeeded", 1, 20)
        await asyncio.wait_for(q.terminate(), 20)
    finally:
        await _leave(q)


# -- the reaper isolates a bad row ---------------------------------------------------------


@pytest.mark.usefixtures("unchecked")
async def test_an_expired_attempt_whose_next_run_overflows_does_not_block_stop(
    pg_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Reaping it fails; it ends as a dropped failure, the row after it is reaped too,
    and stop() reaches STOPPED."""
    caplog.set_level(logging.ERROR, logger="envq")
    name = _name()
    q = PgQueue(pg_dsn, name, workers=0, poll=0.1)
    await q.install()
    async with q:
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="far", interval=FAR))
        retry = envq.Retry(attempts=3, base=0.1)
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="after", retry=retry))
        conn = await asyncpg.connect(pg_dsn)
        try:  # a node claims both and dies
            await conn.fetch("SELECT * FROM envq.claim($1, 'dead', 2, interval '0.2 s')", name)
        finally:
            await conn.close()
        await asyncio.sleep(0.5)
        await asyncio.wait_for(q.stop(envq.StopMode.STOP), 15)
        assert (await q.state()) is envq.QueueState.STOPPED
        # "after" is reaped as usual: a retry, parked by the stop.
        assert await q.counts() == {"failed": 1, "parked": 1}
        assert any("could not reap" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("unchecked")
async def test_a_serving_node_reaps_past_a_bad_row(pg_dsn: str) -> None:
    """The keeper of a serving node reaps the row after the bad one too, and the node
    goes on running attempts."""
    name = _name()
    prod = PgQueue(pg_dsn, name, workers=0, poll=0.1)
    await prod.install()
    node = PgQueue(pg_dsn, name, workers=2, lease=1.0, poll=0.1)
    async with prod:
        await prod.start()
        await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="far", interval=FAR))
        await prod.send(envq.Envelope(invoke=pg_jobs.fail, id="after"))
        conn = await asyncpg.connect(pg_dsn)
        try:  # a node claims both and dies
            await conn.fetch("SELECT * FROM envq.claim($1, 'dead', 2, interval '0.2 s')", name)
        finally:
            await conn.close()
        await node.start()
        try:
            await _until(prod, "failed", 2, 20)
            assert node._node.counts_local["reaped"] == 2  # by the serving node's keeper
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="next"))
            await _until(prod, "succeeded", 1, 20)
            await asyncio.wait_for(prod.stop(envq.StopMode.STOP), 15)
            assert (await prod.state()) is envq.QueueState.STOPPED
        finally:
            await _leave(node)


# -- terminate() loses nothing -------------------------------------------------------------


def _module(tmp_path: Path) -> str:
    """A module only processes given ``tmp_path`` can import; its name."""
    name = f"only_there_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("async def job(env):\n    pass\n")
    return name


async def test_terminate_loses_no_envelope_whose_code_it_cannot_import(
    pg_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """They stay RETURNED in the database, and a later terminate() in a process that
    can import them hands them back."""
    caplog.set_level(logging.ERROR, logger="envq")
    name = _name()
    mod = _module(tmp_path)
    q = PgQueue(pg_dsn, name, workers=0)
    await q.install()
    code = textwrap.dedent(f"""
        import asyncio, sys, envq, {mod}
        from envq.postgres import PgQueue
        async def m():
            async with PgQueue(sys.argv[1], {name!r}, workers=0) as q:
                await q.send(*[envq.Envelope(invoke={mod}.job, id=i) for i in range(3)])
                await q.send(envq.Envelope(invoke=envq.drop, id="known"))
        asyncio.run(m())
    """)
    subprocess.run(  # noqa: ASYNC221 - a short producer process, before any queue runs
        [sys.executable, "-c", code, pg_dsn],
        check=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": ""},
    )
    async with q:
        handed = await q.terminate()
        assert [env.id for env in handed] == ["known"]
        assert await q.counts() == {"returned": 3}
        assert any("not handed back" in r.getMessage() for r in caplog.records)
    sys.path.insert(0, str(tmp_path))
    try:
        again = PgQueue(pg_dsn, name, workers=0)
        async with again:
            assert sorted(env.id for env in await again.terminate()) == [0, 1, 2]
            assert await again.counts() == {}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(mod, None)


# -- a node without the code ---------------------------------------------------------------


@pytest.fixture
def hidden_module(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A module importable now, and the directory to take off ``sys.path`` to hide it."""
    mod = _module(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        yield mod, tmp_path
    finally:
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
        sys.modules.pop(mod, None)
        _codec.resolve.cache_clear()
        _codec._PROTOTYPES.clear()


def _hide(mod: str, where: Path) -> None:
    sys.path.remove(str(where))
    sys.modules.pop(mod, None)
    _codec.resolve.cache_clear()
    _codec._PROTOTYPES.clear()


async def test_a_node_without_the_code_retries_under_the_policy(
    pg_dsn: str, hidden_module: tuple[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A node of an older deploy: the attempt fails and is retried under the
    envelope's Retry policy (logged at WARNING), so that once the code is there the
    envelope runs; without attempts left it fails."""
    import importlib  # noqa: PLC0415

    caplog.set_level(logging.WARNING, logger="envq")
    mod, where = hidden_module
    job = importlib.import_module(mod).job
    name = _name()
    prod = PgQueue(pg_dsn, name, workers=0, poll=0.1)
    await prod.install()
    async with prod:
        await prod.start()
        policy = envq.Retry(attempts=20, base=0.3, cap=0.3, jitter=False)
        await prod.send(envq.Envelope(invoke=job, id="rolled", retry=policy))
        await prod.send(
            envq.Envelope(invoke=job, id="once", retry=envq.Retry(attempts=1, base=0.1))
        )
        _hide(mod, where)
        node = PgQueue(pg_dsn, name, workers=2, lease=5.0, poll=0.1)
        await node.start()
        try:
            await _until(prod, "failed", 1, 20)
            conn = await asyncpg.connect(pg_dsn)
            try:
                rows = await conn.fetch(
                    "SELECT id, state::text, attempt FROM envq.envelopes WHERE queue = $1",
                    name,
                )
            finally:
                await conn.close()
            by_id = {r["id"]: r for r in rows}
            assert by_id['"once"']["state"] == "failed"
            assert by_id['"rolled"']["state"] != "failed"
            assert any("cannot run on node" in r.getMessage() for r in caplog.records)
            sys.path.insert(0, str(where))  # the new deploy
            await _until(prod, "succeeded", 1, 20)
        finally:
            await _leave(node)
