"""Faults across processes: real node processes (``python -m envq.postgres.node``) on a
real server, killed, paused, cut off from the database, or left racing.

Each test has a database of its own that records every move of every envelope row
(``fault_support``), and a job (``fault_jobs.work``) that records each attempt it runs.
After the fault, every envelope sent must be accounted for (ended as its policy says,
or handed back), each claim ended exactly once by a move naming its lease token, and
every committed result produced inside its lease (``check_history``).

Leases are about a second and polls a fifth of one, so a lost node is noticed quickly;
nothing is timed: each step waits, with a generous bound, for what the database shows.
"""

from __future__ import annotations

import ast
import asyncio
import random
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import pytest

import envq
from envq.postgres._server import ThrowawayServer

if TYPE_CHECKING:
    from fault_support import Cluster

    from envq.postgres import PgQueue

pytestmark = pytest.mark.real_clock

LEASE = 1.0
POLL = 0.2
RETRY = envq.Retry(attempts=3, base=0.1, jitter=False)
#: For the scenarios where every envelope must succeed in the end, however often its
#: attempts are cut short.
PATIENT = envq.Retry(attempts=-1, base=0.05, cap=0.5, jitter=False)


@asynccontextmanager
async def producer(dsn: str, queue: str) -> AsyncIterator[PgQueue]:
    """This process on the queue: it starts it and sends, runs nothing."""
    from envq.postgres import PgQueue  # noqa: PLC0415

    q = PgQueue(dsn, queue, workers=0, lease=LEASE, poll=POLL)
    async with q:
        await q.start()
        yield q


def job(
    queue: str,
    key: str,
    *,
    sleep: float = 0.0,
    retry: envq.Retry | None = RETRY,
    gate: bool = False,
    interval: float = 0.0,
) -> envq.Envelope:
    """An envelope running ``fault_jobs.work``."""
    import fault_jobs  # noqa: PLC0415

    return envq.Envelope(
        invoke=fault_jobs.work,
        id=key,
        payload={"queue": queue, "sleep": sleep, "gate": gate},
        retry=retry,
        interval=interval,
    )


async def ended(dsn: str, queue: str, count: int, states: tuple[str, ...]) -> bool:
    """``count`` envelopes of ``queue`` are in ``states``."""
    from fault_support import states as counts  # noqa: PLC0415

    found = await counts(dsn, queue)
    return sum(found.get(s, 0) for s in states) == count


async def running_on(dsn: str, queue: str, key: str, cluster: Cluster) -> str:
    """Wait until an attempt of ``key`` runs (its job has started and not ended); the
    name of its node."""
    from fault_support import fetch, until  # noqa: PLC0415

    found: list[str] = []

    async def started() -> bool:
        rows = await fetch(
            dsn,
            "SELECT node FROM fault_runs WHERE queue = $1 AND key = $2 AND ended_at IS NULL",
            queue,
            key,
        )
        found[:] = [r["node"] for r in rows]
        return bool(found)

    await until(started, f"an attempt of {key} to run", cluster=cluster)
    return found[0]


def left_counts(stdout: str) -> dict[str, int]:
    """The counts a node printed when it left (``left <node> {...}``)."""
    match = re.search(r"^left \S+ (\{.*\})$", stdout, re.MULTILINE)
    assert match is not None, stdout
    found = ast.literal_eval(match.group(1))
    assert isinstance(found, dict), stdout
    return found


def no_crash(cluster: Cluster) -> None:
    """No node logged an error: a task that died, or a failure envq logs as one (the
    driver's own warnings about reconnecting are expected)."""
    for node in cluster.nodes:
        log = node.stderr()
        for sign in ("never retrieved", "ERROR:", "CRITICAL:"):
            assert sign not in log, log[-4000:]


# -- 1. kill -9 ---------------------------------------------------------------------------


