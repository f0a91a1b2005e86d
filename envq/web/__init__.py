"""envq in a browser: an ASGI app that shows queues, their machines and envelopes.

``envq.web.app(queue)`` serves one in-process :class:`envq.Queue` or one
:class:`envq.postgres.PgQueue`; ``envq.web.app(dsn=...)`` (and ``python -m envq web``)
every queue of a PostgreSQL database. Mount it in a FastAPI or Starlette app, whose
authentication then guards it; it is read-only unless given an action ``token``, or
an ``authorize`` callable through which the host's authentication decides who acts.
See ``docs/web.md``. Needs the ``envq[web]`` extra (Starlette, Jinja2; uvicorn for
the command line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from envq import _checks
from envq._queue import Queue
from envq.web._app import build
from envq.web._memory import MemorySource
from envq.web._source import Source

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request

    from envq.postgres import PgQueue

__all__ = ["aclose", "app"]

#: The shortest action token accepted: a token is a password, guessable ones are refused.
MIN_TOKEN: Final = 16


def app(
    queue: Queue | PgQueue | None = None,
    *,
    dsn: str | None = None,
    token: str | None = None,
    authorize: Callable[[Request], bool] | None = None,
    poll: float = 2.0,
) -> Starlette:
    """The dashboard, as an ASGI (Starlette) app.

    :param queue: an in-process :class:`envq.Queue` or a :class:`envq.postgres.PgQueue`
        to show (exactly one of ``queue`` and ``dsn``). An in-process queue is
        subscribed to (a listener that does not count as handling failures), so its
        pages can show the moves of its envelopes and those that ended.
    :param dsn: a PostgreSQL database whose every queue is shown.
    :param token: the action token: without it the pages are read-only; with it, a
        browser that unlocks the actions with this token may stop and start queues
        (at least 16 characters; keep it out of command lines and logs).
    :param authorize: instead of a token, the host application's own authentication:
        called with each request (a Starlette :class:`~starlette.requests.Request`, on
        which the host's middleware has set ``request.user`` or ``request.scope``),
        ``True`` lets that request act (no unlocking); anything else, or an exception,
        leaves it read-only. Actions still need the page's CSRF token.
    :param poll: seconds between two reads of the live counts by an open page.
    :raises TypeError: ``queue`` is neither, ``token`` not a str, ``authorize`` not
        callable.
    :raises ValueError: both or neither of ``queue`` and ``dsn``; a short token; both
        ``token`` and ``authorize``.
    """
    if (queue is None) == (dsn is None):
        raise ValueError("envq.web.app(): give a queue or a dsn (exactly one)")
    if token is not None:
        if not isinstance(token, str):
            raise TypeError(f"envq.web.app(): token must be a str, not {type(token).__name__}")
        if len(token) < MIN_TOKEN:
            raise ValueError(f"envq.web.app(): the token must have at least {MIN_TOKEN} characters")
    if authorize is not None:
        if not callable(authorize):
            raise TypeError(
                "envq.web.app(): authorize must be callable (request -> bool), "
                f"not {type(authorize).__name__}"
            )
        if token is not None:
            raise ValueError("envq.web.app(): give a token or authorize, not both")
    poll = _checks.seconds("envq.web.app() poll", poll, positive=True)
    source: Source
    single: str | None
    if isinstance(queue, Queue):
        source, single = MemorySource(queue), queue.name
    elif queue is not None:
        from envq.postgres import PgQueue  # noqa: PLC0415 - the postgres extra
        from envq.web._pg import PgSource  # noqa: PLC0415

        if not isinstance(queue, PgQueue):
            raise TypeError(
                "envq.web.app(): queue must be an envq.Queue or an envq.postgres.PgQueue, "
                f"not {type(queue).__name__}"
            )
        source, single = PgSource(queue._dsn, only=queue.name, queue=queue), queue.name
    else:
        from envq.postgres._edges import check_dsn  # noqa: PLC0415
        from envq.web._pg import PgSource  # noqa: PLC0415

        assert dsn is not None
        source, single = PgSource(check_dsn("envq.web.app()", dsn)), None
    return build(source, token=token, poll=poll, single=single, authorize=authorize)


async def aclose(web: Starlette) -> None:
    """Let go of what an app made by :func:`app` holds — its database sessions, its
    listener on an in-process queue. A server that runs the app's lifespan does this
    at shutdown; call it from the host's lifespan when the app is mounted (a mounted
    app's lifespan is not run)."""
    source: Source = web.state.source
    await source.aclose()
