"""The ``envq demo`` command: runs end to end on a real loop and tells the whole story."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import envq
from envq.__main__ import main
from envq.demo import DemoOptions, run_demo
from envq.demo import run as demo_run
from envq.demo.narration import Narrator
from envq.demo.output import Output
from envq.demo.scenario import Scenario
from envq.demo.workload import Mail

ROOT = Path(__file__).resolve().parents[2]


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The rest of a child's stdout and its stderr once it exits. Not
    ``communicate()``: after iterating ``proc.stdout`` it reads the pipes' descriptors
    directly, and the lines the iteration had already buffered are lost (a story line
    went missing that way on a loaded machine)."""
    assert proc.stdout is not None
    assert proc.stderr is not None
    errors: list[str] = []
    stderr = proc.stderr
    reader = threading.Thread(target=lambda: errors.append(stderr.read()))
    reader.start()
    rest = proc.stdout.read()
    reader.join(60)
    proc.wait(timeout=60)
    return rest, "".join(errors)


def _check_story(out: str) -> None:
    """The key moments the demo promises; a miss shows the whole story (pytest would
    shorten it), since a real-clock run cannot be replayed."""
    try:
        _story_markers(out)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- the demo printed ---\n{out}") from None


def _story_markers(out: str) -> None:
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
    assert re.search(r"report/21 +RUNNING -> STOPPED +StopType: .+ blacklisted", out)
    assert re.search(r"report/22 +DELAYED -> STOPPED", out)
    assert "send(report/23) refused: TypeBlacklisted" in out
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
        scenario = Scenario(DemoOptions(duration=2, seed=seed), Output(sys.stdout))
        mails = [(e.id, e.payload) for e in scenario.work.emails()]
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
        rest, err = _finish(proc)
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


# ------------------------------------------------------------------------------------
# --metrics-port
# ------------------------------------------------------------------------------------


def _scrape(url: str) -> dict[str, float]:
    """``sample{labels}`` → value, from a real HTTP GET of the endpoint."""
    assert url.startswith("http://127.0.0.1:")  # loopback only
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_port_serves_the_demo_queue() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "envq", "demo", "--duration", "3", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    with proc:
        assert proc.stdout is not None
        head: list[str] = []
        url = ""
        for line in proc.stdout:
            head.append(line)
            if line.startswith("metrics: "):
                url = line.split()[1]
            if "send_wait admitted" in line:
                break
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", url), head
        samples = _scrape(url)
        rest, err = _finish(proc)
    assert proc.returncode == 0, "".join(head) + rest + err
    assert samples['workqueue_adds_total{name="demo"}'] >= 8
    assert samples['envq_capacity_limit{name="demo"}'] == 12
    assert samples['envq_dedups_total{name="demo"}'] == 1
    assert samples['envq_rejections_total{name="demo",reason="capacity"}'] == 1
    assert samples['envq_queue_state{name="demo",state="running"}'] == 1
    assert 'workqueue_work_duration_seconds_bucket{le="+Inf",name="demo"}' in samples
    _check_story("".join(head) + rest)
    with pytest.raises(urllib.error.URLError):  # the endpoint is gone with the demo
        _scrape(url)


def test_metrics_port_in_use_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run_demo(DemoOptions(duration=1, metrics_port=port), io.StringIO()) == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["-1", "65536", "x"])
def test_bad_metrics_port_exits_2(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--metrics-port", port])
    assert info.value.code == 2
    assert "--metrics-port" in capsys.readouterr().err


# ------------------------------------------------------------------------------------
# The live view
# ------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_live_view_forced_into_a_stream() -> None:
    # A real-clock run: three seconds leave the scenario's timed steps a margin on a
    # loaded machine (one second once missed the blacklist's deadline in CI).
    out = io.StringIO()
    assert run_demo(DemoOptions(duration=3, seed=5, live=True), out) == 0
    text = out.getvalue()
    assert "\x1b[" in text  # drawn for a terminal
    plain = _ANSI.sub("", text)
    assert "envq demo - queue 'demo'" in plain
    for title in ("envelopes", "outcomes", "throughput", "events", "attempts/s"):
        assert title in plain
    # The narration scrolled inside the view; the end is printed plainly below it.
    assert re.search(r"│ .*queue demo +INIT -> RUNNING", plain)
    tail = plain[plain.rindex("╯") :]
    assert "* stop() (DRAIN)" in tail
    assert "== final statistics ==" in tail
    assert re.search(r"accounted +13 admitted = ", tail)
    assert tail.rstrip().endswith("demo finished: every envelope accounted for")


def test_plain_flag_wins_over_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(out, "isatty", lambda: True)
    assert main_with(["demo", "--duration", "1", "--plain"], out) == 0
    assert "\x1b" not in out.getvalue()
    _check_story(out.getvalue())


def test_live_without_rich_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)
    monkeypatch.setattr(demo_run, "_has", lambda module: module != "rich")
    assert run_demo(DemoOptions(duration=1, live=True), io.StringIO()) == 2
    assert "needs rich" in capsys.readouterr().err


