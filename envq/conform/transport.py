"""How the harness talks to a driver: a child process speaking JSON lines, or envq's
reference driver in-process (the same messages, without the pipes)."""

from __future__ import annotations

import contextlib
import json
import math
import queue
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NoReturn, Protocol

from envq.driver import answer

__all__ = [
    "Driver",
    "DriverCrashed",
    "InProcessDriver",
    "ProcessDriver",
    "ProtocolError",
    "SharedProcess",
    "model_wait",
]


class DriverCrashed(RuntimeError):
    """The driver exited, broke the protocol, or did not answer in time."""


class ProtocolError(DriverCrashed):
    """The driver answered with valid JSON of the wrong shape (a field missing, of the
    wrong type, or a name the protocol does not know)."""


class Driver(Protocol):
    """One driver session: send a command, get its response."""

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send ``command``; its response (``ok``, ``result``/``error``, ``events``)."""
        ...

    def close(self) -> None:
        """End the session (``quit``)."""
        ...


#: The command fields that ask the driver to let model time pass: ``advance``'s
#: ``seconds``, a blocking call's ``limit``, ``send_wait``'s ``timeout``.
WAITING_FIELDS: Final = ("seconds", "limit", "timeout")


def model_wait(command: Mapping[str, Any]) -> float:
    """The most model seconds ``command`` may make the driver wait (0 if none)."""
    longest = 0.0
    for field in WAITING_FIELDS:
        value = command.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            longest = max(longest, float(value))
    return longest


def _timeout(timeout: object) -> float:
    """``timeout`` checked: a finite number of seconds > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be finite and > 0, got {timeout!r}")
    return float(timeout)


class ProcessDriver:
    """A driver program: ``argv`` started once; one JSON object per line each way.

    :param timeout: real seconds any answer may take, beyond the time the command asks
        the driver to let pass; after that the driver counts as hung and is killed.
        A real-clock driver (its ``hello`` says so) is given, on top, the model seconds
        a command may wait (``advance``'s ``seconds``, a blocking call's ``limit``)
        times the ``time_scale`` sent in ``hello``.

    Once the driver's output has ended (it exited, was killed, or closed stdout) or it
    broke the protocol, every further call fails at once with the same explanation.
    """

    def __init__(self, argv: Sequence[str], timeout: float = 60.0) -> None:
        self.argv = list(argv)
        self.timeout = _timeout(timeout)
        #: Real seconds per model second; 0 until ``hello`` says the clock is real.
        self.scale = 0.0
        #: How many lines the driver has written, and the last one.
        self.lines = 0
        self.last_line = ""
        #: Why the driver can no longer be used, once it cannot.
        self.ended: str | None = None
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
        with contextlib.suppress(OSError, ValueError):
            for line in self._proc.stdout:
                self._lines.put(line)
        self._lines.put("")  # the end of the output

    def _read_stderr(self) -> None:
        assert self._proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self._proc.stderr:
                self._stderr.append(line)
                del self._stderr[:-50]

    @property
    def alive(self) -> bool:
        """Whether the driver can still be sent commands."""
        return self.ended is None and self._proc.poll() is None

    def time_limit(self, command: Mapping[str, Any]) -> float:
        """Real seconds the answer to ``command`` may take."""
        return self.timeout + model_wait(command) * self.scale

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one command, read one response line."""
        name = command.get("cmd")
        if self.ended is not None:
            raise DriverCrashed(f"cannot send {name!r}: {self.ended}")
        proc = self._proc
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            self._end(f"the driver stopped reading its input during {name!r} ({exc})")
        limit = self.time_limit(command)
        try:
            line = self._lines.get(timeout=limit)
        except queue.Empty:
            proc.kill()
            self._end(f"the driver did not answer {name!r} in {limit:g} s (it was killed)")
        if not line:
            self._end(f"the driver's output ended during {name!r}")
        self.lines += 1
        self.last_line = line.rstrip("\n")
        where = f"line {self.lines} of the driver's output: {self.last_line[:200]!r}"
        try:
            response = json.loads(line)
        except json.JSONDecodeError:
            proc.kill()
            self._end(f"the answer to {name!r} is not JSON ({where})")
        if not isinstance(response, dict):
            proc.kill()
            self._end(f"the answer to {name!r} is not a JSON object ({where})")
        if name == "hello" and isinstance(response.get("result"), dict):
            scale = command.get("time_scale")
            real = response["result"].get("clock") == "real"
            if real and isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0:
                self.scale = float(scale)
        return response

    def _end(self, why: str) -> NoReturn:
        """The driver can no longer be used: say why (its exit status and the end of its
        stderr, once it has written them) and raise."""
        proc = self._proc
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(ENDING)
        status = proc.poll()
        if status is not None:
            self._readers[0].join(ENDING)  # the rest of its stderr
            why += f"; it exited with status {status}" if status >= 0 else ""
            why += f"; it was killed by signal {-status}" if status < 0 else ""
        self.ended = self._why(why)
        raise DriverCrashed(self.ended)

    def _why(self, message: str) -> str:
        tail = "".join(self._stderr[-10:]).rstrip()
        return message + (f"\n--- driver stderr ---\n{tail}" if tail else "")

    def close(self) -> None:
        """``quit``, then wait for the process (killed if it lingers) and close its
        pipes. A driver whose output has ended is not sent ``quit``."""
        proc = self._proc
        if self.alive:
            with contextlib.suppress(DriverCrashed):
                self.call({"cmd": "quit"})
        if self.ended is not None and proc.poll() is None:
            proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()
        for reader in self._readers:
            reader.join(5)


#: Real seconds to wait for a driver whose output ended to exit (and finish its stderr).
ENDING: Final = 2.0


class InProcessDriver:
    """A driver object in this process (envq's :class:`envq.driver.Session` or a
    variant of it): the harness's messages round-trip through JSON all the same, so the
    in-process and the piped reference driver answer alike."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._session = make()
        #: How many responses the session has given, and the last one as a JSON line.
        self.lines = 0
        self.last_line = ""

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Hand the command to the session, as the driver process would."""
        response, _ = answer(self._session, json.dumps(command))
        self.lines += 1
        self.last_line = json.dumps(response)
        return json.loads(self.last_line)  # type: ignore[no-any-return]

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
        self.timeout = _timeout(timeout)
        self._process: ProcessDriver | None = None
        self._used = False

    def connect(self) -> Driver:
        """A session on the shared process (a new process if the last one died)."""
        process = self._process
        if process is None or not process.alive:
            if process is not None:
                process.close()
            process = self._process = ProcessDriver(self.argv, self.timeout)
            self._used = False
        elif self._used:
            response = process.call({"cmd": "reset"})
            if response.get("ok") is not True:
                # With the driver's last words: a reset that fails is the end of an
                # example the harness had no more to say about.
                raise DriverCrashed(process._why(f"reset answered {process.last_line[:600]}"))
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

    @property
    def lines(self) -> int:
        """How many lines the driver process has written."""
        return self._process.lines

    @property
    def last_line(self) -> str:
        """The last line the driver process wrote."""
        return self._process.last_line

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one command to the shared process."""
        return self._process.call(command)

    def close(self) -> None:
        """Nothing: the next session resets the process."""
