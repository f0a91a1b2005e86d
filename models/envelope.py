"""The envelope state machine: the auditor's entry point to :mod:`envq.model.envelope`."""

from __future__ import annotations

from envq.model.envelope import EVENTS, Context, EnvelopeModel

__all__ = [
    "EVENTS",
    "Context",
    "EnvelopeModel",
]
