"""The contract between data sources (samplers, job discovery, probes) and the batcher.

Samplers never talk to the network: they push what they observed into a ``SampleSink``. The batcher
implements the sink and turns its content into columnar ``Batch`` messages. ``ListSink`` is a plain
in-memory sink for tests and for `gpuagent status`-style one-shot reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from gpuagent.common.timeutil import now_ns


@dataclass(frozen=True)
class SampleRecord:
    ts_ns: int
    metric: str          # unit in the name, e.g. "cpu_steal_percent"
    value: float
    gpu: int = -1        # -1: host-level
    labels: tuple[tuple[str, str], ...] = ()   # sorted (key, value) pairs


@dataclass(frozen=True)
class EventRecord:
    ts_ns: int
    kind: str            # "xid", "throttle_change", "agent_start", "job_start", "job_end", ...
    message: str
    gpu: int = -1
    value: float = 0.0
    attrs: Mapping[str, str] = field(default_factory=dict)


class SampleSink(Protocol):
    """Where samplers put what they measured. Implemented by the batcher and by ListSink."""

    def add(self, metric: str, value: float, gpu: int = -1,
            labels: Mapping[str, str] | None = None, ts_ns: int | None = None) -> None: ...

    def event(self, kind: str, message: str, gpu: int = -1, value: float = 0.0,
              attrs: Mapping[str, str] | None = None, ts_ns: int | None = None) -> None: ...

    def job_sample(self, **fields: Any) -> None:
        """Fields of the JobSample proto message (ts_ns, job_id, pid, rank, gpu_util_percent, ...)."""

    def job_step(self, **fields: Any) -> None:
        """Fields of the JobStep proto message."""

    def probe_result(self, result: Mapping[str, Any]) -> None:
        """A probe's JSON result: {probe, status, reason, params, metrics, started_at, ended_at, env, gpu?}."""


class Sampler(Protocol):
    """One data source. ``sample`` is called once per sampling tick and must not block for long."""

    name: str

    def sample(self, ts_ns: int, sink: SampleSink) -> None: ...

    def close(self) -> None: ...


def sorted_labels(labels: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if not labels:
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in labels.items()))


class ListSink:
    """Keeps everything in lists. Useful in tests and for one-shot reads."""

    def __init__(self) -> None:
        self.samples: list[SampleRecord] = []
        self.events: list[EventRecord] = []
        self.job_samples: list[dict[str, Any]] = []
        self.job_steps: list[dict[str, Any]] = []
        self.probe_results: list[dict[str, Any]] = []

    def add(self, metric, value, gpu=-1, labels=None, ts_ns=None):
        self.samples.append(SampleRecord(ts_ns if ts_ns is not None else now_ns(), metric,
                                         float(value), gpu, sorted_labels(labels)))

    def event(self, kind, message, gpu=-1, value=0.0, attrs=None, ts_ns=None):
        self.events.append(EventRecord(ts_ns if ts_ns is not None else now_ns(), kind, message,
                                       gpu, float(value), dict(attrs or {})))

    def job_sample(self, **fields):
        self.job_samples.append(fields)

    def job_step(self, **fields):
        self.job_steps.append(fields)

    def probe_result(self, result):
        self.probe_results.append(dict(result))

    def metrics(self) -> dict[tuple[str, int, tuple[tuple[str, str], ...]], float]:
        """Latest value per (metric, gpu, labels)."""
        return {(s.metric, s.gpu, s.labels): s.value for s in self.samples}
