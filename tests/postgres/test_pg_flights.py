"""A node's record of the attempts it runs, on a real server: an envelope ended and
claimed again in the same statement (a retry at once, on a node with one worker) is
still known to its node, so a stop's cancel and the lease renewals reach it."""

from __future__ import annotations

import asyncio
import uuid

import pytest

import envq
from envq.postgres._queue import PgQueue

pytestmark = pytest.mark.real_clock

#: The attempts each envelope started, by id (the jobs below count them).
STARTED: dict[object, int] = {}
#: Set by the test when it ends, so that a hanging attempt no cancel reached ends too.
RELEASE: list[asyncio.Event] = []


async def fail_then_hang(env: envq.Envelope) -> None:
    """Fail the first attempt; hang in every later one until cancelled."""
    STARTED[env.id] = STARTED.get(env.id, 0) + 1
    if STARTED[env.id] == 1:
        raise RuntimeError("first attempt fails")
    await RELEASE[0].wait()


def retry_now(env: envq.Envelope, exc: BaseException | None, attempt: int) -> envq.Decision:
    """on_failure: run it again at once."""
    return envq.retry_now()


async def test_a_retry_claimed_with_the_end_of_its_attempt_is_cancelled_by_terminate(
    pg_dsn: str,
) -> None:
    name = f"flights-{uuid.uuid4().hex[:10]}"
    RELEASE[:] = [asyncio.Event()]
    # A lease far longer than the test: only the cancel can end the hanging attempt.
    async with PgQueue(pg_dsn, name, workers=1, lease=60.0, poll=0.01) as q:
        await q.start()
        env = envq.Envelope(invoke=fail_then_hang, id="a", on_failure=retry_now)
        await q.send(env)
        async with asyncio.timeout(10):
            while STARTED.get("a", 0) < 2:  # noqa: ASYNC110 - counted by the node's attempts
                await asyncio.sleep(0.01)
        terminating = asyncio.ensure_future(q.terminate())
        done, _ = await asyncio.wait({terminating}, timeout=10)
        RELEASE[0].set()
        if not done:
            terminating.cancel()
        assert done, "terminate() did not cancel the hanging attempt"
        assert [e.id for e in terminating.result()] == ["a"]
        assert STARTED["a"] == 2
