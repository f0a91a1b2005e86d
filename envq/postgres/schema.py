"""The SQL of envq's tables in PostgreSQL, generated from ``envq._machine``.

Theory of operation
-------------------
Every state, event and guard here comes from the runtime tables; nothing is written
twice. The generated SQL (:func:`render`) creates, in the schema ``envq``:

* enums for the envelope states (``NEW`` is not one: it is the state of an envelope
  not yet in a queue, so a row is born by the ``send`` move instead), the queue's
  lifecycle states, the lifecycle calls, the envelope events (queue-side events by
  their value, the ends of an attempt as ``attempt_<outcome>``), the outcome-table
  kinds, stop modes, failure decisions and cancel causes;
* ``queues``: one lifecycle row per named queue; ``envelopes``: one row per envelope
  per stay in a queue, with a unique index on ``(queue, id)`` among live envelopes
  (the dedup key) and the lease columns a worker will hold;
* ``envelope_target(...)``: the state an event leads an envelope to in a situation,
  exactly :func:`envq._machine.target`, compiled into nested ``CASE`` expressions by
  enumerating ``target`` over every state, event and guard valuation and branching
  only on the guards a pair depends on; ``queue_target`` and ``queue_refusal`` do the
  same for the lifecycle table;
* two triggers that refuse every change of state the tables do not allow;
* attempts under leases: ``claim`` starts attempts on ready envelopes (``FOR UPDATE
  SKIP LOCKED``), each with a lease (a token, an owner, an expiry on the database's
  clock); ``renew`` extends, in one statement, the leases whose tokens a node knows
  it holds (never one it does not know of: a claim whose reply was lost is taken back
  by ``adopt``, or expires); ``hold`` fences a decision: before ``on_failure`` runs,
  the lease must still hold, and is extended over the hook's budget; ``finish`` ends an
  attempt where the tables lead, only while its token holds, and records the token
  (``ended_token``) so that a node that lost the reply can tell that it committed;
* schedules: the ``cron`` and ``cron_tz`` columns of a calendar envelope, and
  ``next_due``, the next run of a FIXED_DELAY or FIXED_RATE envelope (the grid from the
  row's scheduled start), which the end of an attempt uses when a node passes no delay;
* an optional journal (``envq.journal``): every move of a queue whose
  ``queues.journal`` is true, appended by the triggers (off by default).

A state-changing statement names its move: it writes the event (``event`` for an
envelope, ``call`` for a queue) and the guard values that only the mover knows
(``decision``, ``cause``, ``wait``, ``limited``) in the same ``UPDATE`` or
``INSERT``. The trigger reads the rest from the database (the envelope's ``kind``,
its queue's lifecycle ``state`` and ``stop_mode``), asks ``envelope_target`` for the
one allowed target, refuses the statement unless the new state is that target, and
clears the move columns, so a later statement cannot reuse a stale event: a change of
state without an event is refused.

``python -m envq.postgres.schema`` prints the SQL; ``specs/postgres.sql`` is a
generated copy that ``tests/postgres/test_pg_schema.py`` keeps fresh.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Final

from envq._machine import (
    DISPATCHING,
    KIND_OF,
    LIFECYCLE,
    LIVE_STATES,
    RELABEL,
    CancelCause,
    DecisionKind,
    EnvEvent,
    EnvState,
    Kind,
    LifeAction,
    Outcome,
    QueueCall,
    QueueState,
    Situation,
    StopMode,
    moved_by,
    target,
)
from envq._reports import STORY_LIMIT
from envq._values import Schedule

__all__ = [
    "COMPATIBLE_FROM",
    "ENVELOPE_EVENTS",
    "GUARDS",
    "INITIAL_QUEUE_STATE",
    "REFUSED_CALL",
    "REFUSED_ENVELOPE_MOVE",
    "REFUSED_QUEUE_MOVE",
    "SCHEMA",
    "SCHEMA_VERSION",
    "STORED_STATES",
    "event_label",
    "main",
    "render",
]

#: The PostgreSQL schema every object is created in.
SCHEMA: Final = "envq"
#: The version of the generated schema, recorded in ``envq.schema_version``; a later
#: release migrates from it.
SCHEMA_VERSION: Final = 5
#: The oldest schema version whose envq runs on this schema: a release whose schema
#: keeps what an older release's nodes call sets it lower, and both share a queue
#: during a rolling upgrade (docs/postgres.md, "Upgrades").
COMPATIBLE_FROM: Final = 4

#: SQLSTATE of an envelope move the tables do not allow.
REFUSED_ENVELOPE_MOVE: Final = "EQ001"
#: SQLSTATE of a queue (lifecycle) move the tables do not allow.
REFUSED_QUEUE_MOVE: Final = "EQ002"
#: SQLSTATE of a lifecycle call the tables reject in the queue's state (the message
#: names the error the in-process queue raises, e.g. ``QueueStopping``).
REFUSED_CALL: Final = "EQ003"

#: The states an envelope row can be in: every state but ``NEW``.
STORED_STATES: Final[tuple[EnvState, ...]] = tuple(s for s in EnvState if s is not EnvState.NEW)
#: Every event of the envelope machine: the queue-side ones, then the outcomes.
ENVELOPE_EVENTS: Final[tuple[EnvEvent | Outcome, ...]] = (*EnvEvent, *Outcome)
#: The lifecycle state a queue row is created in.
INITIAL_QUEUE_STATE: Final = QueueState.INIT

#: The guards of :class:`envq._machine.Situation`, in the order the generated
#: ``CASE`` branches on them, with every value each can take.
GUARDS: Final[tuple[tuple[str, tuple[object, ...]], ...]] = (
    ("kind", tuple(Kind)),
    ("queue", tuple(QueueState)),
    ("wait", (False, True)),
    ("decision", (None, *DecisionKind)),
    ("cause", (None, *CancelCause)),
    ("mode", tuple(StopMode)),
    ("limited", (False, True)),
)


def event_label(event: EnvEvent | Outcome) -> str:
    """The SQL label of an envelope event: a queue-side event by its value, the end of
    an attempt as ``attempt_<outcome>`` (``stop`` is both an event and an outcome)."""
    return f"attempt_{event.value}" if isinstance(event, Outcome) else event.value


# ---------------------------------------------------------------------------------------
# SQL text helpers
# ---------------------------------------------------------------------------------------


def _q(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def _label(value: object) -> str:
    if isinstance(value, EnvEvent | Outcome):
        return event_label(value)
    if isinstance(value, Enum):
        return str(value.value)
    raise TypeError(value)


_TYPES: Final[Mapping[str, str]] = {
    "state": f"{SCHEMA}.envelope_state",
    "event": f"{SCHEMA}.envelope_event",
    "kind": f"{SCHEMA}.envelope_kind",
    "queue": f"{SCHEMA}.queue_state",
    "decision": f"{SCHEMA}.decision_kind",
    "cause": f"{SCHEMA}.cancel_cause",
    "mode": f"{SCHEMA}.stop_mode",
    "wait": "boolean",
    "limited": "boolean",
}


def _condition(name: str, values: Sequence[object]) -> str:
    """``name`` takes one of ``values`` (None is SQL NULL, booleans are tested as such)."""
    parts: list[str] = []
    if None in values:
        parts.append(f"{name} IS NULL")
    if True in values and False in values:
        parts.append(f"{name} IS NOT NULL")
    elif True in values:
        parts.append(name)
    elif False in values:
        parts.append(f"NOT {name}")
    labels = [_label(v) for v in values if v is not None and not isinstance(v, bool)]
    if len(labels) == 1:
        parts.append(f"{name} = {_q(labels[0])}")
    elif labels:
        parts.append(f"{name} IN ({', '.join(_q(x) for x in labels)})")
    return " OR ".join(parts) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------
# The envelope machine, compiled
# ---------------------------------------------------------------------------------------

_Point = tuple[object, ...]


@functools.cache
def _situations() -> tuple[tuple[_Point, Situation], ...]:
    """Every guard valuation, as a point (values in ``GUARDS`` order) and a Situation."""
    names = [name for name, _ in GUARDS]
    return tuple(
        (point, Situation(**dict(zip(names, point, strict=True))))  # type: ignore[arg-type]
        for point in itertools.product(*(values for _, values in GUARDS))
    )


def _targets(
    source: EnvState, event: EnvEvent | Outcome, decide: Callable[..., EnvState | None]
) -> dict[_Point, EnvState | None]:
    """The target of ``(source, event)`` in every situation; a move back to NEW (a
    discard: the row leaves the table) is no state a row can be updated to, so it
    counts as none here (``envq.discardable`` and the delete trigger allow it)."""
    found = {point: decide(source, event, situation) for point, situation in _situations()}
    return {point: None if to is _NEW else to for point, to in found.items()}


_NEW: Final = EnvState.NEW


def _handed_back() -> EnvState:
    """The state of an envelope ``terminate()`` hands back (its row then leaves)."""
    found = target(EnvState.PARKED, EnvEvent.TERMINATE, Situation())
    assert found is not None
    return found


def discardable(decide: Callable[..., EnvState | None] = target) -> tuple[EnvState, ...]:
    """The stored states a discard moves back to NEW (their rows may be deleted)."""
    return tuple(
        state
        for state in STORED_STATES
        if any(decide(state, EnvEvent.DISCARD, c) is _NEW for _, c in _situations())
    )


def _depends(table: Mapping[_Point, EnvState | None], index: int) -> bool:
    """Two points of ``table`` that differ only in guard ``index`` have different targets."""
    seen: dict[_Point, EnvState | None] = {}
    for point, to in table.items():
        rest = point[:index] + point[index + 1 :]
        if seen.setdefault(rest, to) is not to:
            return True
    return False


def _branch(table: Mapping[_Point, EnvState | None], depth: int) -> str:
    """The SQL expression choosing the target among the points of ``table`` (a part of
    the guard space): a leaf when the target is the same everywhere there, else a
    ``CASE`` on the first guard it depends on, values leading to the same expression
    grouped into one branch."""
    found = set(table.values())
    if len(found) == 1:
        (only,) = found
        return "NULL" if only is None else f"{_q(only.value)}::{_TYPES['state']}"
    index = next(i for i in range(len(GUARDS)) if _depends(table, i))
    name, values = GUARDS[index]
    groups: dict[str, list[object]] = {}
    for value in values:
        part = {point: to for point, to in table.items() if point[index] == value}
        groups.setdefault(_branch(part, depth + 1), []).append(value)
    pad = "    " * (depth + 1)
    whens = "".join(
        f"\n{pad}    WHEN {_condition(name, vals)} THEN {expr}" for expr, vals in groups.items()
    )
    return f"CASE{whens}\n{pad}END"


def _envelope_target_body(decide: Callable[..., EnvState | None] = target) -> str:
    """The body of ``envelope_target``: one branch per (state, event) pair the tables
    define, in declaration order; every other pair yields NULL."""
    whens: list[str] = []
    for source in EnvState:
        for event in ENVELOPE_EVENTS:
            table = _targets(source, event, decide)
            if all(to is None for to in table.values()):
                continue
            state = "state IS NULL" if source is EnvState.NEW else f"state = {_q(source.value)}"
            whens.append(
                f"\n    WHEN {state} AND event = {_q(event_label(event))}\n"
                f"    THEN {_branch(table, 1)}"
            )
    return "SELECT CASE" + "".join(whens) + "\n  END"


# ---------------------------------------------------------------------------------------
# The lifecycle, compiled
# ---------------------------------------------------------------------------------------


def _queue_target_body() -> str:
    whens = [
        f"\n    WHEN state = {_q(state.value)} AND call = {_q(call.value)}"
        f" THEN {_q(row.target.value)}::{_TYPES['queue']}"
        for (state, call), row in LIFECYCLE.items()
        if row.target is not None
    ]
    return "SELECT CASE" + "".join(whens) + "\n  END"


def _queue_refusal_body() -> str:
    whens = [
        f"\n    WHEN state = {_q(state.value)} AND call = {_q(call.value)}"
        f" THEN {_q(row.error.__name__)}"
        for (state, call), row in LIFECYCLE.items()
        if row.action is LifeAction.REJECT and row.error is not None
    ]
    return "SELECT CASE" + "".join(whens) + "\n  END"


# ---------------------------------------------------------------------------------------
# The whole schema
# ---------------------------------------------------------------------------------------


def _enum(name: str, labels: Iterable[str], comment: str) -> str:
    body = ",\n".join(f"    {_q(label)}" for label in labels)
    return (
        f"CREATE TYPE {SCHEMA}.{name} AS ENUM (\n{body}\n);\n"
        f"COMMENT ON TYPE {SCHEMA}.{name} IS {_q(comment)};\n"
    )


def _in(states: Iterable[EnvState]) -> str:
    return ", ".join(_q(s.value) for s in sorted(states, key=STORED_STATES.index))


_ENVELOPE_CHECK: Final = """\
CREATE FUNCTION envq.envelopes_check() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    source envq.envelope_state;
    row_kind envq.envelope_kind;
    queue_now envq.queue_state;
    mode_now envq.stop_mode;
    allowed envq.envelope_state;
    rejected text;
    journal_on boolean;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.queue IS DISTINCT FROM OLD.queue THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: envelope %s cannot move from queue %L to queue %L',
                                 OLD.seq, OLD.queue, NEW.queue);
        END IF;
        -- A running envelope's row group is relabelled (its type banned, an operator's
        -- cancel); an operator's retry gives it its own group back.
        IF NEW.kind IS DISTINCT FROM OLD.kind
           AND NOT (OLD.state = '{running}' AND NEW.kind IN ({relabels}))
           AND NOT (NEW.event IS NOT DISTINCT FROM '{retry}' AND NEW.kind IN ({own_kinds}))
        THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: envelope %s cannot change kind from %s to %s '
                                 '(only a running one is relabelled, to %s; a retry gives '
                                 'it its own back)', OLD.seq, OLD.kind, NEW.kind,
                                 '{relabels_text}');
        END IF;
        IF NEW.event IS NULL THEN
            IF NEW.state IS DISTINCT FROM OLD.state THEN
                RAISE EXCEPTION USING ERRCODE = '{refused}',
                    MESSAGE = format('envq: envelope %s of queue %L: %s -> %s names no event '
                                     '(set the column event in the same statement)',
                                     OLD.seq, OLD.queue, OLD.state, NEW.state);
            END IF;
            NEW.decision := NULL; NEW.cause := NULL; NEW.wait := NULL; NEW.limited := NULL;
            RETURN NEW;
        END IF;
        source := OLD.state;
        row_kind := OLD.kind;
    ELSE
        source := NULL;
        row_kind := NEW.kind;
    END IF;
    SELECT q.state, q.stop_mode, q.journal INTO queue_now, mode_now, journal_on
      FROM envq.queues AS q WHERE q.name = NEW.queue;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: there is no queue named %L', NEW.queue);
    END IF;
    IF TG_OP = 'INSERT' THEN
        rejected := envq.queue_refusal(queue_now, 'send');
        IF rejected IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = '{rejected}',
                MESSAGE = format('envq: queue %L is %s: send is rejected (%s)',
                                 NEW.queue, queue_now, rejected);
        END IF;
    END IF;
    allowed := envq.envelope_target(source, NEW.event, row_kind, queue_now,
                                    coalesce(NEW.wait, false), NEW.decision, NEW.cause,
                                    mode_now, coalesce(NEW.limited, false));
    IF allowed IS NULL OR allowed IS DISTINCT FROM NEW.state THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: envelope %s of queue %L: %s --%s--> %s is not in the '
                             'tables (%s)', coalesce(OLD.seq, NEW.seq), NEW.queue,
                             coalesce(source::text, 'new'), NEW.event,
                             coalesce(NEW.state::text, 'NULL'),
                             CASE WHEN allowed IS NULL
                                  THEN 'the event does not move it here'
                                  ELSE format('they lead to %s', allowed) END),
            DETAIL = format('kind=%s queue=%s wait=%s decision=%s cause=%s mode=%s limited=%s',
                            row_kind, queue_now, coalesce(NEW.wait, false),
                            coalesce(NEW.decision::text, 'none'), coalesce(NEW.cause::text, 'none'),
                            coalesce(mode_now::text, 'none'), coalesce(NEW.limited, false));
    END IF;
    -- The time of the move itself: a start measures the wait left from it, and the
    -- journal gives it as the move's. A statement that based a due time on an instant
    -- of its own gives that instant (one reading of the clock for both columns: the
    -- move is never later than the due time it set); other moves are stamped now.
    IF (TG_OP = 'INSERT' AND NEW.updated_at = now())
       OR (TG_OP = 'UPDATE' AND NEW.updated_at IS NOT DISTINCT FROM OLD.updated_at) THEN
        NEW.updated_at := clock_timestamp();
    END IF;
    IF journal_on THEN
        -- The node whose attempt moved: the claimer, or the holder of the lease ended.
        PERFORM envq.journal_move(NEW, source, queue_now,
            CASE WHEN TG_OP = 'UPDATE' THEN coalesce(NEW.lease_owner, OLD.lease_owner) END);
    END IF;
    NEW.event := NULL; NEW.decision := NULL; NEW.cause := NULL;
    NEW.wait := NULL; NEW.limited := NULL;
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION envq.envelopes_check() IS
    'Refuses any envelope row whose change of state the tables of envq._machine do not allow.';
