"""The small-scope explorer finds no violation in the runtime tables, and can find one.

:mod:`envq.model.explore` (``python -m envq explore``) walks every state of an
abstract queue within a bounded number of operations, driven by the tables of
``envq._machine``. These tests run it on the real tables (no violation, every table
entry exercised) and on deliberately broken
copies (each one caught, naming the right invariant).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from envq.__main__ import main
from envq._machine import (
    CancelCause,
    EnvEvent,
    EnvState,
    Kind,
    LifeAction,
    LifeRow,
    Outcome,
    QueueCall,
    QueueState,
    StopMode,
)
from envq.model import explore
from models.invariants import INVARIANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> list[Any]:
    """One exploration of every scope the script explores, at depth 12."""
    return [explore.explore(attrs.evolve(scope, depth=12)) for scope in explore.SCOPES]


class TestRealTables:
    """The runtime tables keep every invariant in every scope."""

    def test_no_violation(self, reports: list[Any]) -> None:
        """No state and no edge breaks an invariant."""
        for report in reports:
            assert report.violations == (), "\n".join(map(str, report.violations))

    def test_meaningful_state_count(self, reports: list[Any]) -> None:
        """The scopes reach thousands of distinct states; the two-envelope ones exhaustively."""
        assert sum(r.states for r in reports) > 2000
        assert all(r.states > 150 for r in reports)
        assert any(r.frontier == 0 for r in reports)

    def test_every_table_entry_is_exercised(self, reports: list[Any]) -> None:
        """Every lifecycle row, outcome row and envelope move is used by some edge."""
        assert explore.uncovered(reports) == []

    def test_main_reports_and_exits_zero(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``envq explore`` prints the state counts and exits 0."""
        assert main(["explore", "--depth", "8"]) == 0
        out = capsys.readouterr().out
        assert "states explored" in out
        assert "no violations" in out
        assert out.count("depth=8:") == len(explore.SCOPES)

    def test_a_violation_exits_one(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A broken table makes ``envq explore`` print the violations and exit 1."""
        broken = attrs.evolve(explore.Tables(), park_instead={})
        monkeypatch.setattr(explore, "explore", lambda config: _explore(config, broken))
        assert main(["explore", "--depth", "6", "--show", "1"]) == 1
        assert "VIOLATIONS FOUND" in capsys.readouterr().out

    def test_as_a_command(self) -> None:
        """``python -m envq explore`` runs as a command."""
        proc = subprocess.run(
            [sys.executable, "-m", "envq", "explore", "--depth", "4"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
            timeout=120,
        )
        assert "states explored" in proc.stdout, proc.stderr
        # at depth 4 some table entries are not reached: the exit status says so
        assert proc.returncode == 1
        assert "not exercised" in proc.stdout

    def test_invariant_ids_are_the_documented_ones(self) -> None:
        """The explorer reports with the ids of models/invariants.py."""
        assert [i.id for i in INVARIANTS] == [f"I{n}" for n in range(1, 9)]


_explore = explore.explore


def _with(mapping: Any, key: Any, value: Any) -> dict[Any, Any]:
    changed = dict(mapping)
    if value is None:
        del changed[key]
    else:
        changed[key] = value
    return changed


def _outcome_row(kind: Kind, outcome: Outcome, **changes: Any) -> Callable[[Any], Any]:
    def mutate(tables: Any) -> Any:
        row = attrs.evolve(tables.outcomes[(kind, outcome)], **changes)
        return attrs.evolve(tables, outcomes=_with(tables.outcomes, (kind, outcome), row))

    return mutate


BROKEN: dict[str, tuple[Callable[[Any], Any], set[str]]] = {
    # A periodic success that drops the envelope instead of rescheduling it.
    "periodic OK drops the envelope": (
        _outcome_row(Kind.PERIODIC, Outcome.OK, target=EnvState.NEW),
        {"I1", "I5", "I7"},
    ),
    # A one-off failure whose default is "retry now" while the action drops (slot released).
    "one-off ERROR default is READY": (
        _outcome_row(Kind.ONE_OFF, Outcome.ERROR, target=EnvState.READY),
        {"I1"},
    ),
    # StopEnvelope that reschedules.
    "STOP reschedules": (
        _outcome_row(Kind.PERIODIC, Outcome.STOP, target=EnvState.DELAYED),
        {"I1", "I4", "I7"},
    ),
    # Nothing parked while the queue is not running: reschedules stay DELAYED in a stop.
    "no parking while not running": (
        lambda t: attrs.evolve(t, park_instead={}),
        {"I6"},
    ),
    # A terminate-cancelled attempt parked instead of handed back.
    "terminate parks the cancelled": (
        lambda t: attrs.evolve(
            t, shelve_target={**t.shelve_target, CancelCause.TERMINATE: EnvState.PARKED}
        ),
        {"I1", "I5"},
    ),
    # terminate() from STOPPED forgets the parked envelopes.
    "terminate forgets parked": (
        lambda t: attrs.evolve(
            t,
            lifecycle=_with(
                t.lifecycle,
                (QueueState.STOPPED, QueueCall.TERMINATE),
                LifeRow(LifeAction.NOTHING, QueueState.TERMINATED),
            ),
        ),
        {"I5", "I6"},
    ),
    # send() admitted while STOPPING.
    "send admitted while stopping": (
        lambda t: attrs.evolve(
            t,
            lifecycle=_with(
                t.lifecycle,
                (QueueState.STOPPING, QueueCall.SEND),
                LifeRow(LifeAction.ADMIT, QueueState.STOPPING),
            ),
        ),
        {"I7"},
    ),
    # A DRAIN stop that does not park DELAYED envelopes: they wait in a stopping queue.
    "a drain stop parks nothing": (
        lambda t: attrs.evolve(t, stop_parks={**t.stop_parks, StopMode.DRAIN: frozenset()}),
        {"I6"},
    ),
    # A STOP stop that leaves READY envelopes to be dispatched.
    "a stop stop parks only delayed": (
        lambda t: attrs.evolve(
            t, stop_parks={**t.stop_parks, StopMode.STOP: frozenset({EnvState.DELAYED})}
        ),
        {"I6"},
    ),
    # A limited retry that goes straight to RUNNING.
    "a limited retry runs": (
        lambda t: attrs.evolve(t, limited={EnvState.READY: EnvState.RUNNING}),
        {"I3", "I7"},
    ),
    # Arming that sends a delayed envelope back to the buffer.
    "arming buffers": (
        lambda t: attrs.evolve(t, armed={False: EnvState.READY, True: EnvState.BUFFERED}),
        {"I6", "I7"},
    ),
    # The relation forgets that a READY envelope can be dispatched.
    "no dispatch move": (
        lambda t: attrs.evolve(t, moves=_with(t.moves, (EnvState.READY, EnvEvent.DISPATCH), None)),
        {"I7"},
    ),
}


class TestBrokenTables:
    """A broken copy of a runtime table is caught (so a clean run means something)."""

    @pytest.mark.parametrize("name", sorted(BROKEN))
    def test_broken_copy_is_caught(self, name: str) -> None:
        """The exploration of the default scope reports the invariants the change breaks."""
        mutate, expected = BROKEN[name]
        report = explore.explore(explore.Config(), mutate(explore.Tables()))
        found = {v.invariant for v in report.violations}
        assert expected <= found, (name, found)

    def test_typeless_stop_type_is_a_stop(self) -> None:
        """A StopType on an envelope without a type must end it (``TYPELESS``); mapped to
        a plain error instead, the periodic envelope runs again after its StopType."""
        config = explore.Config(types=("a", ""))
        assert explore.explore(config).violations == ()
        broken = attrs.evolve(explore.Tables(), typeless={Outcome.STOP_TYPE: Outcome.ERROR})
        found = {v.invariant for v in explore.explore(config, broken).violations}
        assert "I4" in found, found

    def test_violation_carries_a_trace(self) -> None:
        """A violation names the operations that lead to it, from the initial state."""
        mutate, _ = BROKEN["periodic OK drops the envelope"]
        report = explore.explore(explore.Config(), mutate(explore.Tables()))
        first = report.violations[0]
        assert first.trace
        assert first.trace[0].startswith(("send", "start"))
        assert "end(e1, OK)" in first.trace
