"""``envq conform`` as a port author meets it: a driver that crashes, hangs, closes its
output, prints nonsense or answers with JSON of the wrong shape is reported as exactly
that (with its stderr), never as a flaky strategy, and never waited on for ever; a
saved script that cannot be replayed is bad input, not a violation; the exit status
tells pass (0), violation (1) and bad input or a failed driver (2) apart; the response
limit grows with the model time a command lets pass."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from envq.conform.cli import EXIT_DRIVER, EXIT_PASS, EXIT_VIOLATION, main
from envq.conform.harness import Harness
from envq.conform.oracle import Violation
from envq.conform.runner import Options, run
from envq.conform.scripts import ScriptError, load_script
from envq.conform.shapes import shape_problem
from envq.conform.transport import (
    DriverCrashed,
    InProcessDriver,
    ProcessDriver,
    SharedProcess,
    model_wait,
)

BROKEN = [sys.executable, str(Path(__file__).resolve().parent / "broken_drivers.py")]
DRIVER = [sys.executable, "-m", "envq.driver"]
QUICK = ["--examples", "5", "--steps", "10", "--derandomize"]


def _conform(
    args: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> tuple[int, str]:
    """``envq conform ARGS``: its exit status, and its stdout and stderr together."""
    status = main([*QUICK, "--save", str(tmp_path / "saved"), *args])
    out = capsys.readouterr()
    return status, out.out + out.err


class TestCrashingDrivers:
    def test_a_driver_that_exits_midway_is_reported_with_its_stderr(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        """Every process of the driver exits at its 6th command: the report says the
        driver exited, during which command, with its status and stderr; no
        flakiness, no strategy blamed."""
        status, text = _conform(["--", *BROKEN, "exit", "6"], capsys, tmp_path)
        assert status == EXIT_DRIVER
        assert "ERROR" in text.splitlines()[0]
        assert "the driver's output ended during 'define'; it exited with status 3" in text
        assert "broken driver: exit at command 6 (define)" in text
        assert "Flaky" not in text
        assert "Inconsistent data generation" not in text
        # The commands that led there are saved, the failing one last.
        saved = tmp_path / "saved" / "driver-error.jsonl"
        commands = [json.loads(line) for line in saved.read_text().splitlines()]
        assert commands[0]["cmd"] == "hello"
        assert commands[-1]["cmd"] == "define"
        assert str(saved) in text

    def test_an_intermittent_crash_is_the_run_error(self) -> None:
        """A crash in the middle of a generated run ends the run (Hypothesis does not
        replay it): the result's error is the crash with the driver's stderr."""
        shared = SharedProcess([*BROKEN, "exit", "9"], timeout=30)
        try:
            result = run(shared.connect, Options(examples=5, steps=10, derandomize=True))
        finally:
            shared.shutdown()
        assert result.error is not None
        assert "it exited with status 3" in result.error
        assert "--- driver stderr ---\nbroken driver: exit at command 9" in result.error
        assert len(result.error_script) >= 2
        assert not result.passed

    def test_a_closed_output_is_not_waited_on(self) -> None:
        """A driver alive but with its output closed: the call that met the end fails,
        and every later one fails at once with the same explanation (it is not sent
        anything, not even ``quit``)."""
        driver = ProcessDriver([*BROKEN, "close", "2"], timeout=30)
        try:
            assert driver.call({"cmd": "hello", "protocol": 1})["ok"] is True
            with pytest.raises(DriverCrashed, match="output ended during 'stats'"):
                driver.call({"cmd": "stats"})
            assert not driver.alive
            with pytest.raises(DriverCrashed, match=r"cannot send 'reset'.*output ended"):
                driver.call({"cmd": "reset"})
        finally:
            driver.close()
        assert driver._proc.poll() is not None  # killed, not left running

    def test_a_shared_process_whose_output_ended_is_replaced(self) -> None:
        """The next session starts a new driver process instead of sending ``reset``
        to one that can no longer answer."""
        shared = SharedProcess([*BROKEN, "close", "2"], timeout=30)
        try:
            first = shared.connect()
            first.call({"cmd": "hello", "protocol": 1})
            with pytest.raises(DriverCrashed):
                first.call({"cmd": "stats"})
            second = shared.connect()
            assert second.call({"cmd": "hello", "protocol": 1})["ok"] is True
        finally:
            shared.shutdown()

    def test_a_hung_driver_is_killed_and_reported(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        args = ["--response-timeout", "1", "--", *BROKEN, "hang", "4"]
        status, text = _conform(args, capsys, tmp_path)
        assert status == EXIT_DRIVER
        assert re.search(r"the driver did not answer '\w+' in 1 s \(it was killed\)", text)
        assert "broken driver: hang at command 4" in text

    def test_a_line_that_is_not_json_is_reported_with_its_number(
        self, capsys: pytest.CaptureFixture[str], tmp_path: Path
    ) -> None:
        status, text = _conform(["--", *BROKEN, "garbage", "6"], capsys, tmp_path)
        assert status == EXIT_DRIVER
        assert "the answer to 'define' is not JSON (line 6 of the driver's output" in text
        assert "Traceback (most recent call last): oops" in text


GOOD: dict[str, Any] = {"ok": True, "result": None, "events": [], "at": 0, "t": 0.0}
MOVE: dict[str, Any] = {
    "t": 1.0,
    "kind": "move",
    "env": "e1",
    "from": "new",
    "to": "ready",
    "outcome": None,
    "cause": None,
}


class TestWrongShapes:
    @pytest.mark.parametrize(
        ("mode", "command", "field"),
        [
            ("events_null", "hello", "field 'events' is null, not a list"),
            ("move_no_env", r"\w+", r"field 'events\[\d+\]\.env' is missing, not a name"),
            ("at_text", "hello", "field 'at' is '0', not a count"),
            ("stats_no_capacity", "stats", "field 'result.capacity_used' is missing, not a count"),
        ],
    )
    def test_valid_json_of_the_wrong_shape_is_a_protocol_error(
        self,
        mode: str,
        command: str,
        field: str,
        capsys: pytest.CaptureFixture[str],
        tmp_path: Path,
    ) -> None:
        """The command, the field, and the driver's line; exit 2, no traceback."""
        status, text = _conform(["--", *BROKEN, mode], capsys, tmp_path)
        assert status == EXIT_DRIVER
        assert re.search(f"protocol error: the answer to '{command}': {field}", text), text
        assert re.search(r"line \d+ of the driver's output: \{", text), text
        assert "Traceback" not in text

    @pytest.mark.parametrize(
        ("command", "change", "field"),
        [
            ("start", {"ok": None}, "'ok'"),
            ("start", {"ok": False}, "'error'"),
            ("start", {"events": {"kind": "move"}}, "'events'"),
            ("start", {"events": [7]}, "'events[0]'"),
            ("start", {"events": [{**MOVE, "kind": "moved"}]}, "'events[0].kind'"),
            ("start", {"events": [{**MOVE, "t": "1"}]}, "'events[0].t'"),
            ("start", {"events": [{**MOVE, "to": "gone"}]}, "'events[0].to'"),
            ("start", {"events": [{**MOVE, "outcome": "fine"}]}, "'events[0].outcome'"),
            ("start", {"events": [{"t": 0, "kind": "invoke", "env": "e1"}]}, ".plan'"),
            ("start", {"events": [MOVE], "at": 2}, "'at'"),
            ("start", {"events": [MOVE, MOVE], "at": 1, "effect": 2}, "'effect'"),
            ("start", {"events": [MOVE], "effect": 2}, "'effect'"),
            ("start", {"events": [MOVE], "at": 1, "effect": -1}, "'effect'"),
            ("start", {"events": [MOVE], "at": 1, "effect": "1"}, "'effect'"),
            ("send", {"events": [MOVE], "at": 1, "effect_until": 2}, "'effect_until'"),
            (
                "send",
                {"events": [MOVE, MOVE], "at": 2, "effect": 2, "effect_until": 1},
                "'effect_until'",
            ),
            ("send", {"events": [MOVE], "at": 1, "effect_until": "1"}, "'effect_until'"),
            ("start", {"t": None}, "'t'"),
            ("stats", {"result": {"state": "init"}}, "'result.capacity_used'"),
            ("stats", {"result": {"state": 1, "capacity_used": 0}}, "'result.state'"),
            ("stats", {"result": {"state": "init", "capacity_used": -1}}, "capacity_used"),
            (
                "stats",
                {"result": {"state": "init", "capacity_used": 0, "by_state": []}},
                "'result.by_state'",
            ),
            ("terminate", {"result": {"handed_back": None}}, "'result.handed_back'"),
            ("release", {"result": "yes"}, "'result'"),
            ("reclaim", {"result": None}, "'result'"),
            ("hello", {"result": {"features": "all"}}, "'result.features'"),
        ],
    )
    def test_each_field_is_named(self, command: str, change: dict[str, Any], field: str) -> None:
        problem = shape_problem({"cmd": command}, {**GOOD, **change})
        assert problem is not None
        assert field in problem

    def test_the_protocols_own_shapes_pass(self) -> None:
        moved = {**GOOD, "events": [MOVE], "at": 1}
        assert shape_problem({"cmd": "start"}, moved) is None
        for effect in (0, 1):  # the events before the call took effect: up to `at`
            assert shape_problem({"cmd": "start"}, {**moved, "effect": effect}) is None
        ranged = {**moved, "ok": False, "error": "capacity_exceeded", "effect_until": 1}
        assert shape_problem({"cmd": "send"}, ranged) is None
        unplaced = {"ok": True, "events": [MOVE], "effect": 1}  # `at` absent: all of them
        assert shape_problem({"cmd": "start"}, unplaced) is None
        stats = {"state": "running", "capacity_used": 2, "by_state": {"ready": 2}}
        assert shape_problem({"cmd": "stats"}, {**GOOD, "result": stats}) is None
        failed = {"ok": False, "error": "queue_stopping", "events": []}
        assert shape_problem({"cmd": "send"}, failed) is None
        # Only state and capacity_used are required of stats; a failed call has none.
        assert shape_problem({"cmd": "stats"}, {**failed, "error": "other:X"}) is None