async def test_a_killed_node_s_attempt_is_reaped_and_retried_elsewhere(
    fault_dsn: str, cluster: Cluster
) -> None:
    """The node running a slow attempt is killed (-9): its lease expires, the other node
    reaps it (EXPIRED, retried after the policy's backoff) and runs it to success."""
    from fault_support import check_history, until  # noqa: PLC0415

    q = "kill9"
    async with producer(fault_dsn, q) as prod:
        nodes = {n.name: n for n in cluster.start(q, ["a", "b"], workers=1)}
        await prod.send(job(q, "slow", sleep=1.5))
        victim = nodes.pop(await running_on(fault_dsn, q, "slow", cluster))
        (other,) = nodes.values()
        victim.kill()
        await until(
            lambda: ended(fault_dsn, q, 1, ("succeeded", "failed")), "the end", cluster=cluster
        )
    story = (await check_history(fault_dsn, q, ["slow"]))["slow"]
    assert [(x.owner, x.event) for x in story.leases] == [
        (victim.name, "attempt_expired"),
        (other.name, "attempt_ok"),
    ]
    counts = left_counts(other.leave())
    assert counts["reaped"] == 1
    assert counts["finished"] == 1
    no_crash(cluster)


# -- 2. SIGSTOP past the lease ------------------------------------------------------------


async def test_a_paused_node_s_late_result_is_refused(fault_dsn: str, cluster: Cluster) -> None:
    """The node running an attempt is paused (SIGSTOP) past its lease; the other node
    reaps it and runs the envelope to success; resumed, the paused node's result is
    refused: the one committed end of its attempt is the reaper's."""
    from fault_support import check_history, fetch, until  # noqa: PLC0415

    q = "sigstop"
    async with producer(fault_dsn, q) as prod:
        nodes = {n.name: n for n in cluster.start(q, ["a", "b"], workers=1)}
        await prod.send(job(q, "late", sleep=1.0))
        victim = nodes.pop(await running_on(fault_dsn, q, "late", cluster))
        (other,) = nodes.values()
        victim.signal(signal.SIGSTOP)
        try:
            await until(lambda: ended(fault_dsn, q, 1, ("succeeded",)), "the end", cluster=cluster)
        finally:
            victim.signal(signal.SIGCONT)

        async def late_run_over() -> bool:
            rows = await fetch(
                fault_dsn,
                "SELECT how FROM fault_runs WHERE queue = $1 AND node = $2",
                q,
                victim.name,
            )
            return len(rows) == 1 and rows[0]["how"] is not None

        await until(late_run_over, "the paused attempt to end", cluster=cluster)
        counts = left_counts(victim.leave())
    assert counts == {"finished": 0, "fenced": 1, "reaped": 0}
    story = (await check_history(fault_dsn, q, ["late"]))["late"]
    assert [(x.owner, x.event) for x in story.leases] == [
        (victim.name, "attempt_expired"),
        (other.name, "attempt_ok"),
    ]
    assert {r["node"] for r in story.runs} == {victim.name, other.name}
    no_crash(cluster)


# -- 3. the server restarted --------------------------------------------------------------


async def test_nodes_ride_out_an_immediate_server_restart(
    pg_server: ThrowawayServer, fault_dsn: str, cluster: Cluster
) -> None:
    """``pg_ctl restart -m immediate`` while three nodes work through hundreds of
    envelopes: the nodes reconnect, and every envelope succeeds, each claim ended once."""
    from fault_support import check_history, restart_server, states, until  # noqa: PLC0415

    q = "restart"
    keys = [f"r{i}" for i in range(300)]
    async with producer(fault_dsn, q) as prod:
        await prod.send(*(job(q, k, sleep=0.02, retry=PATIENT) for k in keys))
        cluster.start(q, ["n1", "n2", "n3"], workers=4)

        async def under_way() -> bool:
            return (await states(fault_dsn, q)).get("succeeded", 0) >= 50

        await until(under_way, "50 envelopes to succeed", cluster=cluster)
        await asyncio.to_thread(restart_server, pg_server)
        before = (await states(fault_dsn, q)).get("succeeded", 0)
        assert before < len(keys), "the restart came after the work: nothing was tested"
        await until(
            lambda: ended(fault_dsn, q, len(keys), ("succeeded",)),
            "every envelope to succeed",
            timeout=120,
            cluster=cluster,
        )
    await check_history(fault_dsn, q, keys)
    for node in cluster.nodes:
        assert node.alive, node.stderr()[-3000:]
        node.leave()
    no_crash(cluster)


# -- 4. a node's sessions terminated ------------------------------------------------------


async def _terminate(dsn: str, node: str) -> int:
    from fault_support import fetch  # noqa: PLC0415

    rows = await fetch(
        dsn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE application_name = $1 AND pid <> pg_backend_pid()",
        f"envq:{node}",
    )
    return sum(1 for r in rows if r[0])


