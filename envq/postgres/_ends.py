"""The end of an attempt on PostgreSQL, as far as a node decides it: the failure
decision before the end commits, the hooks that report it after, and the reaping of
an attempt whose lease expired.

Fencing reaches the hooks (docs/postgres.md, "Which hooks run for an attempt"): a
*deciding* hook (``on_failure`` of a ``DECIDE`` row) runs only while the attempt's lease
holds, checked by its ``hold`` (the node asks ``envq.hold``; a reaper holds the
expired row locked); a *reporting* hook (``on_success``, an ``on_failure`` that only
reports) runs after the end committed, only for an end the database accepted. The
target of every move is the database's to compute from the tables.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias, assert_never

import attrs

from envq._attempt import Runner, Worker
from envq._envelope import Envelope
from envq._errors import MaxRetriesExceeded
from envq._machine import OUTCOMES, Action, DecisionKind, EnvState, Kind, Outcome
from envq._reports import ErrorInfo
from envq._rules import exhausted, failure, hook_number
from envq._schedule import Timing
from envq._values import Retry, Schedule
from envq.postgres._codec import calendar, decode, fire_wait
from envq.postgres._edges import lost
from envq.postgres._sql import SHARE_QUEUE
from envq.postgres.schema import discardable

if TYPE_CHECKING:
    import asyncpg

__all__ = [
    "REAP_FLOOR",
    "RETIRE_BATCH",
    "RETIRE_EVERY",
    "Decided",
    "Ended",
    "Reaper",
    "decide",
    "error_json",
    "next_run",
    "report",
    "spent",
    "without_code",
]

log = logging.getLogger("envq.postgres")

#: A row of ``envq.envelopes`` as the driver returns it.
Row = Any
#: A pooled connection, as the pool lends it.
_Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"
_Cause: TypeAlias = BaseException | None
#: How often a node applies the queue's retention, and how many rows a statement of it
#: removes at most (a backlog of old rows goes a batch a minute per node).
RETIRE_EVERY: Final = 60.0
#: The shortest pause between a node's reaper rounds, in seconds. A lease's expiry is
#: found a third of a lease late at most anyway; a node polling fast for its sends
#: (a short ``poll``) would otherwise scan the running rows that often for nothing.
REAP_FLOOR: Final = 0.25
RETIRE_BATCH: Final = 10_000
_ENDED_STATES: Final = [state.value for state in discardable()]
_RETIRE_ENVELOPES: Final = """
DELETE FROM envq.envelopes WHERE seq IN (
    SELECT seq FROM envq.envelopes
     WHERE queue = $1 AND state = ANY($2::envq.envelope_state[])
       AND updated_at < clock_timestamp() - $3 * interval '1 second'
     LIMIT $4 FOR UPDATE SKIP LOCKED)
"""
_RETIRE_JOURNAL: Final = """
DELETE FROM envq.journal WHERE n IN (
    SELECT n FROM envq.journal
     WHERE queue = $1 AND at < clock_timestamp() - $2 * interval '1 second'
     ORDER BY n LIMIT $3 FOR UPDATE SKIP LOCKED)
"""

#: What a node decides of an attempt's end: the failure decision (None: the row's own
#: target), the seconds to the next run (None: the database computes it from the
#: row's FIXED_DELAY / FIXED_RATE schedule), and the failures in a row of a periodic
#: envelope (None: unchanged).
Decided: TypeAlias = tuple[DecisionKind | None, float | None, int | None]

#: An expired attempt's row, locked for its reaper; none when another reaper holds it
#: (SKIP LOCKED) or the attempt ended meanwhile.
_REAPABLE: Final = """
SELECT e.*, clock_timestamp() AS reaped_at FROM envq.envelopes AS e
 WHERE seq = $1 AND lease_token = $2 AND state = 'running'
   AND lease_expires_at <= clock_timestamp()
   FOR UPDATE SKIP LOCKED
"""

#: How the reaper tries to end an expired attempt: decided, else as a dropped failure
#: (whether it is dropped, and what the log says when the try fails).
_REAP_TRIES: Final = ((False, "it ends as a dropped failure"), (True, "the next round tries again"))

#: A NULL delay: the next run of the row's FIXED_DELAY / FIXED_RATE schedule. The
#: clock is read once: the move's time and what its due time is measured from.
_EXPIRE: Final = """
SELECT envq.expire($1, $2, $3::envq.decision_kind,
                   coalesce(n.t + $4::float8 * interval '1 second',
                            (SELECT envq.next_due(e.schedule, e.interval_s, e.due_at, n.t)
                               FROM envq.envelopes AS e WHERE e.seq = $1)), $5, $6::jsonb, n.t)
  FROM (SELECT clock_timestamp() AS t) AS n