class _Canned:
    """A driver answering every command with the reference driver's empty answer,
    and ``invoke`` with an observation of an envelope never defined."""

    lines = 0
    last_line = ""

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        events: list[dict[str, Any]] = []
        if command["cmd"] == "hello":
            return {"ok": True, "result": {"features": []}, "events": []}
        if command["cmd"] == "start":
            events = [{"t": 0.0, "kind": "invoke", "env": "ghost", "plan": "ok"}]
        return {"ok": True, "result": None, "events": events}

    def close(self) -> None:
        """Nothing to end."""


def test_an_observation_of_an_unknown_envelope_is_a_protocol_violation() -> None:
    """Not a KeyError out of the oracle."""
    harness = Harness(_Canned())
    with pytest.raises(Violation, match="never defined: 'ghost'"):
        harness.start()


SCRIPT_OK = [
    {"cmd": "hello", "protocol": 1, "time_scale": 0.05},
    {"cmd": "queue", "workers": 1, "capacity": 0, "stop_mode": "drain", "wait": True},
    {"cmd": "define", "env": "e1", "spec": {"script": ["error"]}},
    {"cmd": "start"},
    {"cmd": "send", "envs": ["e1"]},
    {"cmd": "advance", "seconds": 1.0},
    {"cmd": "stats"},
]


