"""``envq conform`` against the PostgreSQL driver (three PgQueue nodes, one database).

A short real-clock run of the conformance machine: every move the driver reports is
read back from the database's journal and checked against the model. The run fails
(exit status 1) on any violation that is not a declared divergence, and (2) when the
driver crashes or breaks the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import envq
from envq.conform.protocol import PROTOCOL
from envq.postgres import driver
from envq.postgres._observed import effect, in_order, merge
from envq.postgres._server import ThrowawayServer

#: A small run, on a time scale whose timing tolerance (a quarter of a model second,
#: 50 ms) covers the nodes' polling with room to spare on a loaded machine. Not the
#: default 0.05: see docs/postgres.md, "Conformance", for what still ends a run there.
ARGS = ("--examples", "3", "--steps", "20", "--time-scale", "0.2", "--derandomize")


def _conform(dsn: str, tmp_path: Path, *driver_args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "envq",
        "conform",
        *ARGS,
        "--no-shrink",
        "--save",
        str(tmp_path / "failures"),
        "--",
        sys.executable,
        "-m",
        "envq.postgres.driver",
        "--nodes",
        "3",
        "--dsn",
        dsn,
        *driver_args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=170, env=env, check=False
    )


def test_the_postgres_driver_conforms(pg_server: ThrowawayServer, tmp_path: Path) -> None:
    done = _conform(pg_server.dsn(), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "VIOLATION" not in done.stdout


@pytest.mark.real_clock
async def test_a_refused_send_may_come_before_what_the_nodes_did_while_it_ran(
    pg_dsn: str,
) -> None:
    """The queue is full (``a`` runs, capacity 1); ``send(b)`` is refused, and while the
    call is still under way ``a`` ends. The refusal made no move that places it: it is
    given as a range (``effect`` to ``effect_until``) that starts before the end of
    ``a``, where the harness finds the queue full."""
    session = driver.Session(pg_dsn, 1)
    driver._ACTIVE[:] = [session]
    await session.open()

    async def call(**command: Any) -> dict[str, Any]:
        response = await session.handle(command)
        assert response["ok"] or command["cmd"] == "send", response
        return response

    try:
        hello = (await call(cmd="hello", protocol=PROTOCOL, time_scale=0.05))["result"]
        # Its declared bounds: cancels and due moves within two polls and a statement.
        assert {"late_cancel", "late_due"} <= set(hello["features"])
        assert hello["cancel_latency"] == pytest.approx(0.6)
        assert hello["due_latency"] == pytest.approx(0.6)
        await call(cmd="queue", workers=1, capacity=1)
        await call(cmd="define", env="a", spec={"script": ["hang"]})
        await call(cmd="define", env="b", spec={})
        await call(cmd="start")
        await call(cmd="send", envs=["a"])
        await _hanging(session, "a")
        node = session.nodes[0]
        refuse = node.send
        db = session._pool()

        async def refused_while_a_ends(*envelopes: envq.Envelope) -> int:
            try:
                return await refuse(*envelopes)
            finally:
                await session.cmd_release({"env": "a", "plan": "ok"})
                ended = (
                    "SELECT count(*) FROM envq.journal WHERE queue = $1 AND to_state = 'succeeded'"
                )
                async with asyncio.timeout(10):
                    while not await db.fetchval(ended, session.queue_name):  # noqa: ASYNC110 - the node commits it
                        await asyncio.sleep(0.005)

        node.send = refused_while_a_ends  # type: ignore[method-assign]
        response = await call(cmd="send", envs=["b"])
        assert (response["ok"], response["error"]) == (False, "capacity_exceeded")
        ends = [
            i
            for i, ev in enumerate(response["events"])
            if ev["kind"] == "move" and ev["env"] == "a" and ev["to"] == "succeeded"
        ]
        assert len(ends) == 1
        assert response["effect"] <= ends[0] < response["effect_until"] <= response["at"]
    finally:
        await session.close()
        driver._ACTIVE.clear()


async def _hanging(session: driver.Session, name: str) -> None:
    """Wait (at most 10 s) until a node's attempt of ``name`` hangs at its gate."""
    async with asyncio.timeout(10):
        while name not in session.gates:  # noqa: ASYNC110 - set by the node's attempt
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _session(pg_dsn: str, *commands: dict[str, Any]) -> AsyncIterator[driver.Session]:
    """A driver session on one node, after ``commands`` (each answered ok)."""
    session = driver.Session(pg_dsn, 1)
    driver._ACTIVE[:] = [session]
    await session.open()
    try:
        for command in commands:
            assert (await session.handle(command))["ok"]
        yield session
    finally:
        await session.close()
        driver._ACTIVE.clear()