CREATE TRIGGER envelopes_check BEFORE INSERT OR UPDATE ON envq.envelopes
    FOR EACH ROW EXECUTE FUNCTION envq.envelopes_check();
"""

_ENVELOPE_DELETE: Final = """\
CREATE FUNCTION envq.envelopes_discard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    journal_on boolean;
BEGIN
    -- A handed-back row leaves with its envelope (terminate()); an ended one is
    -- discarded (the tables' discard); a live one never leaves.
    IF OLD.state = '{handed_back}' THEN
        RETURN OLD;
    END IF;
    IF OLD.state NOT IN ({discardable}) THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: envelope %s of queue %L is %s: only an ended envelope '
                             'can be discarded (cancel it first)', OLD.seq, OLD.queue,
                             OLD.state);
    END IF;
    SELECT q.journal INTO journal_on FROM envq.queues AS q WHERE q.name = OLD.queue;
    IF journal_on THEN
        INSERT INTO envq.journal (queue, seq, from_state, to_state, event)
        VALUES (OLD.queue, OLD.seq, OLD.state::text, 'new', 'discard');
    END IF;
    RETURN OLD;
END
$$;
COMMENT ON FUNCTION envq.envelopes_discard() IS
    'Refuses deleting an envelope row the tables do not discard (a live one).';
