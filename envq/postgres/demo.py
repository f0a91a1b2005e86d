"""``envq demo --postgres``: several worker processes share one queue; one is killed.

The demo starts a throwaway PostgreSQL server when no DSN is given (``--dsn`` or
``$ENVQ_DSN``), starts ``--nodes`` worker processes (``python -m envq.postgres.node``)
on one queue, sends envelopes (some fail once and are retried by their policy),
kills one node with SIGKILL while it runs attempts, and shows the others reap its
expired leases and finish everything. It ends by stopping the queue (DRAIN) and
accounting for every envelope: exit status 0 when none is lost.

With ``--web PORT`` it also serves the dashboard of its database (``python -m envq
web``, read-only) and prints its address, records the queue's moves (its journal, so
that an envelope's page shows them), paces the work so that a person can follow it
(each unit of work takes 0.3 s instead of 0.05), and at the end waits for Enter before
it stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import envq
from envq.postgres._queue import PgQueue

__all__ = ["flaky", "run_pg_demo", "work"]

#: The demo's queue.
QUEUE = "envq-demo"
#: Seconds a lease lasts in the demo (short, so that the reaping shows quickly).
LEASE = 2.0


async def work(env: envq.Envelope) -> None:
    """A unit of work: a short wait (the payload's ``pace``, 0.05 s by default)."""
    await asyncio.sleep(float(env.payload.get("pace", 0.05)))


async def flaky(env: envq.Envelope) -> None:
    """Fails one attempt in two (the envelope's retry policy decides what follows)."""
    await asyncio.sleep(float(env.payload.get("pace", 0.05)))
    if random.random() < 0.5:
        raise RuntimeError("flaky: this attempt fails")


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


@contextlib.contextmanager
def _database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from envq.postgres._server import ThrowawayServer  # noqa: PLC0415

    _say("no DSN given (--dsn or $ENVQ_DSN): starting a throwaway PostgreSQL server")
    with ThrowawayServer() as server:
        yield server.dsn()


def _node(dsn: str, name: str, workers: int) -> subprocess.Popen[str]:
    env = dict(os.environ, ENVQ_DSN=dsn)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "envq.postgres.node",
            "--queue",
            QUEUE,
            "--workers",
            str(workers),
            "--lease",
            str(LEASE),
            "--poll",
            "0.2",
            "--node",
            name,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


@contextlib.contextmanager
def _dashboard(dsn: str, port: int | None) -> Iterator[subprocess.Popen[str] | None]:
    """``python -m envq web`` on the demo's database while the demo runs (None: no
    ``--web``); its address is said once it listens."""
    if port is None:
        yield None
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "envq", "web", "--port", str(port)],
        env=dict(os.environ, ENVQ_DSN=dsn),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("envq web: "):
            _say(f"the dashboard did not start (status {proc.wait()})")
        else:
            _say(f"dashboard: {line.removeprefix('envq web: ')} - open it to watch the queue")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def _demo(dsn: str, nodes: int, count: int, web: int | None = None) -> int:
    queue = PgQueue(dsn, QUEUE, workers=0, node="demo-producer", poll=0.2)
    await queue.install()
    async with queue:
        # A fresh run each time: hand back whatever an earlier run left.
        state = await queue.state()
        if state is not envq.QueueState.INIT:
            _say(f"queue {QUEUE!r} was {state.value}: clearing it")
            async with queue._db().acquire() as conn:  # the demo owns its queue
                await conn.execute("DELETE FROM envq.envelopes WHERE queue = $1", QUEUE)
                await conn.execute("DELETE FROM envq.queues WHERE name = $1", QUEUE)
                await conn.execute("INSERT INTO envq.queues (name) VALUES ($1)", QUEUE)
        if web is not None:  # an envelope's page shows its moves
            await queue._db().execute(
                "UPDATE envq.queues SET journal = true WHERE name = $1", QUEUE
            )
        pace = {"pace": 0.3} if web is not None else {}
        procs = {f"node-{i + 1}": _node(dsn, f"node-{i + 1}", 4) for i in range(nodes)}
        try:
            for name, proc in procs.items():
                assert proc.stdout is not None
                line = await asyncio.to_thread(proc.stdout.readline)
                _say(f"{name}: {line.strip() or 'did not start'}")
            policy = envq.Retry(attempts=10, base=0.1, cap=0.5, jitter=False)
            envelopes = [
                envq.Envelope(
                    invoke=flaky if i % 10 == 0 else work,
                    id=i,
                    payload={"n": i, **pace},
                    retry=policy,
                )
                for i in range(count)
            ]
            await queue.send(*envelopes)
            _say(f"sent {count} envelopes ({count // 10} fail one attempt in two, and are retried)")
            victim = next(iter(procs))
            await _until_running(queue, victim)
            procs[victim].send_signal(signal.SIGKILL)
            held = await _held_by(queue, victim)
            _say(
                f"killed {victim} with SIGKILL while it held {held} lease(s); they expire "
                f"after {LEASE:g} s and another node reaps them"
            )
            last = None
            while True:
                counts = await queue.counts()
                if counts != last:
                    _say("states: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
                    last = counts
                if counts.get("succeeded", 0) + counts.get("failed", 0) >= count:
                    break
                await asyncio.sleep(0.5)
            await queue.stop()
            _say(f"queue stopped: {(await queue.state()).value}")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for name, proc in procs.items():
                out, _ = await asyncio.to_thread(proc.communicate)
                if proc.returncode == -signal.SIGKILL:
                    _say(f"{name}: killed")
                else:
                    _say(f"{name}: {out.strip().splitlines()[-1] if out.strip() else 'no report'}")
        counts = await queue.counts()
        retried = await queue._db().fetchval(
            "SELECT count(*) FROM envq.envelopes WHERE queue = $1 AND attempt > 1", QUEUE
        )
        ended = counts.get("succeeded", 0) + counts.get("failed", 0)
        lost = count - ended
        _say(
            f"{counts.get('succeeded', 0)} of {count} succeeded, {counts.get('failed', 0)} "
            f"failed after {policy.attempts} attempts, {retried} needed more than one "
            f"attempt, {lost} lost"
        )
        return 0 if lost == 0 else 1


async def _until_running(queue: PgQueue, node: str) -> None:
    for _ in range(200):
        if await _held_by(queue, node):
            return
        await asyncio.sleep(0.02)


async def _held_by(queue: PgQueue, node: str) -> int:
    return int(
        await queue._db().fetchval(
            "SELECT count(*) FROM envq.envelopes WHERE queue = $1 AND state = 'running'"
            # A node holds its leases under its name and a suffix of its own.
            " AND left(lease_owner, length($2) + 1) = $2 || '#'",
            QUEUE,
            node,
        )
    )


def run_pg_demo(
    dsn: str | None = None, nodes: int = 3, count: int = 400, *, web: int | None = None
) -> int:
    """Run the demo; its exit status (0: nothing lost). ``web``: serve the dashboard on
    this port (0: any free one) while it runs, and wait for Enter at the end."""
    dsn = dsn or os.environ.get("ENVQ_DSN")
    try:
        with _database(dsn) as where, _dashboard(where, web) as board:
            status = asyncio.run(_demo(where, nodes, count, web))
            if board is not None and board.poll() is None:
                _say("press Enter to stop the dashboard and the demo's server")
                with contextlib.suppress(EOFError):
                    input()
            return status
    except KeyboardInterrupt:
        return 130
