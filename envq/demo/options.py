"""The demo's knobs: :class:`DemoOptions`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoOptions"]


@dataclass(frozen=True)
class DemoOptions:
    """The demo's knobs (the command line's ``--duration``, ``--seed``, ``--workers``,
    ``--metrics-port`` and ``--live``/``--plain``)."""

    #: Real seconds of workload, from start to the final stop.
    duration: float = 6.0
    #: Seeds the failure plan and the collector's samples.
    seed: int = 7
    #: The queue's worker count.
    workers: int = 4
    #: Serve Prometheus metrics on 127.0.0.1:PORT while the demo runs (0: a free port).
    metrics_port: int | None = None
    #: The live view: True forces it, False forces plain text, None (the default) uses
    #: it when the output is a terminal and rich is installed.
    live: bool | None = None

    def __post_init__(self) -> None:
        if not self.duration >= 1.0:
            raise ValueError(f"duration must be at least 1 second, got {self.duration!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0..65535, got {self.metrics_port!r}")