CREATE TRIGGER envelopes_discard BEFORE DELETE ON envq.envelopes
    FOR EACH ROW EXECUTE FUNCTION envq.envelopes_discard();
"""

_QUEUE_CHECK: Final = """\
CREATE FUNCTION envq.queues_check() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    allowed envq.queue_state;
    rejected text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.state IS DISTINCT FROM '{initial}' OR NEW.call IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: queue %L must be created in state {initial}, not %s',
                                 NEW.name, NEW.state);
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: queue %L cannot be renamed', OLD.name);
    END IF;
    IF NEW.call IS NULL THEN
        IF NEW.state IS DISTINCT FROM OLD.state THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}',
                MESSAGE = format('envq: queue %L: %s -> %s names no call '
                                 '(set the column call in the same statement)',
                                 OLD.name, OLD.state, NEW.state);
        END IF;
        RETURN NEW;
    END IF;
    rejected := envq.queue_refusal(OLD.state, NEW.call);
    IF rejected IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '{rejected}',
            MESSAGE = format('envq: queue %L is %s: %s is rejected (%s)',
                             OLD.name, OLD.state, NEW.call, rejected);
    END IF;
    allowed := envq.queue_target(OLD.state, NEW.call);
    IF allowed IS NULL OR allowed IS DISTINCT FROM NEW.state THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}',
            MESSAGE = format('envq: queue %L: %s --%s--> %s is not in the tables (%s)',
                             OLD.name, OLD.state, NEW.call, coalesce(NEW.state::text, 'NULL'),
                             CASE WHEN allowed IS NULL THEN 'the call cannot happen in this state'
                                  ELSE format('they lead to %s', allowed) END);
    END IF;
    IF NEW.journal AND NEW.state IS DISTINCT FROM OLD.state THEN
        INSERT INTO envq.journal (queue, from_state, to_state, event)
        VALUES (NEW.name, OLD.state::text, NEW.state::text, NEW.call::text);
    END IF;
    NEW.call := NULL;
    NEW.updated_at := now();
    RETURN NEW;
END
$$;
COMMENT ON FUNCTION envq.queues_check() IS
    'Refuses any queue row whose lifecycle move the tables of envq._machine do not allow.';
CREATE TRIGGER queues_check BEFORE INSERT OR UPDATE ON envq.queues
    FOR EACH ROW EXECUTE FUNCTION envq.queues_check();