@pytest.mark.real_clock
async def test_a_move_that_saw_the_queue_running_comes_before_a_stop_it_raced(
    pg_dsn: str,
) -> None:
    """A stop is under way (not committed) when a keeper makes a DELAYED envelope due:
    the keeper saw the queue RUNNING and commits first, though its journal row was
    written after the stop's. The due move is reported before the stop."""
    import asyncpg  # noqa: PLC0415

    async with _session(
        pg_dsn,
        {"cmd": "hello", "protocol": PROTOCOL, "time_scale": 0.05},
        {"cmd": "queue", "workers": 1, "stop_mode": "drain"},
        {"cmd": "define", "env": "a", "spec": {"delay": 100.0}},
    ) as session:
        name = session.queue_name
        db = session._pool()
        # The queue runs, served by no node: the moves below are made by hand.
        await db.execute(
            "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = $1", name
        )
        await session.nodes[0].send(session.envs["a"])
        await db.execute(
            "UPDATE envq.envelopes SET due_at = clock_timestamp() WHERE queue = $1", name
        )
        stopper = await asyncpg.connect(pg_dsn)
        try:
            async with stopper.transaction():
                await stopper.execute(
                    "UPDATE envq.queues SET state = 'stopping', call = 'stop' WHERE name = $1",
                    name,
                )
                assert await db.fetchval("SELECT envq.due($1)", name) == 1
                await stopper.execute("SELECT envq.broadcast($1, 'stop')", name)
        finally:
            await stopper.close()
        response = await session.handle({"cmd": "stats"})
        moves = [(ev.get("from"), ev["to"]) for ev in response["events"]]
        assert moves.index(("delayed", "ready")) < moves.index(("running", "stopping"))


@pytest.mark.real_clock
async def test_stats_wait_for_a_stop_with_nothing_in_flight_to_end(pg_dsn: str) -> None:
    """A stop with nothing READY or RUNNING is ended by a node's keeper at its next
    round, not at once: the statistics wait for it (a settled queue)."""
    async with _session(
        pg_dsn,
        {"cmd": "hello", "protocol": PROTOCOL, "time_scale": 0.05},
        {"cmd": "queue", "workers": 1},
        {"cmd": "start"},
    ) as session:
        node = session.nodes[0]
        drained = node._try_drained

        async def late() -> None:
            await asyncio.sleep(0.1)  # a keeper round later than the settling pause
            await drained()

        node._try_drained = late  # type: ignore[method-assign]
        await session._pool().execute(
            "UPDATE envq.queues SET state = 'stopping', call = 'stop' WHERE name = $1",
            session.queue_name,
        )
        response = await session.handle({"cmd": "stats"})
        assert response["result"]["state"] == "stopped"
        moves = [(ev["from"], ev["to"]) for ev in response["events"] if ev["kind"] == "queue"]
        assert moves == [("running", "stopping"), ("stopping", "stopped")]


