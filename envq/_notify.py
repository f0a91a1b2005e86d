"""What a queue tells or hands to the outside world on its own: a stop on a signal, an
envelope that ended FAILED handed to its dead-letter callable, and the log lines a user
must see (a failure nothing handles, work left over at exit or lost with the queue)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import warnings
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, cast

from envq import _checks
from envq._config import DeadLetter
from envq._entry import keep_alive
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


class _Hub:
    """envq's handling of signals on one loop: every registration made by
    ``stop_on_signals()`` (any queue, any number of times), and the handling each signal
    had before envq took it, given back once no registration wants it any more.

    The loop keeps one handler per signal; a second registration that took "the
    previous handler" from the loop would take the first one's (and restore the loop's
    no-op in the end). Here the first registration records the handling from before,
    and every one is a subscriber.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        #: Per signal taken: the Python-level handler before envq, and the loop's own
        #: handler of it then (its callback and arguments), if the loop had one.
        self.before: dict[
            int, tuple[Any, tuple[Callable[..., object], tuple[Any, ...]] | None]
        ] = {}
        #: Per signal taken: the registrations that want it, in order.
        self.wanted: dict[int, list[_Registration]] = {}

    def add(self, registration: _Registration) -> None:
        for sig in registration.signals:
            if sig not in self.wanted:
                self.before[sig] = (signal.getsignal(sig), _loop_handler(self.loop, sig))
                self.wanted[sig] = []
                self.loop.add_signal_handler(sig, self.fire, sig)
            self.wanted[sig].append(registration)

    def remove(self, registration: _Registration) -> None:
        for sig in registration.signals:
            wanted = self.wanted.get(sig)
            if wanted is None or registration not in wanted:
                continue
            wanted.remove(registration)
            if not wanted:
                self.give_back(sig)

    def give_back(self, sig: int) -> None:
        del self.wanted[sig]
        handler, own = self.before.pop(sig)
        self.loop.remove_signal_handler(sig)
        if own is not None:
            self.loop.add_signal_handler(sig, own[0], *own[1])
        else:
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if not self.wanted:
            _HUBS.pop(self.loop, None)

    def fire(self, sig: int) -> None:
        # Every registration that wants this signal fires once: each gives back all of
        # its signals (a signal nobody wants any more returns to its handling from
        # before envq), then stops its queue.
        for registration in list(self.wanted.get(sig, ())):
            registration.fire(sig)


def _loop_handler(
    loop: asyncio.AbstractEventLoop, sig: int
) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
    """The loop's own handler of ``sig`` (one added with ``add_signal_handler`` before
    envq's), as its callback and arguments, so that it can be put back."""
    handles = getattr(loop, "_signal_handlers", None)
    handle = handles.get(sig) if isinstance(handles, dict) else None
    callback = getattr(handle, "_callback", None)
    if handle is None or not callable(callback):
        return None
    return callback, tuple(getattr(handle, "_args", ()) or ())


#: The hub of each loop that has signals taken by envq.
_HUBS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Hub] = weakref.WeakKeyDictionary()


class _Registration:
    """One ``stop_on_signals()`` call: its signals, and the stop to run at the first."""

    def __init__(
        self,
        hub: _Hub,
        name: str,
        signals: tuple[int, ...],
        stop: Callable[[], Coroutine[Any, Any, object]],
    ) -> None:
        self.hub = hub
        self.name = name
        self.signals = tuple(dict.fromkeys(signals))
        self.stop = stop
        self.given_back = False

    def give_back(self) -> None:
        if self.given_back:
            return
        self.given_back = True
        self.hub.remove(self)

    def fire(self, sig: int) -> None:
        self.give_back()
        loop = self.hub.loop
        log.info("queue %r: signal %s received, stopping", self.name, signal.strsignal(sig))
        keep_alive(loop.create_task(self.stop(), name=f"envq:{self.name}:stop-on-signal"))


def on_first_signal(
    bound: asyncio.AbstractEventLoop | None,
    bind: Callable[[], asyncio.AbstractEventLoop],
    name: str,
    signals: tuple[int, ...],
    stop: Callable[[], Coroutine[Any, Any, object]],
) -> Callable[[], None]:
    """Run ``stop()`` as a task on the queue's loop (``bound``, or the running loop
    ``bind()`` binds the queue to) at the first of ``signals``, giving every one of them
    back at once; returns the function that gives them back without waiting for one.

    Registrations on one loop are chained (:class:`_Hub`): a signal stops every queue
    that registered for it, and goes back to the handling it had before envq took it
    once no registration wants it (a second Ctrl-C interrupts as it would have).

    :raises RuntimeError: not called from a coroutine on the queue's loop."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is None or (bound is not None and running is not bound):
        raise RuntimeError(
            f"queue {name!r}: stop_on_signals() must be called from a coroutine on the "
            "queue's event loop"
        )
    loop = bind()
    hub = _HUBS.get(loop)
    if hub is None:
        hub = _HUBS[loop] = _Hub(loop)
    registration = _Registration(hub, name, signals, stop)
    hub.add(registration)
    return registration.give_back


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
