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
from envq.postgres._sql import (
    CLAIM_UPDATE,
    ENVELOPE_CHECK,
    ENVELOPE_DELETE,
    FINISH_UPDATE,
    LEASES,
    LOCK_QUEUES_OF_SEQS,
    QUEUE_CHECK,
    QUEUE_KEEP,
    QUEUE_LOCK,
    SCHEDULES,
)
from envq.postgres._sql_kept import CAPACITY, JOURNAL

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


def _leases() -> str:
    """The lease functions, with the dispatch move and the dispatching lifecycle
    states taken from the tables."""
    dispatched = target(EnvState.READY, EnvEvent.DISPATCH, Situation())
    assert dispatched is not None
    dispatching = ", ".join(_q(s.value) for s in QueueState if s in DISPATCHING)
    return (
        # The shared statement bodies first: they hold placeholders of their own.
        LEASES.replace("{claim_update}", CLAIM_UPDATE)
        .replace(
            "{finish_update_rows}",
            FINISH_UPDATE.replace(
                "unnest(seqs, tokens, outcomes, decisions, causes, delays, failures,\n"
                "                             errors)",
                "unnest(end_seqs, end_tokens, end_outcomes, end_decisions, end_causes,\n"
                "                             end_delays, end_failures, end_errors)",
            ).replace("RETURNING e.seq, e.state", "RETURNING e.*"),
        )
        .replace("{finish_update}", FINISH_UPDATE)
        .replace("{lock_queues_of_seqs}", LOCK_QUEUES_OF_SEQS)
        .replace("{queue_lock}", str(QUEUE_LOCK))
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
        "    -- Its queue's row (checked and held by the trigger, kept by queues_keep).\n"
        "    queue text NOT NULL,\n"
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
        SCHEDULES,
        "-- The triggers.\n",
        ENVELOPE_CHECK.replace("{refused}", REFUSED_ENVELOPE_MOVE)
        .replace("{rejected}", REFUSED_CALL)
        .replace("{running}", EnvState.RUNNING.value)
        .replace("{retry}", EnvEvent.RETRY.value)
        .replace("{relabels}", ", ".join(_q(k.value) for k in RELABEL.values()))
        .replace("{relabels_text}", " or ".join(k.value for k in RELABEL.values()))
        .replace("{own_kinds}", ", ".join(_q(k.value) for k in KIND_OF.values())),
        ENVELOPE_DELETE.replace("{refused}", REFUSED_ENVELOPE_MOVE)
        .replace("{discardable}", _in(discardable(decide)))
        .replace("{handed_back}", _handed_back().value),
        QUEUE_CHECK.replace("{refused}", REFUSED_QUEUE_MOVE)
        .replace("{rejected}", REFUSED_CALL)
        .replace("{initial}", INITIAL_QUEUE_STATE.value),
        QUEUE_KEEP,
        "-- Attempts under leases: claim, renew, finish (fenced by the lease token).\n",
        _leases(),
        CAPACITY,
        JOURNAL.replace("{send}", event_label(EnvEvent.SEND)),
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
