"""A queue's listeners: who is told of every state change, and whether anyone is.

Like trio's instruments: the queue asks :attr:`Listeners.observed` before it builds an
:class:`envq.Event`, so a queue nobody listens to (and not under ``STRICT``) pays
nothing for events.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from envq._reports import Event

__all__ = ["Listener", "Listeners"]

log = logging.getLogger("envq")

Listener = Callable[[Event], object]


class Listeners:
    """The listeners of one queue, in subscription order.

    ``on_change(observed)`` is called whenever whether anyone observes the queue
    changes (a first listener, the last one gone); ``strict`` counts as an observer
    (the queue then checks every move against the tables).
    """

    __slots__ = ("_name", "_on_change", "_strict", "aside", "handlers", "listeners", "lock")

    def __init__(self, name: str, strict: bool, on_change: Callable[[bool], None]) -> None:
        self._name = name
        self._strict = strict
        self._on_change = on_change
        self.listeners: list[Listener] = []
        #: Subscribed listeners that count as handling failures.
        self.handlers = 0
        #: Events held for the loop's thread, in order: set while a call from another
        #: thread runs (between two runs of the loop) and until the loop delivers them;
        #: every event emitted meanwhile, on any thread, joins them.
        self.aside: list[Event] | None = None
        #: Held by a call from another thread for its whole run (one at a time), and by
        #: the loop's thread to take the events set aside.
        self.lock = threading.Lock()

    @property
    def observed(self) -> bool:
        """Whether moves must be observed: someone listens, or ``STRICT`` is on."""
        return bool(self.listeners) or self._strict

    def add(self, listener: Listener, *, handles_failures: bool) -> Callable[[], None]:
        """Subscribe ``listener``; returns the function that unsubscribes it (once)."""
        self.listeners.append(listener)
        if handles_failures:
            self.handlers += 1
        self._on_change(True)
        subscribed = True

        def remove() -> None:
            nonlocal subscribed
            if subscribed:
                subscribed = False
                self.listeners.remove(listener)
                if handles_failures:
                    self.handlers -= 1
                self._on_change(self.observed)

        return remove

    def emit(self, event: Event) -> None:
        """Call every listener with ``event``; one that raises is logged and skipped.
        While events are set aside for the loop's thread, ``event`` joins them."""
        aside = self.aside
        if aside is not None:
            aside.append(event)
            return
        for listener in list(self.listeners):
            try:
                listener(event)
            except BaseException:
                log.exception("queue %r: event listener %r failed", self._name, listener)

    def deliver_aside(self) -> None:
        """On the loop's thread: deliver the events set aside, in order. While a call
        from another thread is still running it does nothing: that call asks for
        another delivery when it ends (so no event joins a list already delivered)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            events, self.aside = self.aside, None
        finally:
            self.lock.release()
        for event in events or ():
            self.emit(event)