"""


@attrs.frozen
class Ended:
    """An attempt's end as the database committed it: the envelope's state and its row
    group (``blacklisted``: its type was banned while it ran, and no hook runs)."""

    state: str
    kind: str


def without_code(
    queue: str,
    node: str,
    row: Row,
    outcome: Outcome,
    error: Exception,
    started: float,
    started_db: float | None,
) -> tuple[DecisionKind | None, float | None, int | None]:
    """The end of an attempt of an envelope whose code this node cannot import (a
    node of an older deploy): a failed attempt, decided from the row's data alone.
    A one-off envelope is retried under its ``Retry`` policy (so that a node with
    the code may run it), and fails once the policy allows no more attempts; a
    periodic one runs again on its schedule. Its ``on_failure`` hook is not called
    (this node cannot import it either). Logged at WARNING."""
    kind = Kind(row["kind"])
    attempt = int(row["attempt"])
    what = f"queue {queue!r}: envelope {row['seq']} cannot run on node {node!r} ({error})"
    match OUTCOMES[(kind, outcome)].action:
        case Action.DECIDE:
            try:
                retry = None if row["retry"] is None else Retry(**json.loads(row["retry"]))
            except (TypeError, ValueError):
                retry = None
            f = failure(periodic=False, hooked=False, retry=retry, attempt=attempt, failures=0)
            if f.decision is not None:
                log.warning(
                    "%s: attempt %d failed; retried in %.3g s under its retry policy",
                    what,
                    attempt,
                    f.delay,
                )
                return f.decision, f.delay, None
            log.warning("%s: attempt %d failed, and its retry policy allows no more", what, attempt)
            return DecisionKind.DROP, 0.0, None
        case Action.DECIDE_PERIODIC:
            f = failure(
                periodic=True,
                hooked=False,
                retry=None,
                attempt=attempt,
                failures=int(row["failures"]),
            )
            failures = f.failures
            try:
                timing: Timing = (
                    Schedule(row["schedule"])
                    if row["cron"] is None
                    else calendar(row["cron"], row["cron_tz"])
                )
                interval = float(row["interval_s"])
                wait = next_run(timing, interval, row, started, started_db)
            except Exception as bad:  # its calendar cannot be read here either
                log.warning("%s: this run failed, and no next run can be found (%s)", what, bad)
                return DecisionKind.DROP, 0.0, failures
            log.warning("%s: this run failed; the next runs as scheduled", what)
            return None, wait, failures
        case _:
            log.warning("%s: its attempt ends as the tables say for %s", what, outcome.value)
            return None, 0.0, None


def next_run(
    timing: Timing, interval: float, row: Row, started: float, started_db: float | None
) -> float | None:
    """Seconds from now to a periodic envelope's next run; None for FIXED_DELAY and
    FIXED_RATE, whose next run the database computes from the row (the grid from
    its scheduled start, whatever node ran it and however late it was claimed).

    A calendar's next run is its first fire after the attempt ended and after the
    fire this run was due at, so no fire runs twice. "Now" is the database's clock:
    its time ``started_db`` (None: the claim's, the row's ``updated_at``) when this
    node's monotonic clock read ``started``, plus the time since, so this node's
    wall clock plays no part.
    """
    schedule = timing
    if isinstance(schedule, Schedule):
        return None
    if started_db is None:
        started_db = row["updated_at"].timestamp()
    now = started_db + (time.monotonic() - started)
    due = row["due_at"]
    previous = now if due is None else due.timestamp()
    fire = schedule.next_run(interval, previous, previous, now, 0.0)
    return fire_wait(fire, now)


async def decide(
    runner: Runner,
    w: Worker,
    env: Envelope,
    row: Row,
    outcome: Outcome,
    cause: _Cause,
    clock: tuple[float, float | None],
    hold: Callable[[], Awaitable[Kind | None]],
) -> tuple[DecisionKind | None, float | None, int | None] | None:
    """The row of the outcome table for this attempt, decided as far as a node
    decides before its end commits: the failure decision (``on_failure``, run only
    once ``hold()`` says the lease holds, else the retry policy) and the delay before
    the next run (the target itself is the database's to compute). ``(decision,
    delay, failures)``, or None when the lease lapsed before ``on_failure`` could
    run. ``clock``: this node's monotonic clock when the database's read the second
    (None: the claim's, the row's ``updated_at``)."""
    kind = Kind(row["kind"])
    action = OUTCOMES[(kind, outcome)].action
    attempt = int(row["attempt"])
    started, started_db = clock
    match action:
        case Action.SUCCEED:
            return None, 0.0, None
        case Action.RESCHEDULE:
            return None, next_run(env.schedule, env.interval, row, started, started_db), 0
        case Action.DECIDE | Action.DECIDE_PERIODIC:
            f = failure(
                periodic=action is Action.DECIDE_PERIODIC,
                hooked=env.on_failure is not None,
                retry=env.retry,
                attempt=attempt,
                failures=int(row["failures"]),
            )
            if f.hook is not None:
                held = await hold()
                if held is None:
                    return None
                if held is not kind:  # relabelled meanwhile (banned, cancelled): no hook
                    return None, 0.0, f.failures
                decision = await runner.on_failure(w, env, cause, f.hook)
                return decision.kind, decision.delay, f.failures
            if f.next_run:
                wait = next_run(env.schedule, env.interval, row, started, started_db)
                return None, wait, f.failures
            return f.decision, f.delay, None
        case Action.REPORT_FAILURE | Action.END | Action.SHELVE | Action.BLACKLIST:
            return None, 0.0, None
        case _:
            assert_never(action)


def spent(queue: str, env: Envelope, row: Row, outcome: Outcome, cause: _Cause) -> _Cause:
    """The error an attempt's end reports: for a one-off failure whose retry policy
    allows no more attempts (and no ``on_failure`` decides), ``MaxRetriesExceeded``
    chained to the attempt's own error (as in one process); else that error."""
    if OUTCOMES[(Kind(row["kind"]), outcome)].action is not Action.DECIDE:
        return cause
    if env.on_failure is not None:
        return cause
    return exhausted(f"queue {queue!r}", env.label(), env.retry, int(row["attempt"]), cause)


