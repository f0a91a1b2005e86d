"""The demo's live terminal view (rich, imported only when the view is used).

The narration scrolls in a panel under tables of the envelopes by state, the outcomes
and the throughput. The view is refreshed by a task on the demo's loop, so it reads the
queue on the loop's thread. When it ends (before the final stop, or on Ctrl-C) its last
frame stays on screen and the rest of the story is printed plainly below it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, TextIO

import envq
from envq import EnvState, Event, Outcome
from envq.demo.options import DemoOptions
from envq.demo.output import Output

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.live import Live

__all__ = ["LIVE_FPS", "LIVE_LINES", "LiveOutput"]

#: Refreshes of the live view per second, and how many narration lines it shows.
LIVE_FPS: Final = 8
LIVE_LINES: Final = 12


class LiveOutput(Output):
    """The narration inside a live view of the demo queue, drawn on ``console``."""

    def __init__(self, stream: TextIO, console: Console, options: DemoOptions) -> None:
        super().__init__(stream)
        self.console = console
        self.options = options
        self.queue: envq.Queue | None = None
        self.live: Live | None = None
        self.recent: collections.deque[str] = collections.deque(maxlen=LIVE_LINES)
        #: Loop times at which attempts ended, for the attempts-per-second rate.
        self.ended: collections.deque[float] = collections.deque()
        self.attempts = 0
        self.refresher: asyncio.Task[None] | None = None
        self.unsubscribe: Callable[[], None] | None = None

    def emit(self, text: str) -> None:
        """Into the view's narration panel while it is shown, else as the plain output."""
        if self.live is None:
            super().emit(text)
        elif text:
            self.recent.extend(text.rstrip("\n").split("\n"))

    def count(self, ev: Event) -> None:
        """Count ended attempts, for the throughput (a listener of the queue)."""
        if ev.from_state is EnvState.RUNNING:
            self.attempts += 1
            self.ended.append(ev.time)

    def start_view(self, queue: envq.Queue) -> None:
        """Start the live view of ``queue`` and its refresher task."""
        from rich.live import Live  # noqa: PLC0415 - rich is optional

        self.queue = queue
        self.unsubscribe = queue.subscribe(self.count)
        self.live = Live(
            self.render(queue),
            console=self.console,
            auto_refresh=False,
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.live.start(refresh=True)
        self.refresher = asyncio.create_task(self.refresh(queue))

    def end_view(self) -> None:
        """Stop refreshing; leave the last frame on screen."""
        task = self.refresher
        self.refresher = None
        if task is not None:
            task.cancel()
        if self.unsubscribe is not None:
            self.unsubscribe()
            self.unsubscribe = None
        live = self.live
        if live is None or self.queue is None:
            return
        with contextlib.suppress(Exception):
            live.update(self.render(self.queue), refresh=True)
        self.live = None
        live.stop()

    async def refresh(self, queue: envq.Queue) -> None:
        """Redraw the view :data:`LIVE_FPS` times a second."""
        while self.live is not None:
            self.live.update(self.render(queue), refresh=True)
            await asyncio.sleep(1 / LIVE_FPS)

    def rate(self) -> float:
        """Attempts ended per second over the last two seconds."""
        horizon = (self.loop.time() if self.loop is not None else 0.0) - 2.0
        while self.ended and self.ended[0] < horizon:
            self.ended.popleft()
        return len(self.ended) / 2.0

    def render(self, queue: envq.Queue) -> RenderableType:
        """One frame of the view of ``queue``."""
        from rich.console import Group  # noqa: PLC0415 - rich is optional
        from rich.panel import Panel  # noqa: PLC0415
        from rich.table import Table  # noqa: PLC0415
        from rich.text import Text  # noqa: PLC0415

        stats = queue.statistics()

        def table(title: str, head: str) -> Table:
            t = Table(
                title=title, title_justify="left", box=None, pad_edge=False, show_header=False
            )
            t.add_column(head)
            t.add_column("", justify="right")
            return t

        states = table("envelopes", "state")
        for state in EnvState:
            if state in stats.by_state:
                count = stats.by_state[state]
                states.add_row(state.name.lower(), Text(str(count), style="bold" if count else ""))
        outcomes = table("outcomes", "outcome")
        for outcome, count in stats.outcomes.items():
            colour = {
                Outcome.OK: "green",
                Outcome.ERROR: "red",
                Outcome.TIMEOUT: "yellow",
                Outcome.EXPIRED: "yellow",
            }
            outcomes.add_row(outcome.value, Text(str(count), style=colour.get(outcome, "")))
        flow = table("throughput", "")
        flow.add_row("attempts/s", f"{self.rate():.1f}")
        flow.add_row("attempts", str(self.attempts))
        flow.add_row("in flight", f"{stats.in_flight} of {self.options.workers} workers")
        flow.add_row("capacity", f"{stats.capacity_used} of {stats.capacity_limit}")
        flow.add_row("dedups", str(stats.dedups))
        flow.add_row("rejections", str(sum(stats.rejections.values())))
        flow.add_row("stuck threads", str(stats.stuck_threads))
        grid = Table.grid(padding=(0, 4))
        grid.add_row(states, outcomes, flow)
        title = (
            f"envq demo - queue {queue.name!r} {stats.state.name} - "
            f"{self.now():.1f}s of {self.options.duration:g}s"
        )
        lines = Text("\n".join(self.recent) or "...", no_wrap=True, overflow="ellipsis")
        return Panel(
            Group(grid, Text(""), Panel(lines, title="events", title_align="left")),
            title=title,
            title_align="left",
        )
