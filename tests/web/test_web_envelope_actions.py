"""An envelope's page over an in-process queue, through HTTP: its last error with the
traceback (escaped) and its failed attempts, the operator's moves it offers (those the
tables allow in its state, for an envelope the queue holds), and retry, cancel and
discard performed through ``Queue.retry``, ``cancel`` and ``discard``, with the
refusals of the queue and of the guard rails as clear 4xx answers."""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

import envq
import envq.web
from envq import EnvState

pytest.importorskip("starlette")

from envq.web._app import CSRF_COOKIE

TOKEN = "an-envelope-action-token-0123"
EVIL = "<script>alert(1)</script>"
#: Envelope ids whose attempts fail until the test lets them through.
FAILING: set[object] = set()


async def hold(env: envq.Envelope) -> None:
    await asyncio.sleep(3600)


async def fine(env: envq.Envelope) -> None:
    return None


async def evil(env: envq.Envelope) -> None:
    raise RuntimeError(f"bad {EVIL} input")


async def flaky(env: envq.Envelope) -> None:
    """Fails while its id is in :data:`FAILING`."""
    if env.id in FAILING:
        raise ValueError(f"{env.id} is not ready yet")


@asynccontextmanager
async def client(
    queue: envq.Queue, token: str | None = TOKEN, *, unlocked: bool = True
) -> AsyncIterator[httpx.AsyncClient]:
    web = envq.web.app(queue, token=token)
    transport = httpx.ASGITransport(app=web)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            await c.get("/queue")  # the CSRF cookie
            if unlocked:
                done = await c.post("/unlock", data={"csrf": csrf(c), "token": TOKEN})
                assert done.status_code == 303
            yield c
    finally:
        await envq.web.aclose(web)


def csrf(c: httpx.AsyncClient) -> str:
    value = c.cookies.get(CSRF_COOKIE)
    assert value is not None
    return value


async def act(c: httpx.AsyncClient, key: object, action: str) -> httpx.Response:
    return await c.post(
        "/action", data={"csrf": csrf(c), "q": "jobs", "key": str(key), "action": action}
    )


def offered(page: str) -> set[str]:
    """The envelope actions a page's buttons offer."""
    return set(re.findall(r'name="action" value="(retry|cancel|discard)"', page))


def key_of(queue: envq.Queue, ident: object) -> int:
    """The key (seq) of the stay of the envelope with id ``ident`` the queue holds."""
    found = [x.seq for x in queue.envelopes(limit=1000) if x.envelope.id == ident]
    assert len(found) == 1, found
    return found[0]


async def until(what: str, check: Callable[[], bool]) -> None:
    """Wait (virtual time) until ``check()``."""
    for _ in range(10_000):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def state(queue: envq.Queue, ident: object) -> EnvState | None:
    found = [x.state for x in queue.envelopes(limit=1000) if x.envelope.id == ident]
    return found[0] if found else None


async def test_a_failed_envelope_shows_its_last_error_and_its_attempts(
    make_queue: object,
) -> None:
    q: envq.Queue = make_queue(name="jobs", workers=1)  # type: ignore[operator]
    async with client(q) as c:
        q.start()
        q.send(envq.Envelope(invoke=evil, id="e", retry=envq.Retry(attempts=2, base=0.01)))
        await until("the failure", lambda: state(q, "e") is EnvState.FAILED)
        page = (await c.get(f"/envelope?key={key_of(q, 'e')}")).text
        assert EVIL not in page
        traceback = re.search(r'<pre class="traceback">([^<]*)</pre>', page)
        assert traceback is not None
        text = html.unescape(traceback[1])
        assert f"RuntimeError: bad {EVIL} input" in text
        assert "in evil" in text  # the job's own frame
        line = re.search(r'<p class="error-line">(.*?)</p>', page)
        assert line is not None
        assert "envq._errors.MaxRetriesExceeded" in html.unescape(line[1])
        attempts = re.findall(r'<td class="num">(\d+)</td><td>([A-Z_]+)</td>', page)
        assert attempts == [("1", "ERROR"), ("2", "ERROR")]
        errors = [html.unescape(e) for e in re.findall(r'<td class="mono err">([^<]*)</td>', page)]
        assert errors[0] == f"builtins.RuntimeError: bad {EVIL} input"
        assert errors[1].startswith("envq._errors.MaxRetriesExceeded: ")
        assert offered(page) == {"retry", "discard"}


