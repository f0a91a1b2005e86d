"""The database enforces envq's tables: a real PostgreSQL server, the generated schema.

For every envelope state (``NEW`` is an ``INSERT``), every event and every guard
valuation the tables define, the database accepts exactly the target that
``envq._machine.target`` chooses and refuses every other state; for every (state,
event) pair the tables do not define, it refuses them all. The situations are
enumerated by ``models.tables.contexts`` (the same enumeration
``tests/model/test_models.py`` proves the models equal to the tables with), not by the
generator. The lifecycle table is checked the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Callable, Iterator

import pytest

from envq._machine import (
    LIFECYCLE,
    QUEUE_MOVES,
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
    target,
)
from envq.postgres.schema import (
    REFUSED_CALL,
    REFUSED_ENVELOPE_MOVE,
    REFUSED_QUEUE_MOVE,
    SCHEMA_VERSION,
    STORED_STATES,
    event_label,
)
from models.tables import ENVELOPE_EVENTS, contexts

SITUATIONS: list[Situation] = list(contexts())
_N = EnvState.NEW


def _value(member: object) -> str | None:
    return None if member is None else str(getattr(member, "value", member))


def _defined_pairs(decide: Callable[..., EnvState | None]) -> set[tuple[EnvState, object]]:
    return {
        (state, event)
        for state, event in itertools.product(EnvState, ENVELOPE_EVENTS)
        if any(decide(state, event, c) is not None for c in SITUATIONS)
    }


# ---------------------------------------------------------------------------------------
# The compiled function: every (state, event, situation)
# ---------------------------------------------------------------------------------------


def _stored(to: EnvState | None) -> EnvState | None:
    """A target as an update of a row: a discard's NEW is no state a row is updated
    to (the row is deleted instead: the delete trigger's, tested below)."""
    return None if to is _N else to


async def _function_disagreements(
    conn: object, decide: Callable[..., EnvState | None] = target
) -> list[tuple[str, str, Situation, str | None, str | None]]:
    """Every (state, event, situation) where the database's ``envelope_target`` differs
    from ``decide`` (the tables' ``target`` unless a test passes another)."""
    points = [
        (state, event, c)
        for c in SITUATIONS
        for state, event in itertools.product(EnvState, ENVELOPE_EVENTS)
    ]
    columns: list[list[object]] = [[] for _ in range(9)]
    for state, event, c in points:
        row = (
            None if state is _N else state.value,
            event_label(event),
            c.kind.value,
            c.queue.value,
            c.wait,
            _value(c.decision),
            _value(c.cause),
            c.mode.value,
            c.limited,
        )
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    got = await conn.fetch(  # type: ignore[attr-defined]
        """
        SELECT envq.envelope_target(state::envq.envelope_state, event::envq.envelope_event,
                                    kind::envq.envelope_kind, queue::envq.queue_state, wait,
                                    decision::envq.decision_kind, cause::envq.cancel_cause,
                                    mode::envq.stop_mode, limited)::text AS target
          FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[], $6::text[],
                      $7::text[], $8::text[], $9::bool[]) WITH ORDINALITY
               AS t(state, event, kind, queue, wait, decision, cause, mode, limited, i)
         ORDER BY i
        """,
        *columns,
    )
    assert len(got) == len(points)
    disagreements = []
    for (state, event, c), record in zip(points, got, strict=True):
        expected = _value(_stored(decide(state, event, c)))
        if record["target"] != expected:
            disagreements.append((state.name, event_label(event), c, record["target"], expected))
    return disagreements


@pytest.mark.real_clock
@pytest.mark.one_python
async def test_envelope_target_is_the_tables_everywhere(pg_dsn: str) -> None:
    """``envq.envelope_target`` returns what ``target`` returns for every state, event
    and guard valuation (NULL where the event does not move the envelope)."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        disagreements = await _function_disagreements(conn)
    assert disagreements == [], disagreements[:5]


def _mutant(state: EnvState, event: object, situation: Situation) -> EnvState | None:
    """The tables with one row changed: a periodic envelope's successful attempt
    succeeds instead of being rescheduled."""
    if (state, event, situation.kind) == (EnvState.RUNNING, Outcome.OK, Kind.PERIODIC):
        return EnvState.SUCCEEDED
    return target(state, event, situation)


@pytest.mark.real_clock
@pytest.mark.one_python
async def test_a_schema_from_changed_tables_disagrees(pg_server: object) -> None:
    """The comparison can fail: a schema compiled from tables with one changed row
    disagrees with the tables exactly where the row applies."""
    from pg_support import create_database, session  # noqa: PLC0415

    await create_database(pg_server, "envq_mutant", _mutant)  # type: ignore[arg-type]
    async with session(pg_server.dsn("envq_mutant")) as conn:  # type: ignore[attr-defined]
        disagreements = await _function_disagreements(conn)
    expected = [c for c in SITUATIONS if c.kind is Kind.PERIODIC]
    assert [(d[0], d[1]) for d in disagreements] == [("RUNNING", "attempt_ok")] * len(expected)
    assert {d[3] for d in disagreements} == {"succeeded"}


# ---------------------------------------------------------------------------------------
# The trigger: real INSERTs and UPDATEs, every candidate target
# ---------------------------------------------------------------------------------------

#: Tries one move in a subtransaction and undoes it: 'accepted' or 'refused' (any other
#: error propagates and fails the test).
_TRY_MOVE = f"""
CREATE FUNCTION pg_temp.try_move(row_seq bigint, q text, k envq.envelope_kind,
                                 candidate envq.envelope_state, ev envq.envelope_event,
                                 w boolean, d envq.decision_kind, c envq.cancel_cause,
                                 l boolean) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    BEGIN
        IF row_seq IS NULL THEN
            INSERT INTO envq.envelopes (queue, invoke, kind, state, event, wait, decision,
                                        cause, limited)
            VALUES (q, 'tests.job', k, candidate, ev, w, d, c, l);
        ELSE
            UPDATE envq.envelopes
               SET state = candidate, event = ev, wait = w, decision = d, cause = c,
                   limited = l
             WHERE seq = row_seq;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'no envelope %', row_seq;
            END IF;
        END IF;
        RAISE EXCEPTION USING ERRCODE = 'EQ999';
    EXCEPTION
        WHEN SQLSTATE 'EQ999' THEN RETURN true;
        WHEN SQLSTATE '{REFUSED_ENVELOPE_MOVE}' OR SQLSTATE '{REFUSED_CALL}' THEN RETURN false;
    END;
END
$$;
"""


def _queue_name(queue: QueueState, mode: StopMode) -> str:
    return f"{queue.value}/{mode.value}"


async def _place_rows(conn: object) -> dict[tuple[EnvState, Kind, str], int]:
    """One queue row per (lifecycle state, stop mode) and one envelope row per (stored
    state, kind, queue), put there directly (triggers off for this transaction)."""
    execute = conn.execute  # type: ignore[attr-defined]
    fetchval = conn.fetchval  # type: ignore[attr-defined]
    await execute("SET LOCAL session_replication_role = replica")
    seqs: dict[tuple[EnvState, Kind, str], int] = {}
    for queue, mode in itertools.product(QueueState, StopMode):
        name = _queue_name(queue, mode)
        await execute(
            "INSERT INTO envq.queues (name, state, stop_mode) VALUES ($1, $2, $3)",
            name,
            queue.value,
            mode.value,
        )
        for state, kind in itertools.product(STORED_STATES, Kind):
            seqs[(state, kind, name)] = await fetchval(
                "INSERT INTO envq.envelopes (queue, invoke, kind, state)"
                " VALUES ($1, 'tests.job', $2, $3) RETURNING seq",
                name,
                kind.value,
                state.value,
            )
    await execute("SET LOCAL session_replication_role = origin")
    await execute(_TRY_MOVE)
    return seqs


def _send_rejected(queue: QueueState) -> bool:
    return LIFECYCLE[(queue, QueueCall.SEND)].action is LifeAction.REJECT


def _cases() -> Iterator[tuple[EnvState, EnvEvent | Outcome, Situation, EnvState | None]]:
    """(state, event, situation, the one target the database must accept): every
    situation of every pair the tables define, and every pair they do not in every
    kind and lifecycle state (the other guards at their defaults)."""
    defined = _defined_pairs(target)
    plain = Situation()
    for c in SITUATIONS:
        others_default = attrs_equal_except(c, plain, ("kind", "queue"))
        for state, event in itertools.product(EnvState, ENVELOPE_EVENTS):
            if (state, event) not in defined and not others_default:
                continue
            expected = _stored(target(state, event, c))
            if state is _N and _send_rejected(c.queue):
                # The lifecycle rejects a send before any envelope moves.
                expected = None
            yield state, event, c, expected


def attrs_equal_except(left: Situation, right: Situation, names: tuple[str, ...]) -> bool:
    """``left`` and ``right`` agree on every guard but ``names``."""
    fields = ("kind", "queue", "wait", "decision", "cause", "mode", "limited")
    return all(getattr(left, f) == getattr(right, f) for f in fields if f not in names)


async def _trigger_disagreements(
    conn: object,
    cases: list[tuple[EnvState, EnvEvent | Outcome, Situation, EnvState | None]],
) -> tuple[list[object], int]:
    """Try every case with every candidate state; the cases where the accepted states
    are not exactly the expected target, and how many cases accepted one."""
    seqs = await _place_rows(conn)
    columns: list[list[object]] = [[] for _ in range(10)]
    for index, (state, event, c, _expected) in enumerate(cases):
        name = _queue_name(c.queue, c.mode)
        seq = None if state is _N else seqs[(state, c.kind, name)]
        for candidate in STORED_STATES:
            row = (
                index,
                seq,
                name,
                c.kind.value,
                candidate.value,
                event_label(event),
                c.wait,
                _value(c.decision),
                _value(c.cause),
                c.limited,
            )
            for column, value in zip(columns, row, strict=True):
                column.append(value)
    accepted = await conn.fetch(  # type: ignore[attr-defined]
        """
        SELECT i, candidate FROM unnest($1::int[], $2::bigint[], $3::text[], $4::text[],
                                        $5::text[], $6::text[], $7::bool[], $8::text[],
                                        $9::text[], $10::bool[])
               AS t(i, seq, q, k, candidate, ev, w, d, c, l)
         WHERE pg_temp.try_move(seq, q, k::envq.envelope_kind,
                                candidate::envq.envelope_state, ev::envq.envelope_event,
                                w, d::envq.decision_kind, c::envq.cancel_cause, l)
        """,
        *columns,
    )
    by_case: dict[int, list[str]] = {}
    for record in accepted:
        by_case.setdefault(record["i"], []).append(record["candidate"])
    wrong: list[object] = [
        (state.name, event_label(event), c, by_case.get(i, []), _value(expected))
        for i, (state, event, c, expected) in enumerate(cases)
        if by_case.get(i, []) != ([] if expected is None else [expected.value])
    ]
    return wrong, len(by_case)


@pytest.mark.real_clock
@pytest.mark.one_python
async def test_the_trigger_accepts_exactly_the_tables_target(pg_dsn: str) -> None:
    """Every (state, event, situation), every candidate state: the INSERT (from NEW)
    or UPDATE is accepted for the tables' target and refused for every other."""
    from pg_support import session  # noqa: PLC0415

    cases = list(_cases())
    async with session(pg_dsn) as conn:
        wrong, accepting = await _trigger_disagreements(conn, cases)
    assert wrong == [], wrong[:5]
    # Both sides were exercised: moves accepted and refused, from NEW and from the rest.
    assert accepting == sum(1 for *_, expected in cases if expected is not None) > 10_000
    assert any(state is _N and exp is not None for state, _, _, exp in cases)
    assert any(exp is None for _, _, _, exp in cases)


@pytest.mark.real_clock
@pytest.mark.one_python
async def test_a_trigger_from_changed_tables_disagrees(pg_server: object) -> None:
    """The trigger comparison can fail: under a schema compiled from tables with one
    changed row, the database accepts the changed target where the tables refuse it."""
    from pg_support import create_database, session  # noqa: PLC0415

    await create_database(pg_server, "envq_mutant_trigger", _mutant)  # type: ignore[arg-type]
    cases = [case for case in _cases() if case[:2] == (EnvState.RUNNING, Outcome.OK)]
    async with session(pg_server.dsn("envq_mutant_trigger")) as conn:  # type: ignore[attr-defined]
        wrong, _ = await _trigger_disagreements(conn, cases)
    periodic = [case for case in cases if case[2].kind is Kind.PERIODIC]
    assert len(wrong) == len(periodic) > 0
    assert {(w[3][0] if w[3] else None) for w in wrong} == {"succeeded"}  # type: ignore[index]


# ---------------------------------------------------------------------------------------
# The lifecycle
# ---------------------------------------------------------------------------------------


@pytest.mark.real_clock
@pytest.mark.one_python
async def test_the_lifecycle_trigger_accepts_exactly_the_tables_target(pg_dsn: str) -> None:
    """Every (lifecycle state, call), every candidate state: accepted only for the
    row's target; a REJECT row refuses every candidate naming its error; a pair the
    tables leave out refuses every candidate."""
    from pg_support import session  # noqa: PLC0415

    wrong = []
    async with session(pg_dsn) as conn:
        await conn.execute("SET LOCAL session_replication_role = replica")
        for state in QueueState:
            await conn.execute(
                "INSERT INTO envq.queues (name, state) VALUES ($1, $2)", state.value, state.value
            )
        await conn.execute("SET LOCAL session_replication_role = origin")
        for state, call, candidate in itertools.product(QueueState, QueueCall, QueueState):
            row = LIFECYCLE.get((state, call))
            message = ""
            try:
                async with conn.transaction():
                    await conn.execute(
                        "UPDATE envq.queues SET state = $2, call = $3 WHERE name = $1",
                        state.value,
                        candidate.value,
                        call.value,
                    )
                    verdict = "accepted"
                    raise _Undo
            except _Undo:
                pass
            except asyncpg_error() as error:
                verdict, message = error.sqlstate, str(error)
            if row is None:
                expected = REFUSED_QUEUE_MOVE
            elif row.action is LifeAction.REJECT:
                expected = REFUSED_CALL
                assert row.error is not None
                if row.error.__name__ not in message:
                    wrong.append((state.name, call.name, "error not named", message))
            else:
                expected = "accepted" if row.target is candidate else REFUSED_QUEUE_MOVE
            if verdict != expected:
                wrong.append((state.name, call.name, candidate.name, verdict, expected))
    assert wrong == [], wrong


class _Undo(Exception):
    """Rolls back an accepted move's savepoint."""


def asyncpg_error() -> type[Exception]:
    """asyncpg's base class of server errors (imported only where the server runs)."""
    import asyncpg  # noqa: PLC0415

    return asyncpg.PostgresError  # type: ignore[no-any-return]


@pytest.mark.real_clock
async def test_a_queue_is_created_in_its_initial_state_only(pg_dsn: str) -> None:
    """A queue row starts INIT; creating one in another state is refused."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        await conn.execute("INSERT INTO envq.queues (name) VALUES ('q')")
        assert await conn.fetchval("SELECT state::text FROM envq.queues WHERE name = 'q'") == "init"
        with pytest.raises(asyncpg_error()) as caught:
            await conn.execute("INSERT INTO envq.queues (name, state) VALUES ('r', 'running')")
        assert caught.value.sqlstate == REFUSED_QUEUE_MOVE  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# No way around the trigger, and what the rows hold
# ---------------------------------------------------------------------------------------


async def _ready_envelope(conn: object, queue: str = "q", id_: str | None = None) -> int:
    execute = conn.execute  # type: ignore[attr-defined]
    known = await conn.fetchval(  # type: ignore[attr-defined]
        "SELECT count(*) FROM envq.queues WHERE name = $1", queue
    )
    if known == 0:
        await execute("INSERT INTO envq.queues (name) VALUES ($1)", queue)
        await execute(
            "UPDATE envq.queues SET state = 'running', call = 'start' WHERE name = $1", queue
        )
    seq: int = await conn.fetchval(  # type: ignore[attr-defined]
        "INSERT INTO envq.envelopes (queue, id, invoke, kind, state, event)"
        " VALUES ($1, $2::jsonb, 'tests.job', 'one_off', 'ready', 'send') RETURNING seq",
        queue,
        id_,
    )
    return seq


@pytest.mark.real_clock
async def test_a_state_change_without_an_event_is_refused(pg_dsn: str) -> None:
    """An UPDATE that changes the state and names no event is refused, even right after
    a legal move (the trigger clears the event, so it cannot be reused)."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        seq = await _ready_envelope(conn)
        with pytest.raises(asyncpg_error()) as caught:
            async with conn.transaction():
                await conn.execute(
                    "UPDATE envq.envelopes SET state = 'running' WHERE seq = $1", seq
                )
        assert caught.value.sqlstate == REFUSED_ENVELOPE_MOVE  # type: ignore[attr-defined]
        assert "names no event" in str(caught.value)
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'running', event = 'dispatch' WHERE seq = $1", seq
        )
        stored = await conn.fetchrow(
            "SELECT state::text, event, decision, cause, wait, limited FROM envq.envelopes"
            " WHERE seq = $1",
            seq,
        )
        assert tuple(stored) == ("running", None, None, None, None, None)
        with pytest.raises(asyncpg_error()):
            async with conn.transaction():
                await conn.execute(
                    "UPDATE envq.envelopes SET state = 'succeeded' WHERE seq = $1", seq
                )
        # Columns other than the state change freely, without an event.
        await conn.execute("UPDATE envq.envelopes SET attempt = 1 WHERE seq = $1", seq)
        assert await conn.fetchval("SELECT attempt FROM envq.envelopes WHERE seq = $1", seq) == 1


