"""Claims, leases and fencing tokens, as SQL functions, on a real server.

``envq.claim`` takes ready envelopes (``FOR UPDATE SKIP LOCKED``) and gives each
attempt a lease: a token, an owner and an expiry on the database's clock;
``envq.renew`` extends, in one statement, the leases an owner knows it holds;
``envq.finish`` ends an attempt only while its token holds. Expiry is tested with
leases that are over as soon as they are given (no sleeping).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import pytest

from envq.postgres._server import ThrowawayServer

_names = itertools.count()


def _postgres_error() -> type[Exception]:
    import asyncpg  # noqa: PLC0415 - only where the server runs

    return asyncpg.PostgresError  # type: ignore[no-any-return]


async def _queue_with_ready(dsn: str, count: int, *, state: str = "running") -> str:
    """A new queue (committed, so other connections see it) in lifecycle ``state``
    ('init', 'running' or 'stopped'), holding ``count`` envelopes sent to it (buffered,
    ready or parked)."""
    import asyncpg  # noqa: PLC0415

    name = f"leases-{next(_names)}-{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("INSERT INTO envq.queues (name) VALUES ($1)", name)
        if state != "init":
            await conn.execute(
                "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = $1", name
            )
        sent = "buffered" if state == "init" else "ready"
        for _ in range(count):
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, invoke, kind, state, event)"
                " VALUES ($1, 'tests.job', 'one_off', $2, 'send')",
                name,
                sent,
            )
        if state == "stopped":
            await conn.execute(
                "UPDATE envq.queues SET state = 'stopping', call = 'stop', stop_mode = 'stop'"
                " WHERE name = $1",
                name,
            )
            await conn.execute(
                "UPDATE envq.envelopes SET state = 'parked', event = 'stop' WHERE queue = $1",
                name,
            )
            await conn.execute(
                "UPDATE envq.queues SET state = 'stopped', call = 'drained' WHERE name = $1", name
            )
    finally:
        await conn.close()
    return name


@pytest.mark.real_clock
async def test_claim_takes_ready_envelopes_in_order_with_a_lease(pg_dsn: str) -> None:
    """At most ``how_many`` ready envelopes, oldest first, each RUNNING with a fresh
    token, the owner, an expiry in the future and its attempt counted."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 5)
    async with session(pg_dsn) as conn:
        claimed = await conn.fetch(
            "SELECT * FROM envq.claim($1, 'node-a', 3, interval '30 seconds')", queue
        )
        assert [r["state"] for r in claimed] == ["running"] * 3
        seqs = await conn.fetch(
            "SELECT seq, state::text FROM envq.envelopes WHERE queue = $1 ORDER BY seq", queue
        )
        assert [r["seq"] for r in claimed] == [r["seq"] for r in seqs[:3]]
        assert [r["state"] for r in seqs[3:]] == ["ready", "ready"]
        assert len({r["lease_token"] for r in claimed}) == 3
        assert {r["lease_owner"] for r in claimed} == {"node-a"}
        assert {r["attempt"] for r in claimed} == {1}
        assert await conn.fetchval(
            "SELECT bool_and(lease_expires_at > clock_timestamp()) FROM envq.envelopes"
            " WHERE queue = $1 AND state = 'running'",
            queue,
        )


