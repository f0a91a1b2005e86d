"""Mutation check of envq's runtime tables: does a wrong row make a behavioural test fail?

Every row of every table in :mod:`envq._machine` that the runtime reads is mutated in
turn — the target changed (to each other plausible state; a REJECT row's error to each
other error), the action swapped (to each other plausible action), the row dropped; for
``ENVELOPE_MOVES`` a target removed from a row; for the state sets a member removed or a
wrong one added — and the behavioural tests run against each mutant. A mutant is
*killed* when a test fails (or a run hangs); a *survivor* is a missing test, unless it is
listed in :data:`EQUIVALENT` with the reason no test can tell it apart by construction.
(``OutcomeRow.redirects`` and ``ILLEGAL_LIFECYCLE`` are not mutated: the runtime never
reads them.)

Left out (:data:`EXCLUDED`): the tests that compare the tables with the models or
``specs/`` (they would kill every mutant trivially), the ones that run code in a fresh
interpreter (the mutant is not there), and the slow ones not about tables. Envelope
moves are checked against ``ENVELOPE_MOVES`` because ``tests/conftest.py`` turns
``STRICT`` on.

Mechanics: the repository is copied to a fresh ``/tmp/envq-mut-*`` directory (the work
tree is never touched) and each mutant is ``pytest -x`` subprocesses in that copy with
this file loaded as a plugin (``-p mutate``): at import time it reads the mutation from
the ``ENVQ_MUTANT`` environment variable (JSON) and patches the table in
``envq._machine`` and every alias of it in the other envq modules (``envq._queue`` does
``from envq._machine import ...``). A mutant runs the row tests
(``tests/queue/test_*_rows.py``) first and the other behavioural files only if it
survives them; a kill by one of those others (some are timing-sensitive) counts only if
the killing test alone (or, when it passes alone, its file) fails again with the mutant
and passes without it. Two mutants run at a time (``--jobs``). The accepted equivalents
are not run (``--run-equivalents`` runs them too, ``--equivalents`` only them, to check
the list is not stale). The copying, the staged runs and the parallel driver are shared
with ``scripts/mutate_code.py`` (realistic bugs in the engine's code).

Usage::

    python scripts/mutate.py              # every mutant (635: tens of minutes on 2 cores)
    python scripts/mutate.py --quick      # 8 per table (~6 min on 2 cores; CI: --per-table 2)
    python scripts/mutate.py --list       # print the mutants, run nothing
    python scripts/mutate.py --table OUTCOMES --match PERIODIC -v

The last line is ``mutants: N killed: K survived: S``; the exit code is 1 if a survivor
is not an accepted equivalent, 2 if the unmutated suite fails or a mutant run errors.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import enum
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, Final, Generic, Protocol, TypeVar

import attrs

# The repository's envq: the work tree's when run as a script, the temporary copy's when
# loaded as the pytest plugin there (this file is copied with the repository).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import envq._queue
import envq.testing
from envq import _errors, _machine

ENV_VAR: Final = "ENVQ_MUTANT"
ROOT: Final = Path(__file__).resolve().parents[1]
#: Tests left out, and why. ``--include`` takes one back, ``--exclude`` adds one.
EXCLUDED: Final[Mapping[str, str]] = {
    "test_models.py": "compares the tables with the models: kills every mutant trivially",
    "test_specs.py": "compares the tables with specs/: kills every mutant trivially",
    "test_explore.py": "drives the explorer by the tables: kills every mutant trivially",
    "test_oracle_tables.py": "compares the oracle's sets derived from the tables with"
    " their values: kills every mutant of those tables trivially",
    "test_spec_cmd.py": "compares `envq spec` with specs/: kills every mutant trivially",
    "test_docs_tables.py": "compares docs/ with specs/: about the docs, not behaviour",
    "test_demo.py": "slow, and not about the tables",
    "test_docs_examples.py": "runs the docs' examples in fresh interpreters, without the mutant",
    "test_examples.py": "runs the example scripts in fresh interpreters, without the mutant",
    "test_benchmarks_smoke.py": "runs the benchmarks in a fresh interpreter (slow, no mutant)",
    "test_stateful.py": "minutes per run: too slow to run per mutant (--include it to try)",
    "test_mutate_code.py": "checks scripts/mutate_code.py's list against the source: not"
    " about behaviour (and kills every code mutant trivially)",
}
#: Run first (with ``-x`` the first failure ends the run, so likely killers go first).
#: The row tests, the first stage of a mutant's run (fast: no threads, virtual time).
ROWS: Final = ("test_table_rows.py", "test_lifecycle_rows.py")
FIRST: Final = (
    *ROWS,
    "test_lifecycle.py",
    "test_outcomes.py",
    "test_stop.py",
    "test_terminate.py",
    "test_periodic.py",
    "test_events.py",
)
#: Test folders run last in the second stage: their tests start servers and driver
#: processes (minutes in all), and the engine's own tests kill most mutants first.
LAST: Final = ("postgres", "conform")
#: The tables mutated, in report order. ``ILLEGAL_LIFECYCLE`` is not here: the runtime
#: never reads it (it only documents the pairs missing from ``LIFECYCLE`` on purpose).
TABLES: Final = (
    "LIFECYCLE",
    "OUTCOMES",
    "DECISION_TARGET",
    "SHELVE_TARGET",
    "PARK_INSTEAD",
    "LIMITED",
    "QUEUE_MOVES",
    "KIND_OF",
    "RELABEL",
    "BROADCASTS",
    "TYPELESS",
    "ENVELOPE_MOVES",
    "TAKES_BACK",
    "DISPATCHING",
    "TERMINAL_STATES",
    "LIVE_STATES",
)
#: Copied to the temporary work copy: everything but these.
IGNORED: Final = (
    ".git",
    ".venv",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "*.egg-info",
    "build",
    "dist",
    "site",
)


@dataclass(frozen=True)
class Equivalent:
    """Mutants no behavioural test can tell apart from the real table, and why.

    ``pattern`` is an :mod:`fnmatch` pattern over :attr:`Mutant.ident`.
    """

    pattern: str
    reason: str


#: Accepted equivalent mutants: no behavioural test can tell them apart, by construction
#: of the runtime (``envq/_queue.py``), not merely because no test tries. Keep it short.
#: They are not run unless ``--run-equivalents`` (their verdict cannot fail the check);
#: an accepted mutant that a run kills is reported as stale.
EQUIVALENT: Final[tuple[Equivalent, ...]] = (
    Equivalent(
        "LIFECYCLE[TERMINATED,TERMINATE] NOTHING→TERMINATED :: action HAND_BACK→TERMINATED",
        "nothing is live in TERMINATED (the terminate that entered it handed everything back,"
        " send/start are rejected): a second HAND_BACK hands back [] and changes no state",
    ),
    Equivalent(
        "OUTCOMES[*,CANCELLED] SHELVE→PARKED :: target *",
        "SHELVE goes to SHELVE_TARGET[cause] (Queue._resolve); the row's target is unread",
    ),
    Equivalent(
        "OUTCOMES[BLACKLISTED,*] END→STOPPED :: action BLACKLIST",
        "the type is already blacklisted and every other live envelope of it is already"
        " in flight as BLACKLISTED: blacklisting it again changes nothing",
    ),
    Equivalent(
        "QUEUE_MOVES[BUFFERED,BLACKLIST] * :: *",
        "unreachable move: envelopes are BUFFERED only while the queue is INIT, when no"
        " attempt runs that could raise StopType",
    ),
    Equivalent(
        "ENVELOPE_MOVES[BUFFERED,BLACKLIST] {STOPPED} :: drop",
        "unreachable move: envelopes are BUFFERED only while the queue is INIT, when no"
        " attempt runs that could raise StopType",
    ),
    Equivalent(
        "TAKES_BACK[*] {RUNNING} :: with INIT",
        "a move back into the queue happens only at the end of an attempt, and attempts"
        " run only after ARM has left INIT",
    ),
    Equivalent(
        "TAKES_BACK[*] {RUNNING} :: with STOPPED",
        "STOPPED is entered only once no worker holds an envelope (FINISH_STOP after"
        " DRAINED): no attempt or hook ends while STOPPED",
    ),
    Equivalent(
        "TAKES_BACK[*] {RUNNING} :: with TERMINATED",
        "TERMINATED is entered only from INIT (no workers) or STOPPED, when no worker holds"
        " an envelope: no attempt or hook ends while TERMINATED",
    ),
    Equivalent(
        "DISPATCHING[*] {RUNNING,STOPPING} :: with INIT",
        "workers exist only after ARM, which leaves INIT first: no worker ever sees INIT",
    ),
    Equivalent(
        "DISPATCHING[*] {RUNNING,STOPPING} :: with TERMINATED",
        "TERMINATED is entered only from INIT (no workers) or STOPPED, after every worker"
        " retired at FINISH_STOP (idle ones are woken with False, the last one sees STOPPED)",
    ),
    Equivalent(
        "DISPATCHING[*] {RUNNING,STOPPING} :: without STOPPING",
        "a worker reads DISPATCHING only when no READY work is left, and while STOPPING"
        " nothing becomes READY (send is rejected, due timers and retries park): retiring"
        " then instead of idling until FINISH_STOP is unobservable",
    ),
)


# ---------------------------------------------------------------------------------------
# Mutants
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    """One mutation of one table row; ``spec`` is what the plugin applies (JSON)."""

    table: str
    row: str
    change: str
    spec: Mapping[str, Any] = field(compare=False)

    @property
    def ident(self) -> str:
        return f"{self.table}[{self.row}] {self.change}"


def _enc(value: object) -> Any:
    """JSON form of a table key or value: enum members and error classes by name."""
    if isinstance(value, bool):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, type):
        name = value.__name__
        if getattr(_errors, name, None) is value:
            return f"errors.{name}"
    if isinstance(value, tuple):
        return [_enc(v) for v in value]
    if isinstance(value, frozenset):
        return {"set": sorted(_enc(v) for v in value)}
    if value is None:
        return None
    raise TypeError(f"cannot encode {value!r}")


def _dec(value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        owner, _, name = value.partition(".")
        if owner == "errors":
            return getattr(_errors, name)
        return getattr(getattr(_machine, owner), name)
    if isinstance(value, list):
        return tuple(_dec(v) for v in value)
    if isinstance(value, dict) and set(value) == {"set"}:
        return frozenset(_dec(v) for v in value["set"])
    raise ValueError(f"cannot decode {value!r}")


def _name(value: object) -> str:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, tuple):
        return ",".join(_name(v) for v in value)
    if isinstance(value, frozenset):
        return "{" + ",".join(sorted(_name(v) for v in value)) + "}"
    return repr(value)


def mutants() -> list[Mutant]:
    """Every mutant, in a fixed order (tables as in :data:`TABLES`, rows as declared)."""
    m = _machine
    out: list[Mutant] = []
    out += _lifecycle_mutants(m)
    out += _outcome_mutants(m)
    # The plain maps: target → each other plausible state, or dropped.
    plausible = [s for s in m.EnvState if s not in (m.EnvState.NEW, m.EnvState.RUNNING)]
    for table in ("DECISION_TARGET", "SHELVE_TARGET", "PARK_INSTEAD", "LIMITED"):
        mapping: Mapping[Any, Any] = getattr(m, table)
        for key, target in mapping.items():
            for other in plausible:
                if other is not target:
                    out.append(_set(table, key, f"→{target.name}", other, f"→{other.name}"))
            out.append(_drop(table, key, f"→{target.name}"))
    # TYPELESS: the outcome → each other outcome, or dropped.
    for key, outcome in m.TYPELESS.items():
        for instead in m.Outcome:
            if instead is not outcome:
                change = f"→{instead.name}"
                out.append(_set("TYPELESS", key, f"→{outcome.name}", instead, change))
        out.append(_drop("TYPELESS", key, f"→{outcome.name}"))
    out += _queue_move_mutants(m, plausible)
    # KIND_OF and RELABEL: the row group → each other one.
    for table in ("KIND_OF", "RELABEL"):
        groups: Mapping[Any, Any] = getattr(m, table)
        for key, kind in groups.items():
            for group in m.Kind:
                if group is not kind:
                    out.append(_set(table, key, f"→{kind.name}", group, f"→{group.name}"))
    # BROADCASTS: the events a lifecycle action applies → another one of them, or none.
    events = sorted({e for evs in m.BROADCASTS.values() for e in evs}, key=lambda e: e.name)
    for key, applied in m.BROADCASTS.items():
        was = f"→{_name(applied)}"
        if len(applied) == 1:
            for event in events:
                if (event,) != applied:
                    out.append(_set("BROADCASTS", key, was, (event,), f"→{event.name}"))
        out.append(_drop("BROADCASTS", key, was))
    out += _envelope_move_mutants(m)
    out += _set_mutants(m)
    return out


def _set(table: str, key: object, was: str, value: object, change: str) -> Mutant:
    spec = {"table": table, "op": "set", "key": _enc(key), "value": _enc(value)}
    return Mutant(table, _name(key), f"{was} :: {change}", spec)


def _evolve(table: str, key: object, was: str, fields: Mapping[str, object], change: str) -> Mutant:
    spec = {
        "table": table,
        "op": "evolve",
        "key": _enc(key),
        "fields": {k: _enc(v) for k, v in fields.items()},
    }
    return Mutant(table, _name(key), f"{was} :: {change}", spec)


def _drop(table: str, key: object, was: str) -> Mutant:
    spec = {"table": table, "op": "drop", "key": _enc(key)}
    return Mutant(table, _name(key), f"{was} :: drop", spec)


def _lifecycle_mutants(m: ModuleType) -> list[Mutant]:
    """Target → each other state (REJECT rows: error → each other state error); action →
    each other action of the same call's column, NOTHING or REJECT (with the target the
    new action naturally has); drop."""
    S, A = m.QueueState, m.LifeAction
    errors = sorted({r.error for r in m.LIFECYCLE.values() if r.error}, key=lambda e: e.__name__)
    natural = {
        A.ARM: S.RUNNING,
        A.BEGIN_STOP: S.STOPPING,
        A.FINISH_STOP: S.STOPPED,
        A.HAND_BACK: S.TERMINATED,
        A.STOP_THEN_TERMINATE: S.TERMINATED,
        A.ESCALATE_THEN_TERMINATE: S.TERMINATED,
    }
    state_error = {S.STOPPING: "QueueStopping", S.TERMINATED: "QueueTerminated"}
    out: list[Mutant] = []
    for key, row in m.LIFECYCLE.items():
        state, call = key
        was = f"{row.action.name}→{row.target.name if row.target else row.error.__name__}"
        if row.target is None:
            for err in errors:
                if err is not row.error:
                    out.append(
                        _evolve("LIFECYCLE", key, was, {"error": err}, f"error {err.__name__}")
                    )
        else:
            for other in S:
                if other is not row.target:
                    out.append(
                        _evolve("LIFECYCLE", key, was, {"target": other}, f"target {other.name}")
                    )
        column = {r.action for (_s, c), r in m.LIFECYCLE.items() if c is call}
        for action in sorted(column | {A.NOTHING, A.REJECT}, key=lambda a: a.name):
            if action is row.action:
                continue
            fields: dict[str, object]
            if action is A.REJECT:
                err_name = state_error.get(state, "QueueNotRunning")
                err = next(e for e in errors if e.__name__ == err_name)
                fields = {"action": action, "target": None, "error": err}
                change = f"action REJECT({err_name})"
            else:
                target = natural.get(action, state)
                fields = {"action": action, "target": target, "error": None}
                change = f"action {action.name}→{target.name}"
            out.append(_evolve("LIFECYCLE", key, was, fields, change))
        out.append(_drop("LIFECYCLE", key, was))
    return out


def _outcome_mutants(m: ModuleType) -> list[Mutant]:
    """Target → each other plausible state; action → each other action (target kept);
    drop. The ``redirects`` are not mutated: the runtime never reads them (they only
    feed ``ENVELOPE_MOVES``, which is mutated on its own)."""
    E = m.EnvState
    plausible = [s for s in E if s not in (E.NEW, E.RUNNING)]
    out: list[Mutant] = []
    for key, row in m.OUTCOMES.items():
        was = f"{row.action.name}→{row.target.name}"
        for other in plausible:
            if other is not row.target:
                out.append(_evolve("OUTCOMES", key, was, {"target": other}, f"target {other.name}"))
        for action in m.Action:
            if action is not row.action:
                change = f"action {action.name}"
                out.append(_evolve("OUTCOMES", key, was, {"action": action}, change))
        if row.action in (m.Action.RESCHEDULE, m.Action.DECIDE, m.Action.DECIDE_PERIODIC):
            change = f"limited {not row.limited}"
            out.append(_evolve("OUTCOMES", key, was, {"limited": not row.limited}, change))
        out.append(_drop("OUTCOMES", key, was))
    return out


def _queue_move_mutants(m: ModuleType, plausible: Sequence[Any]) -> list[Mutant]:
    """Per row of ``QUEUE_MOVES`` and value of its guard: the target → each other
    plausible state (RUNNING too for the rows that do not dispatch), or dropped (the
    event then leaves the envelope where it is); a missing value of a MODE row added
    (a stop that parks what it should leave); the row dropped."""
    E = m.EnvState
    out: list[Mutant] = []
    for key, row in m.QUEUE_MOVES.items():
        values = list(row.targets)
        if row.guard is m.Guard.MODE:
            values += [mode for mode in m.StopMode if mode not in row.targets]
        for value in values:
            target = row.targets.get(value)
            was = f"{_name(value)}→{target.name if target else '-'}"
            others = [*plausible, E.RUNNING] if key[1] is not m.EnvEvent.DISPATCH else plausible
            for other in others:
                if other is not target:
                    spec = {
                        "table": "QUEUE_MOVES",
                        "op": "retarget",
                        "key": _enc(key),
                        "guard": _enc(value),
                        "value": _enc(other),
                    }
                    out.append(Mutant("QUEUE_MOVES", _name(key), f"{was} :: →{other.name}", spec))
            if target is not None:
                spec = {
                    "table": "QUEUE_MOVES",
                    "op": "retarget",
                    "key": _enc(key),
                    "guard": _enc(value),
                    "value": None,
                }
                out.append(Mutant("QUEUE_MOVES", _name(key), f"{was} :: no move", spec))
        out.append(_drop("QUEUE_MOVES", key, "row"))
    return out


def _envelope_move_mutants(m: ModuleType) -> list[Mutant]:
    """Drop each (state, event) row; from a row with several targets remove each one.
    (Adding a target only makes the relation more permissive, which no run can show.)"""
    out: list[Mutant] = []
    for key, targets in m.ENVELOPE_MOVES.items():
        was = _name(targets)
        if len(targets) > 1:
            for t in sorted(targets, key=lambda s: s.name):
                out.append(_set("ENVELOPE_MOVES", key, was, targets - {t}, f"without {t.name}"))
        out.append(_drop("ENVELOPE_MOVES", key, was))
    return out


def _set_mutants(m: ModuleType) -> list[Mutant]:
    """The state sets: remove each member; add each plausible non-member."""
    Q, E = m.QueueState, m.EnvState
    additions = {
        "DISPATCHING": list(Q),
        "TERMINAL_STATES": [E.BUFFERED, E.READY, E.DELAYED, E.PARKED],
        # A terminal state added to LIVE_STATES is overwritten by the terminal counts in
        # ``statistics()``; NEW is the one plausible wrong member.
        "LIVE_STATES": [E.NEW],
        "TAKES_BACK": list(Q),
    }
    out: list[Mutant] = []
    for table, extra in additions.items():
        members: frozenset[Any] = getattr(m, table)
        was = _name(members)
        for x in sorted(members, key=lambda s: s.name):
            spec = {"table": table, "op": "remove", "value": _enc(x)}
            out.append(Mutant(table, "*", f"{was} :: without {x.name}", spec))
        for x in extra:
            if x not in members:
                spec = {"table": table, "op": "add", "value": _enc(x)}
                out.append(Mutant(table, "*", f"{was} :: with {x.name}", spec))
    return out


def _glob(pattern: str) -> re.Pattern[str]:
    """``*`` matches anything; every other character is literal (``[`` included)."""
    return re.compile(".*".join(re.escape(part) for part in pattern.split("*")) + r"\Z")


def accepted(mutant: Mutant) -> Equivalent | None:
    """The accepted-equivalent entry that covers ``mutant``, if any."""
    for eq in EQUIVALENT:
        if _glob(eq.pattern).match(mutant.ident):
            return eq
    return None


# ---------------------------------------------------------------------------------------
# The plugin side: runs inside the pytest subprocess
# ---------------------------------------------------------------------------------------


def apply(spec: Mapping[str, Any]) -> None:
    """Patch ``envq._machine``'s table (and every alias of it in envq) per ``spec``."""
    name = spec["table"]
    old = getattr(_machine, name)
    op = spec["op"]
    new: object
    if isinstance(old, frozenset):
        member = _dec(spec["value"])
        assert op in ("add", "remove"), spec
        assert (member in old) == (op == "remove"), spec
        new = old | {member} if op == "add" else old - {member}
    else:
        assert isinstance(old, (dict, MappingProxyType)), (name, type(old))
        table = dict(old)
        key = _dec(spec["key"])
        assert key in table, spec
        if op == "drop":
            del table[key]
        elif op == "set":
            table[key] = _dec(spec["value"])
        elif op == "evolve":
            table[key] = attrs.evolve(table[key], **{k: _dec(v) for k, v in spec["fields"].items()})
        elif op == "retarget":
            targets = dict(table[key].targets)
            guard, value = _dec(spec["guard"]), _dec(spec["value"])
            if value is None:
                del targets[guard]
            else:
                targets[guard] = value
            table[key] = attrs.evolve(table[key], targets=MappingProxyType(targets))
        else:
            raise ValueError(f"unknown op {op!r}")
        if isinstance(old, dict):
            # In place: every holder of the dict sees the mutant (row order is kept).
            old.clear()
            old.update(table)
            return
        new = MappingProxyType(table)
    for module in [mod for mod_name, mod in sys.modules.items() if mod_name.startswith("envq")]:
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)


