"""An operator's moves on a PostgreSQL queue (retry, cancel, discard, purge), the story
a row keeps (its last error with the traceback, its failed attempts), and the dead
letter of an envelope that ends FAILED; against the session's throwaway server."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pg_jobs
import pytest

import envq
from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

_names = itertools.count()


def _name() -> str:
    return f"op{next(_names)}-{uuid.uuid4().hex[:6]}"


@asynccontextmanager
async def _queue(dsn: str, **options: Any) -> AsyncIterator[PgQueue]:
    q = PgQueue(dsn, _name(), workers=2, lease=2.0, poll=0.05, **options)
    await q.install()
    async with q:
        await q.start()
        yield q
        await q.terminate()


async def _until(check: Callable[[], Any], what: str) -> None:
    from fault_support import until  # noqa: PLC0415

    async def holds() -> bool:
        return bool(await check())

    await until(holds, what, timeout=30)


async def _row(q: PgQueue, ident: object) -> Any:
    return await q._db().fetchrow(
        "SELECT seq, state::text, kind::text, attempt, last_error, history"
        " FROM envq.envelopes WHERE queue = $1 AND id = $2::jsonb ORDER BY seq DESC LIMIT 1",
        q.name,
        json.dumps(ident),
    )


async def _state(q: PgQueue, ident: object) -> str:
    row = await _row(q, ident)
    return "" if row is None else str(row["state"])


class TestTheStory:
    async def test_failed_attempts_and_the_last_error_are_kept(self, pg_dsn: str) -> None:
        policy = envq.Retry(attempts=3, base=0.01, jitter=False)
        async with _queue(pg_dsn) as q:
            await q.send(envq.Envelope(invoke=pg_jobs.fail, id="story", retry=policy))
            await _until(lambda: _row_state_is(q, "story", "failed"), "the end")
            row = await _row(q, "story")
        error = json.loads(row["last_error"])
        assert error["type"] == "envq._errors.MaxRetriesExceeded"
        assert "failed 3 of 3 attempts" in error["message"]
        assert "RuntimeError: story fails" in error["traceback"]
        history = json.loads(row["history"])
        assert [(h["attempt"], h["outcome"]) for h in history] == [
            (1, "attempt_error"),
            (2, "attempt_error"),
            (3, "attempt_error"),
        ]
        assert [h["error"]["message"] for h in history][:2] == ["story fails"] * 2
        assert all("traceback" not in h["error"] for h in history)  # last_error has it
        assert all(h["node"].startswith(q.node) for h in history)
        assert all(h["started"] <= h["ended"] for h in history)

    async def test_a_success_writes_no_story(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn) as q:
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="ok"))
            await _until(lambda: _row_state_is(q, "ok", "succeeded"), "the end")
            row = await _row(q, "ok")
        assert row["last_error"] is None
        assert row["history"] is None


async def _row_state_is(q: PgQueue, ident: object, state: str) -> bool:
    return await _state(q, ident) == state


class TestRetry:
    async def test_a_failed_envelope_goes_back_and_keeps_its_story(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn) as q:
            pg_jobs.SEEN.pop("again", None)
            await q.send(envq.Envelope(invoke=pg_jobs.fail_twice, id="again"))
            await _until(lambda: _row_state_is(q, "again", "failed"), "the first failure")
            assert await q.retry("again") == 1
            await _until(lambda: _row_state_is(q, "again", "failed"), "the second failure")
            assert await q.retry("again") == 1
            await _until(lambda: _row_state_is(q, "again", "succeeded"), "the success")
            row = await _row(q, "again")
        assert row["attempt"] == 3
        assert len(json.loads(row["history"])) == 2
        assert json.loads(row["last_error"])["message"] == "again fails"

    async def test_a_retry_is_checked_as_a_send(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn, capacity=1) as q:
            await q.send(envq.Envelope(invoke=pg_jobs.fail, id="f"))
            await _until(lambda: _row_state_is(q, "f", "failed"), "the failure")
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="blocker", delay=100))
            with pytest.raises(envq.CapacityExceeded):
                await q.retry("f")
            assert await _state(q, "f") == "failed"
            assert await q.cancel("blocker") == 1
            # The id live again (another envelope with it): a dedup.
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="f", delay=100))
            assert await q.retry("f") == 0
            await q.stop()
            with pytest.raises(envq.QueueNotRunning):
                await q.retry("f")

    async def test_retry_by_seq_and_nothing_for_a_live_or_unknown_one(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn) as q:
            await q.send(envq.Envelope(invoke=pg_jobs.fail, id="s"))
            await _until(lambda: _row_state_is(q, "s", "failed"), "the failure")
            seq = (await _row(q, "s"))["seq"]
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="live", delay=100))
            assert await q.retry("live", "nope") == 0
            assert await q.retry(seqs=[seq]) == 1
            await _until(lambda: _row_state_is(q, "s", "failed"), "the retried failure")
            with pytest.raises(TypeError, match="id must be"):
                await q.retry(["unhashable"])
            with pytest.raises(TypeError, match="seqs"):
                await q.retry(seqs=["1"])  # type: ignore[list-item]


class TestCancel:
    async def test_a_waiting_envelope_is_stopped(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn) as q:
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="later", delay=100))
            assert await q.cancel("later", "nope") == 1
            assert await _state(q, "later") == "stopped"
            assert await q.cancel("later") == 0

    async def test_a_running_envelope_is_asked_to_stop_and_ends_stopped(self, pg_dsn: str) -> None:
        decided: list[object] = []
        async with _queue(pg_dsn) as q:
            await q.send(
                envq.Envelope(
                    invoke=pg_jobs.slow,
                    id="long",
                    payload="300",
                    on_failure=pg_jobs.retry_then_drop,
                )
            )
            await _until(lambda: _row_state_is(q, "long", "running"), "the attempt")
            assert await q.cancel("long") == 1
            assert (await _row(q, "long"))["kind"] == "cancelled"
            await _until(lambda: _row_state_is(q, "long", "stopped"), "the stop")
            decided.append(q.counts_local)
        assert decided == [{"finished": 1, "fenced": 0, "reaped": 0}]


class TestDiscardAndPurge:
    async def test_ended_rows_are_discarded_and_live_ones_kept(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn) as q:
            await q.send(
                envq.Envelope(invoke=pg_jobs.noop, id="done"),
                envq.Envelope(invoke=pg_jobs.noop, id="waiting", delay=100),
            )
            await _until(lambda: _row_state_is(q, "done", "succeeded"), "the end")
            assert await q.discard("done", "waiting") == 1
            assert await _row(q, "done") is None
            assert await _state(q, "waiting") == "delayed"

    async def test_purge_removes_only_what_ended_before_the_age(self, pg_dsn: str) -> None:
        async with _queue(pg_dsn) as q:
            await q.send(*(envq.Envelope(invoke=pg_jobs.noop, id=f"p{i}") for i in range(5)))
            await _until(lambda: _count_is(q, "succeeded", 5), "the five to succeed")
            assert await q.purge(3600) == 0
            await asyncio.sleep(0.2)
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="later", delay=100))
            assert await q.purge(0.1) == 5
            assert await q.counts() == {"delayed": 1}
            with pytest.raises(ValueError, match="older_than"):
                await q.purge(-1)


async def _count_is(q: PgQueue, state: str, n: int) -> bool:
    return (await q.counts()).get(state, 0) == n


class TestDeadLetter:
    async def test_a_failed_envelope_is_handed_to_the_dead_letter_once(self, pg_dsn: str) -> None:
        seen: list[tuple[object, str]] = []

        def dead(env: envq.Envelope, error: BaseException | None) -> None:
            seen.append((env.id, type(error).__name__))

        policy = envq.Retry(attempts=2, base=0.01, jitter=False)
        async with _queue(pg_dsn, dead_letter=dead) as q:
            await q.send(
                envq.Envelope(invoke=pg_jobs.fail, id="dl", retry=policy),
                envq.Envelope(invoke=pg_jobs.noop, id="fine"),
            )
            await _until(lambda: _row_state_is(q, "dl", "failed"), "the failure")
            await _until(lambda: _row_state_is(q, "fine", "succeeded"), "the success")
            await asyncio.sleep(0.1)
        assert seen == [("dl", "MaxRetriesExceeded")]

    def test_a_dead_letter_that_is_not_callable_is_refused(self) -> None:
        with pytest.raises(TypeError, match="dead_letter"):
            PgQueue("postgresql://u@/d", "q", dead_letter="nope")  # type: ignore[arg-type]


class TestRetention:
    async def test_a_node_removes_what_the_retention_no_longer_keeps(
        self, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Ended envelopes and journal rows older than the retention go; live ones and
        younger ones stay."""
        from envq.postgres import _node  # noqa: PLC0415

        monkeypatch.setattr(_node, "RETIRE_EVERY", 0.1)
        async with _queue(pg_dsn, retention=0.5) as q:
            q.subscribe(lambda event: None)  # the journal on
            await q.send(
                *(envq.Envelope(invoke=pg_jobs.noop, id=f"kept{i}") for i in range(3)),
                envq.Envelope(invoke=pg_jobs.noop, id="waits", delay=100),
            )
            await _until(lambda: _count_is(q, "succeeded", 3), "the three to succeed")
            journal_before = await _journal_rows(q)
            assert journal_before > 0
            await _until(lambda: _count_is(q, "succeeded", 0), "the retention")
            assert await q.counts() == {"delayed": 1}
            await _until(lambda: _journal_empty_of_old(q), "the journal's retention")

    def test_retention_is_checked(self) -> None:
        with pytest.raises(ValueError, match="retention"):
            PgQueue("postgresql://u@/d", "q", retention=0)
        with pytest.raises(TypeError, match="retention"):
            PgQueue("postgresql://u@/d", "q", retention="7d")  # type: ignore[arg-type]
        assert PgQueue("postgresql://u@/d", "q", retention=None).retention is None
        assert PgQueue("postgresql://u@/d", "q").retention == 7 * 86400


async def _journal_rows(q: PgQueue) -> int:
    return int(await q._db().fetchval("SELECT count(*) FROM envq.journal WHERE queue = $1", q.name))


async def _journal_empty_of_old(q: PgQueue) -> bool:
    return not await q._db().fetchval(
        "SELECT count(*) FROM envq.journal WHERE queue = $1"
        " AND at < clock_timestamp() - interval '2 seconds'",
        q.name,
    )
