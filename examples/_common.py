"""Helpers shared by the examples (not an example itself).

The Go examples wait for SIGINT/SIGTERM or a timeout, then stop the queue;
:func:`until_signal_or_timeout` is that wait. :func:`clock` prefixes printed lines
with the seconds since the first line it stamped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

_start: list[float] = []


def clock() -> str:
    """``[ 1.23s]``: the time since the first call."""
    now = time.monotonic()
    if not _start:
        _start.append(now)
    return f"[{now - _start[0]:5.2f}s]"


async def until_signal_or_timeout(seconds: float) -> None:
    """Return after ``seconds``, or earlier on SIGINT/SIGTERM (Ctrl+C); print which."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows
            loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
        print("signal shutdown")
    except TimeoutError:
        print("main: timeout")
    finally:
        for sig in signals:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