async def test_a_node_whose_sessions_are_terminated_recovers(
    fault_dsn: str, cluster: Cluster
) -> None:
    """A node's database sessions are terminated, again and again, while it works:
    it reconnects, and nothing is lost."""
    from fault_support import check_history, states, until  # noqa: PLC0415

    q = "terminated"
    keys = [f"t{i}" for i in range(120)]
    async with producer(fault_dsn, q) as prod:
        a, _b = cluster.start(q, ["a", "b"], workers=3)
        await prod.send(*(job(q, k, sleep=0.05, retry=PATIENT) for k in keys))
        cut = 0
        for _ in range(4):
            cut += await _terminate(fault_dsn, a.name)
            if (await states(fault_dsn, q)).get("succeeded", 0) == len(keys):
                break
            await asyncio.sleep(0.3)
        assert cut > 0, "no session of the node was found to terminate"
        await until(
            lambda: ended(fault_dsn, q, len(keys), ("succeeded",)),
            "every envelope to succeed",
            cluster=cluster,
        )
    await check_history(fault_dsn, q, keys)
    assert a.alive
    assert left_counts(a.leave())["finished"] > 0
    no_crash(cluster)


async def test_a_session_terminated_while_an_attempt_ends_still_commits_it(
    fault_dsn: str, cluster: Cluster
) -> None:
    """The session ending an attempt is terminated in the middle of ``finish`` (held
    up by a row lock meanwhile): the node ends it again on a new session while its
    lease holds, so the attempt's success commits — it is not lost to the reaper (this
    envelope has no retry policy, so an expired lease would fail it)."""
    import asyncpg  # noqa: PLC0415
    from fault_support import check_history, fetch, until  # noqa: PLC0415

    q = "cut-finish"
    async with producer(fault_dsn, q) as prod:
        (a,) = cluster.start(q, ["a"], workers=1, lease=4.0)
        await prod.send(job(q, "gated", gate=True, retry=None))
        await running_on(fault_dsn, q, "gated", cluster)
        lock = await asyncpg.connect(fault_dsn)
        try:
            async with lock.transaction():
                await lock.execute("SELECT FROM envq.envelopes WHERE queue = $1 FOR UPDATE", q)
                await fetch(fault_dsn, "INSERT INTO fault_gates VALUES ('gated')")

                async def finishing() -> bool:
                    rows = await fetch(
                        fault_dsn,
                        "SELECT FROM pg_stat_activity WHERE application_name = 'envq:a'"
                        " AND wait_event_type = 'Lock' AND query LIKE '%envq.finish%'",
                    )
                    return bool(rows)

                await until(finishing, "the node's finish to wait on the lock", cluster=cluster)
                assert await _terminate(fault_dsn, "a") > 0
        finally:
            await lock.close()
        await until(
            lambda: ended(fault_dsn, q, 1, ("succeeded", "failed")), "the end", cluster=cluster
        )
    story = (await check_history(fault_dsn, q, ["gated"], ends=("succeeded", "failed")))["gated"]
    assert story.state == "succeeded"
    assert [(x.owner, x.event) for x in story.leases] == [("a", "attempt_ok")]
    assert left_counts(a.leave())["finished"] == 1
    no_crash(cluster)


# -- 5. racing nodes ----------------------------------------------------------------------


async def test_racing_nodes_end_every_attempt_once(fault_dsn: str, cluster: Cluster) -> None:
    """Three nodes with short leases run attempts about as long as a lease, while each
    is paused now and then for longer than one: claims, reaping and late results race
    on the same envelopes. Every envelope succeeds in the end, each claim is ended
    exactly once, and every committed result was produced inside its own lease; the
    nodes' own counts agree with the database (each reaped attempt refused once)."""
    from fault_support import check_history, until  # noqa: PLC0415

    q = "race"
    lease = 0.8
    rng = random.Random(20261126)
    keys = [f"x{i}" for i in range(40)]
    async with producer(fault_dsn, q) as prod:
        nodes = cluster.start(q, ["n1", "n2", "n3"], workers=3, lease=lease, poll=0.1)
        await prod.send(
            *(job(q, k, sleep=rng.uniform(0.3, 0.9) * lease, retry=PATIENT) for k in keys)
        )
        for _ in range(6):
            if await ended(fault_dsn, q, len(keys), ("succeeded",)):
                break
            node = rng.choice(nodes)
            node.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(rng.uniform(1.2, 2.0) * lease)
            finally:
                node.signal(signal.SIGCONT)
            await asyncio.sleep(0.3)
        await until(
            lambda: ended(fault_dsn, q, len(keys), ("succeeded",)),
            "every envelope to succeed",
            cluster=cluster,
        )
    stories = await check_history(fault_dsn, q, keys)
    leases = [x for s in stories.values() for x in s.leases]
    expired = sum(x.event == "attempt_expired" for x in leases)
    assert expired > 0, "no lease expired: nothing raced"
    counts = [left_counts(n.leave()) for n in nodes]
    assert sum(c["reaped"] for c in counts) == expired
    assert sum(c["fenced"] for c in counts) == expired
    assert sum(c["finished"] for c in counts) == len(leases) - expired
    no_crash(cluster)


