"""A queue's workers: a fixed crew of tasks, each running the dispatch loop.

A worker takes the next READY envelope (paying the dispatch rate limit first), moves it
to RUNNING by the DISPATCH row (resolved once per queue), runs its attempt — inline for
an envelope with no hooks or stamps, else through the attempt runner — and performs the
row of the outcome table for its (kind, outcome). The queue's one deadline timer calls
:meth:`Crew.expire` to cancel the workers whose time limit has passed. A worker task
cancelled by someone other than envq abandons the queue (its ABANDON row).

The crew reads the queue it serves through :class:`Host` (the queue's lifecycle state,
the stop under way, whether moves are observed) and moves envelopes only through the
host's entry routines.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from typing import Final, Protocol

from envq._attempt import Runner, Threads, Worker, expire_limits
from envq._config import QueueConfig
from envq._entry import keep_alive
from envq._envelope import Enter, Envelope
from envq._limits import ask_limiter
from envq._listeners import Listeners
from envq._machine import (
    DISPATCHING,
    FAULT_TARGET,
    QUEUE_MOVES,
    CancelCause,
    EnvEvent,
    EnvState,
    Outcome,
)
from envq._outcomes import Settler
from envq._stats import Counters, Status
from envq._store import MemoryStore
from envq._timers import Clock, Deadlines

__all__ = ["ATTEMPT", "Crew", "Host"]

log = logging.getLogger("envq")

_READY: Final = EnvState.READY
_RUNNING_E: Final = EnvState.RUNNING
_DISPATCH: Final = EnvEvent.DISPATCH
_OK: Final = Outcome.OK
_CANCELLED: Final = Outcome.CANCELLED
_INF: Final = math.inf


#: The envelope whose attempt the current task runs (or was spawned from).
ATTEMPT: contextvars.ContextVar[Envelope | None] = contextvars.ContextVar(
    "envq_attempt", default=None
)
_ATTEMPT: Final = ATTEMPT
#: The attempt a node of a shared queue runs in the current task: its queue, envelope,
#: number and worker (set by ``envq.postgres``'s nodes; read by ``current_attempt``).
HOSTED: contextvars.ContextVar[tuple[object, Envelope, int, Worker] | None] = (
    contextvars.ContextVar("envq_hosted_attempt", default=None)
)


class Host(Protocol):
    """The queue's entry routines the crew moves envelopes with."""

    @property
    def observed(self) -> bool: ...

    def observe(
        self,
        env: Envelope,
        frm: EnvState,
        event: EnvEvent | Outcome,
        to: EnvState,
        cause: BaseException | None,
    ) -> None: ...

    @property
    def enter(self) -> Enter: ...


class Life(Protocol):
    """The lifecycle rows the crew asks for."""

    def check_drained(self) -> None: ...

    def abandoned(self) -> None: ...


