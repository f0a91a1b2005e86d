"""The dashboard over an in-process queue, through HTTP (httpx's ASGI transport, no
socket): the pages' counts are the queue's, user data is escaped, bad input gets a
clear 4xx, pages walk the envelopes once each, moves name their table rows."""

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
from envq import EnvState, QueueState

pytest.importorskip("starlette")

EVIL = "<script>alert(1)</script>"


async def hold(env: envq.Envelope) -> None:
    await asyncio.sleep(3600)


async def fine(env: envq.Envelope) -> None:
    return None


async def fails(env: envq.Envelope) -> None:
    raise RuntimeError("no")


@asynccontextmanager
async def client(queue: envq.Queue, **kw: object) -> AsyncIterator[httpx.AsyncClient]:
    web = envq.web.app(queue, **kw)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=web)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash") as c:
            yield c
    finally:
        await envq.web.aclose(web)


def counts_in(page: str) -> dict[str, int]:
    """The counts a page shows, by state (the elements the script refreshes)."""
    found = re.findall(r'data-count="([A-Z]+)">(\d+)<', page)
    assert found, "no count on the page"
    shown: dict[str, int] = {}
    for state, n in found:
        assert shown.setdefault(state, int(n)) == int(n), f"{state} shown twice, differently"
    return shown


async def busy_queue(make_queue: object) -> envq.Queue:
    q: envq.Queue = make_queue(name="jobs", workers=2)  # type: ignore[operator]
    q.subscribe(lambda event: None)  # a listener: failures count as handled
    return q