# -- 6. a periodic envelope's node killed -------------------------------------------------


async def test_a_periodic_envelope_goes_on_after_its_node_is_killed(
    fault_dsn: str, cluster: Cluster
) -> None:
    """The node running a periodic envelope's run is killed (-9): the run is reaped
    (a failed run, rescheduled) and the schedule goes on on the other node."""
    from fault_support import check_history, fetch, until  # noqa: PLC0415

    q = "periodic"
    async with producer(fault_dsn, q) as prod:
        nodes = {n.name: n for n in cluster.start(q, ["a", "b"], workers=1)}
        await prod.send(job(q, "tick", sleep=0.5, retry=None, interval=0.2))
        victim = nodes.pop(await running_on(fault_dsn, q, "tick", cluster))
        (other,) = nodes.values()
        victim.kill()
        (killed_at,) = await fetch(fault_dsn, "SELECT clock_timestamp() AS t")

        async def three_more() -> bool:
            rows = await fetch(
                fault_dsn,
                "SELECT count(*) FROM fault_runs WHERE queue = $1 AND node = $2"
                " AND started_at > $3 AND how = 'ok'",
                q,
                other.name,
                killed_at["t"],
            )
            return bool(rows[0][0] >= 3)

        await until(three_more, "three runs after the kill", cluster=cluster)
        await asyncio.wait_for(prod.stop(envq.StopMode.STOP), 60)
    story = (await check_history(fault_dsn, q, ["tick"], ends=("parked",)))["tick"]
    killed = [x for x in story.leases if x.owner == victim.name]
    assert [x.event for x in killed][-1] == "attempt_expired"
    after = story.leases[story.leases.index(killed[-1]) + 1 :]
    assert len(after) >= 3
    assert {x.owner for x in after} == {other.name}
    assert {x.event for x in after} == {"attempt_ok"}
    no_crash(cluster)


# -- 7. stop while a node is dead ---------------------------------------------------------


async def test_stop_drains_while_a_node_is_dead(fault_dsn: str, cluster: Cluster) -> None:
    """``stop(DRAIN)`` while the node running an attempt lies dead (-9): the stop
    returns once that lease expired and the other node reaped it (parked: its retry
    cannot run in a stopping queue) and drained the rest; the queue is STOPPED and
    nothing is lost (terminate hands the parked one back)."""
    from fault_support import check_history  # noqa: PLC0415

    q = "stop-dead"
    quick = [f"q{i}" for i in range(5)]
    async with producer(fault_dsn, q) as prod:
        nodes = {n.name: n for n in cluster.start(q, ["a", "b"], workers=1)}
        await prod.send(job(q, "slow", sleep=3.0))
        victim = nodes.pop(await running_on(fault_dsn, q, "slow", cluster))
        victim.kill()
        await prod.send(*(job(q, k, sleep=0.1) for k in quick))
        await asyncio.wait_for(prod.stop(envq.StopMode.DRAIN), 60)
        assert await prod.state() is envq.QueueState.STOPPED
        stories = await check_history(fault_dsn, q, ["slow", *quick], ends=("succeeded", "parked"))
        assert stories["slow"].state == "parked"
        assert [x.event for x in stories["slow"].leases] == ["attempt_expired"]
        assert all(stories[k].state == "succeeded" for k in quick)
        back = await prod.terminate()
    assert [e.id for e in back] == ["slow"]
    no_crash(cluster)


