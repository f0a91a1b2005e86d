"""``scripts/mutate_code.py``'s list of engine mutants is valid against the current
source: ids unique, every snippet found exactly once in its file (a refactor of the
engine that makes a mutant stale fails here, naming it), every mutant parses and
changes code, the ``--quick`` sample names real mutants, the three of its issue among
them. No mutant is run here (that is ``python scripts/mutate_code.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import mutate_code

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = mutate_code.MUTANTS


def test_the_list_matches_the_source() -> None:
    """Every snippet occurs exactly once in its file and the ids are unique."""
    assert mutate_code.problems(MUTANTS) == []


def test_ids_are_unique() -> None:
    idents = [mu.ident for mu in MUTANTS]
    assert len(idents) == len(set(idents))


def test_enough_mutants_of_every_engine_file() -> None:
    """At least 40 mutants, spread over every file of the engine."""
    assert len(MUTANTS) >= 40
    files = {mu.file for mu in MUTANTS}
    engine = {
        f"envq/{name}.py"
        for name in (
            "_queue",
            "_machine",
            "_admission",
            "_outcomes",
            "_rules",
            "_crew",
            "_lifecycle",
            "_moves",
            "_attempt",
            "_timers",
            "_stats",
            "_envelope",
            "_limits",
            "_task",
            "_tasks",
            "_background",
            "_schedule",
            "_values",
        )
    }
    assert files == engine
    assert all(mu.description for mu in MUTANTS)


def test_quick_sample_holds_the_issue_mutants() -> None:
    """The CI sample is about eight mutants and includes the three the suite once missed."""
    quick = set(mutate_code.QUICK)
    assert quick <= {mu.ident for mu in MUTANTS}
    assert 6 <= len(quick) <= 10
    assert {
        "queue-internal-error-ignored",
        "queue-drained-ignores-hooks",
        "tasks-shutdown-drops-held",
    } <= quick


def test_a_stale_mutant_is_named(tmp_path: Path) -> None:
    """When the engine changed under a mutant, the problem names the mutant and file."""
    mu = MUTANTS[0]
    (tmp_path / "envq").mkdir()
    source = (ROOT / mu.file).read_text(encoding="utf-8")
    (tmp_path / mu.file).write_text(source.replace(mu.original, ""), encoding="utf-8")
    [problem] = mutate_code.problems([mu], tmp_path, quick=())
    assert problem.startswith(f"{mu.ident}: ")
    assert mu.file in problem
    with pytest.raises(ValueError, match=mu.ident):
        mutate_code.mutated(mu, source + source)


def test_a_mutant_applies_to_a_copy_and_is_put_back(tmp_path: Path) -> None:
    """Applying a mutant rewrites the copy's file (with a new mtime, so no stale
    bytecode is used) and puts the original back afterwards."""
    mu = next(m for m in MUTANTS if m.ident == "queue-internal-error-ignored")
    path = tmp_path / "source.py"
    original = (ROOT / mu.file).read_text(encoding="utf-8")
    path.write_text(original, encoding="utf-8")
    before = path.stat().st_mtime
    with mutate_code.swapped(path, mutate_code.mutated(mu, original)):
        text = path.read_text(encoding="utf-8")
        assert mu.original not in text
        assert mu.replacement in text
        during = path.stat().st_mtime
        assert int(during) != int(before)
    assert path.read_text(encoding="utf-8") == original
    assert int(path.stat().st_mtime) not in (int(before), int(during))
