"""Log lines that a client can provoke, kept to one line per cause and rate-limited.

A hostile or broken client must not be able to fill the collector's log (or journald's quota) with
tracebacks: each cause is logged once, then at most once per interval with the count of repeats.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from gpuagent.common.errors import first_line


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self._log = logger
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, cause: str, message: str) -> bool:
        """Log ``message`` for ``cause`` unless it was logged within the interval; True when logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(cause)
            if last is not None and now - last < self._every_s:
                self._suppressed[cause] = self._suppressed.get(cause, 0) + 1
                return False
            repeats = self._suppressed.pop(cause, 0)
            self._last[cause] = now
        suffix = f" ({repeats} more like it in the last {self._every_s:g} s)" if repeats else ""
        self._log.warning("%s%s", message, suffix)
        return True


class OneLineServicerErrors(logging.Filter):
    """grpc logs an exception escaping a servicer (or a request it cannot decode) with a traceback; make it
    one rate-limited line per (method, exception type). Installed on grpc's own logger by the server."""

    def __init__(self, limiter: RateLimitedLog):
        super().__init__()
        self._limiter = limiter

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if not msg.startswith("Unexpected [") and not msg.startswith("Exception "):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        detail = f": {first_line(exc)}" if exc is not None and str(exc).strip() else ""
        self._limiter.warning(msg, f"{msg}{detail}")
        return False
