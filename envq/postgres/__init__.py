"""envq on PostgreSQL: a queue whose state lives in the database, shared by processes.

:class:`PgQueue` has envq's lifecycle and outcome tables, enforced by the database
(:mod:`envq.postgres.schema` generates the SQL from them): any number of processes on
any number of machines run workers for the same named queue, each attempt under a
lease with a fencing token, and an attempt whose node died is reaped by another node
and decided by the envelope's own retry policy. See ``docs/postgres.md``.

The names are imported when first used, so that ``python -m envq.postgres.schema``
and ``python -m envq.postgres.node`` run their module once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from envq.postgres._codec import callable_name
    from envq.postgres._queue import CHANNEL, AdmissionUnknown, PgQueue, StoreUnavailable

__all__ = ["CHANNEL", "AdmissionUnknown", "PgQueue", "StoreUnavailable", "callable_name"]

_WHERE = {
    "AdmissionUnknown": "envq.postgres._queue",
    "CHANNEL": "envq.postgres._queue",
    "PgQueue": "envq.postgres._queue",
    "StoreUnavailable": "envq.postgres._queue",
    "callable_name": "envq.postgres._codec",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'envq.postgres' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
