"""The generated tables of the documentation, rendered from ``specs/``.

Three pages keep hand-written prose around generated blocks: each block between
``<!-- gen_docs_tables: NAME -->`` and ``<!-- /gen_docs_tables -->`` is replaced with
the Markdown rendering of ``specs/lifecycle.json``, ``specs/envelope.json`` or a
``specs/*.mmd`` diagram (see :data:`BLOCKS`; :data:`PAGES` says which page has which
blocks):

* ``docs/tables.md`` — every table and diagram, as the engine runs them;
* ``docs/lifecycle.md`` — the guide's table of what each call does in each state;
* ``docs/outcomes.md`` — the guide's outcome table.

``specs/`` itself is generated from the runtime tables and the models
(:mod:`envq.model.specgen`), so the chain is ``envq/_machine.py`` + ``envq/model/`` →
``specs/`` → ``docs/``; ``python -m envq spec --write`` regenerates all of it and
``--check`` fails when a link is stale.

Only the short meaning of each action name (:data:`LIFE_ACTIONS`,
:data:`OUTCOME_ACTIONS`, and the guide's wording :data:`GUIDE_LIFE`,
:data:`GUIDE_OUTCOMES`) is written here by hand; an action that appears in ``specs/``
without one (or a meaning for an action that no longer exists) is an error, so the
legends cannot drift either. This module needs no python-statemachine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "BLOCKS",
    "GUIDE_LIFE",
    "GUIDE_OUTCOMES",
    "LIFE_ACTIONS",
    "OUTCOME_ACTIONS",
    "PAGES",
    "Specs",
    "generate",
    "guide_lifecycle_table",
    "guide_outcome_table",
    "load_specs",
    "render",
]

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

    @classmethod
    def parse(cls, files: Mapping[str, str]) -> Specs:
        """From the text of the spec files, by name (``lifecycle.json``,
        ``envelope.json``, ``*.mmd``)."""
        return cls(
            json.loads(files["lifecycle.json"]),
            json.loads(files["envelope.json"]),
            {name: text for name, text in sorted(files.items()) if name.endswith(".mmd")},
        )


def load_specs(specs: Path) -> Specs:
    """Read ``lifecycle.json``, ``envelope.json`` and every ``*.mmd`` of ``specs``."""
    names = ["lifecycle.json", "envelope.json", *(p.name for p in specs.glob("*.mmd"))]
    return Specs.parse({name: (specs / name).read_text(encoding="utf-8") for name in names})


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
            "(edit envq/model/doctables.py)"
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


#: The guide's wording of each lifecycle action in a public call's cell
#: (``docs/lifecycle.md``): ``{target}`` is the row's next state, ``{error}`` its error,
#: ``{drained}`` where a stop ends.
GUIDE_LIFE: Final[Mapping[str, str]] = {
    "NOTHING": "no-op",
    "REJECT": "raises `{error}`",
    "BUFFER": "buffered (capacity reserved)",
    "ADMIT": "admitted",
    "ARM": "→ {target}; buffered or parked envelopes become ready (or delayed)",
    "BEGIN_STOP": "→ {target} → {drained}",
    "AWAIT_STOP": "waits for the stop under way",
    "STOP_THEN_TERMINATE": "as `stop(mode=STOP, cancel=True)`, then → {target}",
    "ESCALATE_THEN_TERMINATE": (
        "cancels what is in flight, waits for the stop to end, then as from {drained}"
    ),
    "HAND_BACK": "→ {target}; returns the envelopes it holds",
}

#: The public calls of the guide's lifecycle table and their column headings.
GUIDE_CALLS: Final[Mapping[str, str]] = {
    "START": "`start()`",
    "SEND": "`send(...)`",
    "STOP": "`await stop()`",
    "TERMINATE": "`await terminate()`",
}

#: The guide's wording of each outcome-table action (``docs/outcomes.md``).
GUIDE_OUTCOMES: Final[Mapping[str, str]] = {
    "SUCCEED": "`on_success`",
    "RESCHEDULE": "`on_success`; next run after `interval`",
    "DECIDE": "**decide** (below)",
    "DECIDE_PERIODIC": "`on_failure` decides if set; else next run after `interval`",
    "REPORT_FAILURE": "`on_failure` is called to report (its decision is ignored)",
    "END": "no reschedule, ever",
    "BLACKLIST": "the envelope's `type` is [blacklisted](#blacklisting); no reschedule, ever",
    "SHELVE": "parked by `stop(cancel=True)`, handed back by `terminate()`",
}

#: How the guide names each kind of the outcome table.
GUIDE_KINDS: Final[Mapping[str, str]] = {
    "ONE_OFF": "one-off",
    "PERIODIC": "periodic",
    "BLACKLISTED": "type blacklisted during the attempt",
    "CANCELLED": "cancelled by an operator during the attempt",
}


def _wording(used: Iterable[str], wording: Mapping[str, str], what: str) -> None:
    """Every action ``used`` has a wording, and every wording is used."""
    order = list(dict.fromkeys(used))
    missing = [a for a in order if a not in wording]
    unused = [a for a in wording if a not in order]
    if missing or unused:
        raise ValueError(
            f"{what} wording out of step with specs/: undescribed {missing}, stale {unused} "
            "(edit envq/model/doctables.py)"
        )


def guide_lifecycle_table(specs: Specs) -> str:
    """State × public call, each cell what the call does in the guide's words."""
    life = specs.lifecycle
    rows = {(r["state"], r["call"]): r for r in life["rows"]}
    calls = [c for c in life["calls"] if c in GUIDE_CALLS]
    if len(calls) != len(GUIDE_CALLS):
        raise ValueError(f"guide calls {sorted(GUIDE_CALLS)} not all in specs/ {calls}")
    used = (rows.get((s, c), {}).get("action") for s in life["states"] for c in calls)
    _wording(
        (action for action in used if action is not None),
        GUIDE_LIFE,
        "guide lifecycle",
    )
    drained = [r["target"] for r in life["rows"] if r["call"] == "DRAINED" and "action" in r]
    body = []
    for state in life["states"]:
        cells = [state]
        for call in calls:
            row = rows.get((state, call), {})
            if "action" not in row:
                cells.append("cannot happen")
                continue
            cells.append(
                GUIDE_LIFE[row["action"]].format(
                    target=row["target"], error=row["error"], drained=", ".join(drained)
                )
            )
        body.append(cells)
    return _table(["state \\ call", *(GUIDE_CALLS[c] for c in calls)], body)