@pytest.mark.real_clock
async def test_a_refused_move_names_the_state_the_event_and_the_target(pg_dsn: str) -> None:
    """The error says where the envelope was, the event, the refused state and the
    one the tables lead to."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        seq = await _ready_envelope(conn)
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'running', event = 'dispatch' WHERE seq = $1", seq
        )
        with pytest.raises(asyncpg_error()) as caught:
            await conn.execute(
                "UPDATE envq.envelopes SET state = 'ready', event = 'attempt_ok' WHERE seq = $1",
                seq,
            )
    message = str(caught.value)
    assert "running --attempt_ok--> ready is not in the tables" in message
    assert "they lead to succeeded" in message


@pytest.mark.real_clock
async def test_an_envelope_stays_in_its_queue_and_its_kind(pg_dsn: str) -> None:
    """Moving a row to another queue is refused; its kind changes only while it runs,
    to a relabelled group (blacklisted, cancelled)."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        seq = await _ready_envelope(conn, "a")
        await _ready_envelope(conn, "b")
        for change in ("queue = 'b'", "kind = 'periodic'", "kind = 'blacklisted'"):
            with pytest.raises(asyncpg_error()) as caught:
                async with conn.transaction():
                    await conn.execute(f"UPDATE envq.envelopes SET {change} WHERE seq = $1", seq)
            assert caught.value.sqlstate == REFUSED_ENVELOPE_MOVE  # type: ignore[attr-defined]
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'running', event = 'dispatch' WHERE seq = $1", seq
        )
        for kind in ("blacklisted", "cancelled"):
            await conn.execute("UPDATE envq.envelopes SET kind = $2 WHERE seq = $1", seq, kind)


