"""``envq spec``: the runtime's lifecycle and outcome tables, as text, Markdown or JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import envq
from envq import _machine as m
from envq.__main__ import main, render_spec, spec_data

ROOT = Path(__file__).resolve().parents[2]


def spec_json(capsys: pytest.CaptureFixture[str]) -> Any:
    """``envq spec --format json``, parsed."""
    assert main(["spec", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


class TestJson:
    def test_lifecycle_equals_the_table(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Every (state, call) row is the table's row, or illegal exactly when the pair
        is listed as illegal."""
        data = spec_json(capsys)
        rows = {(r["state"], r["call"]): r for r in data["lifecycle"]}
        assert len(rows) == len(m.QueueState) * len(m.QueueCall) == len(data["lifecycle"])
        rebuilt = {}
        for (state, call), r in rows.items():
            key = (m.QueueState[state], m.QueueCall[call])
            if "action" not in r:
                assert r["illegal"] is True
                assert key in m.ILLEGAL_LIFECYCLE
                continue
            rebuilt[key] = m.LifeRow(
                m.LifeAction[r["action"]],
                m.QueueState[r["target"]] if r["target"] is not None else None,
                getattr(envq, r["error"]) if r["error"] is not None else None,
            )
        assert rebuilt == dict(m.LIFECYCLE)

    def test_outcomes_equal_the_table(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Every (kind, outcome) row is the table's row, redirects included."""
        data = spec_json(capsys)
        rebuilt = {
            (m.Kind[r["kind"]], m.Outcome[r["outcome"]]): m.OutcomeRow(
                m.Action[r["action"]],
                m.EnvState[r["target"]],
                frozenset(m.EnvState[s] for s in r["redirects"]),
                limited=r["limited"],
            )
            for r in data["outcomes"]
        }
        assert rebuilt == dict(m.OUTCOMES)
        assert len(data["outcomes"]) == len(m.OUTCOMES)

    def test_choices_equal_the_tables(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The decision, cancel and parking maps are the runtime's."""
        data = spec_json(capsys)
        assert data["decision_target"] == {d.name: t.name for d, t in m.DECISION_TARGET.items()}
        assert data["shelve_target"] == {c.name: t.name for c, t in m.SHELVE_TARGET.items()}
        assert data["park_instead"] == {s.name: t.name for s, t in m.PARK_INSTEAD.items()}

    def test_rows_match_the_generated_specs(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The rows have the shape and content of specs/lifecycle.json and
        specs/envelope.json (generated from the same tables)."""
        data = spec_json(capsys)
        lifecycle = json.loads((ROOT / "specs" / "lifecycle.json").read_text())
        envelope = json.loads((ROOT / "specs" / "envelope.json").read_text())
        assert data["lifecycle"] == lifecycle["rows"]
        assert data["outcomes"] == envelope["outcomes"]


class TestText:
    def test_default_is_text(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Plain text: a titled table for each machine, one line per row."""
        assert main(["spec"]) == 0
        out = capsys.readouterr().out
        assert out == render_spec("text")
        assert out.startswith("Lifecycle (envq._machine.LIFECYCLE)")
        assert "Outcomes (envq._machine.OUTCOMES)" in out
        assert re.search(r"^RUNNING +STOP +BEGIN_STOP +STOPPING *$", out, re.M)
        assert re.search(r"^STOPPING +SEND +REJECT +\(unchanged\) +QueueStopping$", out, re.M)
        assert re.search(r"^INIT +DRAINED +\(illegal\)$", out, re.M)
        assert re.search(r"^ONE_OFF +ERROR +DECIDE +FAILED +READY, DELAYED, PARKED$", out, re.M)
        assert re.search(r"^on_failure decision +DROP -> FAILED, ", out, re.M)
        data = spec_data()
        for row in data["lifecycle"]:
            assert re.search(rf"^{row['state']} +{row['call']} ", out, re.M)
        for row in data["outcomes"]:
            assert re.search(rf"^{row['kind']} +{row['outcome']} +{row['action']} ", out, re.M)
        assert "\x1b" not in out

    def test_markdown(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Markdown: two pipe tables with a header and a separator, one row per entry."""
        assert main(["spec", "--format", "markdown"]) == 0
        out = capsys.readouterr().out
        assert "## Lifecycle: queue state x call" in out
        assert "## Outcomes: (kind, outcome) of an attempt" in out
        table_rows = [ln for ln in out.splitlines() if ln.startswith("| ")]
        data = spec_data()
        header_lines = 2
        assert len(table_rows) == len(data["lifecycle"]) + len(data["outcomes"]) + header_lines
        assert "| RUNNING | STOP | BEGIN_STOP | STOPPING |  |" in out
        assert "| PERIODIC | OK | RESCHEDULE | DELAYED | PARKED |" in out
        assert out.count("|---|---|---|---|---|") == 2

    def test_bad_format_exits_2(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown format is a usage error."""
        with pytest.raises(SystemExit) as info:
            main(["spec", "--format", "yaml"])
        assert info.value.code == 2
        assert "invalid choice" in capsys.readouterr().err
        with pytest.raises(ValueError, match="yaml"):
            render_spec("yaml")

    def test_subprocess(self) -> None:
        """``python -m envq spec --format json`` works as a command."""
        proc = subprocess.run(
            [sys.executable, "-m", "envq", "spec", "--format", "json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == spec_data()


class TestWithoutTheModels:
    """``envq spec`` needs only the engine; the generators say what they miss."""

    @staticmethod
    def _run(*args: str) -> subprocess.CompletedProcess[str]:
        code = (
            "import sys; sys.modules['statemachine'] = None; "
            "from envq.__main__ import main; sys.exit(main(sys.argv[1:]))"
        )
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
            timeout=60,
        )

    def test_spec_prints_without_python_statemachine(self) -> None:
        proc = self._run("spec", "--format", "json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == spec_data()

    @pytest.mark.parametrize("args", [("spec", "--check"), ("explore",)])
    def test_the_generators_need_the_conform_extra(self, args: tuple[str, ...]) -> None:
        proc = self._run(*args)
        assert proc.returncode == 2
        assert "needs the conform extra (statemachine is missing)" in proc.stderr


def test_queue_moves_equal_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """Every queue-side row of ``QUEUE_MOVES`` is printed with its guard and targets."""
    rows = {(r["state"], r["event"]): r for r in spec_json(capsys)["queue_moves"]}
    assert set(rows) == {(s.name, e.name) for s, e in m.QUEUE_MOVES}
    for (state, event), row in m.QUEUE_MOVES.items():
        printed = rows[(state.name, event.name)]
        assert printed["guard"] == row.guard.name
        assert sorted(printed["targets"].values()) == sorted(t.name for t in row.targets.values())
