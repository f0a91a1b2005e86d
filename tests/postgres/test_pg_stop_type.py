"""A StopType attempt on a real server: the ban of its type commits with its end.

In one process the attempt raising StopType bans its type as it ends; an attempt of
the same type ending on another node must not see the ban (and end STOPPED) before
the attempt that made it has ended. The ends below are committed late on purpose (a
slow finisher): a ban committed on its own would be visible that long before the
end of the attempt that made it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pg_jobs
import pytest

import envq
from envq.postgres._node import Node
from envq.postgres._queue import PgQueue

asyncpg = pytest.importorskip("asyncpg")

pytestmark = pytest.mark.real_clock

#: One snapshot: whether the type is banned, and the state of the StopType envelope.
_BANNED_AND_STATE = """
SELECT $2 = ANY(q.blacklist) AS banned, e.state::text AS state
  FROM envq.queues AS q JOIN envq.envelopes AS e ON e.queue = q.name
 WHERE q.name = $1 AND e.id #>> '{}' = $3
"""


async def test_the_ban_of_a_type_commits_with_the_end_of_the_stop_type_attempt(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ending = Node._end

    async def slow_end(self: Node, batch: Any, how_many: int) -> Any:
        await asyncio.sleep(0.3)
        return await ending(self, batch, how_many)

    monkeypatch.setattr(Node, "_end", slow_end)
    name = f"stoptype-{uuid.uuid4().hex[:10]}"
    watcher = await asyncpg.connect(pg_dsn)
    try:
        async with PgQueue(pg_dsn, name, workers=2, poll=0.01) as q:
            await q.start()
            await q.send(envq.Envelope(invoke=pg_jobs.stop_type, id="st", type="t"))
            seen: list[tuple[bool, str]] = []
            async with asyncio.timeout(10):
                while not seen or not seen[-1][0]:
                    row = await watcher.fetchrow(_BANNED_AND_STATE, name, "t", "st")
                    seen.append((row["banned"], row["state"]))
            # The first snapshot showing the ban shows the attempt ended too.
            assert seen[-1] == (True, "stopped"), seen[-5:]
            with pytest.raises(envq.TypeBlacklisted):
                await q.send(envq.Envelope(invoke=pg_jobs.noop, id="later", type="t"))
            await q.terminate()
    finally:
        await watcher.close()