def error_json(error: _Cause) -> str | None:
    """An error as the row keeps it (``last_error``, an attempt of ``history``)."""
    if error is None:
        return None
    info = ErrorInfo.of(error)
    return json.dumps({"type": info.type, "message": info.message, "traceback": info.traceback})


async def report(
    runner: Runner,
    name: str,
    w: Worker,
    env: Envelope,
    row: Row,
    outcome: Outcome,
    cause: _Cause,
    ended: Ended,
    dead_letter: Callable[[Envelope, _Cause], None] | None = None,
) -> None:
    """After an end committed: the hooks and log lines that report it, at most once
    per committed end (never for one the database refused): ``on_success``, a
    report-only ``on_failure``, a spent retry policy's log line, and the dead letter of
    an envelope that ended FAILED (``cause``: its error, ``MaxRetriesExceeded`` for a
    spent policy). An envelope relabelled while it ran (banned, cancelled) ends with
    no hook."""
    kind = Kind(ended.kind)
    if dead_letter is not None and ended.state == EnvState.FAILED.value:
        dead_letter(env, cause)
    action = OUTCOMES[(kind, outcome)].action
    match action:
        case Action.SUCCEED | Action.RESCHEDULE:
            await runner.on_success(w, env)
        case Action.REPORT_FAILURE:
            if env.on_failure is not None:
                periodic = kind is Kind.PERIODIC
                number = hook_number(periodic, int(row["failures"]), int(row["attempt"]))
                await runner.on_failure(w, env, cause, number)
        case Action.DECIDE:
            if isinstance(cause, MaxRetriesExceeded):
                log.info("queue %r: %s", name, cause)
        case Action.DECIDE_PERIODIC | Action.END | Action.SHELVE | Action.BLACKLIST:
            pass
        case _:
            assert_never(action)


