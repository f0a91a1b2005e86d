"""The committed ``specs/`` (and the generated blocks of the docs) equal a fresh generation.

:mod:`envq.model.specgen` renders the runtime tables and the models; if a table or a
model changes and the specs are not regenerated, this test fails (run
``python -m envq spec --write``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from envq.__main__ import main
from envq._machine import (
    ENVELOPE_MOVES,
    LIFECYCLE,
    OUTCOMES,
    EnvState,
    QueueCall,
    QueueState,
)
from envq.model import specgen as gen_specs
from models.tables import envelope_transitions, lifecycle_transitions

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"


def generate() -> dict[Path, str]:
    """A fresh generation for this checkout."""
    return gen_specs.generate(ROOT)


class TestNoDrift:
    """What is committed is what the generator makes now."""

    def test_committed_specs_are_fresh(self) -> None:
        """Every generated file exists and equals a fresh generation (else: run gen_specs)."""
        stale = gen_specs.check(generate())
        assert stale == [], "stale: " + ", ".join(str(p) for p in stale)

    def test_expected_files(self) -> None:
        """The generator makes the five spec files and fills the four docs pages."""
        names = {p.relative_to(ROOT).as_posix() for p in generate()}
        assert names == {
            "specs/lifecycle.json",
            "specs/envelope.json",
            "specs/invariants.md",
            "specs/lifecycle.mmd",
            "specs/envelope.mmd",
            "docs/model.md",
            "docs/tables.md",
            "docs/lifecycle.md",
            "docs/outcomes.md",
        }

    def test_generation_is_deterministic(self) -> None:
        """Two generations are byte-for-byte equal."""
        assert generate() == generate()

    def test_check_reports_a_differing_file(self, tmp_path: Path) -> None:
        """``check`` lists a file whose content differs and one that is missing."""
        same, other, missing = tmp_path / "same", tmp_path / "other", tmp_path / "missing"
        same.write_text("a", encoding="utf-8")
        other.write_text("b", encoding="utf-8")
        files = {same: "a", other: "a", missing: "a"}
        assert gen_specs.check(files) == [other, missing]

    def test_main_check_exit_status(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``envq spec --check`` exits 0 on fresh specs, quietly."""
        assert main(["spec", "--check"]) == 0
        assert capsys.readouterr().out == ""

    def test_check_and_write_a_stale_spec(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A stale spec file fails ``--check`` (naming it); ``--write`` restores it."""
        root = tmp_path / "checkout"
        (root / "specs").mkdir(parents=True)
        lifecycle = root / "specs" / "lifecycle.json"
        lifecycle.write_text("{}\n", encoding="utf-8")
        assert main(["spec", "--check", "--root", str(root)]) == 1
        out = capsys.readouterr().out.splitlines()
        assert "differs: specs/lifecycle.json" in out
        assert out[-1] == "run: python -m envq spec --write"
        assert main(["spec", "--write", "--root", str(root)]) == 0
        assert lifecycle.read_text(encoding="utf-8") == (SPECS / "lifecycle.json").read_text(
            encoding="utf-8"
        )
        assert main(["spec", "--check", "--root", str(root)]) == 0

    def test_not_a_checkout(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """Outside a source checkout (no specs/) the command says so and exits 2."""
        assert main(["spec", "--check", "--root", str(tmp_path)]) == 2
        assert "not a source checkout" in capsys.readouterr().err

    def test_check_as_a_command(self) -> None:
        """``python -m envq spec --check`` runs as a command from the checkout."""
        proc = subprocess.run(
            [sys.executable, "-m", "envq", "spec", "--check"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
            timeout=120,
        )
        assert (proc.returncode, proc.stdout) == (0, ""), proc.stderr


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
            text = generate()[SPECS / name]
            assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"

    def test_mermaid_has_every_transition(self) -> None:
        """Each Mermaid diagram draws one arrow per model transition (plus start/final)."""
        lifecycle = generate()[SPECS / "lifecycle.mmd"]
        envelope = generate()[SPECS / "envelope.mmd"]
        assert lifecycle.startswith("stateDiagram-v2")
        arrows = [line for line in lifecycle.splitlines() if " : " in line]
        assert len(arrows) == len(lifecycle_transitions())
        arrows = [line for line in envelope.splitlines() if " : " in line]
        assert len(arrows) == len(envelope_transitions())

    def test_docs_blocks_are_replaced(self) -> None:
        """A ``gen_specs`` block of the docs gets the current file, the rest is kept."""
        text = "intro\n<!-- gen_specs: lifecycle.mmd -->\nold\n<!-- /gen_specs -->\nend\n"
        files = generate()
        out = gen_specs.render_docs(text, files, SPECS)
        mermaid = files[SPECS / "lifecycle.mmd"]
        assert out == (
            f"intro\n<!-- gen_specs: lifecycle.mmd -->\n```mermaid\n{mermaid}```\n"
            "<!-- /gen_specs -->\nend\n"
        )