def _plugin_main() -> None:
    """Import-time entry of the plugin: apply ``$ENVQ_MUTANT`` to the copy's envq."""
    raw = os.environ.get(ENV_VAR)
    if raw is None:
        return
    spec = json.loads(raw)
    here = Path(os.environ["ENVQ_MUTANT_ROOT"]).resolve()
    where = Path(_machine.__file__).resolve()
    if here not in where.parents:
        raise RuntimeError(f"envq imported from {where}, not from the mutant copy {here}")
    # A mutant often deadlocks a test: give up after a few idle real seconds, not 30.
    idle = float(os.environ.get("ENVQ_MUTANT_IDLE", "5"))
    for fn in (envq.testing.run, envq.testing.VirtualTimeLoop.__init__):
        if fn.__kwdefaults__ is not None:
            fn.__kwdefaults__["idle_timeout"] = idle
    if spec is not None:
        apply(spec)


if __name__ != "__main__":
    _plugin_main()


# ---------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------


UNMUTATED: Final = Mutant("-", "-", "unmutated", {})
KILLED: Final = ("killed", "timeout")


class Labelled(Protocol):
    """Anything mutated: a table row here, a piece of source in ``mutate_code.py``."""

    @property
    def ident(self) -> str: ...


M = TypeVar("M", bound=Labelled)
#: Entered around a confirming run of the unmutated code (see :meth:`Runner.staged`).
Clean = Callable[[], AbstractContextManager[object]]


