"""The edges of :class:`envq.postgres.PgQueue`: what it checks before it asks the
database (parameters, text the database cannot store), what it checks when it
connects (envq's schema and its version, the queue's row and its capacity), the
capacity check of a send, and the error of a database it cannot reach (which never
shows the DSN's password)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final

from envq import _checks
from envq._envelope import Envelope
from envq._errors import BadEnvelopeType, CapacityExceeded, QueueNotRunning
from envq._machine import LIVE_STATES
from envq.postgres.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres._codec import Encoded

__all__ = [
    "LEASE_MAX",
    "LEASE_MIN",
    "AdmissionUnknown",
    "CommitUnheard",
    "NeverFits",
    "StoreUnavailable",
    "check_dsn",
    "check_lease",
    "check_room",
    "check_schema",
    "committed",
    "queue_row",
    "storable_text",
    "unavailable",
    "unreachable",
]

_LIVE: Final = [s.value for s in LIVE_STATES]


class StoreUnavailable(QueueNotRunning):
    """The database could not be reached, or the connection was lost mid-call; what the
    call would have changed is rolled back (a ``send`` admitted nothing)."""


class AdmissionUnknown(StoreUnavailable):
    """The connection was lost while a ``send`` committed, and the database could not
    be asked afterwards whether the commit went through: the batch was admitted whole
    or not at all, but which is unknown. Sending it again is safe for envelopes with an
    ``id``: one still live is counted as a dedup, not admitted twice."""


class CommitUnheard(Exception):
    """The connection was lost during a transaction's ``COMMIT``: the server may have
    committed it. ``xid`` names the transaction, to ask the server which."""

    def __init__(self, xid: str, admitted: int) -> None:
        super().__init__(f"COMMIT of transaction {xid} unheard")
        self.xid = xid
        self.admitted = admitted


async def committed(
    session: Callable[[], AbstractAsyncContextManager[Any]],
    xid: str,
    lost: tuple[type[BaseException], ...],
    *,
    patience: float = 5.0,
) -> bool | None:
    """Whether transaction ``xid`` committed, asked on a new session
    (``pg_xact_status``): ``True``, ``False`` (aborted), or ``None`` if the database
    cannot tell within ``patience`` seconds (unreachable, or the transaction still
    in progress)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + patience
    while True:
        try:
            async with session() as conn:
                status = await conn.fetchval("SELECT pg_xact_status($1::text::xid8)", xid)
        except lost:
            status = None
        if status in ("committed", "aborted"):
            return bool(status == "committed")
        if loop.time() >= until:
            return None
        await asyncio.sleep(0.05)


class NeverFits(CapacityExceeded):
    """A batch with more new envelopes than the capacity: no wait makes room for it."""


#: The shortest lease: a node renews every third of it, and a renewal is a round trip
#: to the database; a shorter one would expire under a node that is alive.
LEASE_MIN: Final = 0.1
#: The longest lease: a day (an attempt longer than that is renewed, not leased once;
#: a lease of years would outrun PostgreSQL's intervals and timestamps).
LEASE_MAX: Final = 86400.0

#: The characters PostgreSQL's text and jsonb cannot hold: NUL, and the UTF-16
#: surrogates (a lone one is no character; a pair would come back joined).
_UNSTORABLE: Final = re.compile("[\x00\ud800-\udfff]")


def check_dsn(where: str, dsn: object) -> str:
    """``dsn``: a str naming a database (its text is checked by the driver)."""
    if not isinstance(dsn, str):
        raise TypeError(f"{where}: dsn must be a str, not {type(dsn).__name__}")
    if not dsn.strip():
        raise ValueError(f"{where}: dsn must name a database, got {dsn!r}")
    return dsn


def check_lease(where: str, lease: object) -> float:
    """``lease``: seconds from :data:`LEASE_MIN` to :data:`LEASE_MAX`."""
    seconds = _checks.seconds(f"{where} lease", lease, positive=True)
    if not LEASE_MIN <= seconds <= LEASE_MAX:
        raise ValueError(
            f"{where}: lease must be from {LEASE_MIN} to {LEASE_MAX} seconds, got {lease!r}"
        )
    return seconds


