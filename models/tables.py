"""Dict tables rebuilt from the models: the auditor's entry point to :mod:`envq.model.tables`."""

from __future__ import annotations

from envq.model.tables import (
    ENVELOPE_EVENTS,
    Guard,
    ModelTransition,
    contexts,
    enabled_targets,
    envelope_moves,
    envelope_transitions,
    lifecycle_moves,
    lifecycle_transitions,
    outcome_targets,
)

__all__ = [
    "ENVELOPE_EVENTS",
    "Guard",
    "ModelTransition",
    "contexts",
    "enabled_targets",
    "envelope_moves",
    "envelope_transitions",
    "lifecycle_moves",
    "lifecycle_transitions",
    "outcome_targets",
]
