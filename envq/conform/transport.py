"""How the harness talks to a driver: a child process speaking JSON lines, or envq's
reference driver in-process (the same messages, without the pipes)."""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from envq.driver import answer

__all__ = ["Driver", "DriverCrashed", "InProcessDriver", "ProcessDriver", "SharedProcess"]


class DriverCrashed(RuntimeError):
    """The driver exited, broke the protocol, or did not answer in time."""


class Driver(Protocol):
    """One driver session: send a command, get its response."""

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send ``command``; its response (``ok``, ``result``/``error``, ``events``)."""
        ...

    def close(self) -> None:
        """End the session (``quit``)."""
        ...


class ProcessDriver:
    """A driver program: ``argv`` started once; one JSON object per line each way.

    :param timeout: real seconds a response may take before the driver counts as hung.
    """

    def __init__(self, argv: Sequence[str], timeout: float = 60.0) -> None:
        self.argv = list(argv)
        self.timeout = timeout
        try:
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        except OSError as exc:
            raise DriverCrashed(f"cannot start driver {self.argv}: {exc}") from exc
        self._stderr: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        self._readers = [
            threading.Thread(target=target, daemon=True)
            for target in (self._read_stderr, self._read_stdout)
        ]
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # the end of the output

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-50]

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one command, read one response line."""
        proc = self._proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise DriverCrashed(self._why(f"could not send {command.get('cmd')!r}: {exc}")) from exc
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            proc.kill()
            why = f"no answer to {command.get('cmd')!r} in {self.timeout} s"
            raise DriverCrashed(self._why(why)) from None
        if not line:
            raise DriverCrashed(self._why(f"driver exited during {command.get('cmd')!r}"))
        try:
            response = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DriverCrashed(self._why(f"not JSON: {line[:200]!r}")) from exc
        if not isinstance(response, dict):
            raise DriverCrashed(self._why(f"not an object: {line[:200]!r}"))
        return response

    def _why(self, message: str) -> str:
        tail = "".join(self._stderr[-10:]).rstrip()
        return message + (f"\n--- driver stderr ---\n{tail}" if tail else "")

    def close(self) -> None:
        """``quit``, then wait for the process (killed if it lingers) and close its
        pipes."""
        proc = self._proc
        if proc.poll() is None:
            with contextlib.suppress(DriverCrashed):
                self.call({"cmd": "quit"})
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(5)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class InProcessDriver:
    """A driver object in this process (envq's :class:`envq.driver.Session` or a
    variant of it): the harness's messages round-trip through JSON all the same, so the
    in-process and the piped reference driver answer alike."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._session = make()

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Hand the command to the session, as the driver process would."""
        response, _ = answer(self._session, json.dumps(command))
        return json.loads(json.dumps(response))  # type: ignore[no-any-return]

    def close(self) -> None:
        """End the session."""
        self._session.handle({"cmd": "quit"})


class SharedProcess:
    """One driver process for a whole run: each session begins with ``reset`` (a
    driver starts in a fresh session, so the first does not need one), and only
    :meth:`shutdown` ends the process. Starting an interpreter per example would cost
    more than the example."""

    def __init__(self, argv: Sequence[str], timeout: float = 60.0) -> None:
        self.argv = list(argv)
        self.timeout = timeout
        self._process: ProcessDriver | None = None
        self._used = False

    def connect(self) -> Driver:
        """A session on the shared process (a new process if the last one died)."""
        process = self._process
        if process is None or process._proc.poll() is not None:
            if process is not None:
                process.close()
            process = self._process = ProcessDriver(self.argv, self.timeout)
            self._used = False
        elif self._used:
            response = process.call({"cmd": "reset"})
            if not response.get("ok"):
                raise DriverCrashed(f"reset answered {response}")
        self._used = True
        return _Session(process)

    def shutdown(self) -> None:
        """End the process (``quit``)."""
        if self._process is not None:
            self._process.close()
            self._process = None


class _Session:
    """A session on a shared driver process: closing it leaves the process running."""

    def __init__(self, process: ProcessDriver) -> None:
        self._process = process

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one command to the shared process."""
        return self._process.call(command)

    def close(self) -> None:
        """Nothing: the next session resets the process."""
