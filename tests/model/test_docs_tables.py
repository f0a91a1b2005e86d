"""The documentation site stays in step with the code.

- ``docs/tables.md``'s generated blocks equal a fresh rendering of ``specs/`` by
  ``scripts/gen_docs_tables.py`` (run it to refresh the page), as ``tests/model/test_specs.py``
  does for ``specs/`` itself;
- ``docs/api.md`` has a block for every public name of ``envq``;
- ``mkdocs.yml``'s nav lists every page of ``docs/`` and only pages that exist.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

import envq

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load_gen_docs_tables() -> ModuleType:
    path = ROOT / "scripts" / "gen_docs_tables.py"
    spec = importlib.util.spec_from_file_location("gen_docs_tables", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs_tables"] = module
    spec.loader.exec_module(module)
    return module


gen = _load_gen_docs_tables()


class TestNoDrift:
    """What is committed is what the generator makes from specs/ now."""

    def test_page_is_fresh(self) -> None:
        """docs/tables.md equals a fresh rendering (else: run scripts/gen_docs_tables.py)."""
        assert gen.PAGE.read_text(encoding="utf-8") == gen.generate(), (
            "docs/tables.md is stale: run python scripts/gen_docs_tables.py"
        )

    def test_check_passes_quietly(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``--check`` exits 0 and prints nothing on a fresh page."""
        assert gen.main(["--check"]) == 0
        assert capsys.readouterr().out == ""

    def test_check_fails_on_a_stale_page(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``--check`` exits 1 when a block differs; a rewrite then fixes the page."""
        page = tmp_path / "tables.md"
        text = gen.PAGE.read_text(encoding="utf-8")
        page.write_text(text.replace("`ARM` → RUNNING", "`ARM` → STOPPED", 1), encoding="utf-8")
        assert gen.main(["--check", "--page", str(page)]) == 1
        assert "differs" in capsys.readouterr().out
        assert gen.main(["--page", str(page)]) == 0
        assert page.read_text(encoding="utf-8") == text

    def test_generation_is_deterministic(self) -> None:
        """Two renderings are equal."""
        assert gen.generate() == gen.generate()


class TestRender:
    """``render`` replaces the blocks and nothing else."""

    @staticmethod
    def _page(names: list[str]) -> str:
        parts = ["# title\n"]
        for name in names:
            parts.append(
                f"prose\n<!-- gen_docs_tables: {name} -->\nold\n<!-- /gen_docs_tables -->\n"
            )
        return "".join(parts)

    def test_blocks_are_refilled_and_prose_kept(self) -> None:
        """Each block gets its renderer's output; the text around it is unchanged."""
        specs = gen.load_specs()
        out = gen.render(self._page(list(gen.BLOCKS)), specs)
        assert "old\n" not in out
        assert out.startswith("# title\nprose\n")
        body = gen.BLOCKS["lifecycle-diagram"](specs)
        assert (
            f"<!-- gen_docs_tables: lifecycle-diagram -->\n{body}<!-- /gen_docs_tables -->" in out
        )

    def test_unknown_block_is_an_error(self) -> None:
        """A block naming no renderer raises."""
        with pytest.raises(ValueError, match="unknown"):
            gen.render(self._page([*gen.BLOCKS, "no-such-block"]), gen.load_specs())

    def test_missing_block_is_an_error(self) -> None:
        """A page without one of the blocks raises (the page must show every table)."""
        names = [n for n in gen.BLOCKS if n != "outcome-table"]
        with pytest.raises(ValueError, match="missing \\['outcome-table'\\]"):
            gen.render(self._page(names), gen.load_specs())

    def test_repeated_block_is_an_error(self) -> None:
        """A block that appears twice raises."""
        with pytest.raises(ValueError, match="repeated"):
            gen.render(self._page([*gen.BLOCKS, "choice-maps"]), gen.load_specs())


class TestContent:
    """The rendered tables say what specs/ says."""

    def test_diagrams_are_the_spec_files(self) -> None:
        """Both Mermaid blocks are the committed ``specs/*.mmd``, verbatim."""
        page = gen.PAGE.read_text(encoding="utf-8")
        for name in ("lifecycle.mmd", "envelope.mmd"):
            mermaid = (ROOT / "specs" / name).read_text(encoding="utf-8")
            assert f"```mermaid\n{mermaid}```\n" in page

    def test_lifecycle_table_has_every_pair(self) -> None:
        """One row per state, one column per call, and every row's action and target."""
        specs = gen.load_specs()
        table = gen.lifecycle_table(specs).splitlines()
        assert len(table) == 2 + len(specs.lifecycle["states"])
        header, _rule, *rows = table
        assert all(line.count(" | ") == len(specs.lifecycle["calls"]) for line in [header, *rows])
        text = "\n".join(table)
        for row in specs.lifecycle["rows"]:
            if "action" not in row:
                continue
            expected = (
                f"raises `{row['error']}`"
                if row["action"] == "REJECT"
                else f"`{row['action']}` → {row['target']}"
            )
            assert expected in text, row

    def test_outcome_table_has_every_row(self) -> None:
        """Each (kind, outcome) row appears with its action, target and redirects."""
        specs = gen.load_specs()
        lines = gen.outcome_table(specs).splitlines()
        kinds = specs.envelope["kinds"]
        for row in specs.envelope["outcomes"]:
            line = next(x for x in lines if x.startswith(f"| **{row['outcome']}** |"))
            cell = line.strip("| ").split(" | ")[1 + kinds.index(row["kind"])]
            assert cell.startswith(f"`{row['action']}` → {row['target']}"), (row, cell)
            for state in row["redirects"]:
                assert state in cell, (row, cell)

    def test_every_move_and_transition_is_listed(self) -> None:
        """The moves table and the transitions table have one line per spec entry."""
        specs = gen.load_specs()
        moves = gen.envelope_moves(specs).splitlines()[2:]
        assert len(moves) == len(specs.envelope["moves"])
        transitions = gen.model_transitions(specs).splitlines()[2:]
        assert len(transitions) == len(specs.envelope["model_transitions"])

    def test_an_undescribed_action_is_an_error(self) -> None:
        """A new action in specs/ without a meaning in the legend fails the generator."""
        specs = gen.load_specs()
        envelope = copy.deepcopy(specs.envelope)
        envelope["outcomes"][0]["action"] = "NEW_ACTION"
        changed = gen.Specs(specs.lifecycle, envelope, specs.diagrams)
        with pytest.raises(ValueError, match="NEW_ACTION"):
            gen.outcome_actions(changed)

    def test_a_stale_legend_entry_is_an_error(self) -> None:
        """A meaning for an action specs/ no longer has fails the generator too."""
        specs = gen.load_specs()
        lifecycle = copy.deepcopy(specs.lifecycle)
        lifecycle["rows"] = [r for r in lifecycle["rows"] if r.get("action") != "AWAIT_STOP"]
        changed = gen.Specs(lifecycle, specs.envelope, specs.diagrams)
        with pytest.raises(ValueError, match="AWAIT_STOP"):
            gen.lifecycle_actions(changed)


class TestApiPage:
    """docs/api.md documents the whole public API."""

    BLOCK = re.compile(r"^::: (\S+)$", re.M)

    def test_every_public_name_has_a_block(self) -> None:
        """Each name of ``envq.__all__`` has a ``::: envq.NAME`` block."""
        documented = set(self.BLOCK.findall((DOCS / "api.md").read_text(encoding="utf-8")))
        missing = [name for name in envq.__all__ if f"envq.{name}" not in documented]
        assert missing == [], f"add to docs/api.md: {missing}"

    def test_every_block_names_something_public(self) -> None:
        """Each ``::: envq.NAME`` block names a public name (or a public module)."""
        for target in self.BLOCK.findall((DOCS / "api.md").read_text(encoding="utf-8")):
            module, _, name = target.partition(".")
            assert module == "envq", target
            assert name in envq.__all__ or name in {"testing", "pytest_plugin"}, target


class TestSiteNav:
    """mkdocs.yml's nav and docs/ agree (mkdocs --strict checks it too, in CI)."""

    def test_nav_lists_every_page(self) -> None:
        """Every docs/*.md is in the nav, and every nav entry exists."""
        config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
        nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w./-]+\.md)\s*$", config, re.M))
        pages = {p.name for p in DOCS.glob("*.md")}
        assert nav == pages
