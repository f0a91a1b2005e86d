"""send_wait (docs/capacity.md) — waiting for room, timeouts, FIFO, no overtaking, state changes."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envq
from envq.conform.oracle import room_in_time
from envq.testing import run
from tests.support import gated, lasting, nap, now, settle

S = envq.EnvState


class Admissions:
    """Records when each envelope entered the queue (its first event)."""

    def __init__(self, q: envq.Queue) -> None:
        self.at: dict[envq.Envelope, float] = {}
        self.order: list[envq.Envelope] = []
        q.subscribe(self._on_event)

    def _on_event(self, ev: envq.Event) -> None:
        env = ev.envelope
        if env is not None and env not in self.at:
            self.at[env] = ev.time
            self.order.append(env)


class TestSendWaitImmediate:
    async def test_room_returns_at_once(self) -> None:
        """With room, send_wait admits the batch without any time passing."""
        q = envq.Queue("q", capacity=3)
        q.start()
        t0 = now()
        a, b = lasting(5), lasting(5)
        await q.send_wait(a, b)
        assert now() == t0
        assert q.capacity_used == 2
        await q.terminate()

    async def test_unlimited_never_waits(self) -> None:
        """With capacity 0, send_wait never waits."""
        q = envq.Queue("q")
        q.start()
        await q.send_wait(*[lasting(100) for _ in range(50)])
        assert now() == 0
        assert q.capacity_used == 50
        await q.terminate()

    @pytest.mark.parametrize("limit", [None, 5.0])
    async def test_batch_larger_than_capacity(self, limit: float | None) -> None:
        """A batch larger than the capacity raises CapacityExceeded at once, admitting none."""
        q = envq.Queue("q", capacity=2)
        q.start()
        with pytest.raises(envq.CapacityExceeded):
            await q.send_wait(lasting(1), lasting(1), lasting(1), timeout=limit)
        assert now() == 0
        assert q.capacity_used == 0
        await q.terminate()

    async def test_invalid_raises_at_once(self) -> None:
        """A non-envelope raises BadEnvelope at once, even on a full queue."""
        q = envq.Queue("q", capacity=1)
        q.start()
        q.send(lasting(10))
        with pytest.raises(envq.BadEnvelope):
            await q.send_wait("junk")  # type: ignore[arg-type]
        assert now() == 0
        await q.terminate()

    async def test_stopped_raises_at_once(self) -> None:
        """On a STOPPED queue send_wait raises QueueNotRunning at once."""
        q = envq.Queue("q", capacity=1)
        q.start()
        await q.stop()
        with pytest.raises(envq.QueueNotRunning):
            await q.send_wait(lasting(1))
        await q.terminate()
        with pytest.raises(envq.QueueTerminated):
            await q.send_wait(lasting(1))

    async def test_dedup_on_full_queue(self) -> None:
        """Re-sending a live envelope to a full queue returns at once as a dedup."""
        q = envq.Queue("q", capacity=1)
        q.start()
        env = lasting(10)
        q.send(env)
        await q.send_wait(env, timeout=1)
        assert now() == 0
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        await q.terminate()


class TestSendWaitDedup:
    async def test_live_envelope_needs_no_room(self) -> None:
        """A waiting batch needs room only for its envelopes not already live."""
        q = envq.Queue("q", workers=2, capacity=2)
        seen = Admissions(q)
        q.start()
        live = lasting(30)
        q.send(live, lasting(10))
        new = lasting(1)
        await q.send_wait(live, new)
        assert now() == pytest.approx(10)
        assert seen.at[new] == pytest.approx(10)
        assert q.capacity_used == 2
        assert q.statistics().dedups == 1
        await q.terminate()

    async def test_same_envelope_in_two_waiters(self) -> None:
        """Two producers waiting with the same envelope admit it once."""
        q = envq.Queue("q", capacity=1)
        entered: list[envq.Event] = []
        q.start()
        q.send(lasting(10))
        env = lasting(10)
        q.subscribe(lambda ev: entered.append(ev) if ev.envelope is env else None)
        first = asyncio.create_task(q.send_wait(env))
        await settle()
        second = asyncio.create_task(q.send_wait(env))
        await asyncio.gather(first, second)
        assert q.capacity_used == 1
        assert q.statistics().dedups == 1
        await asyncio.sleep(30)
        assert [ev.to_state for ev in entered] == [S.READY, S.RUNNING, S.SUCCEEDED]
        await q.terminate()


class TestSendWaitWaiting:
    async def test_waits_for_room(self) -> None:
        """send_wait returns when a slot frees, and admits the envelope then."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        q.send(lasting(10))
        late = lasting(1)
        await q.send_wait(late)
        assert now() == pytest.approx(10)
        assert seen.at[late] == pytest.approx(10)
        assert q.capacity_used == 1
        await q.terminate()

    async def test_waits_for_whole_batch(self) -> None:
        """A batch waits until there is room for all of it."""
        q = envq.Queue("q", workers=3, capacity=3)
        q.start()
        q.send(lasting(10), lasting(20), lasting(30))
        batch = [lasting(1), lasting(1)]
        await q.send_wait(*batch)
        assert now() == pytest.approx(20)
        assert q.capacity_used == 3
        await q.terminate()

    async def test_timeout(self) -> None:
        """On timeout send_wait raises CapacityExceeded and admits nothing."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        q.send(lasting(100))
        late = lasting(1)
        with pytest.raises(envq.CapacityExceeded):
            await q.send_wait(late, timeout=5)
        assert now() == pytest.approx(5)
        assert late not in seen.at
        assert q.capacity_used == 1
        await asyncio.sleep(200)
        assert late not in seen.at  # a timed-out call never admits later
        await q.terminate()


class TestFifo:
    async def test_waiters_admitted_in_arrival_order(self) -> None:
        """Waiters are served first come first served as slots free."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        q.send(lasting(10))
        waiting = [lasting(10, id=i) for i in range(3)]
        tasks = []
        for env in waiting:
            tasks.append(asyncio.create_task(q.send_wait(env)))
            await settle()
        await asyncio.gather(*tasks)
        assert seen.order[1:] == waiting
        assert [seen.at[env] for env in waiting] == [
            pytest.approx(10),
            pytest.approx(20),
            pytest.approx(30),
        ]
        await q.terminate()

    async def test_small_batch_does_not_overtake_big_one(self) -> None:
        """A later single-envelope waiter is not served before an earlier batch of two."""
        gates = [asyncio.Event(), asyncio.Event()]
        hold = asyncio.Event()
        q = envq.Queue("q", workers=4, capacity=2)
        seen = Admissions(q)
        q.start()
        q.send(gated(gates[0]), gated(gates[1]))
        big = [gated(hold), gated(hold)]
        small = lasting(1)
        task_big = asyncio.create_task(q.send_wait(*big))
        await settle()
        task_small = asyncio.create_task(q.send_wait(small))
        await settle()
        gates[0].set()
        await settle()
        assert q.capacity_used == 1
        assert not task_big.done()
        assert not task_small.done()
        assert small not in seen.at
        gates[1].set()
        await settle()
        assert task_big.done()
        assert not task_small.done()
        assert all(env in seen.at for env in big)
        hold.set()
        await task_small
        assert small in seen.at
        await q.terminate()

    async def test_send_does_not_overtake(self) -> None:
        """While a producer waits, send() raises CapacityExceeded even if the batch would fit."""
        gates = [asyncio.Event(), asyncio.Event()]
        q = envq.Queue("q", workers=4, capacity=2)
        q.start()
        q.send(gated(gates[0]), gated(gates[1]))
        waiter = asyncio.create_task(q.send_wait(lasting(5), lasting(5)))
        await settle()
        gates[0].set()
        await settle()
        assert q.capacity_used == 1  # room for one...
        before = q.statistics().rejections.get("capacity", 0)
        pushy = lasting(1)
        with pytest.raises(envq.CapacityExceeded):
            q.send(pushy)  # ...but a producer is waiting
        assert q.capacity_used == 1
        assert q.statistics().rejections.get("capacity", 0) == before + 1
        gates[1].set()
        await waiter
        assert q.capacity_used == 2
        await asyncio.sleep(10)
        q.send(pushy)  # nobody waits any more
        assert q.capacity_used == 1
        await q.terminate()

    async def test_cancelled_waiter_leaves_the_line(self) -> None:
        """A cancelled send_wait admits nothing and does not block the waiters behind it."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        q.send(lasting(10))
        first, second = lasting(1), lasting(1)
        task1 = asyncio.create_task(q.send_wait(first))
        await settle()
        task2 = asyncio.create_task(q.send_wait(second))
        await settle()
        task1.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task1
        await task2
        assert now() == pytest.approx(10)
        assert first not in seen.at
        assert seen.at[second] == pytest.approx(10)
        await q.terminate()

    async def test_timed_out_waiter_leaves_the_line(self) -> None:
        """A waiter that timed out does not block the waiters behind it."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        q.send(lasting(10))
        first, second = lasting(1), lasting(1)
        task1 = asyncio.create_task(q.send_wait(first, timeout=5))
        await settle()
        task2 = asyncio.create_task(q.send_wait(second))
        await settle()
        with pytest.raises(envq.CapacityExceeded):
            await task1
        await task2
        assert seen.at[second] == pytest.approx(10)
        assert first not in seen.at
        await q.terminate()

    async def test_send_allowed_after_line_empties(self) -> None:
        """When no producer waits and there is room, send() admits again."""
        q = envq.Queue("q", capacity=1)
        q.start()
        q.send(lasting(10))
        await q.send_wait(lasting(10))
        await asyncio.sleep(10.5)
        assert q.capacity_used == 0
        q.send(lasting(1))
        await q.terminate()


