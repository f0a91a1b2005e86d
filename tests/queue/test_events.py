"""docs/events.md: events, subscribe/unsubscribe, listener failures, statistics snapshots."""

from __future__ import annotations

import asyncio
import itertools
import logging

import attrs
import pytest

import envq
from envq.conform.oracle import LIVE
from tests.support import Recorder, lasting, settle

S = envq.EnvState
Q = envq.QueueState
OC = envq.Outcome


class TestEnvelopeEvents:
    async def test_one_off_success(self) -> None:
        """A one-off goes NEW→READY→RUNNING→SUCCEEDED, the last with outcome OK, at loop times."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        await asyncio.sleep(3)
        env = lasting(5)
        q.send(env)
        await asyncio.sleep(10)
        assert log.moves(env) == [
            (S.NEW, S.READY, None),
            (S.READY, S.RUNNING, None),
            (S.RUNNING, S.SUCCEEDED, OC.OK),
        ]
        assert log.times(env) == [3, 3, 8]
        for ev in log.events:
            if ev.envelope is env:
                assert ev.queue == "evq"
                assert ev.cause is None
        await q.terminate()

    async def test_buffered_then_started(self) -> None:
        """An envelope sent before start() goes NEW→BUFFERED, then BUFFERED→READY at start."""
        q = envq.Queue("evq")
        log = Recorder(q)
        env = lasting(1)
        q.send(env)
        await asyncio.sleep(2)
        q.start()
        await asyncio.sleep(5)
        assert log.moves(env) == [
            (S.NEW, S.BUFFERED, None),
            (S.BUFFERED, S.READY, None),
            (S.READY, S.RUNNING, None),
            (S.RUNNING, S.SUCCEEDED, OC.OK),
        ]
        assert log.times(env) == [0, 2, 2, 3]
        await q.terminate()

    async def test_delayed(self) -> None:
        """An envelope with delay goes NEW→DELAYED, then DELAYED→READY when due."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        env = lasting(0, delay=10)
        q.send(env)
        await asyncio.sleep(20)
        assert log.moves(env)[:3] == [
            (S.NEW, S.DELAYED, None),
            (S.DELAYED, S.READY, None),
            (S.READY, S.RUNNING, None),
        ]
        assert log.times(env)[:2] == [0, 10]
        await q.terminate()

    async def test_error_carries_cause(self) -> None:
        """A failing attempt ends RUNNING→FAILED with outcome ERROR and the exception as cause."""
        boom = RuntimeError("boom")

        async def fail(env: envq.Envelope) -> None:
            raise boom

        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        env = envq.Envelope(invoke=fail)
        q.send(env)
        await settle()
        last = [e for e in log.events if e.envelope is env][-1]
        assert (last.from_state, last.to_state, last.outcome) == (S.RUNNING, S.FAILED, OC.ERROR)
        assert last.cause is boom
        await q.terminate()

    async def test_periodic(self) -> None:
        """A periodic envelope goes RUNNING→DELAYED (OK) and DELAYED→READY each interval."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        env = lasting(0, interval=10)
        q.send(env)
        await asyncio.sleep(15)
        assert log.moves(env) == [
            (S.NEW, S.READY, None),
            (S.READY, S.RUNNING, None),
            (S.RUNNING, S.DELAYED, OC.OK),
            (S.DELAYED, S.READY, None),
            (S.READY, S.RUNNING, None),
            (S.RUNNING, S.DELAYED, OC.OK),
        ]
        assert log.times(env) == [0, 0, 0, 10, 10, 10]
        await q.terminate()

    async def test_parked_and_returned(self) -> None:
        """A stop parks a delayed envelope (DELAYED→PARKED); terminate hands it back (→RETURNED)."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        env = lasting(0, delay=100)
        q.send(env)
        await asyncio.sleep(5)
        await q.stop()
        assert log.moves(env)[-1] == (S.DELAYED, S.PARKED, None)
        assert log.times(env)[-1] == 5
        assert await q.terminate() == [env]
        assert log.moves(env)[-1] == (S.PARKED, S.RETURNED, None)

    async def test_terminate_cancels_running(self) -> None:
        """terminate() ends a running attempt RUNNING→RETURNED with outcome CANCELLED."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        env = lasting(100)
        q.send(env)
        await asyncio.sleep(1)
        assert await q.terminate() == [env]
        assert log.moves(env)[-1] == (S.RUNNING, S.RETURNED, OC.CANCELLED)

    async def test_events_chain_and_carry_loop_time(self) -> None:
        """In a mixed run every event's time is the loop time and each envelope's moves chain."""

        async def fail(env: envq.Envelope) -> None:
            raise RuntimeError("boom")

        q = envq.Queue("evq", workers=2)
        log = Recorder(q)
        envs = [
            lasting(3),
            lasting(1, interval=4),
            lasting(0, delay=7),
            envq.Envelope(invoke=fail, retry=envq.Retry(attempts=3, base=1, jitter=False)),
        ]
        q.send(envs[0])
        q.start()
        q.send(*envs[1:])
        await asyncio.sleep(9)
        await q.stop()
        q.start()
        await asyncio.sleep(5)
        await q.terminate()
        assert log.events
        for ev, at in zip(log.events, log.delivered_at, strict=True):
            assert ev.time == at
            assert ev.queue == "evq"
        times = [ev.time for ev in log.events]
        assert times == sorted(times)
        for env in envs:
            moves = [e for e in log.events if e.envelope is env]
            assert moves[0].from_state is S.NEW
            for prev, nxt in itertools.pairwise(moves):
                assert nxt.from_state is prev.to_state
            assert moves[-1].to_state not in LIVE

    async def test_event_is_frozen(self) -> None:
        """An Event cannot be modified."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        ev = log.events[0]
        with pytest.raises(attrs.exceptions.FrozenError):
            ev.time = 99.0  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenError):
            ev.to_state = Q.TERMINATED  # type: ignore[misc]
        await q.terminate()


