"""Helpers of the dashboard's tests: databases, a server that goes away and comes
back, the app served by uvicorn in a thread, and jobs that wait for a gate.

The jobs are module functions so that a PgQueue can name them by import path
(``web_support:gated``); the nodes that run them live in the test's process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

import envq
from envq.postgres._server import ThrowawayServer
from envq.postgres.schema import render

_T = TypeVar("_T")
_names = itertools.count()

#: A password the DSNs carry (the throwaway server trusts every local user, so it is
#: never checked): no page, answer or output may show it.
PASSWORD = "s3cret-Pa55word"

#: Opened to let the gated jobs end (set from any thread).
GATE = threading.Event()

#: Where the browser tests' screenshots go (for docs/web.md).
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "assets"
#: How long a browser test waits for a page to change (ms): generous, nothing is timed.
LIMIT = 60_000


def shoot(page: Any, name: str) -> None:
    """A screenshot of the page for the docs, when asked for (``ENVQ_WEB_SCREENSHOTS=1``)."""
    if os.environ.get("ENVQ_WEB_SCREENSHOTS") == "1":
        page.screenshot(path=str(SHOTS / f"web-{name}.png"), full_page=True)


async def gated(env: envq.Envelope) -> None:
    """Runs until :data:`GATE` is set (a thread's event: the gate is opened from the
    test's thread, the job runs on a server's loop)."""
    while not GATE.is_set():  # noqa: ASYNC110 - a threading.Event, not an asyncio one
        await asyncio.sleep(0.05)


async def quick(env: envq.Envelope) -> None:
    """Ends at once."""


async def broken(env: envq.Envelope) -> None:
    """Fails."""
    raise RuntimeError("broken <b>on purpose</b>")


async def stopping(env: envq.Envelope) -> None:
    """Ends its envelope STOPPED."""
    raise envq.StopEnvelope


#: The ids of the envelopes :func:`flaky` fails (a test lets one through by removing it).
FAILING: set[object] = set()


async def flaky(env: envq.Envelope) -> None:
    """Fails, with markup in its message, while its id is in :data:`FAILING`."""
    if env.id in FAILING:
        raise ValueError(f"<i>{env.id}</i> is not ready yet")


def with_password(dsn: str) -> str:
    """``dsn`` with :data:`PASSWORD` as the user's password."""
    return dsn.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@", 1)


async def _create(server: ThrowawayServer, name: str) -> None:
    admin = await asyncpg.connect(server.dsn())
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(server.dsn(name))
    try:
        await conn.execute(render())
    finally:
        await conn.close()


def run_aside(coro: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run(coro)`` in a thread of its own: the caller's thread may have a
    loop running (a coroutine's, or Playwright's sync API's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result(120)


def fresh_database(server: ThrowawayServer) -> str:
    """A new database with envq's schema; its DSN, with :data:`PASSWORD`."""
    name = f"web{os.getpid()}_{next(_names)}"
    run_aside(_create(server, name))
    return with_password(server.dsn(name))


def _pg_ctl(server: ThrowawayServer, *args: str) -> None:
    prefix: tuple[str, ...] = ("runuser", "-u", "postgres", "--") if os.geteuid() == 0 else ()
    done = subprocess.run(
        [*prefix, str(server.bindir / "pg_ctl"), "-D", str(server.socket_dir / "data"), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def stop_server(server: ThrowawayServer) -> None:
    """Stop the server (every session cut), keeping its data: a fast shutdown, which
    writes what the server holds (with synchronous_commit off, an immediate one loses
    the last commits)."""
    _pg_ctl(server, "-m", "fast", "-w", "-t", "60", "stop")


def start_server(server: ThrowawayServer) -> None:
    """Start it again, as :meth:`ThrowawayServer.start` did."""
    options = [
        f"-c unix_socket_directories='{server.socket_dir}'",
        "-c listen_addresses=''",
        f"-p {urllib.parse.parse_qs(urllib.parse.urlsplit(server.dsn()).query)['port'][0]}",
        "-c fsync=off",
        "-c synchronous_commit=off",
        "-c full_page_writes=off",
    ]
    _pg_ctl(server, "-l", str(server.log_file), "-w", "-t", "60", "-o", " ".join(options), "start")


def wait_for(what: str, check: Callable[[], bool], limit: float = 60.0) -> None:
    """Wait (real time) until ``check()``; fail after ``limit`` seconds."""
    until = time.monotonic() + limit
    while not check():
        if time.monotonic() > until:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def wait_async(what: str, check: Callable[[], Awaitable[bool]], limit: float = 60.0) -> None:
    """:func:`wait_for` for an async ``check``."""
    loop = asyncio.get_running_loop()
    until = loop.time() + limit
    while not await check():
        if loop.time() > until:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Served:
    """An ASGI app served by uvicorn on 127.0.0.1 in a thread of its own, with its own
    event loop (the one ``setup`` runs on: a queue made there lives there)."""

    def __init__(self, setup: Callable[[], Awaitable[Any]]) -> None:
        self._setup = setup
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self._sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._main, name="web-served", daemon=True)

    def _main(self) -> None:
        import uvicorn  # noqa: PLC0415

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            try:
                app = await self._setup()
                self._server = uvicorn.Server(
                    uvicorn.Config(app, log_level="warning", access_log=False)
                )
            except BaseException as error:
                self._error = error
                self._ready.set()
                raise
            self._ready.set()
            await self._server.serve(sockets=[self._sock])

        asyncio.run(main())

    def call(self, make: Callable[[], Coroutine[Any, Any, _T]], timeout: float = 60) -> _T:
        """Run ``make()`` on the server's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result(timeout)

    def __enter__(self) -> Served:
        self._thread.start()
        self._ready.wait(60)
        if self._error is not None:
            raise self._error
        wait_for("the server to listen", lambda: bool(self._server and self._server.started))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(60)
        self._sock.close()


@contextmanager
def gate_closed() -> Iterator[threading.Event]:
    """:data:`GATE` closed for the block, open after it."""
    GATE.clear()
    try:
        yield GATE
    finally:
        GATE.set()