class Crew:
    """The workers of one queue.

    The crew makes what runs and settles its attempts: the deadline timer, the
    attempt runner (each calls back into the crew: a limit passed, a worker cancelled
    by someone else) and the outcome interpreter, whose resolved table it performs.

    :param config: the queue's settings (its name, workers, dispatch rate, stamps, hook
        budgets, failure limiter, whether unhandled failures are logged).
    :param host: the queue's entry routines.
    :param life: the lifecycle that made the crew (the rows the workers ask for: the
        stop drained, the queue abandoned).
    :param status: the queue's lifecycle state (whether the workers dispatch, the stop
        under way).
    :param store: the holding side (its ready deque, live envelopes and idle workers'
        futures, lent); ``counts``: the queue's counters; ``threads``: its pool for
        plain callables; ``clock``: its loop, once known; ``listeners``: its
        listeners; ``blacklist``: its blacklisted types.
    """

    def __init__(
        self,
        config: QueueConfig,
        host: Host,
        life: Life,
        *,
        status: Status,
        store: MemoryStore,
        counts: Counters,
        threads: Threads,
        clock: Clock,
        listeners: Listeners,
        blacklist: set[str],
    ) -> None:
        name = self._name = config.name
        self._host = host
        self._life = life
        self._status = status
        self._size = config.workers
        self._ready = store.ready
        self._live = store.live
        self._outcome_counts = counts.outcomes
        self._call = threads.call
        self._rate = config.rate
        self._bare = not config.stamps
        self._dispatch_to = QUEUE_MOVES[(_READY, _DISPATCH)].targets[None]
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The deadline timer: the time limits of what the workers run.
        self.deadlines = Deadlines(clock, self.expire)
        #: Runs each attempt with its hooks, stamps and time limits.
        self.runner = Runner(
            name, config.stamps, config.hook_timeout, threads, clock, self.deadlines, self.abandon
        )
        #: Performs the outcome row of each attempt's end.
        self.settler = Settler(
            name,
            limiter=config.limiter,
            runner=self.runner,
            enter=host.enter,
            status=status,
            live=store.live,
            ready=store.ready,
            blacklist=blacklist,
            listeners=listeners,
            log_unhandled=config.log_unhandled,
            clock=clock,
        )
        self._plan = self.settler.plan
        #: The workers of the current run (start).
        self.workers: list[Worker] = []
        #: Idle workers' wake-up futures (True: work is ready; False: exit).
        self.idle = store.idle
        #: The run (start) of the queue the current workers belong to.
        self.epoch = 0

    def spawn(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin a new run: a fresh set of workers on ``loop`` (workers of an earlier
        run retire once they see the new epoch)."""
        self._loop = loop
        self.epoch += 1
        self.workers = [Worker(self.epoch) for _ in range(self._size)]
        for n, w in enumerate(self.workers):
            w.task = task = loop.create_task(self.work(w), name=f"envq:{self._name}:worker-{n}")
            # Keep workers alive even if the queue is dropped.
            keep_alive(task)

    def wake_one(self) -> None:
        """Work became READY: wake one idle worker."""
        idle = self.idle
        while idle:
            fut = idle.popleft()
            if not fut.done():
                fut.set_result(True)
                break

    def retire_idle(self) -> None:
        """The run ended: every idle worker exits."""
        idle = self.idle
        while idle:
            fut = idle.popleft()
            if not fut.done():
                fut.set_result(False)

    def busy(self) -> bool:
        """Whether a worker holds an envelope (its attempt or hooks)."""
        return any(w.env is not None for w in self.workers)

    def holding(self, env: Envelope) -> Worker | None:
        """The worker holding ``env`` now, if any."""
        for w in self.workers:
            if w.env is env:
                return w
        return None

    def cancel(self, env: Envelope, cause: CancelCause) -> None:
        """Ask the attempt of ``env`` to stop (as a stop with ``cancel=True`` would), if
        it is running and may be cancelled now (not its hooks)."""
        w = self.holding(env)
        if w is not None and w.cancellable and w.task is not None and w.cancel_cause is None:
            w.task.cancel()
            w.owed = 1
            w.cancel_cause = cause

    def cancel_in_flight(self, cause: CancelCause, spared: object) -> None:
        """Cancel every attempt in flight that may be cancelled now (not its hooks),
        except ``spared``'s, noting ``cause``."""
        for w in self.workers:
            if w.env is not None and w.cancellable and w is not spared and w.task is not None:
                if w.cancel_cause is None:
                    w.task.cancel()
                    w.owed = 1
                w.cancel_cause = cause

    async def work(self, w: Worker) -> None:
        try:
            await self.serve(w)
        except asyncio.CancelledError:
            # Cancelled while idle or waiting for the rate limit (a cancel that reaches
            # an attempt or a hook is absorbed there and ends up here as well).
            self.abandon(w)
            raise

    async def serve(self, w: Worker) -> None:
        host = self._host
        life = self._life
        status = self._status
        loop, runner, deadlines = self._loop, self.runner, self.deadlines
        assert loop is not None
        ready = self._ready
        idle = self.idle
        live = self._live
        rate = self._rate
        call = self._call
        plan = self._plan
        outcome_counts = self._outcome_counts
        clock = loop.time
        dispatched = self._dispatch_to
        bare_queue = self._bare
        paid = False
        while True:
            if w.epoch != self.epoch:
                # A worker of an earlier run (a stop, then a start, before it ever ran):
                # the new run's workers take the work, and only they are waited for.
                return
            if not ready:
                # Ready work only exists while dispatching, so the lifecycle is checked
                # here, before idling, not on every envelope.
                if status.state not in DISPATCHING:
                    return
                if deadlines.armed:
                    self.disarm_deadlines()
                fut: asyncio.Future[bool] = loop.create_future()
                idle.append(fut)
                if not await fut:
                    return
                continue
            if rate is not None and not paid:
                wait = ask_limiter(self._name, rate, ready[0], "rate")
                if wait > 0:
                    paid = True
                    await asyncio.sleep(wait)
                    if w.epoch != self.epoch:
                        return
                    continue
            paid = False
            cause: BaseException | None
            env = ready.popleft()
            rec = env._rec
            w.env = env
            rec.attempts += 1
            rec.state = dispatched
            _ATTEMPT.set(env)
            if host.observed:
                host.observe(env, _READY, _DISPATCH, dispatched, None)
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
                run = status.run
                if run is not None:
                    (run.cancelled if outcome is _CANCELLED else run.completed).append(env)
                pending = plan[rec.kind][outcome](w, env, rec, outcome, cause)
                if pending is not None:
                    await pending
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except BaseException as exc:  # the queue's own failure: log, end the envelope
                log.exception("queue %r: internal error handling %s", self._name, env.label())
                if live.get(env) is rec and rec.state is _RUNNING_E:
                    host.enter(env, rec, Outcome.ERROR, FAULT_TARGET, cause=exc)
            finally:
                w.env = None
                w.cancellable = False
                w.cancel_cause = None
                w.deadline_at = None
                if w.owed:  # user code swallowed envq's cancel: settle the task's count
                    runner.absorb_cancel(w)
            if status.run is not None and not ready:
                life.check_drained()
            if w.abandoned:
                raise asyncio.CancelledError

    def expire(self, limit: float) -> float:
        """The deadline timer: cancel every worker whose limit is ``<= limit``; the
        earliest limit still running (inf for none)."""
        return expire_limits(self.workers, limit)

    def disarm_deadlines(self) -> None:
        """A worker goes idle: once no worker has a limit running, the deadline timer
        is disarmed (a timer left armed would move a virtual clock for nothing)."""
        for w in self.workers:
            if w.expiry < math.inf:
                return
        self.deadlines.disarm()

    def abandon(self, w: Worker) -> None:
        """The worker's task was cancelled by someone other than envq (typically the
        event loop closing): the queue stops at once, cancelling and parking
        everything (the ABANDON row), and the worker exits once its envelope is
        settled. The attempt in flight, if any, counts as cancelled by that stop."""
        if w.abandoned:
            return
        w.abandoned = True
        if w.cancel_cause is None:
            w.cancel_cause = CancelCause.STOP
        if w.epoch != self.epoch:
            return  # a worker of an earlier run, on its way out
        self._life.abandoned()
