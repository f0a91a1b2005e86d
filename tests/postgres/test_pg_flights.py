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


#: The on_failure calls heard, by envelope id; the queue the jobs blacklist in.
HEARD: list[object] = []
BLACKLIST_IN: list[PgQueue] = []


async def blacklisted_meanwhile(env: envq.Envelope) -> None:
    """Another node blacklists this envelope's type while it runs; then it fails."""
    q = BLACKLIST_IN[0]
    async with q._db().acquire() as conn, conn.transaction():
        await conn.execute(
            "UPDATE envq.queues SET blacklist = array_append(blacklist, $2) WHERE name = $1",
            q.name,
            env.type,
        )
        await conn.execute(
            "UPDATE envq.envelopes SET kind = 'blacklisted'"
            " WHERE queue = $1 AND type = $2 AND state = 'running'",
            q.name,
            env.type,
        )
    raise envq.DoNotRetry("after the blacklist")


def heard(env: envq.Envelope, exc: BaseException | None, attempt: int) -> envq.Decision:
    """on_failure: note the call."""
    HEARD.append(env.id)
    return envq.drop()


async def test_an_attempt_whose_type_was_blacklisted_meanwhile_calls_no_hook(
    pg_dsn: str,
) -> None:
    name = f"flights-{uuid.uuid4().hex[:10]}"
    HEARD.clear()
    async with PgQueue(pg_dsn, name, workers=1, poll=0.01) as q:
        BLACKLIST_IN[:] = [q]
        await q.start()
        await q.send(
            envq.Envelope(invoke=blacklisted_meanwhile, id="a", type="t", on_failure=heard)
        )
        async with asyncio.timeout(10):
            while (await q.counts()).get("stopped", 0) < 1:  # noqa: ASYNC110 - a row
                await asyncio.sleep(0.01)
        await q.terminate()
    # As in one process: the outcome row of a blacklisted envelope ends it, no hook.
    assert HEARD == []
