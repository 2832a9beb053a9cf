"""Minimal sd_notify(3) in the standard library, so ``Type=notify`` units need no extra dependency.

Sends ``READY=1``, ``WATCHDOG=1``, ``STATUS=...`` and ``STOPPING=1`` datagrams to ``$NOTIFY_SOCKET``
(a path, or an abstract socket when it starts with ``@``). Without ``$NOTIFY_SOCKET`` every call is a
no-op, so the same code runs under systemd, in a terminal and in tests. The collector reuses it.
"""

from __future__ import annotations

import os
import socket
import threading


class Notifier:
    def __init__(self, env: dict | None = None):
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        self._addr = addr or None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ok_pid = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and ok_pid else 0.0

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    @property
    def watchdog_interval_s(self) -> float:
        """How often to ping: half of WatchdogSec, as sd_watchdog_enabled(3) advises; 0 = no watchdog."""
        return self.watchdog_s / 2

    def notify(self, *lines: str) -> bool:
        if self._addr is None:
            return False
        msg = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(msg, self._addr)
                return True
            except OSError:
                return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *((f"STATUS={status}",) if status else ()))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class WatchdogPinger:
    """Pings WATCHDOG=1 from the main loop at most every ``watchdog_interval_s`` (no own thread: if the
    loop hangs, the pings stop and systemd restarts the service, which is the point)."""

    def __init__(self, notifier: Notifier, clock=None):
        import time
        self._n = notifier
        self._clock = clock or time.monotonic
        self._next = 0.0

    def maybe_ping(self) -> None:
        iv = self._n.watchdog_interval_s
        if iv <= 0:
            return
        now = self._clock()
        if now >= self._next:
            self._n.watchdog()
            self._next = now + iv
