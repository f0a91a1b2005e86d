"""Stamps (middleware) shipped with envq."""

from __future__ import annotations

import logging
import time

from envq._envelope import Envelope, Invoker, Stamp

__all__ = ["logging_stamp"]


def logging_stamp(logger: logging.Logger | None = None, level: int = logging.INFO) -> Stamp:
    """A stamp that logs each invocation's type/id, duration and error.

    Records go to ``logger`` (default: the ``envq.stamp`` logger) with structured
    ``extra`` fields ``envq_type``, ``envq_id``, ``envq_duration`` and ``envq_error``;
    nothing is formatted unless the level is enabled.
    """
    log = logger or logging.getLogger("envq.stamp")

    def stamp(next_: Invoker) -> Invoker:
        async def invoker(env: Envelope) -> None:
            if not log.isEnabledFor(level):
                await next_(env)
                return
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                await next_(env)
            except BaseException as exc:
                error = exc
                raise
            finally:
                took = time.perf_counter() - started
                extra = {
                    "envq_type": env.type,
                    "envq_id": env.id,
                    "envq_duration": took,
                    "envq_error": repr(error) if error is not None else None,
                }
                if error is None:
                    log.log(level, "envelope %s done in %.6f s", env.label(), took, extra=extra)
                else:
                    log.log(
                        level,
                        "envelope %s failed in %.6f s: %r",
                        env.label(),
                        took,
                        error,
                        extra=extra,
                    )

        return invoker

    return stamp
