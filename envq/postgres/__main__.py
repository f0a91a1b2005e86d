"""``python -m envq.postgres``: an operator's command line for envq's PostgreSQL queues.

Subcommands::

    install            create envq's schema, or upgrade it (keeps every envelope)
    migrate            upgrade envq's schema to this release's version
    status             queues: lifecycle state, capacity, envelopes per state, nodes
    list               envelopes by queue, state, type, id (a page at a time)
    show ID            one envelope: its row, its last error, its failed attempts
    retry ID...        send envelopes that ended FAILED or STOPPED back
    cancel ID...       cancel live envelopes (a running one is asked to stop)
    purge --older-than AGE
                       remove ended envelopes that ended before AGE ago

An ID is an envelope's ``id`` as JSON (``42``, ``"order-7"``; a bare word is a string),
or, with ``--seq``, its row's number (``list`` shows both). ``retry`` and ``cancel``
are the calls of ``PgQueue`` (:meth:`~envq.postgres.PgQueue.retry`,
:meth:`~envq.postgres.PgQueue.cancel`): moves of the tables the database checks.

The database is ``--dsn`` or ``$ENVQ_DSN`` (the environment keeps it out of the process
list); no output ever shows its password. ``--json`` prints machine-readable output.

Exit status: 0 done; 1 refused (a schema this envq cannot run on or upgrade, a queue or
envelope not found, a move the tables do not allow); 2 usage (a bad argument); 3 the
database cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, Final, NoReturn, TextIO

from envq._errors import EnvqError
from envq.postgres._edges import StoreUnavailable, check_dsn, redact, unreachable
from envq.postgres.migrations import check, install, installed, steps
from envq.postgres.schema import SCHEMA_VERSION, STORED_STATES

__all__ = ["EXIT_REFUSED", "EXIT_UNREACHABLE", "EXIT_USAGE", "main"]

#: Exit status: the request was refused (see the message).
EXIT_REFUSED: Final = 1
#: Exit status: a bad argument.
EXIT_USAGE: Final = 2
#: Exit status: the database cannot be reached.
EXIT_UNREACHABLE: Final = 3


class _Refused(Exception):
    """What the command was asked cannot be done (exit 1)."""


class _Usage(Exception):
    """A bad argument found after parsing (exit 2)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m envq.postgres",
        description="Look at and act on envq's queues in a PostgreSQL database.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help="the database (default: $ENVQ_DSN)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser(
        "install",
        parents=[common],
        help="create envq's schema, or upgrade it",
        description="Create envq's schema in the database, or upgrade it to this "
        "release's version (every envelope is kept).",
    )
    migrate = sub.add_parser(
        "migrate",
        parents=[common],
        help="upgrade envq's schema",
        description="Upgrade envq's schema to this release's version, in one transaction "
        "under a lock (every envelope is kept).",
    )
    migrate.add_argument(
        "--dry-run", action="store_true", help="say what would be applied, apply nothing"
    )
    status = sub.add_parser(
        "status",
        parents=[common],
        help="queues, their envelopes per state, and their nodes",
        description="Each queue: lifecycle state, capacity, envelopes per state, and the "
        "nodes holding leases.",
    )
    status.add_argument("--queue", help="only this queue")
    listing = sub.add_parser(
        "list",
        parents=[common],
        help="envelopes by queue, state, type and id",
        description="Envelopes, in row order, a page at a time (--after the last seq seen).",
    )
    listing.add_argument("--queue", help="only this queue")
    listing.add_argument(
        "--state", action="append", choices=_STATES, help="only this state (repeatable)"
    )
    listing.add_argument("--type", help="only this envelope type")
    listing.add_argument("--id", help="only this id (JSON, or a bare word)")
    listing.add_argument("--after", type=int, default=0, help="rows after this seq")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (1-10000)")
    show = sub.add_parser(
        "show",
        parents=[common],
        help="one envelope, its last error and its failed attempts",
        description="One envelope's row (the latest with this id), its payload, its last "
        "error with the traceback, and its failed attempts.",
    )
    show.add_argument("key", metavar="ID", help="its id (JSON, or a bare word), or its seq")
    show.add_argument("--seq", action="store_true", help="ID is the row's seq")
    show.add_argument("--queue", help="the queue (needed when several hold the id)")
    for name, what in (
        ("retry", "send envelopes that ended FAILED or STOPPED back"),
        ("cancel", "cancel live envelopes (a running one is asked to stop)"),
    ):
        act = sub.add_parser(name, parents=[common], help=what, description=what + ".")
        act.add_argument("keys", metavar="ID", nargs="+", help="ids (JSON, or bare words)")
        act.add_argument("--seq", action="store_true", help="the IDs are rows' seqs")
        act.add_argument("--queue", required=True, help="the queue")
    purge = sub.add_parser(
        "purge",
        parents=[common],
        help="remove ended envelopes older than an age",
        description="Remove the envelopes that ended (SUCCEEDED, FAILED, STOPPED) before "
        "the age given (e.g. 7d, 12h, 30m, 90s).",
    )
    purge.add_argument("--older-than", required=True, type=_age, help="an age: 7d, 12h, 90s")
    purge.add_argument("--queue", help="only this queue (default: every queue)")
    return parser


