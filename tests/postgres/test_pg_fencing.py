"""Fencing from end to end: what a node does after its lease lapsed reaches neither the
database, nor a hook, nor a user; a reply lost after the database committed is read
back from the database, never guessed.

Real node processes on a real server, stalled (a job that blocks its loop past the
lease), killed, or cut off by a proxy that loses a reply after its statement committed
(``lossy_proxy``). Each hook records its calls in ``fault_hooks``; the database records
every move (``fault_support``). Waits are for conditions in the database with generous
bounds; nothing is timed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue
from envq.postgres._server import ThrowawayServer

if TYPE_CHECKING:
    from fault_support import Cluster
    from lossy_proxy import LossyProxy

pytestmark = pytest.mark.real_clock

LEASE = 1.0
POLL = 0.2


@asynccontextmanager
async def lossy(server: ThrowawayServer) -> AsyncIterator[LossyProxy]:
    """A proxy in front of ``server`` that can lose a reply."""
    from lossy_proxy import LossyProxy  # noqa: PLC0415

    found = LossyProxy(server.socket_dir / ".s.PGSQL.5432").start()
    try:
        yield found
    finally:
        found.close()


def _database(dsn: str) -> str:
    return dsn.split("@/", 1)[1].split("?", 1)[0]


def _envelope(
    queue: str, key: str, invoke: Any, *, decides: bool = True, **payload: Any
) -> envq.Envelope:
    """An envelope whose hooks record their calls (``decides``: with ``on_failure``,
    which drops; without, a retry policy decides)."""
    import fault_jobs  # noqa: PLC0415

    return envq.Envelope(
        invoke=invoke,
        id=key,
        payload={"queue": queue, **payload},
        on_success=fault_jobs.success_recorded,
        on_failure=fault_jobs.failure_recorded if decides else None,
        retry=None if decides else envq.Retry(attempts=3, base=0.1, jitter=False),
    )


async def _hooks(dsn: str, queue: str) -> list[tuple[str, str, str, str | None]]:
    """Every hook call recorded: ``(key, node, hook, cause)``."""
    from fault_support import fetch  # noqa: PLC0415

    rows = await fetch(
        dsn, "SELECT key, node, hook, cause FROM fault_hooks WHERE queue = $1 ORDER BY n", queue
    )
    return [(r["key"], r["node"], r["hook"], r["cause"]) for r in rows]


async def _producer(dsn: str, queue: str) -> Any:
    from envq.postgres import PgQueue  # noqa: PLC0415

    q = PgQueue(dsn, queue, workers=0, lease=LEASE, poll=POLL)
    await q.connect()
    await q.start()
    return q


# -- 2. a reporting hook runs only for an end that committed --------------------------------


async def test_on_success_runs_once_for_a_stalled_attempt_whose_end_was_refused(
    fault_dsn: str, cluster: Cluster
) -> None:
    """A job blocks its node's loop 4 s under a 1 s lease: the other node reaps it and
    runs it again; the stalled node's end is refused, and it calls no ``on_success``:
    one committed success, one ``on_success``."""
    import fault_jobs  # noqa: PLC0415
    from fault_support import check_history, until  # noqa: PLC0415

    q = "report"
    prod = await _producer(fault_dsn, q)
    try:
        cluster.start(q, ["a"], workers=1, lease=LEASE, poll=POLL)
        await prod.send(
            _envelope(q, "stall", fault_jobs.blocking, decides=False, block=4.0, stall_on="a")
        )

        async def stalled() -> bool:
            from fault_support import fetch  # noqa: PLC0415

            rows = await fetch(
                fault_dsn, "SELECT 1 FROM envq.envelopes WHERE state = 'running' AND queue = $1", q
            )
            return bool(rows)

        await until(stalled, "the stalled attempt to start", cluster=cluster)
        # The second node reaps the stalled attempt once its lease lapses, and runs
        # the envelope again (it stalls only on a).
        cluster.start(q, ["b"], workers=1, lease=LEASE, poll=POLL)

        async def done() -> bool:
            from fault_support import states  # noqa: PLC0415

            return (await states(fault_dsn, q)).get("succeeded") == 1

        await until(done, "the success", timeout=90, cluster=cluster)
        await asyncio.sleep(5.0)  # the stalled node wakes, tries to end, is refused
    finally:
        await prod.close()
    hooks = await _hooks(fault_dsn, q)
    successes = [h for h in hooks if h[2] == "on_success"]
    story = (await check_history(fault_dsn, q, ["stall"], runs=False))["stall"]
    committed_ok = [x for x in story.leases if x.event == "attempt_ok"]
    assert len(committed_ok) == 1, story.leases
    assert len(successes) == 1, hooks
    assert successes[0][1] == committed_ok[0].owner


def _fields(env: envq.Envelope) -> dict[str, Any]:
    return {
        "invoke": env.invoke,
        "id": env.id,
        "payload": env.payload,
        "on_success": env.on_success,
        "on_failure": env.on_failure,
        "retry": env.retry,
    }


# -- 3. an expired attempt is decided once ------------------------------------------------


async def test_an_expired_attempt_is_decided_once(fault_dsn: str, cluster: Cluster) -> None:
    """A job blocks its loop past its lease, then fails: the reaper decides it
    (``on_failure(TimeoutError)``); the late node, whose lease lapsed, does not decide
    it again (no ``on_failure(RuntimeError)``)."""
    import fault_jobs  # noqa: PLC0415
    from fault_support import states, until  # noqa: PLC0415

    q = "decide"
    prod = await _producer(fault_dsn, q)
    try:
        cluster.start(q, ["a", "b"], workers=1, lease=LEASE, poll=POLL)
        await prod.send(_envelope(q, "late", fault_jobs.blocking, block=4.0, fail=True))

        async def failed() -> bool:
            return (await states(fault_dsn, q)).get("failed") == 1

        await until(failed, "the end", timeout=90, cluster=cluster)
        await asyncio.sleep(5.0)  # the stalled node wakes and ends its attempt
    finally:
        await prod.close()
    hooks = await _hooks(fault_dsn, q)
    decisions = [h for h in hooks if h[2] == "on_failure"]
    assert len(decisions) == 1, hooks
    assert decisions[0][3] == "TimeoutError", hooks


# -- 4. renewals never wait behind user code ------------------------------------------------


async def test_a_slow_hook_on_the_reaper_does_not_starve_its_renewals(
    fault_dsn: str, cluster: Cluster
) -> None:
    """Envelope x's node dies; node a reaps x and its ``on_failure`` sleeps 6 s;
    meanwhile a's own attempt y (1.5 s lease) keeps its lease and succeeds on its one
    attempt, never reaped."""
    import fault_jobs  # noqa: PLC0415
    from fault_support import (  # noqa: PLC0415
        check_history,
        fetch,
        states,
        until,
    )

    q = "starve"
    prod = await _producer(fault_dsn, q)
    try:
        [doomed] = cluster.start(q, ["doomed"], workers=1, lease=1.5, poll=POLL)
        x = _envelope(q, "x", fault_jobs.work, gate=True, hook_sleep=6.0)
        await prod.send(envq.Envelope(**_fields(x), deadline=60))  # a 30 s hook budget

        async def x_runs() -> bool:
            rows = await fetch(fault_dsn, "SELECT 1 FROM fault_runs WHERE key = 'x'")
            return bool(rows)

        await until(x_runs, "x to run", cluster=cluster)
        [a] = cluster.start(q, ["a"], workers=2, lease=1.5, poll=POLL)
        await prod.send(_envelope(q, "y", fault_jobs.work, gate=True))

        async def y_runs_on_a() -> bool:
            rows = await fetch(fault_dsn, "SELECT node FROM fault_runs WHERE key = 'y'")
            return [r["node"] for r in rows] == ["a"]

        await until(y_runs_on_a, "y to run on a", cluster=cluster)
        doomed.kill()

        async def reaping() -> bool:
            rows = await fetch(fault_dsn, "SELECT node FROM fault_hooks WHERE key = 'x'")
            return bool(rows)

        await until(reaping, "x's reaper to call on_failure", cluster=cluster)
        await asyncio.sleep(5.0)  # the hook sleeps; y's lease must be renewed meanwhile
        await fetch(fault_dsn, "INSERT INTO fault_gates VALUES ('y') RETURNING 1")

        async def y_done() -> bool:
            rows = await fetch(
                fault_dsn,
                "SELECT state::text FROM envq.envelopes WHERE queue = $1 AND id = '\"y\"'",
                q,
            )
            return [r["state"] for r in rows] == ["succeeded"]

        await until(y_done, "y to succeed", timeout=60, cluster=cluster)

        async def x_done() -> bool:
            return (await states(fault_dsn, q)) == {"succeeded": 1, "failed": 1}

        await until(x_done, "x's reaper to end it", timeout=60, cluster=cluster)
    finally:
        await prod.close()
    stories = await check_history(fault_dsn, q, ["x", "y"], ends=("succeeded", "failed"))
    assert [(x.owner, x.event) for x in stories["y"].leases] == [("a", "attempt_ok")]
    assert [(x.owner, x.event) for x in stories["x"].leases] == [("doomed", "attempt_expired")]
    assert a.alive


# -- 1. a claim or an end whose reply was lost -----------------------------------------------


async def test_a_claim_made_under_a_nodes_name_elsewhere_is_not_kept_alive_by_it(
    fault_dsn: str, cluster: Cluster
) -> None:
    """Another session claims an envelope under node a's lease owner while a is busy:
    a renews only the leases it knows it holds, so that attempt's lease expires and it
    is reaped (retried by its policy, then run), not left RUNNING while a works."""
    import fault_jobs  # noqa: PLC0415
    from fault_support import fetch, states, until  # noqa: PLC0415

    q = "stranger"
    prod = await _producer(fault_dsn, q)
    try:
        cluster.start(q, ["a"], workers=2, lease=1.5, poll=POLL)
        await prod.send(_envelope(q, "busy", fault_jobs.work, gate=True))

        async def busy() -> bool:
            return bool(await fetch(fault_dsn, "SELECT 1 FROM fault_runs WHERE key = 'busy'"))

        await until(busy, "a to be busy", cluster=cluster)
        owner = (
            await fetch(
                fault_dsn,
                "SELECT lease_owner FROM envq.envelopes WHERE queue = $1 AND state = 'running'",
                q,
            )
        )[0]["lease_owner"]
        claimed = await _claimed_elsewhere(fault_dsn, q, "ghost", owner)
        assert claimed == ["ghost"]

        async def ghost_moved_on() -> bool:
            rows = await fetch(
                fault_dsn,
                "SELECT state::text, attempt FROM envq.envelopes WHERE queue = $1"
                " AND id = '\"ghost\"'",
                q,
            )
            return rows[0]["state"] != "running" or rows[0]["attempt"] > 1

        await until(ghost_moved_on, "the stranger's claim to expire", timeout=20, cluster=cluster)
        await fetch(fault_dsn, "INSERT INTO fault_gates VALUES ('busy') RETURNING 1")

        async def all_done() -> bool:
            return (await states(fault_dsn, q)).get("succeeded") == 2

        await until(all_done, "both to succeed", timeout=60, cluster=cluster)
    finally:
        await prod.close()


async def _claimed_elsewhere(dsn: str, queue: str, key: str, owner: str) -> list[str]:
    """A READY envelope sent and claimed under ``owner`` by another session, in one
    transaction (no node sees it READY); the ids claimed."""
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, id, invoke, payload, kind, state, event,"
                " retry) VALUES ($1, $2::jsonb, 'fault_jobs:work', $3::jsonb, 'one_off',"
                " 'ready', 'send', $4::jsonb)",
                queue,
                json.dumps(key),
                json.dumps({"queue": queue}),
                json.dumps({"attempts": 3, "base": 0.1, "cap": 1.0, "jitter": False}),
            )
            rows = await conn.fetch(
                "SELECT id FROM envq.claim($1, $2, 1, interval '1.5 seconds')", queue, owner
            )
    finally:
        await conn.close()
    return [json.loads(r["id"]) for r in rows]


async def test_a_claim_whose_reply_was_lost_is_taken_back_and_run(
    pg_server: ThrowawayServer, fault_dsn: str, cluster: Cluster
) -> None:
    """The connection is cut after a claim committed, before its reply: the node takes
    back the attempt the database gave it (adopt) and runs it, while another attempt
    keeps it busy; nothing sits RUNNING unrun."""
    import fault_jobs  # noqa: PLC0415
    from fault_support import fetch, states, until  # noqa: PLC0415

    q = "lostclaim"
    prod = await _producer(fault_dsn, q)
    try:
        async with lossy(pg_server) as proxy:
            cluster.dsn = proxy.dsn(_database(fault_dsn))
            [a] = cluster.start(q, ["a"], workers=4, lease=1.5, poll=POLL)
            await prod.send(_envelope(q, "busy", fault_jobs.work, gate=True))

            async def busy() -> bool:
                rows = await fetch(fault_dsn, "SELECT 1 FROM fault_runs WHERE key = 'busy'")
                return bool(rows)

            await until(busy, "a to be busy", cluster=cluster)
            proxy.lose_reply("envq.claim(")
            await prod.send(_envelope(q, "lost", fault_jobs.work))
            await proxy.wait_lost()

            async def lost_done() -> bool:
                rows = await fetch(
                    fault_dsn,
                    "SELECT state::text FROM envq.envelopes WHERE queue = $1 AND id = '\"lost\"'",
                    q,
                )
                return [r["state"] for r in rows] == ["succeeded"]

            # Taken back within a renewal period or two: well before the busy one ends.
            await until(lost_done, "the lost claim's envelope to run", timeout=30, cluster=cluster)
            runs = await fetch(fault_dsn, "SELECT node, attempt FROM fault_runs WHERE key = 'lost'")
            assert [(r["node"], r["attempt"]) for r in runs] == [("a", 1)]
            await fetch(fault_dsn, "INSERT INTO fault_gates VALUES ('busy') RETURNING 1")

            async def all_done() -> bool:
                return (await states(fault_dsn, q)).get("succeeded") == 2

            await until(all_done, "both to succeed", timeout=60, cluster=cluster)
            assert proxy.lost == 1
    finally:
        await prod.close()
    assert "took back envelope" in a.stderr()


async def test_taking_back_a_lost_claim_holds_no_session_while_a_claim_is_in_flight(
    pg_dsn: str,
) -> None:
    """Taking back a lost claim's attempts waits for the claims in flight to end. It must
    not hold one of the pool's sessions while it waits: with the pool's other sessions
    busy, the claim it waits for waits for that session, and the node stops (nothing
    claimed, reaped or counted again)."""
    from envq.postgres import PgQueue  # noqa: PLC0415

    name = "adopt-gate"
    async with PgQueue(pg_dsn, name, workers=1, lease=0.6, poll=30.0) as q:
        await q.start()
        pool = q._db()
        node = q._node
        # Every session of the pool but one busy elsewhere (the host's long statements).
        held = [await pool.acquire() for _ in range(pool.get_max_size() - 1)]
        try:
            async with node._gate.claiming():  # a claim in flight...
                node._orphans = True  # ...and the reply of an earlier one was lost
                # Five renewal periods: the renewer has found the orphans and waits
                # for the claim to end.
                await asyncio.sleep(1.0)
                assert node._orphans
                # The claim gets the last session: the waiting renewer does not hold it.
                async with asyncio.timeout(5):
                    conn = await pool.acquire()
                await pool.release(conn)
            # The claim ended: the renewer takes back (nothing to take) and is done.
            async with asyncio.timeout(5):
                while node._orphans:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
        finally:
            for conn in held:
                await pool.release(conn)
        await q.terminate()


async def test_an_end_whose_reply_was_lost_is_read_back_not_counted_as_refused(
    pg_server: ThrowawayServer, fault_dsn: str, cluster: Cluster
) -> None:
    """The connection is cut after a batched end committed, before its reply: the node
    reads back that it committed, runs ``on_success`` once, and counts it finished,
    not fenced."""
    import fault_jobs  # noqa: PLC0415
    from fault_support import fetch, until  # noqa: PLC0415
    from test_pg_faults import left_counts  # noqa: PLC0415

    q = "lostend"
    prod = await _producer(fault_dsn, q)
    try:
        async with lossy(pg_server) as proxy:
            cluster.dsn = proxy.dsn(_database(fault_dsn))
            [a] = cluster.start(q, ["a"], workers=1, lease=LEASE, poll=POLL)
            proxy.lose_reply("finish_and_claim(")
            await prod.send(_envelope(q, "end", fault_jobs.work))
            await proxy.wait_lost()

            async def hooked() -> bool:
                return bool(await _hooks(fault_dsn, q))

            await until(hooked, "on_success", timeout=30, cluster=cluster)
            rows = await fetch(
                fault_dsn, "SELECT state::text FROM envq.envelopes WHERE queue = $1", q
            )
            assert [r["state"] for r in rows] == ["succeeded"]
            counts = left_counts(a.leave())
    finally:
        await prod.close()
    assert counts["finished"] == 1
    assert counts["fenced"] == 0
    assert "was refused" not in a.stderr()
    assert [h[2] for h in await _hooks(fault_dsn, q)] == ["on_success"]


async def test_a_ban_racing_a_claim_leaves_no_attempt_of_the_type_unbanned(pg_dsn: str) -> None:
    """A type is banned while another session claims one of its READY envelopes (found
    by the PostgreSQL conformance check: a 10-command counterexample ending SUCCEEDED
    where the ban leads to STOPPED). The claim holds the row when the ban's statements
    run; once it commits, the envelope is RUNNING, and the ban must relabel it (its
    end is then looked up in the BLACKLISTED rows), not skip it as READY in one
    statement and as RUNNING in the other."""
    import asyncpg  # noqa: PLC0415

    from envq.postgres._moves import blacklist  # noqa: PLC0415

    name = f"ban-{uuid.uuid4().hex[:8]}"
    q = PgQueue(pg_dsn, name, workers=0)
    await q.install()
    async with q:
        await q.start()
        await q.send(envq.Envelope(invoke=pg_jobs.noop, id="e2", type="t"))
        claimer = await asyncpg.connect(pg_dsn)
        banner = await asyncpg.connect(pg_dsn)
        try:
            claim = claimer.transaction()
            await claim.start()
            claimed = await claimer.fetch(
                "SELECT seq FROM envq.claim($1, 'other', 1, interval '30 s')", name
            )
            assert len(claimed) == 1
            ban = asyncio.create_task(blacklist(banner, name, "t"))
            # The ban waits for the claim's row lock (it cannot finish first).
            await asyncio.sleep(0.3)
            assert not ban.done()
            await claim.commit()
            await asyncio.wait_for(ban, 10)
            row = await claimer.fetchrow(
                "SELECT state::text, kind::text FROM envq.envelopes WHERE queue = $1", name
            )
        finally:
            await claimer.close()
            await banner.close()
        assert (row["state"], row["kind"]) == ("running", "blacklisted")
