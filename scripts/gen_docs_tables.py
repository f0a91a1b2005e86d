"""Fill the generated blocks of ``docs/tables.md`` from ``specs/``.

Usage::

    python scripts/gen_docs_tables.py          # rewrite docs/tables.md's generated blocks
    python scripts/gen_docs_tables.py --check  # exit 1 if the page differs from specs/

The page keeps its hand-written prose; each block between
``<!-- gen_docs_tables: NAME -->`` and ``<!-- /gen_docs_tables -->`` is replaced with
the Markdown rendering of ``specs/lifecycle.json``, ``specs/envelope.json`` or a
``specs/*.mmd`` diagram (see :data:`BLOCKS`). ``specs/`` itself is generated from the
runtime tables and the models by ``scripts/gen_specs.py``, so the chain is
``envq/_machine.py`` + ``models/`` → ``specs/`` → ``docs/tables.md``, and
``tests/test_specs.py`` and ``tests/test_docs_tables.py`` fail when a link is stale.

Only the short meaning of each action name (:data:`LIFE_ACTIONS`,
:data:`OUTCOME_ACTIONS`) is written here by hand; an action that appears in
``specs/`` without one (or a meaning for an action that no longer exists) is an error,
so the legend cannot drift either.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "BLOCKS",
    "LIFE_ACTIONS",
    "OUTCOME_ACTIONS",
    "PAGE",
    "ROOT",
    "SPECS",
    "Specs",
    "generate",
    "load_specs",
    "main",
    "render",
]

ROOT: Final = Path(__file__).resolve().parents[1]
SPECS: Final = ROOT / "specs"
PAGE: Final = ROOT / "docs" / "tables.md"
_BLOCK: Final = re.compile(
    r"(?P<open><!-- gen_docs_tables: (?P<name>[\w.-]+) -->\n)"
    r".*?(?P<close><!-- /gen_docs_tables -->)",
    re.S,
)

#: What each lifecycle action does (the legend of the lifecycle table).
LIFE_ACTIONS: Final[Mapping[str, str]] = {
    "NOTHING": "a no-op: nothing changes",
    "REJECT": "raises the error named in the cell; nothing changes",
    "BUFFER": "keeps the envelopes in the pre-start buffer (capacity reserved)",
    "ADMIT": "admits the envelopes: READY, or DELAYED until their first run",
    "ARM": "spawns the workers; buffered or parked envelopes become READY or DELAYED",
    "BEGIN_STOP": "enters STOPPING: parks what the stop mode parks, cancels if asked",
    "AWAIT_STOP": "waits for the stop under way",
    "FINISH_STOP": "the stop has nothing left to wait for: makes the final report",
    "STOP_THEN_TERMINATE": "`stop(mode=STOP, cancel=True)`, then hands back",
    "ESCALATE_THEN_TERMINATE": "turns the stop under way into a cancelling STOP, then hands back",
    "ESCALATE": "turns the stop under way into a cancelling STOP (ready envelopes parked)",
    "HAND_BACK": "hands back every envelope still held and ends the queue",
}

#: What each outcome-table action does (the legend of the outcome table).
OUTCOME_ACTIONS: Final[Mapping[str, str]] = {
    "SUCCEED": "runs `on_success`; the envelope ends",
    "RESCHEDULE": "runs `on_success`; the next run is `interval` later",
    "DECIDE": "`on_failure`'s decision, else the `Retry` policy, else drop",
    "DECIDE_PERIODIC": "`on_failure`'s decision if set, else the next run `interval` later",
    "REPORT_FAILURE": "calls `on_failure` to report; its decision is ignored",
    "END": "ends the envelope, no reschedule, no hooks",
    "BLACKLIST": "blacklists the envelope's `type` in the queue, stops every live one of it",
    "SHELVE": "a cancelled attempt: parked by `stop(cancel=True)`, handed back by `terminate()`",
}


class Specs:
    """The spec files a page is rendered from (JSON already parsed)."""

    def __init__(
        self, lifecycle: dict[str, Any], envelope: dict[str, Any], diagrams: Mapping[str, str]
    ) -> None:
        self.lifecycle: Final = lifecycle
        self.envelope: Final = envelope
        #: ``specs/*.mmd`` by file name.
        self.diagrams: Final = diagrams


def load_specs(specs: Path = SPECS) -> Specs:
    """Read ``lifecycle.json``, ``envelope.json`` and every ``*.mmd`` of ``specs``."""
    return Specs(
        json.loads((specs / "lifecycle.json").read_text(encoding="utf-8")),
        json.loads((specs / "envelope.json").read_text(encoding="utf-8")),
        {p.name: p.read_text(encoding="utf-8") for p in sorted(specs.glob("*.mmd"))},
    )


# ---------------------------------------------------------------------------------------
# Markdown helpers
# ---------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _code(name: str) -> str:
    return f"`{name}`"


def _states(names: Iterable[str]) -> str:
    return ", ".join(names)


def _legend(used: Iterable[str], meanings: Mapping[str, str], what: str) -> str:
    """The legend rows for the actions ``used`` (in order of first use)."""
    order = list(dict.fromkeys(used))
    missing = [a for a in order if a not in meanings]
    unused = [a for a in meanings if a not in order]
    if missing or unused:
        raise ValueError(
            f"{what} legend out of step with specs/: undescribed {missing}, stale {unused} "
            "(edit scripts/gen_docs_tables.py)"
        )
    return _table(["action", "what it does"], [(_code(a), meanings[a]) for a in order])


# ---------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------


def lifecycle_table(specs: Specs) -> str:
    """State × call, each cell the row's action and target (or its error)."""
    life = specs.lifecycle
    calls: list[str] = life["calls"]
    rows = {(r["state"], r["call"]): r for r in life["rows"]}
    header = ["state \\ call"] + [f"{call} (`{life['model_events'][call]}`)" for call in calls]
    body = []
    for state in life["states"]:
        cells = [f"**{state}**" + (" (initial)" if state == life["initial"] else "")]
        for call in calls:
            row = rows[(state, call)]
            if "action" not in row:
                cells.append("cannot happen" if row["illegal"] else "missing")
            elif row["action"] == "REJECT":
                cells.append(f"`REJECT`: raises `{row['error']}`")
            else:
                cells.append(f"`{row['action']}` → {row['target']}")
        body.append(cells)
    return _table(header, body)


