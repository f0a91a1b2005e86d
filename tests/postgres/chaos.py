"""A chaos soak of ``envq.postgres``: real node processes on a real server, while a
producer keeps sending, are killed (-9), paused past their leases (SIGSTOP), cut off
(``pg_terminate_backend``), lose the replies of their claims and ends after the server
committed them (a proxy in front of one node), and see the server restart
(``pg_ctl restart -m immediate``). Then the chaos stops, every envelope is let finish,
and the database's own history is checked (``fault_support.check_history``): every
envelope sent is there once and SUCCEEDED, every claim was ended exactly once by a
move naming its token, no two leases of an envelope overlapped, every committed
result came from a run inside its own lease — and no ``on_success`` hook ran for an
end the database refused (at most one call per envelope, by the node whose end
committed).

As a program (the 10-minute run of docs/postgres.md, *Faults*)::

    python tests/postgres/chaos.py --seconds 600

The suite runs a short one (``tests/postgres/test_pg_chaos.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import asyncpg  # noqa: E402
import fault_jobs  # noqa: E402
from fault_support import (  # noqa: E402
    Cluster,
    Node,
    check_history,
    create_fault_database,
    fetch,
    restart_server,
    until,
)
from lossy_proxy import LossyProxy  # noqa: E402

import envq  # noqa: E402
from envq.postgres import PgQueue, StoreUnavailable  # noqa: E402
from envq.postgres._server import ThrowawayServer  # noqa: E402

LEASE = 1.0
POLL = 0.2
QUEUE = "chaos"
#: Every envelope must succeed in the end, however often its attempts are cut short.
PATIENT = envq.Retry(attempts=-1, base=0.05, cap=0.5, jitter=False)
#: The statements whose replies the proxy loses (each after the server committed it).
LOSABLE = ("envq.claim", "envq.finish_and_claim", "envq.renew")


def _envelope(key: str, rng: random.Random) -> envq.Envelope:
    return envq.Envelope(
        invoke=fault_jobs.work,
        id=key,
        payload={"queue": QUEUE, "sleep": rng.uniform(0.0, 0.7) * LEASE, "gate": False},
        retry=PATIENT,
        on_success=fault_jobs.success_recorded,
    )


class Soak:
    """One run: the cluster, the proxy, the producer and the chaos."""

    def __init__(self, server: ThrowawayServer, directory: Path, seed: int) -> None:
        self.server = server
        self.directory = directory
        self.rng = random.Random(seed)
        self.actions: collections.Counter[str] = collections.Counter()
        self.keys: list[str] = []
        self.unsure: list[str] = []
        self.named = 0
        self.dsn = ""
        self.proxy: LossyProxy | None = None
        self.cluster: Cluster | None = None
        self.last_restart = time.monotonic()
        #: Seconds between server restarts, at least.
        self.restart_every = 20.0

    def _spawn(self, through_proxy: bool) -> Node:
        assert self.cluster is not None
        assert self.proxy is not None
        self.named += 1
        name = f"{'p' if through_proxy else 'n'}{self.named}"
        options = ["--dsn", self.proxy.dsn(self._database())] if through_proxy else []
        return self.cluster.spawn(QUEUE, name, workers=3, lease=LEASE, poll=POLL, options=options)

    def _database(self) -> str:
        return self.dsn.split("@/", 1)[1].split("?", 1)[0]

    def _live(self) -> list[Node]:
        assert self.cluster is not None
        return [n for n in self.cluster.nodes if n.alive]

    async def _send(self, producer: PgQueue, count: int) -> None:
        """Send ``count`` new envelopes; on a lost connection, the batch is unsure and
        is looked up (and sent again if it is not there) once the database answers."""
        batch = [f"k{len(self.keys) + len(self.unsure) + i}" for i in range(count)]
        try:
            await producer.send(*(_envelope(k, self.rng) for k in batch))
        except StoreUnavailable:
            self.unsure += batch
            return
        self.keys += batch

    async def _settle_unsure(self, producer: PgQueue) -> None:
        if not self.unsure:
            return
        try:
            rows = await fetch(
                self.dsn,
                "SELECT id #>> '{}' AS id FROM envq.envelopes WHERE queue = $1"
                " AND id = ANY($2::jsonb[])",
                QUEUE,
                [json.dumps(k) for k in self.unsure],
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return
        there = {r["id"] for r in rows}
        missing = [k for k in self.unsure if k not in there]
        try:
            if missing:
                await producer.send(*(_envelope(k, self.rng) for k in missing))
        except StoreUnavailable:
            return
        self.keys += self.unsure
        self.unsure = []

    async def _chaos_step(self) -> None:
        live = self._live()
        choices: list[tuple[str, Callable[[], Any]]] = [
            ("stall", self._stall),
            ("kill", self._kill),
            ("terminate_backend", self._terminate_backend),
            ("lose_reply", self._lose_reply),
        ]
        since = time.monotonic() - self.last_restart
        if since > self.restart_every:
            choices.append(("restart", self._restart))
        name, act = self.rng.choice(choices)
        if since > 1.5 * self.restart_every:  # a restart in every run, whatever the draws
            name, act = "restart", self._restart
        if name in ("stall", "kill") and len(live) < 2:
            name, act = "terminate_backend", self._terminate_backend
        self.actions[name] += 1
        await act()

    async def _stall(self) -> None:
        node = self.rng.choice(self._live())
        node.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.rng.uniform(1.2, 2.0) * LEASE)
        finally:
            node.signal(signal.SIGCONT)

    async def _kill(self) -> None:
        node = self.rng.choice(self._live())
        node.kill()
        self._spawn(through_proxy=node.name.startswith("p"))

    async def _terminate_backend(self) -> None:
        with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            await fetch(
                self.dsn,
                "SELECT pg_terminate_backend(pid) FROM (SELECT pid FROM pg_stat_activity"
                " WHERE application_name LIKE 'envq:%' ORDER BY random() LIMIT 1) AS s",
            )

    async def _lose_reply(self) -> None:
        assert self.proxy is not None
        self.proxy.lose_reply(self.rng.choice(LOSABLE))

    async def _restart(self) -> None:
        self.last_restart = time.monotonic()
        await asyncio.to_thread(restart_server, self.server)

    async def run(self, seconds: float) -> dict[str, Any]:
        """Chaos for ``seconds``, then the drain and the checks; the run's figures."""
        self.dsn = await create_fault_database(self.server)
        self.proxy = LossyProxy(self.server.socket_dir / ".s.PGSQL.5432").start()
        self.cluster = Cluster(self.dsn, self.directory)
        started = self.last_restart = time.monotonic()
        self.restart_every = min(20.0, seconds / 2)
        try:
            producer = PgQueue(self.dsn, QUEUE, workers=0, lease=LEASE, poll=POLL)
            async with producer:
                await producer.start()
                nodes = [self._spawn(False), self._spawn(False), self._spawn(True)]
                await asyncio.to_thread(_wait_ready, nodes)
                until_t = time.monotonic() + seconds
                next_chaos = time.monotonic() + 1.0
                while time.monotonic() < until_t:
                    await self._send(producer, self.rng.randint(1, 6))
                    await self._settle_unsure(producer)
                    if time.monotonic() >= next_chaos:
                        await self._chaos_step()
                        next_chaos = time.monotonic() + self.rng.uniform(0.5, 2.0)
                    await asyncio.sleep(self.rng.uniform(0.05, 0.3))
                chaos_s = time.monotonic() - started
                for node in self.cluster.nodes:
                    if node.alive:
                        node.signal(signal.SIGCONT)
                while self.unsure:
                    await self._settle_unsure(producer)
                    await asyncio.sleep(0.2)
                if len(self._live()) < 2:
                    self._spawn(False)
                await until(
                    lambda: _all_succeeded(self.dsn, len(self.keys)),
                    "every envelope to succeed",
                    timeout=180.0,
                    cluster=self.cluster,
                )
            stories = await check_history(self.dsn, QUEUE, self.keys)
            hooks = await fetch(
                self.dsn,
                "SELECT key, node FROM fault_hooks WHERE queue = $1 AND hook = 'on_success'",
                QUEUE,
            )
            _check_hooks(stories, hooks)
            leases = [x for s in stories.values() for x in s.leases]
            return {
                "seconds": round(chaos_s, 1),
                "envelopes": len(self.keys),
                "attempts": len(leases),
                "expired": sum(x.event == "attempt_expired" for x in leases),
                "on_success": len(hooks),
                "replies_lost": self.proxy.lost,
                "nodes_started": self.named,
                "actions": dict(self.actions),
            }
        finally:
            self.cluster.close()
            self.proxy.close()