class TestFifoProperty:
    @settings(max_examples=80, deadline=None)
    @given(
        capacity=st.integers(1, 4),
        initial=st.lists(st.integers(1, 20), min_size=1, max_size=4),
        waiters=st.lists(
            st.tuples(
                st.integers(0, 15),
                st.integers(1, 4),
                st.one_of(st.none(), st.integers(1, 30)),
                st.integers(1, 20),
            ),
            max_size=6,
        ),
    )
    def test_no_waiter_is_overtaken(
        self,
        capacity: int,
        initial: list[int],
        waiters: list[tuple[int, int, int | None, int]],
    ) -> None:
        """Waiters enter whole, in arrival order, never over capacity; timed-out ones admit none."""

        async def main() -> None:
            q = envq.Queue("q", workers=capacity, capacity=capacity)
            seen = Admissions(q)
            over: list[int] = []
            q.subscribe(
                lambda ev: over.append(q.capacity_used) if q.capacity_used > capacity else None
            )
            q.start()
            q.send(*[lasting(d) for d in initial[:capacity]])

            async def call(batch: list[envq.Envelope], limit: int | None) -> float:
                await q.send_wait(*batch, timeout=limit)
                return now()

            calls = []
            for i, (gap, size, limit, duration) in enumerate(waiters):
                await asyncio.sleep(gap)
                batch = [lasting(duration, id=(i, j)) for j in range(min(size, capacity))]
                calls.append((batch, now(), limit, asyncio.create_task(call(batch, limit))))
                await settle()
            ends: list[float] = []
            for batch, t0, limit, task in calls:
                try:
                    await task
                except envq.CapacityExceeded:
                    assert limit is not None
                    assert now() >= t0 + limit
                    assert not any(env in seen.at for env in batch)
                    ends.append(t0 + limit)
                else:
                    times = {seen.at[env] for env in batch}
                    assert len(times) == 1  # the batch entered at one moment
                    ends.append(times.pop())
                    if limit is not None:
                        assert ends[-1] <= t0 + limit
            for j, (batch, _t0, _limit, _task) in enumerate(calls):
                if batch[0] in seen.at:  # admitted: everyone ahead was resolved by then
                    assert all(end <= ends[j] for end in ends[:j]), (j, ends)
            admitted = [calls[i][0][0] for i in range(len(calls)) if calls[i][0][0] in seen.at]
            assert [env for env in seen.order if env in admitted] == admitted
            assert over == []
            await q.terminate()

        run(main())


