"""Resolution where it pays: per-interval summaries of the series no rule reads sample by sample, and a
bounded ring of their 1 s samples that the collector can ask for (docs/RESOLUTION.md).

``Summaries`` keeps one open interval per series (count, sum, min, max); an interval is closed when a sample
of a later one arrives or when the wall clock passes its end, and then travels in the next batch. Intervals
are aligned to the wall clock and divide a minute, so the collector merges them exactly into its 1-minute
rollup. ``RawRing`` holds the samples in blocks (one per batch cut) of compact arrays and drops whole blocks
older than ``keep_s``. Neither is thread-safe: the batcher calls them under its lock.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

Key = tuple  # (metric, gpu, labels): the batcher's series key


class Summaries:
    """Open and closed per-interval summaries of every summarised series."""

    def __init__(self, interval_s: float):
        self.interval_ns = int(round(interval_s * 1e9))
        self._open: dict[Key, list] = {}            # key -> [start_ns, n, sum, min, max]
        self.closed: list[tuple[Key, int, int, float, float, float]] = []

    def add(self, key: Key, ts_ns: int, v: float) -> None:
        start = ts_ns - ts_ns % self.interval_ns
        acc = self._open.get(key)
        if acc is not None and acc[0] != start:
            self.closed.append((key, *acc))
            acc = None
        if acc is None:
            if math.isfinite(v):
                self._open[key] = [start, 1, v, v, v]
            else:       # a NaN/inf sample is counted in no summary (as the rollup's count(value) skips NULL)
                self._open[key] = [start, 0, 0.0, math.inf, -math.inf]
            return
        if math.isfinite(v):
            acc[1] += 1
            acc[2] += v
            if v < acc[3]:
                acc[3] = v
            if v > acc[4]:
                acc[4] = v

    def close_ended(self, now_ns: int) -> None:
        """Close every interval whose end has passed (wall clock)."""
        for key in [k for k, acc in self._open.items() if acc[0] + self.interval_ns <= now_ns]:
            self.closed.append((key, *self._open.pop(key)))

    def close_all(self) -> None:
        """Close the open intervals too, partial ones included (the agent is stopping)."""
        self.closed.extend((key, *acc) for key, acc in self._open.items())
        self._open.clear()

    def take(self) -> list[tuple[Key, int, int, float, float, float]]:
        out = [c for c in self.closed if c[2] > 0]      # an interval of only NaN samples says nothing
        self.closed = []
        return out

    @property
    def pending(self) -> int:
        return len(self.closed)


@dataclass
class _Block:
    lo_ns: int
    hi_ns: int
    ts: array = field(default_factory=lambda: array("q"))
    sid: array = field(default_factory=lambda: array("I"))
    val: array = field(default_factory=lambda: array("d"))


class RawRing:
    """The last ``keep_s`` seconds of summarised series' samples, for raw-window requests."""

    def __init__(self, keep_s: float):
        self.keep_ns = int(keep_s * 1e9)
        self.keys: list[Key] = []                  # ring-wide series id -> key
        self._ids: dict[Key, int] = {}
        self._blocks: deque[_Block] = deque()
        self._cur = _Block(lo_ns=2 ** 63 - 1, hi_ns=0)

    def add(self, key: Key, ts_ns: int, v: float) -> None:
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self.keys)
            self.keys.append(key)
        b = self._cur
        b.ts.append(ts_ns)
        b.sid.append(sid)
        b.val.append(v)
        if ts_ns < b.lo_ns:
            b.lo_ns = ts_ns
        if ts_ns > b.hi_ns:
            b.hi_ns = ts_ns

    def seal(self, now_ns: int) -> None:
        """End the current block (at a batch cut) and drop the blocks wholly older than keep_s."""
        if len(self._cur.ts):
            self._blocks.append(self._cur)
            self._cur = _Block(lo_ns=2 ** 63 - 1, hi_ns=0)
        while self._blocks and self._blocks[0].hi_ns < now_ns - self.keep_ns:
            self._blocks.popleft()

    @property
    def held_since_ns(self) -> int:
        """The oldest sample still held (0 when none)."""
        return self._blocks[0].lo_ns if self._blocks else 0

    def snapshot(self) -> list[_Block]:
        """The blocks as they are now (a copy of the open one), to read without the batcher's lock: sealed
        blocks never change."""
        cur = _Block(self._cur.lo_ns, self._cur.hi_ns, array("q", self._cur.ts), array("I", self._cur.sid),
                     array("d", self._cur.val))
        return [*self._blocks, cur]

    @staticmethod
    def window_of(blocks: list[_Block], since_ns: int, until_ns: int) -> Iterator[tuple[int, int, float]]:
        """(ts_ns, ring series id, value) of every sample of ``blocks`` in [since_ns, until_ns]."""
        for b in blocks:
            if b.hi_ns < since_ns or b.lo_ns > until_ns:
                continue
            for t, s, v in zip(b.ts, b.sid, b.val):
                if since_ns <= t <= until_ns:
                    yield t, s, v
