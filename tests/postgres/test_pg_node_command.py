"""``python -m envq.postgres.node`` as an operator runs it: ``--metrics-port`` serves
the node's Prometheus metrics (the shared queue's counts and this node's attempts),
``--log-attempts`` logs a record per attempt, a bad port is a usage error."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from fault_support import Cluster

pytestmark = pytest.mark.real_clock

pytest.importorskip("prometheus_client")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode())


def test_a_node_serves_its_metrics_and_logs_its_attempts(cluster: Cluster, fault_dsn: str) -> None:
    import envq  # noqa: PLC0415
    from envq.postgres import PgQueue  # noqa: PLC0415

    (node,) = cluster.start(
        "watched", ["node-m"], options=["--metrics-port", "0", "--log-attempts"]
    )
    found = re.search(r"^metrics (http://\S+/metrics)$", node.stdout(), re.M)
    assert found, node.stdout()
    url = found.group(1)

    async def send() -> None:
        import fault_jobs  # noqa: PLC0415

        async with PgQueue(fault_dsn, "watched", workers=0) as queue:
            await queue.send(
                *(
                    envq.Envelope(
                        invoke=fault_jobs.work,
                        id=f"m{i}",
                        payload={"queue": "watched", "sleep": 0.0, "gate": False},
                    )
                    for i in range(3)
                )
            )

    asyncio.run(send())
    until = time.monotonic() + 60
    text = ""
    while time.monotonic() < until:
        text = _scrape(url)
        if re.search(r'^envq_envelopes\{name="watched",state="succeeded"\} 3\.0$', text, re.M):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the scrape never showed 3 succeeded:\n{text[-3000:]}")
    # This node's attempts: three ended OK.
    assert re.search(r'^envq_outcomes_total\{name="watched",outcome="ok"\} 3\.0$', text, re.M), (
        text[-3000:]
    )
    out = node.leave()
    assert "left node-m" in out
    logged = [line for line in node.stderr().splitlines() if "envq.stamp" in line]
    assert len(logged) == 3, node.stderr()[-3000:]
    assert all(" ok in " in line for line in logged), logged


def test_a_metrics_port_out_of_range_is_a_usage_error(fault_dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "envq.postgres.node", "--metrics-port", "70000"],
        env={"ENVQ_DSN": fault_dsn, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--metrics-port must be from 0 to 65535, not 70000" in done.stderr
    assert "postgres@" not in done.stderr
