"""What a queue tells or hands to the outside world on its own: a stop on a signal, an
envelope that ended FAILED handed to its dead-letter callable, and the log lines a user
must see (a failure nothing handles, work left over at exit or lost with the queue)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import warnings
from collections.abc import Callable, Coroutine
from typing import Any, cast

from envq import _checks
from envq._config import DeadLetter
from envq._crew import keep_alive
from envq._envelope import Envelope

__all__ = [
    "checked_signals",
    "leftovers_at_exit",
    "lost_with_queue",
    "on_first_signal",
    "to_dead_letter",
    "unhandled_failure",
]

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
        log.info("queue %r: signal %s received, stopping", name, signal.strsignal(sig))
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


def unhandled_failure(name: str, env: Envelope, cause: BaseException | None) -> None:
    """Log an envelope that ended FAILED while nothing handles it, with its traceback."""
    log.warning(
        "queue %r: %s failed and nothing handles it (no on_failure, dead_letter or listener): %r",
        name,
        env.label(),
        cause,
        exc_info=cause,
    )


def leftovers_at_exit(name: str, left: list[Envelope], orderly: bool) -> None:
    """Log what an ``async with`` exit handed back: periodic envelopes parked by an
    orderly exit at INFO (a periodic envelope never ends by itself: parking it is how
    an orderly exit ends it), anything else at WARNING."""
    periodic = sum(1 for env in left if env.interval > 0)
    if orderly and periodic == len(left):
        log.info(
            "queue %r: %d periodic envelope(s) parked at exit (see Queue.leftovers)", name, periodic
        )
    else:
        log.warning(
            "queue %r: %d envelope(s) left over at exit (see Queue.leftovers)", name, len(left)
        )


def lost_with_queue(name: str, count: int, state: str, source: object) -> None:
    """A queue was garbage-collected holding ``count`` envelopes: they are lost. A
    ``ResourceWarning`` is hidden by default, so it is logged too."""
    message = (
        f"envq.Queue {name!r} was garbage-collected holding {count} envelope(s) ({state}): "
        "they are lost; terminate() it and keep what it hands back"
    )
    with contextlib.suppress(Exception):  # logging torn down at interpreter exit
        log.warning("%s", message)
    warnings.warn(message, ResourceWarning, source=source, stacklevel=2)