class TestQueueEvents:
    async def test_lifecycle(self) -> None:
        """start, stop, restart and terminate emit the queue's state changes, envelope None."""
        q = envq.Queue("evq")
        log = Recorder(q)
        q.start()
        await asyncio.sleep(1)
        await q.stop()
        q.start()
        await q.terminate()
        moves = log.queue_moves()
        assert moves[:4] == [
            (Q.INIT, Q.RUNNING),
            (Q.RUNNING, Q.STOPPING),
            (Q.STOPPING, Q.STOPPED),
            (Q.STOPPED, Q.RUNNING),
        ]
        assert moves[4][0] is Q.RUNNING
        assert moves[-1][1] is Q.TERMINATED
        for prev, nxt in itertools.pairwise(moves):
            assert nxt[0] is prev[1]
        for ev in log.events:
            assert ev.envelope is None
            assert ev.outcome is None
            assert ev.queue == "evq"
            assert isinstance(ev.from_state, envq.QueueState)
            assert isinstance(ev.to_state, envq.QueueState)
        assert [ev.time for ev in log.events][:2] == [0, 1]

    async def test_terminate_from_init(self) -> None:
        """terminate() on an INIT queue emits exactly INIT→TERMINATED."""
        q = envq.Queue("evq")
        log = Recorder(q)
        await q.terminate()
        assert log.queue_moves() == [(Q.INIT, Q.TERMINATED)]

    async def test_noops_emit_nothing(self) -> None:
        """No-op calls (stop on INIT or STOPPED, start on RUNNING, terminate twice) emit nothing."""
        q = envq.Queue("evq")
        log = Recorder(q)
        await q.stop()
        assert log.events == []
        q.start()
        n = len(log.events)
        q.start()
        assert len(log.events) == n
        await q.stop()
        n = len(log.events)
        await q.stop()
        assert len(log.events) == n
        await q.terminate()
        n = len(log.events)
        assert await q.terminate() == []
        assert len(log.events) == n


