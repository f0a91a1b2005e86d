"""PgQueue.subscribe(): the events of a shared queue, read back from the journal.

A producer-only PgQueue subscribes while a second PgQueue (another pool, another node
name) runs the envelopes: the producer must hear of every move the worker node makes,
in order. Waits are for conditions, with generous limits; no timing is asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, nullcontext
from pathlib import Path

import pg_jobs
import pytest

import envq
from envq import EnvState, Outcome, QueueState, _machine
from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

_names = itertools.count()

N, B, R, D, RUN, P = (
    EnvState.NEW,
    EnvState.BUFFERED,
    EnvState.READY,
    EnvState.DELAYED,
    EnvState.RUNNING,
    EnvState.PARKED,
)
RETRY = envq.Retry(attempts=3, base=0.05, jitter=False)


@pytest.fixture
def qname() -> str:
    return f"s{next(_names)}-{uuid.uuid4().hex[:6]}"


class Recorder:
    """A listener keeping every event it hears."""

    def __init__(self) -> None:
        self.events: list[envq.Event] = []

    def __call__(self, event: envq.Event) -> None:
        self.events.append(event)

    def of(self, ident: object) -> list[tuple[object, object, object]]:
        """(from, to, outcome) of the envelope whose id is ``ident``, in order."""
        return [
            (e.from_state, e.to_state, e.outcome)
            for e in self.events
            if e.envelope is not None and e.envelope.id == ident
        ]

    def queue_moves(self) -> list[tuple[object, object]]:
        return [(e.from_state, e.to_state) for e in self.events if e.envelope is None]

    def summary(self) -> str:
        """Every event heard, briefly: ``id from->to(outcome)`` in order."""
        return ", ".join(
            f"{'queue' if e.envelope is None else e.envelope.id} {e.from_state.value}"
            f"->{e.to_state.value}{'' if e.outcome is None else f'({e.outcome.value})'}"
            for e in self.events
        )


async def until(
    check: Callable[[], bool], limit: float = 20.0, heard: Recorder | None = None
) -> None:
    """Wait for ``check`` to hold, failing after ``limit`` seconds (saying what
    ``heard`` had heard by then)."""
    end = time.monotonic() + limit
    while not check():
        if time.monotonic() > end:
            story = "" if heard is None else f"; heard: {heard.summary()}"
            raise AssertionError(f"not reached within {limit} s{story}")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def producer(dsn: str, name: str) -> AsyncIterator[PgQueue]:
    q = PgQueue(dsn, name, workers=0, poll=0.1, event_poll=0.05, node=f"producer-{name}")
    await q.install()
    async with q:
        yield q


@asynccontextmanager
async def worker(dsn: str, name: str, lease: float = 5.0) -> AsyncIterator[PgQueue]:
    async with PgQueue(dsn, name, workers=4, lease=lease, poll=0.1, node=f"worker-{name}") as q:
        yield q


def event_tasks() -> list[asyncio.Task[object]]:
    return [
        t
        for t in asyncio.all_tasks()
        if t.get_name().startswith("envq-pg-events-") and not t.done()
    ]


async def journal_flag(dsn: str, name: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return bool(await conn.fetchval("SELECT journal FROM envq.queues WHERE name = $1", name))
    finally:
        await conn.close()


class TestEventsOfAnotherNode:
    async def test_every_move_of_a_worker_node_reaches_a_producer_in_order(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        # pg_jobs counts attempts by id in this process: another test's "retried" would
        # make fail_twice fail once only.
        for ident in ("ok", "retried", "failed", "spent", "tick"):
            pg_jobs.SEEN.pop(ident, None)
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.start()
            await prod.send(
                envq.Envelope(invoke=pg_jobs.noop, id="ok", payload={"to": "a"}),
                envq.Envelope(invoke=pg_jobs.fail_twice, id="retried", retry=RETRY),
                envq.Envelope(invoke=pg_jobs.fail, id="failed"),
                envq.Envelope(invoke=pg_jobs.fail, id="spent", retry=RETRY),
                envq.Envelope(invoke=pg_jobs.noop, id="tick", interval=0.1),
            )
            async with worker(pg_dsn, qname) as node:
                await node.start()
                await until(
                    lambda: (
                        len(rec.of("spent")) >= 9
                        and len(rec.of("retried")) >= 9
                        and sum(1 for x in rec.of("tick") if x[2] is Outcome.OK) >= 2
                        and len(rec.of("ok")) >= 3
                        and len(rec.of("failed")) >= 3
                    ),
                    heard=rec,
                )
                await prod.stop(envq.StopMode.STOP)
            await until(lambda: (QueueState.STOPPING, QueueState.STOPPED) in rec.queue_moves())

        assert rec.queue_moves() == [
            (QueueState.INIT, QueueState.RUNNING),
            (QueueState.RUNNING, QueueState.STOPPING),
            (QueueState.STOPPING, QueueState.STOPPED),
        ]
        assert rec.of("ok") == [(N, R, None), (R, RUN, None), (RUN, EnvState.SUCCEEDED, Outcome.OK)]
        failing_attempt = [(R, RUN, None), (RUN, D, Outcome.ERROR), (D, R, None)]
        assert rec.of("retried") == [
            (N, R, None),
            *failing_attempt,
            *failing_attempt,
            (R, RUN, None),
            (RUN, EnvState.SUCCEEDED, Outcome.OK),
        ]
        assert rec.of("failed") == [
            (N, R, None),
            (R, RUN, None),
            (RUN, EnvState.FAILED, Outcome.ERROR),
        ]
        assert rec.of("spent") == [
            (N, R, None),
            *failing_attempt,
            *failing_attempt,
            (R, RUN, None),
            (RUN, EnvState.FAILED, Outcome.ERROR),
        ]
        # A periodic envelope: each run ends OK and waits for the next one, until the
        # stop parks it.
        tick = rec.of("tick")
        assert tick[0] == (N, R, None)
        runs = tick[1:]
        while runs[:3] == [(R, RUN, None), (RUN, D, Outcome.OK), (D, R, None)]:
            runs = runs[3:]
        assert runs in (
            [(R, RUN, None), (RUN, D, Outcome.OK), (D, P, None)],
            [(R, RUN, None), (RUN, P, Outcome.OK)],
            [(D, P, None)],
            [(R, P, None)],
        ), tick

        by_id = {e.envelope.id: e for e in rec.events if e.envelope is not None}
        assert by_id["ok"].envelope is not None
        assert by_id["ok"].envelope.payload == {"to": "a"}
        assert by_id["ok"].envelope.invoke is pg_jobs.noop
        assert by_id["tick"].envelope is not None
        assert by_id["tick"].envelope.interval == 0.1
        assert all(e.queue == qname for e in rec.events)
        # The server's clock, as epoch seconds, never going back along one envelope.
        assert all(abs(e.time - time.time()) < 600 for e in rec.events)
        for ident in ("ok", "retried", "failed", "spent", "tick"):
            times = [e.time for e in rec.events if e.envelope and e.envelope.id == ident]
            assert times == sorted(times)

        causes = {
            ident: [e.cause for e in rec.events if e.envelope and e.envelope.id == ident]
            for ident in ("ok", "failed", "spent")
        }
        assert causes["ok"] == [None, None, None]
        assert causes["failed"][-1] is None
        spent = causes["spent"][-1]
        assert isinstance(spent, envq.MaxRetriesExceeded)
        assert "3 attempts" in str(spent)
        assert all(c is None for c in causes["spent"][:-1])

    async def test_a_buffered_envelope_enters_before_the_start(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="early"))
            async with worker(pg_dsn, qname) as node:
                await node.start()
                await until(lambda: len(rec.of("early")) == 4)
        assert rec.of("early") == [
            (N, B, None),
            (B, R, None),
            (R, RUN, None),
            (RUN, EnvState.SUCCEEDED, Outcome.OK),
        ]
        assert rec.queue_moves() == [(QueueState.INIT, QueueState.RUNNING)]

    async def test_an_expired_lease_is_reported_with_its_outcome(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.start()
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="lost", retry=RETRY))
            # A node that claims the envelope and dies: its lease runs out.
            conn = await asyncpg.connect(pg_dsn)
            try:
                claimed = await conn.fetch(
                    "SELECT seq FROM envq.claim($1, 'ghost', 1, interval '0.2 seconds')", qname
                )
            finally:
                await conn.close()
            assert len(claimed) == 1
            await asyncio.sleep(0.3)
            async with worker(pg_dsn, qname) as node:
                await node.start()
                await until(lambda: (RUN, EnvState.SUCCEEDED, Outcome.OK) in rec.of("lost"))
        assert rec.of("lost") == [
            (N, R, None),
            (R, RUN, None),
            (RUN, D, Outcome.EXPIRED),
            (D, R, None),
            (R, RUN, None),
            (RUN, EnvState.SUCCEEDED, Outcome.OK),
        ]

    async def test_terminate_reports_the_hand_back_and_ends_the_subscription(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.send(
                envq.Envelope(invoke=pg_jobs.noop, id="a"),
                envq.Envelope(invoke=pg_jobs.noop, id="b", payload=[1, 2]),
            )
            assert event_tasks()
            handed = await prod.terminate()
            assert [e.id for e in handed] == ["a", "b"]
            assert not event_tasks()
        assert rec.of("a") == [(N, B, None), (B, EnvState.RETURNED, None)]
        assert rec.of("b") == [(N, B, None), (B, EnvState.RETURNED, None)]
        last = [e for e in rec.events if e.to_state is EnvState.RETURNED]
        assert [e.envelope.payload for e in last if e.envelope] == [None, [1, 2]]
        assert rec.queue_moves() == [(QueueState.INIT, QueueState.TERMINATED)]


class TestSubscriptions:
    async def test_unsubscribe_stops_delivery(self, pg_dsn: str, qname: str) -> None:
        kept, gone = Recorder(), Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(kept)
            unsubscribe = prod.subscribe(gone)
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="one"))
            await until(lambda: len(gone.of("one")) == 1)
            unsubscribe()
            unsubscribe()  # a second call does nothing
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="two"))
            await until(lambda: len(kept.of("two")) == 1)
            await asyncio.sleep(0.2)  # several reads of the journal
        assert gone.of("two") == []
        assert kept.of("one") == gone.of("one") == [(N, B, None)]

    async def test_the_last_unsubscribe_stops_the_task(self, pg_dsn: str, qname: str) -> None:
        async with producer(pg_dsn, qname) as prod:
            unsubscribe = prod.subscribe(Recorder())
            assert event_tasks()
            unsubscribe()
            await until(lambda: not event_tasks(), limit=5.0)
            rec = Recorder()
            prod.subscribe(rec)
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="again"))
            await until(lambda: rec.of("again") == [(N, B, None)])

    async def test_a_raising_listener_is_logged_and_breaks_nothing(
        self, pg_dsn: str, qname: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        def broken(event: envq.Event) -> None:
            raise RuntimeError("listener bug")

        rec = Recorder()
        caplog.set_level(logging.ERROR, logger="envq")
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(broken)
            prod.subscribe(rec)
            await prod.start()
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
            async with worker(pg_dsn, qname) as node:
                await node.start()
                await until(lambda: len(rec.of("x")) == 3)
            assert await prod.counts() == {"succeeded": 1}
        failures = [r for r in caplog.records if "listener" in r.getMessage()]
        assert failures
        assert failures[0].exc_info is not None
        assert isinstance(failures[0].exc_info[1], RuntimeError)
        assert rec.of("x")[-1] == (RUN, EnvState.SUCCEEDED, Outcome.OK)

    async def test_bad_listeners_are_refused(self, pg_dsn: str, qname: str) -> None:
        async def coroutine_listener(event: envq.Event) -> None:
            return None

        async with producer(pg_dsn, qname) as prod:
            with pytest.raises(TypeError, match="listener"):
                prod.subscribe(42)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="async def"):
                prod.subscribe(coroutine_listener)
            assert not event_tasks()
            assert not await journal_flag(pg_dsn, qname)

    async def test_subscribed_before_connecting(self, pg_dsn: str, qname: str) -> None:
        rec = Recorder()
        q = PgQueue(pg_dsn, qname, workers=0, event_poll=0.05)
        await q.install()
        q.subscribe(rec)
        assert not event_tasks()
        async with q:
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
            await until(lambda: rec.of("x") == [(N, B, None)])
        assert not event_tasks()

    async def test_leaving_ends_the_task_after_the_last_moves(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
            assert event_tasks()
        # The send's move is delivered by the time the queue is left.
        assert rec.of("x") == [(N, B, None)]
        assert not event_tasks()

    async def test_the_journal_is_off_until_someone_subscribes(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with producer(pg_dsn, qname) as prod:
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
            assert not await journal_flag(pg_dsn, qname)
            conn = await asyncpg.connect(pg_dsn)
            try:
                rows = await conn.fetchval(
                    "SELECT count(*) FROM envq.journal WHERE queue = $1", qname
                )
            finally:
                await conn.close()
            assert rows == 0
            prod.subscribe(Recorder())
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="y"))
            assert await journal_flag(pg_dsn, qname)


class TestJournalOrder:
    async def test_a_move_committed_late_is_reported_before_later_ones(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="warm-up"))
            await until(lambda: len(rec.events) == 1)
            slow = await asyncpg.connect(pg_dsn)
            try:
                tx = slow.transaction()
                await tx.start()
                # The first move takes its journal number now, and commits last.
                await slow.execute(
                    "INSERT INTO envq.envelopes (queue, invoke, kind, state, event, id)"
                    " VALUES ($1, 'pg_jobs:noop', 'one_off', 'buffered', 'send', '\"first\"')",
                    qname,
                )
                await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="second"))
                await asyncio.sleep(0.5)  # several reads of the journal
                assert rec.of("second") == []
                await tx.commit()
            finally:
                await slow.close()
            await until(lambda: len(rec.events) == 3)
        assert [e.envelope.id for e in rec.events if e.envelope] == ["warm-up", "first", "second"]

    async def test_a_move_rolled_back_does_not_hold_the_later_ones(
        self, pg_dsn: str, qname: str
    ) -> None:
        rec = Recorder()
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="warm-up"))
            await until(lambda: len(rec.events) == 1)
            slow = await asyncpg.connect(pg_dsn)
            try:
                tx = slow.transaction()
                await tx.start()
                await slow.execute(
                    "INSERT INTO envq.envelopes (queue, invoke, kind, state, event, id)"
                    " VALUES ($1, 'pg_jobs:noop', 'one_off', 'buffered', 'send', '\"never\"')",
                    qname,
                )
                await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="after"))
                await tx.rollback()
            finally:
                await slow.close()
            # Well within the longest a hole is held: the rollback settles it.
            await until(lambda: len(rec.of("after")) == 1, limit=3.0)
        assert [e.envelope.id for e in rec.events if e.envelope] == ["warm-up", "after"]

    async def test_an_illegal_move_in_the_journal(self, pg_dsn: str, qname: str) -> None:
        """Under STRICT an illegal move is raised when the queue is left; otherwise it
        is reported as the journal has it."""
        rec = Recorder()
        strict = _machine.STRICT
        refused = pytest.raises(AssertionError, match="illegal envelope move")
        with refused if strict else nullcontext():
            async with producer(pg_dsn, qname) as prod:
                prod.subscribe(rec)
                await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
                await until(lambda: len(rec.events) == 1)
                conn = await asyncpg.connect(pg_dsn)
                try:
                    await conn.execute(
                        "INSERT INTO envq.journal (queue, seq, from_state, to_state, event)"
                        " SELECT queue, seq, 'buffered', 'succeeded', 'dispatch'"
                        " FROM envq.envelopes WHERE queue = $1",
                        qname,
                    )
                finally:
                    await conn.close()
                if not strict:
                    await until(lambda: len(rec.events) == 2)
        if not strict:
            assert rec.of("x")[-1] == (B, EnvState.SUCCEEDED, None)


async def test_a_call_right_after_subscribe_waits_for_the_journal(
    pg_dsn: str, qname: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue's own calls made after subscribe() are reported even when the
    journal takes a while to be turned on."""
    from envq.postgres._journal import Follower  # noqa: PLC0415

    start = Follower._start

    async def slow_start(self: Follower) -> None:
        await asyncio.sleep(0.3)
        await start(self)

    monkeypatch.setattr(Follower, "_start", slow_start)
    rec = Recorder()
    async with producer(pg_dsn, qname) as prod:
        prod.subscribe(rec)
        await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="first"))
        await prod.start()
        await until(lambda: len(rec.events) == 3)
    assert rec.of("first") == [(N, B, None), (B, R, None)]
    assert rec.queue_moves() == [(QueueState.INIT, QueueState.RUNNING)]


