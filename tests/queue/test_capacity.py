"""Capacity (docs/capacity.md), dedup, send order, all-or-nothing, and the capacity invariant."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envq
from envq.conform.oracle import LIVE
from envq.testing import run
from tests.support import gated, noop, settle

S = envq.EnvState
TERMINAL = frozenset({S.SUCCEEDED, S.FAILED, S.STOPPED, S.RETURNED})


def simple(**kwargs: Any) -> envq.Envelope:
    """A one-off envelope that succeeds at once (unless kwargs say otherwise)."""
    kwargs.setdefault("invoke", noop)
    return envq.Envelope(**kwargs)


def counted(calls: list[envq.Envelope], **kwargs: Any) -> envq.Envelope:
    """An envelope that logs each attempt in ``calls`` and then acts on its payload.

    payload "ok" (default) succeeds, "error" raises, "stop" raises StopEnvelope.
    """

    async def invoke(env: envq.Envelope) -> None:
        calls.append(env)
        if env.payload == "error":
            raise RuntimeError("boom")
        if env.payload == "stop":
            raise envq.StopEnvelope

    kwargs.setdefault("payload", "ok")
    return envq.Envelope(invoke=invoke, **kwargs)


class Tracker:
    """Follows every envelope's state in one queue through its events."""

    def __init__(self, q: envq.Queue) -> None:
        self.events: list[envq.Event] = []
        self.state: dict[envq.Envelope, envq.EnvState] = {}
        q.subscribe(self._on_event)

    def _on_event(self, ev: envq.Event) -> None:
        self.events.append(ev)
        if ev.envelope is not None:
            assert isinstance(ev.to_state, envq.EnvState)
            self.state[ev.envelope] = ev.to_state

    def live(self) -> int:
        """Envelopes whose last event left them in a non-terminal state."""
        return sum(1 for state in self.state.values() if state in LIVE)

    def of(self, env: envq.Envelope) -> list[envq.Event]:
        """The events of one envelope."""
        return [ev for ev in self.events if ev.envelope is env]


def stats_live(q: envq.Queue) -> int:
    """Live envelopes according to statistics().by_state."""
    by_state = q.statistics().by_state
    return sum(by_state.get(state, 0) for state in LIVE)


def check_invariant(q: envq.Queue, tracker: Tracker, capacity: int = 0) -> None:
    """capacity_used equals the live count (events and statistics agree) and fits."""
    used = q.capacity_used
    assert used == tracker.live(), (used, tracker.live())
    assert used == stats_live(q), (used, dict(q.statistics().by_state))
    assert used == q.statistics().capacity_used
    if capacity:
        assert used <= capacity


def nonzero(mapping: Mapping[Any, int]) -> dict[Any, int]:
    """A mapping as a plain dict without zero counts."""
    return {k: v for k, v in mapping.items() if v}


def assert_only_rejection(
    q: envq.Queue,
    tracker: Tracker,
    before: envq.Statistics,
    events_before: int,
    reason: str,
) -> None:
    """Since ``before`` only the rejection counter for ``reason`` moved; no events."""
    after = q.statistics()
    assert len(tracker.events) == events_before
    expected = nonzero(before.rejections)
    expected[reason] = expected.get(reason, 0) + 1
    assert nonzero(after.rejections) == expected
    for field in attrs.fields(envq.Statistics):
        if field.name == "rejections":
            continue
        old, new = getattr(before, field.name), getattr(after, field.name)
        if isinstance(old, Mapping):
            assert nonzero(old) == nonzero(new), field.name
        else:
            assert old == new, field.name