def _wait_ready(nodes: list[Node]) -> None:
    until_t = time.monotonic() + 120
    for node in nodes:
        while f"ready {node.name}" not in node.stdout():
            assert node.alive, f"node {node.name} died:\n{node.stderr()[-3000:]}"
            assert time.monotonic() < until_t, f"node {node.name} never served"
            time.sleep(0.05)


async def _all_succeeded(dsn: str, count: int) -> bool:
    rows = await fetch(
        dsn,
        "SELECT count(*) FILTER (WHERE state = 'succeeded') AS done, count(*) AS n"
        " FROM envq.envelopes WHERE queue = $1",
        QUEUE,
    )
    return bool(rows[0]["done"] == rows[0]["n"] == count)


def _check_hooks(stories: dict[str, Any], hooks: list[asyncpg.Record]) -> None:
    """At most one ``on_success`` per envelope, run by the node whose end committed."""
    calls: dict[str, list[str]] = collections.defaultdict(list)
    for hook in hooks:
        calls[hook["key"]].append(hook["node"])
    for key, nodes in calls.items():
        assert len(nodes) <= 1, f"{key}: on_success ran {len(nodes)} times: {nodes}"
        (ok,) = [x for x in stories[key].leases if x.event == "attempt_ok"]
        owner = ok.owner.rsplit("#", 1)[0]
        assert nodes == [owner], f"{key}: on_success ran on {nodes}, its end on {owner}"


def main(argv: list[str] | None = None) -> int:
    """Run one soak on a throwaway server; print its figures; 0 if every check held."""
    parser = argparse.ArgumentParser(prog="python tests/postgres/chaos.py")
    parser.add_argument("--seconds", type=float, default=600.0, help="chaos time (600)")
    parser.add_argument("--seed", type=int, default=20261128, help="the chaos's seed")
    args = parser.parse_args(argv)
    server = ThrowawayServer()
    server.start()
    try:
        with tempfile.TemporaryDirectory(prefix="envq-chaos-") as directory:
            report = asyncio.run(Soak(server, Path(directory), args.seed).run(args.seconds))
    finally:
        server.stop()
    print(json.dumps(report, indent=2))
    print("every envelope accounted for: PASS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
