"""A throwaway PostgreSQL server for the tests of ``envq.postgres``.

The server (``initdb`` + ``pg_ctl`` in a temporary directory, a Unix socket inside
it, see ``envq.postgres._server``) starts once per session, when the first test that
needs it runs, and is removed at the end. Where PostgreSQL or the driver is missing,
those tests skip with the reason, unless ``ENVQ_REQUIRE_POSTGRES=1`` (CI sets it after
installing Debian's ``postgresql``), in which case they fail. The tests that need no
server (the generated SQL's text) run everywhere.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest

from envq.postgres._server import ServerUnavailable, ThrowawayServer

if TYPE_CHECKING:
    from fault_support import Cluster

#: The database the schema is applied to once per session.
SCHEMA_DB = "envq_schema"


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("ENVQ_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"ENVQ_REQUIRE_POSTGRES=1, but {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL tests skipped: {reason}")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[ThrowawayServer]:
    """A running throwaway server (skips, or fails under ENVQ_REQUIRE_POSTGRES=1,
    when it cannot start)."""
    try:
        import asyncpg  # noqa: F401, PLC0415 - only the server tests need the driver
    except ImportError:
        _unavailable("asyncpg is not installed (pip install -e '.[postgres]')")
    try:
        server = ThrowawayServer()
        server.start()
    except ServerUnavailable as error:
        _unavailable(str(error))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_dsn(pg_server: ThrowawayServer) -> str:
    """The DSN of a database holding the generated schema (tests roll back what they do)."""
    from pg_support import create_database  # noqa: PLC0415 - needs asyncpg

    asyncio.run(create_database(pg_server, SCHEMA_DB))
    return pg_server.dsn(SCHEMA_DB)


@pytest.fixture
def fault_dsn(pg_server: ThrowawayServer) -> str:
    """A database of this test's own, with the history tables of the fault tests
    (``fault_support``)."""
    from fault_support import create_fault_database  # noqa: PLC0415 - needs asyncpg

    return asyncio.run(create_fault_database(pg_server))


@pytest.fixture
def cluster(fault_dsn: str, tmp_path: Path) -> Iterator[Cluster]:
    """The test's node processes (``python -m envq.postgres.node``); all killed at
    the end."""
    from fault_support import Cluster  # noqa: PLC0415

    nodes = Cluster(fault_dsn, tmp_path)
    try:
        yield nodes
    finally:
        nodes.close()
