"""One attempt of an envelope, as a worker runs it: its outcome and its hooks.

:class:`Runner` runs ``before → stamps → invoke → after`` under the envelope's
deadline and the hooks' budgets, runs ``on_success`` / ``on_failure`` under their own
budget, and classifies how an attempt ended into an :class:`envq.Outcome`. The queue's
worker loop hands it envelopes and looks the outcome up in the outcome table.

Time limits cost no timer per attempt: a worker records the limit of what it runs now
(:attr:`Worker.expiry`) and the queue's one deadline timer
(:class:`envq._timers.Deadlines`) cancels the workers that overrun it. Such a cancel
is envq's own: :meth:`Runner.absorb_cancel` tells it from a stop's or terminate's
cancel, from a cancel of the worker by someone else (which abandons the queue) and
from a ``CancelledError`` user code raised on its own.

:class:`Threads` is the queue's thread pool for plain (``def``) callables, shared with
the task API; a call the queue stopped waiting for counts as stuck until its thread
returns.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

from envq._errors import DoNotRetry, StopEnvelope, StopType
from envq._machine import TYPELESS, CancelCause, Outcome
from envq._values import Decision, HookTimeout, drop, retry_now

if TYPE_CHECKING:
    from envq._envelope import Envelope, Invoker, Stamp
    from envq._timers import Clock, Deadlines

__all__ = ["Runner", "Threads", "Worker", "expire_limits"]

log = logging.getLogger("envq")

_INF: Final = math.inf
_OK: Final = Outcome.OK
_CANCELLED: Final = Outcome.CANCELLED
_TIMEOUT: Final = Outcome.TIMEOUT
_ERROR: Final = Outcome.ERROR

#: Control signals raised by user code, first match wins (StopType before StopEnvelope).
_SIGNALS: Final[tuple[tuple[type[BaseException], Outcome], ...]] = (
    (StopType, Outcome.STOP_TYPE),
    (StopEnvelope, Outcome.STOP),
    (DoNotRetry, Outcome.NO_RETRY),
)


class Worker:
    """One worker of a queue: what it runs now, and who has cancelled it."""

    __slots__ = (
        "abandoned",
        "cancel_cause",
        "cancellable",
        "deadline_at",
        "env",
        "epoch",
        "expiry",
        "fired",
        "owed",
        "task",
    )

    def __init__(self, epoch: int) -> None:
        #: The queue run (start) the worker belongs to.
        self.epoch = epoch
        self.task: asyncio.Task[None] | None = None
        #: The envelope it handles (attempt and hooks), or None when idle.
        self.env: Envelope | None = None
        #: Loop time the attempt's deadline expires; None without a deadline.
        self.deadline_at: float | None = None
        #: The time limit of what it runs now (deadline, hook budget); inf for none.
        self.expiry = _INF
        #: The limit the deadline timer cancelled it for, until the scope settles it.
        self.fired: float | None = None
        #: Whether a stop may cancel it now (its attempt, not its hooks).
        self.cancellable = False
        #: Who cancelled the attempt in flight (a stop, terminate, or the worker's
        #: abandonment, which counts as a stop).
        self.cancel_cause: CancelCause | None = None
        #: envq's own ``task.cancel()`` calls not yet matched by ``uncancel()``.
        self.owed = 0
        #: Cancelled by someone other than envq: ends its envelope, then exits.
        self.abandoned = False


# --------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------


class _Stuck:
    """Counts calls still running in a thread after the queue stopped waiting for
    them; shared with the threads."""

    __slots__ = ("count", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0


class _ThreadJob:
    """A plain callable on the pool. Once the queue stops waiting for it
    (:meth:`abandon`) it counts as stuck until its thread returns; nothing keeps it.
    It runs at most once (a job started on the loop's thread is skipped by the pool)."""

    __slots__ = ("abandoned", "args", "ctx", "dead", "finished", "fn", "started", "stuck")

    def __init__(self, stuck: _Stuck, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.stuck = stuck
        self.fn: Callable[..., Any] | None = fn
        self.args = args
        self.ctx = contextvars.copy_context()
        self.started = False
        self.finished = False
        self.abandoned = False
        self.dead = False

    def __call__(self) -> tuple[bool, Any]:
        # The error is returned, not raised: asyncio would rebuild a TimeoutError or
        # CancelledError crossing from a thread, and on_failure must see the original.
        stuck = self.stuck
        with stuck.lock:
            if self.dead or self.started:
                return False, asyncio.CancelledError()
            self.started = True
        fn, self.fn = self.fn, None
        args, self.args = self.args, ()
        assert fn is not None
        try:
            return True, self.ctx.run(fn, *args)
        except BaseException as exc:
            return False, exc
        finally:
            with stuck.lock:
                self.finished = True
                if self.abandoned:
                    stuck.count -= 1

    def abandon(self) -> None:
        """The queue no longer waits for this call."""
        stuck = self.stuck
        with stuck.lock:
            if not self.started:
                self.dead = True  # never runs
            elif not self.finished and not self.abandoned:
                self.abandoned = True
                stuck.count += 1


class Threads:
    """A queue's thread pool for plain callables, started on first use.

    :param size: the most threads at once.
    :param name: the threads' name prefix.
    """

    __slots__ = ("_name", "_pool", "_size", "_stuck")

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._stuck = _Stuck()

    @property
    def stuck(self) -> int:
        """Calls still running although nobody waits for them any more."""
        return self._stuck.count

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a thread, with the caller's context; an awaitable it
        returns (``lambda env: send(env)`` for an ``async def send``) is awaited here,
        on the loop."""
        pool = self._pool
        if pool is None:
            pool = self._pool = ThreadPoolExecutor(self._size, thread_name_prefix=self._name)
        job = _ThreadJob(self._stuck, fn, args)
        try:
            running = asyncio.get_running_loop().run_in_executor(pool, job)
        except RuntimeError:
            # No thread can start: the interpreter is exiting (CPython 3.12+ refuses new
            # threads then; a background queue finishes its tasks at exit). The call runs
            # here, on the loop's thread; should a pool thread pick the queued job up
            # after all, it finds it taken.
            ok, value = job()
        else:
            try:
                ok, value = await running
            except asyncio.CancelledError:
                job.abandon()
                raise
        if not ok:
            raise value
        if inspect.isawaitable(value):
            value = await value
        return value

    def shutdown(self) -> None:
        """Stop the pool without waiting (a stuck thread keeps running); a later call
        starts a new one."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------
# Attempts and hooks
# --------------------------------------------------------------------------------------

#: What a hook call came to: its value, its error, or a cancel of the worker from
#: outside (the hook was interrupted; the queue is being abandoned).
_INTERRUPTED: Final = object()


class Runner:
    """Runs one queue's attempts and hooks, each hook within its time budget.

    :param name: the queue's name, for messages.
    :param stamps: the queue's stamps (outermost).
    :param hook_timeout: the hooks' budgets.
    :param threads: the pool for plain callables.
    :param clock: the queue's loop, once known.
    :param deadlines: the queue's deadline timer.
    :param abandon: called with a worker cancelled by someone other than envq.
    """

    __slots__ = (
        "_abandon",
        "_clock",
        "_deadlines",
        "_plain",
        "hook_timeout",
        "name",
        "stamps",
        "threads",
    )

    def __init__(
        self,
        name: str,
        stamps: tuple[Stamp, ...],
        hook_timeout: HookTimeout,
        threads: Threads,
        clock: Clock,
        deadlines: Deadlines,
        abandon: Callable[[Worker], None],
    ) -> None:
        self.name = name
        self.stamps = stamps
        #: No queue stamps: an envelope without stamps of its own calls invoke directly.
        self._plain = not stamps
        self.hook_timeout = hook_timeout
        self.threads = threads
        self._deadlines = deadlines
        self._abandon = abandon
        self._clock = clock

    # -- time limits ------------------------------------------------------------------

    def _set_limit(self, w: Worker, at: float) -> None:
        """What ``w`` runs now must end by loop time ``at`` (inf: no limit)."""
        w.expiry = at
        if at < _INF:
            self._deadlines.arm(at)

    def absorb_cancel(self, w: Worker) -> bool:
        """A ``CancelledError`` reached ``w``'s attempt or hook. Settle envq's own
        cancels of it (a stop's, terminate's, a time limit's); True when the worker was
        cancelled — by envq, or by someone else, which abandons the queue — and False
        when user code raised it on its own."""
        task = w.task
        owed = w.owed
        if task is None:
            return False
        if owed:
            w.owed = 0
            for _ in range(owed):
                task.uncancel()
        if task.cancelling():
            self._abandon(w)
            return True
        return owed > 0

    # -- the attempt ------------------------------------------------------------------

    async def attempt(self, w: Worker, env: Envelope) -> tuple[Outcome, BaseException | None]:
        """``before → stamps → invoke → after`` under the deadline and hook budgets."""
        now = self._clock.time()
        deadline = env.deadline
        deadlines = self._deadlines
        if deadline:
            deadline_at = w.deadline_at = now + deadline
        else:
            deadline_at = _INF
        stopped: BaseException | None = None
        budget: float | None = None
        w.cancellable = True
        try:
            try:
                before = env.before
                if before is not None:
                    budget = self.hook_timeout.budget(deadline)
                    limit = deadline_at if budget is None else min(deadline_at, now + budget)
                    self._set_limit(w, limit)
                    if env._async_before:
                        await before(env)  # type: ignore[misc]
                    else:
                        await self.threads.call(before, env)
                    if w.fired is not None:  # before swallowed the cancel
                        raise TimeoutError(self._overran(w, env, deadline_at, "before"))
                # (Inline: this runs for every attempt.)
                w.expiry = deadline_at
                if deadline_at < deadlines.armed_at:
                    deadlines.arm(deadline_at)
                if env._direct and self._plain:
                    await env.invoke(env)  # type: ignore[misc]
                else:
                    await self.chain(env)(env)
            except StopEnvelope as exc:
                stopped = exc
            if w.fired is not None and stopped is None:  # user code swallowed the cancel
                raise TimeoutError(self._overran(w, env, deadline_at, "invoke"))
        except BaseException as exc:
            return self.failed(w, env, exc)
        w.expiry = _INF
        if env.after is not None:
            try:
                await self._after_hook(w, env, deadline_at, budget)
            except StopEnvelope as exc:
                stopped = stopped or exc
        w.cancellable = False
        if stopped is not None:
            return self.classify(w, env, stopped), stopped
        return _OK, None

    async def _after_hook(
        self, w: Worker, env: Envelope, deadline_at: float, budget: float | None
    ) -> None:
        """Run ``after`` within its budget (``budget``: already known, or None) and the
        deadline; whatever goes wrong there is logged and ignored, but a
        ``StopEnvelope``, which the caller sees."""
        after = env.after
        assert after is not None
        if budget is None:
            budget = self.hook_timeout.budget(env.deadline)
        limit = deadline_at if budget is None else min(deadline_at, self._clock.time() + budget)
        self._set_limit(w, limit)
        try:
            if env._async_after:
                await after(env)  # type: ignore[misc]
            else:
                await self.threads.call(after, env)
            if w.fired is not None:
                raise TimeoutError(self._overran(w, env, deadline_at, "after"))
        except StopEnvelope:
            raise
        except asyncio.CancelledError:
            # A cancel of the worker that lands in after keeps the outcome.
            if not self.absorb_cancel(w):
                log.warning(
                    "queue %r: after hook of %s raised CancelledError (ignored)",
                    self.name,
                    env.label(),
                )
            elif w.cancel_cause is None:
                log.warning(
                    "queue %r: after hook of %s failed (ignored): %s",
                    self.name,
                    env.label(),
                    self._overran(w, env, deadline_at, "after"),
                )
        except GeneratorExit:
            raise
        except BaseException:
            log.warning(
                "queue %r: after hook of %s failed (ignored)", self.name, env.label(), exc_info=True
            )
        finally:
            w.expiry = _INF
            w.fired = None

    def _overran(self, w: Worker, env: Envelope, deadline_at: float, what: str) -> str:
        """Why the time limit that fired on ``w`` stopped ``what``."""
        fired = w.fired
        if fired is not None and fired < deadline_at:
            budget = self.hook_timeout.budget(env.deadline)
            return f"{what} overran its budget of {budget:g} s"
        return f"deadline of {env.deadline:g} s expired"

    def failed(
        self, w: Worker, env: Envelope, exc: BaseException
    ) -> tuple[Outcome, BaseException | None]:
        """``before`` or the invoker chain raised ``exc`` (``w``'s limit settles here):
        the attempt's outcome, and the cause ``on_failure`` and events see (envq's own
        time-limit cancel becomes a ``TimeoutError``)."""
        w.expiry = _INF
        w.cancellable = False
        outcome = self.classify(w, env, exc)
        if outcome is _TIMEOUT and not isinstance(exc, TimeoutError):
            deadline_at = w.deadline_at
            exc = TimeoutError(
                self._overran(w, env, _INF if deadline_at is None else deadline_at, "before")
            )
        w.fired = None
        return outcome, exc

    def swallowed(self, w: Worker, env: Envelope) -> tuple[Outcome, BaseException | None]:
        """The invoker chain returned although ``w``'s time limit cancelled it (user
        code swallowed the cancel): a TIMEOUT all the same."""
        deadline_at = w.deadline_at
        return self.failed(
            w,
            env,
            TimeoutError(
                self._overran(w, env, _INF if deadline_at is None else deadline_at, "invoke")
            ),
        )

    def classify(self, w: Worker, env: Envelope, exc: BaseException) -> Outcome:
        """The outcome an exception from ``before`` or the invoker chain stands for."""
        for signal, outcome in _SIGNALS:
            if isinstance(exc, signal):
                return outcome if env.type else TYPELESS.get(outcome, outcome)
        if isinstance(exc, asyncio.CancelledError):
            if not self.absorb_cancel(w):
                return _ERROR  # raised by user code on its own
            if w.cancel_cause is not None:  # a stop, terminate, or the queue abandoned
                return _CANCELLED
            return _TIMEOUT if w.fired is not None else _ERROR
        if isinstance(exc, TimeoutError) and w.fired is not None:
            return _TIMEOUT
        if isinstance(exc, GeneratorExit):
            raise exc
        # Any other exception, KeyboardInterrupt and SystemExit included: the attempt
        # failed; the worker carries on.
        return _ERROR

    def chain(self, env: Envelope) -> Invoker:
        """The invoker chain of ``env``: queue stamps around envelope stamps around
        ``invoke`` (a plain one runs in a thread)."""
        invoke = env.invoke
        inner: Invoker
        if env._async:
            inner = invoke  # type: ignore[assignment]
        else:
            call = self.threads.call

            async def inner(e: Envelope) -> None:
                await call(invoke, e)

        for stamp in reversed(env.stamps):
            inner = stamp(inner)
        for stamp in reversed(self.stamps):
            inner = stamp(inner)
        return inner

    # -- on_success / on_failure ------------------------------------------------------

    async def _hook(
        self, w: Worker, env: Envelope, fn: Callable[..., Any], is_async: bool, *args: Any
    ) -> tuple[bool, Any]:
        """Run a hook under its own budget: ``(True, value)``, ``(False, error)``, or
        ``(False, _INTERRUPTED)`` when the worker was cancelled from outside."""
        budget = self.hook_timeout.budget(env.deadline)
        self._set_limit(w, _INF if budget is None else self._clock.time() + budget)
        try:
            value = await (fn(env, *args) if is_async else self.threads.call(fn, env, *args))
            if w.fired is not None:  # the hook swallowed its budget's cancel
                return False, TimeoutError(f"overran its budget of {budget} s")
            return True, value
        except GeneratorExit:
            raise
        except asyncio.CancelledError as exc:
            if self.absorb_cancel(w):
                if w.abandoned:
                    return False, _INTERRUPTED
                return False, TimeoutError(f"overran its budget of {budget} s")
            return False, exc
        except BaseException as exc:
            return False, exc
        finally:
            w.expiry = _INF
            w.fired = None

    async def on_success(self, w: Worker, env: Envelope) -> None:
        """Run ``on_success`` (if any); its failure is logged."""
        hook = env.on_success
        if hook is None:
            return
        ok, value = await self._hook(w, env, hook, env._async_success)
        if not ok and value is not _INTERRUPTED:
            log.error("queue %r: on_success of %s failed", self.name, env.label(), exc_info=value)

    async def on_failure(
        self, w: Worker, env: Envelope, cause: BaseException | None, attempt: int
    ) -> Decision:
        """Ask ``on_failure``; a crash, an overrun or a wrong answer counts as drop.

        Interrupted by a cancel of the worker from outside, it counts as retry now:
        the stop that cancel begins parks the envelope instead of losing it.
        """
        hook = env.on_failure
        assert hook is not None
        ok, decision = await self._hook(w, env, hook, env._async_failure, cause, attempt)
        if not ok:
            if decision is _INTERRUPTED:
                return retry_now()
            log.error(
                "queue %r: on_failure of %s failed (drop)",
                self.name,
                env.label(),
                exc_info=decision,
            )
            return drop()
        if decision is None:
            return drop()
        if not isinstance(decision, Decision):
            log.error(
                "queue %r: on_failure of %s returned %r, not a Decision (drop)",
                self.name,
                env.label(),
                decision,
            )
            return drop()
        return decision


def expire_limits(workers: Iterable[Worker], limit: float) -> float:
    """A deadline timer fired at loop time ``limit``: cancel every worker whose limit is
    ``<= limit`` (noting it in ``fired``); the earliest limit still running (inf for
    none)."""
    following = _INF
    for w in workers:
        at = w.expiry
        if at <= limit:
            w.expiry = _INF
            w.fired = at
            if w.task is not None:
                w.owed += 1
                w.task.cancel()
        elif at < following:
            following = at
    return following
