"""``envq demo --postgres``: worker processes share a queue, one is killed, none lost."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_the_demo_loses_nothing_when_a_node_is_killed(pg_dsn: str) -> None:
    pytest.importorskip("asyncpg")
    env = dict(os.environ)
    env.pop("ENVQ_DSN", None)
    done = subprocess.run(
        [sys.executable, "-m", "envq", "demo", "--postgres", "--dsn", pg_dsn],
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