def main_with(argv: list[str], out: io.StringIO) -> int:
    """``main(argv)`` with ``out`` as stdout."""
    saved = sys.stdout
    sys.stdout = out
    try:
        return main(argv)
    finally:
        sys.stdout = saved


def _run_in_pty(argv: list[str], interrupt_after: str | None = None) -> tuple[int, str]:
    """Run ``python -m envq ARGV`` with a pseudo-terminal as stdout; optionally send
    SIGINT once ``interrupt_after`` has been drawn. Returns (exit code, output)."""
    pty = pytest.importorskip("pty")
    primary, secondary = pty.openpty()
    child = (
        "import runpy, signal, sys; "
        "signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = {['envq', *argv]!r}; "
        "runpy.run_module('envq', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdout=secondary,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "100", "LINES": "40", "TERM": "xterm-256color"},
    )
    os.close(secondary)
    chunks: list[bytes] = []
    sent = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.1)
            if ready:
                try:
                    data = os.read(primary, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            if interrupt_after and not sent:
                seen = _ANSI.sub("", b"".join(chunks).decode(errors="replace"))
                if interrupt_after in seen:
                    proc.send_signal(signal.SIGINT)
                    sent = True
            if proc.poll() is not None and not ready:
                break
        code = proc.wait(timeout=30)
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        proc.stderr.close()
    assert "Traceback" not in err, err
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_live_view_on_a_terminal() -> None:
    code, out = _run_in_pty(["demo", "--duration", "1.5", "--seed", "2"])
    assert code == 0, out
    assert "\x1b[" in out
    plain = _ANSI.sub("", out)
    assert "throughput" in plain
    assert "demo finished: every envelope accounted for" in plain


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_live_view_ctrl_c_prints_the_stop_report() -> None:
    code, out = _run_in_pty(["demo", "--duration", "20"], interrupt_after="send_wait admitted")
    plain = _ANSI.sub("", out)
    assert code == 130, plain
    tail = plain[plain.rindex("╯") :]
    assert "* interrupted (Ctrl-C): stop(mode=StopMode.STOP, cancel=True)" in tail
    assert "* stop report: complete=True" in tail
    assert "demo interrupted: queue stopped and terminated cleanly" in tail


def test_narrator_tells_an_expired_lease() -> None:
    """An attempt whose lease expired (only a store shared by several processes tells
    it) is narrated as such, with the Retry policy's delay when it is retried."""
    stream = io.StringIO()
    narrator = Narrator(Output(stream))

    async def invoke(env: envq.Envelope) -> None:
        return None

    env = envq.Envelope(invoke=invoke, id=7, type="email", retry=envq.Retry(base=2, jitter=False))
    es = envq.EnvState
    for t, frm, to, outcome in [
        (0.0, es.NEW, es.READY, None),
        (0.0, es.READY, es.RUNNING, None),
        (3.0, es.RUNNING, es.DELAYED, envq.Outcome.EXPIRED),
    ]:
        narrator.on_event(envq.Event(t, "q", env, frm, to, outcome))
    out = stream.getvalue()
    assert re.search(r"email/7 +RUNNING -> DELAYED +lease expired before the attempt ended", out)
    assert "(attempt 1), retry in 2.00s" in out