@pytest.mark.real_clock
async def test_sending_to_a_stopped_queue_is_rejected_with_its_error(pg_dsn: str) -> None:
    """An INSERT into a queue whose lifecycle rejects sends is refused, naming the
    error the in-process queue raises; a queue that does not exist is refused too."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        await _ready_envelope(conn)
        await conn.execute(
            "UPDATE envq.queues SET state = 'stopping', call = 'stop' WHERE name = 'q'"
        )
        await conn.execute(
            "UPDATE envq.queues SET state = 'stopped', call = 'drained' WHERE name = 'q'"
        )
        with pytest.raises(asyncpg_error()) as caught:
            async with conn.transaction():
                await _ready_envelope(conn)
        assert caught.value.sqlstate == REFUSED_CALL  # type: ignore[attr-defined]
        assert "QueueNotRunning" in str(caught.value)
        with pytest.raises(asyncpg_error()) as missing:
            await _ready_envelope_in_missing_queue(conn)
        assert "no queue named" in str(missing.value)


async def _ready_envelope_in_missing_queue(conn: object) -> None:
    await conn.execute(  # type: ignore[attr-defined]
        "INSERT INTO envq.envelopes (queue, invoke, kind, state, event)"
        " VALUES ('nowhere', 'tests.job', 'one_off', 'ready', 'send')"
    )


@pytest.mark.real_clock
async def test_dedup_by_id_among_live_envelopes(pg_dsn: str) -> None:
    """Two live envelopes of one queue cannot share an id; once the first has ended, or
    in another queue, or without an id, they can."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        first = await _ready_envelope(conn, "q", '{"order": 7}')
        with pytest.raises(asyncpg_error()) as caught:
            async with conn.transaction():
                await _ready_envelope(conn, "q", '{"order": 7}')
        assert caught.value.sqlstate == "23505"  # type: ignore[attr-defined]
        await _ready_envelope(conn, "other", '{"order": 7}')
        await _ready_envelope(conn, "q")
        await _ready_envelope(conn, "q")
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'running', event = 'dispatch' WHERE seq = $1", first
        )
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'succeeded', event = 'attempt_ok' WHERE seq = $1",
            first,
        )
        await _ready_envelope(conn, "q", '{"order": 7}')