def _unstorable(value: object) -> str | None:
    """The first string in ``value`` (a JSON value: keys, items, values) PostgreSQL
    cannot store, or None."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _UNSTORABLE.search(item):
                return item
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def storable_text(env: Envelope, label: str) -> None:
    """Refuse an envelope whose ``id``, ``payload`` or ``type`` holds text PostgreSQL
    cannot store, naming the field (before the database is asked)."""
    for field in ("id", "payload", "type"):
        bad = _unstorable(getattr(env, field))
        if bad is not None:
            raise BadEnvelopeType(
                f"{label}: {field}={getattr(env, field)!r} cannot cross processes: "
                f"{bad!r} holds a NUL character or a UTF-16 surrogate, which PostgreSQL "
                "cannot store"
            )


def unreachable(driver: Any) -> tuple[type[BaseException], ...]:
    """The errors of a database that cannot be reached, or of a DSN the driver cannot
    read (the standard library's URL parser raises ``ValueError``)."""
    return (OSError, ValueError, driver.PostgresError, driver.InterfaceError)


def _secrets(dsn: str) -> list[str]:
    """What of the DSN no message may show: the DSN itself and its password (as a
    URL's or as a ``password=`` setting), longest first."""
    found = [dsn]
    found += re.findall(r"://[^:/@?]*:([^@/?]+)@", dsn)
    found += re.findall(r"password=([^&\s]+)", dsn)
    return sorted((s for s in found if s), key=len, reverse=True)


def unavailable(name: str, dsn: str, error: BaseException) -> StoreUnavailable:
    """The error of a database that cannot be reached (or a DSN the driver cannot
    read): the driver's reason, with the DSN and its password left out."""
    reason = str(error)
    for secret in _secrets(dsn):
        reason = reason.replace(secret, "***")
    return StoreUnavailable(
        f"queue {name!r}: cannot reach the database: {type(error).__name__}"
        + (f": {reason}" if reason else "")
    )


async def check_schema(conn: asyncpg.pool.PoolConnectionProxy[Any], name: str) -> None:
    """Refuse a database without envq's schema, or with a schema of another version
    than this envq's."""
    if await conn.fetchval("SELECT to_regclass('envq.schema_version')") is None:
        raise RuntimeError(
            f"queue {name!r}: the database has no envq schema: call install() "
            "(or run the node command with --install) first"
        )
    version = await conn.fetchval("SELECT max(version) FROM envq.schema_version")
    if version != SCHEMA_VERSION:
        raise RuntimeError(
            f"queue {name!r}: envq's schema in the database is version {version}, "
            f"this envq needs {SCHEMA_VERSION}"
        )


async def queue_row(
    conn: asyncpg.pool.PoolConnectionProxy[Any], name: str, capacity: int | None
) -> int:
    """Create the queue's row unless it is there (with ``capacity``, 0 for None); the
    queue's capacity. A capacity other than the row's is refused: the capacity is the
    queue's, set by whoever created its row."""
    await conn.execute(
        "INSERT INTO envq.queues (name, capacity) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        name,
        capacity or 0,
    )
    found: int = await conn.fetchval("SELECT capacity FROM envq.queues WHERE name = $1", name)
    if capacity is not None and found != capacity:
        raise ValueError(
            f"queue {name!r}: capacity={capacity} but the queue's capacity is {found} (set "
            "by whoever created it): give capacity=None to use the queue's"
        )
    return found


async def check_room(
    conn: asyncpg.pool.PoolConnectionProxy[Any],
    name: str,
    rows: Sequence[Encoded],
    capacity: int,
) -> None:
    """Refuse a batch that does not fit the queue's ``capacity`` now
    (:class:`CapacityExceeded`), or ever (:class:`NeverFits`), inside the send's
    transaction (under a lock of the queue's sends)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", name)
    # A dedup (an id live already, or twice in the batch) takes no room. The room and
    # the dedup are read in one statement (one snapshot): an attempt ending between
    # two reads would count its envelope live and new.
    ids = [e.id for e in rows if e.id is not None]
    room = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM envq.envelopes WHERE queue = $1"
        " AND state = ANY($3::envq.envelope_state[])) AS live,"
        " (SELECT count(DISTINCT i) FROM unnest($2::text[]) AS i"
        " WHERE NOT EXISTS (SELECT FROM envq.envelopes AS e WHERE e.queue = $1"
        " AND e.id = i::jsonb AND e.state = ANY($3::envq.envelope_state[]))) AS fresh",
        name,
        ids,
        _LIVE,
    )
    assert room is not None  # an aggregate: always one row
    live = room["live"]
    fresh = len(rows) - len(ids) + room["fresh"]
    if fresh > capacity:
        # An id live now can only take room later: more new ones than the capacity
        # never fit.
        raise NeverFits(
            f"queue {name!r}: {fresh} new envelope(s) can never fit the capacity of {capacity}"
        )
    if fresh and live + fresh > capacity:
        raise CapacityExceeded(
            f"queue {name!r}: no room for {fresh} envelope(s): {live} of {capacity} used"
        )
