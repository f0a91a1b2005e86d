"""``python -m envq.postgres.node``: run one worker node of a PostgreSQL queue.

The node joins the named queue (starting it when it is not running), runs up to
``--workers`` attempts at once, and leaves on SIGTERM or SIGINT: it stops claiming,
lets its attempts in flight end, and closes its connections (the shared queue goes
on). The envelopes' callables are imported by name, so the node's ``PYTHONPATH`` must
reach their modules. The DSN is read from ``$ENVQ_DSN`` unless ``--dsn`` is given
(an argument shows in the process list; the environment does not).

Behind a connection pooler in transaction mode (PgBouncer's ``pool_mode =
transaction``), give ``--pooler transaction``; the session that listens for sends then
connects to ``$ENVQ_LISTEN_DSN`` (the server itself, or a pool in session mode), and
without it the node polls every ``--poll`` seconds. A database the node refuses to
run on (no envq schema, another version, a transaction pooler it was not told of, a
capacity of its own) ends it with the reason on stderr and exit status 1.

With ``--metrics-port``, the node serves its Prometheus metrics on
``http://<--metrics-host>:<port>/metrics`` (:func:`envq.prometheus_metrics` of its
queue: the shared queue's counts read from the database per scrape, this node's
attempts; needs the ``envq[prometheus]`` extra) and prints ``metrics <url>``. With
``--log-attempts`` it logs one record per attempt (:func:`envq.logging_stamp`: the
envelope, its outcome, its duration) on the ``envq.stamp`` logger at INFO.

It prints ``ready <node>`` on stdout once it serves, for scripts that wait for it, and
``left <node> <counts>`` once it has left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Final

from envq._stamps import logging_stamp
from envq.postgres._edges import POOLERS, StoreUnavailable
from envq.postgres._queue import PgQueue

__all__ = ["main"]


#: The levels ``--log`` accepts.
_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


async def _run(args: argparse.Namespace, queue: PgQueue) -> str | None:
    """Serve until told to leave; the reason the database was refused, if it was."""
    try:
        if args.install:
            await queue.install()
        await queue.connect()
    except (RuntimeError, ValueError, StoreUnavailable) as error:
        return str(error)  # (never shows the DSN's password)
    leave = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, leave.set)
    with contextlib.ExitStack() as metrics:
        if args.metrics_port is not None:
            try:
                from envq._metrics import prometheus_metrics, serve_metrics  # noqa: PLC0415

                metrics.callback(prometheus_metrics(queue).close)
                server = serve_metrics(args.metrics_port, host=args.metrics_host)
            except (ImportError, OSError) as error:
                await queue.close()
                return f"--metrics-port: {error}"
            metrics.callback(server.close)
            print(f"metrics {server.url}", flush=True)
        async with queue:
            await queue.start()
            print(f"ready {queue.node}", flush=True)
            await leave.wait()
    print(f"left {queue.node} {queue.counts_local}", flush=True)
    return None


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
    parser.add_argument(
        "--install",
        action="store_true",
        help="create the schema if missing, or upgrade an older one",
    )
    parser.add_argument(
        "--pooler",
        choices=POOLERS,
        help="the DSN reaches the database through a pooler in this mode (listen on "
        "$ENVQ_LISTEN_DSN, or poll)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (0: a free one; needs envq[prometheus])",
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="the metrics' address (127.0.0.1)"
    )
    parser.add_argument(
        "--log-attempts", action="store_true", help="log one record per attempt (INFO)"
    )
    parser.add_argument(
        "--log", default="WARNING", type=str.upper, choices=_LEVELS, help="log level"
    )
    args = parser.parse_args(argv)
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be from 0 to 65535, not {args.metrics_port}")
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
            pooler=args.pooler,
            listen_dsn=os.environ.get("ENVQ_LISTEN_DSN") or None,
            stamps=(logging_stamp(),) if args.log_attempts else (),
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    logging.basicConfig(level=args.log, stream=sys.stderr)
    if args.log_attempts:
        logging.getLogger("envq.stamp").setLevel(logging.INFO)
    refused = asyncio.run(_run(args, queue))
    if refused is not None:
        sys.stderr.write(f"{parser.prog}: {refused}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
