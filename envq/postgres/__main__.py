"""``python -m envq.postgres``: an operator's command line for envq's PostgreSQL queues.

Subcommands::

    install            create envq's schema, or upgrade it (keeps every envelope)
    migrate            upgrade envq's schema to this release's version
    status             queues: lifecycle state, capacity, envelopes per state, nodes

The database is ``--dsn`` or ``$ENVQ_DSN`` (the environment keeps it out of the process
list); no output ever shows its password. ``--json`` prints machine-readable output.

Exit status: 0 done; 1 refused (a schema this envq cannot run on or upgrade, a queue or
envelope not found, a move the tables do not allow); 2 usage (a bad argument); 3 the
database cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, Final, NoReturn, TextIO

from envq.postgres import migrations
from envq.postgres._edges import check_dsn, redact, unreachable
from envq.postgres.schema import SCHEMA_VERSION

__all__ = ["EXIT_REFUSED", "EXIT_UNREACHABLE", "EXIT_USAGE", "main"]

#: Exit status: the request was refused (see the message).
EXIT_REFUSED: Final = 1
#: Exit status: a bad argument.
EXIT_USAGE: Final = 2
#: Exit status: the database cannot be reached.
EXIT_UNREACHABLE: Final = 3


class _Refused(Exception):
    """What the command was asked cannot be done (exit 1)."""


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
    return parser


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
    found, now = await migrations.install(conn)
    if found is None:
        text = f"installed envq's schema, version {now}"
    elif found == now:
        text = f"envq's schema is at version {now}: nothing to do"
    else:
        text = f"upgraded envq's schema from version {found} to {now}"
    _say(out, args, {"from": found, "to": now}, text)


async def _migrate(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    found = await migrations.installed(conn)
    if found is None:
        raise _Refused("the database has no envq schema: run `python -m envq.postgres install`")
    if args.dry_run:
        try:
            pending = migrations.steps(found.version)
        except RuntimeError as error:
            raise _Refused(str(error)) from None
        if found.version > SCHEMA_VERSION:
            migrations.check(found, "migrate")
        text = f"envq's schema is at version {found.version}: would apply " + (
            ", ".join(f"{v:04d}.sql" for v in pending) if pending else "nothing"
        )
        _say(out, args, {"from": found.version, "pending": pending}, text)
        return
    await _install(conn, args, out)


_STATUS: Final = """
SELECT q.name, q.state::text AS state, q.capacity, q.blacklist,
       coalesce((SELECT jsonb_object_agg(s.state, s.n) FROM
                   (SELECT e.state::text AS state, count(*) AS n FROM envq.envelopes AS e
                     WHERE e.queue = q.name GROUP BY e.state) AS s), '{}'::jsonb) AS counts,
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


async def _status(conn: Any, args: argparse.Namespace, out: TextIO) -> None:
    migrations.check(await migrations.installed(conn), "status")
    rows = await conn.fetch(_STATUS, args.queue)
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
    _say(out, args, {"queues": queues}, "\n".join(lines) or "no queues")


_COMMANDS: Final = {"install": _install, "migrate": _migrate, "status": _status}


async def _main(dsn: str, args: argparse.Namespace, out: TextIO) -> None:
    conn = await _connect(dsn)
    try:
        await _COMMANDS[args.command](conn, args, out)
    finally:
        await conn.close()


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run one subcommand; the exit status (see the module's docstring)."""
    out = out or sys.stdout
    parser = _parser()
    args = parser.parse_args(argv)
    dsn = _dsn(parser, args)
    try:
        import asyncpg  # noqa: PLC0415
    except ImportError:
        _fail(EXIT_USAGE, "envq.postgres needs asyncpg: pip install 'envq[postgres]'")
    try:
        asyncio.run(_main(dsn, args, out))
    except (_Refused, RuntimeError) as error:
        _fail(EXIT_REFUSED, redact(dsn, str(error)))
    except unreachable(asyncpg) as error:
        reason = redact(dsn, f"{type(error).__name__}: {error}")
        _fail(EXIT_UNREACHABLE, f"cannot reach the database: {reason}")
    return 0


def _fail(code: int, message: str) -> NoReturn:
    sys.stderr.write(f"python -m envq.postgres: {message}\n")
    raise SystemExit(code)


if __name__ == "__main__":
    raise SystemExit(main())
