"""The documentation site stays in step with the code.

- the generated blocks of ``docs/tables.md``, ``docs/lifecycle.md`` and
  ``docs/outcomes.md`` equal a fresh rendering of ``specs/`` by
  :mod:`envq.model.doctables` (``python -m envq spec --write`` refreshes them), as
  ``tests/model/test_specs.py`` does for ``specs/`` itself;
- ``docs/api.md`` has a block for every public name of ``envq``;
- ``mkdocs.yml``'s nav lists every page of ``docs/`` and only pages that exist.
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest

import envq
from envq.__main__ import main
from envq.model import doctables as gen

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SPECS = ROOT / "specs"
PAGE = DOCS / "tables.md"


def load_specs() -> gen.Specs:
    """The committed ``specs/``."""
    return gen.load_specs(SPECS)


def fresh_pages() -> dict[Path, str]:
    """Every page with generated blocks, as the committed ``specs/`` render it."""
    return gen.generate(DOCS, load_specs())


class TestNoDrift:
    """What is committed is what the generator makes from specs/ now."""

    def test_pages_are_fresh(self) -> None:
        """Each page equals a fresh rendering (else: run python -m envq spec --write)."""
        pages = fresh_pages()
        assert sorted(p.name for p in pages) == sorted(gen.PAGES)
        for path, text in pages.items():
            assert path.read_text(encoding="utf-8") == text, (
                f"{path.name} is stale: run python -m envq spec --write"
            )

    def test_check_passes_quietly(self, capsys: pytest.CaptureFixture[str]) -> None:
        """``envq spec --check`` exits 0 and prints nothing on fresh pages."""
        assert main(["spec", "--check", "--root", str(ROOT)]) == 0
        assert capsys.readouterr().out == ""

    @pytest.mark.parametrize(
        ("name", "old", "new"),
        [
            ("tables.md", "`ARM` → RUNNING", "`ARM` → STOPPED"),
            ("lifecycle.md", "| RUNNING | no-op | admitted |", "| RUNNING | no-op | buffered |"),
            (
                "outcomes.md",
                "| `OK` | `on_success` | SUCCEEDED |",
                "| `OK` | `on_success` | FAILED |",
            ),
        ],
    )
    def test_check_fails_on_a_stale_page(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, old: str, new: str
    ) -> None:
        """``envq spec --check`` exits 1 when a block differs; ``--write`` then fixes it."""
        shutil.copytree(SPECS, tmp_path / "specs")
        shutil.copytree(DOCS, tmp_path / "docs")
        page = tmp_path / "docs" / name
        text = page.read_text(encoding="utf-8")
        assert old in text
        page.write_text(text.replace(old, new, 1), encoding="utf-8")
        assert main(["spec", "--check", "--root", str(tmp_path)]) == 1
        assert capsys.readouterr().out.splitlines()[0] == f"differs: docs/{name}"
        assert main(["spec", "--write", "--root", str(tmp_path)]) == 0
        assert page.read_text(encoding="utf-8") == text
        assert main(["spec", "--check", "--root", str(tmp_path)]) == 0

    def test_generation_is_deterministic(self) -> None:
        """Two renderings are equal."""
        assert fresh_pages() == fresh_pages()


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
        specs = load_specs()
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
            gen.render(self._page([*gen.BLOCKS, "no-such-block"]), load_specs())

    def test_missing_block_is_an_error(self) -> None:
        """A page without one of the blocks raises (the page must show every table)."""
        names = [n for n in gen.BLOCKS if n != "outcome-table"]
        with pytest.raises(ValueError, match="missing \\['outcome-table'\\]"):
            gen.render(self._page(names), load_specs())

    def test_repeated_block_is_an_error(self) -> None:
        """A block that appears twice raises."""
        with pytest.raises(ValueError, match="repeated"):
            gen.render(self._page([*gen.BLOCKS, "choice-maps"]), load_specs())


class TestContent:
    """The rendered tables say what specs/ says."""

    def test_diagrams_are_the_spec_files(self) -> None:
        """Both Mermaid blocks are the committed ``specs/*.mmd``, verbatim."""
        page = PAGE.read_text(encoding="utf-8")
        for name in ("lifecycle.mmd", "envelope.mmd"):
            mermaid = (ROOT / "specs" / name).read_text(encoding="utf-8")
            assert f"```mermaid\n{mermaid}```\n" in page

    def test_lifecycle_table_has_every_pair(self) -> None:
        """One row per state, one column per call, and every row's action and target."""
        specs = load_specs()
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
        specs = load_specs()
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
        specs = load_specs()
        moves = gen.envelope_moves(specs).splitlines()[2:]
        assert len(moves) == len(specs.envelope["moves"])
        transitions = gen.model_transitions(specs).splitlines()[2:]
        assert len(transitions) == len(specs.envelope["model_transitions"])

    def test_an_undescribed_action_is_an_error(self) -> None:
        """A new action in specs/ without a meaning in the legend fails the generator."""
        specs = load_specs()
        envelope = copy.deepcopy(specs.envelope)
        envelope["outcomes"][0]["action"] = "NEW_ACTION"
        changed = gen.Specs(specs.lifecycle, envelope, specs.diagrams)
        with pytest.raises(ValueError, match="NEW_ACTION"):
            gen.outcome_actions(changed)

    def test_a_stale_legend_entry_is_an_error(self) -> None:
        """A meaning for an action specs/ no longer has fails the generator too."""
        specs = load_specs()
        lifecycle = copy.deepcopy(specs.lifecycle)
        lifecycle["rows"] = [r for r in lifecycle["rows"] if r.get("action") != "AWAIT_STOP"]
        changed = gen.Specs(lifecycle, specs.envelope, specs.diagrams)
        with pytest.raises(ValueError, match="AWAIT_STOP"):
            gen.lifecycle_actions(changed)


class TestGuideTables:
    """The guide's tables in docs/lifecycle.md and docs/outcomes.md say what specs/ says."""

    @staticmethod
    def _cells(table: str) -> list[list[str]]:
        return [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]

    def test_lifecycle_cells_follow_the_rows(self) -> None:
        """One line per state, one cell per public call: a rejected call names its
        error, a call that moves the queue names the state it leads to."""
        specs = load_specs()
        life = specs.lifecycle
        rows = {(r["state"], r["call"]): r for r in life["rows"]}
        lines = self._cells(gen.guide_lifecycle_table(specs))
        assert [cells[0] for cells in lines] == life["states"]
        calls = list(gen.GUIDE_CALLS)
        for state, *cells in lines:
            assert len(cells) == len(calls)
            for call, cell in zip(calls, cells, strict=True):
                row = rows[(state, call)]
                if row["action"] == "REJECT":
                    assert cell == f"raises `{row['error']}`"
                elif row["action"] == "ESCALATE_THEN_TERMINATE":
                    assert cell.endswith("as from STOPPED"), cell
                elif row["target"] != state:
                    assert f"→ {row['target']}" in cell, (state, call, cell)
                else:
                    assert "→" not in cell, (state, call, cell)
        page = (DOCS / "lifecycle.md").read_text(encoding="utf-8")
        assert gen.guide_lifecycle_table(specs) in page

    def test_outcome_lines_cover_every_row_once(self) -> None:
        """Every (kind, outcome) row is on exactly one line, with its action's wording,
        its target first and its redirects."""
        specs = load_specs()
        env = specs.envelope
        lines = self._cells(gen.guide_outcome_table(specs))
        names = {v: k for k, v in gen.GUIDE_KINDS.items()}
        seen: list[tuple[str, str]] = []
        for kind_name, outs, action, states in lines:
            kinds = ["ONE_OFF", "PERIODIC"] if kind_name == "one-off or periodic" else None
            kinds = kinds or [names[kind_name]]
            listed = env["events"]["outcomes"] if outs == "any" else outs.strip("`").split("`, `")
            for kind in kinds:
                for outcome in listed:
                    row = next(
                        r for r in env["outcomes"] if (r["kind"], r["outcome"]) == (kind, outcome)
                    )
                    seen.append((kind, outcome))
                    assert action == gen.GUIDE_OUTCOMES[row["action"]]
                    assert states.startswith(row["target"]), (row, states)
                    assert all(state in states for state in row["redirects"]), (row, states)
        assert sorted(seen) == sorted((r["kind"], r["outcome"]) for r in env["outcomes"])
        page = (DOCS / "outcomes.md").read_text(encoding="utf-8")
        assert gen.guide_outcome_table(specs) in page

    def test_an_undescribed_action_is_an_error(self) -> None:
        """An action with no wording in the guide (or a stale wording) fails the render."""
        specs = load_specs()
        envelope = copy.deepcopy(specs.envelope)
        envelope["outcomes"][0]["action"] = "NEW_ACTION"
        with pytest.raises(ValueError, match="NEW_ACTION"):
            gen.guide_outcome_table(gen.Specs(specs.lifecycle, envelope, specs.diagrams))
        lifecycle = copy.deepcopy(specs.lifecycle)
        lifecycle["rows"] = [r for r in lifecycle["rows"] if r.get("action") != "AWAIT_STOP"]
        with pytest.raises(ValueError, match="AWAIT_STOP"):
            gen.guide_lifecycle_table(gen.Specs(lifecycle, specs.envelope, specs.diagrams))

    def test_an_unnamed_kind_is_an_error(self) -> None:
        specs = load_specs()
        envelope = copy.deepcopy(specs.envelope)
        envelope["kinds"].append("SOMETIMES")
        with pytest.raises(ValueError, match="SOMETIMES"):
            gen.guide_outcome_table(gen.Specs(specs.lifecycle, envelope, specs.diagrams))


class TestApiPage:
    """docs/api.md documents the whole public API."""

    BLOCK = re.compile(r"^::: (\S+)$", re.M)

    def test_every_public_name_has_a_block(self) -> None:
        """Each name of ``envq.__all__`` has a ``::: envq.NAME`` block."""
        documented = set(self.BLOCK.findall((DOCS / "api.md").read_text(encoding="utf-8")))
        missing = [name for name in envq.__all__ if f"envq.{name}" not in documented]
        assert missing == [], f"add to docs/api.md: {missing}"

    def test_every_public_name_of_the_postgres_queue_has_a_block(self) -> None:
        """Each name of ``envq.postgres.__all__`` has a ``::: envq.postgres.NAME`` block."""
        import envq.postgres  # noqa: PLC0415

        documented = set(self.BLOCK.findall((DOCS / "api.md").read_text(encoding="utf-8")))
        missing = [n for n in envq.postgres.__all__ if f"envq.postgres.{n}" not in documented]
        assert missing == [], f"add to docs/api.md: {missing}"

    def test_every_block_names_something_public(self) -> None:
        """Each ``::: envq.NAME`` block names a public name (or a public module), and
        each ``::: envq.postgres.NAME`` one of ``envq.postgres``."""
        import envq.postgres  # noqa: PLC0415

        for target in self.BLOCK.findall((DOCS / "api.md").read_text(encoding="utf-8")):
            module, _, name = target.partition(".")
            assert module == "envq", target
            if name.startswith("postgres."):
                assert name.removeprefix("postgres.") in envq.postgres.__all__, target
                continue
            assert name in envq.__all__ or name in {"testing", "pytest_plugin"}, target


class TestSiteNav:
    """mkdocs.yml's nav and docs/ agree (mkdocs --strict checks it too, in CI)."""

    def test_nav_lists_every_page(self) -> None:
        """Every docs/*.md is in the nav, and every nav entry exists."""
        config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
        nav = set(re.findall(r"^\s+- (?:[^:\n]+: )?([\w./-]+\.md)\s*$", config, re.M))
        pages = {p.name for p in DOCS.glob("*.md")}
        assert nav == pages
