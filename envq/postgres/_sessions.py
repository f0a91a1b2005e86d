"""A shared queue's connections: :class:`PgSessions`, the part of
:class:`envq.postgres.PgQueue` that installs the schema, opens and closes this
process's pool, and lends its sessions to the node (part of its public API:
``install()``, ``connect()``, ``close()``, ``async with``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Self, TypeAlias, cast

from envq.postgres._edges import (
    check_schema,
    lost,
    queue_row,
    refuse_hidden_pooler,
    unavailable,
    unreachable,
)
from envq.postgres._loop import on_its_loop
from envq.postgres._node import _returned
from envq.postgres.migrations import install as install_schema

if TYPE_CHECKING:
    import asyncpg

    from envq.postgres._journal import Follower
    from envq.postgres._node import Node

__all__ = ["PgSessions"]

log = logging.getLogger("envq.postgres")

#: A pooled connection, as the pool lends it.
_Conn: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"


class PgSessions:
    """The connections of :class:`envq.postgres.PgQueue` (its calls of this part are
    documented there)."""

    name: str
    node: str
    workers: int
    pooler: str | None
    capacity: int
    _asked_capacity: int | None
    _dsn: str
    _pool: asyncpg.Pool | None
    _loop: asyncio.AbstractEventLoop | None
    _node: Node
    _events: Follower

    # -- connections -------------------------------------------------------------------

    async def install(self) -> None:
        """Create envq's schema in the database unless it is there, or upgrade it to
        this envq's version, keeping every row (safe to call from several processes at
        once: one of them does it, under a lock; :mod:`envq.postgres.migrations`).

        :raises RuntimeError: the database holds a schema this envq cannot upgrade or
            run on (the message says what to do).
        """
        import asyncpg  # noqa: PLC0415 - the extra is optional

        # One transaction: a pooler in transaction mode keeps its server session.
        conn = await self._connect(asyncpg)
        try:
            found, now = await install_schema(conn)
        finally:
            await conn.close()
        if found is not None and found != now:
            log.warning("envq's schema upgraded from version %d to %d", found, now)

    async def _connect(self, driver: Any) -> asyncpg.Connection:
        try:
            return cast(
                "asyncpg.Connection", await driver.connect(self._dsn, **self._driver_options())
            )
        except unreachable(driver) as error:
            raise unavailable(self.name, self._dsn, error) from None

    @on_its_loop
    async def connect(self) -> None:
        """Open this process's connections and create the queue's row if it is new."""
        if self._pool is not None:
            return
        import asyncpg  # noqa: PLC0415

        try:
            pool = await asyncpg.create_pool(
                self._dsn,
                min_size=1,
                max_size=max(2, min(self.workers, 8) + 2),
                server_settings=self._session_settings(),
                reset=_returned,
                **self._driver_options(),
            )
        except unreachable(asyncpg) as error:
            raise unavailable(self.name, self._dsn, error) from None
        # Kept only once the schema is there and the queue's row made: a connect that
        # failed leaves this object unconnected (and a second connect tries again).
        try:
            async with pool.acquire() as conn:
                if self.pooler is None:
                    await refuse_hidden_pooler(pool, conn, self.name)
                await check_schema(conn, self.name)
                self.capacity = await queue_row(conn, self.name, self._asked_capacity)
        except BaseException as error:
            pool.terminate()
            if isinstance(error, lost(asyncpg)):
                raise unavailable(self.name, self._dsn, error) from None
            raise
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._events.connected()

    def _driver_options(self) -> dict[str, Any]:
        """asyncpg's options for this queue's sessions: behind a pooler in transaction
        mode, no named prepared statements (each transaction may run in another server
        session, where a statement prepared in an earlier one is missing, or is another
        client's of the same name); asyncpg then prepares each statement unnamed with
        its execution."""
        return {"statement_cache_size": 0} if self.pooler == "transaction" else {}

    def _session_settings(self) -> dict[str, str]:
        """The settings of this node's sessions: their ``application_name`` names the
        node (``envq:<node>``), so that an operator can find them in
        ``pg_stat_activity``."""
        return {"application_name": f"envq:{self.node}"}

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[_Conn]:
        """A pooled connection for one step of the node; one whose session is lost is
        thrown away, not put back: a session cut in the middle of a statement can look
        open to the pool and fail every later statement."""
        import asyncpg  # noqa: PLC0415

        async with self._db().acquire() as conn:
            try:
                yield conn
            except lost(asyncpg):
                # (One the driver saw close has gone back to the pool already.)
                with contextlib.suppress(asyncpg.InterfaceError):
                    conn.terminate()
                raise

    @on_its_loop
    async def close(self) -> None:
        """Leave: this node stops claiming, lets its attempts in flight end (their
        results commit), and closes its connections. The shared queue is not stopped:
        other nodes go on."""
        await self._node.leave()
        try:
            await self._events.close()
        finally:
            if self._pool is not None:
                await self._pool.close()
                self._pool = None
            self._loop = None

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _db(self) -> asyncpg.Pool:
        if self._pool is None:
            raise RuntimeError(
                f"queue {self.name!r}: not connected (use `async with` or connect())"
            )
        return self._pool
