"""One behavioural test per row of the lifecycle tables (``envq._machine``): the queue's
lifecycle, and the abandoned waits (the other tables are in ``test_table_rows.py``).

``scripts/mutate.py`` changes each row of each table in turn (target, action, dropped)
and runs the behavioural tests against the mutant, these first; every row therefore
needs a test that *observes* it (see ``test_table_rows.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import envq
from tests.queue.rows import (
    DRAIN,
    ES,
    QS,
    STOP,
    World,
    advance,
    areject_type,
    reject_type,
    within,
)
from tests.support import now, settle

pytestmark = pytest.mark.usefixtures("no_internal_errors")

# ---------------------------------------------------------------------------------------
# LIFECYCLE: one test per (state, call)
# ---------------------------------------------------------------------------------------


class TestLifecycleRows:
    async def test_init_send_buffers(self) -> None:
        """(INIT, SEND) BUFFER: held BUFFERED, the queue stays INIT, nothing runs."""
        w = World()
        a = w.env("a")
        w.q.send(a)
        await advance(10)
        assert w.q.state is QS.INIT
        assert w.path(a) == ["NEW>BUFFERED"]
        assert w.by_state() == {ES.BUFFERED: 1}
        assert w.runs("a") == []
        assert w.queue_path() == []
        await w.q.terminate()

    async def test_init_stop_is_a_no_op(self) -> None:
        """(INIT, STOP) NOTHING: stop() returns at once, changes nothing."""
        w = World()
        a = w.env("a")
        w.q.send(a)
        report = await within(w.q.stop(STOP, cancel=True), 0)
        assert report == envq.StopReport()
        assert w.q.state is QS.INIT
        assert w.queue_path() == []
        assert w.path(a) == ["NEW>BUFFERED"]
        w.q.start()
        await w.ended(a)
        assert w.path(a)[-1] == "RUNNING>SUCCEEDED/OK"
        await w.q.terminate()

    async def test_init_start_arms_buffered(self) -> None:
        """(INIT, START) ARM → RUNNING: buffered envelopes become READY or DELAYED."""
        w = World(workers=2)
        a, b = w.env("a"), w.env("b", delay=5)
        w.q.send(a, b)
        await advance(3)
        w.q.start()
        assert w.q.state is QS.RUNNING
        await w.ended(a)
        await w.ended(b)
        assert w.queue_path() == ["INIT>RUNNING"]
        assert w.path(a) == [
            "NEW>BUFFERED",
            "BUFFERED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        assert w.path(b)[:3] == ["NEW>BUFFERED", "BUFFERED>DELAYED", "DELAYED>READY"]
        assert w.runs("a") == [3.0]
        assert w.runs("b") == [8.0]
        await w.q.terminate()

    async def test_init_terminate_hands_back(self) -> None:
        """(INIT, TERMINATE) HAND_BACK → TERMINATED: buffered envelopes are returned."""
        w = World()
        a, b = w.env("a"), w.env("b")
        w.q.send(a, b)
        assert await within(w.q.terminate()) == [a, b]
        assert w.q.state is QS.TERMINATED
        assert w.queue_path() == ["INIT>TERMINATED"]
        assert w.path(a) == ["NEW>BUFFERED", "BUFFERED>RETURNED"]
        assert w.by_state() == {ES.RETURNED: 2}

    async def test_running_start_is_a_no_op(self) -> None:
        """(RUNNING, START) NOTHING: no new workers, no re-arming, no queue event."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 10, "ok")), w.env("b", delay=3)
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        w.q.start()
        c = w.env("c")
        w.q.send(c)
        await w.ended(c)
        assert w.queue_path() == ["INIT>RUNNING"]
        # One worker: b and c wait for a, in admission order.
        assert (w.runs("a"), w.runs("b"), w.runs("c")) == ([0.0], [10.0], [10.0])
        assert w.path(b) == [
            "NEW>DELAYED",
            "DELAYED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        await w.q.terminate()

    async def test_running_send_admits(self) -> None:
        """(RUNNING, SEND) ADMIT: READY now, DELAYED with a delay."""
        w = World(workers=2)
        w.q.start()
        a, b = w.env("a"), w.env("b", delay=4)
        w.q.send(a, b)
        assert w.path(a) == ["NEW>READY"]
        assert w.path(b) == ["NEW>DELAYED"]
        await w.ended(b)
        assert w.runs("b") == [4.0]
        await w.q.terminate()

    async def test_running_stop_begins_stopping(self) -> None:
        """(RUNNING, STOP) BEGIN_STOP → STOPPING, then (STOPPING, DRAINED) FINISH_STOP →
        STOPPED when the last attempt ends."""
        w = World()
        a = w.env("a", ("sleep", 10, "ok"))
        w.q.start()
        w.q.send(a)
        await advance(1)
        report = await w.q.stop(DRAIN, wait=False)
        assert report.complete is False
        assert w.q.state is QS.STOPPING
        final = await within(w.q.wait_stopped())
        assert now() == 10.0
        assert final.complete is True
        assert final.completed == (a,)
        assert w.q.state is QS.STOPPED
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        await w.q.terminate()

    async def test_running_terminate_stops_then_hands_back(self) -> None:
        """(RUNNING, TERMINATE) STOP_THEN_TERMINATE: cancel, park, hand everything back."""
        w = World(workers=1)
        a, b = w.env("a", "hang"), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        assert await within(w.q.terminate()) == [a, b]
        assert w.q.state is QS.TERMINATED
        assert w.queue_path() == [
            "INIT>RUNNING",
            "RUNNING>STOPPING",
            "STOPPING>STOPPED",
            "STOPPED>TERMINATED",
        ]
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>RETURNED/CANCELLED"]
        assert w.path(b) == ["NEW>READY", "READY>PARKED", "PARKED>RETURNED"]
        assert w.called() == []

    async def test_stopping_start_and_send_raise_queue_stopping(self) -> None:
        """(STOPPING, START) and (STOPPING, SEND): REJECT with QueueStopping."""
        w = World()
        w.q.start()
        w.q.send(w.env("a", ("sleep", 10, "ok")))
        await advance(1)
        await w.q.stop(wait=False)
        reject_type(w.q.start, envq.QueueStopping)
        b = w.env("b")
        reject_type(lambda: w.q.send(b), envq.QueueStopping)
        await areject_type(w.q.send_wait(b), envq.QueueStopping)
        assert w.q.state is QS.STOPPING
        assert w.path(b) == []
        await w.q.terminate()

    async def test_stopping_stop_waits_for_the_stop_under_way(self) -> None:
        """(STOPPING, STOP) AWAIT_STOP: a second stop() returns the final report when the
        first stop ends."""
        w = World()
        a = w.env("a", ("sleep", 10, "ok"))
        w.q.start()
        w.q.send(a)
        await advance(1)
        await w.q.stop(DRAIN, wait=False)
        report = await within(w.q.stop(STOP, cancel=True))
        assert now() == 10.0
        assert report.complete is True
        assert report.completed == (a,)
        assert w.path(a)[-1] == "RUNNING>SUCCEEDED/OK"
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        await w.q.terminate()

    async def test_stopping_terminate_escalates(self) -> None:
        """(STOPPING, TERMINATE) ESCALATE_THEN_TERMINATE: the DRAIN stop under way turns
        into a cancelling one (its waiter gets the final report); everything is handed
        back."""
        w = World(workers=1)
        a, b = w.env("a", "hang"), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        stopping = asyncio.ensure_future(w.q.stop(DRAIN))
        await settle()
        assert w.q.state is QS.STOPPING
        assert await within(w.q.terminate()) == [a, b]
        report = await within(stopping, 0)
        assert report.complete is True
        assert report.cancelled == (a,)
        assert w.q.state is QS.TERMINATED
        assert w.path(a)[-1] == "RUNNING>RETURNED/CANCELLED"
        assert w.path(b) == ["NEW>READY", "READY>PARKED", "PARKED>RETURNED"]
        assert w.queue_path()[-2:] == ["STOPPING>STOPPED", "STOPPED>TERMINATED"]

    async def test_stopped_start_rearms_parked(self) -> None:
        """(STOPPED, START) ARM → RUNNING: parked envelopes are re-armed."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        report = await within(w.q.stop(STOP))
        assert report.parked == (b,)
        assert w.q.state is QS.STOPPED
        await advance(5)
        w.q.start()
        assert w.q.state is QS.RUNNING
        await w.ended(b)
        assert w.runs("b") == [10.0]
        assert w.path(b) == [
            "NEW>READY",
            "READY>PARKED",
            "PARKED>READY",
            "READY>RUNNING",
            "RUNNING>SUCCEEDED/OK",
        ]
        assert w.queue_path()[-1] == "STOPPED>RUNNING"
        await w.q.terminate()

    async def test_stopped_send_raises_queue_not_running(self) -> None:
        """(STOPPED, SEND): REJECT with QueueNotRunning."""
        w = World()
        w.q.start()
        await w.q.stop()
        b = w.env("b")
        reject_type(lambda: w.q.send(b), envq.QueueNotRunning)
        await areject_type(w.q.send_wait(b), envq.QueueNotRunning)
        assert w.path(b) == []
        await w.q.terminate()

    async def test_stopped_stop_is_a_no_op(self) -> None:
        """(STOPPED, STOP) NOTHING: returns the last final report; nothing changes."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        first = await w.q.stop(STOP)
        again = await within(w.q.stop(DRAIN), 0)
        assert again == first
        assert again.parked == (b,)
        assert w.q.state is QS.STOPPED
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        assert w.runs("b") == []
        await w.q.terminate()

    async def test_stopped_terminate_hands_back_parked(self) -> None:
        """(STOPPED, TERMINATE) HAND_BACK → TERMINATED."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b", delay=50)
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        await w.q.stop(STOP)
        assert await within(w.q.terminate()) == [b]
        assert w.q.state is QS.TERMINATED
        assert w.queue_path()[-1] == "STOPPED>TERMINATED"
        assert w.path(b) == ["NEW>DELAYED", "DELAYED>PARKED", "PARKED>RETURNED"]

    async def test_terminated_rejects_start_and_send(self) -> None:
        """(TERMINATED, START) and (TERMINATED, SEND): REJECT with QueueTerminated."""
        w = World()
        w.q.start()
        await w.q.terminate()
        reject_type(w.q.start, envq.QueueTerminated)
        b = w.env("b")
        reject_type(lambda: w.q.send(b), envq.QueueTerminated)
        await areject_type(w.q.send_wait(b), envq.QueueTerminated)
        assert w.q.state is QS.TERMINATED

    async def test_terminated_stop_and_terminate_are_no_ops(self) -> None:
        """(TERMINATED, STOP) and (TERMINATED, TERMINATE) NOTHING."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 5, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        await w.q.stop(STOP)
        last = w.q.statistics()
        assert await w.q.terminate() == [b]
        events = len(w.events)
        report = await within(w.q.stop(), 0)
        assert report.complete is True
        assert await within(w.q.terminate(), 0) == []
        assert w.q.state is QS.TERMINATED
        assert len(w.events) == events
        assert last.state is QS.STOPPED


class TestAbandonRows:
    """(state, ABANDON): a worker task cancelled by someone other than envq (the loop
    closing). The tests cancel the queue's worker tasks as ``asyncio.run`` would."""

    @staticmethod
    def workers(w: World) -> list[asyncio.Task[Any]]:
        prefix = f"envq:{w.q.name}:worker-"
        return [t for t in asyncio.all_tasks() if t.get_name().startswith(prefix)]

    async def test_running_abandon_stops_cancelling_and_parking(self) -> None:
        """(RUNNING, ABANDON) BEGIN_STOP → STOPPING (a cancelling STOP): the attempt
        in flight ends CANCELLED and parked, the ready envelope is parked unrun, the
        stop completes, and the worker ends cancelled."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 50, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        [task] = self.workers(w)
        task.cancel()
        await settle()
        assert w.queue_path() == ["INIT>RUNNING", "RUNNING>STOPPING", "STOPPING>STOPPED"]
        assert w.path(a) == ["NEW>READY", "READY>RUNNING", "RUNNING>PARKED/CANCELLED"]
        assert w.path(b) == ["NEW>READY", "READY>PARKED"]
        assert w.runs("b") == []
        assert task.cancelled()
        assert await w.q.terminate() == [a, b]

    async def test_stopping_abandon_escalates(self) -> None:
        """(STOPPING, ABANDON) ESCALATE: a DRAIN stop waiting for ready work that no
        worker will run any more becomes a cancelling STOP: the ready envelope is
        parked unrun and the stop completes."""
        w = World(workers=1)
        a, b = w.env("a", ("sleep", 50, "ok")), w.env("b")
        w.q.start()
        w.q.send(a, b)
        await advance(1)
        assert (await w.q.stop(DRAIN, wait=False)).complete is False
        waiting = asyncio.ensure_future(w.q.stop())  # waits for the stop under way
        [task] = self.workers(w)
        task.cancel()
        await settle()
        assert w.q.state is QS.STOPPED
        report = await within(waiting, 0)
        assert report.cancelled == (a,)
        assert report.parked == (a, b)
        assert w.path(a)[-1] == "RUNNING>PARKED/CANCELLED"
        assert w.path(b) == ["NEW>READY", "READY>PARKED"]
        assert w.runs("b") == []
        assert now() == 1.0
        assert await w.q.terminate() == [a, b]

    @pytest.mark.parametrize("then", ["stopped", "terminated"])
    async def test_stopped_and_terminated_abandon_change_nothing(self, then: str) -> None:
        """(STOPPED, ABANDON) and (TERMINATED, ABANDON) NOTHING: workers told to retire
        by a stop, and cancelled before they ran again (the loop closing right after
        ``stop()`` or ``terminate()``), end cancelled; the queue does not change."""
        w = World(workers=2)
        w.q.start()
        await settle()  # the workers wait for work
        workers = self.workers(w)
        assert len(workers) == 2
        await w.q.stop()
        if then == "terminated":
            assert await w.q.terminate() == []
        state = w.q.state
        events = len(w.events)
        for task in workers:
            task.cancel()  # before they run again
        await settle()
        assert all(task.cancelled() for task in workers)
        assert w.q.state is state
        assert len(w.events) == events
