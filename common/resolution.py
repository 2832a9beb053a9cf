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
    # 70_hardware_fault: counters summed over consecutive samples, states by their latest value, the load
    # metric's latest value: common/hardware_faults.toml's metrics, filled in by raw_metrics()
    "70_hardware_fault": (),
}

# Every series of the job sampler: they exist only while a job runs, and the passive rules line its ticks up.
RAW_PREFIXES: tuple[str, ...] = ("job_",)


@lru_cache(maxsize=1)
def raw_metrics() -> frozenset[str]:
    """Every metric some rule reads sample by sample."""
    names = {m for ms in RAW_FOR_RULES.values() for m in ms}
    for r in hardware_faults.rule_rows():
        names.update(x for x in (r["metric"], r["max_metric"], r["load_metric"], r["also_metric"]) if x)
    return frozenset(names)


def needs_raw(metric: str) -> bool:
    """True when the collector's rules read this metric per sample (send it raw), False for summaries."""
    return metric in raw_metrics() or metric.startswith(RAW_PREFIXES)


def rules_reading(metric: str) -> list[str]:
    """The rules that read ``metric`` raw (for docs and `gpuagent status`)."""
    out = [rule for rule, ms in RAW_FOR_RULES.items() if metric in ms]
    if metric.startswith(RAW_PREFIXES) and "41_noisy_neighbor_passive" not in out:
        out.append("41_noisy_neighbor_passive")
    hw = {x for r in hardware_faults.rule_rows()
          for x in (r["metric"], r["max_metric"], r["load_metric"], r["also_metric"]) if x}
    if metric in hw:
        out.append("70_hardware_fault")
    return out


def valid_summary_interval(seconds: float) -> bool:
    """0 (every sample raw) or a whole number of seconds that divides a minute, so summaries merge exactly
    into the collector's 1-minute rollup."""
    if seconds == 0:
        return True
    return float(seconds).is_integer() and 1 <= seconds <= 60 and 60 % int(seconds) == 0
