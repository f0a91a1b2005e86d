"""Helpers of the fault tests: node processes, a database that keeps a history of every
move, and the checks of that history against what the jobs recorded.

Every move of an envelope row is recorded in ``fault_moves`` by a trigger that fires
before envq's own (so it sees the move's event; a move envq's trigger refuses is rolled
back with its record). Each attempt's job records itself in ``fault_runs``
(``fault_jobs``). :func:`check_history` reads both and checks, per envelope, that every
claim (a new lease token) was ended exactly once, by a move naming that token, that the
leases never overlapped, and that every result committed by a ``finish`` was produced by
a run that started and ended inside its lease.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import attrs

from envq.postgres._server import ThrowawayServer
from envq.postgres.schema import render

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

_AUDIT = """
CREATE TABLE fault_runs (
    run bigserial PRIMARY KEY,
    queue text NOT NULL,
    key text NOT NULL,
    seq bigint NOT NULL,
    attempt integer NOT NULL,
    token uuid,
    node text NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at timestamptz,
    how text
);
CREATE TABLE fault_gates (key text PRIMARY KEY);
CREATE TABLE fault_hooks (
    n bigserial PRIMARY KEY,
    queue text NOT NULL,
    key text NOT NULL,
    node text NOT NULL,
    hook text NOT NULL,
    cause text,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE fault_moves (
    n bigserial PRIMARY KEY,
    seq bigint NOT NULL,
    at timestamptz NOT NULL,
    old_state text,
    new_state text NOT NULL,
    event text,
    attempt integer NOT NULL,
    old_token uuid,
    new_token uuid,
    owner text
);
CREATE FUNCTION fault_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO fault_moves (seq, at, new_state, event, attempt)
        VALUES (NEW.seq, clock_timestamp(), NEW.state, NEW.event, NEW.attempt);
    ELSIF NEW.state IS DISTINCT FROM OLD.state
          OR NEW.lease_token IS DISTINCT FROM OLD.lease_token THEN
        INSERT INTO fault_moves (seq, at, old_state, new_state, event, attempt,
                                 old_token, new_token, owner)
        VALUES (NEW.seq, clock_timestamp(), OLD.state, NEW.state, NEW.event, NEW.attempt,
                OLD.lease_token, NEW.lease_token,
                -- the node's name: a lease owner is the name and a suffix of its object
                regexp_replace(coalesce(NEW.lease_owner, OLD.lease_owner), '#[0-9a-f]{8}$', ''));
    END IF;
    RETURN NEW;
END
$$;
-- Named to fire before envq's trigger (alphabetical order), which clears the event.
CREATE TRIGGER a_fault_audit BEFORE INSERT OR UPDATE ON envq.envelopes
    FOR EACH ROW EXECUTE FUNCTION fault_audit();
"""

_databases = itertools.count()


async def create_fault_database(server: ThrowawayServer) -> str:
    """A new database with envq's schema and the history tables; its DSN."""
    name = f"faults_{os.getpid()}_{next(_databases)}"
    admin = await asyncpg.connect(server.dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        # The session server does not wait for the disk (synchronous_commit=off): a
        # crash there may lose commits already acknowledged. These tests crash it and
        # count on what was acknowledged, so here every commit waits for its WAL.
        await admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = on')
    finally:
        await admin.close()
    conn = await asyncpg.connect(server.dsn(name))
    try:
        await conn.execute(render())
        await conn.execute(_AUDIT)
    finally:
        await conn.close()
    return server.dsn(name)


def restart_server(server: ThrowawayServer) -> None:
    """``pg_ctl restart -m immediate``: every session is cut, the server recovers from a
    crash and comes back with the options it was started with."""
    directory = server.socket_dir
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        prefix = ("runuser", "-u", "postgres", "--")
    done = subprocess.run(
        [
            *prefix,
            str(server.bindir / "pg_ctl"),
            "-D",
            str(directory / "data"),
            "-l",
            str(server.log_file),
            "-m",
            "immediate",
            "-w",
            "-t",
            "60",
            "restart",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout


@attrs.define
class Node:
    """A node process: ``python -m envq.postgres.node``."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    @property
    def alive(self) -> bool:
        """The process has not exited."""
        return self.proc.poll() is None

    def stdout(self) -> str:
        """What it printed so far."""
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        """What it logged so far."""
        return self.err.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process."""
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """``kill -9``, and reap it."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def leave(self, timeout: float = 60.0) -> str:
        """SIGTERM, wait for a clean exit (status 0); its stdout."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        assert code == 0, f"node {self.name} exited with {code}:\n{self.stderr()[-3000:]}"
        return self.stdout()


class Cluster:
    """The node processes of one test; every one still running is killed at the end."""

    def __init__(self, dsn: str, directory: Path) -> None:
        self.dsn = dsn
        self.directory = directory
        self.nodes: list[Node] = []

    def spawn(
        self,
        queue: str,
        name: str,
        *,
        workers: int = 2,
        lease: float = 1.0,
        poll: float = 0.2,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> Node:
        """Start a node on ``queue`` (not waiting for it to serve); ``options``: more
        arguments of the node command, ``env``: more variables of its environment."""
        env = {**os.environ, **(env or {})}
        env["ENVQ_DSN"] = self.dsn
        env["ENVQ_FAULT_NODE"] = name
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        out = self.directory / f"{name}.out"
        err = self.directory / f"{name}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "envq.postgres.node",
                    "--queue",
                    queue,
                    "--workers",
                    str(workers),
                    "--lease",
                    str(lease),
                    "--poll",
                    str(poll),
                    "--node",
                    name,
                    "--log",
                    "INFO",
                    *options,
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=o,
                stderr=e,
                cwd=ROOT,
            )
        node = Node(name, proc, out, err)
        self.nodes.append(node)
        return node

    def start(self, queue: str, names: Iterable[str], **options: Any) -> list[Node]:
        """Start nodes and wait until each serves."""
        nodes = [self.spawn(queue, name, **options) for name in names]
        until = time.monotonic() + 120
        for node in nodes:
            while f"ready {node.name}" not in node.stdout():
                assert node.alive, f"node {node.name} died:\n{node.stderr()[-3000:]}"
                assert time.monotonic() < until, f"node {node.name} never served"
                time.sleep(0.05)
        return nodes

    def report(self) -> str:
        """The tail of every node's log, for a failure message."""
        return "\n".join(
            f"--- {n.name} ({'alive' if n.alive else n.proc.returncode})\n{n.stderr()[-1500:]}"
            for n in self.nodes
        )

    def close(self) -> None:
        """Kill every node still running (a stopped one is killed as well)."""
        for node in self.nodes:
            if node.alive:
                node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(30)


async def until(
    check: Callable[[], Awaitable[bool]],
    what: str,
    timeout: float = 60.0,  # noqa: ASYNC109 - a bound on waiting for a condition
    cluster: Cluster | None = None,
) -> None:
    """Wait until ``check()`` is true (polled; a database error counts as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await check():
                return
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            pass
        if time.monotonic() > deadline:
            detail = "" if cluster is None else "\n" + cluster.report()
            raise AssertionError(f"timed out waiting for {what}{detail}")
        await asyncio.sleep(0.1)


async def fetch(dsn: str, sql: str, *args: object) -> list[asyncpg.Record]:
    """One query on a connection of its own."""
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def states(dsn: str, queue: str) -> dict[str, int]:
    """How many envelopes of ``queue`` are in each state."""
    rows = await fetch(
        dsn,
        "SELECT state::text, count(*) FROM envq.envelopes WHERE queue = $1 GROUP BY 1",
        queue,
    )
    return {r[0]: r[1] for r in rows}


@attrs.frozen
class Lease:
    """One attempt as the database saw it: claimed with ``token`` by ``owner`` at
    ``start``, ended at ``end`` by the move ``event`` (``attempt_expired``: reaped)."""

    attempt: int
    token: Any
    owner: str
    start: Any
    end: Any
    event: str
    to: str


@attrs.frozen
class Story:
    """One envelope: its row and its attempts, and the runs its jobs recorded."""

    key: str
    state: str
    leases: tuple[Lease, ...]
    runs: tuple[asyncpg.Record, ...]

    @property
    def committed(self) -> list[Lease]:
        """The attempts whose end was committed by their own node's ``finish``."""
        return [lease for lease in self.leases if lease.event != "attempt_expired"]


async def check_history(
    dsn: str,
    queue: str,
    keys: Iterable[str],
    *,
    ends: Iterable[str] = ("succeeded",),
    runs: bool = True,
) -> dict[str, Story]:
    """Check every envelope ``keys`` names has exactly one row in ``queue``, in one of
    the states ``ends``, and that its history is sound (see the module's docstring); the
    story of each. ``runs``: check the runs recorded by ``fault_jobs.work`` too (False
    for a job that records none)."""
    keys = list(keys)
    ends = set(ends)
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT seq, id, state::text, attempt FROM envq.envelopes WHERE queue = $1", queue
        )
        moves = await conn.fetch(
            "SELECT m.* FROM fault_moves AS m JOIN envq.envelopes AS e USING (seq)"
            " WHERE e.queue = $1 ORDER BY m.n",
            queue,
        )
        recorded = await conn.fetch("SELECT * FROM fault_runs WHERE queue = $1 ORDER BY run", queue)
    finally:
        await conn.close()
    found = [json.loads(r["id"]) for r in rows]
    assert sorted(found) == sorted(keys), f"envelopes lost or doubled: {sorted(found)}"
    by_seq: dict[int, list[asyncpg.Record]] = {}
    for m in moves:
        by_seq.setdefault(m["seq"], []).append(m)
    runs_of: dict[int, list[asyncpg.Record]] = {}
    for run in recorded:
        runs_of.setdefault(run["seq"], []).append(run)
    stories: dict[str, Story] = {}
    for row in rows:
        key = json.loads(row["id"])
        assert row["state"] in ends, f"{key}: ended {row['state']}, not one of {sorted(ends)}"
        leases = _leases(key, row, by_seq.get(row["seq"], []))
        story = Story(key, row["state"], tuple(leases), tuple(runs_of.get(row["seq"], [])))
        if runs:
            _check_runs(story)
        stories[key] = story
    return stories


def _leases(key: str, row: asyncpg.Record, moves: list[asyncpg.Record]) -> list[Lease]:
    """The attempts of one envelope, checked: the moves follow one another, each claim
    starts a new lease and is ended once by a move naming its token."""
    state: str | None = None
    held: asyncpg.Record | None = None
    leases: list[Lease] = []
    for m in moves:
        assert m["old_state"] == state, f"{key}: move {dict(m)} does not follow {state}"
        if m["new_state"] == "running":
            assert held is None, f"{key}: claimed twice without an end: {dict(m)}"
            assert m["event"] == "dispatch", dict(m)
            assert m["new_token"] is not None, dict(m)
            assert m["attempt"] == len(leases) + 1, f"{key}: attempt {m['attempt']} out of order"
            held = m
        elif m["old_state"] == "running":
            assert held is not None, dict(m)
            assert m["old_token"] == held["new_token"], f"{key}: ended by another token"
            assert m["new_token"] is None, dict(m)
            if leases:
                assert held["at"] >= leases[-1].end, f"{key}: leases overlap"
            leases.append(
                Lease(
                    held["attempt"],
                    held["new_token"],
                    held["owner"],
                    held["at"],
                    m["at"],
                    m["event"],
                    m["new_state"],
                )
            )
            held = None
        state = m["new_state"]
    assert state == row["state"], f"{key}: history ends {state}, the row is {row['state']}"
    assert held is None, f"{key}: still claimed"
    assert len(leases) == row["attempt"], f"{key}: {len(leases)} claims, attempt {row['attempt']}"
    return leases


def _check_runs(story: Story) -> None:
    """Every run ran under one of the envelope's leases, once per lease; an end a
    ``finish`` committed came from a run that started inside its lease and (when it
    recorded its end) ended inside it, a success from a run that recorded it (a failure
    may have failed to record itself); no two
    committed runs overlap."""
    tokens = {lease.token: lease for lease in story.leases}
    seen: set[Any] = set()
    for run in story.runs:
        assert run["token"] in tokens, f"{story.key}: a run under no lease of it: {dict(run)}"
        assert run["token"] not in seen, f"{story.key}: two runs under one lease"
        seen.add(run["token"])
        lease = tokens[run["token"]]
        assert run["attempt"] == lease.attempt, dict(run)
        assert run["node"] == lease.owner, dict(run)
    by_token = {run["token"]: run for run in story.runs}
    spans = []
    for lease in story.committed:
        run = by_token.get(lease.token)
        label = f"{story.key}: attempt {lease.attempt} ({lease.event})"
        if run is None:  # its job failed before recording its start
            assert lease.event != "attempt_ok", f"{label} committed, never ran"
            continue
        assert lease.start <= run["started_at"], f"{label} ran before its lease"
        if lease.event == "attempt_ok":
            assert run["how"] == "ok", f"{label} committed, its run ended {run['how']}"
        # (A failed attempt may have failed to record its end.)
        if run["ended_at"] is not None:
            assert run["ended_at"] <= lease.end, f"{label} committed outside its lease"
            spans.append((run["started_at"], run["ended_at"]))
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, f"{story.key}: committed runs overlap"
