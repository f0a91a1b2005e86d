"""The dashboard's actions and its guard rails, through HTTP: security headers on
every answer, POST-only actions refused without the action token, without the CSRF
token or from another site, and performed through the queue's own calls with them;
the app mounted under a path in a host application; the host application's own
authentication deciding instead of a token (``authorize``)."""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

import envq
import envq.web
from envq import QueueState

pytest.importorskip("starlette")

from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from envq.web._app import CSRF_COOKIE, DONE, UNLOCK_COOKIE
from envq.web._source import ACTIONS, ENVELOPE_ACTIONS

TOKEN = "a-long-action-token-0123456789"


@asynccontextmanager
async def client(
    queue: envq.Queue, token: str | None = TOKEN, prefix: str = ""
) -> AsyncIterator[httpx.AsyncClient]:
    web = envq.web.app(queue, token=token)
    app = web
    if prefix:

        async def home(request: object) -> PlainTextResponse:
            return PlainTextResponse("host")

        app = Starlette(routes=[Route("/", home), Mount(prefix, app=web)])
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            yield c
    finally:
        await envq.web.aclose(web)


async def csrf_of(c: httpx.AsyncClient, path: str = "/queue") -> str:
    page = await c.get(path)
    found = re.search(r'name="csrf" value="([^"]+)"', page.text)
    cookie = c.cookies.get(CSRF_COOKIE)
    assert cookie is not None
    if found is not None:  # a page with a form carries the cookie's value in it
        assert cookie == found[1]
    return cookie


async def unlock(c: httpx.AsyncClient, prefix: str = "") -> None:
    csrf = await csrf_of(c, f"{prefix}/queue")
    done = await c.post(f"{prefix}/unlock", data={"csrf": csrf, "token": TOKEN, "back": "queue"})
    assert done.status_code == 303
    assert done.headers["location"] == "queue"


async def test_every_answer_carries_the_security_headers(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]
    async with client(q) as c:
        for path in ("/", "/queue", "/envelopes", "/envelope?key=7", "/api/counts"):
            answer = await c.get(path)
            csp = answer.headers["content-security-policy"]
            assert "script-src 'self'" in csp
            assert "frame-ancestors 'none'" in csp
            assert "unsafe-inline" not in csp
            assert answer.headers["x-frame-options"] == "DENY"
            assert answer.headers["x-content-type-options"] == "nosniff"
            assert answer.headers["cache-control"] == "no-store"
        for asset in ("/static/envq.css", "/static/envq.js"):
            answer = await c.get(asset)
            assert answer.status_code == 200
            assert "content-security-policy" in answer.headers
        page = (await c.get("/queue")).text
        assert "<script>" not in page
        assert " style=" not in page
        assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing from the network


async def test_without_a_token_the_page_is_read_only(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]
    async with client(q, token=None) as c:
        page = (await c.get("/queue")).text
        assert "read-only" in page
        assert 'value="stop"' not in page
        csrf = await csrf_of(c)
        for path, data in (
            ("/unlock", {"csrf": csrf, "token": TOKEN}),
            ("/action", {"csrf": csrf, "q": "jobs", "action": "start"}),
        ):
            answer = await c.post(path, data=data)
            assert answer.status_code == 403
            assert "no action token" in html.unescape(answer.text)
            assert answer.headers["cache-control"] == "no-store"
    assert q.state is QueueState.INIT


