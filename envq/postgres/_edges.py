"""The edges of :class:`envq.postgres.PgQueue`: what it checks before it asks the
database (parameters, text the database cannot store), what it checks when it
connects (envq's schema and its version, the queue's row and its capacity), the
capacity check of a send, and the error of a database it cannot reach (which never
shows the DSN's password)."""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Final

from envq import _checks
from envq import _rules as rules
from envq._errors import CapacityExceeded, QueueNotRunning
from envq._machine import LIVE_STATES
from envq.postgres.migrations import check, installed

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres._codec import Encoded

__all__ = [
    "CHANNEL",
    "LEASE_MAX",
    "LEASE_MIN",
    "MAX_NODE_NAME",
    "MAX_QUEUE_NAME_BYTES",
    "AdmissionUnknown",
    "CommitUnheard",
    "NeverFits",
    "StoreUnavailable",
    "check_caller_connection",
    "check_capacity",
    "check_dsn",
    "check_lease",
    "check_node_name",
    "check_pooler",
    "check_queue_name",
    "check_room",
    "check_schema",
    "committed",
    "lost",
    "queue_row",
    "redact",
    "refuse_hidden_pooler",
    "unavailable",
    "unreachable",
]

#: The NOTIFY channel of every queue's sends and moves: the payload is the queue's name.
CHANNEL: Final = "envq"

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


def check_caller_connection(what: str, conn: object) -> None:
    """A caller's connection for a transactional send: an asyncpg connection (or a
    pool's proxy of one) inside a transaction.

    :raises TypeError: not an asyncpg connection; :class:`ValueError`: not in a
        transaction (the send would commit on its own).
    """
    in_transaction = getattr(conn, "is_in_transaction", None)
    if not callable(in_transaction) or not callable(getattr(conn, "fetchrow", None)):
        raise TypeError(
            f"{what} must be an asyncpg connection in a transaction (asyncpg.Connection, or"
            f" a pool's), got {type(conn).__name__}"
        )
    if not in_transaction():
        raise ValueError(
            f"{what}: the connection is not in a transaction; call send() inside"
            " `async with connection.transaction():` (the batch is admitted when it commits)"
        )


def check_dsn(where: str, dsn: object) -> str:
    """``dsn``: a str naming a database (its text is checked by the driver)."""
    if not isinstance(dsn, str):
        raise TypeError(f"{where}: dsn must be a str, not {type(dsn).__name__}")
    if not dsn.strip():
        raise ValueError(f"{where}: dsn must name a database, got {dsn!r}")
    return dsn


#: The poolers envq runs behind when told (``PgQueue(pooler=...)``). A pooler in
#: session mode keeps a server session per client: nothing to tell. One in statement
#: mode runs no transaction of more than one statement, and envq needs them.
POOLERS: Final = ("transaction",)


def check_pooler(where: str, pooler: object) -> str | None:
    """``pooler``: None or one of :data:`POOLERS`."""
    if pooler is None:
        return None
    if not isinstance(pooler, str):
        raise TypeError(f"{where} pooler must be a str or None, not {type(pooler).__name__}")
    if pooler not in POOLERS:
        raise ValueError(
            f"{where} pooler must be 'transaction' or None, got {_checks.show(pooler)} (a "
            "pooler in session mode needs no setting; one in statement mode cannot run "
            "envq's transactions)"
        )
    return pooler


#: The longest queue name, in UTF-8 bytes: a node is woken by a notification whose
#: payload is the name (at most 8,000 bytes), and the name keys the queue's row.
MAX_QUEUE_NAME_BYTES: Final = 255
#: The longest node name: the node's sessions carry ``envq:<node>`` as their
#: ``application_name`` (what ``pg_stat_activity`` shows), which PostgreSQL cuts at 63
#: bytes and in which it shows only printable ASCII.
MAX_NODE_NAME: Final = 63 - len("envq:")


def check_queue_name(where: str, name: object) -> str:
    """A queue name (:func:`envq._checks.name`) of at most
    :data:`MAX_QUEUE_NAME_BYTES` UTF-8 bytes."""
    checked = _checks.name(f"{where} name", name)
    size = len(checked.encode())
    if size > MAX_QUEUE_NAME_BYTES:
        raise ValueError(
            f"{where} name must take at most {MAX_QUEUE_NAME_BYTES} bytes in UTF-8 (a "
            f"notification carries it), got {size} bytes: {_checks.show(checked)}"
        )
    return checked