@dataclass
class Result(Generic[M]):
    """What the tests made of one mutant.

    ``verdict``: "killed" (a test failed), "timeout" (a run hung: counts as killed),
    "survived", "flaky" (the only failure was not reproducible: counts as survived), or
    "error" (pytest itself failed).
    """

    mutant: M
    verdict: str
    seconds: float
    killer: str = ""
    output: str = ""
    stage_seconds: list[float] = field(default_factory=list)


class Runner:
    """Runs pytest subprocesses in a temporary copy of the repository.

    A mutant runs in stages: first the row tests (:data:`ROWS`, in ``tests/queue/``: no
    threads, virtual time only, fast to collect), then, only if it survived them, every
    other behavioural test file. A kill by the second stage, whose tests include some
    timing-sensitive ones (threads, real time), is confirmed: the killing test alone
    (or, if it passes alone, its file) must fail again with the mutant and pass without
    it.
    """

    def __init__(self, copy: Path, idle: float, files: Sequence[str]) -> None:
        self.copy = copy
        self.files = list(files)
        rows = 0
        while rows < len(self.files) and Path(self.files[rows]).name in ROWS:
            rows += 1
        self.stages = [self.files[:rows], self.files[rows:]] if rows else [self.files]
        self.timeouts = [300.0 for _ in self.stages]
        env = dict(os.environ)
        # Cache the assertion-rewritten test modules (in the copy): collection then
        # costs ~1 s instead of ~4 s per mutant.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(
            HYPOTHESIS_PROFILE="ci",
            PYTHONPATH=os.pathsep.join([str(copy), str(copy / "scripts")]),
            PYTHONPYCACHEPREFIX=str(copy / ".pyc"),
            ENVQ_MUTANT_ROOT=str(copy),
            ENVQ_MUTANT_IDLE=str(idle),
        )
        self.env = env
        self._procs: set[subprocess.Popen[str]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def warm(self) -> None:
        """Collect once, so the rewritten test modules are cached for every run."""
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider"]
        cmd += ["-p", "mutate", *self.files]
        env = {**self.env, ENV_VAR: json.dumps(None)}
        subprocess.run(cmd, cwd=self.copy, env=env, capture_output=True, check=False)

    def run(self, mutant: Mutant | None, stages: int | None = None) -> Result[Mutant]:
        """Run a table mutant (the plugin applies its spec); None: the unmutated suite
        (its first ``stages`` stages, all when None)."""
        if mutant is None:
            return self.staged(UNMUTATED, None, None, stages)
        return self.staged(mutant, dict(mutant.spec), contextlib.nullcontext)

    def staged(
        self,
        mutant: M,
        spec: Mapping[str, Any] | None,
        clean: Clean | None,
        stages: int | None = None,
    ) -> Result[M]:
        """Run the stages (the first ``stages`` of them, all when None) against
        ``mutant`` (``spec``: the plugin's table patch, if any) until one fails.
        Without ``clean`` nothing is confirmed (the unmutated suite); with it, a kill
        by a later stage is confirmed: the killing test alone fails again, and passes
        with no spec while ``clean()`` is entered (for a source mutant: the original
        source put back meanwhile)."""
        started = time.monotonic()
        result = Result(mutant, "survived", 0.0)
        for n, files in enumerate(self.stages[:stages]):
            t0 = time.monotonic()
            verdict, out = self._pytest(files, spec, self.timeouts[n])
            result.stage_seconds.append(time.monotonic() - t0)
            result.verdict, result.output = verdict, out
            found = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)
            result.killer = found.group(1) if found else ""
            if verdict == "killed" and n > 0 and clean is not None:
                result.verdict = self._confirm(spec, result.killer, self.timeouts[n], clean)
            if verdict != "survived":
                break
        result.seconds = time.monotonic() - started
        return result

    def _confirm(
        self, spec: Mapping[str, Any] | None, killer: str, timeout: float, clean: Clean
    ) -> str:
        """Confirm a kill: ``killer`` alone fails with the mutant and passes without it;
        or, if it passes alone, its whole file does (the failure may depend on what the
        file's earlier tests left behind, e.g. a global queue)."""
        if not killer or "::" not in killer:
            return "killed"  # a collection error: not a flaky test
        for selection in ([killer], [killer.partition("::")[0]]):
            again, _ = self._pytest(selection, spec, timeout)
            if again in KILLED:
                with clean():
                    unmutated, _ = self._pytest(selection, None, timeout)
                return "killed" if unmutated == "survived" else "flaky"
        return "flaky"

    def _pytest(
        self, files: Sequence[str], spec: Mapping[str, Any] | None, timeout: float
    ) -> tuple[str, str]:
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        cmd += ["-p", "mutate", *files]
        env = {**self.env, ENV_VAR: json.dumps(spec)}
        with self._lock:
            if self._closed:
                return "error", "interrupted"
            proc = subprocess.Popen(
                cmd,
                cwd=self.copy,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            self._procs.add(proc)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this Popen started
            out, _ = proc.communicate()
            return "timeout", out
        finally:
            with self._lock:
                self._procs.discard(proc)
        if self.interrupted():
            return "error", "interrupted"
        return {0: "survived", 1: "killed"}.get(proc.returncode, "error"), out

    def interrupted(self) -> bool:
        with self._lock:
            return self._closed

    def close(self) -> None:
        """Kill the pytest runs still going (each in the session its Popen started)."""
        with self._lock:
            self._closed = True
            for proc in self._procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)


