"""PgQueue's moves that the conformance driver found wrong, each on a real server:
a delayed send to a running queue, a dedup counted against the capacity, a terminate
of a running queue that skipped its stop, and a start that forgot the wait left."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

import envq
from envq.postgres._queue import PgQueue
from envq.postgres.driver import invoke

pytestmark = pytest.mark.real_clock


def _name() -> str:
    return f"moves-{uuid.uuid4().hex[:10]}"


async def _states(q: PgQueue) -> dict[str, int]:
    return await q.counts()


async def test_a_delayed_envelope_sent_to_a_running_queue_waits(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        await q.start()
        assert await q.send(envq.Envelope(invoke=invoke, id="a", delay=60.0)) == 1
        assert await _states(q) == {"delayed": 1}


async def test_a_dedup_takes_no_room(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, _name(), workers=0, capacity=1) as q:
        env = envq.Envelope(invoke=invoke, id="a")
        assert await q.send(env) == 1
        assert await q.send(env) == 0
        assert await q.send(env, env) == 0
        with pytest.raises(envq.CapacityExceeded):
            await q.send(envq.Envelope(invoke=invoke, id="b"))
        assert await _states(q) == {"buffered": 1}


async def test_terminating_a_running_queue_stops_it_first(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        db = q._db()
        await db.execute("UPDATE envq.queues SET journal = true WHERE name = $1", q.name)
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="a"))
        handed = await q.terminate()
        assert [env.id for env in handed] == ["a"]
        moves = await db.fetch(
            "SELECT from_state, to_state FROM envq.journal WHERE queue = $1 AND seq IS NULL"
            " ORDER BY n",
            q.name,
        )
        assert [(m[0], m[1]) for m in moves] == [
            ("init", "running"),
            ("running", "stopping"),
            ("stopping", "stopped"),
            ("stopped", "terminated"),
        ]
        envelope = await db.fetch(
            "SELECT from_state, to_state FROM envq.journal WHERE queue = $1"
            " AND seq IS NOT NULL ORDER BY n",
            q.name,
        )
        assert [(m[0], m[1]) for m in envelope] == [
            (None, "ready"),
            ("ready", "parked"),
            ("parked", "returned"),
        ]


async def test_a_start_arms_a_buffered_envelope_with_its_whole_delay(pg_dsn: str) -> None:
    import asyncio  # noqa: PLC0415

    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        db = q._db()
        await q.send(envq.Envelope(invoke=invoke, id="a", delay=60.0))
        sent_due = await db.fetchval("SELECT due_at FROM envq.envelopes WHERE queue = $1", q.name)
        await asyncio.sleep(0.5)
        await q.start()
        row = await db.fetchrow(
            "SELECT state::text, due_at FROM envq.envelopes WHERE queue = $1", q.name
        )
        assert row["state"] == "delayed"
        # The delay counts from the start, not from the send (0.5 s earlier).
        assert (row["due_at"] - sent_due).total_seconds() >= 0.4


async def test_the_journal_is_off_unless_turned_on(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="a"))
        await q.terminate()
        found = await q._db().fetchval("SELECT count(*) FROM envq.journal WHERE queue = $1", q.name)
        assert found == 0


_CALLS: list[int] = []


async def _no_retry_after_a_success(env: envq.Envelope) -> None:
    """Succeeds on its first run, then raises DoNotRetry."""
    if not _CALLS:
        _CALLS.append(0)
        return
    raise envq.DoNotRetry


async def _record_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> None:
    _CALLS.append(attempt)


async def test_a_periodic_envelope_reports_its_failures_in_a_row(pg_dsn: str) -> None:
    import asyncio  # noqa: PLC0415

    _CALLS.clear()
    env = envq.Envelope(
        invoke=_no_retry_after_a_success, id="p", interval=0.05, on_failure=_record_failure
    )
    async with PgQueue(pg_dsn, _name(), workers=1, poll=0.02) as q:
        await q.start()
        await q.send(env)
        for _ in range(200):
            if len(_CALLS) > 1:
                break
            await asyncio.sleep(0.02)
        await q.terminate()
    # The second run is the first failure since the success: on_failure hears 1, not
    # the attempt number 2.
    assert _CALLS == [0, 1]


async def test_a_cancelling_stop_of_a_stopping_queue_waits_for_the_stop(pg_dsn: str) -> None:
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        db = q._db()
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="a"))
        claimed = await db.fetch(
            "SELECT * FROM envq.claim($1, 'elsewhere', 1, interval '60 seconds')", q.name
        )
        assert len(claimed) == 1
        await q.stop(envq.StopMode.DRAIN, wait=False)
        await q.stop(envq.StopMode.STOP, cancel=True, wait=False)
        found = await db.fetchrow(
            "SELECT state::text, stop_mode::text, cancel::text FROM envq.queues WHERE name = $1",
            q.name,
        )
        # As in one process: the stop under way goes on as it began (drain, no cancel).
        assert tuple(found) == ("stopping", "drain", None)


async def test_a_resend_while_its_attempt_ends_is_counted_once(pg_dsn: str) -> None:
    """Capacity 2, full: ``a`` (RUNNING) and ``b``. ``send(a)`` while ``a``'s attempt
    ends: whether ``a`` is live (a dedup) or not (its room freed, taken again), the
    batch fits. The room and the dedup are read from one snapshot: read apart, the end
    committed between them counted ``a`` both live and new, and the send was refused."""
    async with PgQueue(pg_dsn, _name(), workers=0, capacity=2) as q:
        db = q._db()
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="a"), envq.Envelope(invoke=invoke, id="b"))
        claimed = await db.fetch(
            "SELECT * FROM envq.claim($1, 'elsewhere', 1, interval '60 seconds')", q.name
        )
        assert [r["id"] for r in claimed] == ['"a"']

        class Conn:
            """The send's connection: ``a``'s attempt ends once the room has been read."""

            def __init__(self, conn: Any) -> None:
                self.conn = conn
                self.ended = False

            def __getattr__(self, name: str) -> Any:
                return getattr(self.conn, name)

            async def _read(self, how: str, query: str, *args: Any) -> Any:
                value = await getattr(self.conn, how)(query, *args)
                if "count(" in query and not self.ended:
                    self.ended = True
                    await db.fetchval(
                        "SELECT envq.finish($1, $2, 'attempt_ok')",
                        claimed[0]["seq"],
                        claimed[0]["lease_token"],
                    )
                return value

            async def fetchval(self, query: str, *args: Any) -> Any:
                return await self._read("fetchval", query, *args)

            async def fetchrow(self, query: str, *args: Any) -> Any:
                return await self._read("fetchrow", query, *args)

        class Pool:
            """The queue's pool, handing out the connection above."""

            def acquire(self) -> Any:
                @contextlib.asynccontextmanager
                async def held() -> AsyncIterator[Conn]:
                    async with db.acquire() as conn:
                        yield Conn(conn)

                return held()

        q._pool = Pool()  # type: ignore[assignment]
        try:
            assert await q.send(envq.Envelope(invoke=invoke, id="a")) == 1
        finally:
            q._pool = db
        assert await _states(q) == {"ready": 2, "succeeded": 1}


