"""OpenTelemetry tracing for envq attempts (the optional ``envq[otel]`` extra).

Only ``opentelemetry-api`` is needed; which SDK, exporter and sampler record the spans
is the application's choice, as OpenTelemetry intends for libraries. This module
imports ``opentelemetry`` only when :func:`otel_stamp` is called.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

from envq import _checks
from envq._envelope import Envelope, Invoker, Stamp
from envq._machine import Outcome
from envq._stamps import FAILURES, attempt_number, attempt_outcome, queue_name_of

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = ["otel_stamp"]

_INSTALL: Final = (
    "envq.otel_stamp needs the opentelemetry-api package: "
    "pip install 'envq[otel]' (or pip install opentelemetry-api)"
)


def otel_stamp(tracer: Tracer | None = None) -> Stamp:
    """A stamp that records each attempt as an OpenTelemetry span.

    The span (kind INTERNAL) is named ``envq TYPE`` (``envq attempt`` for an envelope
    without a type), is the current span while the invoker chain runs (so spans the
    work opens are its children), and carries the attributes ``envq.queue``,
    ``envq.envelope.type``, ``envq.envelope.id`` (as a string), ``envq.attempt`` (how
    many times this stamp has run the envelope) and ``envq.outcome`` (an
    :class:`envq.Outcome` value, told from inside the attempt as
    :func:`envq.logging_stamp` tells it). The status follows the outcome: ``OK`` for
    ``ok``; ``ERROR`` with the exception recorded for ``error``, ``timeout`` and
    ``no_retry``; left unset for ``stop``, ``stop_type`` and ``cancelled``, which are
    not failures. (``expired``, an attempt whose lease expired, is a failure too, but
    the stamp, inside the attempt, never tells it: another process finds the lease
    expired.)

    ``tracer`` defaults to ``opentelemetry.trace.get_tracer("envq")`` (the global
    tracer provider, a no-op until the application installs an SDK). Raises
    ``ImportError`` when ``opentelemetry-api`` is not installed.
    """
    if tracer is not None and not callable(getattr(tracer, "start_as_current_span", None)):
        raise TypeError(
            "otel_stamp: tracer must be an opentelemetry Tracer (with start_as_current_span) "
            f"or None, got {_checks.show(tracer)}"
        )
    try:
        from opentelemetry import trace  # noqa: PLC0415 - the optional extra, on demand
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    from envq import __version__  # noqa: PLC0415 - envq/__init__ imports this module

    tr = tracer if tracer is not None else trace.get_tracer("envq", __version__)
    ok = trace.Status(trace.StatusCode.OK)

    def stamp(next_: Invoker) -> Invoker:
        async def invoker(env: Envelope) -> None:
            attempt = attempt_number(env)
            loop = asyncio.get_running_loop()
            with tr.start_as_current_span(
                f"envq {env.type}" if env.type else "envq attempt",
                kind=trace.SpanKind.INTERNAL,
                attributes={
                    "envq.queue": queue_name_of(env),
                    "envq.envelope.type": env.type,
                    "envq.envelope.id": str(env.id),
                    "envq.attempt": attempt,
                },
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                started = loop.time()
                error: BaseException | None = None
                try:
                    await next_(env)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    outcome = attempt_outcome(env, error, started, loop.time())
                    span.set_attribute("envq.outcome", outcome.value)
                    if outcome in FAILURES and error is not None:
                        span.record_exception(error)
                        span.set_status(
                            trace.Status(trace.StatusCode.ERROR, f"{outcome.value}: {error!r}")
                        )
                    elif outcome is Outcome.OK:
                        span.set_status(ok)

        return invoker

    return stamp
