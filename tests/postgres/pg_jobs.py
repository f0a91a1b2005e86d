"""Jobs the PostgreSQL queue tests send: module-level, so that they cross processes."""

from __future__ import annotations

import asyncio

import envq

#: Attempts seen by this process, by the envelope's id.
SEEN: dict[object, int] = {}


def _count(env: envq.Envelope) -> None:
    SEEN[env.id] = SEEN.get(env.id, 0) + 1


async def noop(env: envq.Envelope) -> None:
    """Succeed."""
    _count(env)


def plain(env: envq.Envelope) -> None:
    """Succeed, in a thread."""
    _count(env)


async def fail(env: envq.Envelope) -> None:
    """Fail every time."""
    _count(env)
    raise RuntimeError(f"{env.id} fails")


async def fail_twice(env: envq.Envelope) -> None:
    """Fail the first two attempts, then succeed."""
    _count(env)
    if SEEN[env.id] <= 2:
        raise RuntimeError(f"{env.id} fails")


async def slow(env: envq.Envelope) -> None:
    """Take the seconds the payload says."""
    _count(env)
    await asyncio.sleep(float(env.payload))


async def stop_type(env: envq.Envelope) -> None:
    """Stop every envelope of this type."""
    _count(env)
    raise envq.StopType("enough of this type")


def retry_then_drop(env: envq.Envelope, exc: BaseException | None, attempt: int) -> envq.Decision:
    """on_failure: retry at once twice, then drop."""
    return envq.retry_now() if attempt < 3 else envq.drop()


#: Calls of :func:`slow_decision`, by the envelope's id.
DECIDED: dict[object, int] = {}


async def slow_decision(
    env: envq.Envelope, exc: BaseException | None, attempt: int
) -> envq.Decision:
    """on_failure: take a while (two reapers could meet here), then drop."""
    DECIDED[env.id] = DECIDED.get(env.id, 0) + 1
    await asyncio.sleep(0.3)
    return envq.drop()


#: What :func:`envq.current_attempt` said inside :func:`note_attempt`, by the id.
ATTEMPTS: dict[object, tuple[str, int]] = {}


async def note_attempt(env: envq.Envelope) -> None:
    """Record the attempt as ``current_attempt()`` sees it; fail the first time."""
    attempt = envq.current_attempt()
    assert attempt is not None
    assert attempt.envelope is env
    ATTEMPTS[env.id] = (attempt.queue.name, attempt.number)
    _count(env)
    if SEEN[env.id] == 1:
        raise RuntimeError("the first attempt fails")