@pytest.mark.real_clock
async def test_a_claim_takes_no_more_than_asked_with_a_plan_made_on_an_empty_table(
    pg_server: ThrowawayServer,
) -> None:
    """A plan made while the table was empty (a nested loop that scans the picked rows
    again for each row it updates) and kept by the session still takes ``how_many``:
    the rows a claim picks are picked once."""
    import asyncpg  # noqa: PLC0415
    from pg_support import create_database  # noqa: PLC0415

    name = f"claims_{uuid.uuid4().hex[:8]}"
    await create_database(pg_server, name)
    conn = await asyncpg.connect(pg_server.dsn(name))
    try:
        await conn.execute("VACUUM envq.envelopes")  # no pages: the planner expects no rows
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute("INSERT INTO envq.queues (name) VALUES ('q')")
        await conn.execute("UPDATE envq.queues SET state = 'running', call = 'start'")
        # The session's plan of the claim is made now, on the empty table.
        assert await conn.fetch("SELECT * FROM envq.claim('q', 'a', 1, interval '30 s')") == []
        for _ in range(5):
            await conn.execute(
                "INSERT INTO envq.envelopes (queue, invoke, kind, state, event)"
                " VALUES ('q', 'tests.job', 'one_off', 'ready', 'send')"
            )
        claimed = await conn.fetch("SELECT * FROM envq.claim('q', 'a', 2, interval '30 s')")
        running = await conn.fetchval("SELECT count(*) FROM envq.envelopes WHERE state = 'running'")
        assert (len(claimed), running) == (2, 2)
    finally:
        await conn.close()


@pytest.mark.real_clock
async def test_concurrent_claims_never_share_an_envelope(pg_dsn: str) -> None:
    """A claim skips the rows another open claim holds: two nodes get disjoint sets."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 6)
    async with session(pg_dsn) as first, session(pg_dsn) as second:
        a = await first.fetch(
            "SELECT seq FROM envq.claim($1, 'node-a', 4, interval '30 seconds')", queue
        )
        b = await second.fetch(
            "SELECT seq FROM envq.claim($1, 'node-b', 4, interval '30 seconds')", queue
        )
    assert len(a) == 4
    assert len(b) == 2
    assert not {r["seq"] for r in a} & {r["seq"] for r in b}


@pytest.mark.real_clock
@pytest.mark.parametrize("state", ["init", "stopped"])
async def test_a_queue_that_does_not_dispatch_gives_nothing(pg_dsn: str, state: str) -> None:
    """Only a queue whose lifecycle dispatches (running, stopping) hands out envelopes."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 2, state=state)
    async with session(pg_dsn) as conn:
        got = await conn.fetch(
            "SELECT seq FROM envq.claim($1, 'node-a', 5, interval '30 seconds')", queue
        )
        await conn.execute(
            "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = $1", queue
        )
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'ready', event = 'start' WHERE queue = $1",
            queue,
        )
        started = await conn.fetch(
            "SELECT seq FROM envq.claim($1, 'node-a', 5, interval '30 seconds')", queue
        )
    assert got == []
    assert len(started) == 2