def guide_outcome_table(specs: Specs) -> str:
    """Kind, outcomes, what happens and the next states, outcomes with the same row
    merged into one line (and one-off and periodic rows that agree into ``any``)."""
    env = specs.envelope
    kinds: list[str] = env["kinds"]
    outcomes: list[str] = env["events"]["outcomes"]
    _wording((r["action"] for r in env["outcomes"]), GUIDE_OUTCOMES, "guide outcome")
    unnamed = [k for k in kinds if k not in GUIDE_KINDS]
    if unnamed:
        raise ValueError(f"no guide name for kind(s) {unnamed} (edit envq/model/doctables.py)")
    rows = {(r["kind"], r["outcome"]): r for r in env["outcomes"]}

    def same(row: Mapping[str, Any]) -> tuple[str, str, tuple[str, ...]]:
        return row["action"], row["target"], tuple(row["redirects"])

    pair = ("ONE_OFF", "PERIODIC")
    groups: dict[tuple[str, tuple[str, str, tuple[str, ...]]], list[str]] = {}
    for kind in kinds:
        for outcome in outcomes:
            row = rows.get((kind, outcome))
            if row is None:
                continue
            label = kind
            if kind in pair:
                other = rows.get((pair[1] if kind == pair[0] else pair[0], outcome))
                if other is not None and same(other) == same(row):
                    if kind == pair[1]:
                        continue  # merged into the ONE_OFF row's "any" line
                    label = "any"
            groups.setdefault((label, same(row)), []).append(outcome)
    order = [*(k for k in kinds if k in pair), "any", *(k for k in kinds if k not in pair)]
    body = []
    for label in order:
        for (group, (action, target, redirects)), outs in groups.items():
            if group != label:
                continue
            named = "any" if len(outs) == len(outcomes) else ", ".join(_code(o) for o in outs)
            states = target + (f" (or {' / '.join(redirects)})" if redirects else "")
            kind_name = "one-off or periodic" if label == "any" else GUIDE_KINDS[label]
            body.append((kind_name, named, GUIDE_OUTCOMES[action], states))
    return _table(["kind", "outcome", "action", "next state"], body)


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
    "guide-lifecycle-table": guide_lifecycle_table,
    "guide-outcome-table": guide_outcome_table,
}

#: The pages under ``docs/`` with generated blocks, and the blocks each must have.
PAGES: Final[Mapping[str, tuple[str, ...]]] = {
    "tables.md": tuple(name for name in BLOCKS if not name.startswith("guide-")),
    "lifecycle.md": ("guide-lifecycle-table",),
    "outcomes.md": ("guide-outcome-table",),
}


# ---------------------------------------------------------------------------------------
# The pages
# ---------------------------------------------------------------------------------------


def render(text: str, specs: Specs, blocks: Sequence[str] = PAGES["tables.md"]) -> str:
    """``text`` with every ``gen_docs_tables`` block refilled from ``specs``.

    :param blocks: the blocks the page must have, each exactly once.
    :raises ValueError: a block names no known renderer, or one of ``blocks`` is
        missing or appears twice.
    """
    seen: list[str] = []

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise ValueError(f"unknown gen_docs_tables block {name!r}")
        seen.append(name)
        return f"{match['open']}{BLOCKS[name](specs)}{match['close']}"

    out = _BLOCK.sub(block, text)
    missing = [name for name in blocks if name not in seen]
    twice = sorted({name for name in seen if seen.count(name) > 1})
    if missing or twice:
        raise ValueError(f"gen_docs_tables blocks: missing {missing}, repeated {twice}")
    return out


def generate(docs: Path, specs: Specs) -> dict[Path, str]:
    """Each page of :data:`PAGES` under ``docs`` as it should be: its current text with
    fresh blocks (a page that does not exist is left out)."""
    return {
        docs / name: render((docs / name).read_text(encoding="utf-8"), specs, blocks)
        for name, blocks in PAGES.items()
        if (docs / name).exists()
    }
