"""``python -m envq.postgres.node``: run one worker node of a PostgreSQL queue.

The node joins the named queue (starting it when it is not running), runs up to
``--workers`` attempts at once, and leaves on SIGTERM or SIGINT: it stops claiming,
lets its attempts in flight end, and closes its connections (the shared queue goes
on). The envelopes' callables are imported by name, so the node's ``PYTHONPATH`` must
reach their modules. The DSN is read from ``$ENVQ_DSN`` unless ``--dsn`` is given
(an argument shows in the process list; the environment does not).

It prints ``ready <node>`` on stdout once it serves, for scripts that wait for it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Final

from envq.postgres._queue import PgQueue

__all__ = ["main"]


#: The levels ``--log`` accepts.
_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


async def _run(args: argparse.Namespace, queue: PgQueue) -> None:
    if args.install:
        await queue.install()
    leave = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, leave.set)
    async with queue:
        await queue.start()
        print(f"ready {queue.node}", flush=True)
        await leave.wait()
    print(f"left {queue.node} {queue.counts_local}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a node until SIGTERM / SIGINT; exit status 0 after a clean leave."""
    parser = argparse.ArgumentParser(
        prog="python -m envq.postgres.node", description="Run one worker node of a queue."
    )
    parser.add_argument("--dsn", help="the database (default: $ENVQ_DSN)")
    parser.add_argument("--queue", default="default", help="the queue's name")
    parser.add_argument("--workers", type=int, default=10, help="attempts at once")
    parser.add_argument("--lease", type=float, default=30.0, help="lease seconds")
    parser.add_argument("--poll", type=float, default=1.0, help="poll seconds")
    parser.add_argument("--node", help="this node's name (default: host-pid-random)")
    parser.add_argument("--install", action="store_true", help="create the schema if missing")
    parser.add_argument(
        "--log", default="WARNING", type=str.upper, choices=_LEVELS, help="log level"
    )
    args = parser.parse_args(argv)
    dsn = args.dsn or os.environ.get("ENVQ_DSN")
    if not dsn:
        parser.error("give --dsn or set ENVQ_DSN")
    try:
        # The queue checks its parameters: a bad one is a usage error, not a traceback
        # (the message names the parameter, never the DSN's password).
        queue = PgQueue(
            dsn,
            args.queue,
            workers=args.workers,
            lease=args.lease,
            poll=args.poll,
            node=args.node,
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log, stream=sys.stderr)
    asyncio.run(_run(args, queue))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
