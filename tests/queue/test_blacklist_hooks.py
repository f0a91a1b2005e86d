"""A type blacklisted while an envelope of it is inside a hook (``on_failure`` deciding
a retry, ``on_success`` of a periodic run): that envelope never runs again; it ends
STOPPED when its hook returns."""

from __future__ import annotations

import asyncio

import envq

S = envq.EnvState


async def stop_type(env: envq.Envelope) -> None:
    await asyncio.sleep(0.25)
    raise envq.StopType


async def test_blacklisted_while_on_failure_decides_a_retry() -> None:
    runs: list[float] = []
    hooks: list[float] = []

    async def fail(env: envq.Envelope) -> None:
        runs.append(asyncio.get_running_loop().time())
        raise ValueError("boom")

    async def decide(env: envq.Envelope, error: BaseException, attempt: int) -> envq.Decision:
        hooks.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.5)  # the type is banned meanwhile, at t=0.25
        return envq.retry_after(0.5)

    q = envq.Queue("ban", workers=2)
    ends: dict[str, envq.Event] = {}
    q.subscribe(
        lambda ev: (
            ends.__setitem__(str(ev.envelope.id), ev)
            if ev.envelope is not None and ev.to_state in (S.SUCCEEDED, S.FAILED, S.STOPPED)
            else None
        )
    )
    victim = envq.Envelope(invoke=fail, on_failure=decide, type="t", id="victim")
    culprit = envq.Envelope(invoke=stop_type, type="t", id="culprit")
    q.start()
    q.send(victim, culprit)
    await asyncio.sleep(10)
    assert runs == [0.0]
    assert hooks == [0.0]
    assert ends["victim"].to_state is S.STOPPED
    assert ends["victim"].time == 0.5
    assert ends["culprit"].to_state is S.STOPPED
    assert q.state_of(victim) is None
    assert q.statistics().by_state[S.STOPPED] == 2
    await q.terminate()


async def test_blacklisted_while_a_periodic_on_success_runs() -> None:
    runs: list[float] = []

    async def tick(env: envq.Envelope) -> None:
        runs.append(asyncio.get_running_loop().time())

    async def slow_success(env: envq.Envelope) -> None:
        await asyncio.sleep(0.5)

    q = envq.Queue("ban_periodic", workers=2)
    periodic = envq.Envelope(invoke=tick, on_success=slow_success, interval=5, type="t")
    q.start()
    q.send(periodic, envq.Envelope(invoke=stop_type, type="t"))
    await asyncio.sleep(30)
    assert runs == [0.0]
    assert q.state_of(periodic) is None
    assert q.statistics().by_state[S.STOPPED] == 2
    await q.terminate()


async def test_blacklisted_while_a_one_off_on_failure_reports() -> None:
    """A DoNotRetry's on_failure only reports; the envelope still ends STOPPED, not
    FAILED, once its type is banned (whatever the outcome, as while it runs)."""
    seen: list[envq.EnvState] = []

    async def give_up(env: envq.Envelope) -> None:
        raise envq.DoNotRetry("no")

    async def report(env: envq.Envelope, error: BaseException, attempt: int) -> None:
        await asyncio.sleep(0.5)

    q = envq.Queue("ban_report", workers=2)
    env = envq.Envelope(invoke=give_up, on_failure=report, type="t")
    q.subscribe(lambda ev: seen.append(ev.to_state) if ev.envelope is env else None)
    q.start()
    q.send(env, envq.Envelope(invoke=stop_type, type="t"))
    await asyncio.sleep(10)
    assert seen[-1] is S.STOPPED
    await q.terminate()
