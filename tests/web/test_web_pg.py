"""The dashboard over PostgreSQL, through HTTP: the counts are the rows', pages walk
the envelopes by keyset, the journal's moves name their rows, leases are shown, the
DSN's password never is, and a database that goes away answers 503 with the reason
and is read again once it is back."""

from __future__ import annotations

import asyncio
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

TOKEN = "pg-action-token-0123456789"


@asynccontextmanager
async def client(**kw: object) -> AsyncIterator[httpx.AsyncClient]:
    web = envq.web.app(**kw)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=web)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            yield c
    finally:
        await envq.web.aclose(web)


async def db_counts(dsn: str, queue: str) -> dict[str, int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT state::text, count(*) FROM envq.envelopes WHERE queue = $1 GROUP BY 1",
            queue,
        )
    finally:
        await conn.close()
    return {state.upper(): n for state, n in rows}


def counts_in(page: str, queue: str) -> dict[str, int]:
    found = re.findall(rf'data-q="{re.escape(queue)}" data-count="([A-Z]+)">(\d+)<', page)
    assert found, "no count on the page"
    return {state: int(n) for state, n in found if int(n)}


async def test_pages_read_the_rows(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    async with PgQueue(dsn, "mail", workers=0) as producer:
        await producer.install()
        await producer.start()
        await producer.send(*(envq.Envelope(invoke=ws.quick, id=i, type="mail") for i in range(7)))
        await producer.send(envq.Envelope(invoke=ws.quick, id="later", delay=600))
        await producer.send(envq.Envelope(invoke=ws.quick, id="tick", interval=30, type="tick"))
    async with PgQueue(dsn, "idle", workers=0) as idle:
        await idle.send(envq.Envelope(invoke=ws.quick, id="b"))  # INIT: buffered
    want = await db_counts(dsn, "mail")
    assert want == {"READY": 8, "DELAYED": 1}
    async with client(dsn=dsn) as c:
        page = await c.get("/")
        assert page.status_code == 200
        assert counts_in(page.text, "mail") == want
        assert counts_in(page.text, "idle") == {"BUFFERED": 1}
        assert ws.PASSWORD not in page.text
        machines = (await c.get("/queue?q=mail")).text
        assert counts_in(machines, "mail") == want
        body = (await c.get("/api/counts")).json()["queues"]
        assert body["idle"]["state"] == "INIT"
        assert body["mail"]["state"] == "RUNNING"
        assert {k: v for k, v in body["mail"]["counts"].items() if v} == want
        # Keyset pages, newest first, every envelope once.
        keys: list[int] = []
        url = "/envelopes?q=mail&limit=3"
        while url:
            listed = (await c.get(url)).text
            keys += [int(k) for k in re.findall(r"key=(\d+)\"", listed)]
            older = re.search(r'rel="next" href="([^"]+)"', listed)
            url = "/" + html.unescape(older[1]) if older else ""
        assert len(keys) == 9
        assert keys == sorted(keys, reverse=True)
        assert (
            len(re.findall(r"key=\d+\"", (await c.get("/envelopes?q=mail&state=delayed")).text))
            == 1
        )
        assert len(re.findall(r"key=\d+\"", (await c.get("/envelopes?q=mail&type=mail")).text)) == 7
        for ident in ("3", '"later"', "later"):
            found = (await c.get("/envelopes", params={"q": "mail", "id": ident})).text
            assert len(re.findall(r"key=\d+\"", found)) == 1, ident
        schedules = (await c.get("/schedules?q=mail")).text
        assert "every 30s (FIXED_DELAY)" in schedules
        assert "later" not in schedules
        one = (await c.get(f"/envelope?q=mail&key={keys[-1]}")).text
        assert "web_support:quick" in one
        assert "journal of this queue is off" in one
        assert (await c.get("/envelope?q=mail&key=99999")).status_code == 404
        assert (await c.get("/queue?q=nope")).status_code == 404
        assert (await c.get("/queue")).status_code == 400


async def test_moves_from_the_journal_name_their_rows(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    heard: list[envq.Event] = []
    heard_node = "journal-node"
    async with PgQueue(dsn, "jobs", workers=2, poll=0.1, node=heard_node) as node:
        await node.install()
        node.subscribe(heard.append)  # turns the journal on
        await node.start()
        await node.send(
            envq.Envelope(
                invoke=ws.broken, id="b", retry=envq.Retry(attempts=2, base=0.05, jitter=False)
            )
        )
        await ws.wait_async("the envelope to fail", lambda: _failed(node), limit=60)
    async with client(dsn=dsn) as c:
        listed = (await c.get("/envelopes?q=jobs&state=failed")).text
        key = re.search(r"key=(\d+)\"", listed)
        assert key is not None
        one = (await c.get(f"/envelope?q=jobs&key={key[1]}")).text
        rows = [html.unescape(r) for r in re.findall(r'<td class="mono">([^<]*\[[^<]*)</td>', one)]
        assert rows == [
            "QUEUE_MOVES[(NEW, SEND)] (ARRIVAL: NOW)",
            "QUEUE_MOVES[(READY, DISPATCH)]",
            "OUTCOMES[(ONE_OFF, ERROR)] → DECISION_TARGET[RETRY_AFTER]",
            "QUEUE_MOVES[(DELAYED, DUE)]",
            "QUEUE_MOVES[(READY, DISPATCH)]",
            "OUTCOMES[(ONE_OFF, ERROR)]",
        ]
        # The node of each attempt's moves (its claim and its end), none for the others.
        moved_by = re.findall(r'<td class="node">([^<]*)</td>', one)
        assert len(moved_by) == len(rows)
        attempt_moves = [1, 2, 4, 5]  # the two dispatches and the two ends
        assert all(moved_by[i] == node.lease_owner for i in attempt_moves), moved_by
        assert [moved_by[i] for i in (0, 3)] == ["", ""]
        # Its story, from the row: the last error with the traceback, escaped, and
        # both failed attempts with the node that ran them.
        assert "<b>on purpose" not in one
        error = re.search(r'<pre class="traceback">([^<]*)</pre>', one)
        assert error is not None
        assert "RuntimeError: broken <b>on purpose</b>" in html.unescape(error[1])
        assert "in broken" in html.unescape(error[1])  # the job's frame
        attempts = re.findall(
            r'<td class="num">(\d+)</td><td>([A-Z]+)</td>.*?<td class="mono node">([^<]*)</td>',
            one,
        )
        assert [(int(n), outcome) for n, outcome, _ in attempts] == [(1, "ERROR"), (2, "ERROR")]
        assert all(node.startswith(heard_node) for _, _, node in attempts)


async def _failed(queue: PgQueue) -> bool:
    return (await queue.counts()).get("failed", 0) == 1


async def test_leases_and_nodes_are_shown(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    with ws.gate_closed():
        async with PgQueue(dsn, "held", workers=2, poll=0.1, node="node-a") as node:
            await node.install()
            await node.start()
            await node.send(*(envq.Envelope(invoke=ws.gated, id=i) for i in range(3)))
            await ws.wait_async("two attempts", lambda: _running(node, 2))
            async with client(queue=node) as c:
                page = (await c.get("/")).text
                assert node.lease_owner in page
                assert re.search(r"<td class=\"num\">2</td>", page)
                assert "node-a" in page
                assert ws.PASSWORD not in page
                ws.GATE.set()
                await ws.wait_async("the ends", lambda: _ended(node, 3))


async def _running(queue: PgQueue, n: int) -> bool:
    return (await queue.counts()).get("running", 0) == n


async def _ended(queue: PgQueue, n: int) -> bool:
    return (await queue.counts()).get("succeeded", 0) == n


async def test_actions_go_through_pgqueue(web_db: Callable[[], str]) -> None:
    dsn = web_db()
    async with PgQueue(dsn, "ops", workers=0) as q:
        await q.install()
        await q.start()
    async with client(dsn=dsn, token=TOKEN) as c:
        await c.get("/queue?q=ops")
        csrf = c.cookies["envq_csrf"]
        assert (await c.post("/unlock", data={"csrf": csrf, "token": TOKEN})).status_code == 303
        stop = await c.post("/action", data={"csrf": csrf, "q": "ops", "action": "stop"})
        assert stop.status_code == 303
        body = (await c.get("/api/counts?q=ops")).json()
        assert body["queues"]["ops"]["state"] in ("STOPPING", "STOPPED")
        start = await c.post("/action", data={"csrf": csrf, "q": "ops", "action": "start"})
        assert start.status_code == 303
        body = (await c.get("/api/counts?q=ops")).json()
        assert body["queues"]["ops"]["state"] == "RUNNING"
        gone = await c.post("/action", data={"csrf": csrf, "q": "nope", "action": "stop"})
        assert gone.status_code == 404


async def test_a_database_that_goes_away_answers_503_then_recovers(
    web_pg: object, web_db: Callable[[], str]
) -> None:
    dsn = web_db()
    async with PgQueue(dsn, "mail", workers=0) as q:
        await q.install()
        await q.send(envq.Envelope(invoke=ws.quick, id=1))
    async with client(dsn=dsn) as c:
        assert (await c.get("/")).status_code == 200
        await asyncio.to_thread(ws.stop_server, web_pg)  # type: ignore[arg-type]
        try:
            page = await c.get("/")
            assert page.status_code == 503
            assert "cannot be reached" in page.text
            assert 'id="banner"' in page.text
            assert 'data-down="1"' in page.text
            api = await c.get("/api/counts")
            assert api.status_code == 503
            assert "cannot be reached" in api.json()["error"]
            for answer in (page.text, api.text):
                assert ws.PASSWORD not in answer
                assert "postgresql://" not in answer
        finally:
            await asyncio.to_thread(ws.start_server, web_pg)  # type: ignore[arg-type]
        again = await c.get("/")
        assert again.status_code == 200, again.text[-900:]
        assert counts_in(again.text, "mail") == {"BUFFERED": 1}


async def test_a_database_without_the_schema_says_so(web_pg: object) -> None:
    conn = await asyncpg.connect(web_pg.dsn())  # type: ignore[attr-defined]
    try:
        await conn.execute("CREATE DATABASE web_bare")
    finally:
        await conn.close()
    async with client(dsn=ws.with_password(web_pg.dsn("web_bare"))) as c:  # type: ignore[attr-defined]
        page = await c.get("/")
        assert page.status_code == 503
        assert "no envq schema" in page.text


async def test_the_chart_counts_the_ends_and_cron_is_listed(web_db: Callable[[], str]) -> None:
    """The ends' chart counts the SUCCEEDED and FAILED rows of the last minutes; a cron
    envelope is on the schedules page with its calendar and next run."""
    dsn = web_db()
    async with PgQueue(dsn, "ends", workers=4, poll=0.1) as node:
        await node.install()
        await node.start()
        await node.send(*(envq.Envelope(invoke=ws.quick, id=f"ok{i}") for i in range(6)))
        await node.send(*(envq.Envelope(invoke=ws.broken, id=f"bad{i}") for i in range(2)))
        await node.send(
            envq.Envelope(invoke=ws.quick, id="nightly", schedule=envq.Cron("0 3 * * *"))
        )

        async def ended() -> bool:
            counts = await node.counts()
            return counts.get("succeeded", 0) == 6 and counts.get("failed", 0) == 2

        await ws.wait_async("the ends", ended, limit=60)
        async with client(dsn=dsn) as c:
            for path in ("/", "/queue?q=ends"):
                page = (await c.get(path)).text
                caption = re.search(
                    r'<span class="ok-key">(\d+) succeeded</span>, '
                    r'<span class="bad-key">(\d+) failed</span>',
                    page,
                )
                assert caption is not None, path
                assert (int(caption[1]), int(caption[2])) == (6, 2), path
                bars = re.findall(r"<title>[^<]*: (\d+) succeeded, (\d+) failed</title>", page)
                assert sum(int(ok) for ok, _ in bars) == 6
                assert sum(int(bad) for _, bad in bars) == 2
            schedules = html.unescape((await c.get("/schedules?q=ends")).text)
            assert "nightly" in schedules
            assert "ok0" not in schedules
            assert re.search(r"0 3 \* \* \*", schedules), schedules
            assert re.search(r"\d{4}-\d\d-\d\d 03:00:00 UTC", schedules), schedules
