"""The bound on samples validated but not yet committed, shared by every stream.

Each prepared batch holds its Arrow tables in memory until the writer commits it; without a bound, many
fast agents (or one agent replaying a large spool) could queue more than the collector's memory. A stream
whose batch does not fit waits, which stops it reading, so gRPC flow control pushes back on the agent.
Waiters are admitted in arrival order, so a large batch is not starved by a stream of small ones. A batch
larger than the whole bound still goes through, alone. All methods run on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections


class InflightBudget:
    def __init__(self, max_samples: int):
        self.max_samples = max_samples
        self.inflight = 0
        self._waiters: collections.deque = collections.deque()   # (n_samples, future), first come first served

    def _fits(self, n: int) -> bool:
        return self.inflight == 0 or self.inflight + n <= self.max_samples

    def _grant(self) -> None:
        """Admit waiting batches in arrival order while they fit (wakes only those, not every stream)."""
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self.inflight += n
                fut.set_result(None)

    async def reserve(self, n: int) -> None:
        """Wait until ``n`` more samples fit the bound, then count them in."""
        if not self._waiters and self._fits(n):
            self.inflight += n
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.inflight -= n       # granted just as the stream went away: give it back
                self._grant()
            raise

    def release(self, n: int) -> None:
        """``n`` samples were committed (or refused by the writer): let waiting batches in."""
        self.inflight -= n
        self._grant()
