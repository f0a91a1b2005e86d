"""The outcome interpreter: what the end of an attempt does, row by row.

Each row of ``OUTCOMES`` is resolved once per queue (:meth:`Settler.resolve`) into its
action with its target bound; the worker calls the result at the end of every attempt.
The actions run the ``on_success``/``on_failure`` hooks, take the failure decision
(``on_failure``'s answer, else the ``Retry`` policy), compute the next delay (interval,
FIXED_RATE grid, backoff, the failure limiter's wait) and hand the envelope to the
queue's ``enter`` callback with the target the tables give. The interpreter holds no
envelope: the queue's live set, ready deque and blacklist are lent to it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final, TypeAlias, assert_never

from envq import _machine
from envq._attempt import Runner, Worker
from envq._envelope import Enter, Envelope, _Rec
from envq._first_run import wall_offset
from envq._limits import RateLimiter, ask_limiter, forget_limiter
from envq._listeners import Listeners
from envq._machine import (
    DECISION_TARGET,
    OUTCOMES,
    PARK_INSTEAD,
    RELABEL,
    SHELVE_TARGET,
    Action,
    EnvEvent,
    EnvState,
    Kind,
    Outcome,
    OutcomeRow,
)
from envq._rules import exhausted, failure, hook_number
from envq._stats import Status
from envq._timers import Clock
from envq._values import Schedule

__all__ = ["Perform", "Settler"]

log = logging.getLogger("envq")

_READY: Final = EnvState.READY
_RUNNING_E: Final = EnvState.RUNNING
_PERIODIC: Final = Kind.PERIODIC
#: Seconds of loop time between two WARNINGs of one periodic envelope's row of failing
#: runs (see Settler._log_periodic_failure).
_FAILURE_LOG_WINDOW: Final = 60.0

_Cause: TypeAlias = BaseException | None
#: A row of the outcome table resolved for one queue: ``(worker, env, rec, outcome,
#: cause)`` → the coroutine still to await (a hook), or None when the row is done.
Perform: TypeAlias = Callable[[Worker, Envelope, _Rec, Outcome, _Cause], Awaitable[None] | None]


# A module constant: on Python 3.11 every ``Schedule.X`` read is slow (~60 ns).
_FIXED_DELAY: Final = Schedule.FIXED_DELAY


class Settler:
    """Performs the outcome rows for one queue.

    :param enter: the queue's entry routine (every move goes through it).
    :param status: the queue's lifecycle state (a move back into a queue that is not
        RUNNING parks).
    :param live: the queue's live envelopes; ``ready``: its ready deque;
        ``blacklist``: its blacklisted types; ``listeners``: its listeners (all lent,
        never replaced).
    :param log_unhandled: log a periodic run's failure that nothing handles.
    :param clock: the queue's loop, once known.
    """

    __slots__ = (
        "_banned_kind",
        "_clock",
        "_enter",
        "_runner",
        "_status",
        "blacklist",
        "limiter",
        "listeners",
        "live",
        "log_unhandled",
        "name",
        "plan",
        "ready",
    )

    def __init__(
        self,
        name: str,
        *,
        limiter: RateLimiter | None,
        runner: Runner,
        enter: Enter,
        status: Status,
        live: dict[Envelope, _Rec],
        ready: deque[Envelope],
        blacklist: set[str],
        listeners: Listeners,
        log_unhandled: bool,
        clock: Clock,
    ) -> None:
        self.name = name
        self.limiter = limiter
        self._runner = runner
        self._enter = enter
        self._status = status
        self.live = live
        self.ready = ready
        self.blacklist = blacklist
        self.listeners = listeners
        self.log_unhandled = log_unhandled
        self._clock = clock
        #: The row group of an envelope whose type was blacklisted while it ran.
        self._banned_kind = RELABEL[EnvEvent.BLACKLIST]
        #: The outcome table as this queue performs it: kind → outcome → action.
        self.plan: dict[Kind, dict[Outcome, Perform]] = {kind: {} for kind in Kind}
        for (kind, outcome), row in OUTCOMES.items():
            self.plan[kind][outcome] = self.resolve(row)

    def resolve(self, row: OutcomeRow) -> Perform:
        """A row of the outcome table as this queue performs it: the row's action with
        its target bound (one exhaustive ``match``, run once per row when the queue is
        made; the worker calls the result for every attempt)."""
        target = row.target
        limited = row.limited
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
                        return self._reschedule(w, env, rec, outcome, target, limited)
                    self._rescheduled(env, rec, outcome, target, limited)
                    return None

                return reschedule
            case Action.DECIDE:
                return lambda w, env, rec, outcome, cause: self._decide(
                    w, env, rec, outcome, target, cause, limited
                )
            case Action.DECIDE_PERIODIC:
                return lambda w, env, rec, outcome, cause: self._decide_periodic(
                    w, env, rec, outcome, target, cause, limited
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
                    self.blacklist_type(env)
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

    def _banned_meanwhile(
        self, w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, cause: _Cause
    ) -> bool:
        """After a hook: whether the envelope's type was blacklisted while the hook ran
        (its row group was relabelled, ``RELABEL``). The row of that group is then
        performed instead of the rest of the one chosen before the hook: a banned type
        never runs again."""
        banned = self._banned_kind
        if rec.kind is not banned:
            return False
        done = self.plan[banned][outcome](w, env, rec, outcome, cause)
        assert done is None, "a BLACKLISTED row runs no hook"
        return True

    async def _succeed(
        self, w: Worker, env: Envelope, rec: _Rec, outcome: Outcome, target: EnvState
    ) -> None:
        await self._runner.on_success(w, env)
        if not self._banned_meanwhile(w, env, rec, outcome, None):
            self._enter(env, rec, outcome, target)

    async def _reschedule(
        self,
        w: Worker,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        target: EnvState,
        limited: bool,
    ) -> None:
        await self._runner.on_success(w, env)
        if not self._banned_meanwhile(w, env, rec, outcome, None):
            self._rescheduled(env, rec, outcome, target, limited)

    def _rescheduled(
        self, env: Envelope, rec: _Rec, outcome: Outcome, target: EnvState, limited: bool
    ) -> None:
        rec.failures = 0
        if self.limiter is not None:
            forget_limiter(self.name, self.limiter, env)
        delay, at = self._next_run(env, rec)
        self._requeue(env, rec, outcome, target, delay, None, at, retry=limited)

    async def _decide_periodic(
        self,
        w: Worker,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        target: EnvState,
        cause: BaseException | None,
        limited: bool,
    ) -> None:
        """Periodic failure: on_failure's decision if set, else the next interval."""
        f = failure(
            periodic=True,
            hooked=env.on_failure is not None,
            retry=None,
            attempt=rec.attempts,
            failures=rec.failures,
        )
        assert f.failures is not None
        failures = rec.failures = f.failures
        at: float | None = None
        if f.hook is None:
            to = target
            delay, at = self._next_run(env, rec)
            if self.log_unhandled and not self.listeners.handlers:
                self._log_periodic_failure(env, rec, failures, delay, cause)
        else:
            decision = await self._runner.on_failure(w, env, cause, f.hook)
            if self._banned_meanwhile(w, env, rec, outcome, cause):
                return
            to, delay = DECISION_TARGET[decision.kind], decision.delay
        self._requeue(env, rec, outcome, to, delay, cause, at, retry=limited)

    def _log_periodic_failure(
        self, env: Envelope, rec: _Rec, failures: int, delay: float, cause: BaseException | None
    ) -> None:
        """A periodic run failed and nothing handles it: log it, rate-limited by loop
        time. The first failure of a row (which a success ends) is logged at once, then
        the first failure at least a minute after the last record. Only failures read
        or write the time of the last record (``rec.logged``): a succeeding run pays
        nothing, and a calendar schedule (no interval) or a slow failure is limited as
        any other."""
        now = self._clock.time()
        if failures > 1 and now - rec.logged < _FAILURE_LOG_WINDOW:
            return
        rec.logged = now
        if not log.isEnabledFor(logging.WARNING):
            return
        log.warning(
            "queue %r: periodic %s failed (%d in a row) and nothing handles it (no "
            "on_failure or listener; repeats are logged about once a minute); next run "
            "in %g s: %r",
            self.name,
            env.label(),
            failures,
            delay,
            cause,
            exc_info=cause,
        )

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
            number = hook_number(rec.kind is _PERIODIC, rec.failures, rec.attempts)
            await self._runner.on_failure(w, env, cause, number)
            if self._banned_meanwhile(w, env, rec, outcome, cause):
                return
        self._enter(env, rec, outcome, target, cause=cause)

    async def _decide(
        self,
        w: Worker,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        target: EnvState,
        cause: BaseException | None,
        limited: bool,
    ) -> None:
        """One-off failure: on_failure's decision, else the Retry policy, else drop."""
        attempt = rec.attempts
        f = failure(
            periodic=False,
            hooked=env.on_failure is not None,
            retry=env.retry,
            attempt=attempt,
            failures=rec.failures,
        )
        to, delay = target, f.delay
        if f.hook is not None:
            decision = await self._runner.on_failure(w, env, cause, f.hook)
            if self._banned_meanwhile(w, env, rec, outcome, cause):
                return
            to, delay = DECISION_TARGET[decision.kind], decision.delay
        elif f.decision is not None:
            to = DECISION_TARGET[f.decision]
        elif f.spent:
            cause = exhausted(f"queue {self.name!r}", env.label(), env.retry, attempt, cause)
        self._requeue(env, rec, outcome, to, delay, cause, retry=limited)

    def blacklist_type(self, culprit: Envelope) -> None:
        kind = culprit.type
        self.blacklist.add(kind)
        victims = [
            (env, rec) for env, rec in self.live.items() if env.type == kind and env is not culprit
        ]
        if any(rec.state is _READY for _env, rec in victims):
            kept = [env for env in self.ready if env.type != kind]
            self.ready.clear()
            self.ready.extend(kept)
        for env, rec in victims:
            to = _machine.queue_move(rec.state, EnvEvent.BLACKLIST)
            if to is None:  # in flight: its attempt ends by the relabelled rows
                rec.kind = RELABEL[EnvEvent.BLACKLIST]
            else:
                self._enter(env, rec, EnvEvent.BLACKLIST, to)

    def _requeue(
        self,
        env: Envelope,
        rec: _Rec,
        outcome: Outcome,
        to: EnvState,
        delay: float,
        cause: BaseException | None,
        at: float | None = None,
        *,
        retry: bool,
    ) -> None:
        """Perform the end of a row that may put ``env`` back (``to``: READY or DELAYED,
        or an end state): where it lands is ``_machine.put_back``'s.

        ``at``: the loop time ``delay`` stands for, when it is a grid point. ``retry``:
        the row's ``limited`` flag — a failure retry waits at least
        ``limiter.when(env)``, and a READY retry that must wait becomes DELAYED.
        """
        limited = False
        if retry and self.limiter is not None and to in PARK_INSTEAD:
            wait = ask_limiter(self.name, self.limiter, env, "retry")
            if wait > delay:
                delay, at = wait, None
            limited = delay > 0
        to = _machine.put_back(to, limited=limited, queue=self._status.state)
        self._enter(env, rec, outcome, to, delay, cause, at)

    def _next_run(self, env: Envelope, rec: _Rec) -> tuple[float, float | None]:
        """Seconds from now to the envelope's next periodic run, and the loop time
        it is due at (so that the time spent rescheduling is not added to a grid run
        after run); the envelope's schedule decides."""
        schedule = env.schedule
        if schedule is _FIXED_DELAY:
            return env.interval, None
        now = self._clock.time()
        # Only a calendar reads the wall clock.
        loop = self._clock.loop
        offset = wall_offset(loop) if env._calendar and loop is not None else 0.0
        at = schedule.next_run(env.interval, rec.origin, rec.due, now, offset)
        return at - now, at
