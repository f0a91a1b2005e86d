"""``envq conform``'s command line: run or audit a port's driver against the model,
replay a saved script, write the report, check the findings against an expectation
file; the exit status says which (:data:`EXIT_PASS`, :data:`EXIT_VIOLATION`,
:data:`EXIT_DRIVER`)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from envq.conform.harness import REAL_JITTER, Harness
from envq.conform.oracle import Violation
from envq.conform.reports import check_expected, load_expected, report, save_scripts
from envq.conform.runner import Options, audit, hello, load_classification, run
from envq.conform.scripts import ScriptError, load_script, replay
from envq.conform.transport import Driver, DriverCrashed, InProcessDriver, SharedProcess

__all__ = ["EXIT_DRIVER", "EXIT_PASS", "EXIT_VIOLATION", "build_parser", "main"]


#: ``envq conform``'s exit status when the port passed (or a replay found no violation).
EXIT_PASS: Final = 0
#: A violation was found (or reproduced by ``--replay``), or ``--expect`` disagreed.
EXIT_VIOLATION: Final = 1
#: No verdict: bad input (arguments, a script, an expectation file) or a driver that
#: crashed, hung or answered out of the protocol.
EXIT_DRIVER: Final = 2


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 of ``kind``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    """``envq conform``'s arguments (everything after ``--`` is the driver's command)."""
    parser = argparse.ArgumentParser(
        prog="envq conform",
        description=(
            "Check a port of envq against the model, through a driver speaking the "
            "JSON-lines protocol of specs/driver-protocol.md: envq conform [options] -- "
            "CMD ARGS..."
        ),
        epilog=(
            "exit status: 0 passed (or no violation replayed), 1 a violation (or --expect"
            " disagrees), 2 bad input or a driver that crashed, hung or broke the protocol"
        ),
    )
    count, seconds = _positive(int), _positive(float)
    parser.add_argument("--examples", type=count, default=100, help="Hypothesis examples (100)")
    parser.add_argument("--steps", type=count, default=50, help="steps per example (50)")
    parser.add_argument("--derandomize", action="store_true", help="the same run every time")
    parser.add_argument(
        "--time-scale",
        type=seconds,
        default=0.05,
        help="real seconds per model second, for a real-clock driver (0.05)",
    )
    parser.add_argument(
        "--jitter",
        type=seconds,
        default=REAL_JITTER,
        help=f"real seconds of scheduling jitter a real-clock driver's timing checks allow "
        f"({REAL_JITTER:g}; more on a loaded machine)",
    )
    parser.add_argument(
        "--response-timeout",
        type=seconds,
        default=60.0,
        help=(
            "real seconds a driver's answer may take before it counts as hung, on top of"
            " the model time the command lets pass times the time scale (60)"
        ),
    )
    parser.add_argument("--no-shrink", action="store_true", help="report the first failure as is")
    parser.add_argument(
        "--audit", action="store_true", help="find every distinct divergence, not only the first"
    )
    parser.add_argument("--rounds", type=count, default=25, help="most audit rounds (25)")
    parser.add_argument("--ignore", action="append", default=[], help="a check to set aside")
    parser.add_argument("--report", choices=("text", "md"), default="text")
    parser.add_argument("--out", type=Path, default=None, help="write the report there")
    parser.add_argument(
        "--save",
        type=Path,
        default=Path("conform-failures"),
        help="where counterexamples are saved (./conform-failures)",
    )
    parser.add_argument(
        "--expect",
        type=Path,
        default=None,
        help=(
            "expected findings: a file of keys, one per line, or a --classify JSON file;"
            " exit 0 iff the findings are these"
        ),
    )
    parser.add_argument(
        "--classify",
        type=Path,
        default=None,
        help="a port's audit notes (JSON): each finding's kind in the report",
    )
    parser.add_argument("--replay", type=Path, default=None, help="play back a saved script")
    return parser


def main(argv: Sequence[str]) -> int:
    """``envq conform [options] -- CMD ARGS...``; the exit code (:data:`EXIT_PASS`,
    :data:`EXIT_VIOLATION` or :data:`EXIT_DRIVER`)."""
    args_list = list(argv)
    if "--" in args_list:
        cut = args_list.index("--")
        mine, command = args_list[:cut], args_list[cut + 1 :]
    else:
        mine, command = args_list, []
    parser = build_parser()
    args = parser.parse_args(mine)
    # Every input is read before the driver starts: a typo costs no run.
    script: list[dict[str, Any]] | None = None
    try:
        classification = None if args.classify is None else load_classification(args.classify)
        if args.expect is not None:
            load_expected(args.expect)
        if args.replay is not None:
            text = args.replay.read_text(encoding="utf-8")
            script = load_script(text, str(args.replay))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        sys.stderr.write(f"envq conform: {exc}\n")
        return EXIT_DRIVER
    connect: Callable[[], Driver]
    shared: SharedProcess | None = None
    if command:
        shared = SharedProcess(command, timeout=args.response_timeout)
        connect = shared.connect
    else:
        from envq.driver import Session  # noqa: PLC0415 - the in-process reference driver

        connect = lambda: InProcessDriver(Session)  # noqa: E731
    engine_log = logging.getLogger("envq")
    # The engine's own log lines (a planned on_failure crash, say) are not the report.
    was_disabled, engine_log.disabled = engine_log.disabled, engine_log.disabled or not command
    options = Options(
        examples=args.examples,
        steps=args.steps,
        derandomize=args.derandomize,
        time_scale=args.time_scale,
        jitter=args.jitter,
        shrink=not args.no_shrink,
        ignore=tuple(args.ignore),
    )
    try:
        if script is not None:
            return _replay(connect, script, options)
        result = audit(connect, options, args.rounds) if args.audit else run(connect, options)
    except DriverCrashed as exc:
        sys.stderr.write(f"envq conform: {exc}\n")
        return EXIT_DRIVER
    finally:
        engine_log.disabled = was_disabled
        if shared is not None:
            shared.shutdown()
    out = sys.stdout if args.out is None else args.out.open("w", encoding="utf-8")
    try:
        report(result, out, markdown=args.report == "md", classification=classification)
    finally:
        if args.out is not None:
            out.close()
    for path in save_scripts(result, args.save):
        what = (
            "commands until the driver failed" if path.stem == "driver-error" else "counterexample"
        )
        sys.stderr.write(f"{what}: {path}  (replay: envq conform --replay {path} -- ...)\n")
    if result.error is not None:
        sys.stderr.write(f"envq conform: {result.error}\n")
        return EXIT_DRIVER
    if args.expect is not None:
        differs = check_expected(result, args.expect)
        if differs is not None:
            sys.stderr.write(f"envq conform: {differs}\n")
            return EXIT_VIOLATION
        return EXIT_PASS
    return EXIT_PASS if result.passed else EXIT_VIOLATION


def _replay(connect: Callable[[], Driver], commands: list[dict[str, Any]], options: Options) -> int:
    """Play ``commands`` (checked by :func:`load_script`) through a fresh session."""
    first = commands[0] if commands[0].get("cmd") == "hello" else {}
    answer = hello(connect, options)
    harness = Harness(
        connect(),
        hello={"time_scale": first.get("time_scale", options.time_scale)},
        real_clock=answer.get("clock") == "real",
        ignore=options.ignore,
        jitter=options.jitter,
    )
    try:
        replay(harness, commands)
    except Violation as exc:
        sys.stdout.write(f"VIOLATION {exc}\nafter {len(harness.log)} commands\n")
        return EXIT_VIOLATION
    except ScriptError as exc:
        sys.stderr.write(f"envq conform: the script cannot be replayed: {exc}\n")
        return EXIT_DRIVER
    finally:
        harness.close()
    sys.stdout.write(f"no violation: {len(commands)} commands replayed\n")
    return EXIT_PASS
