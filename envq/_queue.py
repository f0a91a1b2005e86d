"""The queue: lifecycle, admission, capacity, workers and the outcome interpreter.

Every state change goes through the tables of :mod:`envq._machine`: the lifecycle
methods look up ``LIFECYCLE[(state, call)]`` and hand the row to
:meth:`envq._lifecycle.Lifecycle.perform`, which performs its action; the rows of
``OUTCOMES`` are resolved once per queue by :meth:`envq._outcomes.Settler.resolve` into
the row's action with its target bound, which the worker calls at the end of each
attempt. Both end in ``assert_never``, so mypy proves every action is handled. Envelope
moves go through :meth:`envq._moves.Mover.move` (checked against ``ENVELOPE_MOVES`` when
``envq._machine.STRICT`` is on), and every envelope state has one entry routine,
:meth:`envq._moves.Mover.enter`.

Per-envelope bookkeeping lives in :attr:`envq._store.MemoryStore.live` (envelope →
:class:`_Rec`), an insertion-ordered dict: its keys are exactly the live envelopes, in
admission order, so ``capacity_used`` is ``len(live)`` and cannot drift.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Final, TypeVar, cast

import attrs

from envq import _checks, _machine
from envq._admission import Admission, RoomWaiters
from envq._attempt import Threads, Worker
from envq._config import DeadLetter, QueueConfig
from envq._crew import ATTEMPT, HOSTED
from envq._entry import check_own_loop, keep_alive, running_loop
from envq._envelope import Envelope, Stamp, _Rec, is_async_callable
from envq._first_run import first_delay
from envq._lifecycle import Lifecycle
from envq._limits import RateLimiter
from envq._listeners import Listener, Listeners
from envq._machine import (
    LIFECYCLE,
    SETTLED,
    CancelCause,
    EnvEvent,
    EnvState,
    Kind,
    LifeAction,
    LifeRow,
    QueueCall,
    QueueState,
)
from envq._moves import Mover
from envq._notify import (
    checked_signals,
    leftovers_at_exit,
    lost_with_queue,
    on_first_signal,
)
from envq._operator import Operator, OperatorCalls
from envq._protocol import DONE, Count, Done, QueueProtocol, count
from envq._reports import StopReport
from envq._stats import Counters, Status, check_arrives
from envq._store import MemoryStore
from envq._timers import Clock
from envq._values import HookTimeout, Statistics, StopMode

__all__ = ["Attempt", "Queue", "current_attempt"]

log = logging.getLogger("envq")

_T = TypeVar("_T")
_running_loop: Final = running_loop

# Enum members the hot path compares with, as module constants: in Python 3.11 reading
# a member off its class costs ~150 ns, a global ~20 ns. They name states for the entry
# work of ``_enter``; no rule is spelled with them (the targets come from the tables).
_READY: Final = EnvState.READY
_DELAYED: Final = EnvState.DELAYED
_PARKED: Final = EnvState.PARKED
_BUFFERED: Final = EnvState.BUFFERED
_RETURNED: Final = EnvState.RETURNED
_FAILED: Final = EnvState.FAILED
_ADMIT: Final = LifeAction.ADMIT
_BUFFER: Final = LifeAction.BUFFER
_SEND: Final = QueueCall.SEND
_DUE: Final = EnvEvent.DUE
_PERIODIC: Final = Kind.PERIODIC


class Queue(OperatorCalls):
    """A named, bounded, asyncio-native worker pool that runs envelopes.

    :param name: a non-empty printable str without surrounding whitespace
        (``"my-queue"``); used in messages, logs and metric labels.
    :param workers: number of concurrent attempts (> 0).
    :param capacity: most envelopes in non-terminal states at once; 0 = unlimited.
    :param stop_mode: the default :class:`StopMode` of ``stop()``.
    :param wait: whether ``stop()`` waits until nothing is in flight (default True).
    :param stamps: queue-level middleware, outermost, in list order.
    :param rate: a dispatch limiter (e.g. :class:`envq.TokenBucket`): each dispatch
        waits ``rate.when(env)``.
    :param limiter: a failure-retry limiter: every retry waits at least
        ``limiter.when(env)``; ``limiter.forget(env)`` when the envelope succeeds or ends.
    :param dead_letter: called as ``dead_letter(env, error)`` for every envelope that
        ends FAILED, with its last error (``MaxRetriesExceeded`` when retries ran out);
        plain or ``async def`` (then run as a task); errors are logged.
    :param hook_timeout: the hooks' time budgets.
    :param threads: size of the thread pool for plain callables (default
        ``min(32, workers + 4)``).
    :param log_unhandled: log an envelope that ends FAILED while nothing handles it
        (no ``on_failure``, no ``dead_letter``, no subscribed listener) once, at
        WARNING with its last error's traceback, through the ``envq`` logger.
    :param keep_ended: how many envelopes that ended FAILED or STOPPED the queue keeps,
        with their story (last error, failed attempts), for :meth:`envelopes`,
        :meth:`retry` and :meth:`discard` (the latest ones; 0: none).
    """

    def __init__(
        self,
        name: str,
        *,
        workers: int = 1,
        capacity: int = 0,
        stop_mode: StopMode = StopMode.DRAIN,
        wait: bool = True,
        stamps: Iterable[Stamp] | None = (),
        rate: RateLimiter | None = None,
        limiter: RateLimiter | None = None,
        dead_letter: DeadLetter | None = None,
        hook_timeout: HookTimeout = HookTimeout(),  # noqa: B008 - frozen value
        threads: int | None = None,
        log_unhandled: bool = True,
        keep_ended: int = 1000,
    ) -> None:
        config = self.config = QueueConfig.checked(
            name,
            workers=workers,
            capacity=capacity,
            stop_mode=stop_mode,
            wait=wait,
            stamps=stamps,
            rate=rate,
            limiter=limiter,
            dead_letter=dead_letter,
            hook_timeout=hook_timeout,
            threads=threads,
            log_unhandled=log_unhandled,
            keep_ended=keep_ended,
        )
        self.name: Final = name
        self.workers: Final = workers
        self.capacity: Final = capacity
        self.stop_mode: Final = stop_mode
        self.wait: Final = wait
        self.stamps: Final[tuple[Stamp, ...]] = config.stamps
        self.rate: Final = rate
        self.limiter: Final = limiter
        self.dead_letter: Final = dead_letter
        self._dead_async = dead_letter is not None and is_async_callable(dead_letter)
        self.hook_timeout: Final = hook_timeout
        self.log_unhandled: Final = log_unhandled
        #: The termination under way (or done), once it had to wait for a stop.
        self._closing: asyncio.Task[list[Envelope]] | None = None

        self._loop: asyncio.AbstractEventLoop | None = None
        #: The thread the queue's loop runs in (known once bound).
        self._loop_thread: int | None = None
        self._blacklist: set[str] = set()
        self._counts = Counters()
        self._events = Listeners(name, _machine.STRICT, self._observe_changed)
        self._listeners = self._events.listeners
        # The holding side, and the entry routines that move envelopes into it.

        def on_due(env: Envelope, rec: _Rec) -> None:
            mover.due(env, rec)  # the mover is made next: it holds the store

        clock = self._clock = Clock()
        status = self._status = Status()
        store = self._store = MemoryStore(self, on_due, deque(), clock, keep_ended)
        room = RoomWaiters(capacity, status, self, store.live, store.ids, self._blacklist)
        mover = self._mover = Mover(
            config, store, self._events, self._counts, self._now, clock, status, room
        )
        self._live = store.live
        self._threads = Threads(threads or min(32, workers + 4), f"envq-{name}")
        self._admission = admission = Admission(
            name,
            capacity,
            owner=self,
            live=store.live,
            ids=store.ids,
            blacklist=self._blacklist,
            counts=self._counts,
            enter=mover.enter,
            first_delay=self._first_delay,
            status=status,
            room=room,
            listeners=self._events,
        )
        self._admit = admission.admit
        # The lifecycle makes the crew, and the crew what runs and settles its attempts.
        self._lc = Lifecycle(
            config,
            self,
            status=status,
            store=store,
            mover=mover,
            admission=admission,
            room=room,
            threads=self._threads,
            counts=self._counts,
            listeners=self._events,
            clock=clock,
            blacklist=self._blacklist,
        )
        self._crew = crew = self._lc.crew
        self._deadlines = crew.deadlines
        self._settler = crew.settler
        self._operator = Operator(
            name,
            store=store,
            enter=mover.enter,
            move=mover.move,
            admission=admission,
            crew=self._crew,
            status=status,
        )
        #: What the last ``terminate()`` handed back (``async with`` terminates on exit).
        self.leftovers: list[Envelope] = []

    # ----------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------

    @property
    def state(self) -> QueueState:
        """The lifecycle state."""
        return self._status.state

    @property
    def capacity_used(self) -> int:
        """The number of envelopes in non-terminal states (buffered and parked included)."""
        return len(self._live)

    def __repr__(self) -> str:
        return f"<envq.Queue {self.name!r} {self._status.state.name} {len(self._live)} live>"

    def start(self) -> Done:
        """Start (or restart) the queue; needs a running event loop. Over when it
        returns: its answer may be awaited (``await queue.start()``, as on
        :class:`envq.postgres.PgQueue`) and need not be.

        From INIT, buffered envelopes are armed; from STOPPED, parked ones are re-armed
        with the delay they had left. A no-op when RUNNING; raises
        :class:`envq.QueueStopping` / :class:`envq.QueueTerminated` when STOPPING /
        TERMINATED.
        """
        bound = self._loop
        current = _running_loop()
        if bound is not None and current is not bound:
            if bound.is_running():
                return self._from_elsewhere(self.start)
            row = LIFECYCLE[(self._status.state, QueueCall.START)]
            if row.action is LifeAction.REJECT:
                self._lc.perform(row, QueueCall.START)
            raise RuntimeError(
                f"queue {self.name!r} is bound to another event loop, which is not running; "
                "start it from a coroutine on that loop"
            )
        if current is None:
            raise RuntimeError(
                f"queue {self.name!r}: start() needs a running event loop (call it from a "
                "coroutine, or from any thread once the queue's loop is running)"
            )
        self._bound_loop()
        self._lc.perform(LIFECYCLE[(self._status.state, QueueCall.START)], QueueCall.START)
        return DONE

    def send(self, *envelopes: Envelope) -> Count:
        """Admit envelopes; all or nothing; never blocks. The number admitted (an
        envelope already live in the queue is a dedup, not admitted), which may also be
        awaited (``await queue.send(env)``, as on :class:`envq.postgres.PgQueue`).

        Checks, in order: queue state, validation, type blacklist, dedup, capacity.
        An envelope already live in this queue is skipped (deduplicated).

        :raises QueueStopping: the queue is STOPPING.
        :raises QueueNotRunning: the queue is STOPPED.
        :raises QueueTerminated: the queue is TERMINATED.
        :raises BadEnvelopeType: not an envelope (a ``TypeError`` and a ``BadEnvelope``).
        :raises BadEnvelope: live in another queue.
        :raises TypeBlacklisted: its ``type`` was blacklisted by a ``StopType``.
        :raises CapacityExceeded: the batch does not fit, or producers are waiting in
            ``send_wait`` (send does not overtake them).
        """
        loop = self._loop
        if loop is not None and _running_loop() is not loop:
            if loop.is_running():
                return self._from_elsewhere(self.send, *envelopes)
            if threading.get_ident() != self._loop_thread:
                return self._send_aside(loop, envelopes)
        return count(self._send_here(envelopes))

    def _send_here(self, envelopes: Sequence[Envelope]) -> int:
        """The send, on the queue's thread, by the lifecycle's SEND row: the number
        admitted."""
        row = self._status.send_row
        action = row.action
        if action is _ADMIT or action is _BUFFER:
            return self._admit(envelopes, False, action is _BUFFER)
        self._lc.perform(row, _SEND, envelopes)  # refused, or nothing to do
        return 0

    def _send_aside(self, loop: asyncio.AbstractEventLoop, envelopes: Sequence[Envelope]) -> Count:
        """``send()`` from another thread while the queue's loop is not running (between
        two ``run_until_complete`` calls): the call runs here and raises here, one such
        call at a time. Listeners are promised the loop's thread, so the call's events
        are set aside, with every event emitted until the loop delivers them (in
        order), and the loop is asked to deliver them once the call is done: asked
        before, it could run (started meanwhile) and deliver the list before the call
        had added its events to it."""
        events = self._events
        started = True
        admitted = 0
        try:
            with events.lock:
                if not loop.is_running():
                    started = False
                    if events.aside is None:
                        events.aside = []
                    admitted = self._send_here(envelopes)
        finally:
            if not started:
                # Asked once the lock is free: a delivery that finds it held does nothing.
                try:
                    loop.call_soon_threadsafe(events.deliver_aside)
                except RuntimeError:  # closed: nobody else will ever run listeners
                    events.deliver_aside()
        if started:  # the loop started meanwhile: the call is the loop's
            return self._from_elsewhere(self.send, *envelopes)
        return count(admitted)

    async def send_wait(
        self,
        *envelopes: Envelope,
        timeout: float | None = None,  # noqa: ASYNC109 - the contract's signature
    ) -> Count:
        """Like :meth:`send`, but wait for room (first come, first served); the number
        admitted.

        Raises what ``send()`` would raise if the queue changes state while waiting
        (INIT → RUNNING keeps waiting).

        :raises SendTimeout: no room within ``timeout`` (a :class:`CapacityExceeded`
            and a ``TimeoutError``).
        :raises CapacityExceeded: at once, for a batch larger than the capacity.
        """
        if timeout is not None:
            timeout = _checks.timeout(f"queue {self.name!r}: send_wait() timeout", timeout)
        self._own_loop("send_wait")
        batch = envelopes
        if not self._admission.waiters:
            admitted = self._admit(batch, True)
            if admitted >= 0:
                return count(admitted)
        return count(await self._admission.wait(batch, timeout, self._bound_loop()))

    async def stop(
        self, mode: StopMode | None = None, cancel: bool = False, wait: bool | None = None
    ) -> StopReport:
        """Stop the queue (→ STOPPING → STOPPED) and report what the stop did.

        :param mode: :attr:`StopMode.DRAIN` runs ready envelopes first,
            :attr:`StopMode.STOP` parks them; default: the queue's ``stop_mode``.
        :param cancel: cancel in-flight attempts (their envelopes are parked); only
            with ``STOP``, else ``ValueError``.
        :param wait: override the queue's ``wait`` for this call; with False the
            report is returned at once (``complete=False``) and :meth:`wait_stopped`
            returns the final one.

        A no-op stop returns the last final report. Called from inside one of the
        queue's attempts, it spares the caller and returns at once.
        """
        where = f"queue {self.name!r}: stop()"
        mode = self.stop_mode if mode is None else _checks.member(f"{where} mode", mode, StopMode)
        _checks.flag(f"{where} cancel", cancel)
        _checks.optional_flag(f"{where} wait", wait)
        if cancel and mode is StopMode.DRAIN:
            raise ValueError(
                f"queue {self.name!r}: cancel=True needs mode=StopMode.STOP (mode is DRAIN)"
            )
        self._own_loop("stop")
        row = LIFECYCLE[(self._status.state, QueueCall.STOP)]
        waiting = self._lc.perform(
            row, QueueCall.STOP, mode=mode, cause=CancelCause.STOP if cancel else None
        )
        if waiting is None:
            return self._lc.last_report
        if self._inside() is not None or not (self.wait if wait is None else wait):
            return self._lc.make_report()
        await asyncio.shield(waiting)
        return self._lc.last_report

    async def wait_stopped(self) -> StopReport:
        """The final report once the queue is STOPPED (waits for the next stop to end).

        :raises RuntimeError: when called from inside one of the queue's attempts.
        """
        self._own_loop("wait_stopped")
        if self._inside() is not None:
            raise RuntimeError(f"queue {self.name!r}: wait_stopped() from inside the queue")
        if self._status.state in SETTLED:
            return self._lc.last_report
        fut = self._bound_loop().create_future()
        self._status.stopped_waiters.append(fut)
        await asyncio.shield(fut)
        return self._lc.last_report

    async def terminate(self) -> list[Envelope]:
        """End the queue for good and hand back every envelope still in it.

        Cancels in-flight attempts; returns the buffered, ready, delayed, parked and
        just-cancelled envelopes in admission order (and keeps them in
        :attr:`leftovers`). Everything not handed back has ended in a terminal state
        and said so in an event.

        Once begun, a termination runs to its end even if the caller is cancelled
        (what it hands back is then in :attr:`leftovers`); a second ``terminate()``
        meanwhile waits for the same end and returns ``[]``.

        :raises RuntimeError: when called from inside one of the queue's attempts.
        """
        self._own_loop("terminate")
        if self._inside() is not None:
            raise RuntimeError(f"queue {self.name!r}: terminate() from inside the queue")
        closing = self._closing
        if closing is not None:
            await asyncio.shield(closing)
            return []
        row = LIFECYCLE[(self._status.state, QueueCall.TERMINATE)]
        self._store.handed = []
        waiting = self._lc.perform(
            row, QueueCall.TERMINATE, mode=StopMode.STOP, cause=CancelCause.TERMINATE
        )
        if row.action is LifeAction.NOTHING:  # already terminated
            return []
        if waiting is None:
            return self._hand_over()
        closing = self._closing = self._bound_loop().create_task(
            self._terminating(waiting, row), name=f"envq:{self.name}:terminate"
        )
        keep_alive(closing)
        return await asyncio.shield(closing)

    async def _terminating(self, waiting: asyncio.Future[None], row: LifeRow) -> list[Envelope]:
        """The rest of a termination that had a stop to wait for (``row``: the composite
        row it began with, whose target is where it must end)."""
        next_: asyncio.Future[None] | None = waiting
        while next_ is not None:
            await next_
            # Normally STOPPED → HAND_BACK; a start() that slipped in stops again.
            next_ = self._lc.perform(
                LIFECYCLE[(self._status.state, QueueCall.TERMINATE)],
                QueueCall.TERMINATE,
                mode=StopMode.STOP,
                cause=CancelCause.TERMINATE,
            )
        check_arrives(row, self._status.state)
        return self._hand_over()

    def _hand_over(self) -> list[Envelope]:
        """The envelopes the termination handed back, in admission order."""
        assert self._status.state is QueueState.TERMINATED, self._status.state
        self.leftovers = self._store.take_handed()
        return list(self.leftovers)

    async def run_until_empty(self) -> StopReport:
        """Bootstrap mode: start if needed, run until no envelope is left in the queue,
        then stop; returns the stop's report.

        Every live envelope must reach a terminal state first, so a periodic envelope
        keeps this waiting until it stops (wrap the call in ``asyncio.timeout`` to
        bound it).

        :raises RuntimeError: when called from inside one of the queue's attempts.
        """
        self._own_loop("run_until_empty")
        if self._inside() is not None:
            raise RuntimeError(f"queue {self.name!r}: run_until_empty() from inside the queue")
        self.start()
        if self._live:
            fut = self._bound_loop().create_future()
            self._status.empty_waiters.append(fut)
            await asyncio.shield(fut)
        return await self.stop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the queue is bound to (by its first start), or None."""
        return self._loop

    def state_of(self, envelope: Envelope) -> EnvState | None:
        """The state of ``envelope`` in this queue, or None when it is not live here."""
        rec = self._live.get(envelope)
        return rec.state if rec is not None else None

    def due(self, envelope: Envelope) -> float | None:
        """The loop time a DELAYED ``envelope`` of this queue becomes ready; None when
        it is not DELAYED here."""
        rec = self._live.get(envelope)
        return rec.due if rec is not None and rec.state is _DELAYED else None

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(event)`` for every state change; returns an unsubscribe
        function. A listener that raises is logged and never breaks the queue.

        A subscribed listener counts as handling failures: an envelope that ends
        FAILED is then not logged as unhandled (see ``log_unhandled``).
        """
        _checks.plain_callable(
            f"queue {self.name!r}: subscribe() listener",
            listener,
            "listeners are called synchronously on the queue's loop, so an async def "
            "one's coroutine would never be awaited; start a task from a plain listener",
        )
        return self._listen(listener, handles_failures=True)

    def _listen(self, listener: Listener, *, handles_failures: bool) -> Callable[[], None]:
        """Subscribe ``listener``; envq's own listeners (metrics, the task API) do not
        count as handling failures."""
        if self._elsewhere():
            return self._from_elsewhere(self._listen, listener, handles_failures=handles_failures)
        remove = self._events.add(listener, handles_failures=handles_failures)

        def unsubscribe() -> None:
            if self._elsewhere():
                self._from_elsewhere(remove)
            else:
                remove()

        return unsubscribe

    def statistics(self) -> Statistics:
        """A frozen snapshot of the queue's state and counters (it may also be awaited,
        as :meth:`envq.postgres.PgQueue.statistics` is)."""
        if self._elsewhere():
            return self._from_elsewhere(self.statistics)
        return self._counts.snapshot(
            self._status.state,
            (rec.state for rec in self._live.values()),
            capacity_limit=self.capacity,
            stuck_threads=self._threads.stuck,
        )

    def stop_on_signals(self, *signals: int) -> Callable[[], None]:
        """Stop the queue on the first of ``signals`` (default: SIGINT and SIGTERM),
        in its ``stop_mode`` — with the default DRAIN, the work already started and
        ready runs to its end — and give the signals back at once: a second one is
        handled as it was before this call (Ctrl-C twice interrupts as usual).

        Call it from a coroutine on the queue's loop, in the main thread (the loop's
        signal handlers; Unix only); then wait for the stop with
        :meth:`wait_stopped`. Returns a function that gives the signals back without
        waiting for one.

        :raises TypeError: a signal that is not an int.
        :raises ValueError: a signal that cannot be handled (SIGKILL, SIGSTOP, or
            not a signal number).
        :raises RuntimeError: called outside the queue's running loop.
        """
        wanted = checked_signals(f"queue {self.name!r}: stop_on_signals() signals", signals)
        return on_first_signal(self._loop, self._bound_loop, self.name, wanted, self.stop)

    async def __aenter__(self) -> Queue:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop (the queue's mode) and terminate; what terminate hands back is kept in
        :attr:`leftovers`. Leaving the block by a cancellation, or a cancellation during
        the exit, skips or cuts short the graceful stop: the queue terminates at once
        (in-flight attempts cancelled). Either way the exit returns only once the queue
        is TERMINATED, and re-raises such a cancellation afterwards."""
        interrupted = False
        if self._status.state is QueueState.TERMINATED:
            return
        if exc_type is None or not issubclass(exc_type, asyncio.CancelledError):
            try:
                await self.stop()
            except asyncio.CancelledError:
                interrupted = True
        while True:
            try:
                await self.terminate()
                break
            except asyncio.CancelledError:
                interrupted = True  # the termination goes on: wait for it again
        if self.leftovers:
            leftovers_at_exit(self.name, self.leftovers, exc_type is None and not interrupted)
        if interrupted:
            raise asyncio.CancelledError

    def __del__(self) -> None:
        live, lc = getattr(self, "_live", None), getattr(self, "_lc", None)
        if live and lc is not None:
            lost_with_queue(self.name, len(live), lc.state.name, self)

    def _first_delay(self, env: Envelope) -> float:
        return first_delay(env, self._bound_loop())

    # ----------------------------------------------------------------------------------
    # Envelope moves
    # ----------------------------------------------------------------------------------

    # ----------------------------------------------------------------------------------
    # Helpers
    # ----------------------------------------------------------------------------------

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        """The queue's loop; the running one becomes it on first use."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._clock.use(loop)
        return loop

    def _own_loop(self, method: str) -> None:
        check_own_loop(self._loop, self.name, method)

    def _observe_changed(self, observed: bool) -> None:
        self._mover.observed = observed

    def _now(self) -> float:
        """Loop time for events; 0.0 before the queue has seen a loop."""
        if self._loop is not None:
            return self._loop.time()
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return 0.0

    def _inside(self) -> Worker | None:
        """The worker running the attempt the current task belongs to, if it is one of
        this queue's attempts still in progress (or its hooks)."""
        env = ATTEMPT.get()
        owner: object = env._rec.owner if env is not None else None
        return self._crew.holding(env) if owner is self and env is not None else None


@attrs.frozen
class Attempt:
    """The attempt in progress, as :func:`envq.current_attempt` sees it."""

    #: The queue running it: an :class:`envq.Queue`, or an
    #: :class:`envq.postgres.PgQueue` whose node runs it.
    queue: QueueProtocol
    envelope: Envelope
    #: 1-based number of this attempt in the envelope's current stay in the queue.
    number: int
    #: Loop time the envelope's deadline expires; None without a deadline.
    deadline_at: float | None


def current_attempt() -> Attempt | None:
    """The attempt the calling code runs in — from ``invoke``, a hook, a stamp, or a
    task spawned by one of them — or None outside any attempt or once it has ended."""
    env = ATTEMPT.get()
    if env is None:
        hosted = HOSTED.get()  # an attempt a node of a shared queue runs
        if hosted is None:
            return None
        queue, env, number, worker = hosted
        if worker.env is not env:
            return None
        return Attempt(cast("QueueProtocol", queue), env, number, worker.deadline_at)
    owner: object = env._rec.owner
    if not isinstance(owner, Queue):
        return None
    w = owner._crew.holding(env)
    return None if w is None else Attempt(owner, env, env._rec.attempts, w.deadline_at)
