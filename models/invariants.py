"""The invariants envq keeps (the auditor's entry point; see :mod:`envq.model.invariants`)."""

from __future__ import annotations

from envq.model.invariants import INVARIANTS, Invariant

__all__ = [
    "INVARIANTS",
    "Invariant",
]
