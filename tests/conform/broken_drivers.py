"""Drivers that break the way a port's driver does long before it is correct: the
reference driver (``envq.driver.Session``) behind a transport that, at its Nth command
line (counted per process), crashes, closes its output, hangs or prints nonsense, or
that bends every answer into valid JSON of the wrong shape.

Run as a process: ``python tests/conform/broken_drivers.py MODE [N]``.

- ``exit N``: at the Nth command, a message on stderr, then exit status 3.
- ``close N``: at the Nth command, a message on stderr, stdout closed; the process
  lives on (it ignores its input until killed).
- ``hang N``: at the Nth command, a message on stderr, then no answer ever.
- ``garbage N``: at the Nth command, a line that is not JSON.
- ``events_null``: every answer has ``"events": null``.
- ``move_no_env``: every ``move`` observation lacks ``env``.
- ``at_text``: every answer's ``at`` is a string.
- ``stats_no_capacity``: ``stats`` answers without ``capacity_used``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from envq.driver import Session, answer

SHAPES = ("events_null", "move_no_env", "at_text", "stats_no_capacity")


def _bend(mode: str, command: dict[str, Any], response: dict[str, Any]) -> None:
    """Give ``response`` the wrong shape ``mode`` names."""
    if mode == "events_null":
        response["events"] = None
    elif mode == "move_no_env":
        for event in response.get("events", []):
            if event.get("kind") == "move":
                event.pop("env", None)
    elif mode == "at_text":
        response["at"] = str(response.get("at", 0))
    elif mode == "stats_no_capacity" and command.get("cmd") == "stats":
        response["result"].pop("capacity_used", None)


def main(argv: list[str]) -> int:
    """Serve the protocol, broken as ``argv`` says."""
    mode = argv[0]
    nth = int(argv[1]) if len(argv) > 1 else 0
    logging.getLogger("envq").disabled = True
    session = Session()
    count = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        count += 1
        command = json.loads(line)
        if count == nth:
            sys.stderr.write(f"broken driver: {mode} at command {count} ({command['cmd']})\n")
            sys.stderr.flush()
            if mode == "exit":
                os._exit(3)
            if mode == "close":
                sys.stdout.close()
                os.close(1)
                for _ in sys.stdin:
                    pass
                time.sleep(3600)
            if mode == "hang":
                time.sleep(3600)
            if mode == "garbage":
                sys.stdout.write("Traceback (most recent call last): oops\n")
                sys.stdout.flush()
                continue
        response, quitting = answer(session, line)
        _bend(mode, command, response)
        sys.stdout.write(json.dumps(response) + "\n")
        sys.stdout.flush()
        if quitting:
            return 0
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