async def test_pages_show_the_queues_counts(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        q.start()
        q.send(*(envq.Envelope(invoke=fine, id=i, type="ok") for i in range(5)))
        q.send(*(envq.Envelope(invoke=fails, id=10 + i, type="bad") for i in range(3)))
        await asyncio.sleep(0.1)
        q.send(*(envq.Envelope(invoke=hold, id=20 + i) for i in range(3)))
        q.send(envq.Envelope(invoke=fine, id=30, delay=600))
        await asyncio.sleep(0.1)
        stats = q.statistics()
        want = {s.name: n for s, n in stats.by_state.items()}
        assert (want["SUCCEEDED"], want["FAILED"], want["RUNNING"]) == (5, 3, 2)
        assert (want["READY"], want["DELAYED"]) == (1, 1)
        for path in ("/", "/queue?q=jobs", "/queue"):
            page = await c.get(path)
            assert page.status_code == 200, path
            assert counts_in(page.text) == want, path
        body = (await c.get("/api/counts")).json()
        assert body["queues"]["jobs"]["state"] == "RUNNING"
        assert body["queues"]["jobs"]["counts"] == want


async def test_user_data_is_escaped(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        q.send(envq.Envelope(invoke=fine, id=EVIL, type=EVIL, payload={"html": EVIL}))
        listed = await c.get("/envelopes")
        key = re.search(r"key=(\d+)", listed.text)
        assert key is not None
        one = await c.get(f"/envelope?key={key[1]}")
        for page in (listed, one, await c.get(f"/envelopes?type={EVIL}")):
            assert page.status_code == 200
            assert EVIL not in page.text
            assert html.escape(EVIL) in page.text or "&lt;script&gt;" in page.text


@pytest.mark.parametrize(
    ("path", "status", "names"),
    [
        ("/envelope?key=999", 404, "999"),
        ("/envelope?key=0", 400, "'key'"),
        ("/envelope?key=abc", 400, "'key'"),
        ("/envelope", 400, "'key'"),
        ("/queue?q=other", 404, "'other'"),
        ("/envelopes?q=other", 404, "'other'"),
        ("/envelopes?state=bogus", 400, "'state'"),
        ("/envelopes?state=new", 400, "'state'"),
        ("/envelopes?before=-1", 400, "'before'"),
        ("/envelopes?before=99999999999999999999", 400, "'before'"),
        ("/envelopes?before=3&after=1", 400, "'before' and 'after'"),
        ("/envelopes?limit=0", 400, "'limit'"),
        ("/envelopes?limit=100000", 400, "'limit'"),
        ("/envelopes?type=" + "x" * 300, 400, "'type'"),
        ("/envelopes?id=%01", 400, "'id'"),
        ("/api/counts?q=other", 404, "'other'"),
    ],
)
async def test_bad_input_gets_a_clear_4xx(
    make_queue: object, path: str, status: int, names: str
) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        page = await c.get(path)
        assert page.status_code == status, page.text[:500]
        assert names in html.unescape(page.text)
        assert len(page.content) < 20_000


async def test_keyset_pages_walk_every_envelope_once(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        q.send(
            *(envq.Envelope(invoke=fine, id=i, type="even" if i % 2 else "odd") for i in range(23))
        )
        seen: list[int] = []
        url = "/envelopes?limit=5"
        pages = 0
        while url:
            page = (await c.get(url)).text
            seen += [int(k) for k in re.findall(r'href="envelope\?q=jobs&amp;key=(\d+)"', page)]
            older = re.search(r'rel="next" href="([^"]+)"', page)
            url = "/" + html.unescape(older[1]) if older else ""
            pages += 1
        assert pages == 5
        assert seen == sorted(seen, reverse=True) == list(range(23, 0, -1))
        # And back: the newer pages from the last one.
        page = (await c.get("/envelopes?limit=5&before=4")).text
        newer = re.search(r'rel="prev" href="([^"]+)"', page)
        assert newer is not None
        back = (await c.get("/" + html.unescape(newer[1]))).text
        keys = [int(k) for k in re.findall(r"key=(\d+)\"", back)]
        assert keys == [8, 7, 6, 5, 4]
        typed = (await c.get("/envelopes?type=odd&limit=100")).text
        assert len(re.findall(r"key=\d+\"", typed)) == 12
        ided = (await c.get("/envelopes?id=7")).text
        assert re.findall(r"key=(\d+)\"", ided) == ["8"]


async def test_an_envelope_shows_its_moves_and_their_rows(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        q.start()
        q.send(envq.Envelope(invoke=fails, id="f", retry=envq.Retry(attempts=2, base=0.01)))
        await asyncio.sleep(1)
        page = (await c.get("/envelopes?state=failed")).text
        key = re.search(r"key=(\d+)\"", page)
        assert key is not None
        one = (await c.get(f"/envelope?key={key[1]}")).text
        rows = [html.unescape(r) for r in re.findall(r'<td class="mono">([^<]*\[[^<]*)</td>', one)]
        assert rows == [
            "QUEUE_MOVES[(NEW, SEND)] (ARRIVAL: NOW)",
            "QUEUE_MOVES[(READY, DISPATCH)]",
            "OUTCOMES[(ONE_OFF, ERROR)] → DELAYED",
            "QUEUE_MOVES[(DELAYED, DUE)]",
            "QUEUE_MOVES[(READY, DISPATCH)]",
            "OUTCOMES[(ONE_OFF, ERROR)]",
        ]


async def test_schedules_list_periodic_envelopes_with_their_next_run(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        q.start()
        q.send(envq.Envelope(invoke=fine, id="tick", type="tick", interval=30))
        q.send(envq.Envelope(invoke=fine, id="once", delay=5))
        await asyncio.sleep(1)
        page = (await c.get("/schedules")).text
        assert "tick" in page
        assert "every 30s" in page
        assert "once" not in page
        assert re.search(r"UTC \(in (2\d|30) s\)", page), page


async def test_queue_envelopes_lists_snapshots(make_queue: object) -> None:
    q: envq.Queue = make_queue(name="jobs", workers=1)  # type: ignore[operator]
    envs = [envq.Envelope(invoke=fine, id=i, delay=10 if i % 2 else 0) for i in range(6)]
    q.send(*envs)
    listed = q.envelopes()
    assert [x.envelope for x in listed] == envs
    assert [x.seq for x in listed] == [1, 2, 3, 4, 5, 6]
    assert {x.state for x in listed} == {EnvState.BUFFERED}
    q.start()
    await asyncio.sleep(0)
    delayed = q.envelopes(EnvState.DELAYED)
    assert [x.envelope.id for x in delayed] == [1, 3, 5]
    assert all(x.due is not None and x.due > 0 for x in delayed)
    # The ones not delayed have run and left; the delayed ones are stays 2, 4 and 6.
    assert [x.seq for x in q.envelopes(after=2)] == [4, 6]
    assert [x.seq for x in q.envelopes(after=2, limit=1)] == [4]
    with pytest.raises(TypeError, match="state"):
        q.envelopes("delayed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit"):
        q.envelopes(limit=0)
    with pytest.raises(ValueError, match="after"):
        q.envelopes(after=-1)
    assert q.state is QueueState.RUNNING


def chart_of(page: str) -> tuple[int, int, list[str]]:
    """The ends' chart a page shows: its caption's succeeded and failed totals, and the
    title of each bar that has any."""
    caption = re.search(
        r"<span class=\"ok-key\">(\d+) succeeded</span>, "
        r"<span class=\"bad-key\">(\d+) failed</span>",
        page,
    )
    assert caption is not None, "no chart on the page"
    bars = re.findall(r"<title>([^<]*: (\d+) succeeded, (\d+) failed)</title>", page)
    return int(caption[1]), int(caption[2]), [t for t, ok, bad in bars if ok != "0" or bad != "0"]


async def test_the_chart_counts_the_ends_of_the_last_minutes(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        assert chart_of((await c.get("/")).text)[:2] == (0, 0)
        q.start()
        q.send(*(envq.Envelope(invoke=fine, id=f"ok{i}") for i in range(5)))
        q.send(*(envq.Envelope(invoke=fails, id=f"bad{i}") for i in range(3)))
        await asyncio.sleep(1)
        ok, bad, bars = chart_of((await c.get("/")).text)
        assert (ok, bad) == (5, 3)
        assert bars
        assert bars[-1].endswith("5 succeeded, 3 failed")  # the latest slice
        assert chart_of((await c.get("/queue")).text)[:2] == (5, 3)


async def test_a_cron_envelope_is_listed_with_its_next_run(make_queue: object) -> None:
    q = await busy_queue(make_queue)
    async with client(q) as c:
        q.start()
        q.send(
            envq.Envelope(invoke=fine, id="nightly", type="report", schedule=envq.Cron("0 3 * * *"))
        )
        q.send(envq.Envelope(invoke=fine, id="once", delay=5))
        page = (await c.get("/schedules")).text
        assert "nightly" in page
        assert "once" not in page
        assert re.search(r"on Cron\(.*0 3 \* \* \*", html.unescape(page)), page
        # Its next run: 03:00 of the next day that has one, less than a day away.
        due = re.search(r"\d{4}-\d\d-\d\d 03:00:00 UTC \(in ([\d.]+) (s|min|h)\)", page)
        assert due is not None, page
        assert due[2] != "h" or float(due[1]) <= 24