def behavioural_files(
    root: Path, exclude: Sequence[str] = (), include: Sequence[str] = ()
) -> list[str]:
    """The behavioural test files, likely killers first."""
    left_out = ({*EXCLUDED} | set(exclude)) - set(include)
    # Test files live in subdirectories of tests/ and are named by file name alone
    # (names are unique across the suite).
    paths = {p.name: p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")}
    names = sorted(n for n in paths if n not in left_out)
    ordered = [n for n in FIRST if n in names] + [n for n in names if n not in FIRST]
    # With -x a kill ends the run: the slow folders go last, so that a mutant the
    # engine's own tests kill does not wait for them first.
    ordered.sort(key=lambda n: Path(paths[n]).parent.name in LAST)
    return [paths[n] for n in ordered]


def copy_repo() -> Path:
    copy = Path(tempfile.mkdtemp(prefix="envq-mut-"))
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*IGNORED), dirs_exist_ok=True)
    return copy


def sample(all_mutants: Sequence[Mutant], per_table: int, seed: int) -> list[Mutant]:
    """A fixed sample: ``per_table`` mutants from each table (all of a smaller one)."""
    rng = random.Random(seed)
    picked: set[Mutant] = set()
    for table in TABLES:
        of_table = [mu for mu in all_mutants if mu.table == table]
        picked.update(rng.sample(of_table, min(per_table, len(of_table))))
    return [mu for mu in all_mutants if mu in picked]


