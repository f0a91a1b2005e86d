"""Fixtures of the dashboard's tests (``envq.web``).

- ``web_pg``: a throwaway PostgreSQL server of these tests' own (they stop and start
  it to test a database that goes away), skipped where PostgreSQL is missing unless
  ``ENVQ_REQUIRE_POSTGRES=1``; ``web_db`` makes a fresh database with envq's schema.
- ``browser``: headless Chromium driven by Playwright, skipped with the reason where
  either is missing unless ``ENVQ_REQUIRE_BROWSER=1`` (CI), which makes it fail.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

from envq.postgres._server import ServerUnavailable, ThrowawayServer

#: The system's Chromium (Debian's ``chromium`` package), or ``$ENVQ_CHROMIUM``.
CHROMIUM = os.environ.get("ENVQ_CHROMIUM", "/usr/bin/chromium")
#: The flags a closed network and a root user need.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _no_postgres(reason: str) -> NoReturn:
    if os.environ.get("ENVQ_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"ENVQ_REQUIRE_POSTGRES=1, but {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL tests skipped: {reason}")


def _no_browser(reason: str) -> NoReturn:
    if os.environ.get("ENVQ_REQUIRE_BROWSER") == "1":
        pytest.fail(f"ENVQ_REQUIRE_BROWSER=1, but {reason}", pytrace=False)
    pytest.skip(f"browser tests skipped: {reason}")


@pytest.fixture(scope="session")
def web_pg() -> Iterator[ThrowawayServer]:
    """A running throwaway server of the web tests' own."""
    try:
        import asyncpg  # noqa: F401, PLC0415
    except ImportError:
        _no_postgres("asyncpg is not installed (pip install -e '.[postgres]')")
    try:
        server = ThrowawayServer()
        server.start()
    except ServerUnavailable as error:
        _no_postgres(str(error))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def web_db(web_pg: ThrowawayServer) -> Callable[[], str]:
    """Makes a fresh database with envq's schema; returns its DSN."""
    from web_support import fresh_database  # noqa: PLC0415

    return lambda: fresh_database(web_pg)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium (Playwright's sync API, the system's browser).

    Module-scoped: while Playwright's sync API is open, its event loop is the running
    loop of the main thread, and every later ``asyncio.run`` there (the async tests of
    other modules) would fail; it closes before another module's tests run."""
    try:
        from playwright.sync_api import Error, sync_playwright  # noqa: PLC0415
    except ImportError:
        _no_browser("playwright is not installed (pip install -e '.[dev]')")
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        _no_browser(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        try:
            chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        except Error as error:
            _no_browser(f"Chromium did not start: {str(error)[:300]}")
        try:
            yield chromium
        finally:
            chromium.close()
