"""The ``envq`` command line.

* ``envq demo [--duration S] [--seed N] [--workers N] [--metrics-port PORT] [--live|--plain]``
  runs the narrated demo (:mod:`envq.demo`);
* ``envq spec [--format text|markdown|json]`` prints the runtime's lifecycle and outcome
  tables (:mod:`envq._machine`), the ones the queue executes; ``envq spec --write``
  regenerates ``specs/`` and the generated blocks of ``docs/`` from them and the models,
  ``envq spec --check`` fails when one is stale (:mod:`envq.model.specgen`; a source
  checkout and the conform extra);
* ``envq explore [--depth N] [--show N]`` explores every small scope of an abstract
  queue driven by the tables, checking the invariants (:mod:`envq.model.explore`;
  needs ``envq[conform]``);
* ``envq conform [options] -- CMD ARGS...`` checks a port of envq through a driver
  (:mod:`envq.conform`; needs ``envq[conform]``);
* ``envq web [--dsn DSN] [--host HOST] [--port PORT]`` serves every queue of a
  PostgreSQL database in a browser (:mod:`envq.web`; needs ``envq[web,postgres]``);
* ``envq --version`` prints the installed version.

``main(argv)`` is also the ``envq`` console script.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from envq import __version__
from envq.demo import DemoOptions, run_demo
from envq.model.specdata import spec_data

__all__ = ["build_parser", "main", "render_spec", "spec_data"]

#: The formats of ``envq spec``.
SPEC_FORMATS: Final = ("text", "markdown", "json")


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


def _envelopes(text: str) -> int:
    value = _workers(text)
    if not 10 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be from 10 to 100000, got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0: any free port), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``envq`` command."""
    parser = argparse.ArgumentParser(
        prog="envq", description="envq: an asyncio in-process queue and scheduler."
    )
    parser.add_argument("-V", "--version", action="version", version=f"envq {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a small workload on a real event loop and narrate what the queue does",
        description=(
            "Run emails with retries, a periodic collector with a deadline, a blacklisted "
            "report type, backpressure, a stop/restart and a final terminate, printing "
            "every step (a live table instead when stdout is a terminal and rich is "
            "installed). Exit code 0 on success, 130 after Ctrl-C."
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
    demo.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help=(
            "serve Prometheus metrics on http://127.0.0.1:PORT/metrics while the demo runs "
            "(0: any free port; needs prometheus_client)"
        ),
    )
    demo.add_argument(
        "--postgres",
        action="store_true",
        help=(
            "the PostgreSQL demo instead: worker processes share a queue, one is killed "
            "mid-run, nothing is lost (a throwaway server unless --dsn or $ENVQ_DSN)"
        ),
    )
    demo.add_argument("--dsn", default=None, help="the database of --postgres")
    demo.add_argument(
        "--web",
        type=int,
        default=None,
        metavar="PORT",
        help=(
            "with --postgres: serve the dashboard (envq web) of the demo's database on "
            "http://127.0.0.1:PORT/ while it runs, at a pace a person can follow "
            "(0: any free port; needs envq[web])"
        ),
    )
    demo.add_argument(
        "--envelopes",
        type=_envelopes,
        default=400,
        metavar="N",
        help="with --postgres: how many envelopes the producer sends (default 400, 10 to 100000)",
    )
    view = demo.add_mutually_exclusive_group()
    view.add_argument(
        "--live",
        dest="live",
        action="store_const",
        const=True,
        default=None,
        help="show the live view even when stdout is not a terminal (needs rich)",
    )
    view.add_argument(
        "--plain",
        dest="live",
        action="store_const",
        const=False,
        help="print the plain narration even on a terminal",
    )
    spec = commands.add_parser(
        "spec",
        help="print the lifecycle and outcome tables the runtime executes",
        description=(
            "Print envq's state machines as the queue runs them: the lifecycle table "
            "(queue state x call), the outcome table ((kind, outcome) of an attempt) "
            "and the choices their rows may make."
        ),
    )
    commands.add_parser(
        "conform",
        help="check a port of envq through a driver (envq conform --help)",
        add_help=False,
    )
    spec.add_argument(
        "--format",
        choices=SPEC_FORMATS,
        default="text",
        help="text (default), markdown or json",
    )
    generated = spec.add_mutually_exclusive_group()
    generated.add_argument(
        "--write",
        action="store_true",
        help="regenerate specs/ and the generated blocks of docs/ (a source checkout)",
    )
    generated.add_argument(
        "--check",
        action="store_true",
        help="exit 1 and list the generated files that differ from a fresh generation",
    )
    spec.add_argument(
        "--root",
        type=Path,
        default=None,
        metavar="DIR",
        help="the source checkout (default: the one envq is imported from, else .)",
    )
    explore = commands.add_parser(
        "explore",
        help="explore every small scope of an abstract queue driven by the tables",
        description=(
            "Breadth-first search of every state an abstract queue (a few envelopes, "
            "a capacity) reaches within DEPTH operations, its moves driven by the "
            "runtime tables, checking the invariants at every state and edge. Exit code "
            "1 on a violation or a table entry no scope exercised."
        ),
    )
    explore.add_argument(
        "--depth", type=_workers, default=12, metavar="N", help="operations per path (12)"
    )
    explore.add_argument(
        "--show", type=int, default=10, metavar="N", help="violations to print per scope (10)"
    )
    web = commands.add_parser(
        "web",
        help="serve every queue of a PostgreSQL database in a browser",
        description=(
            "Serve the dashboard (envq.web) of every queue of a PostgreSQL database: the "
            "machines with live counts, envelopes, schedules, nodes and leases. Read-only "
            "unless $ENVQ_WEB_TOKEN holds an action token (at least 16 characters)."
        ),
    )
    web.add_argument(
        "--dsn", default=None, help="the database (default: $ENVQ_DSN, which keeps it out of ps)"
    )
    web.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)"
    )
    web.add_argument(
        "--port", type=_port, default=8000, metavar="PORT", help="default 8000 (0: any free port)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envq`` command line with ``argv`` (default ``sys.argv[1:]``); return
    the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["conform"]:
        return _conform(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "demo" and args.postgres:
        from envq.postgres.demo import run_pg_demo  # noqa: PLC0415 - needs asyncpg

        return run_pg_demo(args.dsn, count=args.envelopes, web=args.web)
    if args.command == "demo":
        return run_demo(
            DemoOptions(
                duration=args.duration,
                seed=args.seed,
                workers=args.workers,
                metrics_port=args.metrics_port,
                live=args.live,
            )
        )
    if args.command == "spec":
        if args.write or args.check:
            return _generate(args.root, check=args.check)
        sys.stdout.write(render_spec(args.format))
        return 0
    if args.command == "explore":
        return _explore(args.depth, args.show)
    if args.command == "web":
        try:
            from envq.web._cli import serve  # noqa: PLC0415 - the web extra
        except ImportError as exc:
            sys.stderr.write(
                f"envq web needs the web extra ({exc.name} is missing): "
                "pip install 'envq[web,postgres]'\n"
            )
            return 2
        return serve(args.dsn, args.host, args.port)
    parser.print_help(sys.stderr)
    return 2


def _conform(argv: list[str]) -> int:
    try:
        from envq.conform.cli import main as conform_main  # noqa: PLC0415 - an extra's
    except ImportError as exc:
        sys.stderr.write(
            f"envq conform needs the conform extra ({exc.name} is missing): "
            "pip install 'envq[conform]'\n"
        )
        return 2
    return conform_main(argv)


def _needs_models(what: str, exc: ImportError) -> int:
    sys.stderr.write(
        f"envq {what} needs the conform extra ({exc.name} is missing): "
        "pip install 'envq[conform]'\n"
    )
    return 2


def _generate(root: Path | None, *, check: bool) -> int:
    try:
        from envq.model import specgen  # noqa: PLC0415 - an extra's
    except ImportError as exc:
        return _needs_models("spec --write/--check", exc)
    root = specgen.default_root() if root is None else root
    if not (root / "specs").is_dir():
        sys.stderr.write(f"envq spec: {root} is not a source checkout (no specs/)\n")
        return 2
    files = specgen.generate(root)
    if check:
        stale = specgen.check(files)
        for path in stale:
            print(f"differs: {path.relative_to(root)}")
        if stale:
            print("run: python -m envq spec --write")
        return 1 if stale else 0
    changed = specgen.write(files) + specgen.write(specgen.svgs(root))
    for path in changed:
        print(f"wrote {path.relative_to(root)}")
    print(f"{len(files)} files up to date" if not changed else f"{len(changed)} file(s) written")
    return 0


def _explore(depth: int, show: int) -> int:
    try:
        from envq.model import explore  # noqa: PLC0415 - an extra's
    except ImportError as exc:
        return _needs_models("explore", exc)
    return explore.run(depth=depth, show=show)


# ---------------------------------------------------------------------------------------
# envq spec
# ---------------------------------------------------------------------------------------


_LIFE_HEAD: Final = ("state", "call", "action", "next state", "raises")
_OUT_HEAD: Final = ("kind", "outcome", "action", "next state", "or, as the action chooses")


def _life_cells(row: dict[str, Any]) -> tuple[str, ...]:
    if "action" not in row:
        return (row["state"], row["call"], "(illegal)" if row["illegal"] else "(missing)", "", "")
    target = row["target"] or "(unchanged)"
    return (row["state"], row["call"], row["action"], target, row["error"] or "")


def _out_cells(row: dict[str, Any]) -> tuple[str, ...]:
    return (
        row["kind"],
        row["outcome"],
        row["action"],
        row["target"],
        ", ".join(row["redirects"]),
    )


def _choices(data: dict[str, Any]) -> list[tuple[str, str]]:
    def pairs(mapping: dict[str, str]) -> str:
        return ", ".join(f"{k} -> {v}" for k, v in mapping.items())

    return [
        ("on_failure decision", pairs(data["decision_target"])),
        ("cancelled attempt, by", pairs(data["shelve_target"])),
        ("put back while not RUNNING", pairs(data["park_instead"])),
    ]


def _text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def _md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [fmt(head), "|" + "|".join("---" for _ in head) + "|", *(fmt(r) for r in rows)]


def render_spec(fmt: str = "text") -> str:
    """``envq spec`` output in ``fmt`` (``text``, ``markdown`` or ``json``)."""
    data = spec_data()
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    life = [_life_cells(r) for r in data["lifecycle"]]
    outs = [_out_cells(r) for r in data["outcomes"]]
    choices = _choices(data)
    if fmt == "markdown":
        lines = [
            "# envq runtime tables",
            "",
            "Generated by `envq spec --format markdown` from `envq._machine`.",
            "",
            "## Lifecycle: queue state x call",
            "",
            *_md_table(_LIFE_HEAD, life),
            "",
            "## Outcomes: (kind, outcome) of an attempt",
            "",
            *_md_table(_OUT_HEAD, outs),
            "",
            "## Choices",
            "",
            *(f"- **{name}**: {value}" for name, value in choices),
        ]
    elif fmt == "text":
        width = max(len(name) for name, _ in choices)
        lines = [
            "Lifecycle (envq._machine.LIFECYCLE): queue state x call -> action, next state",
            "",
            *_text_table(_LIFE_HEAD, life),
            "",
            "Outcomes (envq._machine.OUTCOMES): (kind, outcome) of an attempt -> action",
            "",
            *_text_table(_OUT_HEAD, outs),
            "",
            "Choices",
            "",
            *(f"{name.ljust(width)}  {value}" for name, value in choices),
        ]
    else:
        raise ValueError(f"unknown spec format {fmt!r}; expected one of {SPEC_FORMATS}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
