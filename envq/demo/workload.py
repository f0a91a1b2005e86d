"""The demo's workload: the envelopes it sends, their payloads and the jobs they run.

The emails follow a failure plan seeded by :attr:`DemoOptions.seed`; the collector and
the reports misbehave on purpose, each in one way the narration shows.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Final

import envq
from envq import Envelope
from envq.demo.options import DemoOptions
from envq.demo.output import Output, label

__all__ = [
    "CAPACITY",
    "METRICS_DEADLINE",
    "METRICS_INTERVAL",
    "STALLED_RUN",
    "Collector",
    "Mail",
    "TransientError",
    "Workload",
]

#: The demo queue's capacity (small, so backpressure shows).
CAPACITY: Final = 12
#: The metrics collector's interval and deadline, in seconds.
METRICS_INTERVAL: Final = 0.5
METRICS_DEADLINE: Final = 0.2
#: The collector run that stalls past its deadline.
STALLED_RUN: Final = 3

_TRANSIENT: Final = (
    "SMTP 451 4.7.1 greylisted, try again later",
    "SMTP 421 4.3.2 too many connections",
    "SMTP 450 4.2.1 mailbox busy",
    "connection reset by mx.example.net",
)
_RECIPIENTS: Final = (
    "ada",
    "grace",
    "linus",
    "barbara",
    "ken",
    "margaret",
    "dennis",
    "radia",
    "edsger",
    "frances",
)
_ALWAYS_FAILS: Final = 1
_HARD_BOUNCE: Final = 4
_DIGEST: Final = 10


class TransientError(Exception):
    """A temporary delivery failure (an SMTP 4xx reply): worth retrying."""


@dataclass
class Mail:
    """An email envelope's payload."""

    to: str
    subject: str
    #: Attempts that fail transiently before delivery; -1: every attempt fails.
    failures: int = 0
    error: str = _TRANSIENT[0]
    #: Raise DoNotRetry (a hard bounce) instead of delivering.
    bounce: bool = False
    attempts: int = 0


@dataclass
class Collector:
    """The metrics envelope's payload: its run count and its last sample."""

    runs: int = 0
    sample: str = ""


class Workload:
    """The envelopes of one run and the jobs they invoke; the collector samples
    ``queue`` and the bounce hook reports to ``out``."""

    def __init__(self, options: DemoOptions, queue: envq.Queue, out: Output) -> None:
        self.options = options
        self.q = queue
        self.out = out
        d = options.duration
        #: Email backoff shrinks with short runs so the story fits the duration.
        self.retry = envq.Retry(attempts=4, base=round(0.2 * min(1.0, d / 6.0), 3), jitter=False)
        #: Labels of the delivered emails, in delivery order.
        self.delivered: list[str] = []

    def _rng(self, *parts: object) -> random.Random:
        return random.Random(":".join(str(p) for p in (self.options.seed, *parts)))

    # ------------------------------------------------------------------------------
    # The jobs and hooks
    # ------------------------------------------------------------------------------

    async def send_email(self, env: Envelope) -> None:
        """Deliver one email: a short await, then the seeded plan's verdict."""
        mail: Mail = env.payload
        mail.attempts += 1
        await asyncio.sleep(self._rng("email", env.id, mail.attempts).uniform(0.04, 0.12))
        if mail.bounce:
            raise envq.DoNotRetry(f"SMTP 550 5.1.1 <{mail.to}@nowhere.invalid>: no such user")
        if mail.failures < 0 or mail.attempts <= mail.failures:
            raise TransientError(mail.error)

    async def on_delivered(self, env: Envelope) -> None:
        """``on_success`` of the emails: remember the delivery."""
        self.delivered.append(label(env))

    async def on_bounce(self, env: Envelope, exc: BaseException, attempt: int) -> envq.Decision:
        """``on_failure`` of the bouncing email: called to report a DoNotRetry."""
        self.out.line(f"{label(env):<13} on_failure hook: bounce recorded (attempt {attempt})")
        return envq.drop()

    async def collect(self, env: Envelope) -> None:
        """The periodic collector: samples the queue; one run stalls past its deadline."""
        col: Collector = env.payload
        col.runs += 1
        rng = self._rng("metrics", col.runs)
        await asyncio.sleep(0.35 if col.runs == STALLED_RUN else rng.uniform(0.02, 0.06))
        stats = self.q.statistics()
        col.sample = (
            f"load={rng.uniform(0.1, 0.9):.2f} used={stats.capacity_used}/{CAPACITY} "
            f"in_flight={stats.in_flight}"
        )

    async def render_report(self, env: Envelope) -> None:
        """The report job: its backend is gone, so it retires the whole type."""
        await asyncio.sleep(0.1)
        raise envq.StopType("report backend retired (HTTP 410 Gone)")

    # ------------------------------------------------------------------------------
    # The envelopes
    # ------------------------------------------------------------------------------

    def emails(self) -> list[Envelope]:
        """The email envelopes, ids 1..10, with the seeded failure plan."""
        plan = random.Random(self.options.seed)
        mails: list[Mail] = []
        for n, who in enumerate(_RECIPIENTS, start=1):
            mail = Mail(
                to=who,
                subject="daily digest" if n == _DIGEST else f"order #{1000 + n} shipped",
                failures=plan.choice((0, 0, 0, 1, 1, 2)),
                error=plan.choice(_TRANSIENT),
            )
            if n == _ALWAYS_FAILS:
                mail.failures, mail.error = -1, "SMTP 452 4.2.2 mailbox full"
            elif n == _HARD_BOUNCE:
                mail.failures, mail.bounce = 0, True
            elif n == _DIGEST:
                mail.failures = 0
            mails.append(mail)
        if not any(m.failures > 0 for m in mails):
            mails[1].failures = 1  # every seed shows at least one retry that works out
        return [
            Envelope(
                invoke=self.send_email,
                id=n,
                type="email",
                deadline=3,
                # A bounce is decided by on_bounce; retry and on_failure never go together.
                retry=None if mail.bounce else self.retry,
                on_success=self.on_delivered,
                on_failure=self.on_bounce if mail.bounce else None,
                delay=0.7 * self.options.duration if n == _DIGEST else 0,
                payload=mail,
            )
            for n, mail in enumerate(mails, start=1)
        ]

    def collector(self) -> Envelope:
        """``metrics/queue``: the periodic collector."""
        return Envelope(
            invoke=self.collect,
            id="queue",
            type="metrics",
            interval=METRICS_INTERVAL,
            deadline=METRICS_DEADLINE,
            payload=Collector(),
        )

    def reports(self) -> list[Envelope]:
        """``report/21`` and ``report/22``, due at 20 % and 50 % of the duration (ids
        apart from the emails': an ``id`` is the dedup key)."""
        d = self.options.duration
        return [
            Envelope(invoke=self.render_report, id=n, type="report", deadline=2, delay=delay)
            for n, delay in ((21, round(0.2 * d, 2)), (22, round(0.5 * d, 2)))
        ]

    def late_report(self) -> Envelope:
        """``report/23``, sent once its type is blacklisted."""
        return Envelope(invoke=self.render_report, id=23, type="report")

    def ping(self) -> Envelope:
        """``email/11``, sent while the queue is stopped."""
        return Envelope(invoke=self.send_email, id=11, type="email", payload=Mail("ops", "ping"))