def lifecycle_actions(specs: Specs) -> str:
    """The legend of the lifecycle actions."""
    used = (r["action"] for r in specs.lifecycle["rows"] if "action" in r)
    return _legend(used, LIFE_ACTIONS, "lifecycle")


def lifecycle_rejected(specs: Specs) -> str:
    """The calls the contract answers with an error (not transitions of the model)."""
    return _table(
        ["state", "call", "raises"],
        [
            (r["state"], r["call"], _code(r["error"]))
            for r in specs.lifecycle["rejected_by_contract"]
        ],
    )


def envelope_states(specs: Specs) -> str:
    """Every envelope state and its class (pseudo, live, terminal)."""
    states: dict[str, list[str]] = specs.envelope["states"]
    meaning = {
        "pseudo": "not in the queue (yet); every stay starts here",
        "live": "in the queue; counts against capacity",
        "terminal": "the stay is over; the envelope may be sent again",
    }
    return _table(
        ["class", "states", "meaning"],
        [
            (group, _states(states[group]), meaning[group])
            for group in ("pseudo", "live", "terminal")
        ],
    )


def outcome_table(specs: Specs) -> str:
    """Outcome × kind, each cell the row's action, default target and redirects."""
    env = specs.envelope
    kinds: list[str] = env["kinds"]
    rows = {(r["kind"], r["outcome"]): r for r in env["outcomes"]}
    body = []
    for outcome in env["events"]["outcomes"]:
        cells = [f"**{outcome}**"]
        for kind in kinds:
            row = rows.get((kind, outcome))
            if row is None:
                cells.append("—")
                continue
            cell = f"`{row['action']}` → {row['target']}"
            if row["redirects"]:
                cell += f" (or {_states(row['redirects'])})"
            cells.append(cell)
        body.append(cells)
    return _table(["outcome \\ kind", *kinds], body)


