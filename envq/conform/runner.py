"""``envq conform``: run the conformance machine against a driver, report, replay.

:func:`run` asks the driver what it supports (``hello``), generates only that, and
runs the Hypothesis machine; the first violation is shrunk to a short counterexample.
:func:`audit` runs again and again, each time setting aside what was found, to list
every distinct divergence of a port with its own minimal counterexample;
:func:`minimise` shortens a finding's script. The reports are
:mod:`envq.conform.reports`'s, the command line :mod:`envq.conform.cli`'s.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from envq.conform.harness import JITTER, REAL_JITTER, Harness
from envq.conform.machine import DriverFailed, Recorder, make_machine
from envq.conform.oracle import Coverage, Violation
from envq.conform.scripts import ScriptError, replay
from envq.conform.shapes import bad_answer, shape_problem
from envq.conform.strategies import Profile
from envq.conform.transport import (
    Driver,
    DriverCrashed,
    ProtocolError,
)

__all__ = [
    "KINDS",
    "Classification",
    "Finding",
    "Note",
    "Options",
    "Result",
    "audit",
    "hello",
    "load_classification",
    "minimise",
    "run",
    "same_failure",
]


@attrs.frozen
class Options:
    """How much to generate, and how."""

    #: Hypothesis examples (runs of the machine).
    examples: int = 100
    #: Steps (rules) per example.
    steps: int = 50
    #: The same examples every time (a seed derived from the machine).
    derandomize: bool = False
    #: Real seconds per model second, for a port on the real clock.
    time_scale: float = 0.05
    #: Real seconds of scheduling jitter a real-clock port's timing checks allow (a
    #: loaded machine needs more than the default).
    jitter: float = REAL_JITTER
    shrink: bool = True
    #: Violations not to report (a check, or a check and a table row).
    ignore: tuple[str, ...] = ()


@attrs.frozen
class Finding:
    """One violation, with the commands that reproduce it."""

    check: str
    row: str | None
    message: str
    script: tuple[dict[str, Any], ...]
    #: The port declared it (a known divergence), or an audit set it aside.
    declared: bool = False
    #: The name of the declared divergence it belongs to.
    divergence: str | None = None
    #: The generated run failed once but not when Hypothesis replayed it (the port's
    #: timing varies): the script is the one that failed first.
    flaky: bool = False

    @property
    def key(self) -> str:
        """``check`` or ``check row``: what ignores it next time."""
        return f"{self.check} {self.row}" if self.row else self.check


@attrs.define
class Result:
    """What a run (or an audit) found."""

    driver: dict[str, Any]
    findings: list[Finding] = attrs.Factory(list)
    coverage: Coverage = attrs.Factory(Coverage)
    steps: int = 0
    seconds: float = 0.0
    #: Why the driver could not be checked (it crashed, hung or broke the protocol).
    error: str | None = None
    #: The commands sent in the run until the driver failed, the last one the one that
    #: failed (empty if it failed outside a run).
    error_script: tuple[dict[str, Any], ...] = ()

    @property
    def passed(self) -> bool:
        """No violation but declared divergences, and the driver worked."""
        return self.error is None and all(f.declared for f in self.findings)


#: The kinds a finding can be classified as (see :class:`Classification`).
KINDS: Final[Mapping[str, str]] = {
    "defect": "defect of the port",
    "design": "deliberate design difference",
}


@attrs.frozen
class Note:
    """What a port's auditors say about one finding."""

    #: ``defect`` (the port loses, miscounts or breaks something the model keeps) or
    #: ``design`` (the port does it differently on purpose).
    kind: str
    #: One line: how the port behaves, against the model.
    summary: str
    #: Where the difference is discussed (a link or a document section).
    see: str = ""
    #: Timing-dependent on a real clock: an audit may or may not find it.
    sometimes: bool = False


@attrs.frozen
class Classification:
    """A port's audit notes: a title and introduction for the Markdown report, the
    command that reproduces it, and a :class:`Note` per finding key. Read from JSON by
    :func:`load_classification`; ``--expect`` with a JSON file checks the audit finds
    exactly the classified findings (those marked ``sometimes`` may be missing)."""

    title: str = ""
    intro: str = ""
    command: str = ""
    notes: dict[str, Note] = attrs.Factory(dict)

    @property
    def required(self) -> set[str]:
        """The finding keys every audit must find."""
        return {key for key, note in self.notes.items() if not note.sometimes}


