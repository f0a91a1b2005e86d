"""Where the demo's story is written, and how its lines look.

:class:`Output` stamps each line with the seconds since the demo started, marks the
driver's own calls with ``*``, and notices when the reader of the stream has gone. The
live view (:mod:`envq.demo.live`) is an :class:`Output` that draws instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, TextIO

from envq import Envelope, Queue

__all__ = ["Output", "error_text", "label", "labels"]


def label(env: Envelope) -> str:
    """``type/id`` without quotes, for the narration."""
    return f"{env.type}/{env.id}"


def labels(envs: Iterable[Envelope]) -> str:
    """The labels of ``envs`` joined with commas; ``-`` when there are none."""
    names = [label(env) for env in envs]
    return ", ".join(names) if names else "-"


def error_text(exc: BaseException | None) -> str:
    """``Type: message`` (``Type`` alone when the message is empty); ``-`` for None."""
    if exc is None:
        return "-"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Output:
    """The plain narration: lines written to ``stream`` and flushed one by one."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Loop time of the demo's start (see :meth:`start_clock`).
        self.t0 = 0.0
        #: The task to cancel when the reader has gone, and whether it has.
        self.task: asyncio.Task[Any] | None = None
        self.gone = False

    def start_clock(self) -> None:
        """Start counting the seconds of :meth:`now` on the running loop."""
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()

    def now(self) -> float:
        """Seconds since the demo started."""
        return self.loop.time() - self.t0 if self.loop is not None else 0.0

    def emit(self, text: str) -> None:
        """Write and flush; when the reader has gone (``envq demo | head``), stop the
        demo the way Ctrl-C does, silently."""
        if self.gone or not text:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except BrokenPipeError:
            self.gone = True
            if self.task is not None and not self.task.done():
                self.task.cancel()

    def line(self, text: str, at: float | None = None) -> None:
        """Print one timestamped line."""
        t = self.now() if at is None else at
        self.emit(f"[{t:5.2f}s] {text}\n")

    def say(self, text: str) -> None:
        """Print one of the driver's own actions."""
        self.line(f"* {text}")

    def more(self, text: str) -> None:
        """Print a continuation line (no timestamp)."""
        self.emit(f"          {text}\n")

    def plain(self, text: str = "") -> None:
        """Print a line as is."""
        self.emit(f"{text}\n")

    def start_view(self, queue: Queue) -> None:
        """Called once the header is printed, before ``queue`` starts (a live view of
        it starts here; plain output has none)."""

    def end_view(self) -> None:
        """Called before the final stop or after Ctrl-C (a live view ends here)."""
