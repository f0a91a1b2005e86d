"""Generate ``specs/`` from the one source: the runtime tables and the models.

Usage::

    python scripts/gen_specs.py          # (re)write specs/ and docs/model.md's generated blocks
    python scripts/gen_specs.py --check  # exit 1 and list the files that differ

Generated files:

* ``specs/lifecycle.json`` — every (state, call) of the lifecycle: action, target,
  error, or illegal (``envq._machine.LIFECYCLE`` / ``ILLEGAL_LIFECYCLE``);
* ``specs/envelope.json`` — the envelope states, the relation ``ENVELOPE_MOVES``, the
  outcome rows ``OUTCOMES``, the decision / cancel / parking maps and the model's
  guarded transitions;
* ``specs/invariants.md`` — the invariants of ``models/invariants.py``;
* ``specs/lifecycle.mmd``, ``specs/envelope.mmd`` — Mermaid diagrams of the
  python-statemachine models (``f"{Model:mermaid}"``);
* ``specs/*.svg`` — only where Graphviz ``dot`` and ``pydot`` are installed; not
  checked by ``--check`` (CI does not depend on Graphviz);
* the blocks of ``docs/model.md`` between ``<!-- gen_specs: NAME -->`` and
  ``<!-- /gen_specs -->``, so the documentation embeds the current diagrams.

Output is deterministic: JSON objects have sorted keys, and lists follow the
declaration order of the enums (states, calls, events, kinds, outcomes).
``tests/test_specs.py`` fails when the committed files differ from a fresh generation.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envq import _machine as m
from models.envelope import EVENTS, EnvelopeModel
from models.invariants import INVARIANTS
from models.lifecycle import CALL_EVENTS, REJECTED, LifecycleModel
from models.tables import envelope_transitions

__all__ = ["DOC", "ROOT", "SPECS", "check", "generate", "main", "render_docs", "write"]

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
DOC = ROOT / "docs" / "model.md"
_BLOCK = re.compile(r"(<!-- gen_specs: (?P<name>[\w.]+) -->\n).*?(<!-- /gen_specs -->)", re.S)


def _ordered(members: Iterable[Enum]) -> list[str]:
    """Enum member names, in declaration order."""
    items = list(members)
    if not items:
        return []
    declared = list(type(items[0]))
    return [member.name for member in sorted(items, key=declared.index)]


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _life_order(pair: tuple[m.QueueState, m.QueueCall]) -> tuple[int, int]:
    return list(m.QueueState).index(pair[0]), list(m.QueueCall).index(pair[1])


def lifecycle_spec() -> dict[str, Any]:
    """The lifecycle table as JSON-able data, one entry per (state, call)."""
    rows = []
    for state in m.QueueState:
        for call in m.QueueCall:
            row = m.LIFECYCLE.get((state, call))
            entry: dict[str, Any] = {"state": state.name, "call": call.name}
            if row is None:
                entry["illegal"] = (state, call) in m.ILLEGAL_LIFECYCLE
            else:
                entry["action"] = row.action.name
                entry["target"] = row.target.name if row.target is not None else None
                entry["error"] = row.error.__name__ if row.error is not None else None
            rows.append(entry)
    return {
        "source": "envq._machine.LIFECYCLE and ILLEGAL_LIFECYCLE "
        "(equal to models.lifecycle.LifecycleModel, tests/test_models.py)",
        "states": _ordered(m.QueueState),
        "initial": m.QueueState.INIT.name,
        "calls": _ordered(m.QueueCall),
        "model_events": {call.name: CALL_EVENTS[call] for call in m.QueueCall},
        "rows": rows,
        "rejected_by_contract": [
            {"state": s.name, "call": c.name, "error": err.__name__}
            for (s, c), err in sorted(REJECTED.items(), key=lambda kv: _life_order(kv[0]))
        ],
    }


def _event_name(event: m.EnvEvent | m.Outcome) -> str:
    return f"{type(event).__name__}.{event.name}"


def envelope_spec() -> dict[str, Any]:
    """The envelope machine and the outcome table as JSON-able data."""
    events: list[m.EnvEvent | m.Outcome] = [*m.EnvEvent, *m.Outcome]
    moves = [
        {"state": state.name, "event": _event_name(event), "targets": _ordered(targets)}
        for state in m.EnvState
        for event in events
        if (targets := m.ENVELOPE_MOVES.get((state, event)))
    ]
    outcomes = [
        {
            "kind": kind.name,
            "outcome": outcome.name,
            "action": row.action.name,
            "target": row.target.name,
            "redirects": _ordered(row.redirects),
        }
        for kind in m.Kind
        for outcome in m.Outcome
        if (row := m.OUTCOMES.get((kind, outcome))) is not None
    ]
    transitions = [
        {
            "source": t.source.name,
            "event": _event_name(t.event),
            "model_event": EVENTS[t.event],
            "target": t.target.name,
            "guards": [str(g) for g in t.guards],
        }
        for t in envelope_transitions()
    ]
    return {
        "source": "envq._machine (ENVELOPE_MOVES, OUTCOMES, DECISION_TARGET, SHELVE_TARGET, "
        "PARK_INSTEAD); model: models.envelope.EnvelopeModel (equal, tests/test_models.py)",
        "states": {
            "pseudo": [m.EnvState.NEW.name],
            "live": _ordered(m.LIVE_STATES),
            "terminal": _ordered(m.TERMINAL_STATES),
        },
        "events": {"queue": _ordered(m.EnvEvent), "outcomes": _ordered(m.Outcome)},
        "kinds": _ordered(m.Kind),
        "moves": moves,
        "outcomes": outcomes,
        "decision_target": {d.name: t.name for d, t in m.DECISION_TARGET.items()},
        "shelve_target": {c.name: t.name for c, t in m.SHELVE_TARGET.items()},
        "park_instead": {s.name: t.name for s, t in m.PARK_INSTEAD.items()},
        "model_transitions": transitions,
    }


def invariants_md() -> str:
    """``specs/invariants.md``: a title, then :func:`invariants_list`."""
    return (
        "# envq invariants\n\n"
        "<!-- Generated by scripts/gen_specs.py from models/invariants.py; do not edit. -->\n\n"
        + invariants_list()
    )


def invariants_list() -> str:
    """The numbered list of invariants, in Markdown."""
    return "".join(
        f"{n}. **{inv.id} — {inv.title}.** {inv.definition}\n"
        for n, inv in enumerate(INVARIANTS, start=1)
    )


def _mermaid(machine: type[Any]) -> str:
    return f"{machine:mermaid}".rstrip("\n") + "\n"


def generate() -> dict[Path, str]:
    """Every generated text file (path → content), ``docs/model.md`` included if present."""
    files = {
        SPECS / "lifecycle.json": _json(lifecycle_spec()),
        SPECS / "envelope.json": _json(envelope_spec()),
        SPECS / "invariants.md": invariants_md(),
        SPECS / "lifecycle.mmd": _mermaid(LifecycleModel),
        SPECS / "envelope.mmd": _mermaid(EnvelopeModel),
    }
    if DOC.exists():
        files[DOC] = render_docs(DOC.read_text(encoding="utf-8"), files)
    return files


def render_docs(text: str, files: dict[Path, str]) -> str:
    """Replace each ``<!-- gen_specs: NAME -->`` block of ``text`` with the current NAME.

    ``NAME`` is a file of ``specs/``: ``.mmd`` files are embedded as Mermaid fences,
    ``invariants.md`` as its numbered list.
    """

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        if name == "invariants.md":
            body = invariants_list()
        else:
            body = f"```mermaid\n{files[SPECS / name]}```\n"
        return f"{match[1]}{body}{match[3]}"

    return _BLOCK.sub(block, text)


def _svgs() -> dict[Path, str]:
    """SVG diagrams, if Graphviz ``dot`` and ``pydot`` are both available; else none."""
    if shutil.which("dot") is None:
        return {}
    try:
        return {
            SPECS / "lifecycle.svg": f"{LifecycleModel:svg}",
            SPECS / "envelope.svg": f"{EnvelopeModel:svg}",
        }
    except Exception:
        return {}


def check(files: dict[Path, str]) -> list[Path]:
    """The files whose content on disk differs from ``files`` (or is missing)."""
    return [
        path
        for path, content in files.items()
        if not path.exists() or path.read_text(encoding="utf-8") != content
    ]


def write(files: dict[Path, str]) -> list[Path]:
    """Write the files that differ; return them."""
    changed = check(files)
    for path in changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path], encoding="utf-8")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """Generate (or with ``--check``, verify) the specs; return the exit status."""
    parser = argparse.ArgumentParser(description="Generate specs/ from envq's tables and models.")
    parser.add_argument("--check", action="store_true", help="fail if a file differs")
    args = parser.parse_args(argv)
    files = generate()
    if args.check:
        stale = check(files)
        for path in stale:
            print(f"differs: {path.relative_to(ROOT)}")
        if stale:
            print("run: python scripts/gen_specs.py")
        return 1 if stale else 0
    changed = write(files)
    changed += write(_svgs())
    for path in changed:
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"{len(files)} files up to date" if not changed else f"{len(changed)} file(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
