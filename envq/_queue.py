"""The queue: lifecycle, admission, workers and the outcome interpreter (contract §3–§6).

Every state change goes through the tables of :mod:`envq._machine`: the lifecycle
methods look up ``LIFECYCLE[(state, call)]`` and hand the row to :meth:`Queue._life`,
which performs its action; the rows of ``OUTCOMES`` are resolved once per queue by
:meth:`Queue._resolve` into the row's action with its target bound, which the worker
calls at the end of each attempt. Both end in ``assert_never``, so mypy proves every
action is handled. Envelope moves go through :meth:`Queue._move` (checked against
``ENVELOPE_MOVES`` when ``envq._machine.STRICT`` is on), and every envelope state has
one entry routine, :meth:`Queue._enter`.

Per-envelope bookkeeping lives in ``Queue._live`` (envelope → :class:`_Rec`), an
insertion-ordered dict: its keys are exactly the live envelopes, in admission order,
so ``capacity_used`` is ``len(_live)`` and cannot drift.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import math
import time
import warnings
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, Final, NoReturn, TypeAlias, TypeVar, assert_never, cast

from envq import _checks, _machine
from envq._attempt import Runner, Threads, Worker
from envq._envelope import Envelope, Stamp, _Rec, is_async_callable
from envq._errors import (
    BadEnvelope,
    CapacityExceeded,
    EnvqError,
    MaxRetriesExceeded,
    TypeBlacklisted,
)
from envq._limits import RateLimiter
from envq._machine import (
    ARMED,
    DECISION_TARGET,
    DISPATCHING,
    ENVELOPE_MOVES,
    LIFECYCLE,
    LIMITED,
    OUTCOMES,
    PARK_INSTEAD,
    SHELVE_TARGET,
    STOP_PARKS,
    Action,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    LifeAction,
    LifeRow,
    Outcome,
    OutcomeRow,
    QueueCall,
    QueueState,
)
from envq._stats import Counters, StopRun, report
from envq._timers import Deadlines, DelayHeap
from envq._values import (
    Attempt,
    Event,
    HookTimeout,
    Rejection,
    Schedule,
    Statistics,
    StopMode,
    StopReport,
)

__all__ = ["Queue", "current_attempt"]

log = logging.getLogger("envq")

_T = TypeVar("_T")
#: The running event loop of the calling thread, or None (asyncio's C accelerated
#: helper: the thread check on ``send``'s path costs one call).
_running_loop: Final = asyncio._get_running_loop

# Module constants for the hot path: in Python 3.11 reading an enum member off its
# class costs ~150 ns, a global ~20 ns.
_NEW: Final = EnvState.NEW
_READY: Final = EnvState.READY
_DELAYED: Final = EnvState.DELAYED
_RUNNING_E: Final = EnvState.RUNNING
_PARKED: Final = EnvState.PARKED
_BUFFERED: Final = EnvState.BUFFERED
_RETURNED: Final = EnvState.RETURNED
_FAILED: Final = EnvState.FAILED
_TERMINAL: Final = _machine.TERMINAL_STATES
_OK: Final = Outcome.OK
_CANCELLED: Final = Outcome.CANCELLED
_RUNNING_Q: Final = QueueState.RUNNING
_STOPPING_Q: Final = QueueState.STOPPING
_ADMIT: Final = LifeAction.ADMIT
_SEND: Final = QueueCall.SEND
_DISPATCH: Final = EnvEvent.DISPATCH
_DUE: Final = EnvEvent.DUE
_EV_SEND: Final = EnvEvent.SEND
_ONE_OFF: Final = Kind.ONE_OFF
_PERIODIC: Final = Kind.PERIODIC
_REQUEUED: Final = frozenset({_READY, _DELAYED})
_INF: Final = math.inf


# A module constant: on Python 3.11 every ``Schedule.X`` read is slow (~60 ns).
_FIXED_DELAY: Final = Schedule.FIXED_DELAY


#: Lifecycle actions whose row must leave the queue's state as it is.
_STAYS: Final = frozenset(
    {
        LifeAction.NOTHING,
        LifeAction.BUFFER,
        LifeAction.ADMIT,
        LifeAction.AWAIT_STOP,
        LifeAction.ESCALATE,
    }
)

Listener = Callable[[Event], object]
_Cause: TypeAlias = BaseException | None
#: A row of the outcome table resolved for one queue: ``(worker, env, rec, outcome,
#: cause)`` → the coroutine still to await (a hook), or None when the row is done.
_Perform: TypeAlias = Callable[[Worker, Envelope, _Rec, Outcome, _Cause], Awaitable[None] | None]
#: ``dead_letter(env, error)``: plain or ``async def``.
DeadLetter = Callable[[Envelope, BaseException | None], object]


class _Waiter:
    __slots__ = ("envs", "fut")

    def __init__(self, envs: tuple[Envelope, ...], fut: asyncio.Future[None]) -> None:
        self.envs = envs
        self.fut = fut


_TASKS: set[asyncio.Task[Any]] = set()

#: The envelope whose attempt the current task runs (or was spawned from).
_ATTEMPT: contextvars.ContextVar[Envelope | None] = contextvars.ContextVar(
    "envq_attempt", default=None
)


class Queue:
    """A named, bounded, asyncio-native worker pool that runs envelopes (contract §3).

    :param name: ``[a-zA-Z0-9:_]+``; used in messages, logs and metric labels.
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
    ) -> None:
        _checks.name("Queue: name", name)
        where = f"Queue {name!r}:"
        _checks.integer(f"{where} workers", workers, minimum=1)
        _checks.integer(f"{where} capacity", capacity, minimum=0)
        _checks.member(f"{where} stop_mode", stop_mode, StopMode)
        _checks.flag(f"{where} wait", wait)
        stamps = _checks.stamps(f"{where} stamps", stamps)
        for label, lim in (("rate", rate), ("limiter", limiter)):
            if lim is not None:
                _checks.limiter(f"{where} {label}", lim)
        if dead_letter is not None:
            _checks.callable_(f"{where} dead_letter", dead_letter)
        _checks.instance(f"{where} hook_timeout", hook_timeout, HookTimeout)
        if threads is not None:
            _checks.integer(f"{where} threads", threads, minimum=1)
        _checks.flag(f"{where} log_unhandled", log_unhandled)
        self.name: Final = name
        self.workers: Final = workers
        self.capacity: Final = capacity
        self.stop_mode: Final = stop_mode
        self.wait: Final = wait
        self.stamps: Final[tuple[Stamp, ...]] = stamps
        self.rate: Final = rate
        self.limiter: Final = limiter
        self.dead_letter: Final = dead_letter
        self._dead_async = dead_letter is not None and is_async_callable(dead_letter)
        self._empty_waiters: list[asyncio.Future[None]] = []
        self.hook_timeout: Final = hook_timeout
        self.log_unhandled: Final = log_unhandled
        #: Subscribed listeners that count as handling failures.
        self._handlers = 0
        #: The termination under way (or done), once it had to wait for a stop.
        self._closing: asyncio.Task[list[Envelope]] | None = None

        self._state = QueueState.INIT
        self._send_row = self._row_for_send(self._state)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: ``loop.time`` once the queue is bound to its loop.
        self._clock: Callable[[], float] = self._unbound_clock
        #: The live envelopes, in admission order (``capacity_used`` is its length).
        self._live: dict[Envelope, _Rec] = {}
        self._ready: deque[Envelope] = deque()
        #: Idle workers' wake-up futures (True: work is ready; False: exit).
        self._idle: deque[asyncio.Future[bool]] = deque()
        self._epoch = 0
        self._crew: list[Worker] = []
        self._listeners: list[Listener] = []
        self._observed = _machine.STRICT
        self._blacklist: set[str] = set()
        self._waiters: deque[_Waiter] = deque()
        self._run: StopRun | None = None
        self._last_report = StopReport()
        self._stopped_waiters: list[asyncio.Future[None]] = []
        #: (admission number, envelope) handed back by the terminate under way.
        self._handed: list[tuple[int, Envelope]] = []
        self._seq = 0
        self._counts = Counters()
        self._outcome_counts = self._counts.outcomes
        #: The outcome table as this queue performs it (see _resolve).
        self._plan: dict[Kind, dict[Outcome, _Perform]] = {kind: {} for kind in Kind}
        for (kind, outcome), row in OUTCOMES.items():
            self._plan[kind][outcome] = self._resolve(row)
        self._delays = DelayHeap(self, self._due)
        self._deadlines = Deadlines(self._expire)
        self._threads = Threads(threads or min(32, workers + 4), f"envq-{name}")
        self._runner = Runner(
            name, stamps, hook_timeout, self._threads, self._deadlines, self._abandon
        )
        #: What the last ``terminate()`` handed back (``async with`` terminates on exit).
        self.leftovers: list[Envelope] = []

    # ----------------------------------------------------------------------------------
    # Public API
    # ----------------------------------------------------------------------------------

    @property
    def state(self) -> QueueState:
        """The lifecycle state."""
        return self._state

    @property
    def capacity_used(self) -> int:
        """The number of envelopes in non-terminal states (buffered and parked included)."""
        return len(self._live)

    def __repr__(self) -> str:
        return f"<envq.Queue {self.name!r} {self._state.name} {len(self._live)} live>"

    def start(self) -> None:
        """Start (or restart) the queue; needs a running event loop.

        From INIT, buffered envelopes are armed; from STOPPED, parked ones are re-armed
        with the delay they had left. A no-op when RUNNING; raises
        :class:`envq.QueueStopping` / :class:`envq.QueueTerminated` when STOPPING /
        TERMINATED.
        """
        bound = self._loop
        current = _running_loop()
        if bound is not None and current is not bound:
            if bound.is_running():
                self._from_elsewhere(self.start)
                return
            row = LIFECYCLE[(self._state, QueueCall.START)]
            if row.action is LifeAction.REJECT:
                self._life(row, QueueCall.START)
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
        self._life(LIFECYCLE[(self._state, QueueCall.START)], QueueCall.START)

    def send(self, *envelopes: Envelope) -> None:
        """Admit envelopes; all or nothing; never blocks.

        Checks, in order: queue state, validation, type blacklist, dedup, capacity.
        An envelope already live in this queue is skipped (deduplicated).

        :raises QueueStopping: the queue is STOPPING.
        :raises QueueNotRunning: the queue is STOPPED.
        :raises QueueTerminated: the queue is TERMINATED.
        :raises BadEnvelope: not an envelope, or live in another queue.
        :raises TypeBlacklisted: its ``type`` was blacklisted by a ``StopType``.
        :raises CapacityExceeded: the batch does not fit, or producers are waiting in
            ``send_wait`` (send does not overtake them).
        """
        loop = self._loop
        if loop is not None and _running_loop() is not loop and loop.is_running():
            return self._from_elsewhere(self.send, *envelopes)
        row = self._send_row
        if row.action is _ADMIT:
            self._admit(envelopes, False)
        else:
            self._life(row, _SEND, envelopes)
        return None

    async def send_wait(
        self,
        *envelopes: Envelope,
        timeout: float | None = None,  # noqa: ASYNC109 - the contract's signature
    ) -> None:
        """Like :meth:`send`, but wait for room (first come, first served).

        Raises what ``send()`` would raise if the queue changes state while waiting
        (INIT → RUNNING keeps waiting).

        :raises CapacityExceeded: on ``timeout``, or at once for a batch larger than
            the capacity.
        """
        if timeout is not None:
            timeout = _checks.timeout(f"queue {self.name!r}: send_wait() timeout", timeout)
        self._own_loop("send_wait")
        batch = envelopes
        if not self._waiters and self._admit(batch, True):
            return
        distinct = {
            id(env) for env in batch if not (isinstance(env, Envelope) and env._rec.owner is self)
        }
        if self.capacity and len(distinct) > self.capacity:
            self._counts.rejections[Rejection.CAPACITY] += 1
            raise CapacityExceeded(
                f"queue {self.name!r}: a batch of {len(distinct)} envelopes can never fit "
                f"capacity {self.capacity}"
            )
        # Woken (first come, first served) when the batch fits or would be refused, the
        # producer admits it itself: a producer cancelled or timed out after being woken
        # has admitted nothing, and the next one is woken instead.
        loop = self._bound_loop()
        waiter = _Waiter(batch, loop.create_future())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await waiter.fut
                    if self._admit(batch, True):
                        return
                    waiter.fut = loop.create_future()
        except TimeoutError:
            self._counts.rejections[Rejection.CAPACITY] += 1
            raise CapacityExceeded(
                f"queue {self.name!r}: no room for {len(batch)} envelope(s) within "
                f"{timeout!r} s (capacity {self.capacity})"
            ) from None
        finally:
            self._waiters.remove(waiter)
            self._pump()

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
        row = LIFECYCLE[(self._state, QueueCall.STOP)]
        waiting = self._life(
            row, QueueCall.STOP, mode=mode, cause=CancelCause.STOP if cancel else None
        )
        if waiting is None:
            return self._last_report
        if self._inside() is not None or not (self.wait if wait is None else wait):
            return self._make_report()
        await asyncio.shield(waiting)
        return self._last_report

    async def wait_stopped(self) -> StopReport:
        """The final report once the queue is STOPPED (waits for the next stop to end).

        :raises RuntimeError: when called from inside one of the queue's attempts.
        """
        self._own_loop("wait_stopped")
        if self._inside() is not None:
            raise RuntimeError(f"queue {self.name!r}: wait_stopped() from inside the queue")
        if self._state in (QueueState.STOPPED, QueueState.TERMINATED):
            return self._last_report
        fut = self._bound_loop().create_future()
        self._stopped_waiters.append(fut)
        await asyncio.shield(fut)
        return self._last_report

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
        row = LIFECYCLE[(self._state, QueueCall.TERMINATE)]
        self._handed = []
        waiting = self._life(
            row, QueueCall.TERMINATE, mode=StopMode.STOP, cause=CancelCause.TERMINATE
        )
        if row.action is LifeAction.NOTHING:  # already terminated
            return []
        if waiting is None:
            return self._hand_over()
        closing = self._closing = self._bound_loop().create_task(
            self._terminating(waiting, row), name=f"envq:{self.name}:terminate"
        )
        _TASKS.add(closing)
        closing.add_done_callback(_TASKS.discard)
        return await asyncio.shield(closing)

    async def _terminating(self, waiting: asyncio.Future[None], row: LifeRow) -> list[Envelope]:
        """The rest of a termination that had a stop to wait for (``row``: the composite
        row it began with, whose target is where it must end)."""
        next_: asyncio.Future[None] | None = waiting
        while next_ is not None:
            await next_
            # Normally STOPPED → HAND_BACK; a start() that slipped in stops again.
            next_ = self._life(
                LIFECYCLE[(self._state, QueueCall.TERMINATE)],
                QueueCall.TERMINATE,
                mode=StopMode.STOP,
                cause=CancelCause.TERMINATE,
            )
        _check_arrives(row, self._state)
        return self._hand_over()

    def _hand_over(self) -> list[Envelope]:
        """The envelopes the termination handed back, in admission order."""
        assert self._state is QueueState.TERMINATED, self._state
        handed = sorted(self._handed, key=lambda pair: pair[0])
        self._handed = []
        self.leftovers = [env for _seq, env in handed]
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
            self._empty_waiters.append(fut)
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
        self._listeners.append(listener)
        self._observed = True
        if handles_failures:
            self._handlers += 1
        subscribed = True

        def unsubscribe() -> None:
            nonlocal subscribed
            if self._elsewhere():
                self._from_elsewhere(unsubscribe)
                return
            if subscribed:
                subscribed = False
                self._listeners.remove(listener)
                if handles_failures:
                    self._handlers -= 1
            self._observed = bool(self._listeners) or _machine.STRICT

        return unsubscribe

    def statistics(self) -> Statistics:
        """A frozen snapshot of the queue's state and counters."""
        if self._elsewhere():
            return self._from_elsewhere(self.statistics)
        return self._counts.snapshot(
            self._state,
            (rec.state for rec in self._live.values()),
            in_flight=sum(1 for w in self._crew if w.env is not None),
            capacity_limit=self.capacity,
            stuck_threads=self._threads.stuck,
        )

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
        if self._state is QueueState.TERMINATED:
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
            log.warning(
                "queue %r: %d envelope(s) left over at exit (see Queue.leftovers)",
                self.name,
                len(self.leftovers),
            )
        if interrupted:
            raise asyncio.CancelledError

    def __del__(self) -> None:
        live = getattr(self, "_live", None)
        if live:
            warnings.warn(
                f"envq.Queue {getattr(self, 'name', '?')!r} was garbage-collected holding "
                f"{len(live)} envelope(s) ({self._state.name}): terminate() it and keep what "
                "it hands back",
                ResourceWarning,
                source=self,
                stacklevel=1,
            )

    # ----------------------------------------------------------------------------------
    # The lifecycle interpreter
    # ----------------------------------------------------------------------------------

    def _life(
        self,
        row: LifeRow,
        call: QueueCall,
        batch: Sequence[Envelope] = (),
        *,
        mode: StopMode = StopMode.STOP,
        cause: CancelCause | None = None,
    ) -> asyncio.Future[None] | None:
        """Perform a lifecycle row; return the future to await, if the call waits."""
        _check_stays(row, self._state)
        match row.action:
            case LifeAction.BUFFER | LifeAction.ADMIT:
                self._admit(batch, False, row.action is LifeAction.BUFFER)
                return None
            case LifeAction.NOTHING:
                return None
            case LifeAction.REJECT:
                assert row.error is not None
                self._counts.rejections[Rejection.STATE] += 1
                about = ", ".join(
                    env.label() if isinstance(env, Envelope) else repr(env) for env in batch[:3]
                )
                raise row.error(
                    f"queue {self.name!r} is {self._state.name}: {call.value}() is not allowed"
                    + (f" ({about}{', …' if len(batch) > 3 else ''})" if batch else "")
                )
            case LifeAction.ARM:
                self._arm_all(row)
                return None
            case LifeAction.BEGIN_STOP:
                return self._begin_stop(row, mode, cause)
            case LifeAction.AWAIT_STOP:
                assert self._run is not None
                return self._run.done
            case LifeAction.FINISH_STOP:
                self._finish_stop(row)
                return None
            case LifeAction.STOP_THEN_TERMINATE:
                return self._begin_stop(LIFECYCLE[(self._state, QueueCall.STOP)], mode, cause)
            case LifeAction.ESCALATE_THEN_TERMINATE | LifeAction.ESCALATE:
                return self._escalate(cause)
            case LifeAction.HAND_BACK:
                self._hand_back(row)
                return None
            case _:
                assert_never(row.action)

    def _set_state(self, to: QueueState | None, *, pump: bool = True) -> None:
        """Enter queue state ``to``; then (unless told not to) admit waiting producers
        the new state lets in."""
        assert to is not None
        frm, self._state = self._state, to
        self._send_row = self._row_for_send(to)
        if frm is not to and self._listeners:
            self._emit(Event(self._now(), self.name, None, frm, to))
        if pump and self._waiters:
            self._pump()

    @staticmethod
    def _row_for_send(state: QueueState) -> LifeRow:
        """The SEND row of ``state``, cached by ``send()``'s fast path (which then skips
        ``_life``, so the strict self-loop check is made here)."""
        row = LIFECYCLE[(state, QueueCall.SEND)]
        _check_stays(row, state)
        return row

    def _arm_all(self, row: LifeRow) -> None:
        loop = self._bound_loop()
        self._epoch += 1
        self._run = None
        # Waiting producers are let in only once everything already admitted is armed:
        # their envelopes enter READY/DELAYED by admission, not by START, and queue up
        # behind the earlier ones.
        self._set_state(row.target, pump=False)
        self._crew = [Worker(self._epoch) for _ in range(self.workers)]
        for n, w in enumerate(self._crew):
            w.task = task = loop.create_task(self._work(w), name=f"envq:{self.name}:worker-{n}")
            # The loop holds tasks weakly: keep workers alive even if the queue is dropped.
            _TASKS.add(task)
            task.add_done_callback(_TASKS.discard)
        for env, rec in list(self._live.items()):
            if rec.state is EnvState.BUFFERED:
                delay = self._first_delay(env)
            elif env._calendar:
                # Fires missed while the queue was stopped are skipped.
                delay = self._calendar_delay(env, 0.0)
            else:
                delay = rec.due
            self._enter(env, rec, EnvEvent.START, ARMED[delay > 0], delay)
        if self._waiters:
            self._pump()

    def _begin_stop(
        self, row: LifeRow, mode: StopMode, cause: CancelCause | None
    ) -> asyncio.Future[None]:
        run = self._run = StopRun(self._bound_loop().create_future())
        run.spared = self._inside()
        self._set_state(row.target)
        self._park(mode)
        self._cancel_in_flight(cause)
        self._check_drained()
        return run.done

    def _escalate(self, cause: CancelCause | None) -> asyncio.Future[None]:
        run = self._run
        assert run is not None
        self._park(StopMode.STOP)
        run.spared = None  # terminate spares nobody
        self._cancel_in_flight(cause)
        self._check_drained()
        return run.done

    def _park(self, mode: StopMode) -> None:
        """Park delayed envelopes, and ready ones too in STOP mode (admission order)."""
        parkable = STOP_PARKS[mode]
        if _READY in parkable:
            self._ready.clear()
        now = self._bound_loop().time()
        for env, rec in self._live.items():
            if rec.state in parkable:
                rec.tick = 0
                remaining = max(0.0, rec.due - now) if rec.state is EnvState.DELAYED else 0.0
                self._move(env, rec, EnvEvent.STOP, EnvState.PARKED)
                rec.due = remaining
        # Both modes park every DELAYED envelope: no entry of the delay heap is live.
        self._delays.clear()

    def _cancel_in_flight(self, cause: CancelCause | None) -> None:
        if cause is None:
            return
        spared = self._run.spared if self._run is not None else None
        for w in self._crew:
            if w.env is not None and w.cancellable and w is not spared and w.task is not None:
                if w.cancel_cause is None:
                    w.task.cancel()
                    w.owed = 1
                w.cancel_cause = cause

    def _check_drained(self) -> None:
        if self._ready or self._state is not _STOPPING_Q:
            return
        for w in self._crew:
            if w.env is not None:
                return
        self._life(LIFECYCLE[(self._state, QueueCall.DRAINED)], QueueCall.DRAINED)

    def _finish_stop(self, row: LifeRow) -> None:
        self._set_state(row.target)
        self._deadlines.disarm()  # no worker holds an envelope: no limit is running
        self._last_report = self._make_report()
        run = self._run
        self._run = None
        idle = self._idle
        while idle:
            fut = idle.popleft()
            if not fut.done():
                fut.set_result(False)
        if run is not None and not run.done.done():
            run.done.set_result(None)
        self._wake_stopped()

    def _hand_back(self, row: LifeRow) -> None:
        # State first: waiting producers must see TERMINATED, not the room handing
        # back frees.
        self._set_state(row.target)
        for env, rec in list(self._live.items()):
            self._enter(env, rec, EnvEvent.TERMINATE, EnvState.RETURNED)
        self._threads.shutdown()
        self._deadlines.disarm()
        self._wake_stopped()

    def _wake_empty(self) -> None:
        waiters, self._empty_waiters = self._empty_waiters, []
        _release(waiters)

    def _to_dead_letter(self, env: Envelope, error: BaseException | None) -> None:
        dead_letter = self.dead_letter
        assert dead_letter is not None
        if self._dead_async:
            task = self._bound_loop().create_task(self._dead_letter_async(dead_letter, env, error))
            _TASKS.add(task)
            task.add_done_callback(_TASKS.discard)
            return
        try:
            dead_letter(env, error)
        except BaseException:
            log.exception("queue %r: dead_letter failed for %s", self.name, env.label())

    async def _dead_letter_async(
        self, dead_letter: DeadLetter, env: Envelope, error: BaseException | None
    ) -> None:
        try:
            await cast("Coroutine[Any, Any, object]", dead_letter(env, error))
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException:
            log.exception("queue %r: dead_letter failed for %s", self.name, env.label())

    def _wake_stopped(self) -> None:
        waiters, self._stopped_waiters = self._stopped_waiters, []
        _release(waiters)

    def _make_report(self) -> StopReport:
        return report(
            self._run,
            (env for env, rec in self._live.items() if rec.state is _PARKED),
            self._state in (QueueState.STOPPED, QueueState.TERMINATED),
        )

    # ----------------------------------------------------------------------------------
    # Admission
    # ----------------------------------------------------------------------------------

    def _admit(self, items: Sequence[Envelope], waiting: bool, buffer: bool = False) -> bool:
        """Run send's checks and admit the batch (into the pre-start buffer when
        ``buffer``); False if a waiter must keep waiting."""
        if waiting:
            row = LIFECYCLE[(self._state, QueueCall.SEND)]
            if row.action is LifeAction.REJECT:
                self._life(row, QueueCall.SEND, items)
            buffer = row.action is LifeAction.BUFFER
        dedups = 0
        blacklist = self._blacklist
        for env in items:
            # One pass for the common case; anything wrong → the ordered checks.
            if env.__class__ is not Envelope and not isinstance(env, Envelope):
                self._refuse(items)
            if blacklist and env.type in blacklist:
                self._refuse(items)
            owner = env._rec.owner
            if owner is not None:
                if owner is not self:
                    self._refuse(items)
                dedups += 1
        # Usually every envelope is new and the batch is admitted as it came.
        fresh = items
        if dedups:
            fresh = [env for env in fresh if env._rec.owner is None]
        # A batch may name an envelope twice: the second is a dedup, found below as
        # already owned (cheaper than making the batch unique up front).
        if fresh and self.capacity:
            count = len(fresh)
            if count > 1 and len(self._live) + count > self.capacity:
                count = len(set(fresh))
            over = len(self._live) + count > self.capacity
            if waiting:
                if over:
                    return False
            elif over or self._waiters:
                why = "producers are waiting in send_wait" if not over else "no room"
                self._reject(
                    Rejection.CAPACITY,
                    CapacityExceeded,
                    f"{why} for {count} envelope(s): {len(self._live)} of "
                    f"{self.capacity} used ({fresh[0].label()})",
                )
        live = self._live
        seq = self._seq
        enter = self._enter
        for env in fresh:
            # The envelope's own record, reset for this stay (no allocation per send).
            rec = env._rec
            if rec.owner is self:  # named twice in this batch
                dedups += 1
                continue
            seq += 1
            rec.state = _NEW
            rec.kind = _PERIODIC if env.periodic else _ONE_OFF
            rec.seq = seq
            rec.attempts = 0
            rec.failures = 0
            rec.owner = self
            live[env] = rec
            if buffer:
                enter(env, rec, _EV_SEND, _BUFFERED)
            else:
                delay = self._first_delay(env) if env._timed else env.delay
                enter(env, rec, _EV_SEND, ARMED[delay > 0], delay)
        self._seq = seq
        if dedups:
            self._counts.dedups += dedups
        return True

    def _refuse(self, items: Sequence[object]) -> NoReturn:
        """Raise the error of the earliest failing check over the whole batch:
        validation, then the blacklist, then dedup / another queue."""
        for item in items:
            if not isinstance(item, Envelope):
                self._reject(Rejection.INVALID, BadEnvelope, f"not an Envelope: {item!r}")
        batch = cast("Sequence[Envelope]", items)
        for env in batch:
            if env.type in self._blacklist:
                self._reject(
                    Rejection.BLACKLISTED,
                    TypeBlacklisted,
                    f"type {env.type!r} is blacklisted ({env.label()})",
                )
        for env in batch:
            owner = env._rec.owner
            if owner is not None and owner is not self:
                self._reject(
                    Rejection.FOREIGN, BadEnvelope, f"{env.label()} is live in queue {owner.name!r}"
                )
        raise AssertionError("_refuse called on a valid batch")

    def _reject(self, reason: Rejection, error: type[EnvqError], message: str) -> NoReturn:
        self._counts.rejections[reason] += 1
        raise error(f"queue {self.name!r}: {message}")

    def _first_delay(self, env: Envelope) -> float:
        delay = env.delay
        if env.not_before is not None:
            wall = getattr(self._bound_loop(), "wall_time", None)
            now = wall() if callable(wall) else _wall_now()
            delay = max(delay, env.not_before.timestamp() - now)
        if env._calendar:
            delay = self._calendar_delay(env, delay)
        return delay

    def _calendar_delay(self, env: Envelope, delay: float) -> float:
        """Seconds from now to the first run of a calendar schedule armed to run
        ``delay`` seconds from now on."""
        now = self._clock()
        return env.schedule.first_run(now + max(0.0, delay), self._wall_offset()) - now

    def _wall_offset(self) -> float:
        """The wall clock minus the loop time: the loop's ``wall_time()`` if it has
        one (the virtual-time loop), else ``time.time()``."""
        loop = self._bound_loop()
        wall = getattr(loop, "wall_time", None)
        return (wall() if callable(wall) else _wall_now()) - loop.time()

    def _pump(self) -> None:
        """Wake the first waiting producer once its batch fits, or would be refused."""
        waiters = self._waiters
        if waiters:
            head = waiters[0]
            if not head.fut.done() and self._may_admit(head.envs):
                head.fut.set_result(None)

    def _may_admit(self, items: Sequence[Envelope]) -> bool:
        """Whether admitting ``items`` now would not wait for room: it fits, or one of
        send's checks refuses it."""
        capacity = self.capacity
        if not capacity or self._send_row.action is LifeAction.REJECT:
            return True
        blacklist = self._blacklist
        fresh: set[Envelope] = set()
        for env in items:
            if not isinstance(env, Envelope) or (blacklist and env.type in blacklist):
                return True
            owner = env._rec.owner
            if owner is None:
                fresh.add(env)
            elif owner is not self:
                return True
        return len(self._live) + len(fresh) <= capacity

    # ----------------------------------------------------------------------------------
    # Envelope moves
    # ----------------------------------------------------------------------------------

    def _move(
        self,
        env: Envelope,
        rec: _Rec,
        event: EnvEvent | Outcome,
        to: EnvState,
        cause: BaseException | None = None,
    ) -> None:
        frm = rec.state
        rec.state = to
        if self._observed:
            self._observe(env, frm, event, to, cause)

    def _observe(
        self,
        env: Envelope,
        frm: EnvState,
        event: EnvEvent | Outcome,
        to: EnvState,
        cause: BaseException | None,
    ) -> None:
        if _machine.STRICT:
            assert to in ENVELOPE_MOVES.get((frm, event), ()), (
                f"illegal envelope move {frm.name} --{event.name}--> {to.name}"
            )
        if self._listeners:
            outcome = event if isinstance(event, Outcome) else None
            self._emit(Event(self._now(), self.name, env, frm, to, outcome, cause))

    def _enter(
        self,
        env: Envelope,
        rec: _Rec,
        event: EnvEvent | Outcome,
        to: EnvState,
        delay: float = 0.0,
        cause: BaseException | None = None,
        at: float | None = None,
    ) -> None:
        """Move ``env`` into state ``to`` and do that state's entry work (DELAYED: due
        ``delay`` seconds from now, or at loop time ``at`` when given).

        (An identity chain rather than ``match``: on Python 3.11 each ``case
        EnvState.X`` reads the member off the enum class, which is slow on this path.)
        """
        frm = rec.state
        rec.state = to
        if self._observed:
            self._observe(env, frm, event, to, cause)
        if to is _READY:
            # The FIXED_RATE grid needs a periodic run's scheduled start: the time it
            # became READY, or (coming from DELAYED) the time it was due, kept in due.
            if rec.kind is _PERIODIC and event is not _DUE:
                rec.due = rec.origin = self._clock()
            self._ready.append(env)
            idle = self._idle
            while idle:
                fut = idle.popleft()
                if not fut.done():
                    fut.set_result(True)
                    break
        elif to is _DELAYED:
            if at is None:
                due = rec.due = rec.origin = self._clock() + delay
            else:
                due = rec.due = at
            self._delays.push(env, rec, due)
        elif to in _TERMINAL:
            del self._live[env]
            rec.owner = None
            self._counts.terminal[to] += 1
            if rec.tick:
                self._delays.drop(rec)
            if self.limiter is not None:
                self._limiter_forget(env)
            if to is _RETURNED:
                self._handed.append((rec.seq, env))
            elif to is _FAILED:
                if self.dead_letter is not None:
                    self._to_dead_letter(env, cause)
                elif self.log_unhandled and env.on_failure is None and not self._handlers:
                    log.warning(
                        "queue %r: %s failed and nothing handles it (no on_failure, "
                        "dead_letter or listener): %r",
                        self.name,
                        env.label(),
                        cause,
                        exc_info=cause,
                    )
            if self._empty_waiters and not self._live:
                self._wake_empty()
            if self._waiters:
                self._pump()
        elif to is _PARKED or to is _BUFFERED:
            rec.due = max(0.0, delay)
        else:
            raise AssertionError(f"{to.name} is not entered through _enter")

    def _due(self, env: Envelope, rec: _Rec) -> None:
        """The delay heap's call: ``env``'s time has come."""
        self._enter(env, rec, _DUE, _READY)

    def _ask_limiter(self, limiter: RateLimiter, env: Envelope, role: str) -> float:
        """``limiter.when(env)`` as seconds to wait; a limiter that raises or answers
        with something other than a finite number >= 0 is logged and means 0."""
        try:
            wait = limiter.when(env)
            if wait.__class__ is float or wait.__class__ is int:
                if 0 <= wait < math.inf:
                    return wait
            elif isinstance(wait, int | float) and not isinstance(wait, bool):
                wait = float(wait)
                if 0 <= wait < math.inf:
                    return wait
            log.error(
                "queue %r: %s limiter %r answered %r for %s, not a number of seconds (0 used)",
                self.name,
                role,
                limiter,
                wait,
                env.label(),
            )
        except BaseException:
            log.exception(
                "queue %r: %s limiter %r failed for %s (0 used)",
                self.name,
                role,
                limiter,
                env.label(),
            )
        return 0.0

    def _limiter_forget(self, env: Envelope) -> None:
        """``limiter.forget(env)``; a limiter that raises is logged."""
        assert self.limiter is not None
        try:
            self.limiter.forget(env)
        except BaseException:
            log.exception(
                "queue %r: limiter %r failed to forget %s", self.name, self.limiter, env.label()
            )

    def _requeue(
        self,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        to: EnvState,
        delay: float,
        cause: BaseException | None,
        at: float | None = None,
    ) -> None:
        """Put ``env`` back (READY/DELAYED), or park it while the queue is not RUNNING.

        ``at``: the loop time ``delay`` stands for, when it is a grid point. A failure
        retry waits at least ``limiter.when(env)``; a READY retry that must wait
        becomes DELAYED (``LIMITED``).
        """
        if self.limiter is not None and outcome is not _OK and to in _REQUEUED:
            wait = self._ask_limiter(self.limiter, env, "retry")
            if wait > delay:
                delay, at = wait, None
            if delay > 0:
                to = LIMITED.get(to, to)
        if self._state is not _RUNNING_Q:
            to = PARK_INSTEAD.get(to, to)
        self._enter(env, rec, outcome, to, delay, cause, at)

    # ----------------------------------------------------------------------------------
    # Workers and attempts
    # ----------------------------------------------------------------------------------

    async def _work(self, w: Worker) -> None:
        try:
            await self._serve(w)
        except asyncio.CancelledError:
            # Cancelled while idle or waiting for the rate limit (a cancel that reaches
            # an attempt or a hook is absorbed there and ends up here as well).
            self._abandon(w)
            raise

    async def _serve(self, w: Worker) -> None:
        ready = self._ready
        idle = self._idle
        live = self._live
        loop = self._bound_loop()
        rate = self.rate
        runner = self._runner
        call = self._threads.call
        plan = self._plan
        outcome_counts = self._outcome_counts
        deadlines = self._deadlines
        clock = loop.time
        bare_queue = not self.stamps
        paid = False
        while True:
            if not ready:
                # Ready work only exists while dispatching, so the lifecycle is checked
                # here, before idling, not on every envelope.
                if w.epoch != self._epoch or self._state not in DISPATCHING:
                    return
                if self._deadlines.armed:
                    self._disarm_deadlines()
                fut: asyncio.Future[bool] = loop.create_future()
                idle.append(fut)
                if not await fut:
                    return
                continue
            if rate is not None and not paid:
                wait = self._ask_limiter(rate, ready[0], "rate")
                if wait > 0:
                    paid = True
                    await asyncio.sleep(wait)
                    if w.epoch != self._epoch:
                        return
                    continue
            paid = False
            cause: BaseException | None
            env = ready.popleft()
            rec = env._rec
            w.env = env
            rec.attempts += 1
            rec.state = _RUNNING_E
            _ATTEMPT.set(env)
            if self._observed:
                self._observe(env, _READY, _DISPATCH, _RUNNING_E, None)
            try:
                if env._lean and bare_queue:
                    # The attempt of an envelope with no hooks or stamps (the runner's
                    # attempt without its hook steps, inline: it runs for every one).
                    deadline = env.deadline
                    if deadline:
                        at = w.deadline_at = w.expiry = clock() + deadline
                        if at < deadlines.armed_at:
                            deadlines.arm(at)
                    w.cancellable = True
                    try:
                        if env._async:
                            await env.invoke(env)  # type: ignore[misc]
                        else:
                            await call(env.invoke, env)
                    except BaseException as exc:
                        outcome, cause = runner.failed(w, env, exc)
                    else:
                        if w.fired is None:
                            outcome, cause = _OK, None
                            if deadline:
                                w.expiry = _INF
                        else:
                            outcome, cause = runner.swallowed(w, env)
                    w.cancellable = False
                else:
                    outcome, cause = await runner.attempt(w, env)
                # Settle the attempt: count it, note it for a stop under way, and
                # perform its row of the outcome table.
                outcome_counts[outcome] += 1
                run = self._run
                if run is not None:
                    (run.cancelled if outcome is _CANCELLED else run.completed).append(env)
                pending = plan[rec.kind][outcome](w, env, rec, outcome, cause)
                if pending is not None:
                    await pending
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except BaseException as exc:  # the queue's own failure: log, end the envelope
                log.exception("queue %r: internal error handling %s", self.name, env.label())
                if live.get(env) is rec and rec.state is _RUNNING_E:
                    self._enter(env, rec, Outcome.ERROR, EnvState.FAILED, cause=exc)
            finally:
                w.env = None
                w.cancellable = False
                w.cancel_cause = None
                w.deadline_at = None
                if w.owed:  # user code swallowed envq's cancel: settle the task's count
                    runner.absorb_cancel(w)
            if self._run is not None and not ready:
                self._check_drained()
            if w.abandoned:
                raise asyncio.CancelledError

    def _expire(self, limit: float) -> float:
        """The deadline timer: cancel every worker whose limit is ``<= limit``; the
        earliest limit still running (inf for none)."""
        following = math.inf
        for w in self._crew:
            at = w.expiry
            if at <= limit:
                w.expiry = math.inf
                w.fired = at
                if w.task is not None:
                    w.owed += 1
                    w.task.cancel()
            elif at < following:
                following = at
        return following

    def _disarm_deadlines(self) -> None:
        """A worker goes idle: once no worker has a limit running, the deadline timer
        is disarmed (a timer left armed would move a virtual clock for nothing)."""
        for w in self._crew:
            if w.expiry < math.inf:
                return
        self._deadlines.disarm()

    def _abandon(self, w: Worker) -> None:
        """The worker's task was cancelled by someone other than envq (typically the
        event loop closing): the queue stops at once, cancelling and parking
        everything (the ABANDON row), and the worker exits once its envelope is
        settled. The attempt in flight, if any, counts as cancelled by that stop."""
        if w.abandoned:
            return
        w.abandoned = True
        if w.cancel_cause is None:
            w.cancel_cause = CancelCause.STOP
        if w.epoch != self._epoch:
            return  # a worker of an earlier run, on its way out
        self._life(
            LIFECYCLE[(self._state, QueueCall.ABANDON)],
            QueueCall.ABANDON,
            mode=StopMode.STOP,
            cause=CancelCause.STOP,
        )

    def _next_run(self, env: Envelope, rec: _Rec) -> tuple[float, float | None]:
        """Seconds from now to the envelope's next periodic run, and the loop time
        it is due at (so that the time spent rescheduling is not added to a grid run
        after run); the envelope's schedule decides."""
        schedule = env.schedule
        if schedule is _FIXED_DELAY:
            return env.interval, None
        now = self._clock()
        # Only a calendar reads the wall clock.
        offset = self._wall_offset() if env._calendar else 0.0
        at = schedule.next_run(env.interval, rec.origin, rec.due, now, offset)
        return at - now, at

    # ----------------------------------------------------------------------------------
    # The outcome interpreter
    # ----------------------------------------------------------------------------------

    def _resolve(self, row: OutcomeRow) -> _Perform:
        """A row of the outcome table as this queue performs it: the row's action with
        its target bound (one exhaustive ``match``, run once per row when the queue is
        made; the worker calls the result for every attempt)."""
        target = row.target
        enter = self._enter
        match row.action:
            case Action.SUCCEED:

                def succeed(
                    w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, cause: _Cause
                ) -> Awaitable[None] | None:
                    if env.on_success is not None:
                        return self._succeed(w, env, rec, outcome, target)
                    enter(env, rec, outcome, target)
                    return None

                return succeed
            case Action.RESCHEDULE:

                def reschedule(
                    w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, cause: _Cause
                ) -> Awaitable[None] | None:
                    if env.on_success is not None:
                        return self._reschedule(w, env, rec, outcome, target)
                    self._rescheduled(env, rec, outcome, target)
                    return None

                return reschedule
            case Action.DECIDE:
                return lambda w, env, rec, outcome, cause: self._decide(
                    w, env, rec, outcome, target, cause
                )
            case Action.DECIDE_PERIODIC:
                return lambda w, env, rec, outcome, cause: self._decide_periodic(
                    w, env, rec, outcome, target, cause
                )
            case Action.REPORT_FAILURE:
                return lambda w, env, rec, outcome, cause: self._report_failure(
                    w, env, rec, outcome, target, cause
                )
            case Action.END:

                def end(
                    w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, cause: _Cause
                ) -> None:
                    enter(env, rec, outcome, target, cause=cause)

                return end
            case Action.BLACKLIST:

                def blacklist(
                    w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, cause: _Cause
                ) -> None:
                    self._blacklist_type(env)
                    enter(env, rec, outcome, target, cause=cause)

                return blacklist
            case Action.SHELVE:

                def shelve(
                    w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, cause: _Cause
                ) -> None:
                    assert w.cancel_cause is not None
                    enter(env, rec, outcome, SHELVE_TARGET[w.cancel_cause], cause=cause)

                return shelve
            case _:
                assert_never(row.action)

    async def _succeed(
        self, w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, target: EnvState
    ) -> None:
        await self._runner.on_success(w, env)
        self._enter(env, rec, outcome, target)

    async def _reschedule(
        self, w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, target: EnvState
    ) -> None:
        await self._runner.on_success(w, env)
        self._rescheduled(env, rec, outcome, target)

    def _rescheduled(self, env: Envelope, rec: _Rec, outcome: Outcome, target: EnvState) -> None:
        rec.failures = 0
        if self.limiter is not None:
            self._limiter_forget(env)
        delay, at = self._next_run(env, rec)
        self._requeue(env, rec, outcome, target, delay, None, at)

    async def _decide_periodic(
        self,
        w: Worker,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        target: EnvState,
        cause: BaseException | None,
    ) -> None:
        """Periodic failure: on_failure's decision if set, else the next interval."""
        rec.failures += 1
        at: float | None = None
        if env.on_failure is None:
            to = target
            delay, at = self._next_run(env, rec)
        else:
            decision = await self._runner.on_failure(w, env, cause, rec.failures)
            to, delay = DECISION_TARGET[decision.kind], decision.delay
        self._requeue(env, rec, outcome, to, delay, cause, at)

    async def _report_failure(
        self,
        w: Worker,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        target: EnvState,
        cause: BaseException | None,
    ) -> None:
        if env.on_failure is not None:
            await self._runner.on_failure(w, env, cause, self._attempt_no(rec))
        self._enter(env, rec, outcome, target, cause=cause)

    @staticmethod
    def _attempt_no(rec: _Rec) -> int:
        return rec.failures + 1 if rec.kind is _PERIODIC else rec.attempts

    async def _decide(
        self,
        w: Worker,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        target: EnvState,
        cause: BaseException | None,
    ) -> None:
        """One-off failure: on_failure's decision, else the Retry policy, else drop."""
        attempt = rec.attempts
        to, delay = target, 0.0
        if env.on_failure is not None:
            decision = await self._runner.on_failure(w, env, cause, attempt)
            to, delay = DECISION_TARGET[decision.kind], decision.delay
        elif env.retry is not None:
            retry = env.retry
            if retry.allows(attempt):
                to, delay = DECISION_TARGET[DecisionKind.RETRY_AFTER], retry.delay(attempt)
            else:
                exhausted = MaxRetriesExceeded(
                    f"queue {self.name!r}: {env.label()} failed {attempt} of "
                    f"{retry.attempts} attempts"
                )
                exhausted.__cause__ = cause
                cause = exhausted
        self._requeue(env, rec, outcome, to, delay, cause)

    def _blacklist_type(self, culprit: Envelope) -> None:
        kind = culprit.type
        self._blacklist.add(kind)
        victims = [
            (env, rec) for env, rec in self._live.items() if env.type == kind and env is not culprit
        ]
        if any(rec.state is _READY for _env, rec in victims):
            kept = [env for env in self._ready if env.type != kind]
            self._ready.clear()
            self._ready.extend(kept)
        for env, rec in victims:
            if rec.state is _RUNNING_E:
                rec.kind = Kind.BLACKLISTED
            else:
                self._enter(env, rec, EnvEvent.BLACKLIST, EnvState.STOPPED)

    # ----------------------------------------------------------------------------------
    # Helpers
    # ----------------------------------------------------------------------------------

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        """The queue's loop; the running one becomes it on first use."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._clock = loop.time
            self._delays.bind(loop)
            self._deadlines.bind(loop)
            self._runner.bind(loop)
        return loop

    def _unbound_clock(self) -> float:
        return self._bound_loop().time()

    def _own_loop(self, method: str) -> None:
        """Coroutine methods run on the queue's loop only (or, once that loop is
        closed, anywhere: nothing else can touch the queue then, and ``terminate()``
        can still hand back what it holds)."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and asyncio.get_running_loop() is not loop:
            raise RuntimeError(
                f"queue {self.name!r} belongs to another event loop: await {method}() on "
                f"that loop, e.g. asyncio.run_coroutine_threadsafe(queue.{method}(...), "
                "queue.loop) from another thread"
            )

    def _elsewhere(self) -> bool:
        """Whether the caller runs outside the queue's loop while that loop runs (in
        another thread): a synchronous method must then hand itself to the loop."""
        loop = self._loop
        return loop is not None and _running_loop() is not loop and loop.is_running()

    def _from_elsewhere(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run a synchronous method on the queue's loop for a caller in another thread
        (or on another loop), and return its result or raise its error there.

        The caller blocks until the loop has run it. Should the loop stop running
        before it gets to the call, the call runs in place: a loop that is not running
        lets nobody else touch the queue."""
        loop = self._loop
        assert loop is not None
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def call() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args, **kwargs))
                except BaseException as exc:
                    done.set_exception(exc)

        try:
            loop.call_soon_threadsafe(call)
        except RuntimeError:  # closed meanwhile
            return fn(*args, **kwargs)
        while not concurrent.futures.wait([done], timeout=0.05).done:
            if not loop.is_running() and done.cancel():
                return fn(*args, **kwargs)
        return done.result()

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
        env = _ATTEMPT.get()
        owner: object = env._rec.owner if env is not None else None
        if owner is not self:
            return None
        for w in self._crew:
            if w.env is env:
                return w
        return None

    def _emit(self, event: Event) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except BaseException:
                log.exception("queue %r: event listener %r failed", self.name, listener)


def current_attempt() -> Attempt | None:
    """The attempt the calling code runs in — from ``invoke``, a hook, a stamp, or a
    task spawned by one of them — or None outside any attempt or once it has ended."""
    env = _ATTEMPT.get()
    owner: object = env._rec.owner if env is not None else None
    if env is None or not isinstance(owner, Queue):
        return None
    for w in owner._crew:
        if w.env is env:
            return Attempt(owner, env, env._rec.attempts, w.deadline_at)
    return None


def _check_stays(row: LifeRow, state: QueueState) -> None:
    """Under STRICT: a row whose action keeps the state must name it as its target."""
    if _machine.STRICT and row.action in _STAYS:
        assert row.target is state, f"{row} must leave the state unchanged"


def _check_arrives(row: LifeRow, state: QueueState) -> None:
    """Under STRICT: a composite row (a stop, then a terminate) must end in its target,
    though the rows it runs through are the ones that move the state."""
    if _machine.STRICT:
        assert row.target is state, f"{row} ended in {state.name}"


def _release(futures: Iterable[asyncio.Future[None]]) -> None:
    """Resolve every future not already done (cancelled waiters are skipped)."""
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


def _wall_now() -> float:
    return time.time()