"""


_LEASES: Final = """\
CREATE FUNCTION envq.claim(queue_name text, owner text, how_many integer, lease interval)
RETURNS SETOF envq.envelopes
LANGUAGE plpgsql AS $$
BEGIN
    IF how_many IS NULL OR how_many < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('envq.claim: how_many must be at least 1, not %s',
                             coalesce(how_many::text, 'NULL'));
    END IF;
    IF lease IS NULL OR lease < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('envq.claim: lease must not be negative, not %s',
                             coalesce(lease::text, 'NULL'));
    END IF;
    IF owner IS NULL OR owner = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('envq.claim: owner must be a non-empty name, not %L', owner);
    END IF;
    -- A claim does not wait for the WAL flush: one a crash forgets has no committed
    -- end (an end's commit flushes the claim before it), so its envelope is READY
    -- again and runs again, as at-least-once allows; the forgotten attempt's end is
    -- refused by the fence. Ends, sends and lifecycle calls are durable.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
{claim_update}
END
$$;
COMMENT ON FUNCTION envq.claim IS
    'Starts attempts: up to how_many READY envelopes of a dispatching queue, the longest '
    'ready first, skipping rows other claims hold, each RUNNING under a new lease.';

CREATE FUNCTION envq.story(history jsonb, attempt integer, outcome envq.envelope_event,
                           started timestamptz, node text, error jsonb)
RETURNS jsonb
LANGUAGE sql AS $$
    -- The attempt appended (its error without the traceback: last_error keeps that),
    -- the oldest dropped past {story_limit}.
    SELECT CASE WHEN jsonb_array_length(h) > {story_limit} THEN h - 0 ELSE h END
      FROM (SELECT coalesce(history, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                'attempt', attempt, 'outcome', outcome,
                'started', extract(epoch FROM started)::float8,
                'ended', extract(epoch FROM clock_timestamp())::float8,
                'node', node, 'error', error - 'traceback')) AS h) AS s
$$;
COMMENT ON FUNCTION envq.story IS
    'An envelope''s story with one more failed attempt (the latest {story_limit} kept).';

CREATE FUNCTION envq.renew(queue text, owner text, lease interval, tokens uuid[])
RETURNS TABLE (token uuid, kind envq.envelope_kind)
LANGUAGE sql AS $$
    -- Rows are locked in seq order, as the ends lock theirs: a renewal and an end of
    -- the same attempts on two sessions cannot deadlock.
    WITH mine AS MATERIALIZED (
        SELECT m.seq FROM envq.envelopes AS m
         WHERE m.queue = renew.queue AND m.lease_owner = owner AND m.state = 'running'
           AND m.lease_token = ANY(tokens)
         ORDER BY m.seq
           FOR UPDATE)
    UPDATE envq.envelopes AS e
       SET lease_expires_at = greatest(e.lease_expires_at, clock_timestamp() + lease)
      FROM mine
     WHERE e.seq = mine.seq AND e.lease_expires_at > clock_timestamp()
    RETURNING e.lease_token, e.kind
$$;
COMMENT ON FUNCTION envq.renew IS
    'Extends the leases of the attempts a node knows it holds (their tokens, under its '
    'owner name) by lease, never shortening one; returns the tokens renewed with their '
    'row groups (cancelled: an operator asked the attempt to stop). An expired lease is '
    'not renewed: it is lost. A lease the node does not know of (a claim whose reply it '
    'lost) is not renewed either: adopt() takes it, or it expires.';

CREATE FUNCTION envq.adopt(queue_name text, owner text, known uuid[], lease interval)
RETURNS SETOF envq.envelopes
LANGUAGE sql AS $$
    UPDATE envq.envelopes AS e
       SET lease_expires_at = greatest(e.lease_expires_at, clock_timestamp() + lease)
     WHERE e.queue = queue_name AND e.lease_owner = owner AND e.state = 'running'
       AND NOT (e.lease_token = ANY(known)) AND e.lease_expires_at > clock_timestamp()
    RETURNING e.*
$$;
COMMENT ON FUNCTION envq.adopt IS
    'The attempts an owner holds but does not know of (known: the tokens it knows), '
    'their leases renewed: a node whose claim''s reply was lost takes its attempts back.';

CREATE FUNCTION envq.hold(seq bigint, token uuid, span interval)
RETURNS envq.envelope_kind
LANGUAGE sql AS $$
    UPDATE envq.envelopes AS e
       SET lease_expires_at = greatest(e.lease_expires_at, clock_timestamp() + span)
     WHERE e.seq = hold.seq AND e.lease_token = token AND e.state = 'running'
       AND e.lease_expires_at > clock_timestamp()
    RETURNING e.kind
$$;
COMMENT ON FUNCTION envq.hold IS
    'Before a decision (on_failure): the attempt''s lease, while it still holds, '
    'extended to cover span (the hook''s budget); the row''s kind (blacklisted: no '
    'hook), or NULL when the lease no longer holds (the reaper decides instead).';

CREATE FUNCTION envq.finish(seq bigint, token uuid, outcome envq.envelope_event,
                            decision envq.decision_kind DEFAULT NULL,
                            cause envq.cancel_cause DEFAULT NULL,
                            limited boolean DEFAULT false,
                            due_at timestamptz DEFAULT NULL,
                            failures integer DEFAULT NULL,
                            error jsonb DEFAULT NULL)
RETURNS envq.envelope_state
LANGUAGE plpgsql AS $$
DECLARE
    ended envq.envelope_state;
BEGIN
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', outcome, e.kind, q.state, false,
                                        finish.decision, finish.cause, q.stop_mode,
                                        coalesce(finish.limited, false)),
           event = outcome, decision = finish.decision, cause = finish.cause,
           limited = coalesce(finish.limited, false), due_at = finish.due_at,
           failures = coalesce(finish.failures, e.failures), ended_token = e.lease_token,
           last_error = coalesce(finish.error, e.last_error),
           history = CASE WHEN finish.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, outcome, e.updated_at,
                                          e.lease_owner, finish.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM envq.queues AS q
     WHERE e.seq = finish.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = finish.token AND e.lease_expires_at > clock_timestamp()
    RETURNING e.state INTO ended;
    RETURN ended;
END
$$;
COMMENT ON FUNCTION envq.finish IS
    'Ends an attempt with its outcome, moving the envelope where the tables lead, only '
    'while the attempt''s token holds; NULL when it does not (nothing changed).';

CREATE FUNCTION envq.finish_many(seqs bigint[], tokens uuid[],
                                 outcomes envq.envelope_event[],
                                 decisions envq.decision_kind[],
                                 causes envq.cancel_cause[], delays double precision[],
                                 failures integer[], errors jsonb[])
RETURNS TABLE (seq bigint, state envq.envelope_state)
LANGUAGE sql AS $$
{finish_update}
$$;
COMMENT ON FUNCTION envq.finish_many IS
    'finish for many attempts in one statement (one commit): the rows it returns are '
    'the attempts whose token held; the others changed nothing.';

CREATE FUNCTION envq.finish_and_claim(end_seqs bigint[], end_tokens uuid[],
                                      end_outcomes envq.envelope_event[],
                                      end_decisions envq.decision_kind[],
                                      end_causes envq.cancel_cause[],
                                      end_delays double precision[],
                                      end_failures integer[], end_errors jsonb[],
                                      queue_name text, owner text, how_many integer,
                                      lease interval)
RETURNS SETOF envq.envelopes
LANGUAGE plpgsql AS $$
BEGIN
    -- The ends (as finish_many; every returned row is not RUNNING), then in the same
    -- transaction, durable, the claim of up to how_many (RUNNING, owned by owner): a
    -- node that ends attempts starts the next ones in one round trip.
    RETURN QUERY
{finish_update_rows};
    IF how_many > 0 THEN
        RETURN QUERY
{claim_update}
    END IF;
END
$$;
COMMENT ON FUNCTION envq.finish_and_claim IS
    'finish_many, then claim up to how_many more, in one transaction: the ended rows '
    '(not running) and the claimed ones (running).';

