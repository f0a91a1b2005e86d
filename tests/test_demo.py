"""The ``envq demo`` command: runs end to end on a real loop and tells the whole story."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envq.__main__ import main
from envq._demo import Demo, DemoOptions, Mail, run_demo

ROOT = Path(__file__).resolve().parent.parent


def _check_story(out: str) -> None:
    """The key moments the demo promises, by the stable markers it prints."""
    # Transient failures retried with backoff, and the retries working out.
    assert re.search(r"email/\d+ +RUNNING -> DELAYED +error: .+, retry in \d+\.\d\ds", out)
    assert re.search(r"delivered to \w+ \(attempt [2-9]", out)
    # The always-failing email ends FAILED when its attempts are used up; the hard
    # bounce ends FAILED at once and is reported to on_failure.
    assert re.search(r"email/1 +RUNNING -> FAILED +gave up after 4 attempts: MaxRetries", out)
    assert re.search(r"email/4 +RUNNING -> FAILED +no retry: DoNotRetry", out)
    assert "email/4       on_failure hook: bounce recorded" in out
    # The periodic collector runs.
    assert re.search(r"metrics/queue run 1 ok", out)
    # Backpressure and dedup.
    assert "send(email/8, email/9) refused: CapacityExceeded" in out
    assert "send_wait admitted email/8, email/9" in out
    assert "deduplicated (dedups 0 -> 1" in out
    # StopType blacklists the report type: the waiting report is stopped, sends refused.
    assert re.search(r"report/1 +RUNNING -> STOPPED +StopType: .+ blacklisted", out)
    assert re.search(r"report/2 +DELAYED -> STOPPED", out)
    assert "send(report/3) refused: TypeBlacklisted" in out
    # The mid-run stop parks envelopes and reports them; a send while stopped is refused.
    stop = out.index("* stop report: complete=True")
    parked = re.search(r"parked +\((\d+)\): (.+)", out[stop:])
    assert parked is not None
    assert int(parked.group(1)) >= 1
    assert "metrics/queue" in parked.group(2)
    assert "refused: QueueNotRunning" in out
    # The restart re-arms the parked envelopes.
    restart = re.search(r"queue demo +STOPPED -> RUNNING", out)
    assert restart is not None
    assert stop < restart.start()
    assert re.search(r"PARKED -> DELAYED +re-armed: due in", out[restart.start() :])
    # The end: final stop, terminate, statistics, and nothing lost.
    assert "* final stop report: complete=True" in out
    assert re.search(r"queue demo +STOPPED -> TERMINATED", out)
    assert "== final statistics ==" in out
    cap = re.search(r"capacity_used +0 of 12 after terminate \((\d+) before it = (\d+) handed", out)
    assert cap is not None
    assert cap.group(1) == cap.group(2)
    acc = re.search(
        r"accounted +(\d+) admitted = (\d+) succeeded \+ (\d+) failed \+ "
        r"(\d+) stopped \+ (\d+) returned",
        out,
    )
    assert acc is not None
    admitted, *ended = map(int, acc.groups())
    assert admitted == sum(ended) == 13
    assert re.search(r"outcomes +.*STOP_TYPE=1 +NO_RETRY=1", out)
    assert re.search(r"rejections +state=1 +blacklisted=1 +capacity=1", out)
    assert "PROBLEM" not in out
    assert out.rstrip().endswith("demo finished: every envelope accounted for")


def test_demo_subprocess_tells_the_whole_story() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "envq", "demo", "--duration", "2", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    _check_story(proc.stdout)
    lines = proc.stdout.splitlines()
    assert 30 <= len(lines) <= 120
    assert "\x1b" not in proc.stdout  # plain text, no colour
    stamped = [ln for ln in lines if ln.startswith("[")]
    assert all(re.match(r"\[ ?\d+\.\d\ds\] ", ln) for ln in stamped)


def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--duration", "1", "--seed", "11"]) == 0
    _check_story(capsys.readouterr().out)


def test_the_failure_plan_depends_on_the_seed_only() -> None:
    def plan(seed: int) -> list[tuple[object, int, str, bool]]:
        demo = Demo(DemoOptions(duration=2, seed=seed), sys.stdout)
        mails = [(e.id, e.payload) for e in demo.emails()]
        return [(i, m.failures, m.error, m.bounce) for i, m in mails if isinstance(m, Mail)]

    assert len(plan(3)) == 10
    assert plan(3) == plan(3)
    assert plan(3) != plan(4)
    for seed in range(20):
        failures = {email_id: f for email_id, f, _err, _bounce in plan(seed)}
        assert failures[1] == -1  # always fails
        assert any(f > 0 for f in failures.values())  # some transient failure to retry


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--duration", "0"],
        ["demo", "--duration", "nan"],
        ["demo", "--workers", "0"],
        ["demo", "--seed", "x"],
        ["nope"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


#: Runs ``envq demo --duration 20`` with Python's own SIGINT handler, even when this
#: test runs in a background job that ignores SIGINT (and would pass that on).
_CHILD = (
    "import runpy, signal, sys; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['envq', 'demo', '--duration', '20']; "
    "runpy.run_module('envq', run_name='__main__')"
)


def test_ctrl_c_stops_terminates_and_exits_130() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        assert proc.stdout is not None
        head: list[str] = []
        for line in proc.stdout:
            head.append(line)
            if "send_wait admitted" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    out = "".join(head) + rest
    assert proc.returncode == 130, out + err
    assert "send_wait admitted" in "".join(head)
    assert "* interrupted (Ctrl-C): stop(mode=StopMode.STOP, cancel=True)" in out
    assert re.search(r"queue demo +STOPPING -> STOPPED", out)
    assert "* stop report: complete=True" in out
    assert re.search(r"queue demo +STOPPED -> TERMINATED", out)
    cap = re.search(r"capacity_used +0 of 12 after terminate \((\d+) before it = (\d+) handed", out)
    assert cap is not None
    assert cap.group(1) == cap.group(2)
    assert "PROBLEM" not in out
    assert out.rstrip().endswith("demo interrupted: queue stopped and terminated cleanly")
    assert "Traceback" not in err


class _ClosingPipe(io.StringIO):
    """Stdout whose reader goes away after ``lines`` writes (``envq demo | head``)."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.left = lines

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)


@pytest.mark.parametrize("lines", [3, 12])
def test_a_closed_stdout_ends_the_demo_early_with_141(lines: int) -> None:
    out = _ClosingPipe(lines)
    started = time.monotonic()
    assert run_demo(DemoOptions(duration=10), out) == 141
    assert time.monotonic() - started < 5  # it did not run the remaining workload
    assert out.getvalue().count("\n") == lines