async def test_stop_returns_when_every_node_is_dead(fault_dsn: str, cluster: Cluster) -> None:
    """``stop()`` from a process that runs no workers, with the only node dead in the
    middle of an attempt: it returns once the lease expired, the attempt reaped by the
    stopping process itself (parked), and the queue is STOPPED."""
    from fault_support import check_history  # noqa: PLC0415

    q = "stop-alone"
    async with producer(fault_dsn, q) as prod:
        (a,) = cluster.start(q, ["a"], workers=1)
        await prod.send(job(q, "slow", sleep=3.0))
        await running_on(fault_dsn, q, "slow", cluster)
        a.kill()
        await asyncio.wait_for(prod.stop(envq.StopMode.DRAIN), 60)
        assert await prod.state() is envq.QueueState.STOPPED
    story = (await check_history(fault_dsn, q, ["slow"], ends=("parked",)))["slow"]
    assert [x.event for x in story.leases] == ["attempt_expired"]


# -- renewal racing a claim (no server) ---------------------------------------------------


async def test_a_flight_claimed_while_leases_are_renewed_is_not_taken_for_lost() -> None:
    """The keeper's renewal and the pump's claim run on two sessions at once: a lease
    claimed after the renewal's snapshot is not among the tokens it returns, and the
    flight the pump registers meanwhile must not be taken for a lost lease (it would be
    cancelled, and its envelope reaped although its lease holds)."""
    import uuid  # noqa: PLC0415

    from envq._attempt import Worker  # noqa: PLC0415
    from envq.postgres._flights import Flight  # noqa: PLC0415
    from envq.postgres._queue import PgQueue  # noqa: PLC0415

    q = PgQueue("postgresql://nowhere/none", "renewal", workers=2, node="n")._node
    old = Flight({"seq": 1, "lease_token": uuid.uuid4()}, Worker(0))
    new = Flight({"seq": 2, "lease_token": uuid.uuid4()}, Worker(0))
    q._flights[1] = old

    class Session:
        async def fetch(self, sql: str, *args: object) -> list[dict[str, object]]:
            assert "envq.renew" in sql
            q._flights[2] = new  # the claim's result arrives during the statement
            return [{"token": old.token, "kind": "one_off"}]

    await q._renew(Session())  # type: ignore[arg-type]
    assert not old.lost
    assert not new.lost


async def test_a_node_listens_again_after_its_sessions_are_terminated(
    fault_dsn: str, cluster: Cluster
) -> None:
    """The session a node listens on for sends is terminated with the others: the node
    opens it again, so an envelope sent afterwards wakes it (its poll is far longer
    than this test waits for anything)."""
    from fault_support import fetch, until  # noqa: PLC0415

    q = "relisten"
    async with producer(fault_dsn, q) as prod:
        (a,) = cluster.start(q, ["a"], workers=1, poll=600.0)
        await prod.send(job(q, "before"))
        await until(lambda: ended(fault_dsn, q, 1, ("succeeded",)), "a first envelope")
        assert await _terminate(fault_dsn, "a") > 0

        async def listening() -> bool:
            rows = await fetch(
                fault_dsn,
                "SELECT FROM pg_stat_activity WHERE application_name = 'envq:a'"
                " AND query ILIKE 'LISTEN%'",
            )
            return bool(rows)

        await until(listening, "the node to listen again", timeout=30, cluster=cluster)
        await prod.send(job(q, "after"))
        await until(
            lambda: ended(fault_dsn, q, 2, ("succeeded",)),
            "the envelope sent after the cut",
            timeout=30,
            cluster=cluster,
        )
    assert left_counts(a.leave())["finished"] == 2
    no_crash(cluster)


async def test_terminate_returns_when_every_node_is_dead(fault_dsn: str, cluster: Cluster) -> None:
    """``terminate()`` from a process that runs no workers, with the only node dead in
    the middle of an attempt: it returns once the lease expired and hands back every
    envelope, the one whose attempt was cut short included."""
    from fault_support import states  # noqa: PLC0415

    q = "terminate-alone"
    async with producer(fault_dsn, q) as prod:
        (a,) = cluster.start(q, ["a"], workers=1)
        await prod.send(job(q, "slow", sleep=3.0), job(q, "waiting"))
        await running_on(fault_dsn, q, "slow", cluster)
        a.kill()
        back = await asyncio.wait_for(prod.terminate(), 60)
        assert await prod.state() is envq.QueueState.TERMINATED
    assert sorted(e.id for e in back) == ["slow", "waiting"]
    assert await states(fault_dsn, q) == {}
