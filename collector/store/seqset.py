"""Which seqs of a node the collector holds (``SeqSet``): the writer's cache of ``ingest_log`` for dedupe.

An ack with ``duplicate=true`` must name a batch the collector stores, so the writer (store/writer.py)
asks this exact set, never a high-water guess, before it stores a batch.
"""

from __future__ import annotations

import bisect


class SeqSet:
    """Exactly which seqs of one node are stored, as sorted disjoint runs ``[lo, hi]``.

    A cache of ``ingest_log``, never a guess: a seq is "stored" only when its row is there, so an ack with
    ``duplicate=true`` always names a batch the collector holds. Agents send their spool oldest first, so a
    node's seqs form one run (or a few, around a restart); membership and insertion are a bisect."""

    __slots__ = ("_lo", "_hi")

    def __init__(self, runs: list[tuple[int, int]] | None = None):
        runs = sorted(runs or [])
        self._lo = [a for a, _ in runs]
        self._hi = [b for _, b in runs]

    @property
    def highest(self) -> int:
        """The highest stored seq, 0 when none."""
        return self._hi[-1] if self._hi else 0

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._lo, self._hi))

    def __contains__(self, seq: int) -> bool:
        i = bisect.bisect_right(self._lo, seq) - 1
        return i >= 0 and seq <= self._hi[i]

    def add(self, seq: int) -> None:
        i = bisect.bisect_right(self._lo, seq) - 1
        if i >= 0 and seq <= self._hi[i]:
            return
        joins_left = i >= 0 and self._hi[i] == seq - 1
        joins_right = i + 1 < len(self._lo) and self._lo[i + 1] == seq + 1
        if joins_left and joins_right:
            self._hi[i] = self._hi[i + 1]
            del self._lo[i + 1], self._hi[i + 1]
        elif joins_left:
            self._hi[i] = seq
        elif joins_right:
            self._lo[i + 1] = seq
        else:
            self._lo.insert(i + 1, seq)
            self._hi.insert(i + 1, seq)
