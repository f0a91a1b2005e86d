"""envq's benchmark suite: envq against a bare-asyncio floor and its peers.

Run it from the project root with ``python -m benchmarks`` (or
``python benchmarks/run.py``); see ``benchmarks/README.md``. The suite is a program,
not a test: it reports numbers and which targets they meet, and never fails on a
missed target.
"""
