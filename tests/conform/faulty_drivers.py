"""Deliberately wrong variants of the reference driver (``envq.driver.Session``).

Each one carries one known fault, so that ``tests/conform/test_conform.py`` can show the
conformance harness catches it with a short counterexample. Each is also runnable as
a process (``python tests/conform/faulty_drivers.py NAME``) speaking the same protocol.

- ``double_count``: a live envelope sent again counts against the capacity a second
  time (the Go library's ``currentCapacity`` does this) and the count never comes back.
- ``periodic_after_stop``: a periodic envelope that raises ``StopEnvelope`` is
  scheduled again as if it had succeeded.
- ``terminate_drops_parked``: ``terminate()`` hands back nothing: the envelopes a
  stop parked are lost.
- ``late_cron``: a cron envelope's next runs fall one model second after its fires (a
  port that runs its schedules late).
"""

from __future__ import annotations

import sys
from typing import Any

import envq
from envq.driver import Session, _ModelCron, serve


class DoubleCount(Session):
    """A re-sent live envelope is counted against the capacity again."""

    def __init__(self, clock: str = "virtual") -> None:
        super().__init__(clock)
        self.phantom = 0

    def cmd_send(self, command: dict[str, Any]) -> None:
        q = self._queue()
        live = {
            name
            for name in command.get("envs", [])
            if name in self.envs and q.state_of(self.envs[name]) is not None
        }
        super().cmd_send(command)
        self.phantom += len(live)

    def cmd_stats(self, command: dict[str, Any]) -> dict[str, Any]:
        stats = super().cmd_stats(command)
        stats["capacity_used"] += self.phantom
        return stats


class PeriodicAfterStop(Session):
    """``StopEnvelope`` from a periodic envelope is taken as a success."""

    async def invoke(self, env: envq.Envelope) -> None:
        try:
            await super().invoke(env)
        except envq.StopEnvelope:
            if env.interval <= 0:
                raise


class TerminateDropsParked(Session):
    """``terminate()`` hands nothing back."""

    def cmd_terminate(self, command: dict[str, Any]) -> dict[str, Any] | None:
        result = super().cmd_terminate(command)
        if result is not None and "handed_back" in result:
            result["handed_back"] = []
        return result


class _LateModelCron(_ModelCron):
    """The protocol's cron calendar whose next runs are ``late`` model seconds late."""

    def __init__(self, cron: envq.Cron, session: Session, late: float) -> None:
        super().__init__(cron, session)
        self.late = late

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        on_time = super().next_run(interval, origin, previous, ended, offset)
        return on_time + self.late * self.session.scale


class LateCron(Session):
    """A cron envelope's next runs come ``LATE`` model seconds after the fire."""

    #: Model seconds each next run comes late.
    LATE = 1.0

    def cmd_define(self, command: dict[str, Any]) -> None:
        super().cmd_define(command)
        name = command["env"]
        env = self.envs[name]
        if isinstance(env.schedule, _ModelCron):
            late = env.evolve(schedule=_LateModelCron(env.schedule.cron, self, self.LATE))
            del self.names[env]
            self.envs[name] = late
            self.names[late] = name


FAULTY: dict[str, type[Session]] = {
    "double_count": DoubleCount,
    "periodic_after_stop": PeriodicAfterStop,
    "terminate_drops_parked": TerminateDropsParked,
    "late_cron": LateCron,
}

__all__ = ["FAULTY", "DoubleCount", "LateCron", "PeriodicAfterStop", "TerminateDropsParked"]


if __name__ == "__main__":
    import logging

    logging.getLogger("envq").disabled = True
    serve(FAULTY[sys.argv[1]](), sys.stdin, sys.stdout)
