"""An envelope's page over PostgreSQL, through HTTP: the row's last error with its
traceback and its failed attempts with their node, and retry, cancel and discard
performed through ``PgQueue.retry``, ``cancel`` and ``discard`` — by the app's own
``PgQueue``, or, serving every queue of a database, by one connected for the action
and closed after it — with the queue's refusals as 409 and no password anywhere."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import web_support as ws

import envq
import envq.web
from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")
pytest.importorskip("starlette")

pytestmark = pytest.mark.real_clock

TOKEN = "pg-envelope-token-0123456789"
NODE = "actions-node"


@asynccontextmanager
async def client(**kw: object) -> AsyncIterator[httpx.AsyncClient]:
    web = envq.web.app(**kw)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=web)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            await c.get("/")
            csrf = c.cookies["envq_csrf"]
            assert (await c.post("/unlock", data={"csrf": csrf, "token": TOKEN})).status_code == 303
            yield c
    finally:
        await envq.web.aclose(web)


async def act(c: httpx.AsyncClient, key: int, action: str, queue: str = "jobs") -> httpx.Response:
    data = {"csrf": c.cookies["envq_csrf"], "q": queue, "key": str(key), "action": action}
    return await c.post("/action", data=data)


async def row(dsn: str, ident: str) -> dict[str, object] | None:
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetchrow(
            "SELECT seq, state::text AS state, kind::text AS kind FROM envq.envelopes"
            " WHERE id = to_jsonb($1::text)",
            ident,
        )
    finally:
        await conn.close()
    return None if found is None else dict(found)


async def state(dsn: str, ident: str) -> str | None:
    found = await row(dsn, ident)
    return None if found is None else str(found["state"])


async def key(dsn: str, ident: str) -> int:
    found = await row(dsn, ident)
    assert found is not None
    return int(found["seq"])  # type: ignore[call-overload]


async def sessions(dsn: str) -> list[str]:
    """The application names of the sessions that say they are envq nodes."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'envq:%'"
        )
    finally:
        await conn.close()
    return sorted(r[0] for r in rows)


def attempts(page: str) -> list[tuple[int, str, str]]:
    """(attempt, outcome, node) of each row of a page's failed attempts."""
    found = re.findall(
        r'<td class="num">(\d+)</td><td>([A-Z_]+)</td>.*?<td class="mono node">([^<]*)</td>', page
    )
    return [(int(n), outcome, node) for n, outcome, node in found]


def offered(page: str) -> set[str]:
    return set(re.findall(r'name="action" value="(retry|cancel|discard)"', page))


async def test_a_failed_envelope_is_retried_through_pgqueue(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    ws.FAILING.add("flaky")
    async with PgQueue(dsn, "jobs", workers=1, poll=0.1, node=NODE) as node:
        await node.install()
        await node.start()
        await node.send(envq.Envelope(invoke=ws.flaky, id="flaky", type="mail"))
        await ws.wait_async("the failure", lambda: _is(dsn, "flaky", "failed"))
        seq = await key(dsn, "flaky")
        async with client(dsn=dsn, token=TOKEN) as c:
            page = (await c.get(f"/envelope?q=jobs&key={seq}")).text
            assert "<i>flaky" not in page
            traceback = re.search(r'<pre class="traceback">([^<]*)</pre>', page)
            assert traceback is not None
            assert "ValueError: <i>flaky</i> is not ready yet" in html.unescape(traceback[1])
            assert "in flaky" in html.unescape(traceback[1])
            assert [(n, o) for n, o, _ in attempts(page)] == [(1, "ERROR")]
            assert attempts(page)[0][2].startswith(NODE)
            assert offered(page) == {"retry", "discard"}
            assert ws.PASSWORD not in page
            ws.FAILING.discard("flaky")
            done = await act(c, seq, "retry")
            assert done.status_code == 303, done.text[-500:]
            assert done.headers["location"] == f"envelope?q=jobs&done=retry&key={seq}"
            await ws.wait_async("the node to run it again", lambda: _is(dsn, "flaky", "succeeded"))
            page = (await c.get(done.headers["location"])).text
            assert 'data-envstate="SUCCEEDED"' in page
            assert "retry done" in page
            # The story stays with the row: the failed attempt and its error.
            assert [(n, o) for n, o, _ in attempts(page)] == [(1, "ERROR")]
            assert "is not ready yet" in html.unescape(page)
            assert offered(page) == {"discard"}
            assert (await c.get(f"/api/envelope?q=jobs&key={seq}")).json() == {"state": "SUCCEEDED"}
            # The PgQueue made for the action is closed: no session of it is left.
            await ws.wait_async(
                "the action's sessions to close",
                lambda: _only_node_sessions(dsn),
            )


async def _is(dsn: str, ident: str, want: str) -> bool:
    return await state(dsn, ident) == want


async def _only_node_sessions(dsn: str) -> bool:
    return all(name == f"envq:{NODE}" for name in await sessions(dsn))


async def test_cancel_discard_and_refusals(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    with ws.gate_closed() as gate:
        # A short lease: the node hears of the cancel at its next renewal (a third of it).
        async with PgQueue(dsn, "jobs", workers=1, poll=0.1, node=NODE, lease=1.5) as node:
            await node.install()
            await node.start()
            await node.send(
                envq.Envelope(invoke=ws.gated, id="long"),
                envq.Envelope(invoke=ws.quick, id="later", delay=600),
                envq.Envelope(invoke=ws.broken, id="bad", type="mail"),
            )
            await ws.wait_async("the attempt", lambda: _is(dsn, "long", "running"))
            async with client(queue=node, token=TOKEN) as c:
                later, long, bad = [await key(dsn, i) for i in ("later", "long", "bad")]
                page = (await c.get(f"/envelope?q=jobs&key={long}")).text
                assert offered(page) == {"cancel"}
                # A running envelope: relabelled, its attempt asked to stop.
                assert (await act(c, long, "cancel")).status_code == 303
                assert (await row(dsn, "long")) is not None
                await ws.wait_async("the cancelled attempt", lambda: _is(dsn, "long", "stopped"))
                assert (await row(dsn, "long"))["kind"] == "cancelled"  # type: ignore[index]
                await ws.wait_async("the failure", lambda: _is(dsn, "bad", "failed"))
                done = await act(c, later, "cancel")
                assert done.status_code == 303
                assert await state(dsn, "later") == "stopped"
                # Refused by the tables, then by the queue (stopped: a retry is a send).
                wrong = await act(c, bad, "cancel")
                assert wrong.status_code == 409
                assert "no CANCEL move from FAILED" in wrong.text
                await node.stop()
                refused = await act(c, bad, "retry")
                assert refused.status_code == 409
                assert f"the retry of envelope {bad} was refused (QueueNotRunning)" in refused.text
                assert await state(dsn, "bad") == "failed"
                # Discarded: the row leaves the table.
                gone = await act(c, later, "discard")
                assert gone.status_code == 303
                assert gone.headers["location"] == "envelopes?q=jobs&done=discard"
                assert await row(dsn, "later") is None
                assert (await c.get(f"/envelope?q=jobs&key={later}")).status_code == 404
                assert (await act(c, later, "discard")).status_code == 404
                assert (await act(c, bad, "retry", queue="nope")).status_code == 404
                for answer in (wrong, refused, gone):
                    assert ws.PASSWORD not in answer.text
            gate.set()
