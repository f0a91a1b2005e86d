"""envq.postgres.PgQueue against a real server: its API, its tables, its leases.

Every test uses its own queue name in one database holding the schema; the nodes are
PgQueue objects in this process (the fault tests run real node processes). Waits are
for conditions in the database, with generous limits; no timing is asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pg_jobs
import pytest

import envq
from envq import StopMode
from envq._errors import BadEnvelopeType
from envq.postgres import PgQueue, StoreUnavailable

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

_names = itertools.count()


@pytest.fixture
def qname() -> str:
    return f"q{next(_names)}-{uuid.uuid4().hex[:6]}"


@asynccontextmanager
async def opened(dsn: str, name: str) -> AsyncIterator[PgQueue]:
    """A connected node of queue ``name`` with 4 workers (not started)."""
    q = PgQueue(dsn, name, workers=4, lease=5.0, poll=0.1)
    await q.install()
    async with q:
        yield q


async def until(check: Callable[[], Awaitable[bool]], limit: float = 20.0) -> None:
    """Wait for ``check`` to hold (polled), failing after ``limit`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not await check():
        if loop.time() > end:
            raise AssertionError(f"not reached within {limit} s")
        await asyncio.sleep(0.05)


def settled(q: PgQueue, **want: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        counts = await q.counts()
        return all(counts.get(state, 0) == n for state, n in want.items())

    return check


class TestSend:
    async def test_a_batch_runs_to_success(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            envs = [
                envq.Envelope(invoke=pg_jobs.noop, id=f"a{i}", payload={"i": i}) for i in range(30)
            ]
            assert await queue.send(*envs) == 30
            await queue.start()
            await until(settled(queue, succeeded=30))
            assert await queue.counts() == {"succeeded": 30}

    async def test_plain_functions_run_in_threads(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            await queue.send(envq.Envelope(invoke=pg_jobs.plain, id="plain"))
            await until(settled(queue, succeeded=1))

    async def test_a_live_id_is_a_dedup_and_a_finished_one_is_not(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with opened(pg_dsn, qname) as queue:
            env = envq.Envelope(invoke=pg_jobs.noop, id="same")
            assert await queue.send(env) == 1
            assert await queue.send(envq.Envelope(invoke=pg_jobs.noop, id="same")) == 0
            assert await queue.send(env, env) == 0
            await queue.start()
            await until(settled(queue, succeeded=1))
            assert await queue.send(env) == 1
            await until(settled(queue, succeeded=2))

    @pytest.mark.parametrize(
        ("make", "field"),
        [
            (lambda: envq.Envelope(invoke=lambda env: None), "invoke"),
            (lambda: envq.Envelope(invoke=pg_jobs.noop, payload={1, 2}), "payload"),
            (lambda: envq.Envelope(invoke=pg_jobs.noop, id=object()), "id"),
            (
                lambda: envq.Envelope(invoke=pg_jobs.noop, on_failure=lambda e, x, n: None),
                "on_failure",
            ),
            (lambda: envq.Envelope(invoke=pg_jobs.noop, payload=float("nan")), "payload"),
        ],
    )
    async def test_what_cannot_cross_fails_at_once_and_admits_nothing(
        self, pg_dsn: str, qname: str, make: Callable[[], envq.Envelope], field: str
    ) -> None:
        async with opened(pg_dsn, qname) as queue:
            good = envq.Envelope(invoke=pg_jobs.noop, id="good")
            with pytest.raises(BadEnvelopeType, match=field):
                await queue.send(good, make())
            assert await queue.counts() == {}

    async def test_a_closure_is_refused(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:

            def inner(env: envq.Envelope) -> None:
                return None

            with pytest.raises(BadEnvelopeType, match=r"invoke.*inside another"):
                await queue.send(envq.Envelope(invoke=inner))

    async def test_not_an_envelope(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            with pytest.raises(TypeError, match=r"not an envq\.Envelope"):
                await queue.send("job")  # type: ignore[arg-type]

    async def test_a_batch_over_capacity_is_refused_whole(self, pg_dsn: str, qname: str) -> None:
        async with PgQueue(pg_dsn, qname, workers=0, capacity=3) as q:
            await q.send(*(envq.Envelope(invoke=pg_jobs.noop, id=i) for i in range(2)))
            with pytest.raises(envq.CapacityExceeded, match="2 of 3"):
                await q.send(*(envq.Envelope(invoke=pg_jobs.noop, id=i) for i in range(10, 12)))
            assert await q.counts() == {"buffered": 2}
            with pytest.raises(envq.SendTimeout):
                await q.send_wait(
                    *(envq.Envelope(invoke=pg_jobs.noop, id=i) for i in range(20, 22)), timeout=0.3
                )

    async def test_a_password_never_reaches_the_error(self, qname: str) -> None:
        q = PgQueue("postgresql://someone:sekret@127.0.0.1:1/nothing", qname)
        with pytest.raises(StoreUnavailable) as caught:
            await q.connect()
        assert "sekret" not in str(caught.value)
        assert "sekret" not in repr(q)

    def test_bad_arguments_name_themselves(self, pg_dsn: str) -> None:
        with pytest.raises(TypeError, match="workers"):
            PgQueue(pg_dsn, "x", workers="4")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="lease"):
            PgQueue(pg_dsn, "x", lease=0)
        with pytest.raises(ValueError, match="name"):
            PgQueue(pg_dsn, "")
        with pytest.raises(TypeError, match="dsn"):
            PgQueue(None, "x")  # type: ignore[arg-type]


class TestLifecycle:
    async def test_sends_before_start_are_buffered_then_armed(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.send(envq.Envelope(invoke=pg_jobs.noop, id="b"))
            assert await queue.counts() == {"buffered": 1}
            await queue.start()
            await until(settled(queue, succeeded=1))

    async def test_a_stop_on_one_node_stops_every_node(self, pg_dsn: str, qname: str) -> None:
        async with (
            PgQueue(pg_dsn, qname, workers=2, poll=0.1) as a,
            PgQueue(pg_dsn, qname, workers=2, poll=0.1) as b,
        ):
            await a.start()
            await b.start()
            await a.send(
                *(envq.Envelope(invoke=pg_jobs.slow, id=i, payload=0.05) for i in range(8))
            )
            await b.stop(StopMode.DRAIN)
            assert await a.state() is envq.QueueState.STOPPED
            # DRAIN ran what was ready.
            assert await a.counts() == {"succeeded": 8}
            with pytest.raises(envq.QueueNotRunning):
                await a.send(envq.Envelope(invoke=pg_jobs.noop, id="late"))
            await a.start()
            assert await b.state() is envq.QueueState.RUNNING

    async def test_stop_parks_ready_and_start_runs_them(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            await queue.stop(StopMode.STOP)
            await queue.start()
            await queue.send(envq.Envelope(invoke=pg_jobs.noop, id="x", delay=30))
            await queue.stop(StopMode.STOP)
            assert await queue.counts() == {"parked": 1}

    async def test_terminate_hands_back_re_created_envelopes(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            sent = [
                envq.Envelope(invoke=pg_jobs.noop, id=("t", i), payload={"n": i}, type="k")
                for i in range(3)
            ]
            await queue.send(*sent)
            back = await queue.terminate()
            assert [(e.id, e.payload, e.invoke, e.type) for e in back] == [
                (e.id, e.payload, e.invoke, e.type) for e in sent
            ]
            assert await queue.state() is envq.QueueState.TERMINATED
            with pytest.raises(envq.QueueTerminated):
                await queue.start()
            assert await queue.terminate() == []


class TestOutcomes:
    async def test_the_retry_policy_decides(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            policy = envq.Retry(attempts=3, base=0.01, jitter=False)
            for key in ("r1", "r2"):  # another test of this process may have run them
                pg_jobs.SEEN.pop(key, None)
            await queue.send(
                envq.Envelope(invoke=pg_jobs.fail, id="r1", retry=policy),
                envq.Envelope(invoke=pg_jobs.fail_twice, id="r2", retry=policy),
            )
            await until(settled(queue, failed=1, succeeded=1))
            assert pg_jobs.SEEN["r1"] == 3
            assert pg_jobs.SEEN["r2"] == 3

    async def test_on_failure_decides(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            await queue.send(
                envq.Envelope(invoke=pg_jobs.fail, id="of", on_failure=pg_jobs.retry_then_drop)
            )
            await until(settled(queue, failed=1))
            assert pg_jobs.SEEN["of"] == 3

    async def test_a_deadline_times_out(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            await queue.send(envq.Envelope(invoke=pg_jobs.slow, id="d", payload=30, deadline=0.1))
            await until(settled(queue, failed=1))

    async def test_a_periodic_envelope_runs_again_until_stopped(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            await queue.send(envq.Envelope(invoke=pg_jobs.noop, id="per", interval=0.05))
            await until(lambda: _at_least(pg_jobs.SEEN, "per", 3))
            await queue.stop()
            assert await queue.counts() == {"parked": 1}

    async def test_stop_type_blacklists_the_type(self, pg_dsn: str, qname: str) -> None:
        async with opened(pg_dsn, qname) as queue:
            await queue.start()
            await queue.send(envq.Envelope(invoke=pg_jobs.stop_type, id="st", type="bad"))
            await until(settled(queue, stopped=1))
            with pytest.raises(envq.TypeBlacklisted):
                await queue.send(envq.Envelope(invoke=pg_jobs.noop, type="bad"))


async def _at_least(seen: dict[object, int], key: object, n: int) -> bool:
    return seen.get(key, 0) >= n


class TestLeases:
    async def _claim_as_ghost(self, dsn: str, queue: str, lease: float) -> asyncpg.Record:
        conn = await asyncpg.connect(dsn)
        try:
            (row,) = await conn.fetch(
                "SELECT seq, lease_token FROM envq.claim($1, 'ghost', 1, $2 * interval '1 second')",
                queue,
                lease,
            )
            return row
        finally:
            await conn.close()

    async def test_an_expired_lease_is_reaped_and_the_late_result_refused(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with PgQueue(pg_dsn, qname, workers=0) as producer:
            await producer.start()
            await producer.send(
                envq.Envelope(
                    invoke=pg_jobs.noop, id="lease", retry=envq.Retry(attempts=3, base=0.01)
                )
            )
            ghost = await self._claim_as_ghost(pg_dsn, qname, 0.2)
            async with PgQueue(pg_dsn, qname, workers=2, poll=0.05, lease=5) as node:
                await node.start()
                await until(settled(node, succeeded=1))
                assert node.counts_local["reaped"] == 1
            conn = await asyncpg.connect(pg_dsn)
            try:
                late = await conn.fetchval(
                    "SELECT envq.finish($1, $2, 'attempt_ok')", ghost["seq"], ghost["lease_token"]
                )
                attempt = await conn.fetchval(
                    "SELECT attempt FROM envq.envelopes WHERE seq = $1", ghost["seq"]
                )
            finally:
                await conn.close()
            assert late is None
            assert attempt == 2

    async def test_an_expired_lease_without_a_policy_fails(self, pg_dsn: str, qname: str) -> None:
        async with PgQueue(pg_dsn, qname, workers=0) as producer:
            await producer.start()
            await producer.send(envq.Envelope(invoke=pg_jobs.noop, id="ghosted"))
            await self._claim_as_ghost(pg_dsn, qname, 0.1)
            async with PgQueue(pg_dsn, qname, workers=1, poll=0.05) as reaper:
                await reaper.start()
                await until(settled(reaper, failed=1))
                assert reaper.counts_local == {"finished": 0, "fenced": 0, "reaped": 1}, (
                    reaper.counts_local,
                    await reaper.counts(),
                )

    async def test_two_reapers_at_once_decide_an_expired_attempt_once(
        self, pg_dsn: str, qname: str
    ) -> None:
        """Both see the expired lease; only the one holding the row calls on_failure
        (slow here, so that without the row lock both would be inside it together)."""
        async with (
            PgQueue(pg_dsn, qname, workers=0, node="r1") as one,
            PgQueue(pg_dsn, qname, workers=0, node="r2") as two,
        ):
            await one.start()
            await one.send(
                envq.Envelope(invoke=pg_jobs.noop, id="twice?", on_failure=pg_jobs.slow_decision)
            )
            await self._claim_as_ghost(pg_dsn, qname, 0.05)
            await asyncio.sleep(0.1)
            await asyncio.gather(one._node.reap_unserved(), two._node.reap_unserved())
            assert pg_jobs.DECIDED.get("twice?") == 1
            assert one.counts_local["reaped"] + two.counts_local["reaped"] == 1
            assert await one.counts() == {"failed": 1}

    async def test_an_expired_periodic_run_goes_on_with_its_schedule(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with PgQueue(pg_dsn, qname, workers=0) as producer:
            await producer.start()
            await producer.send(envq.Envelope(invoke=pg_jobs.noop, id="pghost", interval=0.05))
            await self._claim_as_ghost(pg_dsn, qname, 0.1)
            async with PgQueue(pg_dsn, qname, workers=1, poll=0.05) as node:
                await node.start()
                await until(lambda: _at_least(pg_jobs.SEEN, "pghost", 2))
                assert node.counts_local["reaped"] == 1

    async def test_renewals_racing_claims_and_ends_lose_no_lease(
        self, pg_dsn: str, qname: str
    ) -> None:
        """A renewal whose snapshot misses a claim committing meanwhile, or sees an end
        committed before its attempt is done, must not take the lease for lost."""
        async with PgQueue(pg_dsn, qname, workers=8, lease=0.3, poll=0.05) as node:
            await node.send(
                *(envq.Envelope(invoke=pg_jobs.noop, id=("race", i)) for i in range(600))
            )
            await node.start()
            await until(settled(node, succeeded=600), limit=60)
            await until(lambda: _finished(node, 600))
            assert node.counts_local == {"finished": 600, "fenced": 0, "reaped": 0}


async def _finished(node: PgQueue, n: int) -> bool:
    return node.counts_local["finished"] + node.counts_local["fenced"] >= n


class TestStatistics:
    async def test_the_snapshot_counts_the_shared_queue_and_this_process(
        self, pg_dsn: str, qname: str
    ) -> None:
        async with PgQueue(pg_dsn, qname, workers=2, capacity=5, poll=0.05) as q:
            await q.send(*(envq.Envelope(invoke=pg_jobs.noop, id=("s", i)) for i in range(3)))
            await q.send(envq.Envelope(invoke=pg_jobs.noop, id=("s", 0)))  # a dedup
            with pytest.raises(envq.CapacityExceeded):
                await q.send(*(envq.Envelope(invoke=pg_jobs.noop, id=("x", i)) for i in range(3)))
            with pytest.raises(BadEnvelopeType):
                await q.send(envq.Envelope(invoke=lambda env: None))
            before = await q.statistics()
            assert before.state is envq.QueueState.INIT
            assert before.by_state == {envq.EnvState.BUFFERED: 3}
            assert (before.capacity_used, before.capacity_limit, before.in_flight) == (3, 5, 0)
            assert before.dedups == 1
            assert before.rejections == {"capacity": 1, "invalid": 1}
            await q.start()
            await q.send(envq.Envelope(invoke=pg_jobs.fail, id="bad"))
            await until(settled(q, succeeded=3, failed=1))
            await until(lambda: _finished(q, 4))
            after = await q.statistics()
            assert after.state is envq.QueueState.RUNNING
            assert after.by_state == {envq.EnvState.SUCCEEDED: 3, envq.EnvState.FAILED: 1}
            assert after.capacity_used == 0
            assert after.outcomes == {envq.Outcome.OK: 3, envq.Outcome.ERROR: 1}
            await q.stop()
            with pytest.raises(envq.QueueNotRunning):
                await q.send(envq.Envelope(invoke=pg_jobs.noop))
            assert (await q.statistics()).rejections == {"capacity": 1, "invalid": 1, "state": 1}
