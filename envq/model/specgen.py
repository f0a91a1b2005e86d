"""Generate ``specs/`` and the generated blocks of the docs from the one source: the
runtime tables and the models.

Run as ``python -m envq spec --write`` (rewrite what differs) or ``python -m envq spec
--check`` (exit 1 and list what differs), from a source checkout.

Generated files:

* ``specs/lifecycle.json`` — every (state, call) of the lifecycle: action, target,
  error, or illegal (``envq._machine.LIFECYCLE`` / ``ILLEGAL_LIFECYCLE``);
* ``specs/envelope.json`` — the envelope states, the relation ``ENVELOPE_MOVES``, the
  outcome rows ``OUTCOMES``, the decision / cancel / parking maps and the model's
  guarded transitions;
* ``specs/invariants.md`` — the invariants of :mod:`envq.model.invariants`;
* ``specs/lifecycle.mmd``, ``specs/envelope.mmd`` — Mermaid diagrams of the
  python-statemachine models (``f"{Model:mermaid}"``);
* ``specs/*.svg`` — only where Graphviz ``dot`` and ``pydot`` are installed, and only
  with ``--write`` (the check does not depend on Graphviz);
* the blocks of ``docs/model.md`` between ``<!-- gen_specs: NAME -->`` and
  ``<!-- /gen_specs -->``, so the documentation embeds the current diagrams;
* the tables of ``docs/tables.md``, ``docs/lifecycle.md`` and ``docs/outcomes.md``
  (:mod:`envq.model.doctables`), rendered from the spec files generated here.

Output is deterministic: JSON objects have sorted keys, and lists follow the
declaration order of the enums (states, calls, events, kinds, outcomes). The rows are
the ones ``envq spec`` prints (:mod:`envq.model.specdata`, the one serialiser).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from envq import _machine as m
from envq.model import doctables
from envq.model.envelope import EVENTS, EnvelopeModel
from envq.model.invariants import INVARIANTS
from envq.model.lifecycle import CALL_EVENTS, REJECTED, LifecycleModel
from envq.model.specdata import (
    choice_maps,
    lifecycle_rows,
    names,
    outcome_rows,
    queue_move_rows,
)
from envq.model.tables import envelope_transitions

__all__ = [
    "check",
    "default_root",
    "envelope_spec",
    "generate",
    "invariants_list",
    "invariants_md",
    "lifecycle_spec",
    "render_docs",
    "svgs",
    "write",
]

_BLOCK: Final = re.compile(
    r"(<!-- gen_specs: (?P<name>[\w.]+) -->\n).*?(<!-- /gen_specs -->)", re.S
)


def default_root() -> Path:
    """The source checkout this package was imported from, if it has ``specs/``;
    else the current directory."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "specs").is_dir() else Path.cwd()


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _life_order(pair: tuple[m.QueueState, m.QueueCall]) -> tuple[int, int]:
    return list(m.QueueState).index(pair[0]), list(m.QueueCall).index(pair[1])


def lifecycle_spec() -> dict[str, Any]:
    """The lifecycle table as JSON-able data, one entry per (state, call)."""
    return {
        "source": "envq._machine.LIFECYCLE and ILLEGAL_LIFECYCLE "
        "(equal to models.lifecycle.LifecycleModel, tests/model/test_models.py)",
        "states": names(m.QueueState),
        "initial": m.QueueState.INIT.name,
        "calls": names(m.QueueCall),
        "model_events": {call.name: CALL_EVENTS[call] for call in m.QueueCall},
        "rows": lifecycle_rows(),
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
        {"state": state.name, "event": _event_name(event), "targets": names(targets)}
        for state in m.EnvState
        for event in events
        if (targets := m.ENVELOPE_MOVES.get((state, event)))
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
        "source": "envq._machine (QUEUE_MOVES, OUTCOMES, DECISION_TARGET, SHELVE_TARGET, "
        "PARK_INSTEAD, LIMITED, TAKES_BACK, KIND_OF; ENVELOPE_MOVES derived); model: "
        "models.envelope.EnvelopeModel (equal, tests/model/test_models.py)",
        "states": {
            "pseudo": [m.EnvState.NEW.name],
            "live": names(m.LIVE_STATES),
            "terminal": names(m.TERMINAL_STATES),
        },
        "events": {"queue": names(m.EnvEvent), "outcomes": names(m.Outcome)},
        "kinds": names(m.Kind),
        "moves": moves,
        "queue_moves": queue_move_rows(),
        "outcomes": outcome_rows(),
        **choice_maps(),
        "takes_back": names(m.TAKES_BACK),
        "model_transitions": transitions,
    }


