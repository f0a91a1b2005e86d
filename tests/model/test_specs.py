"""The committed ``specs/`` (and docs/model.md's generated blocks) equal a fresh generation.

``scripts/gen_specs.py`` renders the runtime tables and the models; if a table or a
model changes and the specs are not regenerated, this test fails (run
``python scripts/gen_specs.py``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

# models/ is not an installed package: make the repository root importable even when
# pytest is started by its own script (``python -m pytest`` adds it anyway).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from envq._machine import (
    ENVELOPE_MOVES,
    LIFECYCLE,
    OUTCOMES,
    EnvState,
    QueueCall,
    QueueState,
)
from models.tables import envelope_transitions, lifecycle_transitions


def _load_gen_specs() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "scripts" / "gen_specs.py"
    spec = importlib.util.spec_from_file_location("gen_specs", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_specs"] = module
    spec.loader.exec_module(module)
    return module


gen_specs = _load_gen_specs()


class TestNoDrift:
    """What is committed is what the generator makes now."""

    def test_committed_specs_are_fresh(self) -> None:
        """Every generated file exists and equals a fresh generation (else: run gen_specs)."""
        stale = gen_specs.check(gen_specs.generate())
        assert stale == [], "stale: " + ", ".join(str(p) for p in stale)

    def test_expected_files(self) -> None:
        """The generator makes the five spec files and fills docs/model.md."""
        names = {p.name for p in gen_specs.generate()}
        assert {
            "lifecycle.json",
            "envelope.json",
            "invariants.md",
            "lifecycle.mmd",
            "envelope.mmd",
            "model.md",
        } <= names

    def test_generation_is_deterministic(self) -> None:
        """Two generations are byte-for-byte equal."""
        assert gen_specs.generate() == gen_specs.generate()

    def test_check_reports_a_differing_file(self, tmp_path: Path) -> None:
        """``check`` lists a file whose content differs and one that is missing."""
        same, other, missing = tmp_path / "same", tmp_path / "other", tmp_path / "missing"
        same.write_text("a", encoding="utf-8")
        other.write_text("b", encoding="utf-8")
        files = {same: "a", other: "a", missing: "a"}
        assert gen_specs.check(files) == [other, missing]

    def test_main_check_exit_status(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--check`` exits 0 on fresh specs."""
        assert gen_specs.main(["--check"]) == 0
        assert capsys.readouterr().out == ""


class TestContent:
    """The generated data says what the tables and the models say."""

    def test_lifecycle_json_has_every_pair(self) -> None:
        """One entry per (state, call): a row of LIFECYCLE or marked illegal."""
        data = json.loads(gen_specs._json(gen_specs.lifecycle_spec()))
        assert len(data["rows"]) == len(QueueState) * len(QueueCall)
        rows = [r for r in data["rows"] if "action" in r]
        assert len(rows) == len(LIFECYCLE)
        assert all(r["illegal"] for r in data["rows"] if "action" not in r)

    def test_envelope_json_matches_tables(self) -> None:
        """Every move, outcome row and model transition is in envelope.json."""
        data = json.loads(gen_specs._json(gen_specs.envelope_spec()))
        assert len(data["moves"]) == len(ENVELOPE_MOVES)
        assert len(data["outcomes"]) == len(OUTCOMES)
        assert len(data["model_transitions"]) == len(envelope_transitions())
        assert data["states"]["pseudo"] == [EnvState.NEW.name]

    def test_json_keys_are_sorted(self) -> None:
        """The JSON text is in canonical form (sorted keys, two-space indent)."""
        for name in ("lifecycle.json", "envelope.json"):
            text = gen_specs.generate()[gen_specs.SPECS / name]
            assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"

    def test_mermaid_has_every_transition(self) -> None:
        """Each Mermaid diagram draws one arrow per model transition (plus start/final)."""
        lifecycle = gen_specs.generate()[gen_specs.SPECS / "lifecycle.mmd"]
        envelope = gen_specs.generate()[gen_specs.SPECS / "envelope.mmd"]
        assert lifecycle.startswith("stateDiagram-v2")
        arrows = [line for line in lifecycle.splitlines() if " : " in line]
        assert len(arrows) == len(lifecycle_transitions())
        arrows = [line for line in envelope.splitlines() if " : " in line]
        assert len(arrows) == len(envelope_transitions())

    def test_docs_blocks_are_replaced(self) -> None:
        """A ``gen_specs`` block of the docs gets the current file, the rest is kept."""
        text = "intro\n<!-- gen_specs: lifecycle.mmd -->\nold\n<!-- /gen_specs -->\nend\n"
        files = gen_specs.generate()
        out = gen_specs.render_docs(text, files)
        mermaid = files[gen_specs.SPECS / "lifecycle.mmd"]
        assert out == (
            f"intro\n<!-- gen_specs: lifecycle.mmd -->\n```mermaid\n{mermaid}```\n"
            "<!-- /gen_specs -->\nend\n"
        )
