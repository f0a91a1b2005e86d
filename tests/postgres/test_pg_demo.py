"""``envq demo --postgres``: worker processes share a queue, one is killed, none lost."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request

import pytest


def test_the_demo_loses_nothing_when_a_node_is_killed(pg_dsn: str) -> None:
    pytest.importorskip("asyncpg")
    env = dict(os.environ)
    env.pop("ENVQ_DSN", None)
    done = subprocess.run(
        [sys.executable, "-m", "envq", "demo", "--postgres", "--dsn", pg_dsn, "--envelopes", "100"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "killed node-1 with SIGKILL while it held" in out
    assert "node-1: killed" in out
    assert ", 0 lost" in out
    # The killed node's leases were reaped by the others.
    reaped = sum(
        int(line.rsplit("'reaped': ", 1)[1].rstrip("}"))
        for line in out.splitlines()
        if "left node-" in line
    )
    assert reaped >= 1, out
    # The password of a DSN never shows.
    assert pg_dsn not in out


def test_the_demo_serves_its_dashboard_while_it_runs(pg_dsn: str) -> None:
    """``--web 0``: the dashboard of the demo's database answers while the demo runs,
    showing its queue, and the demo still loses nothing (stdin closed: no wait)."""
    pytest.importorskip("asyncpg")
    pytest.importorskip("starlette")
    env = dict(os.environ)
    env.pop("ENVQ_DSN", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "envq",
            "demo",
            "--postgres",
            "--dsn",
            pg_dsn,
            "--web",
            "0",
            "--envelopes",
            "40",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        url = None
        page = ""
        for line in proc.stdout:
            lines.append(line)
            found = re.search(r"dashboard: (http://\S+/)", line)
            if found:
                url = found.group(1)
            if "sent 40 envelopes" in line:
                assert url is not None, "".join(lines)
                with urllib.request.urlopen(url, timeout=30) as answer:
                    page = answer.read().decode()
                break
        for line in proc.stdout:
            lines.append(line)
        assert proc.wait(120) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    out = "".join(lines)
    assert "envq-demo" in page, page[:2000]
    assert ", 0 lost" in out
    assert pg_dsn not in out


@pytest.mark.parametrize("given", ["5", "100001", "many", "0"])
def test_a_bad_envelope_count_is_refused_naming_the_option(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from envq.__main__ import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as exited:
        main(["demo", "--postgres", "--envelopes", given])
    assert exited.value.code == 2
    assert "--envelopes" in capsys.readouterr().err