class Reaper:
    """Ends the attempts of a queue whose lease expired, on any node: each decided by
    the envelope's own policy (the ``EXPIRED`` outcome, TIMEOUT's rows) under the
    expired row's lock, so that two reapers at once decide it once.

    :param name: the queue; ``node``: this node's lease owner (for the log).
    :param runner: the node's attempt runner (its hooks' budgets).
    :param epoch: the node's run, now; ``counts``: its counters (``reaped``);
        ``wake``: tell the node something changed; ``dead_letter``: hand it an
        envelope its reaping ended FAILED (after the end committed).
    """

    def __init__(
        self,
        name: str,
        node: str,
        runner: Runner,
        epoch: Callable[[], int],
        counts: dict[str, int],
        wake: Callable[[], None],
        dead_letter: Callable[[Envelope, _Cause], None] | None = None,
    ) -> None:
        self.name = name
        self._dead_letter = dead_letter
        self._node = node
        self._runner = runner
        self._epoch = epoch
        self._counts = counts
        self._wake = wake

    async def reap(self, conn: _Conn) -> None:
        """End the attempts of the queue whose lease expired (at most 100 a round)."""
        import asyncpg  # noqa: PLC0415

        rows = await conn.fetch(
            "SELECT seq, lease_token FROM envq.envelopes WHERE queue = $1"
            " AND state = 'running' AND lease_expires_at <= clock_timestamp()"
            " ORDER BY seq LIMIT 100",
            self.name,
        )
        for row in rows:
            # One bad row (a next run the database cannot compute) must not keep the
            # rows after it from being reaped, nor the keeper from its round: it ends
            # as a dropped failure, else the next round tries again.
            for dropped, then in _REAP_TRIES:
                try:
                    await self._reap_one(conn, row["seq"], row["lease_token"], dropped=dropped)
                    break
                except lost(asyncpg):
                    raise
                except Exception as error:
                    log.error(
                        "queue %r: could not reap envelope %s (%s); %s",
                        self.name,
                        row["seq"],
                        error,
                        then,
                    )

    async def _reap_one(
        self, conn: _Conn, seq: int, token: object, *, dropped: bool = False
    ) -> None:
        """End one expired attempt: decided (``on_failure`` called) by the one reaper
        that holds its row, so that two nodes reaping at once do not both decide.
        ``dropped``: end it as a dropped failure, without deciding (its decided end
        could not be written)."""
        async with conn.transaction():
            row = await conn.fetchrow(_REAPABLE, seq, token)
            if row is None:  # another reaper holds it, or it ended meanwhile
                return
            started = time.monotonic()
            delay: float | None
            decision: str | None
            if dropped:
                decision, delay, failures = DecisionKind.DROP.value, 0.0, None
                await conn.execute(SHARE_QUEUE, self.name)
                ended = await conn.fetchval(_EXPIRE, seq, token, decision, delay, failures, None)
                self._reaped(seq, row, ended)
                return
            env: Envelope | None = None
            kept: _Cause = None
            try:
                env = decode(row)
            except Exception as error:  # its code is missing on this node
                kept = error
                kind_, delay, failures = without_code(
                    self.name,
                    self._node,
                    row,
                    Outcome.EXPIRED,
                    error,
                    started,
                    row["reaped_at"].timestamp(),
                )
                decision = None if kind_ is None else kind_.value
            else:
                w = Worker(self._epoch())
                w.task = asyncio.current_task()
                cause = TimeoutError(
                    f"queue {self.name!r}: the lease of attempt {row['attempt']} of "
                    f"{env.label()} (node {row['lease_owner']!r}) expired"
                )
                locked = Kind(row["kind"])

                async def hold() -> Kind | None:
                    return locked  # this reaper holds the row locked: the lease is its

                decided = await decide(
                    self._runner,
                    w,
                    env,
                    row,
                    Outcome.EXPIRED,
                    cause,
                    (started, row["reaped_at"].timestamp()),
                    hold,
                )
                assert decided is not None  # the hold above always holds
                kind, delay, failures = decided
                decision = None if kind is None else kind.value
                kept = spent(self.name, env, row, Outcome.EXPIRED, cause)
            # The queue's lock before the instant of the move is read: a lifecycle call
            # committed while it waited comes before the move, in time too.
            await conn.execute(SHARE_QUEUE, self.name)
            ended = await conn.fetchval(
                _EXPIRE, seq, token, decision, delay, failures, error_json(kept)
            )
        self._reaped(seq, row, ended)
        if env is not None and ended == EnvState.FAILED.value and self._dead_letter is not None:
            self._dead_letter(env, kept)

    def _reaped(self, seq: int, row: Row, ended: str | None) -> None:
        if ended is not None:
            self._counts["reaped"] += 1
            log.info(
                "queue %r: reaped envelope %s (lease of node %r expired): %s",
                self.name,
                seq,
                row["lease_owner"],
                ended,
            )
            self._wake()

    async def retire(self, conn: _Conn, age: float) -> None:
        """Remove one batch of the queue's ended envelopes, and of its journal's rows,
        older than ``age`` seconds: off the hot path, a statement each a minute per
        node (rows another node is removing are skipped, not waited for)."""
        envelopes = await conn.execute(
            _RETIRE_ENVELOPES, self.name, _ENDED_STATES, age, RETIRE_BATCH
        )
        journal = await conn.execute(_RETIRE_JOURNAL, self.name, age, RETIRE_BATCH)
        removed = int(envelopes.rsplit(" ", 1)[-1]) + int(journal.rsplit(" ", 1)[-1])
        if removed:
            log.info("queue %r: retention removed %d rows older than %g s", self.name, removed, age)
