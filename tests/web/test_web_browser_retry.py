"""An envelope's story and its retry in a real browser (headless Chromium, Playwright).

On PostgreSQL, with a node of the test's own that runs the queue: a failed envelope's
page shows its traceback (escaped: the markup in the message is text); without the
token no action is offered and a forged one is refused; unlocked, clicking retry sends
it back through ``PgQueue.retry``, the node runs it again, and the open page shows it
SUCCEEDED (it reloads when its envelope moves). The same for an in-process queue
mounted in a small Starlette app (``Queue.retry``: a new stay, a new key). With
``ENVQ_WEB_SCREENSHOTS=1`` the page of the failed envelope goes into ``docs/assets/``.

They skip when Chromium or Playwright is missing, unless ``ENVQ_REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import web_support as ws

import envq
import envq.web
from envq.postgres import PgQueue

asyncpg = pytest.importorskip("asyncpg")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
playwright = pytest.importorskip("playwright.sync_api")

LIMIT = ws.LIMIT

TOKEN = "browser-retry-token-0123456789"
FORGE = """async ([q, key]) => {
    const r = await fetch("action", {method: "POST",
        headers: {"content-type": "application/x-www-form-urlencoded"},
        body: "q=" + q + "&key=" + key + "&action=retry"});
    return r.status;
}"""


def check_the_failed_page(page: Any, queue: str, key: str) -> None:
    """The page of the failed envelope: its traceback, escaped; locked, no action is
    offered and a forged one is refused; unlocked, retry and discard are."""
    expect = playwright.expect
    expect(page.locator("h1 .state")).to_have_text("FAILED")
    traceback = page.locator("pre.traceback")
    expect(traceback).to_contain_text("ValueError: <i>flaky</i> is not ready yet")
    expect(traceback).to_contain_text("in flaky")
    assert traceback.locator("i").count() == 0  # the markup is text
    expect(page.locator("table.history tbody tr")).to_have_count(1)
    expect(page.locator("table.history tbody td").nth(1)).to_have_text("ERROR")
    assert page.locator("button[name=action]").count() == 0
    assert page.evaluate(FORGE, [queue, key]) == 403
    page.fill('input[name="token"]', TOKEN)
    with page.expect_navigation():
        page.click("text=Unlock actions")
    expect(page.locator("h1 .state")).to_have_text("FAILED")
    buttons = page.locator("button[name=action]")
    assert sorted(buttons.evaluate_all("bs => bs.map(b => b.value)")) == ["discard", "retry"]


def test_postgres_failed_envelope_retried_from_its_page(
    browser: Any, web_db: Callable[[], str]
) -> None:
    dsn = web_db()
    held: dict[str, Any] = {}
    ws.FAILING.add("flaky")

    async def setup() -> Any:
        node = held["node"] = PgQueue(dsn, "jobs", workers=1, poll=0.1, node="browser-node")
        await node.install()
        await node.connect()
        await node.start()
        await node.send(
            envq.Envelope(invoke=ws.flaky, id="flaky", type="mail", payload={"to": "a@x"})
        )

        async def failed() -> bool:
            return (await node.counts()).get("failed") == 1

        await ws.wait_async("the failure", failed)
        return envq.web.app(dsn=dsn, token=TOKEN, poll=0.5)

    with ws.Served(setup) as served:
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.goto(served.url + "/envelopes?q=jobs&state=failed")
            page.locator("table.envelopes tbody a").first.click()
            page.wait_for_url(re.compile(r"envelope\?q=jobs&key=\d+$"))
            key = page.url.rsplit("=", 1)[1]
            check_the_failed_page(page, "jobs", key)
            ws.shoot(page, "envelope-error")
            ws.FAILING.discard("flaky")
            page.click('button[value="retry"]')
            page.wait_for_url(re.compile(rf"envelope\?q=jobs&done=retry&key={key}$"))
            # The node runs it again; the open page reloads once its envelope moved.
            playwright.expect(page.locator("h1 .state")).to_have_text("SUCCEEDED", timeout=LIMIT)
            playwright.expect(page.locator("table.history tbody tr")).to_have_count(1)
            buttons = page.locator("button[name=action]")
            assert buttons.evaluate_all("bs => bs.map(b => b.value)") == ["discard"]
            assert ws.PASSWORD not in page.content()
            context.close()
        finally:
            served.call(held["node"].close)


def test_in_process_failed_envelope_retried_in_a_starlette_app(browser: Any) -> None:
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.routing import Mount  # noqa: PLC0415

    ws.FAILING.add("flaky")

    async def setup() -> Any:
        queue = envq.Queue("inproc", workers=1, dead_letter=lambda env, error: None)
        dashboard = envq.web.app(queue, token=TOKEN, poll=0.5)

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with queue:
                queue.send(envq.Envelope(invoke=ws.flaky, id="flaky"))
                yield
            await envq.web.aclose(dashboard)

        return Starlette(routes=[Mount("/ops/queue", app=dashboard)], lifespan=lifespan)

    with ws.Served(setup) as served:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.goto(served.url + "/ops/queue/envelopes?state=failed")
        page.locator("table.envelopes tbody a").first.click()
        page.wait_for_url(re.compile(r"/ops/queue/envelope\?q=inproc&key=\d+$"))
        old = page.url.rsplit("=", 1)[1]
        check_the_failed_page(page, "inproc", old)
        ws.FAILING.discard("flaky")
        page.click('button[value="retry"]')
        # A retry is a new stay in the queue: its page has a new key.
        page.wait_for_url(re.compile(r"/ops/queue/envelope\?q=inproc&done=retry&key=\d+$"))
        new = page.url.rsplit("=", 1)[1]
        assert int(new) > int(old)
        playwright.expect(page.locator("h1 .state")).to_have_text("SUCCEEDED", timeout=LIMIT)
        playwright.expect(page.locator("table.history tbody tr")).to_have_count(1)
        moves = page.locator("table.moves").inner_text()
        assert "QUEUE_MOVES[(FAILED, RETRY)]" in moves
        assert "OUTCOMES[(ONE_OFF, OK)]" in moves
        page.goto(served.url + f"/ops/queue/envelope?key={old}")
        assert f"sent it back as envelope {new}" in page.locator("main").inner_text()
        context.close()
