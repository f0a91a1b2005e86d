"""``envq conform``: run the conformance machine against a driver, report, replay.

:func:`run` asks the driver what it supports (``hello``), generates only that, and
runs the Hypothesis machine; the first violation is shrunk to a short counterexample.
:func:`audit` runs again and again, each time setting aside what was found, to list
every distinct divergence of a port with its own minimal counterexample. :func:`report`
writes the result per invariant and per table row, as text or Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from envq._machine import ENVELOPE_MOVES, LIFECYCLE, OUTCOMES
from envq.conform.harness import (
    JITTER,
    REAL_JITTER,
    Harness,
    ScriptError,
    bad_answer,
    load_script,
    replay,
    shape_problem,
)
from envq.conform.machine import DriverFailed, Recorder, make_machine
from envq.conform.oracle import Coverage, Violation
from envq.conform.strategies import Profile
from envq.conform.transport import (
    Driver,
    DriverCrashed,
    InProcessDriver,
    ProtocolError,
    SharedProcess,
)
from envq.model.invariants import INVARIANTS

__all__ = [
    "EXIT_DRIVER",
    "EXIT_PASS",
    "EXIT_VIOLATION",
    "KINDS",
    "Classification",
    "Finding",
    "Note",
    "Options",
    "Result",
    "audit",
    "check_expected",
    "load_classification",
    "main",
    "minimise",
    "report",
    "run",
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


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------


#: Which feature a table row needs (a row a port cannot reach is "not applicable").
def _needs(row: str) -> str | None:
    rules = (
        # first: an EXPIRED row needs leases whatever its row group
        ("EXPIRED", "leases"),
        ("PERIODIC", "periodic"),
        ("STOP_TYPE", "stop_type"),
        ("NO_RETRY", "no_retry"),
        (",STOP]", "stop_envelope"),
        ("TIMEOUT", "deadline"),
        ("CANCELLED", "stop_cancel"),
        ("BUFFERED", "buffer"),
        ("LIFECYCLE[INIT,", "buffer"),
        ("PARKED", "restart"),
        ("LIFECYCLE[STOPPED,START]", "restart"),
    )
    for needle, feature in rules:
        if needle in row:
            return feature
    return None


def _rows() -> list[str]:
    rows = [f"LIFECYCLE[{s.name},{c.name}]" for (s, c) in LIFECYCLE]
    rows += [f"OUTCOMES[{k.name},{o.name}]" for (k, o) in OUTCOMES]
    rows += [f"ENVELOPE_MOVES[{s.name},{e.name}]" for (s, e) in ENVELOPE_MOVES]
    return rows


def report(
    result: Result,
    out: TextIO,
    *,
    markdown: bool = False,
    classification: Classification | None = None,
) -> None:
    """Write the result: per invariant and per table row, then each finding with its
    counterexample (and, given a ``classification``, what kind of divergence each is)."""
    notes = classification.notes if classification is not None else {}
    driver = result.driver
    features = set(driver.get("features", []))
    rate = result.steps / result.seconds if result.seconds else 0.0
    verdict = "ERROR" if result.error else "PASS" if result.passed else "FAIL"
    head = (
        f"{driver.get('driver', '?')} {driver.get('version', '')} on the "
        f"{driver.get('clock', '?')} clock: {verdict}; {result.steps} steps in "
        f"{result.seconds:.1f} s ({rate:.0f} steps/s)"
    )
    violated: dict[str, list[Finding]] = {}
    for finding in result.findings:
        violated.setdefault(finding.check, []).append(finding)
        if finding.row:
            violated.setdefault(finding.row, []).append(finding)

    def status(name: str, checked: int, feature: str | None = None) -> str:
        found = violated.get(name, [])
        if any(not f.declared for f in found):
            return "violated"
        if found:
            return "declared divergence"
        if feature is not None and feature not in features:
            return "not applicable"
        return "checked" if checked else "not reached"

    if markdown:
        if classification is not None:
            _md_preamble(result, classification, out)
        out.write(f"**{head}**\n\n")
        if result.error:
            out.write(f"Driver error:\n\n```text\n{result.error}\n```\n\n")
        out.write("| invariant | checks | status |\n|---|---|---|\n")
        for inv in INVARIANTS:
            n = result.coverage.checks.get(inv.id, 0)
            out.write(f"| {inv.id} — {inv.title} | {n} | {status(inv.id, n)} |\n")
        out.write("\n| table row | uses | status |\n|---|---|---|\n")
        for row in _rows():
            n = result.coverage.rows.get(row, 0)
            out.write(f"| `{row}` | {n} | {status(row, n, _needs(row))} |\n")
        if classification is not None:
            out.write("\n## Counterexamples\n")
        for i, finding in enumerate(result.findings, 1):
            kind = "declared divergence" if finding.declared else "violation"
            title = f"{finding.key}" + (f" ({finding.divergence})" if finding.divergence else "")
            out.write(f"\n### {i}. {kind}: {title}\n\n{finding.message}\n")
            note = notes.get(finding.key)
            if note is not None:
                out.write(f"\n**{KINDS[note.kind].capitalize()}.** {note.summary}")
                out.write(f" See {note.see}.\n" if note.see else "\n")
            elif classification is not None:
                out.write("\n**Unclassified.**\n")
            if finding.flaky:
                out.write(
                    "\nThe generated run failed so once; replayed, it need not (the port's"
                    " timing varies).\n"
                )
            if finding.script:
                out.write("\n```jsonl\n")
                for command in finding.script:
                    out.write(json.dumps(command) + "\n")
                out.write("```\n")
        return
    out.write(head + "\n")
    declared = [
        f"{what} within {float(driver[name]):g} model s"
        for name, what in (("cancel_latency", "cancels"), ("due_latency", "due moves"))
        if driver.get(name)
    ]
    if declared:
        out.write(f"the port's declared bounds: {', '.join(declared)}\n")
    if result.error:
        out.write(f"driver error: {result.error}\n")
        if result.error_script:
            out.write(f"  after {len(result.error_script)} commands of a generated run\n")
    out.write("\ninvariants:\n")
    for inv in INVARIANTS:
        n = result.coverage.checks.get(inv.id, 0)
        out.write(f"  {inv.id:3} {status(inv.id, n):20} {n:7} checks  {inv.title}\n")
    out.write("\ntable rows:\n")
    for row in _rows():
        n = result.coverage.rows.get(row, 0)
        out.write(f"  {status(row, n, _needs(row)):20} {n:7}  {row}\n")
    for i, finding in enumerate(result.findings, 1):
        kind = "declared divergence" if finding.declared else "VIOLATION"
        out.write(f"\n{i}. {kind} {finding.key}: {finding.message}\n")
        note = notes.get(finding.key)
        if note is not None:
            out.write(f"   {KINDS[note.kind]}: {note.summary}\n")
        if finding.script:
            out.write(f"   counterexample: {len(finding.script)} commands\n")


def _md_preamble(result: Result, classification: Classification, out: TextIO) -> None:
    """Title, introduction, the command, and one line per finding with its kind."""
    if classification.title:
        out.write(f"# {classification.title}\n\n")
    if classification.intro:
        out.write(classification.intro.strip() + "\n\n")
    if classification.command:
        out.write(f"```bash\n{classification.command.strip()}\n```\n\n")
    out.write("## Findings\n\n| # | finding | kind | how the port differs | see |\n")
    out.write("|---|---|---|---|---|\n")
    for i, finding in enumerate(result.findings, 1):
        note = classification.notes.get(finding.key)
        kind = KINDS[note.kind] if note is not None else "**unclassified**"
        summary = note.summary if note is not None else finding.message
        see = note.see if note is not None else ""
        out.write(f"| {i} | `{finding.key}` | {kind} | {summary} | {see} |\n")
    missing = sorted(set(classification.notes) - {f.key for f in result.findings})
    if missing:
        out.write(
            "\nClassified, not found by this run (timing-dependent on the real clock): "
            + ", ".join(f"`{key}`" for key in missing)
            + "\n"
        )
    out.write("\n## Coverage\n\n")


def load_expected(path: Path) -> tuple[set[str], set[str]]:
    """The finding keys an expectation file requires, and those it allows (see
    :func:`check_expected`)."""
    if path.suffix == ".json":
        classification = load_classification(path)
        return classification.required, set(classification.notes)
    keys = {
        line.strip()
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    return keys, keys


def check_expected(result: Result, path: Path) -> str | None:
    """Compare the findings with an expectation file; ``None`` if they agree, else why
    not. A JSON file is a :class:`Classification` (every classified finding must be
    found, except those marked ``sometimes``, and nothing else); any other file lists
    the expected keys, one per line (``#`` starts a comment)."""
    found = {f.key for f in result.findings}
    required, allowed = load_expected(path)
    new, gone = sorted(found - allowed), sorted(required - found)
    if not new and not gone:
        return None
    return f"findings differ from {path}:\n  new: {new}\n  gone: {gone}"


def save_scripts(result: Result, directory: Path) -> list[Path]:
    """Write each finding's counterexample as a JSON-lines script, and the commands
    that led to a driver's failure as ``driver-error.jsonl``; their paths."""
    paths = []
    for i, finding in enumerate(result.findings, 1):
        if not finding.script:
            continue
        directory.mkdir(parents=True, exist_ok=True)
        name = finding.key.replace(" ", "_").replace("[", "-").replace("]", "").replace(",", "-")
        path = directory / f"{i:02}-{name}.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in finding.script))
        paths.append(path)
    if result.error_script:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "driver-error.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in result.error_script))
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


#: ``envq conform``'s exit status when the port passed (or a replay found no violation).
EXIT_PASS: Final = 0
#: A violation was found (or reproduced by ``--replay``), or ``--expect`` disagreed.
EXIT_VIOLATION: Final = 1
#: No verdict: bad input (arguments, a script, an expectation file) or a driver that
#: crashed, hung or answered out of the protocol.
EXIT_DRIVER: Final = 2


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 of ``kind``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    """``envq conform``'s arguments (everything after ``--`` is the driver's command)."""
    parser = argparse.ArgumentParser(
        prog="envq conform",
        description=(
            "Check a port of envq against the model, through a driver speaking the "
            "JSON-lines protocol of specs/driver-protocol.md: envq conform [options] -- "
            "CMD ARGS..."
        ),
        epilog=(
            "exit status: 0 passed (or no violation replayed), 1 a violation (or --expect"
            " disagrees), 2 bad input or a driver that crashed, hung or broke the protocol"
        ),
    )
    count, seconds = _positive(int), _positive(float)
    parser.add_argument("--examples", type=count, default=100, help="Hypothesis examples (100)")
    parser.add_argument("--steps", type=count, default=50, help="steps per example (50)")
    parser.add_argument("--derandomize", action="store_true", help="the same run every time")
    parser.add_argument(
        "--time-scale",
        type=seconds,
        default=0.05,
        help="real seconds per model second, for a real-clock driver (0.05)",
    )
    parser.add_argument(
        "--jitter",
        type=seconds,
        default=REAL_JITTER,
        help=f"real seconds of scheduling jitter a real-clock driver's timing checks allow "
        f"({REAL_JITTER:g}; more on a loaded machine)",
    )
    parser.add_argument(
        "--response-timeout",
        type=seconds,
        default=60.0,
        help=(
            "real seconds a driver's answer may take before it counts as hung, on top of"
            " the model time the command lets pass times the time scale (60)"
        ),
    )
    parser.add_argument("--no-shrink", action="store_true", help="report the first failure as is")
    parser.add_argument(
        "--audit", action="store_true", help="find every distinct divergence, not only the first"
    )
    parser.add_argument("--rounds", type=count, default=25, help="most audit rounds (25)")
    parser.add_argument("--ignore", action="append", default=[], help="a check to set aside")
    parser.add_argument("--report", choices=("text", "md"), default="text")
    parser.add_argument("--out", type=Path, default=None, help="write the report there")
    parser.add_argument(
        "--save",
        type=Path,
        default=Path("conform-failures"),
        help="where counterexamples are saved (./conform-failures)",
    )
    parser.add_argument(
        "--expect",
        type=Path,
        default=None,
        help=(
            "expected findings: a file of keys, one per line, or a --classify JSON file;"
            " exit 0 iff the findings are these"
        ),
    )
    parser.add_argument(
        "--classify",
        type=Path,
        default=None,
        help="a port's audit notes (JSON): each finding's kind in the report",
    )
    parser.add_argument("--replay", type=Path, default=None, help="play back a saved script")
    return parser


def main(argv: Sequence[str]) -> int:
    """``envq conform [options] -- CMD ARGS...``; the exit code (:data:`EXIT_PASS`,
    :data:`EXIT_VIOLATION` or :data:`EXIT_DRIVER`)."""
    args_list = list(argv)
    if "--" in args_list:
        cut = args_list.index("--")
        mine, command = args_list[:cut], args_list[cut + 1 :]
    else:
        mine, command = args_list, []
    parser = build_parser()
    args = parser.parse_args(mine)
    # Every input is read before the driver starts: a typo costs no run.
    script: list[dict[str, Any]] | None = None
    try:
        classification = None if args.classify is None else load_classification(args.classify)
        if args.expect is not None:
            load_expected(args.expect)
        if args.replay is not None:
            text = args.replay.read_text(encoding="utf-8")
            script = load_script(text, str(args.replay))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"envq conform: {exc}\n")
        return EXIT_DRIVER
    connect: Callable[[], Driver]
    shared: SharedProcess | None = None
    if command:
        shared = SharedProcess(command, timeout=args.response_timeout)
        connect = shared.connect
    else:
        from envq.driver import Session  # noqa: PLC0415 - the in-process reference driver

        connect = lambda: InProcessDriver(Session)  # noqa: E731
    engine_log = logging.getLogger("envq")
    # The engine's own log lines (a planned on_failure crash, say) are not the report.
    was_disabled, engine_log.disabled = engine_log.disabled, engine_log.disabled or not command
    options = Options(
        examples=args.examples,
        steps=args.steps,
        derandomize=args.derandomize,
        time_scale=args.time_scale,
        jitter=args.jitter,
        shrink=not args.no_shrink,
        ignore=tuple(args.ignore),
    )
    try:
        if script is not None:
            return _replay(connect, script, options)
        result = audit(connect, options, args.rounds) if args.audit else run(connect, options)
    except DriverCrashed as exc:
        sys.stderr.write(f"envq conform: {exc}\n")
        return EXIT_DRIVER
    finally:
        engine_log.disabled = was_disabled
        if shared is not None:
            shared.shutdown()
    out = sys.stdout if args.out is None else args.out.open("w", encoding="utf-8")
    try:
        report(result, out, markdown=args.report == "md", classification=classification)
    finally:
        if args.out is not None:
            out.close()
    for path in save_scripts(result, args.save):
        what = (
            "commands until the driver failed" if path.stem == "driver-error" else "counterexample"
        )
        sys.stderr.write(f"{what}: {path}  (replay: envq conform --replay {path} -- ...)\n")
    if result.error is not None:
        sys.stderr.write(f"envq conform: {result.error}\n")
        return EXIT_DRIVER
    if args.expect is not None:
        differs = check_expected(result, args.expect)
        if differs is not None:
            sys.stderr.write(f"envq conform: {differs}\n")
            return EXIT_VIOLATION
        return EXIT_PASS
    return EXIT_PASS if result.passed else EXIT_VIOLATION


def _replay(connect: Callable[[], Driver], commands: list[dict[str, Any]], options: Options) -> int:
    """Play ``commands`` (checked by :func:`load_script`) through a fresh session."""
    first = commands[0] if commands[0].get("cmd") == "hello" else {}
    answer = hello(connect, options)
    harness = Harness(
        connect(),
        hello={"time_scale": first.get("time_scale", options.time_scale)},
        real_clock=answer.get("clock") == "real",
        ignore=options.ignore,
        jitter=options.jitter,
    )
    try:
        replay(harness, commands)
    except Violation as exc:
        sys.stdout.write(f"VIOLATION {exc}\nafter {len(harness.log)} commands\n")
        return EXIT_VIOLATION
    except ScriptError as exc:
        sys.stderr.write(f"envq conform: the script cannot be replayed: {exc}\n")
        return EXIT_DRIVER
    finally:
        harness.close()
    sys.stdout.write(f"no violation: {len(commands)} commands replayed\n")
    return EXIT_PASS
