"""Clock helpers. Timestamps on the wire are integer nanoseconds since the epoch (UTC)."""

from __future__ import annotations

import datetime as dt
import time


def now_ns() -> int:
    """Wall-clock now in ns since the epoch: the one clock the agent stamps samples with."""
    return time.time_ns()


def utc_now() -> dt.datetime:
    """Naive UTC datetime, the form DuckDB's TIMESTAMP columns store and return."""
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