@pytest.mark.real_clock
async def test_an_admitted_send_takes_effect_after_the_end_that_made_room(pg_dsn: str) -> None:
    """The queue is full (``a`` runs, capacity 1) when the harness sends ``b``; ``a``
    ends before the send reaches the database, so ``b`` is admitted. The answer's
    ``effect`` places the end of ``a`` before the call, and ``b``'s admission after."""
    async with _session(
        pg_dsn,
        {"cmd": "hello", "protocol": PROTOCOL, "time_scale": 0.05},
        {"cmd": "queue", "workers": 1, "capacity": 1},
        {"cmd": "define", "env": "a", "spec": {"script": ["hang"]}},
        {"cmd": "define", "env": "b", "spec": {"delay": 100.0}},
        {"cmd": "start"},
        {"cmd": "send", "envs": ["a"]},
    ) as session:
        await _hanging(session, "a")
        node = session.nodes[0]
        admit = node.send
        db = session._pool()
        ended = "SELECT count(*) FROM envq.journal WHERE queue = $1 AND to_state = 'succeeded'"

        async def after_a_ends(*envelopes: envq.Envelope) -> int:
            await session.cmd_release({"env": "a", "plan": "ok"})
            async with asyncio.timeout(10):
                while not await db.fetchval(ended, session.queue_name):  # noqa: ASYNC110 - the node commits it
                    await asyncio.sleep(0.005)
            return await admit(*envelopes)

        node.send = after_a_ends  # type: ignore[method-assign]
        response = await session.handle({"cmd": "send", "envs": ["b"]})
        assert response["ok"], response
        moves = [(ev.get("env"), ev["to"]) for ev in response["events"]]
        assert moves.index(("a", "succeeded")) < response["effect"]
        assert response["effect"] == moves.index(("b", "delayed")) < response["at"]


@pytest.mark.real_clock
async def test_on_success_comes_after_the_end_numbered_in_its_stay(pg_dsn: str) -> None:
    """A node runs ``on_success`` once the attempt's end committed: the call is
    reported after the move that ended the attempt, numbered by the claims of the
    envelope's row (the second attempt, after a retry; the first again once the
    envelope was sent anew, a new row)."""
    spec = {"script": ["error"], "policy": "retry_now", "on_success": True}
    async with _session(
        pg_dsn,
        {"cmd": "hello", "protocol": PROTOCOL, "time_scale": 0.05},
        {"cmd": "queue", "workers": 1},
        {"cmd": "define", "env": "a", "spec": spec},
        {"cmd": "start"},
    ) as session:
        events: list[dict[str, Any]] = []

        async def until_called(times: int) -> None:
            async with asyncio.timeout(10):
                while sum(ev["kind"] == "on_success" for ev in events) < times:
                    events.extend((await session.handle({"cmd": "stats"}))["events"])

        events.extend((await session.handle({"cmd": "send", "envs": ["a"]}))["events"])
        await until_called(1)
        await session.handle({"cmd": "plan", "env": "a", "plan": "ok"})
        events.extend((await session.handle({"cmd": "send", "envs": ["a"]}))["events"])
        await until_called(2)
    calls = [i for i, ev in enumerate(events) if ev["kind"] == "on_success"]
    ends = [i for i, ev in enumerate(events) if ev["kind"] == "move" and ev["outcome"] == "ok"]
    assert [events[i]["attempt"] for i in calls] == [2, 1]
    assert "_invoked" not in events[calls[0]]
    assert ends[0] < calls[0] < ends[1] < calls[1]