CREATE FUNCTION envq.expire(seq bigint, token uuid,
                            decision envq.decision_kind DEFAULT NULL,
                            due_at timestamptz DEFAULT NULL,
                            failures integer DEFAULT NULL,
                            error jsonb DEFAULT NULL,
                            at timestamptz DEFAULT NULL)
RETURNS envq.envelope_state
LANGUAGE plpgsql AS $$
DECLARE
    ended envq.envelope_state;
BEGIN
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', '{expired}', e.kind, q.state, false,
                                        expire.decision, NULL, q.stop_mode, false),
           event = '{expired}', decision = expire.decision, due_at = expire.due_at,
           updated_at = coalesce(expire.at, e.updated_at),
           failures = coalesce(expire.failures, e.failures), ended_token = NULL,
           last_error = coalesce(expire.error, e.last_error),
           history = CASE WHEN expire.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, '{expired}', e.updated_at,
                                          e.lease_owner, expire.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM envq.queues AS q
     WHERE e.seq = expire.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = expire.token AND e.lease_expires_at <= clock_timestamp()
    RETURNING e.state INTO ended;
    RETURN ended;
END
$$;
COMMENT ON FUNCTION envq.expire IS
    'Ends an attempt whose lease expired (the reaper''s move), where the tables lead, '
    'only while that lease is still the attempt''s; NULL when it is not. at: the '
    'instant due_at was measured from, the move''s time (NULL: now).';

