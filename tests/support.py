"""Shared helpers of the contract tests: a queue running under an event recorder, and
small invokes (was copied into four test files)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import envq
from envq._machine import TERMINAL_STATES

TERMINAL = TERMINAL_STATES
#: Enough virtual time for anything a test waits for; a miss fails fast with TimeoutError.
PATIENCE = 100_000.0


class Recorder:
    """Collects a queue's events and lets a test await a condition on them."""

    def __init__(self, queue: envq.Queue) -> None:
        self.events: list[envq.Event] = []
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        queue.subscribe(self._on_event)

    def _on_event(self, event: envq.Event) -> None:
        self.events.append(event)
        for cond, fut in self._waiters:
            if not fut.done() and cond():
                fut.set_result(None)

    def of(self, env: envq.Envelope) -> list[envq.Event]:
        return [e for e in self.events if e.envelope is env]

    def states(self, env: envq.Envelope) -> list[Any]:
        return [e.to_state for e in self.of(env)]

    def ends(self, env: envq.Envelope) -> list[envq.Event]:
        """The events that ended an attempt of ``env`` (they carry an outcome)."""
        return [e for e in self.of(env) if e.outcome is not None]

    def final(self, env: envq.Envelope) -> envq.Event | None:
        return next((e for e in self.of(env) if e.to_state in TERMINAL), None)

    async def until(self, cond: Callable[[], bool]) -> None:
        if cond():
            return
        entry = (cond, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(PATIENCE):
                await entry[1]
        finally:
            self._waiters.remove(entry)

    async def ended(self, env: envq.Envelope) -> envq.Event:
        await self.until(lambda: self.final(env) is not None)
        event = self.final(env)
        assert event is not None
        return event

    async def attempts(self, env: envq.Envelope, n: int) -> list[envq.Event]:
        await self.until(lambda: len(self.ends(env)) >= n)
        return self.ends(env)


@contextlib.asynccontextmanager
async def running(**options: Any) -> AsyncIterator[tuple[envq.Queue, Recorder]]:
    queue = envq.Queue("test", **options)
    recorder = Recorder(queue)
    queue.start()
    try:
        yield queue, recorder
    finally:
        await queue.terminate()


def now() -> float:
    """The running loop's (virtual) time."""
    return asyncio.get_running_loop().time()


async def settle() -> None:
    """Let every ready task run, without moving the clock."""
    for _ in range(50):
        await asyncio.sleep(0)


async def noop(env: envq.Envelope) -> None:
    return None


def raising(exc: BaseException) -> Callable[[envq.Envelope], Any]:
    async def invoke(env: envq.Envelope) -> None:
        raise exc

    return invoke