def report(results: Sequence[Result[Mutant]], skipped: Sequence[Mutant]) -> int:
    """Print the per-table counts, the survivors and the equivalents; the exit code."""
    print()
    print(f"{'table':<16} {'mutants':>7} {'killed':>7} {'survived':>9} {'accepted':>9}")
    for table in TABLES:
        rows = [r for r in results if r.mutant.table == table]
        skip = sum(mu.table == table for mu in skipped)
        if not rows and not skip:
            continue
        killed = sum(r.verdict in KILLED for r in rows)
        survived = [r for r in rows if r.verdict in ("survived", "flaky")]
        ok = sum(accepted(r.mutant) is not None for r in survived)
        extra = f"  (+{skip} accepted, not run)" if skip else ""
        print(f"{table:<16} {len(rows):>7} {killed:>7} {len(survived):>9} {ok:>9}{extra}")
    survivors = [r for r in results if r.verdict in ("survived", "flaky")]
    missing = [r for r in survivors if accepted(r.mutant) is None]
    errors = [r for r in results if r.verdict == "error"]
    stale = [r for r in results if r.verdict in KILLED and accepted(r.mutant)]
    if missing:
        print(f"\nSURVIVORS ({len(missing)}): a behavioural test is missing for each")
        for r in missing:
            note = "  [only a non-reproducible failure]" if r.verdict == "flaky" else ""
            print(f"  {r.mutant.ident}{note}")
    equivalent = [r.mutant for r in survivors if accepted(r.mutant)] + list(skipped)
    if equivalent:
        print(f"\naccepted equivalents ({len(equivalent)}{', not run' if skipped else ''}):")
        for eq in EQUIVALENT:
            covered = [mu for mu in equivalent if accepted(mu) is eq]
            if covered:
                print(f"  {len(covered):>2} x {eq.pattern}\n       {eq.reason}")
    if stale:
        print(f"\nstale equivalents ({len(stale)}): accepted, but a test kills them")
        for r in stale:
            print(f"  {r.mutant.ident} ({r.killer or r.verdict})")
    if errors:
        print_errors(errors)
        return 2
    return 1 if missing else 0


