"""A FastAPI app whose lifespan owns an envq queue, with the queue's dashboard mounted.

The queue starts with the app and stops with it: ``async with queue`` in the lifespan
starts it on the server's event loop; at shutdown it stops (DRAIN: ready work still
runs) and terminates it, and what was left over is logged. Handlers reach the queue
through ``request.app.state.queue``:

- ``POST /emails`` queues an email and answers 202; a full queue answers 503
  (``envq.CapacityExceeded``), a stopping one 503 too (``envq.QueueNotRunning``).
- ``GET /stats`` returns the queue's statistics.
- ``/ops/queue/`` is the dashboard (``envq.web``): the queue's machines with live
  counts, its envelopes, each with its last error and failed attempts. It is
  read-only unless ``$ENVQ_WEB_TOKEN`` holds an action token (16 characters or more):
  then a browser that unlocks the actions with it may stop and start the queue and
  retry, cancel or discard envelopes. A real app also puts the mount behind its own
  authentication.

Serve it (needs ``pip install -e ".[examples]"`` and ``pip install uvicorn``)::

    ENVQ_WEB_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe())') \
        uvicorn --app-dir examples fastapi_app:app

Run as a script, it drives the app in-process (no network) and prints what happens:
``python examples/fastapi_app.py`` (about 1 s).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

import envq
import envq.web

_ids = itertools.count(1)
#: What the workers "sent" (a real app would call its mail service).
outbox: list[str] = []


class Email(BaseModel):
    to: str
    subject: str


async def send_email(env: envq.Envelope) -> None:
    await asyncio.sleep(0.05)  # the SMTP call
    outbox.append(env.payload["to"])


queue = envq.Queue("emails", workers=4, capacity=100)
#: The dashboard: read-only without a token (none in the environment: None).
dashboard = envq.web.app(queue, token=os.environ.get("ENVQ_WEB_TOKEN") or None)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Own the queue for the app's lifetime."""
    async with queue:
        app.state.queue = queue
        yield
    # Here the queue has stopped and terminated; queue.leftovers holds what was left.
    await envq.web.aclose(dashboard)  # a mounted app's own lifespan is not run


app = FastAPI(lifespan=lifespan)
app.mount("/ops/queue", dashboard)


@app.post("/emails", status_code=202)
async def queue_email(email: Email, request: Request) -> dict[str, int]:
    """Queue one email; 202 with its id, or 503 when the queue cannot take it."""
    queue: envq.Queue = request.app.state.queue
    email_id = next(_ids)
    env = envq.Envelope(
        invoke=send_email,
        id=email_id,
        type="email",
        deadline=10,
        payload=email.model_dump(),
        retry=envq.Retry(attempts=3),
    )
    try:
        queue.send(env)
    except (envq.CapacityExceeded, envq.QueueNotRunning) as exc:
        raise HTTPException(status_code=503, detail=str(exc)) from exc
    return {"id": email_id}


@app.get("/stats")
async def stats(request: Request) -> dict[str, object]:
    """The queue's state and counters."""
    queue: envq.Queue = request.app.state.queue
    s = queue.statistics()
    return {
        "state": s.state.name,
        "capacity_used": s.capacity_used,
        "capacity_limit": s.capacity_limit,
        "by_state": {state.name: n for state, n in s.by_state.items()},
        "outcomes": {outcome.name: n for outcome, n in s.outcomes.items()},
    }


async def demo() -> None:
    """Run the app's lifespan, queue three emails, read the stats, shut down.

    Requests go through httpx's ASGI transport: in-process, no socket. (That transport
    does not run lifespan events, so the demo enters the lifespan itself, as a server
    does at startup and shutdown.)
    """
    import httpx  # noqa: PLC0415 - the demo's client, from the examples extra

    async with app.router.lifespan_context(app):  # startup: the queue starts
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            for to in ("a@example.com", "b@example.com", "c@example.com"):
                response = await client.post("/emails", json={"to": to, "subject": "hello"})
                print("POST /emails ->", response.status_code, response.json())
            await asyncio.sleep(0.5)  # the workers run meanwhile
            body = (await client.get("/stats")).json()
            print("GET /stats ->", body["state"], "succeeded:", body["by_state"]["SUCCEEDED"])
            page = await client.get("/ops/queue/envelopes?state=succeeded")
            listed = page.text.count('href="envelope?')
            print("GET /ops/queue/envelopes ->", page.status_code, f"{listed} succeeded listed")
    # shutdown: the lifespan's exit stopped and terminated the queue
    print("sent:", sorted(outbox))
    print("app: done")


if __name__ == "__main__":
    asyncio.run(demo())
