"""Clock helpers. Timestamps on the wire are integer nanoseconds since the epoch (UTC)."""

from __future__ import annotations

import datetime as dt
import os
import time

# TEST SEAM: when set, now_ns() adds the integer nanoseconds written in this file, re-read at each call,
# so a fault test can step the agent's wall clock without changing the machine's clock.
CLOCK_OFFSET_ENV = "GPUAGENT_CLOCK_OFFSET_FILE"
_OFFSET_FILE = os.environ.get(CLOCK_OFFSET_ENV) or None


def _offset_ns() -> int:
    try:
        with open(_OFFSET_FILE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def now_ns() -> int:
    """Wall-clock now in ns since the epoch: the one clock the agent stamps samples with."""
    if _OFFSET_FILE is None:
        return time.time_ns()
    return time.time_ns() + _offset_ns()


def utc_now() -> dt.datetime:
    """Naive UTC datetime, the form DuckDB's TIMESTAMP columns store and return."""
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)
