"""Errors envq raises, and the control signals user code raises to steer an envelope.

Every error envq raises derives from :class:`EnvqError`. The control signals
(:class:`StopEnvelope`, :class:`StopType`, :class:`DoNotRetry`) are raised *by user code*
inside an attempt; they are ordinary exceptions, not ``EnvqError``\\ s.
"""

from __future__ import annotations

__all__ = [
    "AlreadyComplete",
    "BadEnvelope",
    "BadEnvelopeType",
    "BadIntervals",
    "CapacityExceeded",
    "DoNotRetry",
    "EnvqError",
    "MaxRetriesExceeded",
    "QueueNotRunning",
    "QueueShuttingDown",
    "QueueStopping",
    "QueueTerminated",
    "SendTimeout",
    "StopEnvelope",
    "StopType",
    "TypeBlacklisted",
]


class EnvqError(Exception):
    """Base class of every error envq raises."""


class BadEnvelope(EnvqError, ValueError):
    """An envelope's field has an invalid value, or the envelope cannot be sent here.

    Raised at construction (the message names the field and the value) and by
    ``send()`` for something that is not an envelope or an envelope live in another
    queue. A field of the wrong *type* raises the subclass :class:`BadEnvelopeType`.
    """


class BadEnvelopeType(BadEnvelope, TypeError):
    """An envelope's field has a value of the wrong type (``invoke=3``,
    ``interval="3"``, ``type=5``, a missing ``invoke``...).

    Both a :class:`BadEnvelope` and a ``TypeError``, so either ``except`` catches it.
    A field of the right type with a wrong value (negative, NaN, too large...) raises
    plain :class:`BadEnvelope`.
    """


class BadIntervals(BadEnvelope):
    """A periodic envelope's ``deadline`` exceeds its ``interval``."""


class CapacityExceeded(EnvqError):
    """The batch does not fit in the queue's capacity; nothing of it was admitted."""


class SendTimeout(CapacityExceeded, TimeoutError):
    """``send_wait()`` found no room within its ``timeout``; nothing was admitted.

    Both a :class:`CapacityExceeded` and a ``TimeoutError``, on either store.
    """


class QueueNotRunning(EnvqError):
    """The call needs a queue in another lifecycle state (the message names it)."""


class QueueStopping(QueueNotRunning):
    """The queue is STOPPING: it accepts no envelopes and cannot be started until stopped."""


class QueueTerminated(QueueNotRunning):
    """The queue is TERMINATED: it will never run again."""


class QueueShuttingDown(EnvqError):
    """A task queue that was told to shut down refuses new tasks."""


class TypeBlacklisted(EnvqError):
    """The envelope's ``type`` was blacklisted in this queue by a :class:`StopType`."""


class MaxRetriesExceeded(EnvqError):
    """A retried envelope or task used up its attempts; ``__cause__`` is the last error."""


class AlreadyComplete(EnvqError):
    """A task that has already ended was submitted to run again."""


class StopEnvelope(Exception):
    """Raised by user code to end *this* envelope: no reschedule, ever.

    Raised in ``before`` or ``invoke``, the ``after`` hook still runs;
    ``on_success`` never runs.
    """


class StopType(StopEnvelope):
    """Raised by user code to end this envelope and blacklist its ``type`` in the queue.

    Later sends of that type raise :class:`TypeBlacklisted` and every live envelope of
    that type ends STOPPED. On an envelope with an empty ``type`` it acts as
    :class:`StopEnvelope`.
    """


class DoNotRetry(Exception):
    """Raised by user code for an error that ends the envelope at once (FAILED).

    ``on_failure`` is still called, to report; its decision is ignored.
    """
