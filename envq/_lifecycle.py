"""The lifecycle interpreter: the queue's state, and what each lifecycle row does.

The queue's public calls look up ``LIFECYCLE[(state, call)]`` and hand the row to
:meth:`Lifecycle.perform`, which performs its :class:`LifeAction` in one exhaustive
``match`` (mypy proves every action handled). It is the only writer of the queue's one
state field (:class:`envq._status.Status`, which the other parts read), and keeps a
stop's final report. Envelopes move only through the queue's entry routines; the
workers, the delay heap and the deadline timer are the queue's, lent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final, Protocol, assert_never

from envq import _machine
from envq._admission import Admission, RoomWaiters
from envq._attempt import Threads, Worker
from envq._config import QueueConfig
from envq._crew import Crew
from envq._envelope import Envelope
from envq._first_run import calendar_delay, unschedulable
from envq._listeners import Listeners
from envq._machine import (
    BROADCASTS,
    LIFECYCLE,
    SETTLED,
    CancelCause,
    EnvState,
    LifeAction,
    LifeRow,
    QueueCall,
    QueueState,
)
from envq._moves import Mover
from envq._reports import Event, StopReport
from envq._stats import Counters, Status, StopRun, call_refused, check_stays, report
from envq._store import MemoryStore
from envq._timers import Clock
from envq._values import StopMode

__all__ = ["Host", "Lifecycle"]

_READY: Final = EnvState.READY
_DELAYED: Final = EnvState.DELAYED
_BUFFERED: Final = EnvState.BUFFERED
_PARKED: Final = EnvState.PARKED
_STOPPING_Q: Final = QueueState.STOPPING


class Host(Protocol):
    """The queue's side: its loop, and who is inside one of its attempts."""

    def _now(self) -> float: ...

    def _inside(self) -> Worker | None: ...

    def _bound_loop(self) -> asyncio.AbstractEventLoop: ...

    def _first_delay(self, env: Envelope) -> float: ...