def check_node_name(where: str, node: object) -> str:
    """A node name: printable ASCII, at most :data:`MAX_NODE_NAME` characters, so that
    ``pg_stat_activity`` shows it whole."""
    checked = _checks.name(f"{where} node", node)
    if not checked.isascii() or len(checked) > MAX_NODE_NAME:
        raise ValueError(
            f"{where} node must be printable ASCII of at most {MAX_NODE_NAME} characters "
            "(the sessions' application_name, which pg_stat_activity shows, holds no "
            f"more), got {_checks.show(checked)}"
        )
    return checked


def check_lease(where: str, lease: object) -> float:
    """``lease``: seconds from :data:`LEASE_MIN` to :data:`LEASE_MAX`."""
    seconds = _checks.seconds(f"{where} lease", lease, positive=True)
    if not LEASE_MIN <= seconds <= LEASE_MAX:
        raise ValueError(
            f"{where}: lease must be from {LEASE_MIN} to {LEASE_MAX} seconds, got {lease!r}"
        )
    return seconds


def lost(driver: Any, *more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """The driver's errors of a session lost or not yet possible: the connection broke,
    the server is shutting down, restarting or recovering, or the session was
    terminated (``pg_terminate_backend``), or the driver lost track of a session cut in
    the middle of a statement (``InternalClientError``). The statement may have
    committed unheard of: a finish repeated after that is refused by the fence. ``more``:
    other errors to catch with them."""
    return (
        OSError,
        driver.InterfaceError,
        driver.PostgresConnectionError,
        driver.exceptions.OperatorInterventionError,
        driver.exceptions.InternalClientError,
        *more,
    )


def unreachable(driver: Any) -> tuple[type[BaseException], ...]:
    """The errors of a database that cannot be reached, or of a DSN the driver cannot
    read (the standard library's URL parser raises ``ValueError``)."""
    return (OSError, ValueError, driver.PostgresError, driver.InterfaceError)


#: What separates the parts of a connection URI: an unescaped one inside a password
#: makes a parser cut the password there and quote a piece of it in its error.
_URI_PARTS: Final = re.compile(r"[#/?@:&=\s]+")


def _secrets(dsn: str) -> list[str]:
    """What of the DSN no message may show, longest first: the DSN itself, its password
    (as a URI's, up to the last ``@``, so that an unescaped ``#``, ``/``, ``?`` or
    ``@`` in it does not hide the rest; or as a ``password=`` setting), the password
    percent-decoded, and every piece of it between such characters (a parser that cut
    the password there quotes one of the pieces)."""
    passwords: list[str] = []
    _scheme, sep, rest = dsn.partition("://")
    if sep and "@" in rest:
        userinfo = rest[: rest.rindex("@")]
        if ":" in userinfo:
            passwords.append(userinfo.split(":", 1)[1])
    passwords += re.findall(r"password\s*=\s*'((?:[^'\\]|\\.)*)'", dsn)
    passwords += re.findall(r"password\s*=\s*([^'&\s][^&\s]*)", dsn)
    found = {dsn}
    for password in passwords:
        for form in (password, urllib.parse.unquote(password)):
            found.add(form)
            found.update(piece for piece in _URI_PARTS.split(form) if len(piece) > 1)
    return sorted((s for s in found if s), key=len, reverse=True)


def redact(dsn: str, text: str) -> str:
    """``text`` with the DSN and every part of its password replaced by ``***``."""
    for secret in _secrets(dsn):
        text = text.replace(secret, "***")
    return text


def unavailable(name: str, dsn: str, error: BaseException) -> StoreUnavailable:
    """The error of a database that cannot be reached (or a DSN the driver cannot
    read): the driver's reason, with the DSN and every part of its password left
    out."""
    reason = redact(dsn, str(error))
    hint = ""
    if isinstance(error, ValueError):
        hint = (
            " (the DSN cannot be read: a password holding #, /, ?, @ or : must be "
            "percent-encoded in a URI, e.g. # as %23)"
        )
    return StoreUnavailable(
        f"queue {name!r}: cannot reach the database: {type(error).__name__}"
        + (f": {reason}" if reason else "")
        + hint
    )


#: A session's server process, as the server sees it.
_BACKEND: Final = "SELECT pg_backend_pid()"


async def refuse_hidden_pooler(pool: asyncpg.Pool, conn: Any, name: str) -> None:
    """Refuse a pooler in transaction mode between this process and the database when
    ``PgQueue`` was not told of it (``pooler="transaction"``): its clients' named
    prepared statements would go missing, or run another client's statement of the
    same name, and ``LISTEN`` would be heard by nobody.

    A session is the server's own when the server process it runs in is the one the
    connection was told of at start-up (the cancel key, which PgBouncer makes up); it
    costs one statement. Otherwise a pooler is in front, and its mode shows when a
    second session holds a transaction: in transaction mode that session is given the
    server session the first one just used, or the first one's next statement runs in
    another server session (a statement prepared on one is then missing on the other).
    A pooler in session mode never moves a client's session; one in transaction mode
    that happened to keep it through the test is not detected.

    :raises ValueError: a transaction pooler is in front (the message names the
        setting).
    """
    import asyncpg  # noqa: PLC0415

    # A prepared statement missing, doubled or another's: the session moved.
    confused = (
        asyncpg.InvalidSQLStatementNameError,
        asyncpg.DuplicatePreparedStatementError,
        asyncpg.ProtocolViolationError,
    )
    try:
        first = await conn.fetchval(_BACKEND)
        if first == conn.get_server_pid():
            return
        async with pool.acquire() as other, other.transaction():
            second = await other.fetchval(_BACKEND)
            again = await conn.fetchval(_BACKEND)
        moved = second == first or again != first
    except confused:
        moved = True
    if moved:
        raise ValueError(
            f"queue {name!r}: connect(): a connection pooler in transaction mode (such as "
            "PgBouncer's pool_mode = transaction) sits between this process and the "
            "database: give PgQueue(..., pooler='transaction') (the node command: "
            "--pooler transaction), and listen_dsn= a DSN reaching the server directly "
            "(or a session-mode pool) for LISTEN, or nodes poll every `poll` seconds"
        )


async def check_schema(conn: asyncpg.pool.PoolConnectionProxy[Any], name: str) -> None:
    """Refuse a database without envq's schema, or with a schema this envq cannot run
    on (older: migrate it; newer and not compatible: upgrade envq), saying what to do."""
    check(await installed(conn), f"queue {name!r}")


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
    # two reads would count its envelope live and new. The room is the kept counts'
    # (envq.counts), not a count of rows: it costs the same at any backlog.
    ids = [e.id for e in rows if e.id is not None]
    found = await conn.fetchrow(
        "SELECT (SELECT coalesce(sum(n), 0) FROM envq.counts WHERE queue = $1"
        " AND state = ANY($3::envq.envelope_state[])) AS live,"
        " (SELECT count(DISTINCT i) FROM unnest($2::text[]) AS i"
        " WHERE NOT EXISTS (SELECT FROM envq.envelopes AS e WHERE e.queue = $1"
        " AND e.id = i::jsonb AND e.state = ANY($3::envq.envelope_state[]))) AS fresh",
        name,
        ids,
        _LIVE,
    )
    assert found is not None  # an aggregate: always one row
    live = found["live"]
    fresh = len(rows) - len(ids) + found["fresh"]
    # An id live now can only take room later: more new ones than the capacity never fit.
    verdict = rules.room(live, fresh, capacity)
    if verdict is not rules.Room.FITS:
        error = NeverFits if verdict is rules.Room.NEVER else CapacityExceeded
        raise error(f"queue {name!r}: {rules.refusal(verdict, live, fresh, capacity)}")


async def check_capacity(
    conn: asyncpg.pool.PoolConnectionProxy[Any], name: str, count: int, capacity: int
) -> None:
    """Refuse ``count`` envelopes that do not fit the queue's ``capacity`` now
    (:class:`CapacityExceeded`), under the lock of the queue's sends, from the kept
    counts (an operator's retry: its batch is made of ended envelopes, its dedup done)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", name)
    live = await conn.fetchval(
        "SELECT coalesce(sum(n), 0) FROM envq.counts WHERE queue = $1"
        " AND state = ANY($2::envq.envelope_state[])",
        name,
        _LIVE,
    )
    verdict = rules.room(live, count, capacity)
    if verdict is not rules.Room.FITS:
        why = rules.refusal(verdict, live, count, capacity, doing="retry")
        raise CapacityExceeded(f"queue {name!r}: {why}")