async def test_moves_of_node_processes_reach_a_subscriber(
    pg_dsn: str, qname: str, tmp_path: Path
) -> None:
    """Two node processes (``python -m envq.postgres.node``) run the envelopes; the
    subscriber, a producer in this process, hears of every move in order."""
    from fault_support import Cluster  # noqa: PLC0415 - spawns node processes

    rec = Recorder()
    cluster = Cluster(pg_dsn, tmp_path)
    try:
        async with producer(pg_dsn, qname) as prod:
            prod.subscribe(rec)
            await prod.send(
                *(envq.Envelope(invoke=pg_jobs.noop, id=f"ok{i}") for i in range(10)),
                envq.Envelope(invoke=pg_jobs.fail, id="spent", retry=RETRY),
            )
            nodes = cluster.start(qname, ["sub-a", "sub-b"], workers=2, lease=5.0, poll=0.1)
            await until(lambda: len(rec.of("spent")) == 10, limit=60.0)
            await until(lambda: all(len(rec.of(f"ok{i}")) == 4 for i in range(10)))
            for node in nodes:
                node.leave()
    finally:
        cluster.close()
    for i in range(10):
        assert rec.of(f"ok{i}") == [
            (N, B, None),
            (B, R, None),
            (R, RUN, None),
            (RUN, EnvState.SUCCEEDED, Outcome.OK),
        ]
    failing_attempt = [(R, RUN, None), (RUN, D, Outcome.ERROR), (D, R, None)]
    assert rec.of("spent") == [
        (N, B, None),
        (B, R, None),
        *failing_attempt,
        *failing_attempt,
        (R, RUN, None),
        (RUN, EnvState.FAILED, Outcome.ERROR),
    ]
    assert rec.queue_moves()[0] == (QueueState.INIT, QueueState.RUNNING)


async def test_a_journal_that_cannot_be_read_is_logged_and_leaving_still_works(
    pg_dsn: str, qname: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from envq.postgres._journal import Follower  # noqa: PLC0415

    async def lost(self: Follower) -> None:
        raise ConnectionResetError("the connection broke")

    caplog.set_level(logging.WARNING, logger="envq.postgres")
    async with producer(pg_dsn, qname) as prod:
        prod.subscribe(Recorder())
        monkeypatch.setattr(Follower, "_read_and_deliver", lost)
        await prod.send(envq.Envelope(invoke=pg_jobs.noop, id="x"))
        await until(lambda: any("cannot read the journal" in r.message for r in caplog.records))
        assert await prod.counts() == {"buffered": 1}
    assert not event_tasks()
    assert any("last moves could not be read" in r.message for r in caplog.records)
