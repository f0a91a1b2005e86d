"""APScheduler 3 (an optional peer without type information), imported on demand."""

from apscheduler.schedulers.asyncio import AsyncIOScheduler  # type: ignore[import-untyped]
from apscheduler.triggers.interval import IntervalTrigger  # type: ignore[import-untyped]

__all__ = ["AsyncIOScheduler", "IntervalTrigger"]
