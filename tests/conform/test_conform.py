"""``envq conform``: the reference driver conforms, in-process and over pipes, on both
clocks; each deliberately faulty driver is caught with a short counterexample that
``--replay`` reproduces; reports and ``--expect`` say what they found."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis.internal.conjecture import providers

from envq.conform.cli import main
from envq.conform.harness import Harness
from envq.conform.oracle import Violation
from envq.conform.reports import check_expected, report, save_scripts
from envq.conform.runner import Options, Result, audit, load_classification, run
from envq.conform.scripts import replay
from envq.conform.transport import DriverCrashed, InProcessDriver, ProcessDriver, SharedProcess
from envq.driver import Session
from tests.conform.faulty_drivers import FAULTY, DoubleCount, LateCron, TerminateDropsParked

DRIVER = [sys.executable, "-m", "envq.driver"]
FAULTY_SCRIPT = str(Path(__file__).resolve().parent / "faulty_drivers.py")

#: Findings each faulty driver must produce (the check, and the table row if any).
EXPECTED = {
    "double_count": "I1",
    "periodic_after_stop": "I7 OUTCOMES[PERIODIC,OK]",
    "terminate_drops_parked": "I5",
    "late_cron": "I7",
    # on_failure called after the move that ended its attempt: nothing accounts for it
    "decides_twice": "I7",
    "succeeds_expired": "I7 OUTCOMES[ONE_OFF,EXPIRED]",
}

#: The most commands a faulty driver's shrunk counterexample may need.
SHORT = 8

#: Enough to find each fault (each shows in a few steps), shrunk. Short examples keep
#: Hypothesis's shrinking quick: at 30 steps the periodic fault's first failing run is
#: long and shrinking it to the same five commands replays about 40,000 steps.
FAULTY_RUN = Options(examples=300, steps=15, derandomize=True)


def _in_process(cls: type[Session] = Session) -> InProcessDriver:
    return InProcessDriver(cls)


class TestReferenceDriver:
    def test_conforms_in_process(self) -> None:
        result = run(_in_process, Options(examples=60, steps=40, derandomize=True))
        assert result.error is None
        assert result.findings == []
        assert result.passed
        assert result.steps > 1000
        # Every invariant was checked, and most table rows were used.
        assert all(result.coverage.checks.get(f"I{i}", 0) > 0 for i in range(1, 9))
        assert len(result.coverage.rows) >= 30

    def test_conforms_over_pipes(self) -> None:
        shared = SharedProcess(DRIVER)
        try:
            result = run(shared.connect, Options(examples=15, steps=30, derandomize=True))
        finally:
            shared.shutdown()
        assert result.error is None, result.error
        assert result.passed
        assert result.driver["driver"] == "envq"
        assert result.driver["clock"] == "virtual"

    def test_conforms_on_the_real_clock(self) -> None:
        """A few short examples with model time scaled down: the real-clock path of
        the harness (ordering by spacing, not by a controlled clock)."""
        result = run(
            lambda: InProcessDriver(lambda: Session("real")),
            # A loaded CI machine delays a timer by tens of milliseconds now and then.
            Options(examples=4, steps=15, derandomize=True, time_scale=0.05, jitter=0.08),
        )
        assert result.error is None, result.error
        assert result.driver["clock"] == "real"
        assert result.passed, [f.message for f in result.findings]
        assert result.steps > 0


class TestFaultyDrivers:
    @pytest.mark.parametrize("name", sorted(FAULTY))
    def test_caught_with_a_short_counterexample(self, name: str, tmp_path: Path) -> None:
        result = run(
            lambda: _in_process(FAULTY[name]),
            FAULTY_RUN,
        )
        assert not result.passed
        [finding] = result.findings
        assert finding.key == EXPECTED[name]
        assert not finding.declared
        assert finding.script[0]["cmd"] == "hello"
        assert len(finding.script) <= SHORT, finding.script

        # The saved script replays to the same violation against the faulty driver,
        # and to none against the reference driver.
        [path] = save_scripts(result, tmp_path)
        commands = [json.loads(line) for line in path.read_text().splitlines()]
        assert commands == list(finding.script)
        with pytest.raises(Violation) as caught:
            _replay(_in_process(FAULTY[name]), commands)
        assert caught.value.check == finding.check
        _replay(_in_process(), commands)

        # Minimal: without any one of its commands (but hello), it no longer fails so.
        for i in range(1, len(commands)):
            shorter = commands[:i] + commands[i + 1 :]
            assert _violation(FAULTY[name], shorter) != (finding.check, finding.row), shorter

    @pytest.mark.parametrize("late", [1.0, 5.0, 1000.0])
    def test_a_late_schedule_is_seen_after_an_advance(self, late: float) -> None:
        """A cron envelope every ten model seconds and 35 s of advance, no statistics
        asked: a port whose next run comes late (even never within the advance) is
        caught at the end of the advance; the reference driver is not."""
        commands: list[dict[str, Any]] = [
            {"cmd": "hello", "protocol": 1},
            {"cmd": "queue", "workers": 1, "capacity": 0},
            {"cmd": "define", "env": "e1", "spec": {"cron": "*/10 * * * * *"}},
            {"cmd": "start"},
            {"cmd": "send", "envs": ["e1"]},
            {"cmd": "advance", "seconds": 35},
        ]

        class Late(LateCron):
            LATE = late

        with pytest.raises(Violation) as caught:
            _replay(_in_process(Late), commands)
        assert caught.value.check == "I7"
        assert "10" in str(caught.value)
        _replay(_in_process(), commands)

    def test_replay_from_the_command_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``envq conform --replay FILE -- CMD`` against a driver process."""
        result = run(
            lambda: _in_process(FAULTY["terminate_drops_parked"]),
            FAULTY_RUN,
        )
        [path] = save_scripts(result, tmp_path)
        faulty = [sys.executable, FAULTY_SCRIPT, "terminate_drops_parked"]
        assert main(["--replay", str(path), "--", *faulty]) == 1
        assert "VIOLATION [I5]" in capsys.readouterr().out
        assert main(["--replay", str(path), "--", *DRIVER]) == 0
        assert "no violation" in capsys.readouterr().out

    @pytest.mark.parametrize("name", ["decides_twice", "succeeds_expired"])
    def test_a_leased_fault_replays_from_the_command_line(
        self, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The two faults of hooks run for an end that lost its lease, as ports whose
        store several processes share: each counterexample replays against the
        faulty driver process and passes against the reference driver."""
        result = run(lambda: _in_process(FAULTY[name]), FAULTY_RUN)
        [path] = save_scripts(result, tmp_path)
        faulty = [sys.executable, FAULTY_SCRIPT, name]
        assert main(["--replay", str(path), "--", *faulty]) == 1
        assert f"VIOLATION [{EXPECTED[name]}]" in capsys.readouterr().out
        assert main(["--replay", str(path), "--", *DRIVER]) == 0
        assert "no violation" in capsys.readouterr().out

    def test_the_command_line_fails_and_saves_the_counterexample(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        faulty = [sys.executable, FAULTY_SCRIPT, "terminate_drops_parked"]
        save = tmp_path / "failures"
        argv = ["--examples", "200", "--derandomize", "--save", str(save), "--", *faulty]
        assert main(argv) == 1
        out = capsys.readouterr()
        assert "FAIL" in out.out
        assert "VIOLATION I5" in out.out
        [saved] = save.iterdir()
        assert saved.suffix == ".jsonl"
        assert str(saved) in out.err

    def test_audit_lists_each_fault(self) -> None:
        """A driver with two faults: the audit finds both, each with its own script.
        (A fault with several symptoms is listed once per symptom: the audit sets a
        finding aside by its check and row, not by its cause.)"""

        class Both(DoubleCount, TerminateDropsParked):
            pass

        result = audit(lambda: _in_process(Both), attrs.evolve(FAULTY_RUN, examples=120))
        keys = sorted(f.key for f in result.findings)
        assert keys == ["I1", "I5"]
        assert all(0 < len(f.script) <= SHORT for f in result.findings)

    def test_expect_pins_the_findings(self, tmp_path: Path) -> None:
        """``--expect FILE``: exit 0 iff the findings are exactly the listed keys."""
        faulty = [sys.executable, FAULTY_SCRIPT, "terminate_drops_parked"]
        common = ["--examples", "200", "--derandomize", "--no-shrink", "--save", str(tmp_path)]
        right = tmp_path / "right.txt"
        right.write_text("# work lost at terminate\nI5\n")
        wrong = tmp_path / "wrong.txt"
        wrong.write_text("I1\n")
        assert main([*common, "--expect", str(right), "--", *faulty]) == 0
        assert main([*common, "--expect", str(wrong), "--", *faulty]) == 1


class _OnceOnly(DoubleCount):
    """Double-counts the first re-send of the whole run only: a port whose fault does
    not show again when the same commands are replayed (as timing does on a real
    clock)."""

    left = 1

    def cmd_send(self, command: dict[str, Any]) -> None:
        before = self.phantom
        super().cmd_send(command)
        if self.phantom > before:
            if _OnceOnly.left > 0:
                _OnceOnly.left -= 1
            else:
                self.phantom = before


class TestRealClockTolerance:
    @pytest.mark.parametrize(("scale", "tolerance"), [(0.02, 1.0), (0.05, 0.4), (1.0, 0.25)])
    def test_twenty_milliseconds_or_a_quarter_second(self, scale: float, tolerance: float) -> None:
        """Timing checks on the real clock allow 20 ms of real jitter (in model seconds
        at the given scale) or a quarter of a model second, whichever is more."""
        harness = Harness(
            InProcessDriver(lambda: Session("real")),
            hello={"time_scale": scale},
            real_clock=True,
        )
        harness.close()
        assert harness.oracle.tolerance == pytest.approx(tolerance)

    def test_the_virtual_clock_is_exact(self) -> None:
        harness = Harness(_in_process())
        harness.close()
        assert harness.oracle.tolerance < 1e-5


class TestUnreliablePorts:
    def test_a_failure_that_does_not_replay_is_reported_as_first_seen(self) -> None:
        """Hypothesis's replay of the failing run passes (a Flaky error): the finding
        is the violation as first raised, with the script that led to it."""
        _OnceOnly.left = 1
        result = run(lambda: _in_process(_OnceOnly), attrs.evolve(FAULTY_RUN, examples=120))
        assert result.error is None
        [finding] = result.findings
        assert finding.key == "I1"
        assert finding.flaky
        _OnceOnly.left = 1  # the same commands, with the fault armed again
        harness = Harness(_in_process(_OnceOnly))
        with pytest.raises(Violation) as caught:
            replay(harness, finding.script)
        harness.close()
        assert caught.value.check == "I1"


class TestCommandLine:
    def test_in_process_run_leaves_the_engine_log_as_it_was(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        """``main()`` silences the engine's log only while the in-process driver runs."""
        log = logging.getLogger("envq")
        log.disabled = False
        monkeypatch.chdir(tmp_path)
        assert main(["--examples", "2", "--steps", "5", "--derandomize"]) == 0
        assert "PASS" in capsys.readouterr().out
        assert log.disabled is False
        assert list(tmp_path.iterdir()) == []  # no counterexample, no directory for them


class TestDeclaredDivergences:
    def test_a_declared_divergence_is_reported_not_failed(self) -> None:
        """A port that declares a divergence in ``hello`` passes on it; everything
        else is still checked."""

        class Declares(TerminateDropsParked):
            def cmd_hello(self, command: dict[str, Any]) -> dict[str, Any]:
                answer: dict[str, Any] = super().cmd_hello(command)
                answer["divergences"] = [
                    {"name": "no-handback", "checks": ["I5"], "classification": "design"}
                ]
                return answer

        declares = Options(examples=40, steps=30, derandomize=True)
        result = run(lambda: _in_process(Declares), declares)
        assert result.passed
        [finding] = result.findings
        assert finding.declared
        assert finding.divergence == "no-handback"


@pytest.fixture(scope="module")
def failed() -> Result:
    """One failed run, for the report tests."""
    log = logging.getLogger("envq")
    was, log.disabled = log.disabled, True
    try:
        result = run(lambda: _in_process(FAULTY["periodic_after_stop"]), FAULTY_RUN)
    finally:
        log.disabled = was
    return result


class TestReports:
    def test_text_report(self, failed: Result) -> None:
        out = io.StringIO()
        report(failed, out)
        text = out.getvalue()
        assert "FAIL" in text.splitlines()[0]
        assert "steps/s" in text.splitlines()[0]
        assert "violated" in text
        assert "OUTCOMES[PERIODIC,OK]" in text
        for i in range(1, 9):
            assert f"  I{i} " in text
        assert "declared bounds" not in text  # the reference driver declares none

    def test_text_report_states_the_ports_declared_bounds(self) -> None:
        """A port's declared bounds widen what the oracle accepts: the report says so."""
        out = io.StringIO()
        report(Result(driver={"driver": "p", "cancel_latency": 0.2, "due_latency": 0.6}), out)
        lines = out.getvalue().splitlines()
        assert lines[1] == (
            "the port's declared bounds: cancels within 0.2 model s, due moves within 0.6 model s"
        )

    def test_markdown_report(self, failed: Result) -> None:
        out = io.StringIO()
        report(failed, out, markdown=True)
        text = out.getvalue()
        assert "| invariant | checks | status |" in text
        assert "| `OUTCOMES[PERIODIC,OK]` |" in text
        assert "### 1. violation: I7 OUTCOMES[PERIODIC,OK]" in text
        assert "```jsonl" in text


class TestClassification:
    """A port's audit notes: each finding's kind in the report, and ``--expect``
    against the classified findings."""

    def _write(self, path: Path, findings: dict[str, dict[str, Any]]) -> Path:
        path.write_text(
            json.dumps(
                {
                    "title": "A faulty port",
                    "intro": "What this audit is.",
                    "command": "envq conform --audit -- port",
                    "findings": findings,
                }
            )
        )
        return path

    def test_markdown_report_names_each_kind(self, failed: Result, tmp_path: Path) -> None:
        key = failed.findings[0].key
        notes = self._write(
            tmp_path / "notes.json",
            {
                key: {"kind": "defect", "summary": "reschedules after StopEnvelope", "see": "X"},
                "I2": {"kind": "design", "summary": "never seen", "sometimes": True},
            },
        )
        out = io.StringIO()
        report(failed, out, markdown=True, classification=load_classification(notes))
        text = out.getvalue()
        assert text.startswith("# A faulty port\n\nWhat this audit is.\n")
        assert "envq conform --audit -- port" in text
        assert f"| 1 | `{key}` | defect of the port | reschedules after StopEnvelope | X |" in text
        assert "**Defect of the port.** reschedules after StopEnvelope See X." in text
        assert "not found by this run (timing-dependent on the real clock): `I2`" in text

    def test_an_unclassified_finding_says_so(self, failed: Result, tmp_path: Path) -> None:
        notes = self._write(tmp_path / "notes.json", {})
        out = io.StringIO()
        report(failed, out, markdown=True, classification=load_classification(notes))
        assert "| **unclassified** |" in out.getvalue()
        assert "**Unclassified.**" in out.getvalue()

    def test_expect_against_the_classified_findings(self, failed: Result, tmp_path: Path) -> None:
        key = failed.findings[0].key
        defect = {"kind": "defect", "summary": "s"}
        exact = self._write(tmp_path / "a.json", {key: defect})
        assert check_expected(failed, exact) is None
        maybe = self._write(tmp_path / "b.json", {key: defect, "I2": {**defect, "sometimes": True}})
        assert check_expected(failed, maybe) is None
        missing = self._write(tmp_path / "c.json", {key: defect, "I2": defect})
        assert check_expected(failed, missing) == (
            f"findings differ from {missing}:\n  new: []\n  gone: ['I2']"
        )
        empty = self._write(tmp_path / "d.json", {})
        assert "new: ['" + key + "']" in str(check_expected(failed, empty))

    def test_a_kind_outside_the_list_is_refused(self, tmp_path: Path) -> None:
        bad = self._write(tmp_path / "bad.json", {"I1": {"kind": "bug", "summary": "s"}})
        with pytest.raises(ValueError, match="kind must be one of"):
            load_classification(bad)


class TestDriverErrors:
    def test_unknown_protocol_is_refused(self) -> None:
        driver = _in_process()
        try:
            response = driver.call({"cmd": "hello", "protocol": 99})
        finally:
            driver.close()
        assert response["ok"] is False
        assert response["error"] == "DriverError"
        assert "99" in response["message"]

    def test_a_driver_that_dies_is_reported(self, tmp_path: Path) -> None:
        script = tmp_path / "dies.py"
        script.write_text("import sys\nsys.stdin.readline()\nsys.exit(3)\n")
        driver = ProcessDriver([sys.executable, str(script)], timeout=30)
        with pytest.raises(DriverCrashed):
            driver.call({"cmd": "hello", "protocol": 1})
        driver.close()
        assert main(["--examples", "1", "--", sys.executable, str(script)]) == 2

    def test_a_driver_speaking_nonsense_is_reported(self, tmp_path: Path) -> None:
        script = tmp_path / "nonsense.py"
        script.write_text("import sys\nsys.stdin.readline()\nprint('not json', flush=True)\n")
        assert main(["--examples", "1", "--", sys.executable, str(script)]) == 2


class TestReplayedScripts:
    def test_a_loan_to_the_second_queue_replays(self) -> None:
        """A saved script that lends an envelope to the second queue, then reclaims it,
        replays against the reference driver: the model tracks the loan and its end."""
        harness = Harness(_in_process(), hello={"time_scale": 0.05})
        try:
            replay(
                harness,
                [
                    {"cmd": "hello", "protocol": 1, "time_scale": 0.05},
                    {"cmd": "define", "env": "e1", "spec": {}},
                    {"cmd": "lend", "env": "e1"},
                ],
            )
            assert harness.oracle.lent == ["e1"]
            replay(harness, [{"cmd": "reclaim"}])
            assert harness.oracle.lent == []
        finally:
            harness.close()


def _replay(driver: InProcessDriver, commands: list[dict[str, Any]]) -> None:
    harness = Harness(driver, hello={"time_scale": 0.05})
    try:
        replay(harness, commands)
    finally:
        harness.close()


def _violation(cls: type[Session], commands: list[dict[str, Any]]) -> tuple[str, str | None] | None:
    """The check and row ``commands`` violate against ``cls``'s driver, if any."""
    try:
        _replay(_in_process(cls), commands)
    except Violation as exc:
        return exc.check, exc.row
    except (KeyError, ValueError, TypeError):
        return None  # a command naming an envelope no longer defined
    return None


#: Runs a derandomized conformance run and prints every command sent, one JSON line
#: each. With an argument, imports that module first (a module of the program under
#: test, never used by the run).
_DRAWN_STEPS = """
import importlib, json, logging, sys
from typing import Any
if len(sys.argv) > 1:
    importlib.import_module(sys.argv[1])
from envq.conform.runner import Options, run
from envq.conform.transport import InProcessDriver
from envq.driver import Session

logging.getLogger("envq").disabled = True

class Recording(InProcessDriver):
    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        print(json.dumps(command, sort_keys=True))
        return super().call(command)

result = run(lambda: Recording(Session), Options(examples=12, steps=30, derandomize=True))
print(json.dumps([f.key for f in result.findings]))
"""


class TestDerandomized:
    def test_draws_the_same_steps_whatever_the_process_imported(self, tmp_path: Path) -> None:
        """A derandomized run draws the same steps in a process with another string
        hash seed and with one more module of the program imported: Hypothesis would
        otherwise also draw from the literal numbers in the source of every module of
        the program loaded so far."""
        (tmp_path / "unrelated.py").write_text(
            "from functools import lru_cache\n\n\n@lru_cache\n"
            "def limits(n: int) -> tuple[int, ...]:\n"
            f"    return {tuple(range(2, 400, 3))!r}[:n]\n"
        )
        root = str(Path(__file__).resolve().parents[2])

        def steps(hash_seed: str, *imports: str) -> list[str]:
            env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": root}
            env["PYTHONPATH"] += os.pathsep + str(tmp_path)
            done = subprocess.run(
                [sys.executable, "-c", _DRAWN_STEPS, *imports],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            return done.stdout.splitlines()

        plain = steps("1")
        assert len(plain) > 100
        assert steps("2", "unrelated") == plain
        assert steps("3", "envq.__main__") == plain

    def test_leaves_hypothesis_as_it_was(self) -> None:
        """Other Hypothesis tests of the process still draw the program's literals."""
        before = providers._get_local_constants
        run(_in_process, Options(examples=2, steps=5, derandomize=True))
        assert providers._get_local_constants is before
