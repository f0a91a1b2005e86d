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
- ``decides_twice``: a leased port (below) whose attempt ended ``expired`` and was
  decided by its reaper's ``on_failure`` is decided again, by a late node's
  ``on_failure`` for the same attempt.
- ``succeeds_expired``: a leased port whose attempt ended ``expired`` reports its
  ``on_success`` anyway, as a late node would whose end the store refused.

:class:`LeasedTimeouts` is not faulty: it is the reference driver as a port whose store
several processes share would report it (it declares ``leases``, and each attempt a
deadline cuts ends ``expired``, as if its lease had lapsed then), the base of the
faulty leased ports.
"""

from __future__ import annotations

import sys
from typing import Any

import envq
from envq.conform.protocol import EXPIRED_CAUSE
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


class LeasedTimeouts(Session):
    """A port whose attempts end ``expired`` where envq's end TIMEOUT: as if each
    attempt's lease ran out exactly at its deadline. It declares ``leases`` unless
    built with ``declare=False``."""

    declare = True

    def observe(self, kind: str, **fields: Any) -> None:
        """Every TIMEOUT (its move, its cause, the error on_failure sees) as expired."""
        if kind == "move" and fields.get("outcome") == "timeout":
            fields["outcome"] = "expired"
            if fields.get("cause") == "timeout":
                fields["cause"] = EXPIRED_CAUSE
        if kind == "on_failure" and fields.get("error") == "timeout":
            fields["error"] = EXPIRED_CAUSE
        super().observe(kind, **fields)

    def cmd_hello(self, command: dict[str, Any]) -> dict[str, Any]:
        """The reference driver's answer, ``leases`` added."""
        answer = super().cmd_hello(command)
        if self.declare:
            answer["features"] = sorted({*answer["features"], "leases"})
        return answer

    def cmd_stats(self, command: dict[str, Any]) -> dict[str, Any]:
        """The timeouts counted as expired leases."""
        stats = super().cmd_stats(command)
        outcomes = stats["outcomes"]
        outcomes["expired"] = outcomes.get("expired", 0) + outcomes.pop("timeout", 0)
        outcomes["timeout"] = 0
        return stats


class Undeclared(LeasedTimeouts):
    """The same port, ``leases`` not declared."""

    declare = False


class DecidesTwice(LeasedTimeouts):
    """An expired attempt decided twice: after its reaper's ``on_failure`` and the
    move that ends it, a late node (whose lease lapsed) calls ``on_failure`` for the
    same attempt, with the error its own attempt raised."""

    def __init__(self, clock: str = "virtual") -> None:
        super().__init__(clock)
        self.decided: dict[str, int] = {}

    def observe(self, kind: str, **fields: Any) -> None:
        super().observe(kind, **fields)
        last = self.events[-1]
        name = last.get("env")
        if last["kind"] == "on_failure":
            self.decided[name] = last["attempt"]
        elif last["kind"] == "move" and last["outcome"] == "expired" and name in self.decided:
            super().observe("on_failure", env=name, error="error", attempt=self.decided.pop(name))


class SucceedsExpired(LeasedTimeouts):
    """``on_success`` for a refused end: after an attempt of an envelope with an
    ``on_success`` hook ended ``expired`` (reaped), a late node, its own attempt done,
    reports the hook for it."""

    def observe(self, kind: str, **fields: Any) -> None:
        super().observe(kind, **fields)
        last = self.events[-1]
        name = last.get("env")
        if last["kind"] == "move" and last["outcome"] == "expired" and self.specs[name].on_success:
            super().observe("on_success", env=name, attempt=self.attempts[name])


FAULTY: dict[str, type[Session]] = {
    "double_count": DoubleCount,
    "periodic_after_stop": PeriodicAfterStop,
    "terminate_drops_parked": TerminateDropsParked,
    "late_cron": LateCron,
    "decides_twice": DecidesTwice,
    "succeeds_expired": SucceedsExpired,
}

__all__ = [
    "FAULTY",
    "DecidesTwice",
    "DoubleCount",
    "LateCron",
    "LeasedTimeouts",
    "PeriodicAfterStop",
    "SucceedsExpired",
    "TerminateDropsParked",
    "Undeclared",
]


if __name__ == "__main__":
    import logging

    logging.getLogger("envq").disabled = True
    serve(FAULTY[sys.argv[1]](), sys.stdin, sys.stdout)