class Lifecycle:
    """The lifecycle machine of one queue, performed.

    The lifecycle makes the queue's crew (a start spawns its workers, a stop retires
    them, and the workers ask for the rows that end a stop or abandon the queue).

    :param config: the queue's settings.
    :param host: the queue (its loop, who is inside one of its attempts).
    :param status: the queue's lifecycle state, which only this writes.
    :param store: the holding side; ``mover``: the entry routines; the admission, the
        producers waiting for room, thread pool, counters, listeners, clock and
        blacklist are the queue's own, lent.
    """

    def __init__(
        self,
        config: QueueConfig,
        host: Host,
        *,
        status: Status,
        store: MemoryStore,
        mover: Mover,
        admission: Admission,
        room: RoomWaiters,
        threads: Threads,
        counts: Counters,
        listeners: Listeners,
        clock: Clock,
        blacklist: set[str],
    ) -> None:
        self._name = config.name
        self._host = host
        self._store = store
        self._live = store.live
        self._ready = store.ready
        self._mover = mover
        self._admission = admission
        self._room = room
        #: The workers (with their deadline timer, attempt runner and outcome
        #: interpreter).
        self.crew = Crew(
            config,
            mover,
            self,
            status=status,
            store=store,
            counts=counts,
            threads=threads,
            clock=clock,
            listeners=listeners,
            blacklist=blacklist,
        )
        self._threads = threads
        self._counts = counts
        self._listeners = listeners
        self.status = status
        #: The last stop's final report.
        self.last_report = StopReport()

    @property
    def state(self) -> QueueState:
        """The queue's lifecycle state (the status's one field)."""
        return self.status.state

    def perform(
        self,
        row: LifeRow,
        call: QueueCall,
        batch: Sequence[Envelope] = (),
        *,
        mode: StopMode = StopMode.STOP,
        cause: CancelCause | None = None,
    ) -> asyncio.Future[None] | None:
        """Perform a lifecycle row; return the future to await, if the call waits."""
        check_stays(row, self.state)
        match row.action:
            case LifeAction.BUFFER | LifeAction.ADMIT:
                self._admission.admit(batch, False, row.action is LifeAction.BUFFER)
                return None
            case LifeAction.NOTHING:
                return None
            case LifeAction.REJECT:
                raise call_refused(self._name, self.state, row, call, batch, self._counts)
            case LifeAction.ARM:
                self.arm_all(row)
                return None
            case LifeAction.BEGIN_STOP:
                return self.begin_stop(row, mode, cause)
            case LifeAction.AWAIT_STOP:
                run = self.status.run
                assert run is not None
                return run.done
            case LifeAction.FINISH_STOP:
                self.finish_stop(row)
                return None
            case LifeAction.STOP_THEN_TERMINATE:
                return self.begin_stop(LIFECYCLE[(self.state, QueueCall.STOP)], mode, cause)
            case LifeAction.ESCALATE_THEN_TERMINATE | LifeAction.ESCALATE:
                return self.escalate(cause)
            case LifeAction.HAND_BACK:
                self.hand_back(row)
                return None
            case _:
                assert_never(row.action)

    def set_state(self, to: QueueState | None, *, pump: bool = True) -> None:
        """Enter queue state ``to``; then (unless told not to) admit waiting producers
        the new state lets in."""
        assert to is not None
        frm = self.status.enter(to)
        if frm is not to and self._listeners.listeners:
            self._listeners.emit(Event(self._host._now(), self._name, None, frm, to))
        if pump and self._room.waiters:
            self._room.pump()

    def arm_all(self, row: LifeRow) -> None:
        loop = self._host._bound_loop()
        # Every delay worked out before anything moves: a schedule that cannot place
        # its first run (or, after a stop, its next) refuses the start, naming the
        # envelope, and the queue stays as it was (terminate() hands everything back).
        delays: dict[Envelope, float] = {}
        for env, rec in self._live.items():
            if rec.state is _BUFFERED:
                if not env._timed:
                    delays[env] = env.delay
                    continue
                compute = self._host._first_delay
            elif env._calendar:
                # Fires missed while the queue was stopped are skipped.
                def compute(env: Envelope) -> float:
                    return calendar_delay(env, 0.0, loop)
            else:
                delays[env] = rec.due
                continue
            try:
                delays[env] = compute(env)
            except Exception as exc:
                raise unschedulable(f"queue {self._name!r}: start()", env, exc) from exc
        self.status.run = None
        # Waiting producers are let in only once everything already admitted is armed:
        # their envelopes enter READY/DELAYED by admission, not by START, and queue up
        # behind the earlier ones.
        self.set_state(row.target, pump=False)
        self.crew.spawn(loop)
        # The event a start applies to the live envelopes, read off the table both
        # stores share (a start arms, a stop parks, a terminate hands back).
        (arms,) = BROADCASTS[LifeAction.ARM]
        for env, rec in list(self._live.items()):
            delay = delays[env]
            to = _machine.queue_move(rec.state, arms, delay > 0)
            assert to is not None, rec.state
            self._mover.enter(env, rec, arms, to, delay)
        if self._room.waiters:
            self._room.pump()

    def begin_stop(
        self, row: LifeRow, mode: StopMode, cause: CancelCause | None
    ) -> asyncio.Future[None]:
        run = self.status.run = StopRun(self._host._bound_loop().create_future())
        run.spared = self._host._inside()
        self.set_state(row.target)
        self.park(mode)
        self.cancel_in_flight(cause)
        self.check_drained()
        return run.done

    def escalate(self, cause: CancelCause | None) -> asyncio.Future[None]:
        run = self.status.run
        assert run is not None
        self.park(StopMode.STOP, LifeAction.ESCALATE)
        run.spared = None  # terminate spares nobody
        self.cancel_in_flight(cause)
        self.check_drained()
        return run.done

    def park(self, mode: StopMode, action: LifeAction = LifeAction.BEGIN_STOP) -> None:
        """Park what a stop in ``mode`` parks (the STOP rows of ``QUEUE_MOVES``: delayed
        envelopes, and ready ones too in STOP mode), in admission order."""
        move = _machine.queue_move
        (parks,) = BROADCASTS[action]
        if move(_READY, parks, mode) is not None:
            self._store.drop_ready()
        now = self._host._bound_loop().time()
        for env, rec in self._live.items():
            to = move(rec.state, parks, mode)
            if to is not None:
                rec.tick = 0
                remaining = max(0.0, rec.due - now) if rec.state is _DELAYED else 0.0
                self._mover.move(env, rec, parks, to)
                rec.due = remaining
        # Both modes park every DELAYED envelope: no entry of the delay heap is live.
        self._store.drop_delays()

    def cancel_in_flight(self, cause: CancelCause | None) -> None:
        if cause is not None:
            run = self.status.run
            self.crew.cancel_in_flight(cause, run.spared if run else None)

    def check_drained(self) -> None:
        if self._ready or self.state is not _STOPPING_Q or self.crew.busy():
            return
        self.perform(LIFECYCLE[(self.state, QueueCall.DRAINED)], QueueCall.DRAINED)

    def finish_stop(self, row: LifeRow) -> None:
        self.set_state(row.target)
        self.crew.deadlines.disarm()  # no worker holds an envelope: no limit is running
        self.last_report = self.make_report()
        run = self.status.run
        self.status.run = None
        self.crew.retire_idle()
        if run is not None and not run.done.done():
            run.done.set_result(None)
        self.status.wake_stopped()

    def hand_back(self, row: LifeRow) -> None:
        # State first: waiting producers must see TERMINATED, not the room handing
        # back frees.
        self.set_state(row.target)
        (hands_back,) = BROADCASTS[LifeAction.HAND_BACK]
        for env, rec in list(self._live.items()):
            to = _machine.queue_move(rec.state, hands_back)
            assert to is not None, rec.state
            self._mover.enter(env, rec, hands_back, to)
        self._threads.shutdown()
        self.crew.deadlines.disarm()
        self.status.wake_stopped()

    def make_report(self) -> StopReport:
        return report(
            self.status.run,
            (env for env, rec in self._live.items() if rec.state is _PARKED),
            self.state in SETTLED,
        )

    def abandoned(self) -> None:
        """A worker task was cancelled by someone other than envq: the ABANDON row."""
        self.perform(
            LIFECYCLE[(self.state, QueueCall.ABANDON)],
            QueueCall.ABANDON,
            mode=StopMode.STOP,
            cause=CancelCause.STOP,
        )
