"""The ASGI app: routes, parameters, templates, security headers, actions.

Every URL the pages write is relative (``queue?q=mail``, ``static/envq.css``) and
every route sits at the app's root, so the app works mounted under any path (and
behind a proxy that strips one). A page is rendered from a :class:`Source`; what goes
wrong becomes a clear answer: an unknown queue or envelope 404, a malformed parameter
400 naming it, a forged or unauthenticated action 403, a store that cannot be read
503 with a banner (the page's script polls and reloads it once the store is back).

Actions (a queue's stop and start; an envelope's retry, cancel and discard) are POSTs
with a CSRF token (a random cookie and the same value in the form: a page of another
site cannot read the cookie to copy it; the cookie is ``SameSite=Strict`` too, and an
``Origin`` of another host is refused), and they are refused unless the app was given
an action token and this browser unlocked them with it (a cookie holding an HMAC of
the token, never the token), or was given ``authorize`` and it approves the request
(the host application's own authentication decides; no token, no unlocking). A page
offers only the actions the tables allow in the state it shows
(:func:`envq.web._rows.operator_events`, :func:`~envq.web._rows.queue_calls`); the
queue's own call decides.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import hmac
import logging
import math
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, Final

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envq import __version__
from envq._machine import TERMINAL_STATES, EnvState, QueueCall, QueueState
from envq.web._diagram import envelope_diagram, lifecycle_diagram
from envq.web._rows import queue_calls, states_allowing
from envq.web._source import (
    ACTIONS,
    ENVELOPE_ACTIONS,
    STORED,
    BadParameter,
    Bucket,
    EnvelopeQuery,
    NotFound,
    QueueSummary,
    Refused,
    Source,
    SourceUnavailable,
)

__all__ = ["CSRF_COOKIE", "UNLOCK_COOKIE", "build"]

HERE: Final = Path(__file__).resolve().parent
CSRF_COOKIE: Final = "envq_csrf"
UNLOCK_COOKIE: Final = "envq_unlock"
#: The most bytes of a form, and characters of a text parameter.
MAX_FORM: Final = 4096
MAX_TEXT: Final = 200
MAX_KEY: Final = 2**63 - 1

#: Every response: no script, style or image from elsewhere, no inline script, no
#: framing, no referrer to another site; pages and answers are not cached.
SECURITY_HEADERS: Final[Mapping[str, str]] = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}


class _Headers:
    """Adds :data:`SECURITY_HEADERS` to every response, and ``no-store`` to all but
    the static files; answers a request for the mount point itself (no slash) with a
    redirect to it with one, so that the pages' relative links resolve."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        root = scope.get("root_path", "")
        path: str = scope["path"]
        inner = path[len(root) :] if path.startswith(root) else path
        if inner == "":
            query = scope.get("query_string", b"").decode("latin-1")
            target = urllib.parse.quote(root + "/") + (f"?{query}" if query else "")
            await RedirectResponse(target, status_code=307)(scope, receive, send)
            return
        static = inner.startswith("/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])]
                have = {k.lower() for k, _ in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.encode() not in have:
                        headers.append((name.encode(), value.encode()))
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def _when(epoch: float | None, now: float | None = None) -> str:
    if epoch is None or not math.isfinite(epoch):
        return ""
    now = time.time() if now is None else now
    stamp = dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    delta = epoch - now
    if abs(delta) < 1:
        rel = "now"
    elif delta > 0:
        rel = f"in {_span(delta)}"
    else:
        rel = f"{_span(-delta)} ago"
    return f"{stamp} ({rel})"


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _chart(series: list[Bucket]) -> dict[str, Any]:
    """The bars of the ends' chart: succeeded below, failed stacked on top."""
    width, height, gap = 600.0, 80.0, 1.0
    peak = max((b.succeeded + b.failed for b in series), default=0)
    step = width / max(len(series), 1)
    bars = []
    for i, b in enumerate(series):
        ok = height * b.succeeded / peak if peak else 0.0
        bad = height * b.failed / peak if peak else 0.0
        bars.append(
            {
                "x": round(i * step, 1),
                "w": round(step - gap, 1),
                "ok_y": round(height - ok, 1),
                "ok_h": round(ok, 1),
                "bad_y": round(height - ok - bad, 1),
                "bad_h": round(bad, 1),
                "title": f"{_when(b.start)}: {b.succeeded} succeeded, {b.failed} failed",
            }
        )
    return {
        "width": width,
        "height": height,
        "bars": bars,
        "peak": peak,
        "succeeded": sum(b.succeeded for b in series),
        "failed": sum(b.failed for b in series),
        "minutes": round(len(series) * step and (series[-1].start - series[0].start + 10) / 60)
        if series
        else 0,
    }


def _text(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    if len(value) > MAX_TEXT:
        raise BadParameter(f"parameter {name!r}: at most {MAX_TEXT} characters")
    if any(ord(c) < 32 for c in value):
        raise BadParameter(f"parameter {name!r}: control characters are not allowed")
    return value


def _shown(value: str) -> str:
    return repr(value[:40] + ("…" if len(value) > 40 else ""))


def _int(request: Request, name: str, low: int, high: int) -> int | None:
    value = request.query_params.get(name)
    if value is None or value == "":
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 19:
        raise BadParameter(f"parameter {name!r}: {_shown(value)} is not a whole number")
    number = int(value)
    if not low <= number <= high:
        raise BadParameter(f"parameter {name!r}: must be from {low} to {high}, not {number}")
    return number


def _state(request: Request) -> EnvState | None:
    value = _text(request, "state")
    if value is None:
        return None
    for state in STORED:
        if state.name == value.upper():
            return state
    names = ", ".join(s.name for s in STORED)
    raise BadParameter(f"parameter 'state': {_shown(value)} is not an envelope state ({names})")


log = logging.getLogger("envq.web")

#: ``authorize``: given a request, whether it may act (the host application's auth).
Authorize = Callable[[Request], bool]


def _unlock_value(token: str) -> str:
    return hmac.new(token.encode(), b"envq.web unlock", hashlib.sha256).hexdigest()


class _Web:
    """The routes, over one source."""

    def __init__(
        self,
        source: Source,
        *,
        token: str | None,
        poll: float,
        single: str | None,
        authorize: Authorize | None = None,
    ):
        self.source = source
        self.token = token
        self.authorize = authorize
        #: "token", "host" (``authorize``) or None (read-only).
        self.guard = "host" if authorize is not None else ("token" if token else None)
        self.poll = poll
        self.single = single
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["when"] = _when
        self.env.filters["q"] = lambda value: urllib.parse.quote(str(value), safe="")

    # -- rendering ----------------------------------------------------------------------

    def _csrf(self, request: Request) -> tuple[str, bool]:
        have = request.cookies.get(CSRF_COOKIE, "")
        if len(have) == 43 and have.replace("-", "").replace("_", "").isalnum():
            return have, False
        return secrets.token_urlsafe(32), True

    def unlocked(self, request: Request) -> bool:
        """Whether this request may act: ``authorize`` approves it, or its browser
        unlocked the actions with the app's token."""
        if self.authorize is not None:
            try:
                approved = self.authorize(request)
            except Exception:
                log.exception("envq.web: authorize() failed: the request may not act")
                return False
            return approved is True
        if self.token is None:
            return False
        return hmac.compare_digest(
            request.cookies.get(UNLOCK_COOKIE, ""), _unlock_value(self.token)
        )

    def page(
        self,
        request: Request,
        template: str,
        status: int = 200,
        *,
        queue: str | None = None,
        **context: Any,
    ) -> HTMLResponse:
        csrf, fresh = self._csrf(request)
        body = self.env.get_template(template).render(
            csrf=csrf,
            kind=self.source.kind,
            version=__version__,
            poll_ms=int(self.poll * 1000),
            actions_on=self.guard is not None,
            guard=self.guard,
            unlocked=self.unlocked(request),
            queue_name=queue,
            single=self.single,
            back=_here(request),
            error=context.pop("error", None),
            down=context.pop("down", None),
            notice=context.pop("notice", None),
            **context,
        )
        response = HTMLResponse(body, status_code=status)
        if fresh:
            response.set_cookie(
                CSRF_COOKIE,
                csrf,
                httponly=True,
                samesite="strict",
                path=request.scope.get("root_path", "") + "/",
            )
        return response

    def problem(self, request: Request, error: Exception, queue: str | None = None) -> Response:
        if isinstance(error, NotFound):
            status = 404
        elif isinstance(error, BadParameter):
            status = 400
        elif isinstance(error, Refused):
            status = 409
        else:
            status = 503
        if request.url.path.startswith(request.scope.get("root_path", "") + "/api/"):
            return JSONResponse({"error": str(error)}, status_code=status)
        return self.page(
            request,
            "problem.html",
            status,
            queue=queue,
            title={404: "Not found", 400: "Bad request", 409: "Refused"}.get(
                status, "Store unavailable"
            ),
            error=str(error),
            down=str(error) if status == 503 else None,
        )

    def name(self, request: Request) -> str:
        name = _text(request, "q")
        if name is None:
            if self.single is not None:
                return self.single
            raise BadParameter("parameter 'q' is required: the name of a queue")
        return name

    async def guarded(
        self, request: Request, render: Callable[[], Awaitable[Response]], queue: str | None = None
    ) -> Response:
        try:
            return await render()
        except (NotFound, BadParameter, SourceUnavailable, Refused) as error:
            return self.problem(request, error, queue)

    # -- pages --------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        async def render() -> Response:
            queues = await self.source.queues()
            nodes = None
            if hasattr(self.source, "nodes"):
                nodes = await self.source.nodes()
            return self.page(
                request,
                "overview.html",
                queues=queues,
                charts={q.name: _chart(list(q.series)) for q in queues},
                states=STORED,
                nodes=nodes,
                notice=_notice(request),
            )

        return await self.guarded(request, render)

    async def queue(self, request: Request) -> Response:
        async def render() -> Response:
            name = self.name(request)
            summary = await self.source.queue(name)
            return self.page(
                request,
                "queue.html",
                queue=name,
                q=summary,
                chart=_chart(list(summary.series)),
                life=lifecycle_diagram(),
                machine=envelope_diagram(),
                counts={s.name: n for s, n in summary.counts.items()},
                terminal={s.name for s in TERMINAL_STATES},
                notice=_notice(request),
                calls=[c.value for c in queue_calls(summary.state)],
                when=_when_offered(),
            )

        return await self.guarded(request, render)

    async def envelopes(self, request: Request, *, scheduled: bool = False) -> Response:
        async def render() -> Response:
            name = self.name(request)
            before = _int(request, "before", 1, MAX_KEY)
            after = _int(request, "after", 0, MAX_KEY)
            if before is not None and after is not None:
                raise BadParameter("parameters 'before' and 'after': give one of them, not both")
            limit = _int(request, "limit", 1, 500)
            query = EnvelopeQuery(
                state=None if scheduled else _state(request),
                type=_text(request, "type"),
                id=_text(request, "id"),
                before=before,
                after=after,
                limit=50 if limit is None else limit,
                scheduled=scheduled,
            )
            summary = await self.source.queue(name)
            found = await self.source.envelopes(name, query)
            return self.page(
                request,
                "schedules.html" if scheduled else "envelopes.html",
                queue=name,
                q=summary,
                query=query,
                found=found,
                states=STORED,
                link=lambda **changes: _link(request, changes),
                notice=_notice(request),
            )

        return await self.guarded(request, render)

    async def schedules(self, request: Request) -> Response:
        return await self.envelopes(request, scheduled=True)

    async def envelope(self, request: Request) -> Response:
        async def render() -> Response:
            name = self.name(request)
            key = _int(request, "key", 1, MAX_KEY)
            if key is None:
                raise BadParameter("parameter 'key' is required: an envelope's seq")
            detail = await self.source.envelope(name, key)
            return self.page(
                request,
                "envelope.html",
                queue=name,
                e=detail,
                notice=_notice(request),
                watch=key,
            )

        return await self.guarded(request, render)

    async def envelope_state(self, request: Request) -> Response:
        """``{"state": NAME}`` of one envelope now (its page reloads when it moved)."""

        async def render() -> Response:
            name = self.name(request)
            key = _int(request, "key", 1, MAX_KEY)
            if key is None:
                raise BadParameter("parameter 'key' is required: an envelope's seq")
            state = await self.source.state_of(name, key)
            return JSONResponse({"state": state.name})

        return await self.guarded(request, render)

    async def counts(self, request: Request) -> Response:
        async def render() -> Response:
            name = _text(request, "q")
            if name is not None:
                queues: list[QueueSummary] = [await self.source.queue(name)]
            else:
                queues = await self.source.queues()
            return JSONResponse(
                {
                    "queues": {
                        q.name: {
                            "state": q.state.name,
                            "counts": {s.name: n for s, n in q.counts.items()},
                        }
                        for q in queues
                    }
                }
            )

        return await self.guarded(request, render)

    # -- actions ------------------------------------------------------------------------

    async def _form(self, request: Request) -> dict[str, str]:
        """The POSTed form, checked against CSRF: 403 unless it carries the CSRF cookie's
        value and comes from this host."""
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            host = urllib.parse.urlsplit(origin).netloc
            if host != request.headers.get("host"):
                raise _Forbidden("this action comes from another site (Origin)")
        elif origin == "null":
            raise _Forbidden("this action comes from an opaque origin")
        if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            raise _Forbidden("this action comes from another site (Sec-Fetch-Site)")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM:
                raise BadParameter(f"the form is larger than {MAX_FORM} bytes")
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        if kind != "application/x-www-form-urlencoded":
            raise BadParameter("the form must be application/x-www-form-urlencoded")
        try:
            pairs = urllib.parse.parse_qsl(
                body.decode("utf-8"), keep_blank_values=True, strict_parsing=False
            )
        except (UnicodeDecodeError, ValueError):
            raise BadParameter("the form is not valid UTF-8 url-encoded text") from None
        form = dict(pairs)
        cookie = request.cookies.get(CSRF_COOKIE, "")
        sent = form.get("csrf", "")
        if not cookie or not hmac.compare_digest(cookie.encode(), sent.encode()):
            raise _Forbidden("the form's CSRF token is missing or wrong: reload the page")
        return form

    async def post(
        self, request: Request, act: Callable[[dict[str, str]], Awaitable[Response]]
    ) -> Response:
        try:
            form = await self._form(request)
            if self.guard is None:
                raise _Forbidden("actions are off: this app was given no action token")
            return await act(form)
        except _Forbidden as error:
            return self._refused(request, str(error))
        except (NotFound, BadParameter, SourceUnavailable, Refused) as error:
            return self.problem(request, error)

    def _refused(self, request: Request, why: str) -> Response:
        return self.page(request, "problem.html", 403, title="Forbidden", error=why)

    async def unlock(self, request: Request) -> Response:
        async def act(form: dict[str, str]) -> Response:
            if self.token is None:
                raise _Forbidden("this app's actions are allowed by its host application")
            given = form.get("token", "")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise _Forbidden("that is not the action token")
            response = RedirectResponse(_back(form), status_code=303)
            response.set_cookie(
                UNLOCK_COOKIE,
                _unlock_value(self.token),
                httponly=True,
                samesite="strict",
                path=request.scope.get("root_path", "") + "/",
            )
            return response

        return await self.post(request, act)

    async def lock(self, request: Request) -> Response:
        async def act(form: dict[str, str]) -> Response:
            response = RedirectResponse(_back(form), status_code=303)
            response.delete_cookie(UNLOCK_COOKIE, path=request.scope.get("root_path", "") + "/")
            return response

        return await self.post(request, act)

    async def action(self, request: Request) -> Response:
        async def act(form: dict[str, str]) -> Response:
            if not self.unlocked(request):
                raise _Forbidden(
                    "the host application does not allow this request to act"
                    if self.guard == "host"
                    else "the actions are locked: unlock them with the action token"
                )
            name = form.get("q", "") or (self.single or "")
            if not name or len(name) > MAX_TEXT:
                raise BadParameter("field 'q' is required: the name of a queue")
            given = form.get("action", "")
            event = ENVELOPE_ACTIONS.get(given)
            if event is not None:
                key = _key(form.get("key", ""))
                now = await self.source.operate(name, key, event)
                done = {"q": name, "done": event.value}
                if now is None:
                    target = "envelopes?" + urllib.parse.urlencode(done)
                else:
                    target = "envelope?" + urllib.parse.urlencode({**done, "key": now})
                return RedirectResponse(target, status_code=303)
            what = ACTIONS.get(given)
            if what is None:
                raise BadParameter(
                    f"field 'action': {_shown(given)} is not one of "
                    + ", ".join([*ACTIONS, *ENVELOPE_ACTIONS])
                )
            await self.source.act(name, what)
            target = "queue?" + urllib.parse.urlencode({"q": name, "done": what.value})
            return RedirectResponse(target, status_code=303)

        return await self.post(request, act)


class _Forbidden(Exception):
    """A forged or unauthenticated action (HTTP 403)."""


#: What a page says after an action, by the action's name.
DONE: Final[Mapping[str, str]] = {
    "stop": "stop requested.",
    "start": "start requested.",
    "retry": "retry done: the envelope is back in the queue.",
    "cancel": "cancel done (a running attempt is asked to stop: it ends STOPPED).",
    "discard": "discard done: the queue no longer keeps the envelope.",
}


def _notice(request: Request) -> str | None:
    return DONE.get(request.query_params.get("done", ""))


def _when_offered() -> dict[str, str]:
    """The queue states in which its page offers a stop, a start, neither (the page's
    script shows the buttons of the state it polls)."""
    when = {c.value: " ".join(s.name for s in states_allowing(c)) for c in QueueCall}
    when["none"] = " ".join(s.name for s in QueueState if not queue_calls(s))
    return when


def _key(value: str) -> int:
    """The form's ``key`` field: an envelope's seq."""
    if not value.isascii() or not value.isdigit() or len(value) > 19 or int(value) < 1:
        raise BadParameter(f"field 'key': {_shown(value)} is not an envelope's seq")
    if int(value) > MAX_KEY:
        raise BadParameter(f"field 'key': must be at most {MAX_KEY}")
    return int(value)


def _back(form: Mapping[str, str]) -> str:
    """Where a form returns to: a page of this app (a relative path), else its root."""
    back = form.get("back", "")
    if not back or back.startswith(("/", "\\")) or ":" in back.split("?")[0] or len(back) > 500:
        return "./"
    return back


def _here(request: Request) -> str:
    """This page's URL, relative (where an unlock returns to)."""
    query = request.url.query
    return request.url.path.rsplit("/", 1)[-1] + (f"?{query}" if query else "")


def _link(request: Request, changes: Mapping[str, object]) -> str:
    """This page's URL (relative) with some parameters changed (None: removed)."""
    params: MutableMapping[str, str] = dict(request.query_params)
    for key in ("before", "after"):
        params.pop(key, None)
    for key, value in changes.items():
        if value is None:
            params.pop(key, None)
        else:
            params[key] = str(value)
    path = request.url.path.rsplit("/", 1)[-1]
    return f"{path}?{urllib.parse.urlencode(params)}"


def build(
    source: Source,
    *,
    token: str | None,
    poll: float,
    single: str | None,
    authorize: Authorize | None = None,
) -> Starlette:
    """The Starlette app over ``source``."""
    web = _Web(source, token=token, poll=poll, single=single, authorize=authorize)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await source.aclose()

    app = Starlette(
        routes=[
            Route("/", web.overview),
            Route("/queue", web.queue),
            Route("/envelopes", web.envelopes),
            Route("/envelope", web.envelope),
            Route("/schedules", web.schedules),
            Route("/api/counts", web.counts),
            Route("/api/envelope", web.envelope_state),
            Route("/unlock", web.unlock, methods=["POST"]),
            Route("/lock", web.lock, methods=["POST"]),
            Route("/action", web.action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        middleware=[Middleware(_Headers)],
        lifespan=lifespan,
    )
    app.state.source = source
    app.state.web = web
    return app
