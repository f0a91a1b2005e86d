"""envq on PostgreSQL: a queue whose state lives in the database, shared by processes.

:class:`PgQueue` has envq's lifecycle and outcome tables, enforced by the database
(:mod:`envq.postgres.schema` generates the SQL from them): any number of processes on
any number of machines run workers for the same named queue, each attempt under a
lease with a fencing token, and an attempt whose node died is reaped by another node
and decided by the envelope's own retry policy. See ``docs/postgres.md``.
"""

from envq.postgres._codec import callable_name
from envq.postgres._queue import CHANNEL, PgQueue, StoreUnavailable

__all__ = ["CHANNEL", "PgQueue", "StoreUnavailable", "callable_name"]
