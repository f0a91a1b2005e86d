"""The task API's types, checked by running mypy on a small program: ``Task[T]`` gives
``await task`` and ``task.future.result()`` the function's result type, and
``Task(fn, *args, **kwargs)`` / ``submit`` check the arguments against ``fn``
(``ParamSpec``).

Each line of :data:`PROGRAM` that matters ends with ``# [label]``; the tests read
mypy's messages for that line.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import asyncio
    import envq

    def add(a: int, b: int) -> int:
        return a + b

    async def fetch(url: str, *, timeout: float = 1.0) -> bytes:
        return b""

    async def send(x: int) -> str:
        return str(x)

    t_add = envq.Task(add, 1, 2)
    reveal_type(t_add)  # [task-plain]
    reveal_type(t_add.future.result())  # [future-plain]
    t_fetch = envq.Task(fetch, "u", timeout=3)
    reveal_type(t_fetch)  # [task-async]
    reveal_type(t_fetch.future.result())  # [future-async]
    reveal_type(envq.Task(lambda: send(1)))  # [task-lambda-awaitable]
    reveal_type(envq.Task(add, 1, 2).retries(3).within(5).no_jitter())  # [builder]
    reveal_type(envq.submit(add, 1, 2))  # [submit]
    reveal_type(envq.submit(fetch, "u"))  # [submit-async]
    reveal_type(envq.enqueue(envq.Task(fetch, "u")))  # [enqueue]
    reveal_type(envq.TaskQueue().submit(add, 1, b=2))  # [taskqueue-submit]
    reveal_type(envq.BackgroundQueue().submit(fetch, "u"))  # [background-submit]

    async def main() -> None:
        reveal_type(await t_add)  # [await-plain]
        reveal_type(await t_fetch)  # [await-async]
        reveal_type(await envq.submit(send, 1))  # [await-submit]

    envq.Task(add, 1, "x")  # [bad-type]
    envq.Task(add, 1)  # [missing]
    envq.submit(fetch, "u", timeout=1, retries=3)  # [unknown-keyword]
    envq.TaskQueue().submit(add, 1, 2, 3)  # [too-many]
    envq.BackgroundQueue().submit(fetch, 5)  # [bad-type-background]
    ok: envq.Task[int] = envq.Task(add, 1, 2)  # [annotated]
    wrong: envq.Task[str] = envq.Task(add, 1, 2)  # [annotated-wrong]
    """
)


@pytest.fixture(scope="module")
def mypy_messages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """mypy's messages for each labelled line of the program."""
    where = tmp_path_factory.mktemp("typing")
    program = where / "program.py"
    program.write_text(PROGRAM)
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--show-error-codes",
            "--cache-dir",
            str(ROOT / ".mypy_cache"),
            str(program),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=where,
        check=False,
    )
    labels = {
        n: m.group(1)
        for n, line in enumerate(PROGRAM.splitlines(), start=1)
        if (m := re.search(r"# \[([a-z-]+)\]$", line))
    }
    messages: dict[str, list[str]] = {label: [] for label in labels.values()}
    for line in done.stdout.splitlines():
        m = re.match(r".*program\.py:(\d+): (?:error|note): (.*)", line)
        assert m, f"unexpected mypy output: {line!r}\n{done.stdout}{done.stderr}"
        label = labels.get(int(m.group(1)))
        if label is not None:
            messages[label].append(m.group(2))
    return messages


def revealed(messages: dict[str, list[str]], label: str) -> str:
    notes = [m for m in messages[label] if m.startswith("Revealed type is")]
    assert len(notes) == 1, messages[label]
    # Older mypy versions spell builtins in full: "int".
    return notes[0].removeprefix("Revealed type is ").strip('"').replace("builtins.", "")


@pytest.mark.parametrize(
    ("label", "expected"),
    [
        ("task-plain", "envq._task.Task[int]"),
        ("future-plain", "int"),
        ("task-async", "envq._task.Task[bytes]"),
        ("future-async", "bytes"),
        ("task-lambda-awaitable", "envq._task.Task[str]"),
        ("builder", "envq._task.Task[int]"),
        ("submit", "envq._task.Task[int]"),
        ("submit-async", "envq._task.Task[bytes]"),
        ("enqueue", "envq._task.Task[bytes]"),
        ("taskqueue-submit", "envq._task.Task[int]"),
        ("background-submit", "envq._task.Task[bytes]"),
        ("await-plain", "int"),
        ("await-async", "bytes"),
        ("await-submit", "str"),
    ],
)
def test_revealed_types(mypy_messages: dict[str, list[str]], label: str, expected: str) -> None:
    """A task's type carries its function's result: awaited for an async function (or
    a plain one returning an awaitable), as is for a plain one."""
    assert revealed(mypy_messages, label) == expected


@pytest.mark.parametrize(
    ("label", "fragment"),
    [
        ("bad-type", 'matches argument types "Callable[[int, int], int]", "int", "str"'),
        ("missing", 'matches argument types "Callable[[int, int], int]", "int"'),
        ("unknown-keyword", 'Unexpected keyword argument "retries"'),
        ("too-many", 'argument types "Callable[[int, int], int]", "int", "int", "int"'),
        ("bad-type-background", 'of "BackgroundQueue" matches argument types'),
        ("annotated-wrong", 'No overload variant of "Task"'),
    ],
)
def test_wrong_arguments_are_type_errors(
    mypy_messages: dict[str, list[str]], label: str, fragment: str
) -> None:
    """Arguments that do not fit the function are errors for mypy, as they are at
    run time."""
    errors = [m for m in mypy_messages[label] if not m.startswith("Revealed type")]
    assert any(fragment in m for m in errors), mypy_messages[label]


def test_a_good_annotation_is_clean(mypy_messages: dict[str, list[str]]) -> None:
    """``envq.Task[int]`` is a valid annotation for a task of an int function."""
    assert mypy_messages["annotated"] == []
