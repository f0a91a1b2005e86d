"""The ``envq`` command line: ``python -m envq demo [--duration S] [--seed N] [--workers N]``.

``main(argv)`` is also the ``envq`` console script.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from envq._demo import DemoOptions, run_demo

__all__ = ["build_parser", "main"]


def _duration(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 1.0:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text!r}")
    return value


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``envq`` command."""
    parser = argparse.ArgumentParser(
        prog="envq", description="envq: an asyncio in-process queue and scheduler."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a small workload on a real event loop and narrate what the queue does",
        description=(
            "Run emails with retries, a periodic collector with a deadline, a blacklisted "
            "report type, backpressure, a stop/restart and a final terminate, printing "
            "every step. Exit code 0 on success, 130 after Ctrl-C."
        ),
    )
    demo.add_argument(
        "--duration",
        type=_duration,
        default=6.0,
        metavar="SECONDS",
        help="real seconds of workload (default 6, at least 1)",
    )
    demo.add_argument(
        "--seed", type=int, default=7, metavar="N", help="seed of the failure plan (default 7)"
    )
    demo.add_argument(
        "--workers", type=_workers, default=4, metavar="N", help="queue workers (default 4)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envq`` command line with ``argv`` (default ``sys.argv[1:]``); return
    the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return run_demo(DemoOptions(duration=args.duration, seed=args.seed, workers=args.workers))
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