class TestSubscribe:
    async def test_unsubscribe(self) -> None:
        """After unsubscribing, a listener gets no more events; other listeners still do."""
        q = envq.Queue("evq")
        first, second = Recorder(q), Recorder(q)
        q.start()
        n = len(first.events)
        first.unsubscribe()
        env = lasting(1)
        q.send(env)
        await asyncio.sleep(2)
        assert len(first.events) == n
        assert len(second.of(env)) == 3
        await q.terminate()

    async def test_listeners_see_the_same_sequence(self) -> None:
        """Every listener receives every event, in the same order."""
        q = envq.Queue("evq")
        first, second = Recorder(q), Recorder(q)
        q.start()
        q.send(lasting(1), lasting(2, interval=3))
        await asyncio.sleep(10)
        await q.terminate()
        assert first.events == second.events
        assert len(first.events) > 5

    async def test_raising_listener_is_logged(self, caplog: pytest.LogCaptureFixture) -> None:
        """A listener that raises is logged on the envq logger and breaks nothing."""
        caplog.set_level(logging.DEBUG, logger="envq")

        def bad(ev: envq.Event) -> None:
            raise RuntimeError("listener broke")

        q = envq.Queue("evq")
        q.subscribe(bad)
        log = Recorder(q)
        q.start()
        env = lasting(1)
        q.send(env)
        await asyncio.sleep(2)
        await q.stop()
        q.start()
        left = await q.terminate()
        assert left == []
        assert log.moves(env) == [
            (S.NEW, S.READY, None),
            (S.READY, S.RUNNING, None),
            (S.RUNNING, S.SUCCEEDED, OC.OK),
        ]
        assert q.state is Q.TERMINATED
        assert q.statistics().outcomes.get(OC.OK) == 1
        records = [
            r
            for r in caplog.records
            if (r.name == "envq" or r.name.startswith("envq.")) and r.levelno >= logging.WARNING
        ]
        assert records
        assert any(
            r.exc_info is not None and "listener broke" in str(r.exc_info[1]) for r in records
        )

    async def test_raising_listener_does_not_stop_others(self) -> None:
        """Listeners subscribed after a raising one still get every event."""

        def bad(ev: envq.Event) -> None:
            raise ValueError("nope")

        q = envq.Queue("evq")
        before = Recorder(q)
        q.subscribe(bad)
        after = Recorder(q)
        q.start()
        q.send(lasting(1))
        await asyncio.sleep(2)
        await q.terminate()
        assert before.events == after.events
        assert len(after.events) >= 5