def _lines(commands: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(c) + "\n" for c in commands)


#: Scripts ``--replay`` must refuse (exit 2, nothing sent), and what it says of each.
BAD_SCRIPTS = {
    "truncated": (_lines(SCRIPT_OK)[:-12], r":7: not JSON"),
    "unknown command": (_lines([*SCRIPT_OK, {"cmd": "explode"}]), r":8: unknown command 'explode'"),
    "define without spec": (
        _lines([*SCRIPT_OK[:2], {"cmd": "define", "env": "e1"}]),
        r":3: 'define' has no field 'spec'",
    ),
    "bad spec": (
        _lines([*SCRIPT_OK[:2], {"cmd": "define", "env": "e1", "spec": {"policy": "maybe"}}]),
        r":3: 'define': field 'spec': 'maybe' is not a valid Policy",
    ),
    "undefined envelope": (
        _lines([*SCRIPT_OK[:2], {"cmd": "send", "envs": ["e9"]}]),
        r":3: 'send': field 'envs' names 'e9', which no earlier 'define' defines",
    ),
    "bad plan": (
        _lines([*SCRIPT_OK[:3], {"cmd": "plan", "env": "e1", "plan": "explode"}]),
        r":4: 'plan': field 'plan' is 'explode', not one of",
    ),
    "infinite advance": (
        _lines(SCRIPT_OK[:2]) + '{"cmd": "advance", "seconds": Infinity}\n',
        r":3: 'advance': field 'seconds' is inf, not a finite number >= 0",
    ),
    "not an object": (_lines(SCRIPT_OK[:2]) + "[1, 2]\n", r":3: a command is a JSON object"),
    "empty": ("", r": no command to replay"),
    "only hello": (_lines(SCRIPT_OK[:1]) + "\n", r": no command to replay"),
}