@pytest.mark.real_clock
async def test_renew_extends_only_the_owners_live_leases(pg_dsn: str) -> None:
    """One statement renews the leases an owner holds among the tokens it names;
    another owner's leases and the owner's expired ones are left alone (an expired
    lease is lost)."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 5)
    async with session(pg_dsn) as conn:
        live = await conn.fetch(
            "SELECT lease_token FROM envq.claim($1, 'node-a', 2, interval '30 seconds')", queue
        )
        expired = await conn.fetch(
            "SELECT lease_token FROM envq.claim($1, 'node-a', 1, interval '0')", queue
        )
        other = await conn.fetch(
            "SELECT lease_token FROM envq.claim($1, 'node-b', 1, interval '30 seconds')", queue
        )
        before = await conn.fetchval(
            "SELECT lease_expires_at FROM envq.envelopes WHERE lease_token = $1",
            other[0]["lease_token"],
        )
        asked = [r["lease_token"] for r in (*live, *expired, *other)]
        renewed = await conn.fetch(
            "SELECT token FROM envq.renew($1, 'node-a', interval '60 seconds', $2::uuid[])"
            " AS token",
            queue,
            asked,
        )
        assert {r["token"] for r in renewed} == {r["lease_token"] for r in live}
        assert expired[0]["lease_token"] not in {r["token"] for r in renewed}
        assert (
            await conn.fetchval(
                "SELECT lease_expires_at FROM envq.envelopes WHERE lease_token = $1",
                other[0]["lease_token"],
            )
            == before
        )
        assert await conn.fetchval(
            "SELECT bool_and(lease_expires_at > clock_timestamp() + interval '45 seconds')"
            " FROM envq.envelopes WHERE lease_token = ANY($1::uuid[])",
            [r["lease_token"] for r in live],
        )


@pytest.mark.real_clock
async def test_finish_commits_the_tables_target_while_the_token_holds(pg_dsn: str) -> None:
    """The attempt's end is the tables' target for the outcome and guards; the lease is
    released; a second end of the same attempt is refused (one committed end)."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 2)
    async with session(pg_dsn) as conn:
        ok, retried = await conn.fetch(
            "SELECT seq, lease_token FROM envq.claim($1, 'node-a', 2, interval '30 seconds')",
            queue,
        )
        assert (
            await conn.fetchval(
                "SELECT envq.finish($1, $2, 'attempt_ok')::text", ok["seq"], ok["lease_token"]
            )
            == "succeeded"
        )
        assert (
            await conn.fetchval(
                "SELECT envq.finish($1, $2, 'attempt_error', decision => 'retry_now')::text",
                retried["seq"],
                retried["lease_token"],
            )
            == "ready"
        )
        rows = await conn.fetch(
            "SELECT state::text, lease_token, lease_owner, lease_expires_at"
            " FROM envq.envelopes WHERE queue = $1 ORDER BY seq",
            queue,
        )
        assert [tuple(r) for r in rows] == [
            ("succeeded", None, None, None),
            ("ready", None, None, None),
        ]
        assert (
            await conn.fetchval(
                "SELECT envq.finish($1, $2, 'attempt_ok')::text", ok["seq"], ok["lease_token"]
            )
            is None
        )


@pytest.mark.real_clock
async def test_a_result_without_a_valid_token_changes_nothing(pg_dsn: str) -> None:
    """A token that is not the attempt's, or whose lease has expired, ends nothing: the
    row stays as it was (a late worker cannot overwrite)."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 2)
    async with session(pg_dsn) as conn:
        held = await conn.fetchrow(
            "SELECT seq, lease_token FROM envq.claim($1, 'node-a', 1, interval '30 seconds')",
            queue,
        )
        lapsed = await conn.fetchrow(
            "SELECT seq, lease_token FROM envq.claim($1, 'node-a', 1, interval '0')", queue
        )
        stranger = uuid.uuid4()
        assert (
            await conn.fetchval("SELECT envq.finish($1, $2, 'attempt_ok')", held["seq"], stranger)
            is None
        )
        assert (
            await conn.fetchval(
                "SELECT envq.finish($1, $2, 'attempt_ok')", lapsed["seq"], lapsed["lease_token"]
            )
            is None
        )
        rows = await conn.fetch(
            "SELECT state::text, lease_token FROM envq.envelopes WHERE queue = $1 ORDER BY seq",
            queue,
        )
    assert [tuple(r) for r in rows] == [
        ("running", held["lease_token"]),
        ("running", lapsed["lease_token"]),
    ]


@pytest.mark.real_clock
@pytest.mark.parametrize(
    ("call", "names"),
    [
        ("envq.claim($1, 'node-a', 0, interval '1 second')", "how_many"),
        ("envq.claim($1, 'node-a', 1, interval '-1 second')", "lease"),
        ("envq.claim($1, '', 1, interval '1 second')", "owner"),
    ],
)
async def test_claim_refuses_bad_arguments_by_name(pg_dsn: str, call: str, names: str) -> None:
    """A count below one, a negative lease or an empty owner raise 22023 (invalid
    parameter value) naming the parameter and the value."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 1)
    async with session(pg_dsn) as conn:
        with pytest.raises(_postgres_error()) as caught:
            await conn.fetch(f"SELECT * FROM {call}", queue)
    assert caught.value.sqlstate == "22023"  # type: ignore[attr-defined]
    assert names in str(caught.value)


