"""The gpuagent_* families of one tick's snapshot, as prometheus_client metrics: the GPU values dcgm-exporter
has no name for, the host, probes, training jobs, the agent's own counters and the hardware-health verdict.
Names, units and sources: docs/EXPORTER.md.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpuagent.agent.config import ExporterConfig
from gpuagent.agent.snapshot import StatusSnapshot
from gpuagent.agent.surface.dcgm_families import as_client_metric, job_info_family, pod_info_family

# gpuagent_host_* gauges: (name, HostStatus field, scale, help). Shares are ratios (0-1), as Prometheus
# prefers; the tick's shares, not node_exporter's cumulative CPU seconds (docs/EXPORTER.md says why).
HOST = [
    ("gpuagent_host_cpu_busy_ratio", "cpu_busy_percent", 0.01, "CPU busy share over the last tick (all CPUs)."),
    ("gpuagent_host_cpu_user_ratio", "cpu_user_percent", 0.01, "CPU user+nice share over the last tick."),
    ("gpuagent_host_cpu_system_ratio", "cpu_system_percent", 0.01, "CPU system+irq+softirq share over the last tick."),
    ("gpuagent_host_cpu_iowait_ratio", "cpu_iowait_percent", 0.01, "CPU iowait share over the last tick."),
    ("gpuagent_host_cpu_steal_ratio", "cpu_steal_percent", 0.01, "CPU steal share (hypervisor) over the last tick."),
    ("gpuagent_host_cpu_idle_ratio", "cpu_idle_percent", 0.01, "CPU idle share over the last tick."),
    ("gpuagent_host_load1", "load1", 1.0, "1-minute load average."),
    ("gpuagent_host_load5", "load5", 1.0, "5-minute load average."),
    ("gpuagent_host_load15", "load15", 1.0, "15-minute load average."),
    ("gpuagent_host_memory_total_bytes", "mem_total_bytes", 1.0, "MemTotal."),
    ("gpuagent_host_memory_available_bytes", "mem_available_bytes", 1.0, "MemAvailable."),
    ("gpuagent_host_memory_used_bytes", "mem_used_bytes", 1.0, "MemTotal - MemAvailable."),
    ("gpuagent_host_swap_used_bytes", "swap_used_bytes", 1.0, "SwapTotal - SwapFree."),
    ("gpuagent_host_context_switches_per_second", "context_switches_per_s", 1.0, "Context switches per second."),
    ("gpuagent_host_interrupts_per_second", "interrupts_per_s", 1.0, "Interrupts per second."),
]
PSI = [  # (resource, kind, HostStatus field)
    ("cpu", "some", "psi_cpu_some_avg10_percent"), ("io", "some", "psi_io_some_avg10_percent"),
    ("io", "full", "psi_io_full_avg10_percent"), ("memory", "some", "psi_memory_some_avg10_percent"),
    ("memory", "full", "psi_memory_full_avg10_percent"),
]
DISK = [  # (name, batcher metric, scale, help)
    ("gpuagent_host_disk_read_bytes_per_second", "disk_read_bytes_per_s", 1.0, "Bytes read per second."),
    ("gpuagent_host_disk_written_bytes_per_second", "disk_write_bytes_per_s", 1.0, "Bytes written per second."),
    ("gpuagent_host_disk_reads_per_second", "disk_read_iops", 1.0, "Reads completed per second."),
    ("gpuagent_host_disk_writes_per_second", "disk_write_iops", 1.0, "Writes completed per second."),
    ("gpuagent_host_disk_read_latency_seconds", "disk_read_latency_ms", 1e-3, "Mean time per read."),
    ("gpuagent_host_disk_write_latency_seconds", "disk_write_latency_ms", 1e-3, "Mean time per write."),
    ("gpuagent_host_disk_busy_ratio", "disk_busy_percent", 0.01, "Share of time the disk was busy."),
]
NIC = [
    ("gpuagent_host_network_receive_bytes_per_second", "net_rx_bytes_per_s", "Bytes received per second."),
    ("gpuagent_host_network_transmit_bytes_per_second", "net_tx_bytes_per_s", "Bytes transmitted per second."),
    ("gpuagent_host_network_receive_errors_per_second", "net_rx_errors_per_s", "Receive errors per second."),
    ("gpuagent_host_network_transmit_errors_per_second", "net_tx_errors_per_s", "Transmit errors per second."),
    ("gpuagent_host_network_receive_drops_per_second", "net_rx_drops_per_s", "Receive drops per second."),
]

def gpuagent_families(snap: StatusSnapshot, settings: ExporterConfig) -> Iterator[Metric]:
    """Every gpuagent_* family of the tick, in the order a scrape lists them."""
    yield from _gpu_families(snap, settings)
    yield from _host_families(snap)
    yield from _probe_families(snap)
    yield from _job_families(snap)
    yield from _agent_families(snap)
    yield from _health_families(snap)


def _gpu_families(snap: StatusSnapshot, settings: ExporterConfig) -> Iterator[Metric]:
    yield as_client_metric(job_info_family(snap, settings))
    yield as_client_metric(pod_info_family(snap, settings))
    for name, field, doc in (
            ("gpuagent_gpu_nvlink_data_transmit_bytes_per_second", "nvlink_tx_bytes_per_s",
             "NVLink payload transmitted per second, without protocol headers (all links)."),
            ("gpuagent_gpu_nvlink_data_receive_bytes_per_second", "nvlink_rx_bytes_per_s",
             "NVLink payload received per second, without protocol headers (all links).")):
        fam = GaugeMetricFamily(name, doc, labels=["gpu", "UUID"])
        for g in snap.gpus:
            v = getattr(g, field)
            if v is not None:
                fam.add_metric([str(g.index), g.uuid or ""], v)
        yield fam
    ecc = CounterMetricFamily("gpuagent_gpu_ecc_errors", "Volatile ECC errors since the driver was loaded.",
                              labels=["gpu", "UUID", "type"])
    for g in snap.gpus:
        for typ, v in (("corrected", g.ecc_corrected_total), ("uncorrected", g.ecc_uncorrected_total)):
            if v is not None:
                ecc.add_metric([str(g.index), g.uuid or "", typ], v)
    yield ecc
    thr = GaugeMetricFamily("gpuagent_gpu_throttle_reason_active", "1 for each active clock-event reason.",
                            labels=["gpu", "UUID", "reason"])
    for g in snap.gpus:
        for r in g.throttle_reasons:
            thr.add_metric([str(g.index), g.uuid or "", r], 1.0)
    yield thr
    lim = GaugeMetricFamily("gpuagent_gpu_power_limit_watts", "Enforced power limit.", labels=["gpu", "UUID"])
    for g in snap.gpus:
        if g.power_limit_watts is not None:
            lim.add_metric([str(g.index), g.uuid or ""], g.power_limit_watts)
    yield lim


def _host_families(snap: StatusSnapshot) -> Iterator[Metric]:
    h = snap.host
    for name, field, scale, doc in HOST:
        v = getattr(h, field)
        if v is not None:
            yield GaugeMetricFamily(name, doc, value=float(v) * scale)
    psi = GaugeMetricFamily("gpuagent_host_pressure_avg10_ratio",
                            "PSI avg10: share of the last 10 s some/all tasks stalled on the resource.",
                            labels=["resource", "kind"])
    for res, kind, field in PSI:
        v = getattr(h, field)
        if v is not None:
            psi.add_metric([res, kind], v / 100.0)
    yield psi
    for name, metric, scale, doc in DISK:
        fam = GaugeMetricFamily(name, doc, labels=["device"])
        for dev, vals in sorted((h.disks or {}).items()):
            if metric in vals:
                fam.add_metric([dev], vals[metric] * scale)
        yield fam
    for name, metric, doc in NIC:
        fam = GaugeMetricFamily(name, doc, labels=["device"])
        for dev, vals in sorted((h.nics or {}).items()):
            if metric in vals:
                fam.add_metric([dev], vals[metric])
        yield fam


def _probe_families(snap: StatusSnapshot) -> Iterator[Metric]:
    val = GaugeMetricFamily("gpuagent_probe_value", "A probe metric's value in its last run (unit in the "
                            "metric's name, docs/PROBES.md).", labels=["probe", "metric", "gpu"])
    ok = GaugeMetricFamily("gpuagent_probe_last_run_ok", "1 when the probe's last run succeeded.",
                           labels=["probe", "gpu", "status"])
    when = GaugeMetricFamily("gpuagent_probe_last_run_timestamp_seconds", "When the probe's last run ended.",
                             labels=["probe", "gpu"])
    for _key, p in sorted(snap.probes.items()):
        gpu = str(p.gpu) if p.gpu >= 0 else ""
        for metric, v in sorted(p.metrics.items()):
            val.add_metric([p.probe, metric, gpu], v)
        ok.add_metric([p.probe, gpu, p.status], 1.0 if p.status == "ok" else 0.0)
        when.add_metric([p.probe, gpu], p.ended_ns / 1e9)
    yield from (val, ok, when)


def _job_families(snap: StatusSnapshot) -> Iterator[Metric]:
    specs = [("gpuagent_job_steps_per_second", "steps_per_s", "Training steps per second (last window)."),
             ("gpuagent_job_samples_per_second", "samples_per_s", "Samples per second (last window)."),
             ("gpuagent_job_tokens_per_second", "tokens_per_s", "Tokens per second (last window)."),
             ("gpuagent_job_step_time_p50_seconds", "step_time_p50_s", "Median step time (last window)."),
             ("gpuagent_job_data_wait_ratio", "data_wait_fraction", "Share of step time waiting for data.")]
    for name, field, doc in specs:
        fam = GaugeMetricFamily(name, doc, labels=["job_id", "job_name", "rank"])
        for j in snap.jobs:
            v = getattr(j, field)
            if v is None or (field == "data_wait_fraction" and v < 0):
                continue
            rank = ",".join(str(r) for r in j.ranks) if j.ranks else ("" if j.rank is None else str(j.rank))
            fam.add_metric([j.job_id, j.job_name or "", rank], v)
        yield fam


def _health_families(snap: StatusSnapshot) -> Iterator[Metric]:
    """gpuagent_hardware_fault: 1 for each fault the node's health check holds this tick (docs/HEALTH.md);
    two rules finding the same (component, severity, subject, gpu) are one series. Per-link NVLink and
    per-reason clock-event totals, which the DCGM names sum or leave out, under gpuagent_* names."""
    fault = GaugeMetricFamily("gpuagent_hardware_fault", "1 while a hardware fault holds (common/hardware_faults.toml "
                              "names the rule, its action and source).",
                              labels=["component", "severity", "subject", "gpu"])
    h = snap.health
    seen = set()
    for f in (h.faults if h is not None else []):
        key = (f.component, f.severity, f.subject, str(f.gpu) if f.gpu >= 0 else "")
        if key not in seen:
            seen.add(key)
            fault.add_metric(list(key), 1.0)
    yield fault
    if h is not None:
        yield GaugeMetricFamily("gpuagent_hardware_health_timestamp_seconds",
                                "When the node's hardware health was last judged.", value=h.checked_ns / 1e9)
    nvl = CounterMetricFamily("gpuagent_gpu_nvlink_errors", "NVLink error counters per link (NVML).",
                              labels=["gpu", "UUID", "link", "counter"])
    up = GaugeMetricFamily("gpuagent_gpu_nvlink_link_up", "1 while the NVLink is up, 0 when down (links that exist).",
                           labels=["gpu", "UUID", "link"])
    clk = CounterMetricFamily("gpuagent_gpu_clock_event_duration_seconds",
                              "Time the clocks were held down, per clock-event reason (NVML).",
                              labels=["gpu", "UUID", "reason"])
    for g in snap.gpus:
        for link, counters in sorted((g.nvlink_errors or {}).items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
            for counter, v in sorted(counters.items()):
                nvl.add_metric([str(g.index), g.uuid or "", link, counter], v)
        for link, v in sorted((g.nvlink_link_up or {}).items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
            up.add_metric([str(g.index), g.uuid or "", link], v)
        for reason, v in sorted((g.clock_event_seconds or {}).items()):
            clk.add_metric([str(g.index), g.uuid or "", reason], v)
    yield from (nvl, up, clk)


def _agent_families(snap: StatusSnapshot) -> Iterator[Metric]:
    sp, link, c = snap.spool, snap.collector, snap.counters
    info = GaugeMetricFamily("gpuagent_agent_info", "The agent's version (value 1).",
                             labels=["version", "Hostname", "node_id"])
    info.add_metric([snap.agent_version, snap.node.hostname, snap.node.node_id], 1.0)
    yield info
    gauges = [
        ("gpuagent_agent_start_time_seconds", snap.started_ns / 1e9, "When the agent started."),
        ("gpuagent_agent_last_tick_timestamp_seconds", snap.updated_ns / 1e9,
         "When the tick these values come from ended."),
        ("gpuagent_agent_interval_seconds", snap.interval_s, "Sampling interval."),
        ("gpuagent_spool_backlog_bytes", sp.backlog_bytes, "Bytes spooled and not yet acked by the collector."),
        ("gpuagent_spool_backlog_batches", sp.backlog_batches, "Batches spooled and not yet acked."),
        ("gpuagent_spool_max_bytes", sp.max_bytes, "The spool's size limit."),
        ("gpuagent_collector_connected", 1.0 if link.connected else 0.0, "1 while the collector stream is up."),
        ("gpuagent_collector_in_flight_batches", link.in_flight, "Batches sent and not yet acked."),
    ]
    for name, v, doc in gauges:
        yield GaugeMetricFamily(name, doc, value=float(v))
    if link.last_ack_ns:
        yield GaugeMetricFamily("gpuagent_collector_last_ack_age_seconds",
                                "Seconds from the last ack to the tick these values come from.",
                                value=max(0.0, (snap.updated_ns - link.last_ack_ns) / 1e9))
    counters = [
        ("gpuagent_agent_ticks", c.ticks, "Sampling ticks run."),
        ("gpuagent_agent_late_ticks", c.late_ticks, "Ticks that ended after the next was due."),
        ("gpuagent_agent_skipped_ticks", c.skipped_ticks, "Ticks skipped because the loop fell behind."),
        ("gpuagent_agent_batches", c.batches, "Batches cut."),
        ("gpuagent_agent_samples", c.samples, "Samples taken."),
        ("gpuagent_spool_dropped_batches", sp.dropped_batches, "Batches dropped because the spool was full."),
        ("gpuagent_spool_dropped_samples", sp.dropped_samples, "Samples dropped because the spool was full."),
        ("gpuagent_spool_corrupt_files", sp.corrupt_files, "Spool files found damaged and set aside."),
        ("gpuagent_spool_rejected_batches", sp.rejected_batches, "Batches the collector rejected."),
        ("gpuagent_spool_rejected_samples", sp.rejected_samples, "Samples in batches the collector rejected."),
        ("gpuagent_spool_write_errors", sp.write_errors, "Spool writes that failed."),
        ("gpuagent_collector_reconnects", link.reconnects, "Collector stream reconnects."),
        ("gpuagent_collector_acked_batches", link.acked_batches, "Batches the collector acked."),
    ]
    for name, v, doc in counters:
        yield CounterMetricFamily(name, doc, value=float(v))   # exposed as <name>_total