CREATE FUNCTION envq.due(queue_name text) RETURNS integer
LANGUAGE sql AS $$
    WITH moved AS (
        UPDATE envq.envelopes AS e SET state = '{ready}', event = '{due}'
         WHERE e.seq IN (SELECT d.seq FROM envq.envelopes AS d
                          WHERE d.queue = queue_name AND d.state = 'delayed'
                            AND d.due_at <= clock_timestamp()
                            FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT count(*)::integer FROM moved
$$;
COMMENT ON FUNCTION envq.due IS
    'Moves the DELAYED envelopes of a queue whose time has come to READY.';

CREATE FUNCTION envq.broadcast(queue_name text, what envq.envelope_event)
RETURNS integer
LANGUAGE sql AS $$
    -- A start arms a buffered or parked envelope with the wait it had left when it
    -- was sent or parked (its last move), not the time that passed meanwhile.
    WITH now_ AS (SELECT clock_timestamp() AS t),
    armed AS (
        SELECT e.seq,
               CASE WHEN what = '{start}' AND e.state IN ({armed})
                         AND e.due_at IS NOT NULL
                    THEN n.t + greatest(e.due_at - e.updated_at, interval '0')
                    ELSE e.due_at END AS due,
               n.t
          FROM envq.envelopes AS e, now_ AS n
         WHERE e.queue = queue_name AND e.state IN ({live})
    ),
    moved AS (
        UPDATE envq.envelopes AS e
           SET state = envq.envelope_target(e.state, what, e.kind, q.state,
                                            coalesce(a.due > a.t, false),
                                            NULL, NULL, q.stop_mode, false),
               event = what, wait = coalesce(a.due > a.t, false), due_at = a.due,
               updated_at = a.t
          FROM envq.queues AS q, armed AS a
         WHERE q.name = queue_name AND e.queue = queue_name AND e.seq = a.seq
           AND e.state IN ({live})
           AND envq.envelope_target(e.state, what, e.kind, q.state,
                                    coalesce(a.due > a.t, false),
                                    NULL, NULL, q.stop_mode, false) IS NOT NULL
        RETURNING 1)
    SELECT count(*)::integer FROM moved
$$;
COMMENT ON FUNCTION envq.broadcast IS
    'A queue-side event (start, stop, terminate) applied to every live envelope of a '
    'queue it moves, each where the tables lead (RUNNING ones are left to their attempts).';
"""


# The rows are picked once, in a materialized CTE: as a subquery of the UPDATE's FROM,
# a plan made for a table believed empty (a nested loop with the subquery inside)
# scanned it again for each row updated, and each scan, skipping the rows the
# statement had just updated, picked the next ones: a claim of one took them all.
_CLAIM_UPDATE: Final = """\
    WITH picked AS MATERIALIZED (
        SELECT c.seq FROM envq.envelopes AS c
         WHERE c.queue = queue_name AND c.state = '{ready}'
           AND EXISTS (SELECT FROM envq.queues AS q
                        WHERE q.name = queue_name AND q.state IN ({dispatching}))
         ORDER BY c.updated_at, c.seq
         LIMIT how_many
           FOR UPDATE OF c SKIP LOCKED)
    UPDATE envq.envelopes AS e
       SET state = '{running}', event = '{dispatch}', attempt = e.attempt + 1,
           lease_token = gen_random_uuid(), lease_owner = owner,
           lease_expires_at = clock_timestamp() + lease
      FROM picked
     WHERE e.seq = picked.seq
    RETURNING e.*;"""

_FINISH_UPDATE: Final = """\
    WITH f AS MATERIALIZED (
        SELECT * FROM unnest(seqs, tokens, outcomes, decisions, causes, delays, failures,
                             errors)
                   AS u(seq, token, outcome, decision, cause, delay, failures, error)),
    -- Rows are locked in seq order, as a renewal locks them (no deadlock between two).
    locked AS MATERIALIZED (
        SELECT l.seq FROM envq.envelopes AS l
         WHERE l.seq IN (SELECT f.seq FROM f)
         ORDER BY l.seq
           FOR UPDATE),
    -- The instant of the ends, read once: the moves' time and what their due times
    -- are measured from.
    now_ AS MATERIALIZED (SELECT clock_timestamp() AS t)
    UPDATE envq.envelopes AS e
       SET state = envq.envelope_target('running', f.outcome, e.kind, q.state, false,
                                        f.decision, f.cause, q.stop_mode, false),
           event = f.outcome, decision = f.decision, cause = f.cause, limited = false,
           due_at = coalesce(n.t + f.delay * interval '1 second',
                             envq.next_due(e.schedule, e.interval_s, e.due_at, n.t)),
           updated_at = n.t,
           failures = coalesce(f.failures, e.failures), ended_token = e.lease_token,
           last_error = coalesce(f.error, e.last_error),
           history = CASE WHEN f.error IS NULL THEN e.history
                          ELSE envq.story(e.history, e.attempt, f.outcome, e.updated_at,
                                          e.lease_owner, f.error) END,
           lease_token = NULL, lease_owner = NULL, lease_expires_at = NULL
      FROM f, locked, now_ AS n, envq.queues AS q
     WHERE e.seq = f.seq AND locked.seq = e.seq AND q.name = e.queue AND e.state = 'running'
       AND e.lease_token = f.token AND e.lease_expires_at > clock_timestamp()
    RETURNING e.seq, e.state"""


def _leases() -> str:
    """The lease functions, with the dispatch move and the dispatching lifecycle
    states taken from the tables."""
    dispatched = target(EnvState.READY, EnvEvent.DISPATCH, Situation())
    assert dispatched is not None
    dispatching = ", ".join(_q(s.value) for s in QueueState if s in DISPATCHING)
    return (
        # The shared statement bodies first: they hold placeholders of their own.
        _LEASES.replace("{claim_update}", _CLAIM_UPDATE)
        .replace(
            "{finish_update_rows}",
            _FINISH_UPDATE.replace(
                "unnest(seqs, tokens, outcomes, decisions, causes, delays, failures,\n"
                "                             errors)",
                "unnest(end_seqs, end_tokens, end_outcomes, end_decisions, end_causes,\n"
                "                             end_delays, end_failures, end_errors)",
            ).replace("RETURNING e.seq, e.state", "RETURNING e.*"),
        )
        .replace("{finish_update}", _FINISH_UPDATE)
        .replace("{dispatch}", event_label(EnvEvent.DISPATCH))
        .replace("{ready}", EnvState.READY.value)
        .replace("{running}", dispatched.value)
        .replace("{dispatching}", dispatching)
        .replace("{expired}", event_label(Outcome.EXPIRED))
        .replace("{due}", event_label(EnvEvent.DUE))
        .replace("{start}", event_label(EnvEvent.START))
        .replace("{armed}", _in(moved_by(EnvEvent.START)))
        .replace("{live}", _in(LIVE_STATES))
        .replace("{story_limit}", str(STORY_LIMIT))
    )


# ---------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------

_SCHEDULES: Final = """\
-- ------------------------------------------------------------------------------------
-- Schedules: calendar (cron) envelopes, and the next run of a FIXED_DELAY or FIXED_RATE
-- envelope computed here, on the database's clock, from the row's scheduled start.
-- ------------------------------------------------------------------------------------
ALTER TABLE envq.envelopes
    ADD COLUMN cron text,
    ADD COLUMN cron_tz text,
    ADD CONSTRAINT envelopes_calendar CHECK (
        (cron IS NULL) = (cron_tz IS NULL)
        AND (cron IS NULL OR (interval_s = 0 AND schedule = 'fixed_delay')));
COMMENT ON COLUMN envq.envelopes.cron IS
    'A calendar envelope''s cron expression (NULL: timed by schedule and interval_s); '
    'the nodes find its fires, the database''s clock says when they have come.';
COMMENT ON COLUMN envq.envelopes.cron_tz IS
    'The IANA time zone the cron expression is read in (set with cron).';

CREATE FUNCTION envq.next_due(timing envq.schedule, every double precision,
                              scheduled timestamptz, ended timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    n bigint;
BEGIN
    IF timing = 'fixed_delay' OR scheduled IS NULL OR every IS NULL OR every <= 0 THEN
        RETURN ended + coalesce(every, 0) * interval '1 second';
    END IF;
    -- The first grid point scheduled + n * every (n >= 1) strictly after ended; the
    -- quotient is a first guess, corrected both ways against rounding.
    n := greatest(1, floor(extract(epoch FROM ended - scheduled)::float8 / every)::bigint + 1);
    WHILE n > 1 AND scheduled + ((n - 1) * every) * interval '1 second' > ended LOOP
        n := n - 1;
    END LOOP;
    WHILE scheduled + (n * every) * interval '1 second' <= ended LOOP
        n := n + 1;
    END LOOP;
    RETURN scheduled + (n * every) * interval '1 second';
END
$$;
COMMENT ON FUNCTION envq.next_due IS
    'When a periodic run that ended at ended and was scheduled at scheduled runs next: '
    'every seconds after its end (fixed_delay), or the first point of the grid '
    'scheduled + n * every after its end (fixed_rate; missed points are skipped).';
"""


# ---------------------------------------------------------------------------------------
# The journal (optional)
# ---------------------------------------------------------------------------------------

_CAPACITY: Final = """\
-- ------------------------------------------------------------------------------------
-- The capacity: the queue's, not a process's. Whoever creates the queue's row sets it;
-- every sender checks its batch against the row's value.
-- ------------------------------------------------------------------------------------
ALTER TABLE envq.queues ADD COLUMN capacity integer NOT NULL DEFAULT 0
    CONSTRAINT queues_capacity CHECK (capacity >= 0);
COMMENT ON COLUMN envq.queues.capacity IS
    'The most live envelopes the queue holds (0: no limit), set when the row is created.';

-- ------------------------------------------------------------------------------------
-- The counts: how many envelopes of each queue are in each state, kept with every
-- move (statement triggers: one update per state a statement changes, not per row),
-- so that a send's capacity check and a queue's statistics cost the same at 100 and
-- at 1,000,000 envelopes. Each session adds to a slot of its own (its backend's pid
-- modulo 64): the ends of many nodes do not queue up on one row.
-- ------------------------------------------------------------------------------------
CREATE TABLE envq.counts (
    queue text NOT NULL,
    state envq.envelope_state NOT NULL,
    slot smallint NOT NULL,
    n bigint NOT NULL,
    PRIMARY KEY (queue, state, slot)
);
COMMENT ON TABLE envq.counts IS
    'Envelopes per queue and state: the sum of n over the slots (kept by the triggers).';

CREATE FUNCTION envq.count_moves() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    mine smallint := pg_backend_pid() % 64;
BEGIN
    -- In (queue, state) order: two statements add to the same rows in the same order.
    IF TG_OP = 'INSERT' THEN
        INSERT INTO envq.counts AS c (queue, state, slot, n)
        SELECT m.queue, m.state, mine, count(*) FROM new_rows AS m
         GROUP BY m.queue, m.state ORDER BY m.queue, m.state
        ON CONFLICT (queue, state, slot) DO UPDATE SET n = c.n + excluded.n;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO envq.counts AS c (queue, state, slot, n)
        SELECT m.queue, m.state, mine, -count(*) FROM old_rows AS m
         GROUP BY m.queue, m.state ORDER BY m.queue, m.state
        ON CONFLICT (queue, state, slot) DO UPDATE SET n = c.n + excluded.n;
    ELSE
        INSERT INTO envq.counts AS c (queue, state, slot, n)
        SELECT d.queue, d.state, mine, sum(d.n) FROM (
                   SELECT m.queue, m.state, 1 AS n FROM new_rows AS m
                   UNION ALL
                   SELECT m.queue, m.state, -1 AS n FROM old_rows AS m) AS d
         GROUP BY d.queue, d.state HAVING sum(d.n) <> 0 ORDER BY d.queue, d.state
        ON CONFLICT (queue, state, slot) DO UPDATE SET n = c.n + excluded.n;
    END IF;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION envq.count_moves() IS
    'Keeps envq.counts: what a statement added to and took from each (queue, state).';
CREATE TRIGGER envelopes_count_inserts AFTER INSERT ON envq.envelopes
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_moves();
CREATE TRIGGER envelopes_count_updates AFTER UPDATE ON envq.envelopes
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_moves();
CREATE TRIGGER envelopes_count_deletes AFTER DELETE ON envq.envelopes
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_moves();

CREATE FUNCTION envq.count_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM envq.counts;
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION envq.count_truncate() IS
    'Empties envq.counts when envq.envelopes is truncated.';
CREATE TRIGGER envelopes_count_truncate AFTER TRUNCATE ON envq.envelopes
    FOR EACH STATEMENT EXECUTE FUNCTION envq.count_truncate();
"""

_JOURNAL: Final = """\
-- ------------------------------------------------------------------------------------
-- The journal: an optional record of every move of a queue, for checking a deployment
-- against the tables (the conformance driver turns it on for its queue). Off by
-- default: the triggers read the flag with the queue row they read anyway, so a
-- queue whose journal is off pays nothing more.
-- ------------------------------------------------------------------------------------
ALTER TABLE envq.queues ADD COLUMN journal boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN envq.queues.journal IS
    'Whether the moves of this queue and its envelopes are appended to envq.journal.';

CREATE TABLE envq.journal (
    n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue text NOT NULL,
    -- The envelope row that moved; NULL: a move of the queue itself.
    seq bigint,
    -- States by name (an envelope state, or a queue state when seq is NULL); from_state
    -- is NULL for the send that created the row.
    from_state text,
    to_state text NOT NULL,
    -- The envelope event (attempt_<outcome> for the end of an attempt) or queue call.
    event text NOT NULL,
    decision envq.decision_kind,
    cause envq.cancel_cause,
    -- The queue's state an envelope move was checked against (NULL for a move of the
    -- queue): a move made while a lifecycle call was under way, not yet committed,
    -- saw the state before it, though its row may be written after the call's.
    queue_state text,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The node whose attempt the move began or ended (its lease_owner); NULL for the
    -- other moves (sends, due moves, an operator's).
    node text
);
CREATE INDEX journal_queue ON envq.journal (queue, n);
-- An envelope's moves, newest first, without walking its queue's whole journal.
CREATE INDEX journal_seq ON envq.journal (queue, seq, n);
COMMENT ON TABLE envq.journal IS
    'Every move of the queues whose journal is on, in the order they were made.';

CREATE FUNCTION envq.journal_move(moved envq.envelopes, source envq.envelope_state,
                                  seen envq.queue_state, held_by text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF source IS NOT NULL AND moved.state = source THEN
        RETURN;
    END IF;
    -- A send of an id already live is a dedup: ON CONFLICT DO NOTHING skips the row
    -- after this trigger ran, so it is not a move.
    IF source IS NULL AND moved.id IS NOT NULL AND EXISTS (
        SELECT FROM envq.envelopes AS d
         WHERE d.queue = moved.queue AND d.id = moved.id AND d.state IN ({live})) THEN
        RETURN;
    END IF;
    INSERT INTO envq.journal (queue, seq, from_state, to_state, event, decision, cause,
                              queue_state, at, node)
    VALUES (moved.queue, moved.seq, source::text, moved.state::text, moved.event::text,
            moved.decision, moved.cause, seen::text, moved.updated_at, held_by);
END
$$;
COMMENT ON FUNCTION envq.journal_move IS
    'Appends one envelope move to the journal (called by the trigger when it is on).';
"""


def _function(
    name: str, params: Sequence[tuple[str, str]], returns: str, body: str, comment: str
) -> str:
    args = ", ".join(f"{param} {type_}" for param, type_ in params)
    # PL/pgSQL, not SQL: its expression is planned once per session, where a SQL
    # function this size was planned again at each call from the triggers (most of
    # a claim's time).
    expression = body.removeprefix("SELECT ")
    return (
        f"CREATE FUNCTION {SCHEMA}.{name}({args})\n"
        f"RETURNS {returns} LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$\n"
        f"BEGIN\n  RETURN {expression};\nEND\n$$;\n"
        f"COMMENT ON FUNCTION {SCHEMA}.{name} IS {_q(comment)};\n"
    )


_LIFE_PARAMS: Final = (("state", _TYPES["queue"]), ("call", f"{SCHEMA}.queue_call"))


def render(decide: Callable[..., EnvState | None] = target) -> str:
    """The whole schema as SQL text, deterministic (same tables, same bytes).

    :param decide: the function the envelope moves are compiled from; the tables'
        :func:`envq._machine.target` (a test passes a changed one to show that the
        comparison with the database can fail).
    """
    live = _in(LIVE_STATES)
    parts = [
        "-- envq on PostgreSQL: the tables of envq._machine enforced by the database.\n"
        "-- Generated by `python -m envq.postgres.schema`; do not edit.\n"
        f"-- Schema version {SCHEMA_VERSION}.\n",
        f"CREATE SCHEMA {SCHEMA};\n"
        f"COMMENT ON SCHEMA {SCHEMA} IS {_q(f'envq schema version {SCHEMA_VERSION}')};\n",
        f"CREATE TABLE {SCHEMA}.schema_version (\n"
        "    version integer PRIMARY KEY,\n"
        "    applied_at timestamptz NOT NULL DEFAULT now(),\n"
        "    -- The oldest schema version whose envq can still run on this one (its nodes\n"
        "    -- and a newer release's can share the queue during a rolling upgrade).\n"
        "    compatible_from integer NOT NULL\n"
        ");\n"
        f"INSERT INTO {SCHEMA}.schema_version (version, compatible_from)"
        f" VALUES ({SCHEMA_VERSION}, {COMPATIBLE_FROM});\n",
        "-- The states, events and guard values of the tables.\n",
        _enum(
            "envelope_state",
            (s.value for s in STORED_STATES),
            "EnvState without NEW: a row is born by the send move.",
        ),
        _enum(
            "envelope_event",
            (event_label(e) for e in ENVELOPE_EVENTS),
            "EnvEvent values, then each Outcome as attempt_<outcome>.",
        ),
        _enum("envelope_kind", (k.value for k in Kind), "The row groups of the outcome table."),
        _enum("queue_state", (s.value for s in QueueState), "The queue lifecycle states."),
        _enum("queue_call", (c.value for c in QueueCall), "The lifecycle events."),
        _enum("stop_mode", (m.value for m in StopMode), "How a stop treats ready envelopes."),
        _enum("decision_kind", (d.value for d in DecisionKind), "What a failure decision asks."),
        _enum("cancel_cause", (c.value for c in CancelCause), "Who cancelled an attempt."),
        _enum("schedule", (s.value for s in Schedule), "How a periodic envelope is timed."),
        "-- The moves of the tables, compiled.\n",
        _function(
            "envelope_target",
            [
                (p, _TYPES[p])
                for p in (
                    *("state", "event", "kind", "queue", "wait"),
                    *("decision", "cause", "mode", "limited"),
                )
            ],
            _TYPES["state"],
            _envelope_target_body(decide),
            "The state an event leads an envelope to (state NULL: a new one), "
            "as envq._machine.target; NULL when the event does not move it.",
        ),
        _function(
            "queue_target",
            _LIFE_PARAMS,
            _TYPES["queue"],
            _queue_target_body(),
            "The lifecycle state a call leads to; NULL for a rejected or impossible call.",
        ),
        _function(
            "queue_refusal",
            _LIFE_PARAMS,
            "text",
            _queue_refusal_body(),
            "The error a call rejected in this state raises; NULL when it is not rejected.",
        ),
        "-- The rows.\n",
        f"CREATE TABLE {SCHEMA}.queues (\n"
        "    name text PRIMARY KEY,\n"
        f"    state {SCHEMA}.queue_state NOT NULL DEFAULT '{INITIAL_QUEUE_STATE.value}',\n"
        "    -- The mode of the stop under way, or of the last one.\n"
        f"    stop_mode {SCHEMA}.stop_mode,\n"
        "    -- The envelope types blacklisted in this queue (StopType).\n"
        "    blacklist text[] NOT NULL DEFAULT '{}',\n"
        "    -- Who cancels the attempts in flight (a stop with cancel, terminate); NULL:\n"
        "    -- they run to their end. Every node cancels its own.\n"
        f"    cancel {SCHEMA}.cancel_cause,\n"
        "    -- The call a state-changing statement performs; cleared by the trigger.\n"
        f"    call {SCHEMA}.queue_call,\n"
        "    created_at timestamptz NOT NULL DEFAULT now(),\n"
        "    updated_at timestamptz NOT NULL DEFAULT now(),\n"
        "    CONSTRAINT queues_call_cleared CHECK (call IS NULL)\n"
        ");\n",
        f"CREATE TABLE {SCHEMA}.envelopes (\n"
        "    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n"
        f"    queue text NOT NULL REFERENCES {SCHEMA}.queues (name),\n"
        "    -- The dedup key (the envelope's id as JSON); NULL: never deduplicated.\n"
        "    id jsonb,\n"
        "    type text NOT NULL DEFAULT '',\n"
        "    -- The stable name of the callable that runs an attempt.\n"
        "    invoke text NOT NULL,\n"
        "    payload jsonb,\n"
        f"    kind {SCHEMA}.envelope_kind NOT NULL,\n"
        f"    state {SCHEMA}.envelope_state NOT NULL,\n"
        "    interval_s double precision NOT NULL DEFAULT 0 CHECK (interval_s >= 0),\n"
        f"    schedule {SCHEMA}.schedule NOT NULL DEFAULT 'fixed_delay',\n"
        "    deadline_s double precision NOT NULL DEFAULT 0 CHECK (deadline_s >= 0),\n"
        "    attempt integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),\n"
        "    -- Failed runs in a row of a periodic envelope (a success resets it).\n"
        "    failures integer NOT NULL DEFAULT 0 CHECK (failures >= 0),\n"
        "    -- The stable names of the hooks (NULL: none) and the retry policy.\n"
        "    before_hook text,\n"
        "    after_hook text,\n"
        "    on_success text,\n"
        "    on_failure text,\n"
        "    retry jsonb,\n"
        "    -- When a periodic envelope was first armed (the FIXED_RATE grid's origin).\n"
        "    origin_at timestamptz,\n"
        "    -- When a DELAYED envelope is due.\n"
        "    due_at timestamptz,\n"
        "    -- The lease of the attempt in flight (a later step claims and fences with them).\n"
        "    lease_token uuid,\n"
        "    lease_owner text,\n"
        "    lease_expires_at timestamptz,\n"
        "    -- Its story: the last error an attempt ended with ({type, message,\n"
        "    -- traceback}, bounded) and its failed attempts ([{attempt, outcome,\n"
        "    -- started, ended, node, error}], the latest 20), kept across a retry.\n"
        "    last_error jsonb,\n"
        "    history jsonb,\n"
        "    -- The token of the attempt whose own node ended it last (NULL: reaped, or\n"
        "    -- none yet): a node that lost the reply of an end finds it committed here.\n"
        "    ended_token uuid,\n"
        "    created_at timestamptz NOT NULL DEFAULT now(),\n"
        "    -- The time of its last move (the trigger stamps it when the statement does\n"
        "    -- not give the instant it measured a due time from: on a send, when it\n"
        "    -- leaves the default, the transaction's start).\n"
        "    updated_at timestamptz NOT NULL DEFAULT now(),\n"
        "    -- The move a state-changing statement performs and the guard values only its\n"
        "    -- author knows; the trigger checks them, then clears them.\n"
        f"    event {SCHEMA}.envelope_event,\n"
        f"    decision {SCHEMA}.decision_kind,\n"
        f"    cause {SCHEMA}.cancel_cause,\n"
        "    wait boolean,\n"
        "    limited boolean,\n"
        "    CONSTRAINT envelopes_move_cleared CHECK (\n"
        "        event IS NULL AND decision IS NULL AND cause IS NULL\n"
        "        AND wait IS NULL AND limited IS NULL)\n"
        ");\n",
        "-- Dedup by id among live envelopes (the states that count against capacity).\n"
        f"CREATE UNIQUE INDEX envelopes_live_id ON {SCHEMA}.envelopes (queue, id)\n"
        f"    WHERE id IS NOT NULL AND state IN ({live});\n"
        "-- Ready envelopes in the order they became ready (the trigger stamps updated_at\n"
        "-- with each move), as the in-process ready deque: a claim reads this index\n"
        "-- alone (ordered by seq, the primary key's order, the planner scanned the\n"
        "-- primary key past every ended row at its head).\n"
        f"CREATE INDEX envelopes_ready ON {SCHEMA}.envelopes (queue, updated_at, seq)"
        " WHERE state = 'ready';\n"
        f"CREATE INDEX envelopes_due ON {SCHEMA}.envelopes (queue, due_at)"
        " WHERE state = 'delayed';\n"
        "-- Ended envelopes by the time they ended: an operator's or the nodes' purge\n"
        "-- by age reads this index alone.\n"
        f"CREATE INDEX envelopes_ended ON {SCHEMA}.envelopes (queue, updated_at)"
        f" WHERE state IN ({_in(discardable(decide))});\n"
        f"CREATE INDEX envelopes_leases ON {SCHEMA}.envelopes (lease_expires_at)"
        " WHERE state = 'running';\n",
        f"CREATE INDEX envelopes_owners ON {SCHEMA}.envelopes (lease_owner)"
        " WHERE state = 'running';\n",
        _SCHEDULES,
        "-- The triggers.\n",
        _ENVELOPE_CHECK.replace("{refused}", REFUSED_ENVELOPE_MOVE)
        .replace("{rejected}", REFUSED_CALL)
        .replace("{running}", EnvState.RUNNING.value)
        .replace("{retry}", EnvEvent.RETRY.value)
        .replace("{relabels}", ", ".join(_q(k.value) for k in RELABEL.values()))
        .replace("{relabels_text}", " or ".join(k.value for k in RELABEL.values()))
        .replace("{own_kinds}", ", ".join(_q(k.value) for k in KIND_OF.values())),
        _ENVELOPE_DELETE.replace("{refused}", REFUSED_ENVELOPE_MOVE)
        .replace("{discardable}", _in(discardable(decide)))
        .replace("{handed_back}", _handed_back().value),
        _QUEUE_CHECK.replace("{refused}", REFUSED_QUEUE_MOVE)
        .replace("{rejected}", REFUSED_CALL)
        .replace("{initial}", INITIAL_QUEUE_STATE.value),
        "-- Attempts under leases: claim, renew, finish (fenced by the lease token).\n",
        _leases(),
        _CAPACITY,
        _JOURNAL.replace("{live}", live),
    ]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m envq.postgres.schema [--output FILE | --check FILE]``: print the SQL,
    write it to FILE, or exit 1 when FILE differs from a fresh generation."""
    parser = argparse.ArgumentParser(
        prog="python -m envq.postgres.schema",
        description="Print the SQL of envq's PostgreSQL schema, generated from its tables.",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--output", type=Path, help="write the SQL to this file")
    group.add_argument("--check", type=Path, help="exit 1 when this file is not fresh")
    args = parser.parse_args(argv)
    sql = render()
    if args.output is not None:
        args.output.write_text(sql, encoding="utf-8")
        return 0
    if args.check is not None:
        fresh = args.check.exists() and args.check.read_text(encoding="utf-8") == sql
        if not fresh:
            print(f"{args.check} is stale: python -m envq.postgres.schema --output {args.check}")
        return 0 if fresh else 1
    sys.stdout.write(sql)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