def outcome_actions(specs: Specs) -> str:
    """The legend of the outcome-table actions."""
    return _legend((r["action"] for r in specs.envelope["outcomes"]), OUTCOME_ACTIONS, "outcome")


def choice_maps(specs: Specs) -> str:
    """The small tables that choose among a row's targets."""
    env = specs.envelope
    parts = [
        ("A failure decision (`on_failure`, `Retry`)", "decision", env["decision_target"]),
        ("A cancelled attempt, by who cancelled it", "cancelled by", env["shelve_target"]),
        ("Put back while the queue is not RUNNING", "would go to", env["park_instead"]),
    ]
    out = []
    for title, column, mapping in parts:
        out.append(f"**{title}**\n\n")
        out.append(_table([column, "next state"], sorted(mapping.items())))
        out.append("\n")
    return "".join(out).rstrip("\n") + "\n"


def envelope_moves(specs: Specs) -> str:
    """The relation (state, event) → possible next states."""
    return _table(
        ["state", "event", "may lead to"],
        [(m["state"], _code(m["event"]), _states(m["targets"])) for m in specs.envelope["moves"]],
    )


def model_transitions(specs: Specs) -> str:
    """Every guarded transition of the envelope model."""
    return _table(
        ["from", "event", "model event", "guards", "to"],
        [
            (
                t["source"],
                _code(t["event"]),
                _code(t["model_event"]),
                ", ".join(_code(g) for g in t["guards"]) or "—",
                t["target"],
            )
            for t in specs.envelope["model_transitions"]
        ],
    )


def _mermaid(name: str) -> Callable[[Specs], str]:
    def block(specs: Specs) -> str:
        return f"```mermaid\n{specs.diagrams[name]}```\n"

    block.__doc__ = f"``specs/{name}`` as a Mermaid diagram."
    return block


#: Block name → renderer.
BLOCKS: Final[Mapping[str, Callable[[Specs], str]]] = {
    "lifecycle-diagram": _mermaid("lifecycle.mmd"),
    "lifecycle-table": lifecycle_table,
    "lifecycle-actions": lifecycle_actions,
    "lifecycle-rejected": lifecycle_rejected,
    "envelope-diagram": _mermaid("envelope.mmd"),
    "envelope-states": envelope_states,
    "outcome-table": outcome_table,
    "outcome-actions": outcome_actions,
    "choice-maps": choice_maps,
    "envelope-moves": envelope_moves,
    "model-transitions": model_transitions,
}


# ---------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------


def render(text: str, specs: Specs) -> str:
    """``text`` with every ``gen_docs_tables`` block refilled from ``specs``.

    :raises ValueError: a block names no known renderer, or a known block is missing
        or appears twice.
    """
    seen: list[str] = []

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise ValueError(f"unknown gen_docs_tables block {name!r}")
        seen.append(name)
        return f"{match['open']}{BLOCKS[name](specs)}{match['close']}"

    out = _BLOCK.sub(block, text)
    missing = [name for name in BLOCKS if name not in seen]
    twice = sorted({name for name in seen if seen.count(name) > 1})
    if missing or twice:
        raise ValueError(f"gen_docs_tables blocks: missing {missing}, repeated {twice}")
    return out


def generate(page: Path = PAGE, specs: Path = SPECS) -> str:
    """The page as it should be: its current text with fresh blocks."""
    return render(page.read_text(encoding="utf-8"), load_specs(specs))


def main(argv: Sequence[str] | None = None) -> int:
    """Rewrite (or with ``--check``, verify) the page; return the exit status."""
    parser = argparse.ArgumentParser(description="Fill docs/tables.md from specs/.")
    parser.add_argument("--check", action="store_true", help="fail if the page differs")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page (default: %(default)s)")
    parser.add_argument("--specs", type=Path, default=SPECS, help="the specs directory")
    args = parser.parse_args(argv)
    page: Path = args.page
    fresh = generate(page, args.specs)
    current = page.read_text(encoding="utf-8")
    if args.check:
        if fresh != current:
            print(f"differs: {page}")
            print("run: python scripts/gen_docs_tables.py")
            return 1
        return 0
    if fresh != current:
        page.write_text(fresh, encoding="utf-8")
        print(f"wrote {page}")
    else:
        print(f"{page} up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