@pytest.mark.real_clock
async def test_the_schema_records_its_version(pg_dsn: str) -> None:
    """``envq.schema_version`` holds the generator's version, and so does the schema's
    comment."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        assert await conn.fetchval("SELECT max(version) FROM envq.schema_version") == (
            SCHEMA_VERSION
        )
        comment = await conn.fetchval("SELECT obj_description('envq'::regnamespace)")
    assert comment == f"envq schema version {SCHEMA_VERSION}"


def test_the_enumeration_covers_every_guard() -> None:
    """The situations the tests enumerate take every value of every guard."""
    assert {c.kind for c in SITUATIONS} == set(Kind)
    assert {c.queue for c in SITUATIONS} == set(QueueState)
    assert {c.decision for c in SITUATIONS} == {None, *DecisionKind}
    assert {c.cause for c in SITUATIONS} == {None, *CancelCause}
    assert {c.mode for c in SITUATIONS} == set(StopMode)
    assert {(c.wait, c.limited) for c in SITUATIONS} == set(
        itertools.product((False, True), repeat=2)
    )


# ---------------------------------------------------------------------------------------
# Deletes: a discard, or a hand-back
# ---------------------------------------------------------------------------------------


@pytest.mark.real_clock
async def test_only_the_rows_the_tables_discard_or_hand_back_may_be_deleted(
    pg_dsn: str,
) -> None:
    """A row in a state whose discard leads to NEW in the tables, or a handed-back
    (RETURNED) one, may be deleted; a live one is refused, naming the cancel."""
    from pg_support import session  # noqa: PLC0415

    from envq.postgres.schema import discardable  # noqa: PLC0415

    deletable = {*discardable(), EnvState.RETURNED}
    assert set(discardable()) == {s for (s, e), row in QUEUE_MOVES.items() if e is EnvEvent.DISCARD}
    refused = []
    async with session(pg_dsn) as conn:
        one_each = {state: seq for (state, _kind, _queue), seq in (await _place_rows(conn)).items()}
        for state, seq in sorted(one_each.items(), key=lambda kv: kv[1]):
            try:
                async with conn.transaction():
                    await conn.execute("DELETE FROM envq.envelopes WHERE seq = $1", seq)
            except Exception as error:
                refused.append((state, getattr(error, "sqlstate", None), str(error)))
            else:
                assert state in deletable, state
    assert {state for state, _, _ in refused} == set(STORED_STATES) - deletable
    assert all(code == REFUSED_ENVELOPE_MOVE for _, code, _ in refused), refused
    assert all("cancel it first" in text for _, _, text in refused), refused


@pytest.mark.real_clock
async def test_a_queue_holding_envelopes_is_not_deleted(pg_dsn: str) -> None:
    """A queue is deleted only once it holds no envelope rows (as a foreign key of the
    envelopes' queue would have it); a row sent to a queue that is not there is refused."""
    from pg_support import session  # noqa: PLC0415

    async with session(pg_dsn) as conn:
        seq = await _ready_envelope(conn, "kept")
        with pytest.raises(asyncpg_error()) as caught:
            async with conn.transaction():
                await conn.execute("DELETE FROM envq.queues WHERE name = 'kept'")
        assert caught.value.sqlstate == "23503"  # type: ignore[attr-defined]
        assert "'kept' still holds envelopes" in str(caught.value)
        assert await conn.fetchval("SELECT count(*) FROM envq.queues WHERE name = 'kept'") == 1
        await _discard(conn, seq)
        await conn.execute("DELETE FROM envq.queues WHERE name = 'kept'")
        assert await conn.fetchval("SELECT count(*) FROM envq.queues WHERE name = 'kept'") == 0
        with pytest.raises(asyncpg_error()) as caught:
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO envq.envelopes (queue, invoke, kind, state, event)"
                    " VALUES ('kept', 'tests.job', 'one_off', 'ready', 'send')"
                )
        assert caught.value.sqlstate == REFUSED_ENVELOPE_MOVE  # type: ignore[attr-defined]
        assert "no queue named 'kept'" in str(caught.value)


