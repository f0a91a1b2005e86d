"""Tasks take their function's arguments: ``Task(fn, *args, **kwargs)`` and
``submit(fn, *args, **kwargs)``, on virtual time."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import envq


def add(a: int, b: int) -> int:
    return a + b


async def fetch(url: str, *, wait: float = 1.0) -> str:
    await asyncio.sleep(wait)
    return f"{url} in {wait}"


def options(fn: str, retries: int, rng: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Parameters named like envq's own: they are the function's, not the task's."""
    return {"fn": fn, "retries": retries, "rng": rng, "args": args, "kwargs": kwargs}


class TestArguments:
    async def test_positional_arguments(self) -> None:
        """``Task(add, 1, 2)`` runs ``add(1, 2)`` (a plain function, in a thread)."""
        async with envq.TaskQueue() as q:
            task = q.enqueue(envq.Task(add, 1, 2))
            assert await task == 3
        assert (task.fn, task.args, task.kwargs, task.name) == (add, (1, 2), {}, "add")

    async def test_keyword_arguments_of_an_async_function(self) -> None:
        """Keywords go to the function; an async one runs on the loop."""
        async with envq.TaskQueue() as q:
            task = q.submit(fetch, "u", wait=5)
            assert await task == "u in 5"
        assert task.kwargs == {"wait": 5}

    async def test_every_keyword_belongs_to_the_function(self) -> None:
        """``fn``, ``retries``, ``rng``…: keywords are never the task's own options."""
        async with envq.TaskQueue() as q:
            task = q.submit(options, fn="f", retries=2, rng="r", x=1)
            got = await task
        assert got == {"fn": "f", "retries": 2, "rng": "r", "args": (), "kwargs": {"x": 1}}
        assert task.retry.attempts == 1

    async def test_each_attempt_gets_the_same_arguments(self) -> None:
        """Retries call the function with the same arguments again."""
        seen: list[tuple[int, str]] = []

        async def flaky(n: int, *, tag: str) -> str:
            seen.append((n, tag))
            if len(seen) < 3:
                raise ValueError("again")
            return tag

        async with envq.TaskQueue() as q:
            task = q.enqueue(envq.Task(flaky, 7, tag="t").retries(3).no_jitter())
            assert await task == "t"
        assert seen == [(7, "t")] * 3

    async def test_global_submit_from_a_coroutine(self) -> None:
        """``envq.submit(fn, *args, **kwargs)`` on the loop's global queue."""
        task = envq.submit(fetch, "g", wait=2)
        assert await task == "g in 2"
        await envq.shutdown()

    def test_global_submit_from_plain_code(self) -> None:
        """``envq.submit(add, 1, 2)`` from plain code, on the background queue."""
        task = envq.submit(add, 1, 2)
        assert task.future.result(timeout=30) == 3
        envq.shutdown()

    def test_background_queue_submit(self) -> None:
        """``BackgroundQueue.submit(fn, *args, **kwargs)`` from any thread."""
        got: list[int] = []
        with envq.BackgroundQueue("args") as q:
            worker = threading.Thread(
                target=lambda: got.append(q.submit(add, 2, b=3).future.result())
            )
            worker.start()
            worker.join(30)
        assert got == [5]


class TestBadArguments:
    def test_arguments_that_do_not_fit_are_refused_at_once(self) -> None:
        """Arguments that do not fit the signature raise TypeError where the task is
        made, naming the function and its signature; nothing is queued."""
        with pytest.raises(TypeError, match=r"do not fit add\(a.*, b.*\).*missing.*'b'"):
            envq.Task(add, 1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'c'"):
            envq.Task(add, 1, 2, c=3)
        with pytest.raises(TypeError, match="too many positional arguments"):
            envq.submit(add, 1, 2, 3)

    def test_fn_is_positional_only(self) -> None:
        """``Task(fn=...)`` is not a way to pass the function."""
        with pytest.raises(TypeError):
            envq.Task(fn=add)  # type: ignore[call-overload]

    def test_a_builtin_without_a_signature_is_not_checked(self) -> None:
        """A callable whose signature Python cannot read is taken as it is."""
        task = envq.Task(max, 1, 2)
        assert task.args == (1, 2)
