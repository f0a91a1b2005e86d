"""Mutation check of envq's engine code: does a realistic bug make a test fail?

:data:`MUTANTS` is a hand-written list of realistic bugs in the engine's source — an
off-by-one, a forgotten call, a dropped condition, a swapped branch — each an
``(ident, file, original snippet, replacement, description)``. Each mutant is applied
to a copy of the repository (the work tree is never touched) and the behavioural tests
run against it with ``pytest -x``; the mutant is *killed* when a test fails or the run
hangs. Every mutant must be killed: a survivor is a behaviour the suite leaves
unpinned, so write the test that pins it (or, if no test can tell the mutant from the
real code, drop it from the list and give the reason in :data:`EQUIVALENT`).

This complements ``scripts/mutate.py``, which mutates the runtime tables' rows; the
copying, the staged and confirmed pytest runs, the parallel driver and the excluded
test files (:data:`mutate.EXCLUDED`: the table comparisons, which read only
``envq/_machine.py``, which no mutant here touches; the fresh-interpreter and slow
files; and ``tests/tools/test_mutate_code.py``, which would kill every mutant trivially) are
``mutate.py``'s own, imported from it.

A snippet must occur exactly once in its file: a refactor of the engine that changes
one makes the list stale, and the run stops before running anything, naming the
mutant (``tests/tools/test_mutate_code.py`` checks the same in CI).

Mechanics: one copy of the repository per job (``--jobs``, default 2), reused from
mutant to mutant: the mutant's file is rewritten in the copy, the tests run, the file
is put back. Each rewrite gives the file a new modification time, so no cached
bytecode of an earlier version is ever used. The tests run in two stages as in
``mutate.py`` (the row tests, then the other behavioural files), and a
kill by the second stage is confirmed (the killing test alone, or its file, fails again
with the mutant, and passes with the original source put back).

Usage::

    python scripts/mutate_code.py            # every mutant (~7 min on 2 cores)
    python scripts/mutate_code.py --quick    # the fixed CI sample, QUICK (~1.2 min)
    python scripts/mutate_code.py --list     # print the mutants, run nothing
    python scripts/mutate_code.py --only queue-internal-error-ignored -v

The last line is ``mutants: N killed: K survived: S``; the exit code is 1 if a mutant
survived, 2 if the list is stale, the unmutated suite fails or a run errors.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mutate
from mutate import Result, Runner

ROOT: Final = mutate.ROOT


@dataclass(frozen=True)
class CodeMutant:
    """One realistic bug: ``original`` (found exactly once in ``file``) replaced."""

    ident: str
    file: str
    original: str
    replacement: str
    description: str


def _m(ident: str, file: str, original: str, replacement: str, description: str) -> CodeMutant:
    return CodeMutant(ident, f"envq/{file}", original, replacement, description)


#: The mutants, by file. Snippets keep their indentation and enough context to be
#: unique in their file.
MUTANTS: Final[tuple[CodeMutant, ...]] = (
    # -- envq/_queue.py: the worker loop and the outcome interpreter ---------------------
    _m(
        "queue-internal-error-ignored",
        "_crew.py",
        "                if live.get(env) is rec and rec.state is _RUNNING_E:\n"
        "                    host.enter(env, rec, Outcome.ERROR, FAULT_TARGET, cause=exc)\n",
        "                pass\n",
        "the queue's own failure is logged but the envelope stays RUNNING: its slot is never freed",
    ),
    _m(
        "queue-internal-error-unguarded",
        "_crew.py",
        "                if live.get(env) is rec and rec.state is _RUNNING_E:\n",
        "                if True:\n",
        "an internal error after the envelope already ended ends it a second time",
    ),
    _m(
        "queue-drained-ignores-hooks",
        "_crew.py",
        "        return any(w.env is not None for w in self.workers)\n",
        "        return any(w.env is not None and w.cancellable for w in self.workers)\n",
        "a stop completes while a worker is still inside on_success / on_failure",
    ),
    _m(
        "queue-drained-ignores-ready",
        "_lifecycle.py",
        "        if self._ready or self.state is not _STOPPING_Q or self.crew.busy():\n",
        "        if self.state is not _STOPPING_Q or self.crew.busy():\n",
        "a DRAIN stop completes before the ready envelopes have run",
    ),
    _m(
        "queue-capacity-off-by-one",
        "_admission.py",
        "            over = len(self.live) + count > self.capacity\n",
        "            over = len(self.live) + count >= self.capacity\n",
        "send refuses the batch that exactly fills the capacity",
    ),
    _m(
        "queue-send-overtakes-waiters",
        "_admission.py",
        "            elif over or self.waiters:\n",
        "            elif over:\n",
        "send() admits while producers wait in send_wait (overtakes them)",
    ),
    _m(
        "queue-resend-keeps-attempts",
        "_admission.py",
        "                rec.attempts = 0\n                rec.failures = 0\n",
        "                rec.failures = 0\n",
        "an envelope sent again after it ended keeps counting its attempts from last time",
    ),
    _m(
        "queue-park-keeps-due-time",
        "_lifecycle.py",
        "                remaining = max(0.0, rec.due - now) if rec.state is _DELAYED else 0.0",
        "                remaining = rec.due if rec.state is _DELAYED else 0.0",
        "a parked envelope keeps its absolute due time, not the time it still had to wait",
    ),
    _m(
        "queue-drain-parks-ready",
        "_lifecycle.py",
        "        if move(_READY, parks, mode) is not None:\n"
        "            self._store.drop_ready()\n"
        "        now = self._host._bound_loop().time()\n"
        "        for env, rec in self._live.items():\n"
        "            to = move(rec.state, parks, mode)\n",
        "        if move(_READY, parks, StopMode.STOP) is not None:\n"
        "            self._store.drop_ready()\n"
        "        now = self._host._bound_loop().time()\n"
        "        for env, rec in self._live.items():\n"
        "            to = move(rec.state, parks, StopMode.STOP)\n",
        "a DRAIN stop parks the ready envelopes instead of running them (the ready queue"
        " still holds them)",
    ),
    _m(
        "queue-cancel-spares-nobody",
        "_crew.py",
        "and w.cancellable and w is not spared and w.task is not None:",
        "and w.cancellable and w.task is not None:",
        "stop(cancel=True) from inside an attempt cancels the caller's own attempt",
    ),
    _m(
        "queue-stop-from-inside-waits",
        "_queue.py",
        "        if self._inside() is not None or not (self.wait if wait is None else wait):\n",
        "        if not (self.wait if wait is None else wait):\n",
        "stop() from inside an attempt waits for the stop, i.e. for itself",
    ),
    _m(
        "queue-reschedule-not-parked",
        "_machine.py",
        "    if queue not in TAKES_BACK:\n        to = PARK_INSTEAD.get(to, to)\n",
        "    if queue is QueueState.STOPPED:\n        to = PARK_INSTEAD.get(to, to)\n",
        "a reschedule decided while the queue is STOPPING is not parked",
    ),
    _m(
        "queue-limiter-overrides-decision",
        "_outcomes.py",
        "            if wait > delay:\n                delay, at = wait, None\n",
        "            delay, at = wait, None\n",
        "the retry limiter's wait replaces the decided delay instead of being a minimum",
    ),
    _m(
        "queue-limiter-ready-retry-not-delayed",
        "_outcomes.py",
        "            limited = delay > 0\n",
        "            limited = False\n",
        "a retry_now that the limiter says must wait still runs at once",
    ),
    _m(
        "queue-limiter-on-success",
        "_outcomes.py",
        "        if retry and self.limiter is not None and to in PARK_INSTEAD:\n",
        "        if self.limiter is not None and to in PARK_INSTEAD:\n",
        "a periodic envelope's successful runs are spaced by the failure limiter too",
    ),
    _m(
        "queue-fixed-rate-due-reset",
        "_moves.py",
        "            if rec.kind is _PERIODIC and event is not _DUE:\n",
        "            if rec.kind is _PERIODIC:\n",
        "FIXED_RATE measures from when a run became ready, not from its grid point (drift)",
    ),
    _m(
        "queue-fixed-rate-burst",
        "_values.py",
        "        return origin + fixed_rate_slot(origin, interval, ended) * interval\n",
        "        return previous + interval\n",
        "FIXED_RATE: after an overrun the missed grid slots are run in a burst, not skipped",
    ),
    _m(
        "schedule-fixed-rate-slot-floor",
        "_schedule.py",
        "    while origin + n * interval <= now:\n        n += 1\n",
        "",
        "FIXED_RATE trusts the floored quotient: an attempt ending on a slot runs again at once",
    ),
    _m(
        "queue-calendar-restart-keeps-delay",
        "_lifecycle.py",
        "            elif env._calendar:\n",
        "            elif False:\n",
        "a calendar envelope restarted after a stop waits its old remaining delay",
    ),
    _m(
        "queue-terminal-no-forget",
        "_moves.py",
        "            if self._limiter is not None:\n"
        "                forget_limiter(self.name, self._limiter, env)\n"
        "            if self.observed:\n",
        "            if self.observed:\n",
        "the retry limiter is never told to forget an envelope that ended",
    ),
    _m(
        "queue-dead-letter-no-error",
        "_moves.py",
        "self.name, self._dead_letter, self._dead_async, env, cause, self._clock.loop\n",
        "self.name, self._dead_letter, self._dead_async, env, None, self._clock.loop\n",
        "dead_letter is called without the envelope's last error",
    ),
    _m(
        "queue-unhandled-ignores-listeners",
        "_moves.py",
        "env.on_failure is None and not self._listeners.handlers\n",
        "env.on_failure is None\n",
        "a failure is logged as unhandled although a listener handles it",
    ),
    _m(
        "queue-empty-wakes-early",
        "_moves.py",
        "            if status.empty_waiters and not self._live:\n",
        "            if status.empty_waiters:\n",
        "run_until_empty() returns when the first envelope ends",
    ),
    _m(
        "queue-terminal-no-pump",
        "_moves.py",
        "            if room.waiters:\n"
        "                room.pump()\n",
        "",
        "a slot freed by an envelope's end does not wake the producer waiting in send_wait",
    ),
    _m(
        "queue-finish-stop-no-wake",
        "_lifecycle.py",
        "        if run is not None and not run.done.done():\n"
        "            run.done.set_result(None)\n"
        "        self.status.wake_stopped()\n",
        "        if run is not None and not run.done.done():\n"
        "            run.done.set_result(None)\n",
        "wait_stopped() is never woken by the stop's end",
    ),
    _m(
        "queue-rate-paid-once",
        "_crew.py",
        "            paid = False\n            cause: BaseException | None\n",
        "            cause: BaseException | None\n",
        "once a worker has waited for the dispatch limit, it never asks the limit again",
    ),
    _m(
        "queue-stop-report-cancelled-as-completed",
        "_crew.py",
        "            (run.cancelled if outcome is _CANCELLED else run.completed).append(env)\n",
        "            run.completed.append(env)\n",
        "a cancelled attempt is reported as completed",
    ),
    _m(
        "queue-retry-off-by-one",
        "_rules.py",
        "    if retry is not None and retry.allows(attempt):\n",
        "    if retry is not None and retry.allows(attempt + 1):\n",
        "the Retry policy allows one attempt fewer than configured",
    ),
    _m(
        "queue-max-retries-no-cause",
        "_rules.py",
        "    error.__cause__ = cause\n",
        "",
        "MaxRetriesExceeded does not carry the last error as __cause__",
    ),
    _m(
        "queue-periodic-failures-not-reset",
        "_outcomes.py",
        "        rec.failures = 0\n        if self.limiter is not None:\n"
        "            forget_limiter(self.name, self.limiter, env)\n",
        "        if self.limiter is not None:\n"
        "            forget_limiter(self.name, self.limiter, env)\n",
        "a periodic envelope's consecutive-failure count is not reset by an OK run",
    ),
    _m(
        "queue-blacklist-leaves-ready",
        "_outcomes.py",
        "        if any(rec.state is _READY for _env, rec in victims):\n",
        "        if False:\n",
        "StopType leaves the blacklisted type's READY envelopes in the ready queue",
    ),
    _m(
        "queue-buffered-delay-ignored",
        "_lifecycle.py",
        "                if not env._timed:\n                    delays[env] = env.delay\n",
        "                if not env._timed:\n                    delays[env] = rec.due\n",
        "envelopes buffered before start() ignore their delay",
    ),
    _m(
        "queue-deadline-not-recorded",
        "_attempt.py",
        "            w.expiry = _INF\n            w.fired = at\n",
        "            w.expiry = _INF\n",
        "the deadline timer cancels an overdue worker without noting why: a TIMEOUT counts as"
        " ERROR",
    ),
    # -- envq/_attempt.py: the attempt runner -------------------------------------------
    _m(
        "attempt-signals-order",
        "_attempt.py",
        "    (StopType, Outcome.STOP_TYPE),\n    (StopEnvelope, Outcome.STOP),\n",
        "    (StopEnvelope, Outcome.STOP),\n    (StopType, Outcome.STOP_TYPE),\n",
        "StopType is matched as its base StopEnvelope: the type is never blacklisted",
    ),
    _m(
        "attempt-user-timeout-is-timeout",
        "_attempt.py",
        "        if isinstance(exc, TimeoutError) and w.fired is not None:\n",
        "        if isinstance(exc, TimeoutError):\n",
        "a TimeoutError raised by user code counts as envq's TIMEOUT",
    ),
    _m(
        "attempt-stop-skips-after",
        "_attempt.py",
        "            except StopEnvelope as exc:\n                stopped = exc\n",
        "            except StopEnvelope as exc:\n"
        "                w.cancellable = False\n"
        "                return self.classify(w, env, exc), exc\n",
        "after does not run when before/invoke raised StopEnvelope",
    ),
    _m(
        "attempt-after-no-budget",
        "_attempt.py",
        "        limit = deadline_at if budget is None else min(deadline_at,"
        " self._clock.time() + budget)\n        self._set_limit(w, limit)\n",
        "        self._set_limit(w, deadline_at)\n",
        "the after hook runs without its own time budget",
    ),
    _m(
        "attempt-none-decision-retries",
        "_attempt.py",
        "        if decision is None:\n            return drop()\n",
        "        if decision is None:\n            return retry_now()\n",
        "on_failure returning None retries instead of dropping",
    ),
    _m(
        "attempt-stamps-inside-out",
        "_attempt.py",
        "        for stamp in reversed(env.stamps):\n"
        "            inner = stamp(inner)\n"
        "        for stamp in reversed(self.stamps):\n"
        "            inner = stamp(inner)\n",
        "        for stamp in reversed(self.stamps):\n"
        "            inner = stamp(inner)\n"
        "        for stamp in reversed(env.stamps):\n"
        "            inner = stamp(inner)\n",
        "queue stamps wrap inside the envelope's stamps instead of outside",
    ),
    _m(
        "attempt-stuck-not-counted",
        "_attempt.py",
        "                self.abandoned = True\n                stuck.count += 1\n",
        "                self.abandoned = True\n",
        "a thread the queue stopped waiting for is not counted as stuck",
    ),
    _m(
        "attempt-thread-result-not-awaited",
        "_attempt.py",
        "        if inspect.isawaitable(value):\n            value = await value\n",
        "",
        "an awaitable returned by a plain callable is not awaited",
    ),
    # -- envq/_timers.py -----------------------------------------------------------------
    _m(
        "timers-delay-not-rearmed-earlier",
        "_timers.py",
        "        heappush(self._heap, (due, tick, env))\n        if due < self._timer_at:\n",
        "        heappush(self._heap, (due, tick, env))\n        if self._timer is None:\n",
        "an envelope due earlier than the armed timer waits for that timer",
    ),
    _m(
        "timers-foreign-entry-fires",
        "_timers.py",
        "            if rec.tick != tick or rec.owner is not owner:\n",
        "            if rec.tick != tick:\n",
        "a stale heap entry fires an envelope that is now DELAYED in another queue (same tick)",
    ),
    _m(
        "timers-deadline-not-rearmed-earlier",
        "_timers.py",
        "        if at < self.armed_at:\n",
        "        if self._handle is None:\n",
        "a worker's earlier time limit waits for the limit already armed",
    ),
    _m(
        "timers-deadline-no-follow-up",
        "_timers.py",
        "        if following < math.inf:\n            self.arm(following)\n",
        "",
        "after firing, the deadline timer does not move on to the next worker's limit",
    ),
    # -- envq/_stats.py ------------------------------------------------------------------
    _m(
        "stats-live-not-counted",
        "_stats.py",
        "            by_state[live] += 1\n            used += 1\n",
        "            by_state[live] += 1\n",
        "statistics().capacity_used is always 0",
    ),
    _m(
        "stats-report-swapped",
        "_stats.py",
        "        completed=tuple(run.completed) if run else (),\n"
        "        cancelled=tuple(run.cancelled) if run else (),\n",
        "        completed=tuple(run.completed) if run else (),\n"
        "        cancelled=tuple(run.completed) if run else (),\n",
        "the stop report lists the completed attempts as cancelled too",
    ),
    # -- envq/_envelope.py ---------------------------------------------------------------
    _m(
        "envelope-equal-deadline-refused",
        "_envelope.py",
        "        if self.interval > 0 and self.deadline > self.interval:\n",
        "        if self.interval > 0 and self.deadline >= self.interval:\n",
        "a periodic envelope whose deadline equals its interval is refused",
    ),
    _m(
        "queue-lean-ignores-deadline",
        "_crew.py",
        "                    deadline = env.deadline\n",
        "                    deadline = 0.0\n",
        "an envelope without hooks or stamps runs its attempt inline, its deadline ignored",
    ),
    # -- envq/_limits.py -----------------------------------------------------------------
    _m(
        "limits-bucket-uncapped",
        "_limits.py",
        "            self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate)\n",
        "            self._tokens = self._tokens + elapsed * self.rate\n",
        "an idle token bucket saves up more than its burst",
    ),
    _m(
        "limits-backoff-off-by-one",
        "_limits.py",
        "        return capped_exponential(self.base, exp, self.cap)\n",
        "        return capped_exponential(self.base, exp + 1, self.cap)\n",
        "exponential backoff starts at 2·base instead of base",
    ),
    _m(
        "limits-fast-slow-off-by-one",
        "_limits.py",
        "        return self.fast if n <= self.fast_attempts else self.slow\n",
        "        return self.fast if n < self.fast_attempts else self.slow\n",
        "FastSlow gives one fast retry fewer than fast_attempts",
    ),
    _m(
        "limits-max-of-min",
        "_limits.py",
        "        return max([lim.when(env) for lim in self.limiters])\n",
        "        return min([lim.when(env) for lim in self.limiters])\n",
        "MaxOf answers the most lenient limiter instead of the strictest",
    ),
    # -- envq/_tasks.py and envq/_task.py -------------------------------------------------
    _m(
        "tasks-shutdown-drops-held",
        "_tasks.py",
        "                self._flush_held()\n                await queue.run_until_empty()\n",
        "                await queue.run_until_empty()\n",
        "shutdown() silently never runs tasks enqueued while the queue was stopped",
    ),
    _m(
        "tasks-start-drops-held",
        "_tasks.py",
        "        self.queue.start()\n        self._flush_held()\n",
        "        self.queue.start()\n",
        "start() after a cancelled run() leaves the tasks enqueued meanwhile held",
    ),
    _m(
        "tasks-single-attempt-max-retries",
        "_task.py",
        "            retry=self.retry if self._attempts_max != 1 else None,\n",
        "            retry=self.retry,\n",
        "a one-attempt task fails with MaxRetriesExceeded instead of its own error",
    ),
    _m(
        "tasks-requeue-refused",
        "_task.py",
        "            if self._owner is owner:\n                return False\n",
        "",
        "enqueueing a task already queued in the same queue raises instead of being a no-op",
    ),
    _m(
        "tasks-uncapped-zero",
        "_task.py",
        "        self._cap = cap if cap > 0 else _UNCAPPED\n",
        "        self._cap = cap\n",
        "max_timeout(0) caps the backoff at 0 s instead of meaning no cap",
    ),
    # -- envq/_background.py -------------------------------------------------------------
    _m(
        "background-closed-global-kept",
        "_background.py",
        "            _forget_global(self)\n            self._ready.set()\n",
        "            self._ready.set()\n",
        "the global background queue is not forgotten once shut down: submit() then refuses",
    ),
    _m(
        "background-shutdown-skips-tasks",
        "_background.py",
        "        await self._stop\n        await self.tasks.shutdown()\n",
        "        await self._stop\n",
        "a BackgroundQueue's shutdown() stops its loop without running the queued tasks",
    ),
    _m(
        "background-closed-global-reused",
        "_background.py",
        "        if tq is None or tq.closed:\n",
        "        if tq is None:\n",
        "after envq.shutdown() in a coroutine, the next submit() reuses the closed queue",
    ),
    _m(
        "background-shutdown-no-globals",
        "_background.py",
        "    chosen = list(queues) if queues else _globals(loop)\n",
        "    chosen = list(queues)\n",
        "envq.shutdown() with no queue named shuts nothing down",
    ),
)

#: Mutants tried and dropped because no test can tell them from the real code, and why.
#: (Any other survivor gets the test that kills it.)
EQUIVALENT: Final[Mapping[str, str]] = {
    "_crew.py Crew.expire: `if at <= limit` -> `if at < limit`": (
        "the deadline timer passes loop.time() plus the clock's resolution as the limit,"
        " and a loop runs a timer only once its time is less than one resolution away: a"
        " limit equal to the worker's to the last bit never reaches Crew.expire"
    ),
    "_timers.py DelayHeap._fire: `rec.tick != tick or rec.owner is not owner` ->"
    " `rec.owner is not owner`": (
        "an entry goes stale only when its envelope leaves DELAYED early: parked (the heap"
        " is cleared with it), blacklisted (its type stays refused by that queue) or handed"
        " back (the queue is TERMINATED); so it is never DELAYED in the same queue again"
        " while the stale entry is there, and an entry of this queue's envelope always has"
        " its current tick (the owner check is pinned: timers-foreign-entry-fires)"
    ),
}

#: The ``--quick`` sample, for CI: the three mutants of the issue that asked for this
#: check, and one or two per other file.
QUICK: Final = (
    "queue-internal-error-ignored",
    "queue-drained-ignores-hooks",
    "tasks-shutdown-drops-held",
    "queue-capacity-off-by-one",
    "attempt-signals-order",
    "timers-deadline-no-follow-up",
    "limits-backoff-off-by-one",
    "background-shutdown-skips-tasks",
)


# ---------------------------------------------------------------------------------------
# The list's validity, and applying a mutant
# ---------------------------------------------------------------------------------------


def problems(
    mutants: Sequence[CodeMutant], root: Path = ROOT, quick: Sequence[str] = QUICK
) -> list[str]:
    """What is wrong with the list against the source under ``root``: ids not unique,
    a snippet not found exactly once (a stale mutant), a mutated file that does not
    parse or whose code is unchanged, a quick id that names no mutant."""
    found: list[str] = []
    seen: set[str] = set()
    dumps: dict[str, str] = {}  # file -> its unmutated code's AST
    for mu in mutants:
        if mu.ident in seen:
            found.append(f"{mu.ident}: the id is used twice")
        seen.add(mu.ident)
        path = root / mu.file
        if not path.is_file():
            found.append(f"{mu.ident}: {mu.file} does not exist")
            continue
        source = path.read_text(encoding="utf-8")
        count = source.count(mu.original)
        if count != 1:
            found.append(
                f"{mu.ident}: its snippet occurs {count} times in {mu.file}, not once"
                " (the engine changed: update or drop the mutant)"
            )
            continue
        try:
            tree = ast.parse(mutated(mu, source), mu.file)
        except SyntaxError as exc:
            found.append(f"{mu.ident}: the mutated {mu.file} does not parse: {exc}")
            continue
        if mu.file not in dumps:
            dumps[mu.file] = ast.dump(ast.parse(source, mu.file))
        if ast.dump(tree) == dumps[mu.file]:
            found.append(f"{mu.ident}: the replacement changes no code")
    found += [f"{ident}: in QUICK but not a mutant" for ident in quick if ident not in seen]
    return found


def mutated(mu: CodeMutant, source: str) -> str:
    """``source`` with ``mu`` applied; ValueError naming the mutant if it is stale."""
    count = source.count(mu.original)
    if count != 1:
        raise ValueError(f"mutant {mu.ident}: snippet found {count} times in {mu.file}, not once")
    return source.replace(mu.original, mu.replacement)


#: Modification times for rewritten files: each rewrite gets a new whole second, which
#: invalidates any cached bytecode of the file (its header records the source's mtime in
#: whole seconds and its size, and a mutant may keep the size).
_MTIMES = itertools.count(int(time.time()) + 10)


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    stamp = next(_MTIMES)
    os.utime(path, (stamp, stamp))


@contextlib.contextmanager
def swapped(path: Path, text: str) -> Iterator[None]:
    """``path`` holds ``text`` while the block runs, then again what it held before."""
    before = path.read_text(encoding="utf-8")
    _write(path, text)
    try:
        yield
    finally:
        _write(path, before)


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------


class Slots:
    """One :class:`mutate.Runner` (with its own copy of the repository) per job; a
    mutant takes a free one, mutates its copy, runs, and puts the source back."""

    def __init__(self, runners: Sequence[Runner]) -> None:
        self.runners = list(runners)
        self._free: queue.SimpleQueue[Runner] = queue.SimpleQueue()
        for runner in runners:
            self._free.put(runner)

    def run(self, mu: CodeMutant) -> Result[CodeMutant]:
        runner = self._free.get()
        try:
            path = runner.copy / mu.file
            original = path.read_text(encoding="utf-8")
            with swapped(path, mutated(mu, original)):
                # A kill by a later stage is confirmed with the original put back.
                return runner.staged(mu, None, lambda: swapped(path, original))
        finally:
            self._free.put(runner)

    def close(self) -> None:
        for runner in self.runners:
            runner.close()


def report(results: Sequence[Result[CodeMutant]]) -> int:
    """Print the per-file counts, the survivors and the errors; the exit code."""
    print()
    print(f"{'file':<22} {'mutants':>7} {'killed':>7} {'survived':>9}")
    for file in dict.fromkeys(r.mutant.file for r in results):
        rows = [r for r in results if r.mutant.file == file]
        killed = sum(r.verdict in mutate.KILLED for r in rows)
        survived = sum(r.verdict in ("survived", "flaky") for r in rows)
        print(f"{file:<22} {len(rows):>7} {killed:>7} {survived:>9}")
    survivors = [r for r in results if r.verdict in ("survived", "flaky")]
    errors = [r for r in results if r.verdict == "error"]
    if survivors:
        print(f"\nSURVIVORS ({len(survivors)}): a behavioural test is missing for each")
        for r in survivors:
            note = "  [only a non-reproducible failure]" if r.verdict == "flaky" else ""
            print(f"  {r.mutant.ident} ({r.mutant.file}): {r.mutant.description}{note}")
    if errors:
        mutate.print_errors(errors)
        return 2
    return 1 if survivors else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the fixed CI sample (QUICK)")
    parser.add_argument("--only", action="append", metavar="ID", help="only this mutant")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    mutate.add_runner_options(parser)
    args = parser.parse_args(argv)

    stale = problems(MUTANTS)
    if stale:
        print("the mutant list does not match the source:")
        print("\n".join(f"  {line}" for line in stale))
        return 2
    chosen = list(MUTANTS)
    if args.quick:
        chosen = [mu for mu in chosen if mu.ident in QUICK]
    if args.only:
        unknown = set(args.only) - {mu.ident for mu in MUTANTS}
        if unknown:
            parser.error(f"no such mutant: {', '.join(sorted(unknown))} (see --list)")
        chosen = [mu for mu in chosen if mu.ident in args.only]
    if args.list:
        for mu in chosen:
            print(f"{mu.ident:<40} {mu.file:<20} {mu.description}")
        print(f"{len(chosen)} mutants")
        print(f"\ndropped as equivalent ({len(EQUIVALENT)}):")
        for change, reason in EQUIVALENT.items():
            print(f"  {change}\n      {reason}")
        return 0
    signal.signal(signal.SIGTERM, mutate.interrupt)  # clean up (children, copies) on kill
    jobs = max(1, min(args.jobs, len(chosen)))
    copies = [mutate.copy_repo() for _ in range(jobs)]
    files = mutate.behavioural_files(copies[0], args.exclude or (), args.include or ())
    slots = Slots([Runner(copy, args.idle, files) for copy in copies])
    mutate.RUNNERS.extend(slots.runners)
    try:
        return _run(args, slots, chosen)
    except KeyboardInterrupt:
        slots.close()
        print("interrupted")
        return 130
    finally:
        for copy in copies:
            if args.keep:
                print(f"kept {copy}")
            else:
                shutil.rmtree(copy, ignore_errors=True)


def _run(args: argparse.Namespace, slots: Slots, chosen: Sequence[CodeMutant]) -> int:
    started = time.monotonic()
    warming = [threading.Thread(target=runner.warm) for runner in slots.runners]
    for thread in warming:
        thread.start()
    for thread in warming:
        thread.join()
    first = slots.runners[0]
    base = mutate.baseline(first, args.timeout)
    if base is None:
        return 2
    for runner in slots.runners[1:]:
        runner.timeouts = list(first.timeouts)
    mutate.announce(len(chosen), len(slots.runners), first, base)
    results = mutate.run_all(
        slots.run,
        chosen,
        len(slots.runners),
        verbose=args.verbose,
        expected=lambda mu: False,
        close=slots.close,
    )
    code = report(results)
    mutate.summary(results, started)
    return code


if __name__ == "__main__":
    sys.exit(main())
