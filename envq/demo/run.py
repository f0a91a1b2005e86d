"""Running the demo as a program: :func:`run_demo` and its exit codes.

It picks the plain narration or the live view, serves the metrics when asked, runs the
:class:`~envq.demo.scenario.Scenario` on a fresh event loop, and turns Ctrl-C and a
closed stdout into a clean stop and the exit codes shells expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Final, TextIO

import envq
from envq.demo.live import LiveOutput
from envq.demo.options import DemoOptions
from envq.demo.output import Output
from envq.demo.scenario import Scenario

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry
    from rich.console import Console

__all__ = ["EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "EXIT_USAGE", "run_demo"]

#: Exit code after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED: Final = 130
#: Exit code when stdout's reader went away (128 + SIGPIPE), as shells report it.
EXIT_BROKEN_PIPE: Final = 141
#: Exit code when an option cannot be honoured (a missing extra, a port in use).
EXIT_USAGE: Final = 2


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


async def _run(
    options: DemoOptions,
    stream: TextIO,
    *,
    console: Console | None = None,
    registry: CollectorRegistry | None = None,
    metrics_url: str = "",
) -> tuple[int, bool]:
    """Run the scenario, and the Ctrl-C path when it is cancelled; return the exit code
    and whether the reader of ``stream`` went away."""
    out = Output(stream) if console is None else LiveOutput(stream, console, options)
    scenario = Scenario(options, out, registry, metrics_url)
    task = out.task = asyncio.current_task()
    try:
        try:
            return await scenario.run(), out.gone
        except asyncio.CancelledError:
            # asyncio.run turns the first Ctrl-C into a cancel of this task; a closed
            # stdout does the same (see Output.emit).
            if task is None or not task.cancelling():
                raise
            task.uncancel()
            await scenario.interrupted()
            return (EXIT_BROKEN_PIPE if out.gone else EXIT_INTERRUPTED), out.gone
    finally:
        scenario.close()


def _fail(message: str) -> int:
    with contextlib.suppress(OSError):
        sys.stderr.write(f"envq demo: {message}\n")
    return EXIT_USAGE


def run_demo(options: DemoOptions | None = None, out: TextIO | None = None) -> int:
    """Run the demo on a fresh event loop; return the process exit code.

    0 on success, 1 if a check failed (printed as ``PROBLEM:``), 2 if an option cannot
    be honoured (``rich`` or ``prometheus_client`` missing, the metrics port taken),
    130 after Ctrl-C, 141 when the reader of the output went away
    (``envq demo | head``).
    """
    options = options or DemoOptions()
    stream = sys.stdout if out is None else out
    live = options.live
    if live is None:
        live = _isatty(stream) and _has("rich")
    elif live and not _has("rich"):
        return _fail("the live view needs rich: pip install rich (or use --plain)")
    console: Console | None = None
    if live:
        from rich.console import Console  # noqa: PLC0415 - rich is optional

        console = Console(file=stream, force_terminal=True if options.live else None)
    server: envq.MetricsServer | None = None
    registry: CollectorRegistry | None = None
    if options.metrics_port is not None:
        if not _has("prometheus_client"):
            return _fail("--metrics-port needs prometheus_client: pip install 'envq[prometheus]'")
        from prometheus_client import CollectorRegistry  # noqa: PLC0415 - optional

        registry = CollectorRegistry()
        try:
            server = envq.serve_metrics(options.metrics_port, registry=registry)
        except OSError as exc:
            return _fail(f"cannot serve metrics on 127.0.0.1:{options.metrics_port}: {exc}")
    try:
        code, gone = asyncio.run(
            _run(
                options,
                stream,
                console=console,
                registry=registry,
                metrics_url=server.url if server is not None else "",
            )
        )
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the loop
        with contextlib.suppress(OSError):
            stream.write("interrupted\n")
            stream.flush()
        return EXIT_INTERRUPTED
    except asyncio.CancelledError:  # stdout went away while the demo was ending
        code, gone = EXIT_BROKEN_PIPE, True
    finally:
        if server is not None:
            server.close()
    if gone and stream is sys.stdout:
        # Keep the interpreter's final flush of stdout from complaining about the pipe.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
    return code


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