class TestCapacityUsed:
    async def test_counts_buffered(self) -> None:
        """Envelopes sent before start() count against capacity as BUFFERED."""
        q = envq.Queue("q", capacity=5)
        tracker = Tracker(q)
        q.send(simple(), simple(), simple())
        assert q.capacity_used == 3
        assert q.statistics().by_state.get(S.BUFFERED) == 3
        check_invariant(q, tracker, 5)
        await q.terminate()

    async def test_counts_ready_running_delayed(self) -> None:
        """RUNNING, READY and DELAYED envelopes all count against capacity."""
        gate = asyncio.Event()
        q = envq.Queue("q", workers=1, capacity=10)
        tracker = Tracker(q)
        q.start()
        q.send(gated(gate), gated(gate), simple(delay=100))
        await settle()
        stats = q.statistics()
        assert q.capacity_used == 3
        assert stats.by_state.get(S.RUNNING) == 1
        assert stats.by_state.get(S.READY) == 1
        assert stats.by_state.get(S.DELAYED) == 1
        assert stats.in_flight == 1
        check_invariant(q, tracker, 10)
        gate.set()
        await settle()
        assert q.capacity_used == 1
        check_invariant(q, tracker, 10)
        await q.terminate()

    async def test_counts_parked(self) -> None:
        """A parked envelope keeps counting against capacity while the queue is stopped."""
        q = envq.Queue("q", capacity=1)
        tracker = Tracker(q)
        env = simple(delay=100)
        q.start()
        q.send(env)
        await q.stop()
        assert tracker.state[env] is S.PARKED
        assert q.capacity_used == 1
        assert q.statistics().by_state.get(S.PARKED) == 1
        check_invariant(q, tracker, 1)
        q.start()
        with pytest.raises(envq.CapacityExceeded):
            q.send(simple())
        assert q.capacity_used == 1
        await q.terminate()

    @pytest.mark.parametrize("payload", ["ok", "error", "stop"])
    async def test_released_on_terminal(self, payload: str) -> None:
        """A slot is released when the envelope ends SUCCEEDED, FAILED or STOPPED."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", capacity=1)
        tracker = Tracker(q)
        q.start()
        env = counted(calls, payload=payload)
        q.send(env)
        await settle()
        assert tracker.state[env] in TERMINAL
        assert q.capacity_used == 0
        check_invariant(q, tracker, 1)
        q.send(simple())  # the slot is free again
        await q.terminate()

    async def test_slot_held_until_on_success_finishes(self) -> None:
        """The slot is released only after on_success has finished."""
        gate = asyncio.Event()

        async def on_success(env: envq.Envelope) -> None:
            await gate.wait()

        q = envq.Queue("q", capacity=1, hook_timeout=envq.HookTimeout(floor=None))
        tracker = Tracker(q)
        q.start()
        env = simple(on_success=on_success)
        q.send(env)
        await asyncio.sleep(5)
        assert q.capacity_used == 1
        assert tracker.state[env] not in TERMINAL  # not yet ended while on_success runs
        check_invariant(q, tracker, 1)
        with pytest.raises(envq.CapacityExceeded):
            q.send(simple())
        gate.set()
        await settle()
        assert q.capacity_used == 0
        q.send(simple())
        await q.terminate()

    async def test_slot_held_until_on_failure_finishes(self) -> None:
        """The slot is released only after on_failure has finished."""
        gate = asyncio.Event()

        async def fail(env: envq.Envelope) -> None:
            raise RuntimeError("boom")

        async def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> None:
            await gate.wait()

        q = envq.Queue("q", capacity=1, hook_timeout=envq.HookTimeout(floor=None))
        q.start()
        q.send(simple(invoke=fail, on_failure=on_failure))
        await asyncio.sleep(5)
        assert q.capacity_used == 1
        with pytest.raises(envq.CapacityExceeded):
            q.send(simple())
        gate.set()
        await settle()
        assert q.capacity_used == 0
        await q.terminate()

    async def test_unlimited(self) -> None:
        """capacity=0 admits any number of envelopes and reports limit 0."""
        q = envq.Queue("q")
        q.send(*[simple(delay=10) for _ in range(500)])
        assert q.capacity_used == 500
        assert q.statistics().capacity_limit == 0
        q.send(*[simple() for _ in range(500)])
        assert q.capacity_used == 1000
        await q.terminate()

    async def test_terminate_releases_everything(self) -> None:
        """After terminate(), capacity_used is 0 and the handed-back envelopes are free."""
        gate = asyncio.Event()
        q = envq.Queue("q", capacity=4)
        tracker = Tracker(q)
        envs = [gated(gate), simple(delay=50), simple(delay=100)]
        q.start()
        q.send(*envs)
        await settle()
        left = await q.terminate()
        assert set(left) == set(envs)
        assert q.capacity_used == 0
        check_invariant(q, tracker)
        other = envq.Queue("other")
        other.send(*left)  # not live anywhere any more
        assert other.capacity_used == 3
        await other.terminate()


class TestCapacityLimit:
    async def test_fill_exactly(self) -> None:
        """A batch that exactly fills the capacity is admitted; one more is not."""
        q = envq.Queue("q", capacity=3)
        q.send(simple(), simple())
        q.send(simple())
        assert q.capacity_used == 3
        with pytest.raises(envq.CapacityExceeded):
            q.send(simple())
        assert q.capacity_used == 3
        await q.terminate()

    async def test_batch_all_or_nothing(self) -> None:
        """A batch that does not fit admits none of its envelopes."""
        q = envq.Queue("q", capacity=3)
        tracker = Tracker(q)
        q.send(simple())
        batch = [simple(), simple(), simple()]
        with pytest.raises(envq.CapacityExceeded):
            q.send(*batch)
        assert q.capacity_used == 1
        assert all(env not in tracker.state for env in batch)
        q.send(*batch[:2])
        assert q.capacity_used == 3
        await q.terminate()

    async def test_freed_slot_is_reusable(self) -> None:
        """Once an envelope ends, its slot takes a new envelope."""
        q = envq.Queue("q", capacity=1)
        q.start()
        q.send(simple())
        await settle()
        q.send(simple())
        assert q.capacity_used == 1
        await q.terminate()

    @settings(max_examples=60, deadline=None)
    @given(
        capacity=st.integers(1, 8),
        prefill=st.integers(0, 8),
        batch=st.lists(st.integers(0, 11), max_size=12),
        started=st.booleans(),
    )
    def test_all_or_nothing_property(
        self, capacity: int, prefill: int, batch: list[int], started: bool
    ) -> None:
        """Any batch is admitted whole (dedup skipped) if it fits, else nothing changes."""
        prefill = min(prefill, capacity)

        async def main() -> None:
            q = envq.Queue("q", capacity=capacity)
            tracker = Tracker(q)
            if started:
                q.start()
            pool = [simple(delay=1000, id=i) for i in range(12)]
            if prefill:
                q.send(*pool[:prefill])
            envs = [pool[i] for i in batch]
            new = {env for env in envs if env not in pool[:prefill]}
            before = q.statistics()
            n_events = len(tracker.events)
            if prefill + len(new) <= capacity:
                q.send(*envs)
                assert q.capacity_used == prefill + len(new)
                assert q.statistics().dedups == before.dedups + len(envs) - len(new)
                assert {ev.envelope for ev in tracker.events[n_events:]} == new
            else:
                with pytest.raises(envq.CapacityExceeded):
                    q.send(*envs)
                assert q.capacity_used == prefill
                assert_only_rejection(q, tracker, before, n_events, "capacity")
            check_invariant(q, tracker, capacity)
            await q.terminate()

        run(main())


class TestSendOrder:
    async def test_state_before_validation(self) -> None:
        """A stopped queue rejects even an invalid batch for its state, counted as 'state'."""
        q = envq.Queue("q")
        q.start()
        await q.stop()
        with pytest.raises(envq.QueueNotRunning):
            q.send("junk")  # type: ignore[arg-type]
        rejections = nonzero(q.statistics().rejections)
        assert rejections == {"state": 1}
        await q.terminate()

    async def test_validation_before_capacity(self) -> None:
        """A full queue rejects a non-envelope with BadEnvelope, not CapacityExceeded."""
        q = envq.Queue("q", capacity=1)
        q.send(simple())
        with pytest.raises(envq.BadEnvelope):
            q.send(simple(), 42)  # type: ignore[arg-type]
        assert nonzero(q.statistics().rejections) == {"invalid": 1}
        await q.terminate()

    async def test_foreign_before_capacity(self) -> None:
        """A full queue rejects an envelope live elsewhere with BadEnvelope."""
        a = envq.Queue("a")
        b = envq.Queue("b", capacity=1)
        env = simple()
        a.send(env)
        b.send(simple())
        with pytest.raises(envq.BadEnvelope):
            b.send(env)
        assert nonzero(b.statistics().rejections) == {"foreign": 1}
        await a.terminate()
        await b.terminate()

    async def test_validation_before_blacklist(self) -> None:
        """A batch with both a blacklisted type and a non-envelope raises BadEnvelope."""
        q = await blacklisting_queue("spam")
        with pytest.raises(envq.BadEnvelope):
            q.send(simple(type="spam"), "junk")  # type: ignore[arg-type]
        await q.terminate()

    async def test_blacklist_before_capacity(self) -> None:
        """A full queue rejects a blacklisted type with TypeBlacklisted."""
        q = await blacklisting_queue("spam", capacity=1)
        q.send(simple(delay=100))
        with pytest.raises(envq.TypeBlacklisted):
            q.send(simple(type="spam"))
        assert nonzero(q.statistics().rejections) == {"blacklisted": 1}
        await q.terminate()

    async def test_blacklist_before_dedup(self) -> None:
        """Re-sending a still-running envelope of a just-blacklisted type raises TypeBlacklisted."""
        gate_a, gate_b = asyncio.Event(), asyncio.Event()

        async def stop_type(env: envq.Envelope) -> None:
            await gate_a.wait()
            raise envq.StopType

        q = envq.Queue("q", workers=2)
        tracker = Tracker(q)
        q.start()
        b = gated(gate_b, type="spam")
        q.send(simple(invoke=stop_type, type="spam"), b)
        await settle()
        gate_a.set()
        await settle()
        assert tracker.state[b] is S.RUNNING
        with pytest.raises(envq.TypeBlacklisted):
            q.send(b)
        gate_b.set()
        await settle()
        assert tracker.state[b] is S.STOPPED
        await q.terminate()

    async def test_dedup_before_capacity(self) -> None:
        """Re-sending a live envelope to a full queue is a dedup, not CapacityExceeded."""
        q = envq.Queue("q", capacity=1)
        env = simple(delay=10)
        q.send(env)
        q.send(env)
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        await q.terminate()


async def blacklisting_queue(type_: str, capacity: int = 0) -> envq.Queue:
    """A running queue in which ``type_`` has just been blacklisted by a StopType."""

    async def stop_type(env: envq.Envelope) -> None:
        raise envq.StopType

    q = envq.Queue("q", capacity=capacity)
    q.start()
    q.send(simple(invoke=stop_type, type=type_))
    await settle()
    assert q.statistics().outcomes.get(envq.Outcome.STOP_TYPE) == 1
    return q


class TestRejectedSendLeavesQueueUnchanged:
    async def _populated(self, capacity: int = 0) -> tuple[envq.Queue, Tracker, asyncio.Event]:
        gate = asyncio.Event()
        q = envq.Queue("q", workers=1, capacity=capacity)
        tracker = Tracker(q)
        q.start()
        q.send(gated(gate), simple(), simple(delay=30))
        await settle()
        return q, tracker, gate

    async def test_state(self) -> None:
        """A send to a stopped queue changes nothing but rejections['state']."""
        q = envq.Queue("q")
        tracker = Tracker(q)
        q.start()
        q.send(simple(delay=30))
        await q.stop()
        before, n = q.statistics(), len(tracker.events)
        env = simple()
        with pytest.raises(envq.QueueNotRunning):
            q.send(env)
        assert_only_rejection(q, tracker, before, n, "state")
        check_invariant(q, tracker)
        await q.terminate()

    async def test_invalid(self) -> None:
        """A batch with a non-envelope admits none and only counts rejections['invalid']."""
        q, tracker, _gate = await self._populated()
        before, n = q.statistics(), len(tracker.events)
        valid = simple()
        with pytest.raises(envq.BadEnvelope):
            q.send(valid, object())  # type: ignore[arg-type]
        assert_only_rejection(q, tracker, before, n, "invalid")
        check_invariant(q, tracker)
        other = envq.Queue("other")
        other.send(valid)  # valid was not left live in q
        await other.terminate()
        await q.terminate()

    async def test_blacklisted(self) -> None:
        """A batch with a blacklisted type admits none and only counts rejections['blacklisted']."""
        q = await blacklisting_queue("spam")
        tracker = Tracker(q)
        before, n = q.statistics(), len(tracker.events)
        valid = simple(type="ham")
        with pytest.raises(envq.TypeBlacklisted):
            q.send(valid, simple(type="spam"))
        assert_only_rejection(q, tracker, before, n, "blacklisted")
        assert valid not in tracker.state
        await q.terminate()

    async def test_foreign(self) -> None:
        """A batch with an envelope live elsewhere admits none and counts rejections['foreign']."""
        q, tracker, _gate = await self._populated()
        elsewhere = envq.Queue("elsewhere")
        foreign = simple(delay=100)
        elsewhere.send(foreign)
        before, n = q.statistics(), len(tracker.events)
        valid = simple()
        with pytest.raises(envq.BadEnvelope):
            q.send(valid, foreign)
        assert_only_rejection(q, tracker, before, n, "foreign")
        check_invariant(q, tracker)
        assert elsewhere.capacity_used == 1
        assert valid not in tracker.state
        await elsewhere.terminate()
        await q.terminate()

    async def test_capacity(self) -> None:
        """A batch that does not fit admits none and only counts rejections['capacity']."""
        q, tracker, _gate = await self._populated(capacity=4)
        assert q.capacity_used == 3
        before, n = q.statistics(), len(tracker.events)
        batch = [simple(), simple()]
        with pytest.raises(envq.CapacityExceeded):
            q.send(*batch)
        assert_only_rejection(q, tracker, before, n, "capacity")
        check_invariant(q, tracker, 4)
        assert all(env not in tracker.state for env in batch)
        await q.terminate()

    async def test_rejected_batch_counts_no_dedups(self) -> None:
        """A rejected batch containing a live envelope does not count it as a dedup."""
        q = envq.Queue("q", capacity=2)
        tracker = Tracker(q)
        live = simple()
        q.send(live)
        before, n = q.statistics(), len(tracker.events)
        with pytest.raises(envq.CapacityExceeded):
            q.send(live, simple(), simple())
        assert_only_rejection(q, tracker, before, n, "capacity")
        assert q.statistics().dedups == 0
        await q.terminate()


class TestDedup:
    async def test_same_envelope_twice_in_one_batch(self) -> None:
        """send(e, e) admits e once, uses one slot and counts one dedup."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", capacity=2)
        tracker = Tracker(q)
        env = counted(calls)
        q.send(env, env)
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        assert len(tracker.of(env)) == 1
        q.start()
        await asyncio.sleep(1)
        assert calls == [env]
        await q.terminate()

    async def test_repeats_count_once_against_capacity(self) -> None:
        """send(a, b, a, b) fits capacity 2 (it names two envelopes) and counts two
        dedups; send(x, y, z, x) into capacity 2 is refused whole, as three."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", capacity=2)
        a, b = counted(calls), counted(calls)
        q.send(a, b, a, b)
        assert q.capacity_used == 2
        assert q.statistics().dedups == 2
        r = envq.Queue("r", capacity=2)
        x, y, z = counted(calls), counted(calls), counted(calls)
        with pytest.raises(envq.CapacityExceeded, match="of 3 new envelope"):
            r.send(x, y, z, x)
        assert r.capacity_used == 0
        assert r.statistics().dedups == 0
        await q.terminate()
        await r.terminate()

    async def test_while_buffered(self) -> None:
        """Re-sending a BUFFERED envelope is skipped; it runs once after start()."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q")
        tracker = Tracker(q)
        env = counted(calls)
        q.send(env)
        q.send(env)
        q.send(env)
        assert q.capacity_used == 1
        assert q.statistics().dedups == 2
        assert [ev.to_state for ev in tracker.of(env)] == [S.BUFFERED]
        q.start()
        await asyncio.sleep(1)
        assert calls == [env]
        assert tracker.state[env] is S.SUCCEEDED
        await q.terminate()

    async def test_while_ready(self) -> None:
        """Re-sending a READY envelope is skipped; it runs once."""
        gate = asyncio.Event()
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", workers=1)
        tracker = Tracker(q)
        q.start()
        env = counted(calls)
        q.send(gated(gate), env)
        await settle()
        assert tracker.state[env] is S.READY
        n = len(tracker.events)
        q.send(env)
        assert len(tracker.events) == n
        assert q.capacity_used == 2
        assert q.statistics().dedups == 1
        gate.set()
        await asyncio.sleep(1)
        assert calls == [env]
        await q.terminate()

    async def test_while_running(self) -> None:
        """Re-sending a RUNNING envelope is skipped; its attempt is not repeated."""
        gate = asyncio.Event()
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", workers=2)
        tracker = Tracker(q)
        q.start()
        env = gated(gate, calls)
        q.send(env)
        await settle()
        assert tracker.state[env] is S.RUNNING
        q.send(env)
        await settle()
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        gate.set()
        await asyncio.sleep(1)
        assert calls == [env]
        assert tracker.state[env] is S.SUCCEEDED
        assert q.capacity_used == 0
        await q.terminate()

    async def test_while_delayed(self) -> None:
        """Re-sending a DELAYED envelope is skipped and does not restart its delay."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q")
        tracker = Tracker(q)
        q.start()
        env = counted(calls, delay=50)
        q.send(env)
        await asyncio.sleep(10)
        assert tracker.state[env] is S.DELAYED
        q.send(env)
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        await asyncio.sleep(41)  # t = 51
        assert calls == [env]
        running = [ev for ev in tracker.of(env) if ev.to_state is S.RUNNING]
        assert [ev.time for ev in running] == [pytest.approx(50)]
        await q.terminate()

    async def test_periodic_between_runs(self) -> None:
        """Re-sending a periodic envelope between runs does not add runs."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q")
        tracker = Tracker(q)
        q.start()
        env = counted(calls, interval=10)
        q.send(env)
        await asyncio.sleep(5)
        assert tracker.state[env] is S.DELAYED
        q.send(env)
        q.send(env)
        await asyncio.sleep(30)  # t = 35: runs at 0, 10, 20, 30
        assert len(calls) == 4
        assert q.capacity_used == 1
        assert q.statistics().dedups == 2
        await q.terminate()

    async def test_while_parked(self) -> None:
        """A PARKED envelope stays once in its queue: refused elsewhere, runs once on restart."""
        calls: list[envq.Envelope] = []
        a = envq.Queue("a")
        b = envq.Queue("b")
        tracker = Tracker(a)
        a.start()
        b.start()
        env = counted(calls, delay=20)
        a.send(env)
        await asyncio.sleep(5)
        await a.stop()
        assert tracker.state[env] is S.PARKED
        with pytest.raises(envq.QueueNotRunning):
            a.send(env)
        with pytest.raises(envq.BadEnvelope):
            b.send(env)
        assert b.capacity_used == 0
        assert a.capacity_used == 1
        a.start()
        a.send(env)  # re-armed: a dedup again
        assert a.capacity_used == 1
        await asyncio.sleep(30)
        assert calls == [env]
        assert a.capacity_used == 0
        await a.terminate()
        await b.terminate()

    @pytest.mark.parametrize(
        ("payload", "final"), [("ok", S.SUCCEEDED), ("error", S.FAILED), ("stop", S.STOPPED)]
    )
    async def test_resend_after_terminal(self, payload: str, final: envq.EnvState) -> None:
        """Once terminal, an envelope may be sent again and runs again."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", capacity=1)
        tracker = Tracker(q)
        q.start()
        env = counted(calls, payload=payload)
        q.send(env)
        await settle()
        assert tracker.state[env] is final
        env.payload = "ok"
        q.send(env)
        assert q.capacity_used == 1
        await settle()
        assert calls == [env, env]
        assert tracker.state[env] is S.SUCCEEDED
        assert q.statistics().dedups == 0
        entered = [ev for ev in tracker.of(env) if ev.from_state in (S.NEW, None)]
        assert len(entered) == 2
        await q.terminate()

    async def test_terminal_in_one_queue_free_for_another(self) -> None:
        """An envelope that ended in one queue may be sent to another."""
        calls: list[envq.Envelope] = []
        a = envq.Queue("a")
        b = envq.Queue("b")
        a.start()
        b.start()
        env = counted(calls)
        a.send(env)
        await settle()
        b.send(env)
        await settle()
        assert calls == [env, env]
        await a.terminate()
        await b.terminate()

    async def test_returned_free_for_another(self) -> None:
        """An envelope handed back by terminate() may be sent to another queue."""
        a = envq.Queue("a")
        env = simple()
        a.send(env)
        assert await a.terminate() == [env]
        b = envq.Queue("b")
        b.send(env)
        assert b.capacity_used == 1
        await b.terminate()

    async def test_evolved_copy_is_not_a_duplicate(self) -> None:
        """An evolve() copy is a different envelope and takes its own slot."""
        q = envq.Queue("q")
        env = simple(delay=5)
        q.send(env, env.evolve())
        assert q.capacity_used == 2
        assert q.statistics().dedups == 0
        await q.terminate()

    async def test_dedup_in_batch_with_room(self) -> None:
        """A batch mixing a live envelope and a new one admits the new one, one dedup."""
        q = envq.Queue("q", capacity=2)
        live = simple()
        q.send(live)
        q.send(live, simple())
        assert q.capacity_used == 2
        assert q.statistics().dedups == 1
        await q.terminate()


class TestDedupById:
    """One meaning of ``id``: the dedup key is the envelope's ``id`` when it has one
    (identity otherwise), in process as on PostgreSQL."""

    async def test_a_second_envelope_with_a_live_id_is_a_dedup(self) -> None:
        """Two envelope objects with one id: while the first is live, the second is a
        dedup (counted, no capacity, never runs); once the first has ended, the id can
        be sent again."""
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", capacity=5)
        tracker = Tracker(q)
        first, again = counted(calls, id="hook-1"), counted(calls, id="hook-1")
        q.send(first)
        q.send(again)
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        assert q.state_of(again) is None
        assert tracker.of(again) == []
        q.start()
        await asyncio.sleep(1)
        assert calls == [first]
        later = counted(calls, id="hook-1")
        q.send(later)
        await asyncio.sleep(1)
        assert calls == [first, later]
        check_invariant(q, tracker, 5)
        await q.terminate()

    async def test_one_id_twice_in_a_batch_is_admitted_once(self) -> None:
        calls: list[envq.Envelope] = []
        q = envq.Queue("q", capacity=1)
        a, b = counted(calls, id=7), counted(calls, id=7)
        q.send(a, b)  # fits capacity 1: it names one id
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        q.start()
        await asyncio.sleep(1)
        assert calls == [a]
        await q.terminate()

    async def test_envelopes_without_an_id_dedup_by_identity(self) -> None:
        calls: list[envq.Envelope] = []
        q = envq.Queue("q")
        a, b = counted(calls), counted(calls)
        q.send(a, b, a)
        assert (q.capacity_used, q.statistics().dedups) == (2, 1)
        q.start()
        await asyncio.sleep(1)
        assert sorted(map(id, calls)) == sorted(map(id, [a, b]))
        await q.terminate()

    async def test_a_full_queue_takes_a_dedup_by_id(self) -> None:
        """A dedup takes no capacity: a full queue accepts it without CapacityExceeded,
        and send_wait returns at once for it."""
        q = envq.Queue("q", capacity=1)
        q.send(simple(id="x"))
        q.send(simple(id="x"))
        await q.send_wait(simple(id="x"), timeout=1)
        assert (q.capacity_used, q.statistics().dedups) == (1, 2)
        with pytest.raises(envq.CapacityExceeded):
            q.send(simple(id="y"))
        await q.terminate()

    async def test_a_refused_batch_counts_no_dedup_and_admits_nothing(self) -> None:
        q = envq.Queue("q", capacity=2)
        q.send(simple(id="x"))
        with pytest.raises(envq.CapacityExceeded):
            q.send(simple(id="x"), simple(id="y"), simple(id="z"))
        assert (q.capacity_used, q.statistics().dedups) == (1, 0)
        await q.terminate()

    async def test_the_id_is_free_again_after_terminate_hands_back(self) -> None:
        q = envq.Queue("q")
        q.send(simple(id="x"))
        left = await q.terminate()
        assert [env.id for env in left] == ["x"]
        r = envq.Queue("r")
        r.send(left[0])
        r.send(simple(id="x"))
        assert (r.capacity_used, r.statistics().dedups) == (1, 1)
        await r.terminate()


class TestInvariant:
    async def test_scenario(self) -> None:
        """capacity_used equals the live count after every step of a mixed scenario."""
        calls: list[envq.Envelope] = []
        gate = asyncio.Event()
        q = envq.Queue("q", workers=2, capacity=8)
        tracker = Tracker(q)

        def check() -> None:
            check_invariant(q, tracker, 8)

        periodic = counted(calls, interval=5)
        failing = counted(
            calls, payload="error", retry=envq.Retry(attempts=3, base=2, jitter=False)
        )
        q.send(periodic, simple(), simple(delay=3))
        check()
        q.start()
        check()
        await settle()
        check()
        q.send(failing, gated(gate), simple(delay=40))
        check()
        for _ in range(4):
            await asyncio.sleep(2)
            check()
        await q.stop(mode=envq.StopMode.STOP, cancel=True)
        check()
        assert q.state is envq.QueueState.STOPPED
        assert q.statistics().by_state.get(S.PARKED, 0) >= 2
        q.start()
        check()
        q.send(periodic)  # dedup
        check()
        await asyncio.sleep(7)
        check()
        gate.set()
        await asyncio.sleep(1)
        check()
        await q.stop()
        check()
        assert q.state is envq.QueueState.STOPPED
        q.start()
        check()
        await asyncio.sleep(3)
        check()
        left = await q.terminate()
        check()
        assert q.capacity_used == 0
        assert periodic in left
        assert all(state in TERMINAL for state in tracker.state.values())
        returned = {env for env, state in tracker.state.items() if state is S.RETURNED}
        assert returned == set(left)

    @settings(max_examples=60, deadline=None)
    @given(
        capacity=st.sampled_from([0, 1, 2, 4, 6]),
        workers=st.integers(1, 3),
        ops=st.lists(
            st.one_of(
                st.tuples(
                    st.just("send"),
                    st.sampled_from(
                        ["quick", "slow", "periodic", "delayed", "failing", "pfail", "stop"]
                    ),
                ),
                st.tuples(st.just("resend"), st.integers(0, 20)),
                st.tuples(st.just("advance"), st.integers(0, 15)),
                st.tuples(st.just("stop"), st.sampled_from(["drain", "stop", "cancel"])),
                st.tuples(st.just("start"), st.just(0)),
            ),
            max_size=25,
        ),
    )
    def test_random_operations(
        self, capacity: int, workers: int, ops: list[tuple[str, Any]]
    ) -> None:
        """Under any sequence of sends, time, stops and starts, capacity_used == live count."""

        async def main() -> None:
            q = envq.Queue("q", workers=workers, capacity=capacity)
            tracker = Tracker(q)
            sent: list[envq.Envelope] = []

            async def sleeper(env: envq.Envelope) -> None:
                await asyncio.sleep(env.payload)

            async def fail(env: envq.Envelope) -> None:
                raise RuntimeError("boom")

            async def stop(env: envq.Envelope) -> None:
                raise envq.StopEnvelope

            kinds: dict[str, dict[str, Any]] = {
                "quick": {"invoke": sleeper, "payload": 1},
                "slow": {"invoke": sleeper, "payload": 7},
                "periodic": {"invoke": sleeper, "payload": 1, "interval": 5},
                "delayed": {"invoke": sleeper, "payload": 0, "delay": 12},
                "failing": {
                    "invoke": fail,
                    "retry": envq.Retry(attempts=3, base=2, jitter=False),
                },
                "pfail": {"invoke": fail, "interval": 4},
                "stop": {"invoke": stop},
            }
            modes: dict[str, dict[str, Any]] = {
                "drain": {"mode": envq.StopMode.DRAIN},
                "stop": {"mode": envq.StopMode.STOP},
                "cancel": {"mode": envq.StopMode.STOP, "cancel": True},
            }
            for op, arg in ops:
                try:
                    if op == "send":
                        env = envq.Envelope(id=len(sent), type=arg, **kinds[arg])
                        sent.append(env)
                        q.send(env)
                    elif op == "resend" and sent:
                        q.send(sent[arg % len(sent)])
                    elif op == "advance":
                        await asyncio.sleep(arg)
                    elif op == "stop":
                        await q.stop(**modes[arg])
                    elif op == "start":
                        q.start()
                except (envq.CapacityExceeded, envq.QueueNotRunning):
                    pass
                check_invariant(q, tracker, capacity)
                await settle()
                check_invariant(q, tracker, capacity)
            left = await q.terminate()
            check_invariant(q, tracker, capacity)
            assert q.capacity_used == 0
            assert len(left) == len(set(left))
            assert all(state in TERMINAL for state in tracker.state.values())
            returned = {env for env, state in tracker.state.items() if state is S.RETURNED}
            assert returned == set(left)

        run(main())
