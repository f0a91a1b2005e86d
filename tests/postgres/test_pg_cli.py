"""``python -m envq.postgres``: the operator's command line — its subcommands against a
real database, their output (text and ``--json``), and its exit codes on bad input
(no DSN, a DSN that does not reach, an unknown queue, a database without envq)."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from envq.postgres.__main__ import EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE, main
from envq.postgres._server import ThrowawayServer
from envq.postgres.schema import SCHEMA_VERSION, render

asyncpg = pytest.importorskip("asyncpg")

SCHEMAS = Path(__file__).resolve().parent / "schemas"
ROOT = Path(__file__).resolve().parents[2]
_names = itertools.count()


def _database(server: ThrowawayServer, sql: str | None = None) -> str:
    """A new database holding ``sql`` (nothing when None); its DSN."""
    return asyncio.run(_new_database(server, sql))


def _sql(dsn: str, *statements: str) -> None:
    async def run() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())


async def _new_database(server: ThrowawayServer, sql: str | None) -> str:
    name = f"cli_{next(_names)}_{uuid.uuid4().hex[:6]}"
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


def _run(*argv: str) -> tuple[int, str]:
    """``main(argv)`` in this process: its exit status and what it printed."""
    out = io.StringIO()
    try:
        code = main(list(argv), out)
    except SystemExit as exited:
        code = int(exited.code or 0)
    return code, out.getvalue()


def test_install_then_install_again(pg_server: ThrowawayServer) -> None:
    dsn = _database(pg_server)
    assert _run("install", "--dsn", dsn) == (
        0,
        f"installed envq's schema, version {SCHEMA_VERSION}\n",
    )
    code, out = _run("install", "--dsn", dsn, "--json")
    assert code == 0
    assert json.loads(out) == {"from": SCHEMA_VERSION, "to": SCHEMA_VERSION}


def test_migrate_upgrades_the_oldest_schema_and_dry_run_applies_nothing(
    pg_server: ThrowawayServer,
) -> None:
    dsn = _database(pg_server, (SCHEMAS / "v3.sql").read_text())
    code, out = _run("migrate", "--dsn", dsn, "--dry-run", "--json")
    assert code == 0
    assert json.loads(out) == {"from": 3, "pending": list(range(4, SCHEMA_VERSION + 1))}
    code, out = _run("migrate", "--dsn", dsn, "--dry-run")
    assert "would apply 0004.sql" in out
    assert _run("migrate", "--dsn", dsn) == (
        0,
        f"upgraded envq's schema from version 3 to {SCHEMA_VERSION}\n",
    )
    assert _run("migrate", "--dsn", dsn)[1].endswith("nothing to do\n")


def test_migrate_without_a_schema_says_to_install(
    pg_server: ThrowawayServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = _database(pg_server)
    assert _run("migrate", "--dsn", dsn)[0] == EXIT_REFUSED
    assert "install" in capsys.readouterr().err


def test_status_lists_queues_counts_and_nodes(pg_server: ThrowawayServer) -> None:
    dsn = _database(pg_server, render())
    _sql(
        dsn,
        "INSERT INTO envq.queues (name, capacity) VALUES ('mail', 100)",
        "UPDATE envq.queues SET state = 'running', call = 'start'",
        *(
            "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
            f" VALUES ('mail', '{i}'::jsonb, 'm:f', 'one_off', 'ready', 'send')"
            for i in range(3)
        ),
        "SELECT * FROM envq.claim('mail', 'node-a#1', 2, interval '60 s')",
        "INSERT INTO envq.queues (name) VALUES ('idle')",
    )
    code, out = _run("status", "--dsn", dsn)
    assert code == 0
    assert "idle: init, capacity unlimited: empty" in out
    assert "mail: running, capacity 100: ready 1, running 2" in out
    assert "node node-a#1: 2 running" in out
    code, out = _run("status", "--dsn", dsn, "--queue", "mail", "--json")
    [mail] = json.loads(out)["queues"]
    assert mail["counts"] == {"ready": 1, "running": 2}
    assert [n["owner"] for n in mail["nodes"]] == ["node-a#1"]
    assert 0 < mail["nodes"][0]["expires_in_s"] <= 60


def test_status_lists_the_nodes_connected(pg_server: ThrowawayServer) -> None:
    """A node is seen by its sessions (``application_name`` ``envq:<node>``), holding
    leases or not."""
    dsn = _database(pg_server, render())
    opened, done = threading.Event(), threading.Event()

    async def hold() -> None:
        conn = await asyncpg.connect(dsn, server_settings={"application_name": "envq:node-z"})
        opened.set()
        await asyncio.get_running_loop().run_in_executor(None, done.wait)
        await conn.close()

    holder = threading.Thread(target=asyncio.run, args=(hold(),))
    holder.start()
    try:
        assert opened.wait(10)
        code, out = _run("status", "--dsn", dsn)
        assert code == 0
        assert re.search(r"^nodes connected: 1$", out, re.M)
        assert re.search(r"^  node-z: 1 session\(s\)", out, re.M)
        code, out = _run("status", "--dsn", dsn, "--json")
        assert [n["node"] for n in json.loads(out)["connected"]] == ["node-z"]
    finally:
        done.set()
        holder.join()


def test_status_of_an_unknown_queue_is_refused(
    pg_server: ThrowawayServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = _database(pg_server, render())
    assert _run("status", "--dsn", dsn, "--queue", "nope")[0] == EXIT_REFUSED
    assert "no queue named 'nope'" in capsys.readouterr().err


def test_status_of_an_old_schema_says_to_migrate(
    pg_server: ThrowawayServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = _database(pg_server, (SCHEMAS / "v3.sql").read_text())
    assert _run("status", "--dsn", dsn)[0] == EXIT_REFUSED
    assert "python -m envq.postgres migrate" in capsys.readouterr().err


def test_a_dsn_that_does_not_reach_exits_3_without_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dsn = "postgresql://ops:Hunter2#secret@127.0.0.1:1/nothing"
    assert _run("status", "--dsn", dsn)[0] == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "cannot reach the database" in err
    for piece in ("Hunter2", "secret"):
        assert piece not in err


def test_no_dsn_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ENVQ_DSN", raising=False)
    assert _run("status")[0] == EXIT_USAGE
    assert "ENVQ_DSN" in capsys.readouterr().err


def test_an_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run("frobnicate", "--dsn", "postgresql://u@/d")[0] == EXIT_USAGE
    assert "invalid choice" in capsys.readouterr().err


def test_the_command_runs_as_a_module_with_the_dsn_from_the_environment(
    pg_server: ThrowawayServer,
) -> None:
    dsn = _database(pg_server)
    env = {**os.environ, "ENVQ_DSN": dsn}
    done = subprocess.run(
        [sys.executable, "-m", "envq.postgres", "install"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"version {SCHEMA_VERSION}" in done.stdout


# -- looking and acting --------------------------------------------------------------------


def _node_run(dsn: str, queue: str, envelopes: list[object], until: str) -> None:
    """Send ``envelopes`` to ``queue`` on a node of this process and run it until its
    counts hold ``until`` (a state present)."""
    import pg_jobs  # noqa: PLC0415

    from envq.postgres import PgQueue  # noqa: PLC0415

    async def run() -> None:
        q = PgQueue(dsn, queue, workers=2, lease=2.0, poll=0.05)
        async with q:
            await q.start()
            await q.send(*envelopes)  # type: ignore[arg-type]
            from fault_support import until as wait_until  # noqa: PLC0415

            async def reached() -> bool:
                return until in await q.counts()

            await wait_until(reached, f"a {until} envelope", timeout=30)
            await q.stop()

    del pg_jobs
    asyncio.run(run())


def test_list_show_retry_cancel_and_purge(pg_server: ThrowawayServer) -> None:
    import pg_jobs  # noqa: PLC0415

    import envq  # noqa: PLC0415

    dsn = _database(pg_server, render())
    _node_run(
        dsn,
        "ops",
        [
            envq.Envelope(invoke=pg_jobs.fail, id="broken", type="mail"),
            envq.Envelope(invoke=pg_jobs.noop, id=7, delay=600),
        ],
        "failed",
    )
    code, out = _run("list", "--dsn", dsn, "--queue", "ops", "--json")
    assert code == 0
    found = {e["id"]: e for e in json.loads(out)["envelopes"]}
    assert found["broken"]["state"] == "failed"
    assert found["broken"]["error"] == "builtins.RuntimeError"
    assert found[7]["state"] == "parked"  # the stop parked the delayed one
    code, out = _run("list", "--dsn", dsn, "--state", "failed", "--type", "mail")
    assert code == 0
    assert "broken" in out
    assert "parked" not in out
    code, out = _run("list", "--dsn", dsn, "--id", "7", "--json")
    assert [e["id"] for e in json.loads(out)["envelopes"]] == [7]
    # show: the row, the last error with its traceback, the failed attempt
    code, out = _run("show", "broken", "--dsn", dsn)
    assert code == 0
    assert "state: failed" in out
    assert "RuntimeError: broken fails" in out
    assert "Traceback (most recent call last)" in out
    assert re.search(
        r"^  1  error  on \S+  \S+ -> \S+  builtins.RuntimeError: broken fails$", out, re.M
    )
    code, out = _run("show", str(found["broken"]["seq"]), "--seq", "--dsn", dsn, "--json")
    shown = json.loads(out)
    assert shown["last_error"]["type"] == "builtins.RuntimeError"
    assert len(shown["history"]) == 1
    # retry needs the queue running (as a send); cancel works on the parked one
    assert _run("retry", "broken", "--queue", "ops", "--dsn", dsn)[0] == EXIT_REFUSED
    assert _run("cancel", "7", "--queue", "ops", "--dsn", dsn) == (
        0,
        "1 envelope(s) cancelled\n",
    )
    _sql(dsn, "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = 'ops'")
    assert _run("retry", "broken", "--queue", "ops", "--dsn", dsn) == (
        0,
        "1 envelope(s) sent back\n",
    )
    code, out = _run("show", "broken", "--dsn", dsn, "--json")
    assert json.loads(out)["state"] == "ready"
    # purge: nothing ended an hour ago; everything ended before now
    code, out = _run("purge", "--older-than", "1h", "--dsn", dsn, "--json")
    assert json.loads(out) == {"removed": {"ops": 0}}
    code, out = _run("purge", "--older-than", "0s", "--queue", "ops", "--dsn", dsn)
    assert out == "ops: 1 removed\n"  # the cancelled one (STOPPED); the retried is live


def test_show_and_act_refuse_what_is_not_there(
    pg_server: ThrowawayServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = _database(pg_server, render())
    _sql(dsn, "INSERT INTO envq.queues (name) VALUES ('q')")
    assert _run("show", "nope", "--dsn", dsn)[0] == EXIT_REFUSED
    assert "no envelope nope" in capsys.readouterr().err
    assert _run("show", "x", "--seq", "--dsn", dsn)[0] == EXIT_USAGE
    assert _run("retry", "a", "--queue", "missing", "--dsn", dsn)[0] == EXIT_REFUSED
    assert "no queue named 'missing'" in capsys.readouterr().err
    assert _run("cancel", "a", "--queue", "q", "--dsn", dsn)[0] == EXIT_REFUSED
    assert "no envelope cancelled" in capsys.readouterr().err
    assert _run("list", "--limit", "0", "--dsn", dsn)[0] == EXIT_USAGE
    assert _run("list", "--state", "bogus", "--dsn", dsn)[0] == EXIT_USAGE
    assert _run("purge", "--older-than", "soon", "--dsn", dsn)[0] == EXIT_USAGE
    assert _run("retry", "--queue", "q", "--dsn", dsn)[0] == EXIT_USAGE  # no ID
