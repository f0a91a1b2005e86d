"""What a queue hands to the outside world on its own: a stop on a signal, and an
envelope that ended FAILED to its dead-letter callable."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any, cast

from envq import _checks
from envq._config import DeadLetter
from envq._crew import keep_alive
from envq._envelope import Envelope

__all__ = ["checked_signals", "on_first_signal", "to_dead_letter"]

log = logging.getLogger("envq")


def checked_signals(where: str, signals: tuple[int, ...]) -> tuple[int, ...]:
    """``signals`` (default SIGINT and SIGTERM), each one a loop may handle."""
    wanted = signals or (signal.SIGINT, signal.SIGTERM)
    valid = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
    for sig in wanted:
        _checks.integer(where, sig, minimum=1)
        if sig not in valid:
            raise ValueError(f"{where}: {sig!r} cannot be handled")
    return wanted


def on_first_signal(
    loop: asyncio.AbstractEventLoop,
    name: str,
    signals: tuple[int, ...],
    stop: Callable[[], Coroutine[Any, Any, object]],
) -> Callable[[], None]:
    """Run ``stop()`` as a task on ``loop`` at the first of ``signals``, giving every
    one of them back to its previous handler at once; returns the function that gives
    them back without waiting for one."""
    before = {sig: signal.getsignal(sig) for sig in signals}
    given_back = False

    def give_back() -> None:
        nonlocal given_back
        if given_back:
            return
        given_back = True
        for sig, handler in before.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def on_signal(sig: int) -> None:
        give_back()
        log.info("queue %r: %s received, stopping", name, signal.Signals(sig).name)
        keep_alive(loop.create_task(stop(), name=f"envq:{name}:stop-on-signal"))

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    return give_back


def to_dead_letter(
    name: str,
    dead_letter: DeadLetter,
    is_async: bool,
    env: Envelope,
    error: BaseException | None,
    loop: asyncio.AbstractEventLoop | None,
) -> None:
    """Hand an envelope that ended FAILED to ``dead_letter`` (an ``async def`` one as a
    task on ``loop``); what it raises is logged."""
    if is_async and loop is not None:
        keep_alive(loop.create_task(_dead_letter_async(name, dead_letter, env, error)))
        return
    try:
        dead_letter(env, error)
    except BaseException:
        log.exception("queue %r: dead_letter failed for %s", name, env.label())


async def _dead_letter_async(
    name: str, dead_letter: DeadLetter, env: Envelope, error: BaseException | None
) -> None:
    try:
        await cast("Coroutine[Any, Any, object]", dead_letter(env, error))
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException:
        log.exception("queue %r: dead_letter failed for %s", name, env.label())
