"""The dashboard in a real browser: headless Chromium (Debian's) driven by Playwright.

Against PostgreSQL, with envelopes in every state across three queues: the overview
shows the database's counts, and a count changes on the open page when envelopes end;
actions are refused without the token and work with it; a database that goes away
shows a banner that goes once it is back. The same for an in-process queue mounted in
a small Starlette app. With ``ENVQ_WEB_SCREENSHOTS=1`` the first test writes a
screenshot of each page into ``docs/assets/`` for ``docs/web.md``.

They skip when Chromium or Playwright is missing, unless ``ENVQ_REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import web_support as ws

import envq
import envq.web
from envq.postgres import PgQueue
from envq.web._source import STORED

asyncpg = pytest.importorskip("asyncpg")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

TOKEN = "browser-action-token-0123456789"
LIMIT = ws.LIMIT
shoot = ws.shoot


def shown(page: Any, queue: str, state: str) -> str:
    return page.locator(f'[data-q="{queue}"][data-count="{state}"]').first.text_content()


def wait_shown(page: Any, queue: str, state: str, value: int) -> None:
    page.wait_for_function(
        "([q, s, v]) => { const el = document.querySelector("
        '`[data-q="${q}"][data-count="${s}"]`); return el && el.textContent === v; }',
        arg=[queue, state, str(value)],
        timeout=LIMIT,
    )


async def db_counts(dsn: str) -> dict[str, dict[str, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT queue, state::text, count(*) FROM envq.envelopes GROUP BY 1, 2"
        )
    finally:
        await conn.close()
    found: dict[str, dict[str, int]] = {}
    for queue, state, n in rows:
        found.setdefault(queue, {})[state.upper()] = n
    return found


async def _counts(queue: PgQueue) -> dict[str, int]:
    return await queue.counts()


async def every_state(dsn: str) -> PgQueue:
    """Three queues holding envelopes in every stored state between them; the node
    of ``main`` (two workers, left running: two gated attempts hold them)."""
    async with PgQueue(dsn, "waiting", workers=0) as waiting:
        await waiting.install()
        await waiting.send(*(envq.Envelope(invoke=ws.quick, id=f"b{i}") for i in range(2)))
    async with PgQueue(dsn, "paused", workers=0) as paused:
        await paused.start()
        await paused.send(
            *(envq.Envelope(invoke=ws.quick, id=f"p{i}", delay=600) for i in range(3))
        )
        await paused.stop()
    conn = await asyncpg.connect(dsn)
    try:
        # A PARKED envelope handed back by a terminate stays RETURNED only until the
        # terminating process takes it; the tables' own move keeps one here.
        await conn.execute(
            "UPDATE envq.envelopes SET state = 'returned', event = 'terminate'"
            " WHERE seq = (SELECT min(seq) FROM envq.envelopes WHERE queue = 'paused')"
        )
    finally:
        await conn.close()
    main = PgQueue(dsn, "main", workers=2, poll=0.1, node="web-node")
    await main.connect()
    # The journal on: an envelope's page then shows its moves, each with its table row.
    await main._db().execute("UPDATE envq.queues SET journal = true WHERE name = 'main'")
    await main.start()
    await main.send(
        *(envq.Envelope(invoke=ws.quick, id=f"ok{i}", type="mail") for i in range(3)),
        *(envq.Envelope(invoke=ws.broken, id=f"bad{i}", type="mail") for i in range(2)),
        envq.Envelope(invoke=ws.stopping, id="stop", type="report"),
        envq.Envelope(invoke=ws.quick, id="hourly", type="tick", interval=3600),
        envq.Envelope(invoke=ws.quick, id="later", delay=600, payload={"to": "<b>x</b>"}),
    )

    async def settled() -> bool:
        c = await main.counts()
        return (c.get("succeeded"), c.get("failed"), c.get("stopped"), c.get("delayed")) == (
            3,
            2,
            1,
            2,
        )

    await ws.wait_async("the first envelopes to end", settled)
    await main.send(*(envq.Envelope(invoke=ws.gated, id=f"g{i}", type="mail") for i in range(4)))

    async def busy() -> bool:
        return (await main.counts()).get("running") == 2

    await ws.wait_async("two gated attempts", busy)
    return main


@pytest.fixture
def gate() -> Iterator[None]:
    with ws.gate_closed():
        yield


@asynccontextmanager
async def _nothing() -> AsyncIterator[None]:
    yield


def test_postgres_pages_show_the_counts_and_follow_the_ends(
    browser: Any, web_db: Callable[[], str], gate: None
) -> None:
    dsn = web_db()
    held: dict[str, Any] = {}

    async def setup() -> Any:
        held["main"] = await every_state(dsn)
        return envq.web.app(dsn=dsn, token=TOKEN, poll=0.5)

    with ws.Served(setup) as served:
        try:
            want = ws.run_aside(db_counts(dsn))
            nonzero = {state for states in want.values() for state, n in states.items() if n}
            assert nonzero == {s.name for s in STORED}, want  # every state is there
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(served.url + "/")
            for queue in ("waiting", "paused", "main"):
                for state in STORED:
                    assert shown(page, queue, state.name) == str(want[queue].get(state.name, 0)), (
                        queue,
                        state,
                    )
            shoot(page, "overview")
            page.evaluate("window.envqMark = 1")  # gone if the page reloads
            ws.GATE.set()
            ends = want["main"]["SUCCEEDED"] + 4
            wait_shown(page, "main", "SUCCEEDED", ends)
            wait_shown(page, "main", "RUNNING", 0)
            assert page.evaluate("window.envqMark") == 1
            page.goto(served.url + "/queue?q=main")
            wait_shown(page, "main", "SUCCEEDED", ends)
            assert page.locator('[data-life="RUNNING"].current').count() == 1
            shoot(page, "machines")
            page.goto(served.url + "/envelopes?q=main")
            assert page.locator("table.envelopes tbody tr").count() == sum(want["main"].values())
            shoot(page, "envelopes")
            page.goto(served.url + "/envelopes?q=main&state=failed")
            page.locator("table.envelopes tbody a").first.click()
            page.wait_for_url(re.compile(r"envelope\?q=main&key=\d+"))
            assert page.locator("h1 .state").inner_text() == "FAILED"
            shoot(page, "envelope")
            page.goto(served.url + "/schedules?q=main")
            assert "hourly" in page.locator("table.envelopes").inner_text()
            shoot(page, "schedules")
            context.close()
        finally:
            ws.GATE.set()
            served.call(held["main"].close)


def test_postgres_actions_need_the_token(browser: Any, web_db: Callable[[], str]) -> None:
    dsn = web_db()

    async def setup() -> Any:
        async with PgQueue(dsn, "ops", workers=0) as ops:
            await ops.install()
            await ops.start()
        return envq.web.app(dsn=dsn, token=TOKEN, poll=0.5)

    with ws.Served(setup) as served:
        context = browser.new_context()
        page = context.new_page()
        page.goto(served.url + "/queue?q=ops")
        assert page.locator('button[value="stop"]').count() == 0  # locked: no buttons
        forged = page.evaluate(
            """async () => {
                const r = await fetch("action", {method: "POST",
                    headers: {"content-type": "application/x-www-form-urlencoded"},
                    body: "q=ops&action=stop&csrf=forged"});
                return [r.status, await r.text()];
            }"""
        )
        assert forged[0] == 403
        assert "CSRF" in forged[1]
        page.fill('input[name="token"]', "not-the-token-at-all")
        with page.expect_navigation():
            page.click("text=Unlock actions")
        assert page.locator("h1").inner_text() == "Forbidden"
        page.goto(served.url + "/queue?q=ops")
        page.fill('input[name="token"]', TOKEN)
        with page.expect_navigation():
            page.click("text=Unlock actions")
        page.wait_for_url(re.compile(r"/queue\?q=ops$"))
        page.on("dialog", lambda dialog: dialog.accept())
        page.click('button[value="stop"]')
        page.wait_for_url(re.compile(r"done=stop"))
        page.wait_for_function(
            "() => document.querySelector('[data-qstate]').textContent === 'STOPPED'",
            timeout=LIMIT,
        )
        page.click('button[value="start"]')
        page.wait_for_url(re.compile(r"done=start"))
        assert page.locator("[data-qstate]").first.inner_text() == "RUNNING"
        with page.expect_navigation():
            page.click("text=Lock actions")
        assert page.locator('button[value="stop"]').count() == 0
        context.close()


def test_postgres_going_away_shows_a_banner_until_it_is_back(
    browser: Any, web_pg: Any, web_db: Callable[[], str]
) -> None:
    dsn = web_db()

    async def setup() -> Any:
        async with PgQueue(dsn, "mail", workers=0) as q:
            await q.install()
            await q.send(envq.Envelope(invoke=ws.quick, id=1))
        return envq.web.app(dsn=dsn, poll=0.5)

    with ws.Served(setup) as served:
        context = browser.new_context()
        page = context.new_page()
        page.goto(served.url + "/queue?q=mail")
        banner = page.locator("#banner")
        assert banner.is_hidden()
        ws.stop_server(web_pg)
        try:
            banner.wait_for(state="visible", timeout=LIMIT)
            assert "cannot be reached" in banner.inner_text()
            assert ws.PASSWORD not in page.content()
        finally:
            ws.start_server(web_pg)
        banner.wait_for(state="hidden", timeout=LIMIT)
        assert shown(page, "mail", "BUFFERED") == "1"
        context.close()


def test_in_process_queue_mounted_in_a_starlette_app(browser: Any, gate: None) -> None:
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.responses import PlainTextResponse  # noqa: PLC0415
    from starlette.routing import Mount, Route  # noqa: PLC0415

    held: dict[str, Any] = {}

    async def setup() -> Any:
        queue = envq.Queue("inproc", workers=2, dead_letter=lambda env, error: None)
        held["queue"] = queue
        dashboard = envq.web.app(queue, token=TOKEN, poll=0.5)

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with queue:
                queue.send(*(envq.Envelope(invoke=ws.quick, id=i) for i in range(3)))
                queue.send(envq.Envelope(invoke=ws.broken, id="bad"))
                queue.send(envq.Envelope(invoke=ws.stopping, id="stop"))
                await asyncio.sleep(0.2)
                queue.send(*(envq.Envelope(invoke=ws.gated, id=f"g{i}") for i in range(3)))
                queue.send(envq.Envelope(invoke=ws.quick, id="later", delay=600))
                yield
                ws.GATE.set()
            await envq.web.aclose(dashboard)

        async def home(request: Any) -> PlainTextResponse:
            return PlainTextResponse("the host application")

        return Starlette(
            routes=[Route("/", home), Mount("/ops/queue", app=dashboard)], lifespan=lifespan
        )

    with ws.Served(setup) as served:

        async def stats() -> dict[str, int]:
            return {s.name: n for s, n in held["queue"].statistics().by_state.items()}

        want = served.call(stats)
        assert (want["RUNNING"], want["READY"], want["DELAYED"]) == (2, 1, 1)
        assert (want["SUCCEEDED"], want["FAILED"], want["STOPPED"]) == (3, 1, 1)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.goto(served.url + "/ops/queue/queue")
        for state in STORED:
            assert shown(page, "inproc", state.name) == str(want[state.name]), state
        page.evaluate("window.envqMark = 1")
        ws.GATE.set()
        wait_shown(page, "inproc", "SUCCEEDED", 6)
        wait_shown(page, "inproc", "RUNNING", 0)
        assert page.evaluate("window.envqMark") == 1
        page.goto(served.url + "/ops/queue/envelopes?state=succeeded")
        assert page.locator("table.envelopes tbody tr").count() == 6
        page.goto(served.url + "/ops/queue/queue")
        forged = page.evaluate(
            """async () => (await fetch("action", {method: "POST",
                headers: {"content-type": "application/x-www-form-urlencoded"},
                body: "action=stop"})).status"""
        )
        assert forged == 403
        page.fill('input[name="token"]', TOKEN)
        with page.expect_navigation():
            page.click("text=Unlock actions")
        page.wait_for_url(re.compile(r"/ops/queue/queue$"))
        page.on("dialog", lambda dialog: dialog.accept())
        page.click('button[value="stop"]')
        page.wait_for_url(re.compile(r"/ops/queue/queue\?q=inproc&done=stop"))
        page.wait_for_function(
            "() => document.querySelector('[data-qstate]').textContent === 'STOPPED'",
            timeout=LIMIT,
        )
        assert served.call(stats)["PARKED"] == 1  # the delayed one
        page.click('button[value="start"]')
        page.wait_for_url(re.compile(r"done=start"))
        assert page.locator("[data-qstate]").first.inner_text() == "RUNNING"
        page.goto(served.url + "/")
        assert page.locator("body").inner_text() == "the host application"
        context.close()