def load_classification(path: Path) -> Classification:
    """Read a classification file (JSON: ``title``, ``intro``, ``command`` and
    ``findings``, an object of finding key → ``{kind, summary, see, sometimes}``)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("findings", {}), dict):
        raise ValueError(f"{path}: an object with an object of findings expected")
    notes = {}
    for key, entry in data.get("findings", {}).items():
        if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
            raise ValueError(f"{path}: finding {key!r}: kind must be one of {sorted(KINDS)}")
        notes[key] = Note(
            entry["kind"],
            str(entry.get("summary", "")),
            str(entry.get("see", "")),
            bool(entry.get("sometimes", False)),
        )
    return Classification(
        str(data.get("title", "")), str(data.get("intro", "")), str(data.get("command", "")), notes
    )


def hello(connect: Callable[[], Driver], options: Options) -> dict[str, Any]:
    """The driver's answer to ``hello`` (one short session)."""
    driver = connect()
    command = {"cmd": "hello", "protocol": 1, "time_scale": options.time_scale}
    try:
        response = driver.call(command)
    finally:
        driver.close()
    answer = response.get("result")
    problem = shape_problem(command, response)
    if problem is not None:
        raise ProtocolError(bad_answer(driver, command, problem))
    if not response.get("ok") or not isinstance(answer, dict):
        raise DriverCrashed(f"hello answered {json.dumps(response)[:300]}")
    return answer


def _declared(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in answer.get("divergences", []) if isinstance(d, dict)]