async def test_forged_or_locked_actions_are_refused(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]
    async with client(q) as c:
        csrf = await csrf_of(c)
        start = {"csrf": csrf, "q": "jobs", "action": "start"}
        locked = await c.post("/action", data=start)
        assert locked.status_code == 403
        assert "locked" in locked.text
        wrong = await c.post("/unlock", data={"csrf": csrf, "token": TOKEN + "x"})
        assert wrong.status_code == 403
        assert "not the action token" in wrong.text
        assert UNLOCK_COOKIE not in c.cookies
        no_csrf = await c.post("/unlock", data={"token": TOKEN})
        assert no_csrf.status_code == 403
        assert "CSRF" in no_csrf.text
        bad_csrf = await c.post("/unlock", data={"csrf": "x" * 43, "token": TOKEN})
        assert bad_csrf.status_code == 403
        elsewhere = await c.post(
            "/unlock",
            data={"csrf": csrf, "token": TOKEN},
            headers={"origin": "http://evil.example"},
        )
        assert elsewhere.status_code == 403
        assert "another site" in elsewhere.text
        cross = await c.post(
            "/unlock", data={"csrf": csrf, "token": TOKEN}, headers={"sec-fetch-site": "cross-site"}
        )
        assert cross.status_code == 403
        assert (await c.get("/action")).status_code == 405
        await unlock(c)
        assert TOKEN not in c.cookies.get(UNLOCK_COOKIE, "")
        # Unlocked, but the form lacks the CSRF token: still refused.
        assert (await c.post("/action", data={"q": "jobs", "action": "start"})).status_code == 403
        bad = await c.post("/action", data={**start, "action": "explode"})
        assert bad.status_code == 400
        assert "'action'" in html.unescape(bad.text)
        other = await c.post("/action", data={**start, "q": "other"})
        assert other.status_code == 404
        big = await c.post("/action", data={**start, "pad": "x" * 5000})
        assert big.status_code == 400
        assert "larger than" in big.text
    assert q.state is QueueState.INIT


async def test_stop_and_start_go_through_the_queue(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]
    async with client(q) as c:
        await unlock(c)
        csrf = c.cookies[CSRF_COOKIE]
        # Offered where LIFECYCLE moves the queue: INIT starts, it does not stop.
        assert shown_calls((await c.get("/queue")).text) == {"start"}
        started = await c.post("/action", data={"csrf": csrf, "q": "jobs", "action": "start"})
        assert started.status_code == 303
        assert started.headers["location"] == "queue?q=jobs&done=start"
        assert started.headers["cache-control"] == "no-store"
        assert q.state is QueueState.RUNNING
        assert shown_calls((await c.get("/queue")).text) == {"stop"}
        stopped = await c.post("/action", data={"csrf": csrf, "q": "jobs", "action": "stop"})
        assert stopped.status_code == 303
        await asyncio.sleep(0)
        assert q.state is QueueState.STOPPED
        page = (await c.get("/queue?done=stop")).text
        assert "stop requested." in page
        assert 'data-qstate="1">STOPPED<' in page
        assert shown_calls(page) == {"start"}
        # The script shows the buttons of the state it polls: each names its states.
        assert 'value="start" data-q="jobs" data-when="INIT STOPPED"' in page
        assert 'value="stop" data-q="jobs" data-when="RUNNING"' in page
        await q.terminate()
        refused = await c.post("/action", data={"csrf": csrf, "q": "jobs", "action": "start"})
        assert refused.status_code == 409
        assert "TERMINATED" in refused.text
        locked = await c.post("/lock", data={"csrf": csrf})
        assert locked.status_code == 303
        assert UNLOCK_COOKIE not in c.cookies


def shown_calls(page: str) -> set[str]:
    """The queue's action buttons a page shows (not ``hidden``)."""
    buttons = re.findall(r'<button type="submit" name="action" value="(\w+)"([^>]*)>', page)
    return {value for value, rest in buttons if " hidden" not in rest}


def test_every_action_has_its_notice() -> None:
    assert set(DONE) == set(ACTIONS) | set(ENVELOPE_ACTIONS)


async def test_mounted_under_a_path_the_links_resolve(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]
    async with client(q, prefix="/ops/dash") as c:
        bare = await c.get("/ops/dash")
        assert bare.status_code == 307
        assert bare.headers["location"].endswith("/ops/dash/")
        page = await c.get("/ops/dash/")
        assert page.status_code == 200
        links = set(re.findall(r'(?:href|src|action)="([^"#]+)"', page.text))
        assert links
        assert all(not link.startswith("/") for link in links), links
        for link in links - {"data:,", "./"}:
            if "unlock" in link:
                continue
            got = await c.get("/ops/dash/" + html.unescape(link))
            assert got.status_code == 200, link
        await unlock(c, "/ops/dash")
        csrf = c.cookies[CSRF_COOKIE]
        started = await c.post("/ops/dash/action", data={"csrf": csrf, "action": "start"})
        assert started.status_code == 303
        assert q.state is QueueState.RUNNING
        assert (await c.get("/")).text == "host"