class TestSendWaitStateChange:
    async def test_init_to_running_keeps_waiting(self) -> None:
        """A waiter on an INIT queue keeps waiting across start() and is admitted on room."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.send(lasting(10))
        late = lasting(1)
        task = asyncio.create_task(q.send_wait(late))
        await settle()
        await asyncio.sleep(2)
        q.start()
        await settle()
        assert not task.done()
        await task
        assert seen.at[late] == pytest.approx(12)
        await q.terminate()

    async def test_init_to_terminated(self) -> None:
        """A waiter on an INIT queue raises QueueTerminated when the queue is terminated."""
        q = envq.Queue("q", capacity=1)
        first = lasting(10)
        q.send(first)
        late = lasting(1)
        task = asyncio.create_task(q.send_wait(late))
        await settle()
        left = await q.terminate()
        with pytest.raises(envq.QueueTerminated):
            await task
        assert left == [first]

    async def test_running_to_stopping(self) -> None:
        """A waiter raises QueueStopping when the queue starts stopping."""
        gate = asyncio.Event()
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        q.send(gated(gate))
        late = lasting(1)
        task = asyncio.create_task(q.send_wait(late))
        await settle()
        await q.stop(wait=False)
        assert q.state is envq.QueueState.STOPPING
        await settle()
        assert task.done()
        with pytest.raises(envq.QueueStopping):
            await task
        gate.set()
        await q.wait_stopped()
        assert late not in seen.at
        await q.terminate()

    async def test_running_to_terminated(self) -> None:
        """A waiter raises QueueNotRunning when the queue is terminated; nothing is admitted."""
        q = envq.Queue("q", capacity=1)
        seen = Admissions(q)
        q.start()
        first = lasting(100)
        q.send(first)
        late = lasting(1)
        task = asyncio.create_task(q.send_wait(late, timeout=50))
        await settle()
        left = await q.terminate()
        with pytest.raises(envq.QueueNotRunning):
            await task
        assert late not in seen.at
        assert left == [first]


class TestTimeoutAtTheInstantOfRoom:
    """A timeout due at the very instant room is freed wins: room freed at ``started +
    timeout`` is too late, room freed before it is taken."""

    @staticmethod
    async def _race(free_at: float, patience: float) -> tuple[BaseException | None, float]:
        q = envq.Queue("tie", capacity=1)
        q.start()
        q.send(envq.Envelope(invoke=nap, payload=0, delay=free_at))
        await asyncio.sleep(8.0)
        started = now()
        waiter = asyncio.ensure_future(q.send_wait(lasting(0), timeout=patience))
        await asyncio.wait({waiter})
        ended = now() - started
        error = waiter.exception()
        await settle()
        await q.terminate()
        return error, ended

    async def test_room_at_the_timeout_instant_is_too_late(self) -> None:
        # The slot is freed by a run due at 8.5, the instant the 0.5 s timeout is due.
        error, elapsed = await self._race(free_at=8.5, patience=0.5)
        assert type(error) is envq.SendTimeout
        assert elapsed == 0.5

    async def test_room_just_before_the_timeout_is_taken(self) -> None:
        error, elapsed = await self._race(free_at=8.25, patience=0.5)
        assert error is None
        assert elapsed == 0.25

    async def test_the_room_goes_to_the_next_producer(self) -> None:
        q = envq.Queue("tie_next", capacity=1)
        q.start()
        q.send(envq.Envelope(invoke=nap, payload=0, delay=8.5))
        await asyncio.sleep(8.0)
        first = asyncio.ensure_future(q.send_wait(lasting(0), timeout=0.5))
        nxt = lasting(60, id="next")
        second = asyncio.ensure_future(q.send_wait(nxt, timeout=5))
        await asyncio.wait({first, second})
        assert type(first.exception()) is envq.SendTimeout
        assert second.exception() is None
        assert now() == 8.5
        assert q.state_of(nxt) in (S.READY, S.RUNNING)
        assert q.statistics().rejections["capacity"] == 1
        await q.terminate()


def test_the_oracle_counts_room_only_before_a_timeout() -> None:
    """The rule the stateful test and ``envq conform`` check a timed-out ``send_wait``
    by: room freed strictly before the timeout is due should have been taken; room
    freed at the timeout's instant (within the clock's tolerance) or later need not."""
    assert room_in_time(8.4, started=8.0, timeout=0.5, tolerance=0.0)
    assert not room_in_time(8.5, started=8.0, timeout=0.5, tolerance=0.0)
    assert not room_in_time(8.5 - 1e-12, started=8.0, timeout=0.5, tolerance=0.0)
    assert not room_in_time(8.45, started=8.0, timeout=0.5, tolerance=0.1)
    assert room_in_time(8.3, started=8.0, timeout=0.5, tolerance=0.1)
    assert not room_in_time(9.0, started=8.0, timeout=0.5, tolerance=0.0)