def print_errors(errors: Sequence[Result[M]]) -> None:
    """The runs that ended neither in pass nor in fail, with their output's tail."""
    print(f"\nERRORS ({len(errors)}): the mutant run did not end in pass/fail")
    for r in errors:
        print(f"  {r.mutant.ident}")
        print("    " + "\n    ".join(r.output.strip().splitlines()[-15:]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a fixed sample per table (CI)")
    parser.add_argument("--per-table", type=int, default=8, help="sample size with --quick")
    parser.add_argument("--seed", type=int, default=0, help="sample seed with --quick")
    parser.add_argument("--table", action="append", choices=TABLES, help="only these tables")
    parser.add_argument("--match", help="only mutants whose ident contains this")
    parser.add_argument(
        "--run-equivalents", action="store_true", help="run the accepted equivalents too"
    )
    parser.add_argument(
        "--equivalents", action="store_true", help="run only the accepted equivalents (audit)"
    )
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    add_runner_options(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)  # clean up (children, the copy) on kill

    chosen = mutants()
    assert len({mu.ident for mu in chosen}) == len(chosen), "mutant idents must be unique"
    if args.table:
        chosen = [mu for mu in chosen if mu.table in args.table]
    if args.match:
        chosen = [mu for mu in chosen if args.match in mu.ident]
    skipped: list[Mutant] = []
    if args.equivalents:
        chosen = [mu for mu in chosen if accepted(mu)]
    elif not args.run_equivalents:
        skipped = [mu for mu in chosen if accepted(mu)]
        chosen = [mu for mu in chosen if not accepted(mu)]
    if args.quick:
        chosen = sample(chosen, args.per_table, args.seed)
        skipped = []
    if args.list:
        for mu in chosen:
            eq = accepted(mu)
            print(mu.ident + (f"  [equivalent: {eq.reason}]" if eq else ""))
        print(f"{len(chosen)} mutants to run, {len(skipped)} accepted equivalents not run")
        return 0
    copy = copy_repo()
    runner = Runner(
        copy, args.idle, behavioural_files(copy, args.exclude or (), args.include or ())
    )
    RUNNERS.append(runner)
    try:
        return _run(args, runner, chosen, skipped)
    except KeyboardInterrupt:
        runner.close()
        print("interrupted")
        return 130
    finally:
        if args.keep:
            print(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


def add_runner_options(parser: argparse.ArgumentParser) -> None:
    """The options of how mutants are run (shared with ``mutate_code.py``)."""
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once")
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="per pytest run (s); 0: 5 times the unmutated run's (measured first)",
    )
    parser.add_argument("--idle", type=float, default=5.0, help="virtual-loop idle timeout (s)")
    parser.add_argument(
        "--exclude", action="append", metavar="TEST_FILE", help="also leave out this test file"
    )
    parser.add_argument(
        "--include", action="append", metavar="TEST_FILE", help="run an excluded test file too"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per mutant")


#: The runners of this process, for the SIGTERM handler.
RUNNERS: list[Runner] = []


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM: no new pytest run starts, the ones going are killed."""
    for runner in RUNNERS:
        runner.close()
    raise KeyboardInterrupt


def baseline(runner: Runner, timeout: float) -> Result[Mutant] | None:
    """Run the unmutated suite (once more if it fails: some timing-sensitive tests are
    flaky) and set the runner's per-stage timeouts from it; None, after printing why,
    when it does not pass.

    With ``timeout`` given, only the first stage runs unmutated (the copy works) and
    every stage gets ``timeout``: the later stages' unmutated run only measures their
    time (minutes on 2 cores, CI's largest cost here), and a kill by a later stage is
    confirmed against the unmutated code anyway (:meth:`Runner.staged`)."""
    stages = 1 if timeout else None
    base = runner.run(None, stages)
    if base.verdict != "survived":
        base = runner.run(None, stages)
    if base.verdict != "survived":
        print(base.output)
        print(f"the unmutated test suite does not pass ({base.verdict}): nothing to check")
        return None
    # A stage that runs far longer than unmutated has hung (a mutant can spin).
    if timeout:
        runner.timeouts = [timeout for _ in runner.stages]
    else:
        runner.timeouts = [max(30.0, 5 * t) for t in base.stage_seconds]
    return base


def announce(count: int, jobs: int, runner: Runner, base: Result[Mutant]) -> None:
    """The line that starts a run: how many mutants, the unmutated times, the timeouts."""
    stages = " + ".join(f"{t:.1f}" for t in base.stage_seconds)
    if len(base.stage_seconds) < len(runner.stages):
        stages += " (the first stage only: --timeout given)"
    print(
        f"{count} mutants, {jobs} at a time; unmutated suite {stages} s "
        f"({len(runner.files)} files); timeouts "
        + " + ".join(f"{t:.0f}" for t in runner.timeouts)
        + " s",
        flush=True,
    )


def run_all(
    run_one: Callable[[M], Result[M]],
    chosen: Sequence[M],
    jobs: int,
    *,
    verbose: bool,
    expected: Callable[[M], bool],
    close: Callable[[], None],
) -> list[Result[M]]:
    """``run_one`` every mutant, ``jobs`` at a time, in order; a line per mutant that is
    not killed (unless ``expected`` of it), or per mutant with ``verbose``. On Ctrl-C:
    ``close()`` (kills the pytest runs going), wait for the threads, re-raise."""
    results: list[Result[M]] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            for n, result in enumerate(pool.map(run_one, chosen), 1):
                results.append(result)
                bad = result.verdict in ("survived", "flaky", "error")
                if verbose or (bad and not expected(result.mutant)):
                    where = f" ({result.killer})" if result.killer else ""
                    print(
                        f"[{n}/{len(chosen)}] {result.verdict.upper():<8} "
                        f"{result.seconds:5.1f}s {result.mutant.ident}{where}",
                        flush=True,
                    )
        except KeyboardInterrupt:
            close()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results


def summary(results: Sequence[Result[M]], started: float) -> None:
    """The run's last lines: elapsed time, then ``mutants: N killed: K survived: S``."""
    killed = sum(r.verdict in KILLED for r in results)
    survived = sum(r.verdict in ("survived", "flaky") for r in results)
    print(f"\nelapsed {time.monotonic() - started:.0f} s")
    print(f"mutants: {len(results)} killed: {killed} survived: {survived}")


def _run(
    args: argparse.Namespace, runner: Runner, chosen: Sequence[Mutant], skipped: Sequence[Mutant]
) -> int:
    started = time.monotonic()
    runner.warm()
    base = baseline(runner, args.timeout)
    if base is None:
        return 2
    announce(len(chosen), args.jobs, runner, base)
    results = run_all(
        runner.run,
        chosen,
        args.jobs,
        verbose=args.verbose,
        expected=lambda mu: accepted(mu) is not None,
        close=runner.close,
    )
    code = report(results, skipped)
    summary(results, started)
    return code


if __name__ == "__main__":
    sys.exit(main())