@pytest.mark.real_clock
async def test_finish_with_an_event_that_does_not_end_an_attempt_is_refused(
    pg_dsn: str,
) -> None:
    """Ending an attempt with a queue-side event (or a cancel with no cause) is refused
    by the tables, not silently ignored."""
    from pg_support import session  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 1)
    async with session(pg_dsn) as conn:
        held = await conn.fetchrow(
            "SELECT seq, lease_token FROM envq.claim($1, 'node-a', 1, interval '30 seconds')",
            queue,
        )
        for event in ("due", "attempt_cancelled"):
            with pytest.raises(_postgres_error()) as caught:
                async with conn.transaction():
                    await conn.fetchval(
                        f"SELECT envq.finish($1, $2, '{event}')", held["seq"], held["lease_token"]
                    )
            assert caught.value.sqlstate == "EQ001"  # type: ignore[attr-defined]


@pytest.mark.real_clock
async def test_a_renewal_and_an_end_of_the_same_attempts_never_deadlock(pg_dsn: str) -> None:
    """A node renews its leases and ends some of the same attempts on two sessions at
    once. The rows lie in the table in the reverse of their seq order (each was
    rewritten last to first), and a third session holds the middle one: the renewal
    and the end both wait for it; when it lets go, both complete (each locks its rows
    in seq order), where locking in the table's order made them deadlock."""
    import asyncpg  # noqa: PLC0415

    queue = await _queue_with_ready(pg_dsn, 6)
    setup = await asyncpg.connect(pg_dsn)
    holder = await asyncpg.connect(pg_dsn)
    renewer = await asyncpg.connect(pg_dsn)
    ender = await asyncpg.connect(pg_dsn)
    try:
        claimed = await setup.fetch(
            "SELECT seq, lease_token FROM envq.claim($1, 'node-a', 6, interval '60 seconds')",
            queue,
        )
        seqs = sorted(r["seq"] for r in claimed)
        tokens = {r["seq"]: r["lease_token"] for r in claimed}
        for seq in reversed(seqs):
            # Each rewritten at the table's end, last seq first, and indexed anew (a
            # changed indexed column: no HOT update, which would keep its place).
            await setup.execute(
                "UPDATE envq.envelopes SET lease_expires_at = lease_expires_at"
                " + interval '1 millisecond' WHERE seq = $1",
                seq,
            )
        middle = seqs[3]
        hold = holder.transaction()
        await hold.start()
        await holder.execute("SELECT 1 FROM envq.envelopes WHERE seq = $1 FOR UPDATE", middle)
        renewal = asyncio.ensure_future(
            renewer.fetch(
                "SELECT * FROM envq.renew($1, 'node-a', interval '60 seconds', $2::uuid[])",
                queue,
                [tokens[s] for s in seqs],
            )
        )
        ending = asyncio.ensure_future(
            ender.fetch(
                "SELECT * FROM envq.finish_many($1::bigint[], $2::uuid[],"
                " $3::envq.envelope_event[], $4::envq.decision_kind[],"
                " $5::envq.cancel_cause[], $6::float8[], $7::integer[], $8::jsonb[])",
                seqs,
                [tokens[s] for s in seqs],
                ["attempt_ok"] * len(seqs),
                [None] * len(seqs),
                [None] * len(seqs),
                [0.0] * len(seqs),
                [None] * len(seqs),
                [None] * len(seqs),
            )
        )
        await asyncio.sleep(0.5)  # both are waiting for the held row by now
        assert not renewal.done()
        assert not ending.done()
        await hold.rollback()
        renewed, ended = await asyncio.wait_for(asyncio.gather(renewal, ending), 30)
    finally:
        for conn in (setup, holder, renewer, ender):
            await conn.close()
    assert sorted(r["seq"] for r in ended) == seqs
    # Whichever came second found the leases ended (nothing left to renew) or renewed
    # them before they ended; neither failed.
    assert len(renewed) in (0, len(seqs))
