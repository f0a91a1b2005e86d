"""Stop modes (docs/lifecycle.md), parking, reschedules during a stop, stop reports, and
stop()/wait_stopped()/send() called from inside the queue."""

from __future__ import annotations

import asyncio

import attrs
import pytest

import envq
from envq.testing import advance
from tests.support import QueueMaker, Trace, now, settle

QS = envq.QueueState
ES = envq.EnvState
DRAIN = envq.StopMode.DRAIN
STOP = envq.StopMode.STOP


async def retry_in_40(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
    return envq.retry_after(40)


async def retry_now(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
    return envq.retry_now()


# ---------------------------------------------------------------------------------------
# The stop-mode table: DRAIN/STOP x ready/in-flight/delayed x wait x cancel
# ---------------------------------------------------------------------------------------


@attrs.frozen
class Cell:
    mode: envq.StopMode
    cancel: bool
    #: Loop time at which the stop is complete (stop was called at t=1).
    ends_at: float
    completed: tuple[str, ...]
    cancelled: tuple[str, ...]
    parked: tuple[str, ...]
    #: Final state of f (in flight), r (ready) and d (delayed).
    final: tuple[envq.EnvState, envq.EnvState, envq.EnvState]


CELLS = [
    Cell(DRAIN, False, 20.0, ("f", "r"), (), ("d",), (ES.SUCCEEDED, ES.SUCCEEDED, ES.PARKED)),
    Cell(STOP, False, 10.0, ("f",), (), ("r", "d"), (ES.SUCCEEDED, ES.PARKED, ES.PARKED)),
    Cell(STOP, True, 1.0, (), ("f",), ("f", "r", "d"), (ES.PARKED, ES.PARKED, ES.PARKED)),
]


class TestStopModeTable:
    @pytest.mark.parametrize("wait", [True, False], ids=["wait", "nowait"])
    @pytest.mark.parametrize("cell", CELLS, ids=["drain", "stop", "stop-cancel"])
    async def test_cell(self, cell: Cell, wait: bool, make_queue: QueueMaker) -> None:
        """Each stop mode treats ready, in-flight and delayed envelopes as its table row
        says, returning the final report at once (wait=False) or when complete."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, r, d = trace.env("f", 10), trace.env("r", 10), trace.env("d", delay=100)
        by_id = {"f": f, "r": r, "d": d}
        q.start()
        q.send(f, r, d)
        await advance(1)
        assert trace.started("f") == [0.0]
        report = await q.stop(mode=cell.mode, cancel=cell.cancel, wait=wait)
        if wait:
            assert now() == cell.ends_at
            assert q.state is QS.STOPPED
        else:
            assert now() == 1.0
            assert report.complete is False
            assert q.state is QS.STOPPING
            report = await q.wait_stopped()
            assert now() == cell.ends_at
            assert q.statistics().state is QS.STOPPED
        assert report.complete is True
        assert report.completed == tuple(by_id[i] for i in cell.completed)
        assert report.cancelled == tuple(by_id[i] for i in cell.cancelled)
        assert report.parked == tuple(by_id[i] for i in cell.parked)
        assert (trace.last(f), trace.last(r), trace.last(d)) == cell.final
        assert trace.cancels == ([("f", 1.0)] if cell.cancel else [])
        assert trace.started("r") == ([10.0] if cell.mode is DRAIN else [])
        # DRAIN runs the ready envelope without ever parking it; STOP parks it at once.
        assert trace.states(r) == (
            [ES.READY, ES.RUNNING, ES.SUCCEEDED] if cell.mode is DRAIN else [ES.READY, ES.PARKED]
        )
        assert trace.started("d") == []
        assert q.capacity_used == len(cell.parked)
        # The delayed envelope keeps the 99 s it still had to wait at t=1.
        await advance(200 - now())
        q.start()
        await advance(150)
        assert trace.started("d") == [299.0]
        await q.stop()

    async def test_queue_default_mode_is_used(self, make_queue: QueueMaker) -> None:
        """stop() without mode uses the queue's stop_mode (STOP parks ready envelopes)."""
        trace = Trace()
        q = make_queue(trace, workers=1, stop_mode=STOP)
        f, r = trace.env("f", 5), trace.env("r", 5)
        q.start()
        q.send(f, r)
        await settle()
        report = await q.stop()
        assert report.parked == (r,)
        assert report.completed == (f,)
        assert trace.started("r") == []
        await q.terminate()

    async def test_mode_argument_overrides_queue_mode(self, make_queue: QueueMaker) -> None:
        """stop(mode=DRAIN) on a STOP queue drains the ready envelopes."""
        trace = Trace()
        q = make_queue(trace, workers=1, stop_mode=STOP)
        f, r = trace.env("f", 5), trace.env("r", 5)
        q.start()
        q.send(f, r)
        await settle()
        report = await q.stop(mode=DRAIN)
        assert report.parked == ()
        assert report.completed == (f, r)
        assert now() == 10.0

    async def test_queue_default_drain_is_used(self, make_queue: QueueMaker) -> None:
        """stop() without mode on a default queue drains (DRAIN is the default)."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, r = trace.env("f", 5), trace.env("r", 5)
        q.start()
        q.send(f, r)
        await settle()
        report = await q.stop()
        assert report.completed == (f, r)
        assert now() == 10.0

    async def test_queue_wait_false_is_the_default_for_stop(self, make_queue: QueueMaker) -> None:
        """On a Queue(wait=False), stop() returns at once; stop(wait=True) waits."""
        trace = Trace()
        q = make_queue(trace, wait=False)
        q.start()
        q.send(trace.env("f", 5))
        await settle()
        first = await q.stop()
        assert now() == 0.0
        assert first.complete is False
        final = await q.stop(wait=True)
        assert now() == 5.0
        assert final.complete is True

    async def test_wait_false_argument_overrides_queue_wait(self, make_queue: QueueMaker) -> None:
        """On a default Queue(wait=True), stop(wait=False) returns at once."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        q.send(trace.env("f", 5))
        await settle()
        report = await q.stop(wait=False)
        assert now() == 0.0
        assert report.complete is False
        assert (await q.wait_stopped()).complete is True
        assert now() == 5.0

    async def test_stop_with_nothing_in_flight_is_complete(self, make_queue: QueueMaker) -> None:
        """A stop with nothing to wait for is complete at once, parking the delayed."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        d = trace.env("d", delay=30)
        q.send(d)
        report = await q.stop()
        assert now() == 0.0
        assert report == envq.StopReport(parked=(d,), complete=True)
        await q.terminate()


# ---------------------------------------------------------------------------------------
# Parking
# ---------------------------------------------------------------------------------------


class TestParking:
    async def test_delayed_one_off_keeps_remaining_delay(self, make_queue: QueueMaker) -> None:
        """A delayed envelope parked at t=10 with 90 s to go runs 90 s after the next start."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        d = trace.env("d", delay=100)
        q.send(d)
        await advance(10)
        await q.stop()
        assert trace.states(d) == [ES.DELAYED, ES.PARKED]
        await advance(490)
        q.start()
        await advance(200)
        assert trace.started("d") == [590.0]
        await q.stop()

    async def test_periodic_keeps_remaining_interval(self, make_queue: QueueMaker) -> None:
        """A periodic envelope parked 10 s into a 30 s interval runs 20 s after the next start,
        then every 30 s."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        p = trace.env("p", interval=30)
        q.send(p)
        await advance(10)
        report = await q.stop()
        assert report.parked == (p,)
        await advance(90)
        q.start()
        await advance(61)
        assert trace.started("p") == [0.0, 120.0, 150.0]
        await q.stop()
        await q.terminate()

    async def test_retry_delay_is_kept(self, make_queue: QueueMaker) -> None:
        """An envelope waiting 40 s to retry, parked after 15 s, retries 25 s after start."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        e = trace.env("e", fail=True, on_failure=retry_in_40)
        q.send(e)
        await advance(15)
        report = await q.stop()
        assert report.parked == (e,)
        assert trace.last(e) is ES.PARKED
        await advance(985)
        q.start()
        await advance(30)
        assert trace.started("e") == [0.0, 1025.0]
        await q.stop()
        await q.terminate()

    async def test_parked_ready_envelope_runs_at_start(self, make_queue: QueueMaker) -> None:
        """A ready envelope parked by a STOP-mode stop runs as soon as the queue restarts."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        q.start()
        f, r = trace.env("f", 5), trace.env("r", 1)
        q.send(f, r)
        await settle()
        await q.stop(mode=STOP)
        assert trace.last(r) is ES.PARKED
        await advance(45)
        q.start()
        await advance(10)
        assert trace.started("r") == [50.0]
        await q.stop()

    async def test_cancelled_attempt_is_parked_and_reruns(self, make_queue: QueueMaker) -> None:
        """An attempt cancelled by stop(cancel=True) is parked and runs again after start."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        f = trace.env("f", 5)
        q.send(f)
        await advance(2)
        await q.stop(mode=STOP, cancel=True)
        [cancel_move] = [e for e in trace.for_env(f) if e.outcome is envq.Outcome.CANCELLED]
        assert (cancel_move.from_state, cancel_move.to_state) == (ES.RUNNING, ES.PARKED)
        await advance(8)
        q.start()
        await advance(10)
        assert trace.started("f") == [0.0, 10.0]
        assert trace.last(f) is ES.SUCCEEDED

    async def test_parked_count_against_capacity(self, make_queue: QueueMaker) -> None:
        """Parked envelopes keep their capacity slots across the stop and the restart."""
        trace = Trace()
        q = make_queue(trace, capacity=2)
        q.start()
        q.send(trace.env("a", delay=50), trace.env("b", delay=60))
        await q.stop()
        assert q.capacity_used == 2
        assert q.statistics().by_state.get(ES.PARKED, 0) == 2
        assert q.statistics().capacity_used == 2
        q.start()
        with pytest.raises(envq.CapacityExceeded):
            q.send(trace.env("c"))
        await advance(100)
        assert q.capacity_used == 0
        q.send(trace.env("c"))
        await q.stop()


class TestReschedulesDuringStop:
    async def test_periodic_reschedule_is_parked(self, make_queue: QueueMaker) -> None:
        """A periodic attempt that ends during a stop reschedules into PARKED, keeping the
        full interval for the next start."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        p = trace.env("p", 3, interval=7)
        q.send(p)
        await advance(1)
        report = await q.stop()
        assert now() == 3.0
        assert report.completed == (p,)
        assert report.parked == (p,)
        [end] = [e for e in trace.for_env(p) if e.outcome is envq.Outcome.OK]
        assert (end.from_state, end.to_state) == (ES.RUNNING, ES.PARKED)
        await advance(97)
        q.start()
        await advance(10)
        assert trace.started("p") == [0.0, 107.0]
        await q.stop()
        await q.terminate()

    async def test_retry_now_during_drain_is_parked(self, make_queue: QueueMaker) -> None:
        """retry_now decided during a DRAIN stop parks the envelope instead of re-running it."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        e = trace.env("e", 2, fail=True, on_failure=retry_now)
        q.send(e)
        await advance(1)
        report = await q.stop(mode=DRAIN)
        assert now() == 2.0
        assert trace.started("e") == [0.0]
        assert report.parked == (e,)
        assert report.completed == (e,)
        [end] = [x for x in trace.for_env(e) if x.outcome is envq.Outcome.ERROR]
        assert end.to_state is ES.PARKED
        await advance(48)
        q.start()
        await advance(1)
        assert trace.started("e") == [0.0, 50.0]
        await q.stop()
        await q.terminate()

    async def test_retry_policy_backoff_is_parked_with_its_delay(
        self, make_queue: QueueMaker
    ) -> None:
        """A Retry backoff decided during a stop parks the envelope with the backoff delay."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        e = trace.env("e", 2, fail=True, retry=envq.Retry(attempts=3, base=4, jitter=False))
        q.send(e)
        await advance(1)
        report = await q.stop()
        assert report.parked == (e,)
        await advance(48)
        q.start()
        await advance(10)
        assert trace.started("e") == [0.0, 54.0]
        await q.stop()
        await q.terminate()

    async def test_drained_ready_envelope_reschedule_is_parked(
        self, make_queue: QueueMaker
    ) -> None:
        """A ready periodic envelope run by DRAIN parks its next run."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        q.start()
        f, p = trace.env("f", 4), trace.env("p", 1, interval=20)
        q.send(f, p)
        await settle()
        report = await q.stop(mode=DRAIN)
        assert now() == 5.0
        assert trace.started("p") == [4.0]
        assert report.completed == (f, p)
        assert report.parked == (p,)
        assert trace.last(p) is ES.PARKED
        await q.terminate()

    async def test_due_during_drain_stays_parked(self, make_queue: QueueMaker) -> None:
        """An envelope parked at a DRAIN stop does not run when its time comes during the
        drain, and keeps its remaining delay for the next start."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        f, d = trace.env("f", 10), trace.env("d", delay=5)
        q.start()
        q.send(f, d)
        await advance(1)
        report = await q.stop(mode=DRAIN)
        assert now() == 10.0
        assert report.parked == (d,)
        assert trace.started("d") == []
        await advance(10)
        q.start()
        await advance(10)
        assert trace.started("d") == [24.0]
        await q.stop()


class TestStopWaitsForHooks:
    """A stop completes only when no worker holds an envelope: a worker inside
    ``on_success`` / ``on_failure`` holds one (the hook is not cancellable, and the
    envelope's next state is decided only when it returns)."""

    HOOKS = ("on_success", "on_failure")
    MODES = ((DRAIN, False), (STOP, False), (STOP, True))

    @staticmethod
    def hooked(
        trace: Trace, hook: str, ends: list[tuple[str, float]], seconds: float = 5.0
    ) -> envq.Envelope:
        """An envelope whose attempt ends at once and whose ``hook`` then runs for
        ``seconds`` (and puts it back: periodic on_success, on_failure's retry_now)."""

        async def on_success(env: envq.Envelope) -> None:
            await asyncio.sleep(seconds)
            ends.append((hook, now()))

        async def on_failure(env: envq.Envelope, exc: BaseException, attempt: int) -> envq.Decision:
            await asyncio.sleep(seconds)
            ends.append((hook, now()))
            return envq.retry_now()

        if hook == "on_success":
            return trace.env(hook, interval=50, on_success=on_success)
        return trace.env(hook, fail=True, on_failure=on_failure)

    @pytest.mark.parametrize(("mode", "cancel"), MODES, ids=["drain", "stop", "stop-cancel"])
    @pytest.mark.parametrize("hook", HOOKS)
    async def test_stop_during_a_hook_returns_after_it(
        self,
        hook: str,
        mode: envq.StopMode,
        cancel: bool,
        make_queue: QueueMaker,
    ) -> None:
        """A stop issued while a success or failure hook runs returns only after the hook
        has ended (a hook is never cancelled by a stop), and its report counts the
        envelope the hook put back: parked, the queue STOPPED, the report complete."""
        ends: list[tuple[str, float]] = []
        trace = Trace()
        q = make_queue(trace, hook_timeout=envq.HookTimeout(floor=100))
        env = self.hooked(trace, hook, ends)
        q.start()
        q.send(env)
        await advance(1)
        assert q.state_of(env) is ES.RUNNING
        report = await q.stop(mode=mode, cancel=cancel)
        assert now() == 5.0
        assert ends == [(hook, 5.0)]
        assert q.state is QS.STOPPED
        assert report.complete is True
        assert report.parked == (env,)
        assert report.cancelled == ()
        assert q.state_of(env) is ES.PARKED
        assert await q.wait_stopped() == report
        await q.terminate()

    @pytest.mark.parametrize("hook", HOOKS)
    async def test_another_attempt_ending_does_not_finish_the_stop(
        self, hook: str, make_queue: QueueMaker
    ) -> None:
        """While one worker is inside a hook, another worker's attempt ending during the
        stop does not complete the stop: it completes when the hook ends, and its report
        counts both attempts and parks the envelope the hook put back."""
        ends: list[tuple[str, float]] = []
        trace = Trace()
        q = make_queue(trace, workers=2, hook_timeout=envq.HookTimeout(floor=100))
        hooked = self.hooked(trace, hook, ends, seconds=6)
        slow = trace.env("slow", 4)
        q.start()
        q.send(slow, hooked)
        await advance(1)  # hooked's hook runs 0..6, slow's attempt 0..4
        stopping = asyncio.ensure_future(q.stop(mode=DRAIN))
        await advance(4)
        assert sorted(trace.ends) == [(hook, 0.0), ("slow", 4.0)]
        assert not stopping.done()
        assert q.state is QS.STOPPING
        report = await stopping
        assert now() == 6.0
        assert ends == [(hook, 6.0)]
        assert report.complete is True
        assert report.completed == (slow,)
        assert report.parked == (hooked,)
        assert trace.last(slow) is ES.SUCCEEDED
        await q.terminate()


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------


class TestStopReport:
    async def test_parked_in_admission_order(self, make_queue: QueueMaker) -> None:
        """report.parked lists the envelopes in the order they were admitted."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        c, a, b = trace.env("c", delay=30), trace.env("a", delay=10), trace.env("b", delay=20)
        q.send(c)
        q.send(a)
        q.send(b)
        report = await q.stop()
        assert report.parked == (c, a, b)
        await q.terminate()

    async def test_completed_only_counts_attempts_ending_during_the_stop(
        self, make_queue: QueueMaker
    ) -> None:
        """completed lists every attempt that finished during the stop, failed ones too,
        and none that finished before it."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        q.start()
        early = trace.env("early")
        q.send(early)
        await advance(1)
        x, y = trace.env("x", 5), trace.env("y", 1, fail=True)
        q.send(x, y)
        await advance(1)
        report = await q.stop(mode=DRAIN)
        assert now() == 7.0
        assert report.completed == (x, y)
        assert report.cancelled == ()
        assert report.parked == ()
        assert trace.last(y) is ES.FAILED

    async def test_report_is_frozen(self, make_queue: QueueMaker) -> None:
        """A StopReport cannot be changed."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        q.send(trace.env("d", delay=5))
        report = await q.stop()
        field = "parked"
        with pytest.raises(AttributeError):
            setattr(report, field, ())
        assert len(report.parked) == 1
        await q.terminate()

    async def test_wait_stopped_in_running_waits_for_next_stop(
        self, make_queue: QueueMaker
    ) -> None:
        """wait_stopped() in RUNNING waits until the next stop completes and returns its
        final report."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        q.send(trace.env("f", 3))
        waiter = asyncio.create_task(q.wait_stopped())
        await advance(10)
        assert not waiter.done()
        q.send(trace.env("g", 4))
        report = await q.stop()
        assert await waiter == report
        assert report.complete is True
        assert now() == 14.0

    async def test_wait_stopped_in_init_waits_for_next_stop(self, make_queue: QueueMaker) -> None:
        """wait_stopped() in INIT waits through start() until the stop completes."""
        trace = Trace()
        q = make_queue(trace)
        waiter = asyncio.create_task(q.wait_stopped())
        await advance(5)
        assert not waiter.done()
        q.start()
        f = trace.env("f", 3)
        q.send(f)
        await advance(1)
        assert not waiter.done()
        await q.stop(wait=False)
        report = await waiter
        assert now() == 8.0
        assert report.complete is True
        assert report.completed == (f,)

    async def test_wait_stopped_in_stopped_returns_final_report(
        self, make_queue: QueueMaker
    ) -> None:
        """wait_stopped() in STOPPED returns the last final report at once."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        q.send(trace.env("f", 3))
        await settle()
        report = await q.stop()
        await advance(10)
        assert await q.wait_stopped() == report
        assert now() == 13.0

    async def test_concurrent_stops_share_the_final_report(self, make_queue: QueueMaker) -> None:
        """Two stop() calls at once both return the same final report when it completes."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        f = trace.env("f", 4)
        q.send(f)
        await settle()
        first, second = await asyncio.gather(q.stop(), q.stop())
        assert now() == 4.0
        assert first == second
        assert first.completed == (f,)
        assert first.complete is True

    async def test_each_stop_has_its_own_report(self, make_queue: QueueMaker) -> None:
        """A second stop after a restart reports only its own attempts and parks."""
        trace = Trace()
        q = make_queue(trace)
        q.start()
        a = trace.env("a", 2)
        q.send(a)
        await settle()
        first = await q.stop()
        assert first.completed == (a,)
        q.start()
        b = trace.env("b", 2)
        q.send(b)
        await settle()
        second = await q.stop()
        assert second.completed == (b,)
        assert second.parked == ()


# ---------------------------------------------------------------------------------------
# Calls from inside the queue
# ---------------------------------------------------------------------------------------


class TestCallsFromInside:
    async def test_stop_from_attempt_spares_caller(self, make_queue: QueueMaker) -> None:
        """stop(cancel=True) from an attempt returns at once incomplete, cancels the other
        in-flight attempt, and completes when the caller's attempt ends."""
        trace = Trace()
        q = make_queue(trace, workers=2)
        seen: list[tuple[envq.StopReport, float]] = []

        async def caller(env: envq.Envelope) -> None:
            await asyncio.sleep(1)
            seen.append((await q.stop(mode=STOP, cancel=True), now()))
            await asyncio.sleep(5)

        c = envq.Envelope(invoke=caller, id="c")
        o, r = trace.env("o", 100), trace.env("r", 1)
        q.start()
        q.send(c, o, r)
        report = await q.wait_stopped()
        [(inner, at)] = seen
        assert at == 1.0
        assert inner.complete is False
        assert now() == 6.0
        assert report.complete is True
        assert report.completed == (c,)
        assert report.cancelled == (o,)
        assert report.parked == (o, r)
        assert trace.cancels == [("o", 1.0)]
        assert trace.last(c) is ES.SUCCEEDED
        assert q.state is QS.STOPPED
        await q.terminate()

    async def test_stop_from_spawned_task_spares_caller(self, make_queue: QueueMaker) -> None:
        """stop(cancel=True) from a task an attempt spawned spares that attempt."""
        trace = Trace()
        q = make_queue(trace)
        seen: list[tuple[envq.StopReport, float]] = []

        async def stopper() -> envq.StopReport:
            return await q.stop(mode=STOP, cancel=True)

        async def caller(env: envq.Envelope) -> None:
            await asyncio.sleep(1)
            report = await asyncio.create_task(stopper())
            seen.append((report, now()))
            await asyncio.sleep(5)

        c = envq.Envelope(invoke=caller, id="c")
        q.start()
        q.send(c)
        report = await q.wait_stopped()
        [(inner, at)] = seen
        assert at == 1.0
        assert inner.complete is False
        assert now() == 6.0
        assert report.completed == (c,)
        assert report.cancelled == ()
        assert trace.last(c) is ES.SUCCEEDED

    async def test_task_outliving_its_attempt_spares_no_other_attempt(
        self, make_queue: QueueMaker
    ) -> None:
        """stop(cancel=True) from a task whose spawning attempt has ended spares nobody: the
        attempt now running on that worker is cancelled and parked."""
        trace = Trace()
        q = make_queue(trace, workers=1)
        background: list[asyncio.Task[None]] = []

        async def late_stop() -> None:
            await asyncio.sleep(5)
            await q.stop(mode=STOP, cancel=True)

        async def spawner(env: envq.Envelope) -> None:
            background.append(asyncio.create_task(late_stop()))

        a = envq.Envelope(invoke=spawner, id="a")
        b = trace.env("b", 100)
        q.start()
        q.send(a, b)
        report = await q.wait_stopped()
        assert trace.cancels == [("b", 5.0)]
        assert now() == 5.0
        assert report.cancelled == (b,)
        assert report.parked == (b,)
        assert trace.last(b) is ES.PARKED
        await q.terminate()

    async def test_stop_from_before_hook_spares_caller(self, make_queue: QueueMaker) -> None:
        """stop(cancel=True) from a before hook spares the attempt, which runs on to OK."""
        trace = Trace()
        q = make_queue(trace)
        reports: list[envq.StopReport] = []

        async def before(env: envq.Envelope) -> None:
            reports.append(await q.stop(mode=STOP, cancel=True))

        c = trace.env("c", 3, before=before)
        q.start()
        q.send(c)
        report = await q.wait_stopped()
        assert [r.complete for r in reports] == [False]
        assert trace.ends == [("c", 3.0)]
        assert report.completed == (c,)
        assert trace.last(c) is ES.SUCCEEDED

    async def test_stop_from_periodic_attempt_parks_it(self, make_queue: QueueMaker) -> None:
        """A periodic envelope stopping its own queue finishes its attempt and is parked."""
        trace = Trace()
        q = make_queue(trace)
        runs: list[float] = []

        async def tick(env: envq.Envelope) -> None:
            runs.append(now())
            if len(runs) == 3:
                await q.stop()

        p = envq.Envelope(invoke=tick, id="p", interval=10)
        q.start()
        q.send(p)
        report = await q.wait_stopped()
        assert runs == [0.0, 10.0, 20.0]
        assert report.parked == (p,)
        assert report.completed == (p,)
        assert q.state is QS.STOPPED
        await advance(100)
        assert runs == [0.0, 10.0, 20.0]
        await q.terminate()

    async def test_wait_stopped_from_attempt_raises(self, make_queue: QueueMaker) -> None:
        """wait_stopped() from an attempt raises RuntimeError (it would wait for itself)."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []

        async def inner(env: envq.Envelope) -> None:
            try:
                await q.wait_stopped()
            except RuntimeError as exc:
                errors.append(exc)

        c = envq.Envelope(invoke=inner, id="c")
        q.start()
        q.send(c)
        await advance(1)
        assert len(errors) == 1
        assert q.state is QS.RUNNING
        assert trace.last(c) is ES.SUCCEEDED
        await q.stop()

    async def test_wait_stopped_from_spawned_task_raises(self, make_queue: QueueMaker) -> None:
        """wait_stopped() from a task an attempt spawned raises RuntimeError."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []

        async def waiter() -> None:
            try:
                await q.wait_stopped()
            except RuntimeError as exc:
                errors.append(exc)

        async def inner(env: envq.Envelope) -> None:
            await asyncio.create_task(waiter())

        q.start()
        q.send(envq.Envelope(invoke=inner, id="c"))
        await advance(1)
        assert len(errors) == 1
        assert q.state is QS.RUNNING
        await q.stop()

    async def test_send_from_attempt_while_stopping_raises(self, make_queue: QueueMaker) -> None:
        """send() from an attempt while the queue is STOPPING raises QueueStopping."""
        trace = Trace()
        q = make_queue(trace)
        errors: list[BaseException] = []
        late = trace.env("late")

        async def inner(env: envq.Envelope) -> None:
            await asyncio.sleep(5)
            try:
                q.send(late)
            except envq.EnvqError as exc:
                errors.append(exc)

        q.start()
        q.send(envq.Envelope(invoke=inner, id="c"))
        await advance(1)
        await q.stop()
        assert now() == 5.0
        assert [type(e) for e in errors] == [envq.QueueStopping]
        assert trace.started("late") == []
        assert trace.for_env(late) == []
        assert q.capacity_used == 0

    async def test_send_from_attempt_while_running_admits(self, make_queue: QueueMaker) -> None:
        """send() from an attempt while the queue is RUNNING admits the envelope."""
        trace = Trace()
        q = make_queue(trace)
        child = trace.env("child")

        async def inner(env: envq.Envelope) -> None:
            q.send(child)

        q.start()
        q.send(envq.Envelope(invoke=inner, id="c"))
        await advance(1)
        assert trace.started("child") == [0.0]
        await q.stop()