def run(connect: Callable[[], Driver], options: Options = Options()) -> Result:
    """Run the conformance machine against a driver; at most one new finding."""
    answer = hello(connect, options)
    declared = _declared(answer)
    declared_keys = [key for d in declared for key in d.get("checks", [])]
    profile = Profile(frozenset(answer.get("features", [])), answer.get("clock") == "real")
    result = Result(answer)
    recorder = Recorder()
    machine = make_machine(
        connect,
        profile,
        recorder,
        hello={"time_scale": options.time_scale},
        ignore=[*options.ignore, *declared_keys],
        coverage=result.coverage,
    )
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    real_clock = profile.real_clock
    # On the real clock Hypothesis's shrinking replays hundreds of variants that need not
    # fail the same way twice (minutes each, then a Flaky error); minimise() alone, which
    # tolerates a variant that does not reproduce, shortens the counterexample there.
    if options.shrink and not real_clock:
        phases.append(Phase.shrink)
    config = settings(
        max_examples=options.examples,
        stateful_step_count=options.steps,
        deadline=None,
        derandomize=options.derandomize,
        database=None,
        phases=phases,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    started = time.monotonic()
    harness: Harness | None
    try:
        jitter = JITTER.set(options.jitter)
        try:
            with _without_source_constants():
                run_state_machine_as_test(machine, settings=config)
        finally:
            JITTER.reset(jitter)
    except Violation as exc:
        harness = recorder.harness
        script = tuple(harness.log) if harness is not None else ()
        finding: Finding | None = Finding(exc.check, exc.row, exc.message, script)
    except Flaky as exc:
        # The run failed once and not the same way when Hypothesis replayed it (a port
        # whose timing varies): report the violation as it was first seen.
        finding = None
        if recorder.first is None:
            result.error = (
                "the driver's answers differed when the same commands were sent again, "
                f"and the run failed only once ({type(exc).__name__}: {exc})"
            )
        else:
            first, script = recorder.first
            finding = Finding(first.check, first.row, first.message, script, flaky=True)
    except DriverFailed:
        finding = None  # the recorder has it
    except DriverCrashed as exc:
        finding = None
        result.error = str(exc)
    else:
        finding = None
    if recorder.failure is not None:
        # The driver failed: that is the run's result, whatever Hypothesis made of it
        # (replaying a failing example, it may report a flaky strategy instead). A
        # violation seen before is still reported, with its script, unshortened.
        crash, result.error_script = recorder.failure
        result.error = str(crash)
        finding = None
        if recorder.first is not None:
            first, script = recorder.first
            result.findings.append(Finding(first.check, first.row, first.message, script))
    if finding is not None:
        if options.shrink and finding.script:
            ignore = (*options.ignore, *declared_keys)
            finding = minimise(connect, finding, options, real_clock=real_clock, ignore=ignore)
        result.findings.append(finding)
    result.seconds = time.monotonic() - started
    result.steps = result.coverage.steps
    for known in recorder.known:
        divergence = next(
            (d.get("name") for d in declared if _in(known, d.get("checks", []))), None
        )
        finding = Finding(
            known.check, known.row, known.message, (), declared=True, divergence=divergence
        )
        if finding.key not in {f.key for f in result.findings}:
            result.findings.append(finding)
    return result


_constants_lock = threading.Lock()
#: How many runs are generating, and what Hypothesis had before the first of them.
_constants_users: list[Callable[[], Any]] = []


@contextlib.contextmanager
def _without_source_constants() -> Iterator[None]:
    """While a run generates, Hypothesis draws no numbers or strings taken from the
    source of the program's modules."""
    # Hypothesis mixes into what it draws the literals written in every module of the
    # program (not of installed packages) imported so far. Which modules those are
    # depends on what the process imported before, and on whether envq is installed or
    # checked out, so a derandomized run would differ from one process to the next.
    # These are private names of Hypothesis: if they go, nothing is patched, and the
    # test that compares the same run in two processes fails.
    try:
        providers: Any = importlib.import_module("hypothesis.internal.conjecture.providers")
        current = providers._get_local_constants
        none = providers.Constants()
    except (ImportError, AttributeError):  # pragma: no cover - a Hypothesis without them
        yield
        return

    def no_constants() -> Any:
        return none

    with _constants_lock:
        if not _constants_users:
            providers._get_local_constants = no_constants
        _constants_users.append(current)
    # The draws allowed for each kind of choice are cached, the program's among them.
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        with _constants_lock:
            first = _constants_users[0]
            _constants_users.pop()
            if not _constants_users:
                providers._get_local_constants = first
        providers.CONSTANTS_CACHE.cache.clear()


def minimise(
    connect: Callable[[], Driver],
    finding: Finding,
    options: Options,
    *,
    real_clock: bool = False,
    ignore: Iterable[str] = (),
    passes: int = 3,
) -> Finding:
    """The finding with a shorter script: runs of commands, then single commands, are
    deleted, last first, as long as the script still replays to a violation of the same
    check and row. Hypothesis shrinks the generated run; this pass removes what its shrinking
    leaves behind (a repeated no-op call, a check between two steps), so that a
    counterexample is no longer than it needs to be."""
    ignored = tuple(ignore)

    def violation(script: Sequence[dict[str, Any]]) -> Violation | None:
        harness: Harness | None = None
        try:
            harness = Harness(
                connect(),
                hello={"time_scale": options.time_scale},
                real_clock=real_clock,
                ignore=ignored,
                jitter=options.jitter,
            )
            replay(harness, script)
        except Violation as exc:
            return exc
        except (DriverCrashed, ScriptError):
            return None  # no longer makes sense (a definition, an attempt deleted)
        finally:
            if harness is not None:
                harness.close()
        return None

    script = list(finding.script)
    message = finding.message
    for _ in range(passes):
        shorter = False
        # Runs of commands first (halves, quarters, ... down to one), last first: a long
        # real-clock script loses most of its length in a few replays.
        size = max(1, (len(script) - 1) // 2)
        while True:
            end = len(script)
            while end > 1:  # the first command is hello
                start = max(1, end - size)
                candidate = script[:start] + script[end:]
                found = violation(candidate)
                if found is not None and same_failure(found, finding):
                    script, message, shorter = candidate, found.message, True
                end = start
            if size == 1:
                break
            size = max(1, size // 2)
        if not shorter:
            break
    return attrs.evolve(finding, script=tuple(script), message=message)


_NUMBERS: Final = re.compile(r"\d+(?:\.\d+)?")


def same_failure(found: Violation, finding: Finding) -> bool:
    """Whether a shorter script's ``found`` violation is the ``finding`` being shrunk:
    the same check and row and, for a ``protocol`` finding (whose row says nothing),
    the same message up to its numbers. Deleting a command the protocol needs (the
    ``queue`` before a ``stats``) makes the driver refuse the script; that refusal is
    another failure, and a shrink never trades the failure it shrinks for another."""
    if (found.check, found.row) != (finding.check, finding.row):
        return False
    if found.check != "protocol":
        return True
    return _NUMBERS.sub("#", found.message) == _NUMBERS.sub("#", finding.message)


def _in(violation: Violation, keys: Iterable[str]) -> bool:
    own = {violation.check, f"{violation.check} {violation.row}" if violation.row else ""}
    return any(key in own for key in keys)


def audit(
    connect: Callable[[], Driver],
    options: Options = Options(),
    rounds: int = 25,
) -> Result:
    """Find every distinct divergence: run, set the finding aside, run again — until a
    run finds nothing new (or after ``rounds``). Each finding keeps its own shrunk
    counterexample."""
    ignore = list(options.ignore)
    total: Result | None = None
    for _ in range(rounds):
        one = run(connect, attrs.evolve(options, ignore=tuple(ignore)))
        if total is None:
            total = Result(one.driver, coverage=one.coverage)
        else:
            for name, n in one.coverage.checks.items():
                total.coverage.checks[name] = total.coverage.checks.get(name, 0) + n
            for name, n in one.coverage.rows.items():
                total.coverage.rows[name] = total.coverage.rows.get(name, 0) + n
        total.steps += one.steps
        total.coverage.steps = total.steps
        total.seconds += one.seconds
        new = [f for f in one.findings if not f.declared]
        for finding in one.findings:
            if finding.declared and finding.key not in {f.key for f in total.findings}:
                total.findings.append(finding)
        if one.error is not None:
            total.error = one.error
            total.error_script = one.error_script
            break
        if not new:
            break
        for finding in new:
            total.findings.append(finding)
            # Exactly this one: another row of the same check is another divergence.
            ignore.append(f"={finding.key}")
    assert total is not None
    return total