def test_app_refuses_bad_arguments() -> None:
    q = envq.Queue("jobs")
    with pytest.raises(ValueError, match="exactly one"):
        envq.web.app()
    with pytest.raises(ValueError, match="exactly one"):
        envq.web.app(q, dsn="postgresql://x@/y")
    with pytest.raises(ValueError, match="16 characters"):
        envq.web.app(q, token="short")
    with pytest.raises(TypeError, match="token"):
        envq.web.app(q, token=1234567890123456789)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="PgQueue"):
        envq.web.app(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="authorize must be callable"):
        envq.web.app(q, authorize="admins")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        envq.web.app(q, token=TOKEN, authorize=lambda request: True)


class _HeaderAuth(AuthenticationBackend):
    """The host application's authentication: a user named by a header (a stand-in for
    its session cookie or bearer token), with the scope ``ops`` when the header says so."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        name = conn.headers.get("x-user")
        if not name:
            return None
        scopes = ["ops"] if conn.headers.get("x-ops") == "yes" else []
        return AuthCredentials(scopes), SimpleUser(name)


async def test_the_host_application_s_auth_decides_who_acts(make_queue: object) -> None:
    """``authorize``: the host's authentication, not a token, decides; only the requests
    it approves act (still with the CSRF token); the others see a read-only page."""
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]
    asked: list[str] = []

    def ops_only(request: Request) -> bool:
        asked.append(request.user.display_name if request.user.is_authenticated else "-")
        return "ops" in request.auth.scopes

    web = envq.web.app(q, authorize=ops_only)
    host = Starlette(
        routes=[Mount("/dash", app=web)],
        middleware=[Middleware(AuthenticationMiddleware, backend=_HeaderAuth())],
    )
    transport = httpx.ASGITransport(app=host)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            viewer = {"x-user": "val"}
            page = (await c.get("/dash/queue", headers=viewer)).text
            assert "read-only for you" in page
            assert 'name="token"' not in page  # nothing to unlock
            assert shown_calls(page) == set()
            csrf = c.cookies[CSRF_COOKIE]
            start = {"csrf": csrf, "q": "jobs", "action": "start"}
            refused = await c.post("/dash/action", data=start, headers=viewer)
            assert refused.status_code == 403
            assert "does not allow this request" in html.unescape(refused.text)
            anonymous = await c.post("/dash/action", data=start)
            assert anonymous.status_code == 403
            assert q.state is QueueState.INIT
            ops = {"x-user": "olga", "x-ops": "yes"}
            page = (await c.get("/dash/queue", headers=ops)).text
            assert "actions allowed" in page
            assert shown_calls(page) == {"start"}
            forged = await c.post("/dash/action", data={**start, "csrf": "x" * 43}, headers=ops)
            assert forged.status_code == 403
            assert q.state is QueueState.INIT
            started = await c.post("/dash/action", data=start, headers=ops)
            assert started.status_code == 303
            assert q.state is QueueState.RUNNING
            no_token = await c.post(
                "/dash/unlock", data={"csrf": csrf, "token": TOKEN}, headers=ops
            )
            assert no_token.status_code == 403
            assert "host application" in html.unescape(no_token.text)
    finally:
        await envq.web.aclose(web)
    assert {"val", "-", "olga"} <= set(asked)


async def test_an_authorize_that_raises_leaves_the_request_read_only(
    make_queue: object, caplog: pytest.LogCaptureFixture
) -> None:
    q: envq.Queue = make_queue(name="jobs")  # type: ignore[operator]

    def broken(request: Request) -> bool:
        raise RuntimeError("the session store is down")

    web = envq.web.app(q, authorize=broken)
    transport = httpx.ASGITransport(app=web)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            csrf = await csrf_of(c)
            answer = await c.post("/action", data={"csrf": csrf, "q": "jobs", "action": "start"})
            assert answer.status_code == 403
    finally:
        await envq.web.aclose(web)
    assert q.state is QueueState.INIT
    assert "authorize() failed" in caplog.text
