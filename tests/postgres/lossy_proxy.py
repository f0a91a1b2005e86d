"""A TCP proxy in front of the throwaway server's Unix socket that can lose a reply.

``LossyProxy`` forwards PostgreSQL's wire protocol both ways and reads its messages
(a type byte and a length) enough to know which statement a client runs: a ``Parse``
names the statement's text, a ``Bind`` the statement it executes (asyncpg prepares a
statement once per session and binds it by name afterwards), a ``Query`` carries its
text. Armed with :meth:`LossyProxy.lose_reply`, the proxy holds back the reply of each
statement whose text holds the pattern until the server says it is ready for the next
one (``ReadyForQuery``: the statement has committed); if the reply returned rows, it is
dropped and both sides are cut (the client never hears of its committed statement),
else it is passed on and the proxy watches the next one.

The clients must connect without TLS (``sslmode=disable``): the proxy reads the
messages in the clear.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from pathlib import Path

__all__ = ["LossyProxy"]


class _Side:
    """One direction's message reader: whole messages out of the byte stream."""

    def __init__(self, *, startup: bool) -> None:
        self.buffer = b""
        #: The client's first message (the startup packet) has no type byte.
        self.startup = startup

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The whole messages ``(type, body)`` that ``data`` completes."""
        self.buffer += data
        out: list[tuple[bytes, bytes]] = []
        while True:
            if self.startup:
                if len(self.buffer) < 4:
                    return out
                (size,) = struct.unpack("!I", self.buffer[:4])
                if len(self.buffer) < size:
                    return out
                out.append((b"", self.buffer[4:size]))
                self.buffer = self.buffer[size:]
                self.startup = False
                continue
            if len(self.buffer) < 5:
                return out
            (size,) = struct.unpack("!I", self.buffer[1:5])
            if len(self.buffer) < 1 + size:
                return out
            out.append((self.buffer[:1], self.buffer[5 : 1 + size]))
            self.buffer = self.buffer[1 + size :]


class LossyProxy:
    """Listens on 127.0.0.1 (:attr:`port`), forwards to ``socket`` (the server's Unix
    socket file)."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.port = 0
        self._server: asyncio.Server | None = None
        self._pattern: bytes | None = None
        self._left = 0
        #: How many replies were lost so far.
        self.lost = 0
        #: The texts of the statements whose replies were lost.
        self.statements: list[str] = []
        self._lost_event = threading.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event

    def start(self) -> LossyProxy:
        """Serve on a thread of its own (the tests wait for node processes with blocking
        calls), until :meth:`close`."""
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop

            async def main() -> None:
                self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
                self.port = self._server.sockets[0].getsockname()[1]
                ready.set()
                await self._stopped.wait()
                self._server.close()
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

            self._stopped = asyncio.Event()
            loop.run_until_complete(main())
            loop.close()

        self._thread = threading.Thread(target=serve, name="lossy-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        return self

    def close(self) -> None:
        """Stop serving; every connection is cut."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(30)

    def dsn(self, database: str) -> str:
        """A DSN reaching ``database`` through the proxy."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}?sslmode=disable"

    def lose_reply(self, pattern: str, times: int = 1) -> None:
        """Lose the replies of the next ``times`` statements whose text holds
        ``pattern`` and that return rows (each after it committed)."""
        self._lost_event.clear()
        self._pattern = pattern.encode()
        self._left = times

    async def wait_lost(self, timeout: float = 60.0) -> None:  # noqa: ASYNC109
        """Until the armed replies are lost."""
        if not await asyncio.to_thread(self._lost_event.wait, timeout):
            raise TimeoutError(f"no reply was lost within {timeout} s")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_r, up_w = await asyncio.open_unix_connection(str(self.socket))
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        state = {"watch": False, "closed": False}
        state_text = [""]
        statements: dict[bytes, bytes] = {}

        def close_all() -> None:
            if not state["closed"]:
                state["closed"] = True
                writer.close()
                up_w.close()

        async def client_to_server() -> None:
            side = _Side(startup=True)
            while data := await reader.read(65536):
                for kind, body in side.feed(data):
                    text = self._watch(kind, body, statements)
                    if text is not None:
                        state["watch"] = True
                        state_text[0] = text
                up_w.write(data)
                await up_w.drain()
            close_all()

        async def server_to_client() -> None:
            side = _Side(startup=False)
            held = b""
            rows = False
            while data := await up_r.read(65536):
                messages = side.feed(data)
                if not state["watch"]:
                    writer.write(data)
                    await writer.drain()
                    continue
                # The reply of a statement that holds the pattern: held back until the
                # server is ready again (it has committed); lost if it returned rows.
                held += data
                rows = rows or any(kind == b"D" for kind, _ in messages)
                if not any(kind == b"Z" for kind, _ in messages):
                    continue
                if rows and self._left > 0:
                    self._left -= 1
                    self.lost += 1
                    self.statements.append(state_text[0])
                    close_all()
                    self._lost_event.set()
                    return
                writer.write(held)
                await writer.drain()
                held, rows, state["watch"] = b"", False, False
            close_all()

        try:
            await asyncio.gather(client_to_server(), server_to_client())
        except (OSError, asyncio.IncompleteReadError):
            close_all()
        finally:
            with contextlib.suppress(Exception):
                close_all()
            self._tasks.discard(task)

    def _watch(self, kind: bytes, body: bytes, statements: dict[bytes, bytes]) -> str | None:
        """Follow the statements a client runs: the text of one that holds the armed
        pattern (its reply is watched), else None."""
        text: bytes | None = None
        if kind == b"P":  # Parse: name, text
            name, _, rest = body.partition(b"\0")
            statements[name] = rest.partition(b"\0")[0]
        elif kind == b"B":  # Bind: portal, statement
            _portal, _, rest = body.partition(b"\0")
            text = statements.get(rest.partition(b"\0")[0])
        elif kind == b"Q":  # a simple query
            text = body.partition(b"\0")[0]
        if text is None or self._pattern is None or self._left <= 0:
            return None
        return text.decode(errors="replace") if self._pattern in text else None