class TestReplayCorpus:
    @pytest.mark.parametrize("name", sorted(BAD_SCRIPTS))
    def test_a_bad_script_is_bad_input(
        self, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        text, said = BAD_SCRIPTS[name]
        path = tmp_path / "script.jsonl"
        path.write_text(text)
        assert main(["--replay", str(path)]) == EXIT_DRIVER
        out = capsys.readouterr()
        assert re.search(re.escape(str(path)) + said, out.err), out.err
        assert "no violation" not in out.out
        assert "VIOLATION" not in out.out

    def test_a_missing_file_is_bad_input(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        missing = tmp_path / "nowhere.jsonl"
        assert main(["--replay", str(missing)]) == EXIT_DRIVER
        assert "nowhere.jsonl" in capsys.readouterr().err

    def test_a_good_script_replays(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        path = tmp_path / "script.jsonl"
        path.write_text(_lines(SCRIPT_OK))
        assert main(["--replay", str(path)]) == EXIT_PASS
        assert "no violation: 7 commands replayed" in capsys.readouterr().out

    def test_a_reproduced_violation_is_not_bad_input(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The same well-formed script against a faulty driver: status 1, not 2."""
        path = tmp_path / "script.jsonl"
        hang = {"cmd": "define", "env": "e1", "spec": {"script": ["hang"]}}
        send = {"cmd": "send", "envs": ["e1"]}
        stats = {"cmd": "stats"}
        path.write_text(_lines([*SCRIPT_OK[:2], hang, {"cmd": "start"}, send, send, stats]))
        assert main(["--replay", str(path), "--", *DRIVER]) == EXIT_PASS
        faulty = [sys.executable, str(Path(__file__).resolve().parent / "faulty_drivers.py")]
        assert main(["--replay", str(path), "--", *faulty, "double_count"]) == EXIT_VIOLATION
        assert "VIOLATION [I1]" in capsys.readouterr().out

    def test_a_driver_that_exits_during_a_replay(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Not a violation reproduced: status 2, the exit and the driver's stderr (its
        5th command is the script's define, after hello, reset, hello and queue)."""
        path = tmp_path / "script.jsonl"
        path.write_text(_lines(SCRIPT_OK))
        assert main(["--replay", str(path), "--", *BROKEN, "exit", "5"]) == EXIT_DRIVER
        err = capsys.readouterr().err
        assert "output ended during 'define'; it exited with status 3" in err
        assert "broken driver: exit at command 5 (define)" in err

    def test_a_release_of_nothing_hanging_is_bad_input(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Well formed, but the model has no hanging attempt to release: the script
        cannot be played (no AssertionError out of the oracle)."""
        path = tmp_path / "script.jsonl"
        path.write_text(_lines([*SCRIPT_OK, {"cmd": "release", "env": "e1", "plan": "ok"}]))
        assert main(["--replay", str(path)]) == EXIT_DRIVER
        assert "'e1' has no hanging attempt" in capsys.readouterr().err

    def test_load_script_keeps_the_commands(self) -> None:
        assert load_script(_lines(SCRIPT_OK)) == SCRIPT_OK
        with pytest.raises(ScriptError, match=r"^script:2: "):
            load_script(_lines(SCRIPT_OK[:1]) + "{\n")

    def test_a_bad_expectation_or_classification_file_is_bad_input(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """Read before the run starts: a typo costs no run."""
        assert main(["--expect", str(tmp_path / "none.txt")]) == EXIT_DRIVER
        assert "none.txt" in capsys.readouterr().err
        bad = tmp_path / "bad.json"
        bad.write_text("[1]")
        assert main(["--classify", str(bad)]) == EXIT_DRIVER
        assert "bad.json" in capsys.readouterr().err


class TestResponseLimit:
    def test_the_model_time_a_command_waits(self) -> None:
        assert model_wait({"cmd": "advance", "seconds": 60}) == 60
        assert model_wait({"cmd": "stop", "limit": 60.0, "mode": None}) == 60
        assert model_wait({"cmd": "send_wait", "timeout": 5, "limit": 60}) == 60
        assert model_wait({"cmd": "stats"}) == 0
        assert model_wait({"cmd": "advance", "seconds": float("inf")}) == 0

    @pytest.mark.parametrize(("clock", "extra"), [("virtual", 0.0), ("real", 120.0)])
    def test_the_limit_grows_with_the_scaled_wait(self, clock: str, extra: float) -> None:
        """On the real clock at scale 2, a 60-model-second blocking call may take two
        minutes more than the base limit; on a virtual clock no more."""
        driver = ProcessDriver([*DRIVER, "--clock", clock], timeout=7.0)
        try:
            driver.call({"cmd": "hello", "protocol": 1, "time_scale": 2.0})
            assert driver.time_limit({"cmd": "stop", "limit": 60.0}) == 7.0 + extra
            assert driver.time_limit({"cmd": "stats"}) == 7.0
        finally:
            driver.close()

    def test_a_correct_real_clock_driver_is_not_reported_hung(self) -> None:
        """Real-clock smoke test: ``advance`` of 12 model seconds at scale 0.5 takes
        6 real seconds, longer than the 5 s base limit, and is answered."""
        driver = ProcessDriver([*DRIVER, "--clock", "real"], timeout=5.0)
        try:
            driver.call({"cmd": "hello", "protocol": 1, "time_scale": 0.5})
            response = driver.call({"cmd": "advance", "seconds": 12})
        finally:
            driver.close()
        assert response["ok"] is True
        assert response["t"] >= 12

    @pytest.mark.parametrize(
        "args",
        [
            ["--response-timeout", "0"],
            ["--response-timeout", "-5"],
            ["--response-timeout", "nan"],
            ["--time-scale", "0"],
            ["--time-scale", "inf"],
            ["--examples", "0"],
        ],
    )
    def test_bad_numbers_are_refused(
        self, args: list[str], capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == EXIT_DRIVER
        assert args[0] in capsys.readouterr().err


class TestTransportArguments:
    @pytest.mark.parametrize("cls", [ProcessDriver, SharedProcess])
    @pytest.mark.parametrize(
        ("timeout", "error"),
        [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("60", TypeError)],
    )
    def test_a_bad_timeout_is_refused(
        self, cls: type[ProcessDriver | SharedProcess], timeout: Any, error: type[Exception]
    ) -> None:
        """Before any process is started."""
        with pytest.raises(error, match=r"timeout must .*got "):
            cls(["no-such-driver"], timeout=timeout)


class _CrashesAfterItsFault:
    """The reference driver with a double-counting fault, that fails for good once it
    has shown the fault once (as a port may crash on what follows its own bug)."""

    failed = False

    def __init__(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tests.conform.faulty_drivers import DoubleCount  # noqa: PLC0415

        self._driver = InProcessDriver(DoubleCount)

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if _CrashesAfterItsFault.failed:
            raise DriverCrashed(f"the driver's output ended during {command['cmd']!r}")
        response = self._driver.call(command)
        if command["cmd"] == "stats" and self._driver._session.phantom:
            _CrashesAfterItsFault.failed = True
        return response

    def close(self) -> None:
        self._driver.close()


def test_a_violation_seen_before_the_driver_failed_is_still_reported() -> None:
    """The run ends with the driver's failure, and the violation it found first is a
    finding all the same."""
    _CrashesAfterItsFault.failed = False
    result = run(_CrashesAfterItsFault, Options(examples=300, steps=30, derandomize=True))
    assert result.error is not None
    assert "output ended" in result.error
    [finding] = result.findings
    assert finding.key == "I1"
    assert finding.script[0]["cmd"] == "hello"