async def _discard(conn: object, seq: int) -> None:
    await conn.execute(  # type: ignore[attr-defined]
        "UPDATE envq.envelopes SET state = 'stopped', event = 'cancel' WHERE seq = $1", seq
    )
    await conn.execute("DELETE FROM envq.envelopes WHERE seq = $1", seq)  # type: ignore[attr-defined]


@pytest.mark.real_clock
async def test_a_queue_delete_waits_for_a_send_in_flight_and_is_refused(pg_dsn: str) -> None:
    """A send not yet committed holds its queue's row: a delete of the queue waits for
    it, and once the send commits, is refused (the new row is the queue's)."""
    import asyncpg  # noqa: PLC0415

    name = f"busy-{uuid.uuid4().hex}"
    sender, deleter = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    try:
        await _discard(sender, await _ready_envelope(sender, name))
        sending = sender.transaction()
        await sending.start()
        seq = await sender.fetchval(
            "INSERT INTO envq.envelopes (queue, invoke, kind, state, event)"
            " VALUES ($1, 'tests.job', 'one_off', 'ready', 'send') RETURNING seq",
            name,
        )
        pid = await deleter.fetchval("SELECT pg_backend_pid()")
        deleting = asyncio.ensure_future(
            deleter.execute("DELETE FROM envq.queues WHERE name = $1", name)
        )
        waited = False
        for _ in range(500):  # until the delete waits for the send's lock (or ends)
            waited = await sender.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
            )
            if waited or deleting.done():
                break
            await asyncio.sleep(0.01)
        assert waited
        assert not deleting.done()
        await sending.commit()
        with pytest.raises(asyncpg_error()) as caught:
            await deleting
        assert caught.value.sqlstate == "23503"  # type: ignore[attr-defined]
        assert (
            await sender.fetchval("SELECT count(*) FROM envq.envelopes WHERE queue = $1", name) == 1
        )
        await _discard(sender, seq)
        await sender.execute("DELETE FROM envq.queues WHERE name = $1", name)
    finally:
        await sender.close()
        await deleter.close()
