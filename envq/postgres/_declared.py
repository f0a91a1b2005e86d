"""What the PostgreSQL conformance driver declares to the harness, and the timing it
declares it from: the protocol's optional features it plays, its deliberate
divergences from the in-process queue, the calls whose answers carry where they took
effect, and the bounds of a shared store's lateness (two polls and a statement).
"""

from __future__ import annotations

from typing import Any, Final

__all__ = [
    "COMMIT_LAG_S",
    "DIVERGENCES",
    "EFFECTIVE",
    "FEATURES",
    "REFUSED_AT_ONCE",
    "SETTLE_MAX",
    "SETTLE_SHARE",
    "STATEMENT_S",
    "real_poll",
    "share",
]

#: The optional features of the protocol this driver declares.
FEATURES: Final = (
    "buffer",
    "deadline",
    "dedup",
    "delay",
    "no_retry",
    "on_failure",
    "on_success",
    "periodic",
    "restart",
    "retry_policy",
    "send_wait",
    "stop_cancel",
    "stop_envelope",
    "stop_modes",
    "stop_type",
    "terminate_handback",
    "late_cancel",
    "late_due",
    "leases",
)

_DOCS: Final = "docs/postgres.md#conformance"

#: The deliberate differences from the in-process queue, by name, with the checks of
#: the conformance oracle each one relaxes.
DIVERGENCES: Final[tuple[dict[str, Any], ...]] = (
    {
        "name": "at-least-once execution, one committed end per attempt",
        "checks": [],
        "classification": "design",
        "reference": _DOCS,
    },
    {
        "name": "dedup by id",
        "checks": [],
        "classification": "design",
        "reference": _DOCS,
    },
    {
        "name": "hand-back returns re-created envelopes",
        "checks": [],
        "classification": "design",
        "reference": _DOCS,
    },
    {
        "name": "cancellation takes effect within a lease/poll period",
        "checks": [],
        "classification": "design",
        "reference": _DOCS,
    },
    {
        "name": "event order per envelope only",
        "checks": [],
        "classification": "design",
        "reference": _DOCS,
    },
    {
        "name": "reporting hooks run after the end commits",
        "checks": [],
        "classification": "design",
        "reference": _DOCS,
    },
)

#: The calls that, refused, are refused at once and change nothing: their ``at`` is
#: where the driver received them (see :meth:`envq.postgres.driver.Session.handle`).
REFUSED_AT_ONCE: Final = frozenset({"send", "start", "stop"})

#: The calls whose answer carries ``effect``: where, among the observations, the call
#: took effect in the database (see :func:`envq.postgres._observed.effect`).
EFFECTIVE: Final = frozenset({"send", "start", "stop", "terminate"})

#: Real seconds the driver lets pass after a command for the nodes to settle, as a
#: share of one model second (the smallest duration the harness generates is 1).
SETTLE_SHARE: Final = 0.1
#: The most real seconds a settle waits for the nodes to claim what they have room for.
SETTLE_MAX: Final = 0.5

#: Real seconds a keeper's statement may take on a loaded machine (a round trip to the
#: server and a commit): with two polls, how late a due move may land (``due_latency``)
#: and a committed cancel may reach an attempt (``cancel_latency``).
STATEMENT_S: Final = 0.02

#: Real seconds from the instant a move is timed (its statement's start) to its commit,
#: at most, on a loaded machine: a call refused at once may not have seen a move timed
#: up to this long before the driver received the call.
COMMIT_LAG_S: Final = 2 * STATEMENT_S


def real_poll(scale: float) -> float:
    """The nodes' poll in real seconds: a tenth of a model second, 5 to 50 ms. A node's
    keeper reads a stop's cancel at its next round, in a statement, and acts in that
    round: a cancel reaches an attempt within two polls and a statement of its commit
    (``cancel_latency``)."""
    return max(0.005, min(0.05, 0.1 * scale))


def share(workers: int, nodes: int) -> list[int]:
    """``workers`` shared out among ``nodes`` (the first ones get one more)."""
    return [workers // nodes + (1 if i < workers % nodes else 0) for i in range(nodes)]
