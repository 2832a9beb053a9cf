"""The node-wide probe lock: an flock on one file, so that no two probe runs ever overlap on a node,
whether they come from the agent's scheduler, a second agent, or `gpuagent probe run` by hand.

flock needs no write permission, so a user's manual run and a root agent share a root-owned lock file.
The holder writes "pid=... probe=... since=..." into the file (when it may) so a waiter can say who holds it.
"""

from __future__ import annotations

import fcntl
import os
import time
from datetime import datetime, timezone

LOCK_NAME = "probe.lock"


def default_state_dir() -> str:
    """$GPUAGENT_STATE_DIR, else /var/lib/gpuagent for root, else ~/.local/state/gpuagent."""
    env = os.environ.get("GPUAGENT_STATE_DIR")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/gpuagent"
    return os.path.join(os.path.expanduser("~"), ".local", "state", "gpuagent")


def default_lock_path() -> str:
    return os.path.join(default_state_dir(), LOCK_NAME)


class LockBusy(RuntimeError):
    """Another probe run holds the lock; the message names the holder when known."""


class ProbeLock:
    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_lock_path()
        self._fd = -1

    def holder(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip()
        except OSError:
            return ""

    def acquire(self, wait_s: float = 0.0, what: str = "", poll_s: float = 0.1, cancel=None) -> bool:
        """Try for up to ``wait_s`` seconds; True once held. ``cancel`` (an Event) stops the wait early."""
        if self._fd >= 0:
            raise RuntimeError("ProbeLock is not reentrant")
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            writable = True
        except PermissionError:
            fd = os.open(self.path, os.O_RDONLY)
            writable = False
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                    os.close(fd)
                    return False
                time.sleep(poll_s)
        self._fd = fd
        if writable:
            since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid={os.getpid()} probe={what} since={since}\n".encode(), 0)
        return True

    def release(self) -> None:
        if self._fd >= 0:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def __enter__(self) -> "ProbeLock":
        if not self.acquire():
            raise LockBusy(f"another probe run holds {self.path} ({self.holder() or 'holder unknown'})")
        return self

    def __exit__(self, *exc) -> None:
        self.release()