@pytest.mark.real_clock
async def test_a_reporting_on_failure_comes_after_the_end(pg_dsn: str) -> None:
    """DoNotRetry's ``on_failure`` only reports the end: the node calls it once the end
    committed, and the driver reports it after the move (it is not held back for an
    end to come, as a deciding call is)."""
    spec = {"script": ["no_retry"], "policy": "drop"}
    async with _session(
        pg_dsn,
        {"cmd": "hello", "protocol": PROTOCOL, "time_scale": 0.05},
        {"cmd": "queue", "workers": 1},
        {"cmd": "define", "env": "a", "spec": spec},
        {"cmd": "start"},
    ) as session:
        events = (await session.handle({"cmd": "send", "envs": ["a"]}))["events"]
        async with asyncio.timeout(10):
            while not any(ev["kind"] == "on_failure" for ev in events):
                events.extend((await session.handle({"cmd": "stats"}))["events"])
    kinds = [(ev["kind"], ev.get("to")) for ev in events if ev["kind"] != "queue"]
    assert kinds[-2:] == [("move", "failed"), ("on_failure", None)]
    assert {k: v for k, v in events[-1].items() if k != "t"} == {
        "kind": "on_failure",
        "env": "a",
        "error": "no_retry",
        "attempt": 1,
    }


def _ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"t": 0.0, "kind": kind, **fields}


def _mv(env: str, frm: str, to: str, outcome: str | None = None) -> dict[str, Any]:
    return _ev("move", env=env, **{"from": frm}, to=to, outcome=outcome, cause=None)


def test_a_stop_or_terminate_takes_effect_at_the_queues_move_or_its_first_cancel() -> None:
    """A claim made before a stop committed (it saw the queue RUNNING) comes before the
    stop's effect; a terminate of a stopping queue takes effect at the first attempt it
    cancels; a refused call where the driver received it."""

    def timed(*events: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
        return [(float(i), ev) for i, ev in enumerate(events)]  # wall time: its index

    claimed = _mv("a", "ready", "running")
    stopping = _ev("queue", **{"from": "running"}, to="stopping")
    cancelled = _mv("a", "running", "parked", "cancelled")
    events = timed(_mv("z", "running", "succeeded", "ok"), claimed, stopping, cancelled)
    assert effect("stop", True, events, 0.5) == 2
    assert effect("terminate", True, events, 0.5) == 2
    assert effect("terminate", True, timed(claimed, cancelled), -1.0) == 1
    assert effect("stop", False, events, 0.5) == 1
    assert effect("send", True, timed(claimed), -1.0) == 0
    started = _ev("queue", **{"from": "init"}, to="running")
    assert effect("start", True, timed(claimed, started), -1.0) == 1


def test_an_end_placed_before_a_stop_it_preceded_keeps_its_invoke_before_it() -> None:
    """A run of the PostgreSQL check (``I3 e2: an attempt ended that never started``):
    a stop's queue move was stamped at 3.1968, committed later; e2's attempt was
    invoked at 3.2110 and ended at 3.2939, its end seeing the queue still RUNNING, so
    the end goes before the stop's move — and its invoke with it, before the end."""

    def row(n: int, at: float, seq: int | None, frm: str, to: str, seen: str | None) -> Any:
        return {
            "n": n,
            "at": at,
            "seq": seq,
            "from_state": frm,
            "to_state": to,
            "queue_state": seen,
        }

    claim = row(9, 3.1822, 2, "ready", "running", "running")
    stop = row(10, 3.1968, None, "running", "stopping", None)
    end = row(11, 3.2939, 2, "running", "delayed", "running")
    park = row(12, 3.3856, 1, "delayed", "parked", "stopping")
    placed = in_order([claim, stop, end, park], "running")
    moves = [
        (wall, tie, r["at"], float(r["n"]), {"n": r["n"], "env": f"e{r['seq']}"})
        for wall, tie, r in placed
    ]
    invoke = (3.2110, {"kind": "invoke", "env": "e2"})
    merged = [ev.get("n", ev.get("kind")) for _, ev in merge([invoke], moves)]
    assert merged == [9, "invoke", 11, 10, 12]
    # Another envelope's observation made after the stop's move stays after it.
    other = (3.2110, {"kind": "invoke", "env": "e1"})
    merged = [ev.get("n", ev.get("kind")) for _, ev in merge([other], moves)]
    assert merged == [9, 11, 10, "invoke", 12]