def invariants_md() -> str:
    """``specs/invariants.md``: a title, then :func:`invariants_list`."""
    return (
        "# envq invariants\n\n"
        "<!-- Generated by `python -m envq spec --write` from envq/model/invariants.py; "
        "do not edit. -->\n\n" + invariants_list()
    )


def invariants_list() -> str:
    """The numbered list of invariants, in Markdown."""
    return "".join(
        f"{n}. **{inv.id} — {inv.title}.** {inv.definition}\n"
        for n, inv in enumerate(INVARIANTS, start=1)
    )


def _mermaid(machine: type[Any]) -> str:
    return f"{machine:mermaid}".rstrip("\n") + "\n"


def generate(root: Path | None = None) -> dict[Path, str]:
    """Every generated text file under ``root`` (default :func:`default_root`), path →
    content: ``specs/``, then the docs pages that exist."""
    root = default_root() if root is None else root
    specs = root / "specs"
    files = {
        specs / "lifecycle.json": _json(lifecycle_spec()),
        specs / "envelope.json": _json(envelope_spec()),
        specs / "invariants.md": invariants_md(),
        specs / "lifecycle.mmd": _mermaid(LifecycleModel),
        specs / "envelope.mmd": _mermaid(EnvelopeModel),
    }
    model_page = root / "docs" / "model.md"
    if model_page.exists():
        files[model_page] = render_docs(model_page.read_text(encoding="utf-8"), files, specs)
    fresh = doctables.Specs.parse({path.name: text for path, text in files.items()})
    files.update(doctables.generate(root / "docs", fresh))
    return files


def render_docs(text: str, files: Mapping[Path, str], specs: Path) -> str:
    """Replace each ``<!-- gen_specs: NAME -->`` block of ``text`` with the current NAME.

    ``NAME`` is a file of ``specs``: ``.mmd`` files are embedded as Mermaid fences,
    ``invariants.md`` as its numbered list.
    """

    def block(match: re.Match[str]) -> str:
        name = match["name"]
        if name == "invariants.md":
            body = invariants_list()
        else:
            body = f"```mermaid\n{files[specs / name]}```\n"
        return f"{match[1]}{body}{match[3]}"

    return _BLOCK.sub(block, text)


def svgs(root: Path | None = None) -> dict[Path, str]:
    """SVG diagrams, if Graphviz ``dot`` and ``pydot`` are both available; else none."""
    specs = (default_root() if root is None else root) / "specs"
    if shutil.which("dot") is None:
        return {}
    try:
        return {
            specs / "lifecycle.svg": f"{LifecycleModel:svg}",
            specs / "envelope.svg": f"{EnvelopeModel:svg}",
        }
    except Exception:
        return {}


def check(files: Mapping[Path, str]) -> list[Path]:
    """The files whose content on disk differs from ``files`` (or is missing)."""
    return [
        path
        for path, content in files.items()
        if not path.exists() or path.read_text(encoding="utf-8") != content
    ]


def write(files: Mapping[Path, str]) -> list[Path]:
    """Write the files that differ; return them."""
    changed = check(files)
    for path in changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path], encoding="utf-8")
    return changed
