"""A short chaos soak (``chaos.py``): node processes killed, paused past their leases,
cut off, their replies lost after the commit and the server restarted, while a producer
sends; then every envelope sent is found SUCCEEDED once, with a sound history and no
``on_success`` for a refused end. The 10-minute run is ``python tests/postgres/chaos.py``
(docs/postgres.md, *Faults*)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from envq.postgres._server import ServerUnavailable, ThrowawayServer

pytestmark = [pytest.mark.real_clock, pytest.mark.one_python]

pytest.importorskip("asyncpg")

#: Chaos seconds: long enough for every kind of fault, one restart among them.
SECONDS = 15.0


def test_a_short_chaos_soak_accounts_for_every_envelope(tmp_path: Path) -> None:
    from chaos import Soak  # noqa: PLC0415 - needs asyncpg

    server = ThrowawayServer()
    try:
        server.start()
    except ServerUnavailable as error:
        if os.environ.get("ENVQ_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"ENVQ_REQUIRE_POSTGRES=1, but {error}", pytrace=False)
        pytest.skip(f"PostgreSQL tests skipped: {error}")
    try:
        report = asyncio.run(Soak(server, tmp_path, seed=7).run(SECONDS))
    finally:
        server.stop()
    assert report["envelopes"] > 50, report
    # The chaos happened, and reached the database's history.
    assert report["actions"].get("restart", 0) >= 1, report
    assert sum(report["actions"].values()) >= 5, report
    assert report["expired"] > 0, report
    assert report["attempts"] > report["envelopes"], report
