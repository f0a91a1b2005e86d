"""The queue lifecycle model: the auditor's entry point to :mod:`envq.model.lifecycle`."""

from __future__ import annotations

from envq.model.lifecycle import CALL_EVENTS, REJECTED, LifecycleModel

__all__ = [
    "CALL_EVENTS",
    "REJECTED",
    "LifecycleModel",
]
