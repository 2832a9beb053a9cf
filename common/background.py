"""One background thread with its stop event: what the agent's and the collector's periodic workers share.

Each worker (the probe scheduler, Slurm and kubelet attribution, the job-steps receiver, the fabric client,
the analyzer, actions, maintenance and lake threads) runs one loop on a named daemon thread and leaves it
when told to stop. ``BackgroundThread`` holds that thread and its event, so starting twice, stopping a
worker that never started, stopping from inside the loop, and a loop that outlives the join timeout behave
the same everywhere. The owner's loop waits on ``stopping`` (``stopping.wait(s)`` returns True once stop was
asked for), so a stop is noticed at once rather than at the next interval.
"""

from __future__ import annotations

import threading
from typing import Callable


class BackgroundThread:
    """A named daemon thread running ``target`` once, until ``target`` returns; ``stop`` asks and waits."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self.name = name
        self.stopping = threading.Event()
        self._target = target
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread. A second call, or a call after ``stop``, starts nothing."""
        if self._thread is None and not self.stopping.is_set():
            self._thread = threading.Thread(target=self._target, name=self.name, daemon=True)
            self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None) -> bool:
        """Set the stop event and wait up to ``timeout`` seconds for the loop to end (not when called from
        the loop itself). True when no thread runs any more: it ended, or it never started."""
        self.stopping.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout)
        return not self.alive
