"""``envq conform`` against the PostgreSQL driver (three PgQueue nodes, one database).

A short real-clock run of the conformance machine: every move the driver reports is
read back from the database's journal and checked against the model. The run fails
(exit status 1) on any violation that is not a declared divergence, and (2) when the
driver crashes or breaks the protocol.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from envq.postgres._server import ThrowawayServer

#: A small run: a few examples, on a time scale whose timing tolerance (a quarter of
#: a model second, 50 ms) covers the nodes' polling.
ARGS = ("--examples", "3", "--steps", "20", "--time-scale", "0.2", "--derandomize")


def _conform(dsn: str, tmp_path: Path, *driver_args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "envq",
        "conform",
        *ARGS,
        "--no-shrink",
        "--save",
        str(tmp_path / "failures"),
        "--",
        sys.executable,
        "-m",
        "envq.postgres.driver",
        "--nodes",
        "3",
        "--dsn",
        dsn,
        *driver_args,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=170, env=env, check=False
    )


def test_the_postgres_driver_conforms(pg_server: ThrowawayServer, tmp_path: Path) -> None:
    done = _conform(pg_server.dsn(), tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "VIOLATION" not in done.stdout