class TestStatistics:
    async def test_fresh_queue(self) -> None:
        """A new queue's statistics are all zero, state INIT, with its capacity limit."""
        q = envq.Queue("evq", capacity=7)
        stats = q.statistics()
        assert isinstance(stats, envq.Statistics)
        assert stats.state is Q.INIT
        assert stats.capacity_limit == 7
        assert (stats.capacity_used, stats.in_flight, stats.dedups, stats.stuck_threads) == (
            0,
            0,
            0,
            0,
        )
        assert not any(stats.by_state.values())
        assert not any(stats.outcomes.values())
        assert not any(stats.rejections.values())
        await q.terminate()

    async def test_state_follows_queue(self) -> None:
        """statistics().state is the queue's lifecycle state."""
        q = envq.Queue("evq")
        seen = [q.statistics().state]
        q.start()
        seen.append(q.statistics().state)
        await q.stop()
        seen.append(q.statistics().state)
        await q.terminate()
        seen.append(q.statistics().state)
        assert seen == [Q.INIT, Q.RUNNING, Q.STOPPED, Q.TERMINATED]

    async def test_live_current_terminal_cumulative(self) -> None:
        """by_state counts live envelopes now and terminal ones since the queue was made."""

        async def fail(env: envq.Envelope) -> None:
            raise RuntimeError("boom")

        q = envq.Queue("evq", workers=2)
        q.start()
        q.send(
            lasting(1), lasting(1), envq.Envelope(invoke=fail), lasting(50), lasting(0, delay=30)
        )
        await asyncio.sleep(2)
        stats = q.statistics()
        assert stats.by_state.get(S.SUCCEEDED) == 2
        assert stats.by_state.get(S.FAILED) == 1
        assert stats.by_state.get(S.RUNNING) == 1
        assert stats.by_state.get(S.DELAYED) == 1
        assert stats.in_flight == 1
        assert stats.outcomes.get(OC.OK) == 2
        assert stats.outcomes.get(OC.ERROR) == 1
        q.send(lasting(1))
        await asyncio.sleep(2)
        stats = q.statistics()
        assert stats.by_state.get(S.SUCCEEDED) == 3
        assert stats.by_state.get(S.READY, 0) == 0
        assert stats.outcomes.get(OC.OK) == 3
        await q.terminate()

    async def test_outcomes_count_attempts(self) -> None:
        """outcomes counts every attempt: two errors then a success are ERROR 2, OK 1."""
        attempts: list[int] = []

        async def flaky(env: envq.Envelope) -> None:
            attempts.append(1)
            if len(attempts) < 3:
                raise RuntimeError("flaky")

        def again(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
            return envq.retry_now()

        q = envq.Queue("evq")
        q.start()
        q.send(envq.Envelope(invoke=flaky, on_failure=again))
        await asyncio.sleep(5)
        stats = q.statistics()
        assert len(attempts) == 3
        assert stats.outcomes.get(OC.ERROR) == 2
        assert stats.outcomes.get(OC.OK) == 1
        assert stats.by_state.get(S.SUCCEEDED) == 1
        assert stats.by_state.get(S.FAILED, 0) == 0
        await q.terminate()

    async def test_snapshot_does_not_change(self) -> None:
        """A statistics snapshot keeps its values while the queue moves on."""
        q = envq.Queue("evq")
        q.start()
        env = lasting(5)
        q.send(env)
        await settle()
        snap = q.statistics()
        running = dict(snap.by_state)
        outcomes = dict(snap.outcomes)
        await asyncio.sleep(10)
        q.send(env)
        await asyncio.sleep(10)
        assert snap.state is Q.RUNNING
        assert dict(snap.by_state) == running
        assert dict(snap.outcomes) == outcomes
        assert snap.in_flight == 1
        assert snap.capacity_used == 1
        assert q.statistics().by_state.get(S.SUCCEEDED) == 2
        await q.terminate()

    async def test_snapshot_is_frozen(self) -> None:
        """A Statistics snapshot cannot be modified, neither its fields nor its mappings."""
        q = envq.Queue("evq")
        q.start()
        q.send(lasting(1))
        await asyncio.sleep(2)
        stats = q.statistics()
        with pytest.raises(attrs.exceptions.FrozenError):
            stats.capacity_used = 5  # type: ignore[misc]
        with pytest.raises(attrs.exceptions.FrozenError):
            stats.by_state = {}  # type: ignore[misc]
        with pytest.raises(TypeError):
            stats.by_state[S.READY] = 3  # type: ignore[index]
        with pytest.raises(TypeError):
            stats.outcomes[OC.OK] = 3  # type: ignore[index]
        with pytest.raises(TypeError):
            stats.rejections["state"] = 3  # type: ignore[index]
        assert q.statistics().by_state.get(S.READY, 0) == 0
        await q.terminate()

    async def test_dedups_and_rejections_counted(self) -> None:
        """dedups counts skipped re-sends; rejections counts refused sends by reason."""
        q = envq.Queue("evq", capacity=1)
        env = lasting(1)
        q.send(env, env)
        q.send(env)
        with pytest.raises(envq.CapacityExceeded):
            q.send(lasting(1))
        with pytest.raises(envq.BadEnvelope):
            q.send(3)  # type: ignore[arg-type]
        await q.terminate()
        with pytest.raises(envq.QueueTerminated):
            q.send(lasting(1))
        stats = q.statistics()
        assert stats.dedups == 2
        assert {k: v for k, v in stats.rejections.items() if v} == {
            "capacity": 1,
            "invalid": 1,
            "state": 1,
        }
