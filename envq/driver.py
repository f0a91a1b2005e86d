"""The reference driver: envq itself behind the conformance protocol.

``python -m envq.driver`` reads one JSON command per line on stdin and writes one JSON
response per line on stdout (``specs/driver-protocol.md``); ``envq conform -- python
-m envq.driver`` checks envq against its own model. Options: ``--clock virtual``
(default: envq's virtual-time loop, time moves only when told) or ``--clock real``
(an ordinary loop; the ``time_scale`` given in ``hello`` turns model seconds into real
ones).

:class:`Session` is the driver without the transport, so the harness and envq's own
tests can run it in-process; its ``on_*`` methods are the places a deliberately
faulty variant overrides (``tests/conform/faulty_drivers.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Final, TextIO

import envq
from envq.conform.driving import (
    DriverError,
    arg_choice,
    arg_count,
    arg_flag,
    arg_number,
    arg_optional,
    cause_name,
    error_name,
    member_name,
    play,
)
from envq.conform.protocol import (
    ERRORS,
    FEATURES,
    HANG_RELEASES,
    PROTOCOL,
    SHARED_STORE_FEATURES,
    EnvSpec,
    Plan,
    Policy,
)
from envq.testing import VirtualTimeLoop

__all__ = ["DriverError", "Session", "answer", "main"]

#: ``sleep(0)`` passes that let ready callbacks run after a command (no time passes).
SETTLE_PASSES: Final = 200


class _ModelCron:
    """A cron calendar over the session's model time (UTC, model second 0 = the Unix
    epoch), as the protocol defines it: an :class:`envq.Timing` that reads loop times
    as model times instead of the wall clock."""

    def __init__(self, cron: envq.Cron, session: Session) -> None:
        self.cron = cron
        self.session = session

    def _model(self, t: float) -> float:
        return (t - self.session._t0) / self.session.scale

    def _loop(self, m: float) -> float:
        return self.session._t0 + m * self.session.scale

    def first_run(self, at: float, offset: float) -> float:
        """The first fire at or after loop time ``at``."""
        return self._loop(self.cron.first_fire(self._model(at)))

    def next_run(
        self, interval: float, origin: float, previous: float, ended: float, offset: float
    ) -> float:
        """The first fire after the attempt ended."""
        return self._loop(self.cron.next_fire(self._model(max(previous, ended))))


class Session:
    """One conformance session against envq: the queue under test, a second queue to
    lend envelopes to, the scripted envelopes, and the observations not yet reported.

    :param clock: ``"virtual"`` (envq's virtual-time loop) or ``"real"``.
    """

    def __init__(self, clock: str = "virtual") -> None:
        if clock not in ("virtual", "real"):
            raise DriverError(f"clock must be 'virtual' or 'real', got {clock!r}")
        self.clock = clock
        self.scale = 1.0
        self.loop: asyncio.AbstractEventLoop = (
            VirtualTimeLoop() if clock == "virtual" else asyncio.new_event_loop()
        )
        self._t0 = self.loop.time()
        self.q: envq.Queue | None = None
        self.other: envq.Queue | None = None
        self.envs: dict[str, envq.Envelope] = {}
        self.names: dict[envq.Envelope, str] = {}
        self.specs: dict[str, EnvSpec] = {}
        self.scripts: dict[str, collections.deque[Plan]] = {}
        #: Hanging attempts: envelope name → (gate, the plan it is released with).
        self.gates: dict[str, tuple[asyncio.Event, list[Plan]]] = {}
        self.events: list[dict[str, Any]] = []
        self._returned_at: int | None = None
        #: Each envelope's attempts in its current stay (the dispatches since it was
        #: admitted), the number its on_success reports.
        self.attempts: dict[str, int] = {}

    # -- plumbing ---------------------------------------------------------------------

    def now(self) -> float:
        """Model time: seconds since the session began, divided by the time scale."""
        return (self.loop.time() - self._t0) / self.scale

    def real(self, seconds: float) -> float:
        """Model seconds as the queue's seconds."""
        return seconds * self.scale

    def observe(self, kind: str, **fields: Any) -> None:
        """Record one observation for the next response."""
        self.events.append({"t": self.now(), "kind": kind, **fields})

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a command's coroutine, note where its observations stood when it
        returned, then let the loop settle (no time passes)."""

        async def step() -> Any:
            try:
                return await coro
            finally:
                self._returned_at = len(self.events)
                await self._settle()

        return self.loop.run_until_complete(step())

    async def _settle(self) -> None:
        """Let every ready callback run without moving the clock: pass control until
        the loop has had nothing ready twice in a row (a private attribute of
        asyncio's base loop; at most SETTLE_PASSES passes)."""
        ready = getattr(self.loop, "_ready", None)
        idle = 0
        for _ in range(SETTLE_PASSES):
            await asyncio.sleep(0)
            if ready is None:
                continue
            idle = idle + 1 if not ready else 0
            if idle == 2:
                return

    def _queue(self) -> envq.Queue:
        if self.q is None:
            raise DriverError("no queue: send a 'queue' command first")
        return self.q

    def _env(self, name: object) -> envq.Envelope:
        if not isinstance(name, str) or name not in self.envs:
            raise DriverError(f"unknown envelope {name!r}")
        return self.envs[name]

    def _envs(self, command: dict[str, Any]) -> list[envq.Envelope]:
        names = command.get("envs", [])
        if not isinstance(names, list):
            raise DriverError(f"envs must be a list of names, got {names!r}")
        return [self._env(name) for name in names]

    def _other(self) -> envq.Queue:
        """The second queue (``lend``, ``reclaim``), made when first needed."""
        if self.other is None:
            self.other = envq.Queue("other", log_unhandled=False)
        return self.other

    def close(self) -> None:
        """End the session: terminate what is left and close the loop."""
        for q in (self.q, self.other):
            if q is not None and q.state is not envq.QueueState.TERMINATED:
                self._run(q.terminate())
        self.loop.close()

    # -- the transport-free entry point -----------------------------------------------

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        """Carry out one command; the response (with the observations it caused)."""
        cmd = command.get("cmd")
        method: Callable[[dict[str, Any]], Any] | None = getattr(self, f"cmd_{cmd}", None)
        if not isinstance(cmd, str) or method is None:
            raise DriverError(f"unknown command {cmd!r}")
        response: dict[str, Any]
        self._returned_at = None
        try:
            result = method(command)
        except envq.EnvqError as exc:
            response = {"ok": False, "error": error_name(exc), "message": str(exc)}
        except ValueError as exc:
            response = {"ok": False, "error": ERRORS["ValueError"], "message": str(exc)}
        else:
            response = {"ok": True, "result": result}
        events, self.events = self.events, []
        response["events"] = events
        # The observations made before the call returned, and those after (the loop
        # settling): a call's result describes the queue at that point.
        response["at"] = len(events) if self._returned_at is None else self._returned_at
        response["t"] = self.now()
        return response

    # -- the queue's observations -------------------------------------------------------

    def on_event(self, event: envq.Event) -> None:
        """The queue's listener: every state change, as an observation."""
        if event.envelope is None:
            self.observe(
                "queue",
                **{"from": member_name(event.from_state), "to": member_name(event.to_state)},
            )
            return
        name = self.names.get(event.envelope, "?")
        if event.from_state is envq.EnvState.NEW:
            self.attempts[name] = 0
        elif event.to_state is envq.EnvState.RUNNING:
            self.attempts[name] = self.attempts.get(name, 0) + 1
        self.observe(
            "move",
            env=name,
            **{"from": member_name(event.from_state), "to": member_name(event.to_state)},
            outcome=member_name(event.outcome),
            cause=None if event.cause is None else cause_name(event.cause),
        )

    async def invoke(self, env: envq.Envelope) -> None:
        """A scripted envelope's invoke: the next plan of its script, else its default."""
        name = self.names[env]
        script = self.scripts[name]
        plan = script.popleft() if script else self.specs[name].then
        self.observe("invoke", env=name, plan=plan.value)
        plan = await play(plan, name, self.gates, self.observe, self.real)
        if plan is Plan.ERROR:
            raise RuntimeError(f"{name}: planned error")
        if plan is Plan.STOP:
            raise envq.StopEnvelope
        if plan is Plan.STOP_TYPE:
            raise envq.StopType
        if plan is Plan.NO_RETRY:
            raise envq.DoNotRetry

    async def on_success(self, env: envq.Envelope) -> None:
        """A scripted envelope's on_success: reports the call and its attempt's number
        (envq runs it before the move that ends the attempt)."""
        name = self.names[env]
        self.observe("on_success", env=name, attempt=self.attempts.get(name, 0))

    async def on_failure(
        self, env: envq.Envelope, exc: BaseException, attempt: int
    ) -> envq.Decision | None:
        """A scripted envelope's on_failure: reports the call, answers its policy."""
        name = self.names[env]
        self.observe("on_failure", env=name, error=cause_name(exc), attempt=attempt)
        policy = self.specs[name].policy
        if policy is Policy.DROP:
            return envq.drop()
        if policy is Policy.RETRY_NOW:
            return envq.retry_now()
        if policy is Policy.RETRY_AFTER:
            return envq.retry_after(self.real(self.specs[name].retry_after))
        if policy is Policy.CRASH:
            raise RuntimeError("on_failure crashed (planned)")
        return None

    # -- commands -----------------------------------------------------------------------

    def cmd_hello(self, command: dict[str, Any]) -> dict[str, Any]:
        """Agree on the protocol; a real-clock session takes the time scale."""
        if command.get("protocol", PROTOCOL) != PROTOCOL:
            raise DriverError(f"protocol {command.get('protocol')!r} unknown (speaks {PROTOCOL})")
        if "time_scale" in command:
            value = command["time_scale"]
            try:
                scale = arg_number(command, "time_scale")
            except DriverError:
                scale = 0.0
            if scale <= 0:
                raise DriverError(f"time_scale must be a finite number > 0, got {value!r}")
            if self.clock == "real":
                self.scale = scale
        elif self.clock == "real":
            self.scale = 0.05
        self._t0 = self.loop.time()
        return {
            "driver": "envq",
            "version": envq.__version__,
            "protocol": PROTOCOL,
            "clock": self.clock,
            "features": sorted(FEATURES.keys() - SHARED_STORE_FEATURES),
            "divergences": [],
        }

    def cmd_queue(self, command: dict[str, Any]) -> None:
        """A new queue under test (the previous one must have been terminated)."""
        if self.q is not None and self.q.state is not envq.QueueState.TERMINATED:
            raise DriverError("the previous queue was not terminated")
        workers = arg_count(command, "workers", 1)
        if workers < 1:
            raise DriverError(f"workers must be >= 1, got {workers}")
        capacity = arg_count(command, "capacity", 0)
        stop_mode = arg_choice(envq.StopMode, command.get("stop_mode", "drain"), "stop_mode")
        wait = arg_flag(command, "wait", True)
        self.q = envq.Queue(
            "conform",
            workers=workers,
            capacity=capacity,
            stop_mode=stop_mode,
            wait=bool(wait),
            log_unhandled=False,
        )
        self.q.subscribe(self.on_event)
        self._other()

    def cmd_define(self, command: dict[str, Any]) -> None:
        """A scripted envelope, under a name the later commands use."""
        name = command.get("env")
        if not isinstance(name, str) or name in self.envs:
            raise DriverError(f"bad or duplicate envelope name {name!r}")
        data = command.get("spec", {})
        if not isinstance(data, dict):
            raise DriverError(f"spec must be an object, got {data!r}")
        # A spec the protocol does not allow (an unknown field or plan, a negative
        # interval envq refuses) is the driver's input at fault, not a call of the queue.
        try:
            spec = EnvSpec.from_json(data)
            retry = None
            # A periodic envelope goes on with its schedule: envq refuses a retry policy
            # on it, which the protocol's RETRY policy then means (no decision).
            if spec.policy is Policy.RETRY and not (spec.interval > 0 or spec.cron):
                retry = envq.Retry(
                    attempts=spec.attempts,
                    base=self.real(spec.base),
                    cap=self.real(spec.cap),
                    jitter=False,
                )
            env = envq.Envelope(
                invoke=self.invoke,
                id=name,
                type=spec.type,
                interval=self.real(spec.interval),
                deadline=self.real(spec.deadline),
                delay=self.real(spec.delay),
                schedule=(
                    _ModelCron(envq.Cron(spec.cron), self)
                    if spec.cron
                    else envq.FIXED_RATE
                    if spec.fixed_rate
                    else envq.FIXED_DELAY
                ),
                on_failure=self.on_failure if spec.policy.has_on_failure else None,
                on_success=self.on_success if spec.on_success else None,
                retry=retry,
            )
        except (TypeError, ValueError) as exc:
            raise DriverError(f"bad spec for {name!r}: {exc}") from exc
        self.envs[name] = env
        self.names[env] = name
        self.specs[name] = spec
        self.scripts[name] = collections.deque(spec.script)

    def cmd_plan(self, command: dict[str, Any]) -> None:
        """Append a plan to an envelope's script."""
        self._env(command.get("env"))
        self.scripts[command["env"]].append(arg_choice(Plan, command.get("plan"), "plan"))

    def cmd_release(self, command: dict[str, Any]) -> bool:
        """Let a hanging attempt go on with a plan; False if it does not hang."""
        name = command.get("env")
        plan = arg_choice(Plan, command.get("plan"), "plan")
        if plan not in HANG_RELEASES:
            raise DriverError(f"a hanging attempt is released with one of {HANG_RELEASES}")
        gate = self.gates.get(name) if isinstance(name, str) else None
        if gate is None:
            return False
        gate[1].append(plan)
        gate[0].set()
        self._run(asyncio.sleep(0))
        return True

    def cmd_start(self, command: dict[str, Any]) -> None:
        """``start()``."""
        q = self._queue()

        async def go() -> None:
            q.start()

        self._run(go())

    def cmd_send(self, command: dict[str, Any]) -> None:
        """``send(*envs)``."""
        q = self._queue()
        envs = self._envs(command)

        async def go() -> None:
            q.send(*envs)

        self._run(go())

    def cmd_send_wait(self, command: dict[str, Any]) -> dict[str, Any] | None:
        """``send_wait(*envs, timeout)``; blocks, in model time, for at most ``limit``."""
        q = self._queue()
        envs = self._envs(command)
        timeout = arg_optional(command, "timeout")
        real_timeout = None if timeout is None else self.real(timeout)
        return self._blocking(q.send_wait(*envs, timeout=real_timeout), command)

    def cmd_lend(self, command: dict[str, Any]) -> None:
        """Send an envelope to the second queue (it is then live there)."""
        env = self._env(command.get("env"))
        self._other().send(env)

    def cmd_reclaim(self, command: dict[str, Any]) -> list[str]:
        """Terminate the second queue (a fresh one replaces it); what it handed back."""
        other = self._other()
        left = self._run(other.terminate())
        self.other = envq.Queue("other", log_unhandled=False)
        return [self.names[env] for env in left]

    def _report(self, report: envq.StopReport) -> dict[str, Any]:
        return {
            "parked": [self.names[e] for e in report.parked],
            "completed": [self.names[e] for e in report.completed],
            "cancelled": [self.names[e] for e in report.cancelled],
            "complete": report.complete,
        }

    def _blocking(
        self, coro: Coroutine[Any, Any, Any], command: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Await ``coro`` for at most the command's ``limit`` (model seconds): its
        result, or ``{"timed_out": true}``."""
        try:
            limit = arg_optional(command, "limit")
        except DriverError:
            coro.close()
            raise

        async def go() -> Any:
            if limit is None:
                return await coro
            # Not wait_for: a TimeoutError of the call itself (send_wait's SendTimeout)
            # is its answer, not the limit's.
            task = asyncio.ensure_future(coro)
            done, _ = await asyncio.wait({task}, timeout=self.real(limit))
            if not done:
                task.cancel()
                await asyncio.wait({task})
                return _TIMED_OUT
            return task.result()

        value = self._run(go())
        if value is _TIMED_OUT:
            return {"timed_out": True}
        return value  # type: ignore[no-any-return]

    def cmd_stop(self, command: dict[str, Any]) -> dict[str, Any] | None:
        """``stop(mode, cancel, wait)``; the report."""
        q = self._queue()
        mode = command.get("mode")
        arg_optional(command, "limit")
        stopping = q.stop(
            mode=None if mode is None else arg_choice(envq.StopMode, mode, "mode"),
            cancel=bool(arg_flag(command, "cancel", False)),
            wait=arg_flag(command, "wait", None),
        )

        async def report() -> Any:
            return self._report(await stopping)

        return self._blocking(report(), command)

    def cmd_wait_stopped(self, command: dict[str, Any]) -> dict[str, Any] | None:
        """``wait_stopped()``; the final report."""
        q = self._queue()

        async def report() -> Any:
            return self._report(await q.wait_stopped())

        return self._blocking(report(), command)

    def cmd_terminate(self, command: dict[str, Any]) -> dict[str, Any] | None:
        """``terminate()``; what it handed back."""
        q = self._queue()

        async def handed() -> Any:
            return {"handed_back": [self.names[e] for e in await q.terminate()]}

        return self._blocking(handed(), command)

    def cmd_advance(self, command: dict[str, Any]) -> None:
        """Let ``seconds`` of model time pass."""
        self._run(asyncio.sleep(self.real(arg_number(command, "seconds", 0))))

    def cmd_stats(self, command: dict[str, Any]) -> dict[str, Any]:
        """``statistics()``, with states, outcomes and reasons by their protocol names."""
        stats = self._queue().statistics()
        return {
            "state": stats.state.value,
            "capacity_used": stats.capacity_used,
            "by_state": {s.value: n for s, n in stats.by_state.items()},
            "in_flight": stats.in_flight,
            "outcomes": {o.value: n for o, n in stats.outcomes.items()},
            "dedups": stats.dedups,
            "rejections": {str(r): n for r, n in stats.rejections.items()},
        }

    def cmd_reset(self, command: dict[str, Any]) -> None:
        """Start over, as a fresh session (same clock and time scale): the harness
        reuses one driver process for many examples."""
        scale = self.scale
        self.close()
        self.__init__(self.clock)  # type: ignore[misc]
        self.scale = scale

    def cmd_quit(self, command: dict[str, Any]) -> None:
        """End the session."""
        self.close()


_TIMED_OUT: Final = object()


def answer(session: Session, line: str) -> tuple[dict[str, Any], bool]:
    """The response to one command line, and whether it was ``quit``. A command the
    driver cannot carry out is answered with a ``DriverError``, as the protocol says."""
    try:
        command = json.loads(line)
        if not isinstance(command, dict):
            raise DriverError(f"a command is a JSON object, got {command!r}")
        return session.handle(command), command.get("cmd") == "quit"
    except (DriverError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        return {"ok": False, "error": "DriverError", "message": str(exc), "events": []}, False
    except Exception as exc:
        # Whatever went wrong, an answer keeps the session going and tells the harness.
        message = f"the driver failed: {type(exc).__name__}: {exc}"
        return {"ok": False, "error": "DriverError", "message": message, "events": []}, False


def serve(session: Session, stdin: TextIO, stdout: TextIO) -> None:
    """Answer one JSON command per line until ``quit`` or the end of input."""
    for line in stdin:
        if not line.strip():
            continue
        response, quitting = answer(session, line)
        stdout.write(json.dumps(response) + "\n")
        stdout.flush()
        if quitting:
            return
    session.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m envq.driver [--clock virtual|real]``."""
    parser = argparse.ArgumentParser(prog="python -m envq.driver", description=__doc__)
    parser.add_argument("--clock", choices=("virtual", "real"), default="virtual")
    args = parser.parse_args(argv)
    # The queue's own log lines (a planned on_failure crash, say) are not the protocol's.
    logging.getLogger("envq").disabled = True
    serve(Session(args.clock), sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