@pytest.mark.parametrize("mode", ["stop", "drain"])
async def test_a_stop_waits_for_an_end_in_progress_and_parks_what_it_left(
    pg_dsn: str, mode: str
) -> None:
    """An attempt's end holds the queue's row while it computes where its envelope
    goes (here: DELAYED for a retry, the queue RUNNING); a stop begun meanwhile waits
    for the end to commit, then parks the envelope with the others. (Before, the stop
    went ahead, the end committed DELAYED after the stop's moves, and a terminate then
    left the envelope live in a terminated queue. The other order, the end during the
    stop's moves: ``test_pg_end_during_stop.py``.)"""
    async with PgQueue(pg_dsn, _name(), workers=0) as q:
        db = q._db()
        await q.start()
        await q.send(envq.Envelope(invoke=invoke, id="a"))
        claimed = await db.fetchrow("SELECT * FROM envq.claim($1, 'tester', 1, '1 hour')", q.name)
        assert claimed is not None
        async with db.acquire() as ending:
            ending_tx = ending.transaction()
            await ending_tx.start()
            ended = await ending.fetchval(
                "SELECT envq.finish($1, $2, 'attempt_error', 'retry_after', NULL, false,"
                " clock_timestamp() + interval '1 hour')",
                claimed["seq"],
                claimed["lease_token"],
            )
            assert ended == "delayed"  # the queue RUNNING; not committed yet
            stopping = asyncio.create_task(q.stop(envq.StopMode(mode), wait=False))
            await asyncio.sleep(0.3)
            assert not stopping.done()  # the stop waits for the end
            await ending_tx.commit()
        await stopping
        assert await _states(q) == {"parked": 1}  # parked by the stop's own moves
        await q.wait_stopped()
        assert await q.state() is envq.QueueState.STOPPED