#: The states ``list`` filters by.
_STATES: Final = [s.value for s in STORED_STATES]


def _age(text: str) -> float:
    """An age as ``<number><unit>`` (s, m, h, d), in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = text[:-1], text[-1:]
    if unit not in units:
        number, unit = text, "s"
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an age: {text!r} (e.g. 7d, 12h, 30m, 90s)") from None
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"not an age: {text!r}")
    return seconds


def _key(text: str) -> object:
    """An id as an operator types it: JSON, or a bare word as a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _dsn(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    dsn = args.dsn or os.environ.get("ENVQ_DSN")
    if not dsn:
        parser.error("give --dsn or set ENVQ_DSN")
    try:
        return check_dsn("--dsn", dsn)
    except (TypeError, ValueError) as error:
        parser.error(str(error))


async def _connect(dsn: str) -> Any:
    import asyncpg  # noqa: PLC0415 - the extra is optional

    # No named prepared statements: the commands run as well through a pooler in
    # transaction mode (each statement may run in another server session).
    return await asyncpg.connect(dsn, statement_cache_size=0)


def _say(out: TextIO, args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if args.json:
        json.dump(data, out, indent=2, default=str)
        out.write("\n")
    else:
        out.write(text.rstrip("\n") + "\n")


async def _install(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    found, now = await install(conn)
    if found is None:
        text = f"installed envq's schema, version {now}"
    elif found == now:
        text = f"envq's schema is at version {now}: nothing to do"
    else:
        text = f"upgraded envq's schema from version {found} to {now}"
    _say(out, args, {"from": found, "to": now}, text)


async def _migrate(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    found = await installed(conn)
    if found is None:
        raise _Refused("the database has no envq schema: run `python -m envq.postgres install`")
    if args.dry_run:
        try:
            pending = steps(found.version)
        except RuntimeError as error:
            raise _Refused(str(error)) from None
        if found.version > SCHEMA_VERSION:
            check(found, "migrate")
        text = f"envq's schema is at version {found.version}: would apply " + (
            ", ".join(f"{v:04d}.sql" for v in pending) if pending else "nothing"
        )
        _say(out, args, {"from": found.version, "pending": pending}, text)
        return
    await _install(conn, args, out)


_STATUS: Final = """
SELECT q.name, q.state::text AS state, q.capacity, q.blacklist,
       coalesce((SELECT jsonb_object_agg(s.state, s.n) FROM
                   (SELECT c.state::text AS state, sum(c.n) AS n FROM envq.counts AS c
                     WHERE c.queue = q.name GROUP BY c.state HAVING sum(c.n) <> 0) AS s),
                '{}'::jsonb) AS counts,
       coalesce((SELECT jsonb_agg(jsonb_build_object('owner', l.owner, 'running', l.n,
                                                     'expires_in_s', l.expires)
                                  ORDER BY l.owner) FROM
                   (SELECT e.lease_owner AS owner, count(*) AS n,
                           round(extract(epoch FROM min(e.lease_expires_at)
                                 - clock_timestamp())::numeric, 3) AS expires
                      FROM envq.envelopes AS e
                     WHERE e.queue = q.name AND e.state = 'running'
                     GROUP BY e.lease_owner) AS l), '[]'::jsonb) AS nodes
  FROM envq.queues AS q
 WHERE $1::text IS NULL OR q.name = $1
 ORDER BY q.name
"""


#: The nodes connected to this database: envq's sessions name themselves ``envq:<node>``
#: (pg_stat_activity shows every role's ``application_name``).
_CONNECTED: Final = """
SELECT substr(a.application_name, 6) AS node, count(*) AS sessions,
       min(a.backend_start) AS since, min(host(a.client_addr)) AS client
  FROM pg_stat_activity AS a
 WHERE a.datname = current_database() AND a.application_name LIKE 'envq:%'
   AND a.pid <> pg_backend_pid()
 GROUP BY 1 ORDER BY 1
"""


async def _status(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    check(await installed(conn), "status")
    rows = await conn.fetch(_STATUS, args.queue)
    connected = [
        {
            "node": r["node"],
            "sessions": r["sessions"],
            "since": r["since"].isoformat() if r["since"] is not None else None,
            "client": r["client"],
        }
        for r in await conn.fetch(_CONNECTED)
    ]
    if args.queue is not None and not rows:
        raise _Refused(f"no queue named {args.queue!r}")
    queues = [
        {
            "name": r["name"],
            "state": r["state"],
            "capacity": r["capacity"],
            "blacklist": list(r["blacklist"]),
            "counts": json.loads(r["counts"]),
            "nodes": json.loads(r["nodes"]),
        }
        for r in rows
    ]
    lines = []
    for q in queues:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(q["counts"].items())) or "empty"
        cap = q["capacity"] or "unlimited"
        lines.append(f"{q['name']}: {q['state']}, capacity {cap}: {counts}")
        if q["blacklist"]:
            lines.append(f"  blacklisted types: {', '.join(q['blacklist'])}")
        for node in q["nodes"]:
            lines.append(
                f"  node {node['owner']}: {node['running']} running, earliest lease "
                f"expires in {node['expires_in_s']} s"
            )
    if not queues:
        lines.append("no queues")
    lines.append(f"nodes connected: {len(connected)}")
    for node in connected:
        where = f" from {node['client']}" if node["client"] else ""
        lines.append(
            f"  {node['node']}: {node['sessions']} session(s){where} since {node['since']}"
        )
    _say(out, args, {"queues": queues, "connected": connected}, "\n".join(lines))


_LIST: Final = """
SELECT e.seq, e.queue, e.id, e.type, e.state::text AS state, e.attempt, e.updated_at,
       e.last_error ->> 'type' AS error
  FROM envq.envelopes AS e
 WHERE ($1::text IS NULL OR e.queue = $1) AND ($2::text[] IS NULL OR e.state::text = ANY($2))
   AND ($3::text IS NULL OR e.type = $3) AND ($4::jsonb IS NULL OR e.id = $4)
   AND e.seq > $5
 ORDER BY e.seq
 LIMIT $6
"""


async def _list(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    check(await installed(conn), "list")
    if not 1 <= args.limit <= 10_000:
        raise _Usage(f"--limit must be from 1 to 10000, got {args.limit}")
    ident = None if args.id is None else json.dumps(_key(args.id))
    rows = await conn.fetch(_LIST, args.queue, args.state, args.type, ident, args.after, args.limit)
    found = [
        {
            "seq": r["seq"],
            "queue": r["queue"],
            "id": None if r["id"] is None else json.loads(r["id"]),
            "type": r["type"],
            "state": r["state"],
            "attempt": r["attempt"],
            "updated_at": r["updated_at"].isoformat(),
            "error": r["error"],
        }
        for r in rows
    ]
    lines = [
        f"{e['seq']:>8}  {e['queue']}  {e['state']:<9}  attempt {e['attempt']}  "
        f"id {json.dumps(e['id'])}  type {e['type'] or '-'}  {e['updated_at']}"
        + (f"  error {e['error']}" if e["error"] else "")
        for e in found
    ]
    _say(out, args, {"envelopes": found}, "\n".join(lines) or "no envelopes")


async def _show(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    check(await installed(conn), "show")
    if args.seq:
        seq = _seq(args.key)
        rows = await conn.fetch("SELECT * FROM envq.envelopes WHERE seq = $1", seq)
    else:
        rows = await conn.fetch(
            "SELECT DISTINCT ON (queue) * FROM envq.envelopes WHERE id = $1::jsonb"
            " AND ($2::text IS NULL OR queue = $2) ORDER BY queue, seq DESC",
            json.dumps(_key(args.key)),
            args.queue,
        )
    if not rows:
        raise _Refused(
            f"no envelope {args.key}" + (f" in queue {args.queue!r}" if args.queue else "")
        )
    if len(rows) > 1:
        queues = ", ".join(repr(r["queue"]) for r in rows)
        raise _Refused(f"envelope {args.key} is in several queues ({queues}): give --queue")
    r = rows[0]
    data = {
        "seq": r["seq"],
        "queue": r["queue"],
        "id": None if r["id"] is None else json.loads(r["id"]),
        "type": r["type"],
        "state": r["state"],
        "kind": r["kind"],
        "attempt": r["attempt"],
        "invoke": r["invoke"],
        "payload": None if r["payload"] is None else json.loads(r["payload"]),
        "created_at": r["created_at"].isoformat(),
        "updated_at": r["updated_at"].isoformat(),
        "due_at": None if r["due_at"] is None else r["due_at"].isoformat(),
        "lease_owner": r["lease_owner"],
        "last_error": None if r["last_error"] is None else json.loads(r["last_error"]),
        "history": [] if r["history"] is None else json.loads(r["history"]),
    }
    lines = [
        f"{k}: {json.dumps(v) if k in ('id', 'payload') else v}"
        for k, v in data.items()
        if k not in ("last_error", "history")
    ]
    error = data["last_error"]
    if error:
        lines += ["last error:", f"  {error['type']}: {error['message']}"]
        lines += ["  " + line for line in error["traceback"].rstrip().splitlines()]
    if data["history"]:
        lines.append("failed attempts:")
    for h in data["history"]:
        what = "" if not h.get("error") else f"  {h['error']['type']}: {h['error']['message']}"
        outcome = str(h["outcome"]).removeprefix("attempt_")
        lines.append(
            f"  {h['attempt']}  {outcome}  on {h['node']}  {_when(h.get('started'))}"
            f" -> {_when(h.get('ended'))}{what}"
        )
    _say(out, args, data, "\n".join(lines))


def _when(epoch: object) -> str:
    """A time of the story (seconds since the epoch) as UTC ISO 8601."""
    if not isinstance(epoch, int | float):
        return "?"
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat(timespec="milliseconds")


def _seq(text: str) -> int:
    try:
        seq = int(text)
    except ValueError:
        raise _Usage(f"a seq is a positive integer, got {text!r}") from None
    if seq < 1:
        raise _Usage(f"a seq is a positive integer, got {text!r}")
    return seq


async def _act(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    """retry / cancel through PgQueue: the same calls as the Python API."""
    check(await installed(conn), args.command)
    if not await conn.fetchval(
        "SELECT EXISTS (SELECT FROM envq.queues WHERE name = $1)", args.queue
    ):
        raise _Refused(f"no queue named {args.queue!r}")
    from envq.postgres._queue import PgQueue  # noqa: PLC0415

    queue = PgQueue(args.dsn_resolved, args.queue, workers=0)
    await queue.connect()
    try:
        call = queue.retry if args.command == "retry" else queue.cancel
        if args.seq:
            done = await call(seqs=[_seq(k) for k in args.keys])
        else:
            done = await call(*(_key(k) for k in args.keys))
    finally:
        await queue.close()
    verb = "sent back" if args.command == "retry" else "cancelled"
    _say(out, args, {args.command: done}, f"{done} envelope(s) {verb}")
    if done == 0:
        raise _Refused(f"no envelope {verb} (none named is in a state it may leave so)")


async def _purge(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    check(await installed(conn), "purge")
    names = (
        [args.queue]
        if args.queue
        else [r[0] for r in await conn.fetch("SELECT name FROM envq.queues ORDER BY name")]
    )
    if args.queue and not await conn.fetchval(
        "SELECT EXISTS (SELECT FROM envq.queues WHERE name = $1)", args.queue
    ):
        raise _Refused(f"no queue named {args.queue!r}")
    from envq.postgres._queue import PgQueue  # noqa: PLC0415

    removed: dict[str, int] = {}
    for name in names:
        queue = PgQueue(args.dsn_resolved, name, workers=0)
        await queue.connect()
        try:
            removed[name] = await queue.purge(args.older_than)
        finally:
            await queue.close()
    text = "\n".join(f"{name}: {n} removed" for name, n in removed.items()) or "no queues"
    _say(out, args, {"removed": removed}, text)


_COMMANDS: Final = {
    "install": _install,
    "migrate": _migrate,
    "status": _status,
    "list": _list,
    "show": _show,
    "retry": _act,
    "cancel": _act,
    "purge": _purge,
}


class _Unreachable(Exception):
    """The database cannot be reached (exit 3)."""


async def _main(dsn: str, args: argparse.Namespace, out: TextIO) -> None:
    import asyncpg  # noqa: PLC0415

    try:
        conn = await _connect(dsn)
    except unreachable(asyncpg) as error:
        raise _Unreachable(f"{type(error).__name__}: {error}") from None
    try:
        await _COMMANDS[args.command](conn, args, out)
    finally:
        await conn.close()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run one subcommand; the exit status (see the module's docstring)."""
    out = out or sys.stdout
    parser = _parser()
    args = parser.parse_args(argv)
    dsn = args.dsn_resolved = _dsn(parser, args)
    try:
        import asyncpg  # noqa: PLC0415
    except ImportError:
        _fail(EXIT_USAGE, "envq.postgres needs asyncpg: pip install 'envq[postgres]'")
    try:
        asyncio.run(_main(dsn, args, out))
    except _Usage as error:
        _fail(EXIT_USAGE, redact(dsn, str(error)))
    except (_Unreachable, StoreUnavailable) as error:
        _fail(EXIT_UNREACHABLE, f"cannot reach the database: {redact(dsn, str(error))}")
    except (_Refused, RuntimeError, EnvqError, TypeError, ValueError) as error:
        _fail(EXIT_REFUSED, redact(dsn, str(error)))
    except unreachable(asyncpg) as error:  # lost in the middle of a command
        reason = redact(dsn, f"{type(error).__name__}: {error}")
        _fail(EXIT_UNREACHABLE, f"cannot reach the database: {reason}")
    return 0


def _fail(code: int, message: str) -> NoReturn:
    sys.stderr.write(f"python -m envq.postgres: {message}\n")
    raise SystemExit(code)


if __name__ == "__main__":
    raise SystemExit(main())
