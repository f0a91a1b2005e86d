"""``python -m envq web``: serves every queue of a database on 127.0.0.1, the DSN from
``$ENVQ_DSN``; its password is never printed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest
import web_support as ws

import envq
from envq.postgres import PgQueue

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


def _env(**more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENVQ_DSN", "ENVQ_WEB"))}
    env.update(more)
    return env


async def _fill(dsn: str) -> None:
    async with PgQueue(dsn, "cli-mail", workers=0) as q:
        await q.install()
        await q.send(envq.Envelope(invoke=ws.quick, id="one"))


def test_serves_the_queues_of_the_database(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    ws.run_aside(_fill(dsn))
    proc = subprocess.Popen(
        [sys.executable, "-m", "envq", "web", "--port", "0"],
        env=_env(ENVQ_DSN=dsn),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.match(r"envq web: (http://127\.0\.0\.1:\d+/) \(read-only\)$", first.strip())
        assert found, first
        deadline = time.monotonic() + 60
        while True:
            try:
                page = httpx.get(found[1], timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert page.status_code == 200
        assert "cli-mail" in page.text
        assert ws.PASSWORD not in page.text
        api = httpx.get(found[1] + "api/counts", timeout=10).json()
        assert api["queues"]["cli-mail"]["counts"]["BUFFERED"] == 1
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert ws.PASSWORD not in first + out + err
    assert proc.returncode == 0, err[-2000:]


def test_without_a_database_it_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "envq", "web"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "give --dsn or set $ENVQ_DSN" in done.stderr


def test_a_short_token_is_refused_without_showing_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "envq", "web", "--dsn", "postgresql://u:pw-xyz@/db"],
        env=_env(ENVQ_WEB_TOKEN="short-secret"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "16 characters" in done.stderr
    assert "short-secret" not in done.stdout + done.stderr
    assert "pw-xyz" not in done.stdout + done.stderr