async def test_each_state_offers_the_moves_of_its_rows(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs", workers=2)  # type: ignore[operator]
    async with client(q) as c:
        q.send(envq.Envelope(invoke=fine, id="buffered"))
        page = (await c.get(f"/envelope?key={key_of(q, 'buffered')}")).text
        assert offered(page) == {"cancel"}
        q.start()
        q.send(
            envq.Envelope(invoke=hold, id="running"),
            envq.Envelope(invoke=fine, id="delayed", delay=600),
            envq.Envelope(invoke=evil, id="failed"),
            envq.Envelope(invoke=fine, id="ok"),
        )
        await until("the end", lambda: state(q, "failed") is EnvState.FAILED)
        want = {"running": {"cancel"}, "delayed": {"cancel"}, "failed": {"retry", "discard"}}
        for ident, actions in want.items():
            page = (await c.get(f"/envelope?key={key_of(q, ident)}")).text
            assert offered(page) == actions, ident
        # SUCCEEDED allows a discard, but the queue keeps no envelope that succeeded:
        # the page says so and offers nothing.
        listed = (await c.get("/envelopes?state=succeeded")).text
        key = re.search(r"key=(\d+)\"", listed)
        assert key is not None
        page = (await c.get(f"/envelope?key={key[1]}")).text
        assert offered(page) == set()
        assert "no longer holds this envelope" in page
    async with client(q, unlocked=False) as c:
        page = (await c.get(f"/envelope?key={key_of(q, 'failed')}")).text
        assert offered(page) == set()
        assert "Unlock the actions (top right) to retry or discard" in page
    async with client(q, token=None, unlocked=False) as c:
        page = (await c.get(f"/envelope?key={key_of(q, 'failed')}")).text
        assert offered(page) == set()
        assert "read-only" in page


async def test_a_retry_from_the_page_runs_it_again(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs", workers=1)  # type: ignore[operator]
    FAILING.add("again")
    async with client(q) as c:
        q.start()
        q.send(envq.Envelope(invoke=flaky, id="again"))
        await until("the failure", lambda: state(q, "again") is EnvState.FAILED)
        old = key_of(q, "again")
        FAILING.discard("again")
        done = await act(c, old, "retry")
        assert done.status_code == 303
        location = done.headers["location"]
        new = int(location.rsplit("key=", 1)[1])
        assert location == f"envelope?q=jobs&done=retry&key={new}"
        assert new > old  # a retry is a new stay in the queue
        await until("the second attempt", lambda: state(q, "again") is None)  # succeeded
        page = (await c.get(location)).text
        assert "retry done" in page
        assert 'data-envstate="SUCCEEDED"' in page
        assert (await c.get(f"/api/envelope?key={new}")).json() == {"state": "SUCCEEDED"}
        # Its story goes on: the failed attempt, its error, and every move of both stays.
        assert re.findall(r'<td class="num">(\d+)</td><td>([A-Z_]+)</td>', page) == [("1", "ERROR")]
        assert "ValueError: again is not ready yet" in html.unescape(page)
        rows = [html.unescape(r) for r in re.findall(r'<td class="mono">([^<]*\[[^<]*)</td>', page)]
        assert rows == [
            "QUEUE_MOVES[(NEW, SEND)] (ARRIVAL: NOW)",
            "QUEUE_MOVES[(READY, DISPATCH)]",
            "OUTCOMES[(ONE_OFF, ERROR)]",
            "QUEUE_MOVES[(FAILED, RETRY)] (ARRIVAL: NOW or LATER)",
            "QUEUE_MOVES[(READY, DISPATCH)]",
            "OUTCOMES[(ONE_OFF, OK)]",
        ]
        gone = await c.get(f"/envelope?key={old}")
        assert gone.status_code == 404
        assert f"sent it back as envelope {new}" in gone.text
        assert (await c.get(f"/api/envelope?key={old}")).status_code == 404


async def test_cancel_and_discard_from_the_page(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs", workers=1)  # type: ignore[operator]
    async with client(q) as c:
        q.start()
        q.send(
            envq.Envelope(invoke=hold, id="long"), envq.Envelope(invoke=fine, id="later", delay=600)
        )
        await until("the attempt", lambda: state(q, "long") is EnvState.RUNNING)
        later = key_of(q, "later")
        done = await act(c, later, "cancel")
        assert done.status_code == 303
        assert done.headers["location"] == f"envelope?q=jobs&done=cancel&key={later}"
        assert state(q, "later") is EnvState.STOPPED
        # A running one is relabelled and asked to stop: it ends STOPPED.
        long = key_of(q, "long")
        assert (await act(c, long, "cancel")).status_code == 303
        await until("the cancelled attempt", lambda: state(q, "long") is EnvState.STOPPED)
        page = (await c.get(f"/envelope?key={long}")).text
        assert offered(page) == {"retry", "discard"}
        assert re.search(r"<th scope=\"row\">kind</th><td class=\"mono\">CANCELLED<", page)
        gone = await act(c, later, "discard")
        assert gone.status_code == 303
        assert gone.headers["location"] == "envelopes?q=jobs&done=discard"
        assert state(q, "later") is None
        assert "discard done" in (await c.get(gone.headers["location"])).text
        assert (await c.get(f"/envelope?key={later}")).status_code == 404
        listed = (await c.get("/envelopes")).text
        assert f'key={later}"' not in listed
        assert f'key={long}"' in listed


async def test_refusals_are_clear_and_change_nothing(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs", workers=1, capacity=2)  # type: ignore[operator]
    async with client(q) as c:
        q.start()
        q.send(envq.Envelope(invoke=evil, id="bad"))
        await until("the failure", lambda: state(q, "bad") is EnvState.FAILED)
        key = key_of(q, "bad")
        # A move the tables do not have from FAILED.
        wrong = await act(c, key, "cancel")
        assert wrong.status_code == 409
        assert "no CANCEL move from FAILED" in wrong.text
        # The queue's own refusals: no room, then a stopped queue.
        q.send(*(envq.Envelope(invoke=fine, id=f"wait{i}", delay=600) for i in range(2)))
        full = await act(c, key, "retry")
        assert full.status_code == 409
        assert "refused (CapacityExceeded)" in full.text
        assert "no room to retry" in html.unescape(full.text)
        await q.stop()
        stopped = await act(c, key, "retry")
        assert stopped.status_code == 409
        assert f"the retry of envelope {key} was refused (QueueNotRunning)" in stopped.text
        assert "is STOPPED" in stopped.text
        assert state(q, "bad") is EnvState.FAILED
        # Bad or forged forms.
        assert (await act(c, 999, "retry")).status_code == 404
        for bad in ("", "0", "-1", "x", "9" * 30):
            answer = await act(c, bad, "retry")
            assert answer.status_code == 400, bad
            assert "'key'" in html.unescape(answer.text)
        forged = await c.post("/action", data={"q": "jobs", "key": str(key), "action": "retry"})
        assert forged.status_code == 403
        assert (await c.get(f"/action?key={key}&action=retry")).status_code == 405
    async with client(q, unlocked=False) as c:
        locked = await act(c, key, "discard")
        assert locked.status_code == 403
        assert "locked" in locked.text
    async with client(q, token=None, unlocked=False) as c:
        off = await act(c, key, "discard")
        assert off.status_code == 403
        assert "no action token" in html.unescape(off.text)
    assert state(q, "bad") is EnvState.FAILED
