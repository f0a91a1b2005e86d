"""The generated SQL: fresh in ``specs/``, deterministic, and made from the tables.

These tests read the SQL as text and need no server.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from envq._machine import EnvState, Kind, Outcome, QueueCall, QueueState, Situation, target
from envq.postgres import schema
from envq.postgres.schema import ENVELOPE_EVENTS, STORED_STATES, event_label, main, render

SPEC = Path(__file__).resolve().parents[2] / "specs" / "postgres.sql"


def _enum_labels(sql: str, name: str) -> list[str]:
    found = re.search(rf"CREATE TYPE envq\.{name} AS ENUM \((.*?)\);", sql, re.S)
    assert found is not None, name
    return re.findall(r"'([^']*)'", found.group(1))


def test_committed_sql_is_fresh() -> None:
    """specs/postgres.sql equals a fresh generation (else: python -m envq.postgres.schema
    --output specs/postgres.sql)."""
    assert SPEC.read_text(encoding="utf-8") == render()


def test_generation_is_deterministic() -> None:
    """Two generations are byte-for-byte equal."""
    assert render() == render()


def test_enums_are_the_tables_states_and_events() -> None:
    """The enums list the tables' members in declaration order; NEW is not stored, and
    the outcome STOP and the event STOP get distinct labels."""
    sql = render()
    assert _enum_labels(sql, "envelope_state") == [s.value for s in STORED_STATES]
    assert EnvState.NEW not in STORED_STATES
    assert _enum_labels(sql, "envelope_event") == [event_label(e) for e in ENVELOPE_EVENTS]
    assert len(set(_enum_labels(sql, "envelope_event"))) == len(ENVELOPE_EVENTS)
    assert _enum_labels(sql, "queue_state") == [s.value for s in QueueState]
    assert _enum_labels(sql, "queue_call") == [c.value for c in QueueCall]
    assert _enum_labels(sql, "envelope_kind") == [k.value for k in Kind]


def test_changed_tables_change_the_sql() -> None:
    """The envelope moves are compiled from the function given: a changed row gives
    different SQL (so the SQL cannot drift from the tables unnoticed)."""

    def changed(state: EnvState, event: object, situation: Situation) -> EnvState | None:
        if (state, event) == (EnvState.RUNNING, Outcome.OK):
            return EnvState.FAILED
        return target(state, event, situation)  # type: ignore[arg-type]

    assert render(changed) != render()


def test_main_prints_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m envq.postgres.schema`` prints the SQL, ``--output`` writes it and
    ``--check`` exits 1 on a stale file, 0 on a fresh one."""
    assert main([]) == 0
    assert capsys.readouterr().out == render()
    out = tmp_path / "postgres.sql"
    assert main(["--check", str(out)]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["--output", str(out)]) == 0
    assert main(["--check", str(out)]) == 0
    out.write_text(render() + "-- edited\n", encoding="utf-8")
    assert main(["--check", str(out)]) == 1


def test_guards_are_the_situations_fields() -> None:
    """The generator branches on every guard of a Situation, and only on those (a new
    guard in the tables must reach the SQL)."""
    assert [name for name, _ in schema.GUARDS] == [f.name for f in attrs.fields(Situation)]


def test_version_is_in_the_sql() -> None:
    """The schema records the generator's version."""
    assert f"VALUES ({schema.SCHEMA_VERSION}, {schema.COMPATIBLE_FROM});" in render()
