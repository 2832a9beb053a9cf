"""Which series the collector's rules read at full resolution, and which only as per-minute summaries.

The agent sends every sample of a *raw* series, and per-interval summaries (count, sum, min, max) of every
other series, keeping their 1 s samples for a bounded time so the collector can ask for a window of them
(docs/RESOLUTION.md). This module is the one list both sides use; each entry names the rule that needs it.
A rule that starts reading a new series per sample must add it here, or it would see only summaries.
"""

from __future__ import annotations

from functools import lru_cache

from gpuagent.common import hardware_faults

# Rule (its SQL step) -> the metrics it reads from the raw `samples` table, sample by sample.
RAW_FOR_RULES: dict[str, tuple[str, ...]] = {
    # per job tick: progress, neighbour CPU, RTT and bytes, lined up with the host's steal and pressure
    "41_noisy_neighbor_passive": (
        "job_progress_percent", "job_neighbour_cpu_percent", "job_tcp_srtt_ms",
        "job_tcp_busy_send_rate_bytes_per_s", "job_tcp_bytes_per_s",
        "job_neighbour_process_cpu_percent", "job_neighbour_process_io_bytes_per_s",
        "job_neighbour_process_net_bytes_per_s",
        "cpu_steal_percent", "psi_cpu_some_avg10_percent", "psi_io_some_avg10_percent",
        "psi_memory_some_avg10_percent"),
    # 70_hardware_fault: counters summed over consecutive samples and states by their latest value:
    # common/hardware_faults.toml's metrics, filled in by raw_metrics(). Its load metric (gpu_util_percent) is
    # read per minute from samples_1m, so it is summarised.
    "70_hardware_fault": (),
}

# Every series of the job sampler: they exist only while a job runs, and the passive rules line its ticks up.
RAW_PREFIXES: tuple[str, ...] = ("job_",)


@lru_cache(maxsize=1)
def raw_metrics() -> frozenset[str]:
    """Every metric some rule reads sample by sample."""
    return frozenset({m for ms in RAW_FOR_RULES.values() for m in ms} | _hardware_metrics())


RAW, ON_CHANGE, SUMMARY = "raw", "on_change", "summary"


@lru_cache(maxsize=1)
def _hardware_metrics() -> frozenset[str]:
    return frozenset(x for r in hardware_faults.rule_rows() for x in (r["metric"], r["max_metric"], r["also_metric"])
                     if x)


def needs_raw(metric: str) -> bool:
    """True when the collector's rules read this metric per sample (send its samples), False for summaries."""
    return metric in raw_metrics() or metric.startswith(RAW_PREFIXES)


def resolution_of(metric: str) -> str:
    """How the agent sends a series of ``metric`` when it summarises (summary_interval_s > 0):

    RAW: every sample (41_noisy_neighbor_passive lines up each tick);
    ON_CHANGE: a sample when its value differs from the last one sent, and at least once per summary
      interval. 70_hardware_fault's counters and states: a counter's rise is the sum of its consecutive
      differences, a state rule reads the latest value, and both come out the same from the changes alone;
    SUMMARY: per-interval count, sum, min and max, merged into samples_1m."""
    if metric in _hardware_metrics() and metric not in RAW_FOR_RULES["41_noisy_neighbor_passive"]:
        return ON_CHANGE
    return RAW if needs_raw(metric) else SUMMARY


def valid_summary_interval(seconds: float) -> bool:
    """0 (every sample raw) or a whole number of seconds that divides a minute, so summaries merge exactly
    into the collector's 1-minute rollup."""
    if seconds == 0:
        return True
    return float(seconds).is_integer() and 1 <= seconds <= 60 and 60 % int(seconds) == 0
