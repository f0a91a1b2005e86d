"""A queue's constructor arguments, checked once, as one frozen value."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from envq import _checks
from envq._envelope import Envelope, Stamp
from envq._limits import RateLimiter
from envq._values import HookTimeout, StopMode

__all__ = ["DeadLetter", "QueueConfig"]

#: ``dead_letter(env, error)``: plain or ``async def``.
DeadLetter = Callable[[Envelope, BaseException | None], object]


@attrs.frozen(kw_only=True)
class QueueConfig:
    """What a :class:`envq.Queue` was made with (see its constructor for each field).

    Made by :meth:`checked`, which refuses a wrong type with ``TypeError`` and a wrong
    value with ``ValueError``, each naming the parameter and the value.
    """

    name: str
    workers: int = 1
    capacity: int = 0
    stop_mode: StopMode = StopMode.DRAIN
    wait: bool = True
    stamps: tuple[Stamp, ...] = ()
    rate: RateLimiter | None = None
    limiter: RateLimiter | None = None
    dead_letter: DeadLetter | None = None
    hook_timeout: HookTimeout = attrs.field(factory=HookTimeout)
    threads: int | None = None
    log_unhandled: bool = True
    keep_ended: int = 1000

    @classmethod
    def checked(
        cls,
        name: str,
        *,
        workers: int,
        capacity: int,
        stop_mode: StopMode,
        wait: bool,
        stamps: Iterable[Stamp] | None,
        rate: RateLimiter | None,
        limiter: RateLimiter | None,
        dead_letter: DeadLetter | None,
        hook_timeout: HookTimeout,
        threads: int | None,
        log_unhandled: bool,
        keep_ended: int = 1000,
    ) -> QueueConfig:
        """The configuration, once every argument passed its check."""
        _checks.name("Queue: name", name)
        where = f"Queue {name!r}:"
        _checks.integer(f"{where} workers", workers, minimum=1)
        _checks.integer(f"{where} capacity", capacity, minimum=0)
        _checks.member(f"{where} stop_mode", stop_mode, StopMode)
        _checks.flag(f"{where} wait", wait)
        checked_stamps = _checks.stamps(f"{where} stamps", stamps)
        for label, lim in (("rate", rate), ("limiter", limiter)):
            if lim is not None:
                _checks.limiter(f"{where} {label}", lim)
        if dead_letter is not None:
            _checks.callable_(f"{where} dead_letter", dead_letter)
        _checks.instance(f"{where} hook_timeout", hook_timeout, HookTimeout)
        if threads is not None:
            _checks.integer(f"{where} threads", threads, minimum=1)
        _checks.flag(f"{where} log_unhandled", log_unhandled)
        _checks.integer(f"{where} keep_ended", keep_ended, minimum=0)
        return cls(
            name=name,
            workers=workers,
            capacity=capacity,
            stop_mode=stop_mode,
            wait=wait,
            stamps=checked_stamps,
            rate=rate,
            limiter=limiter,
            dead_letter=dead_letter,
            hook_timeout=hook_timeout,
            threads=threads,
            log_unhandled=log_unhandled,
            keep_ended=keep_ended,
        )
