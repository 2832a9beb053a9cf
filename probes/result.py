"""The probe result object: what every probe prints as one JSON object and what the agent forwards.

A probe never raises to its caller; it reports ``ok``, ``skipped`` (with a reason), ``failed`` (with a
reason) or, when the runner had to kill it, ``timeout``. Metric names carry their unit (docs/METRICS.md).
Per-GPU probes (pcie, gpu_compute) put one entry per GPU in ``per_gpu``; ``sink_records`` splits such a
result into one record per GPU, which is the shape the wire (ProbeResult.gpu) and DuckDB want.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping

STATUSES = ("ok", "skipped", "failed", "timeout")


def iso_utc(ns: int) -> str:
    """ISO-8601 UTC with microseconds, e.g. 2026-11-29T18:53:47.123456Z."""
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if v is None:
            continue
        f = float(v)
        if math.isfinite(f):
            out[str(k)] = f
    return out


@dataclass
class ProbeResult:
    probe: str
    status: str = "ok"
    reason: str = ""                 # why skipped/failed/timeout; on ok, an honesty note (may be "")
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    started_ns: int = 0
    ended_ns: int = 0
    env: dict[str, Any] = field(default_factory=dict)
    gpu: int = -1                    # -1: node-wide
    per_gpu: list[dict[str, Any]] = field(default_factory=list)  # [{gpu, status, reason, metrics, env}]

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        self.metrics = _clean_metrics(self.metrics)

    @classmethod
    def skipped(cls, probe: str, reason: str, params: Mapping[str, Any] | None = None,
                env: Mapping[str, Any] | None = None) -> "ProbeResult":
        now = time.time_ns()
        return cls(probe, "skipped", reason, dict(params or {}), {}, now, now, dict(env or {}))

    @property
    def duration_s(self) -> float:
        return max(0.0, (self.ended_ns - self.started_ns) / 1e9)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "probe": self.probe, "status": self.status, "reason": self.reason,
            "params": dict(self.params), "metrics": dict(self.metrics),
            "started_at": iso_utc(self.started_ns), "ended_at": iso_utc(self.ended_ns),
            "started_ns": int(self.started_ns), "ended_ns": int(self.ended_ns),
            "env": dict(self.env), "gpu": int(self.gpu),
        }
        if self.per_gpu:
            d["per_gpu"] = [dict(g, metrics=_clean_metrics(g.get("metrics", {}))) for g in self.per_gpu]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProbeResult":
        """Validates the shape a probe subprocess printed; raises ValueError with one sentence."""
        if not isinstance(d, Mapping):
            raise ValueError("a probe result must be a JSON object")
        for key in ("probe", "status"):
            if not isinstance(d.get(key), str):
                raise ValueError(f"probe result lacks the text field {key!r}")
        if d["status"] not in STATUSES:
            raise ValueError(f"probe result has unknown status {d['status']!r}")
        for key in ("params", "metrics", "env"):
            if not isinstance(d.get(key, {}), Mapping):
                raise ValueError(f"probe result field {key!r} must be an object")
        per_gpu = d.get("per_gpu") or []
        if not isinstance(per_gpu, list) or not all(isinstance(g, Mapping) and "gpu" in g for g in per_gpu):
            raise ValueError("probe result field 'per_gpu' must be a list of objects with a 'gpu'")
        return cls(probe=d["probe"], status=d["status"], reason=str(d.get("reason") or ""),
                   params=dict(d.get("params") or {}), metrics=dict(d.get("metrics") or {}),
                   started_ns=int(d.get("started_ns") or 0), ended_ns=int(d.get("ended_ns") or 0),
                   env=dict(d.get("env") or {}), gpu=int(d.get("gpu", -1)),
                   per_gpu=[dict(g) for g in per_gpu])

    def sink_records(self) -> list[dict[str, Any]]:
        """One dict per stored row: per GPU when the probe measured GPUs one by one, else one node-wide.

        Each record has {probe, status, reason, params, metrics, started_at, ended_at, started_ns,
        ended_ns, env, gpu}; a per-GPU record merges the run's env with the GPU's own env.
        """
        base = self.to_dict()
        base.pop("per_gpu", None)
        if not self.per_gpu:
            return [base]
        out = []
        for g in self.per_gpu:
            rec = dict(base)
            rec["gpu"] = int(g["gpu"])
            rec["status"] = g.get("status", self.status)
            rec["reason"] = g.get("reason", self.reason) or ""
            rec["metrics"] = _clean_metrics(g.get("metrics", {}))
            rec["env"] = {**self.env, **dict(g.get("env") or {})}
            out.append(rec)
        return out
