"""What a pool comparison is: its time window and its rows, apart from the queries that fill it.

compare.py computes a :class:`PoolComparison`; compare_format.py and the report format one. Both need the
type, so it lives below them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from gpuagent.collector.views.dialect import DUCKDB, Dialect


@dataclass(frozen=True)
class Window:
    start: float    # epoch seconds
    end: float
    seconds: float
    dialect: Dialect = DUCKDB

    def _ts(self, t: float) -> str:
        return self.dialect.ts(t)

    @property
    def start_sql(self) -> str:
        return self._ts(self.start)

    @property
    def end_sql(self) -> str:
        return self._ts(self.end)

    def iso(self, which: str) -> str:
        t = self.start if which == "start" else self.end
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class PoolComparison:
    window: Window | None
    reference_pool: str | None
    pools: list[dict[str, Any]] = field(default_factory=list)      # one row per pool
    probes: list[dict[str, Any]] = field(default_factory=list)     # pool x headline metric
    jobs: list[dict[str, Any]] = field(default_factory=list)       # pool x job name
    synthetic_nodes: int = 0
    total_nodes: int = 0

    @property
    def pool_names(self) -> list[str]:
        return [p["pool"] for p in self.pools]

    def probe(self, pool: str, probe: str, metric: str) -> dict[str, Any] | None:
        for r in self.probes:
            if r["pool"] == pool and r["probe"] == probe and r["metric"] == metric:
                return r
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["window"] = None if self.window is None else {
            "start": self.window.iso("start"), "end": self.window.iso("end"), "seconds": self.window.seconds}
        return d
