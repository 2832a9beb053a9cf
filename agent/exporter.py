"""The agent's Prometheus ``/metrics`` (``[exporter] listen``): GPU metrics under dcgm-exporter's names,
everything else under ``gpuagent_*``. Names, units and sources: docs/EXPORTER.md.

A scrape renders the latest tick's :class:`StatusSnapshot` and nothing else: the daemon swaps in a new
(never mutated) snapshot after each tick with one reference assignment, so a scrape never calls NVML,
never takes a lock the tick loop holds, and never delays a tick. prometheus_client formats it once per
tick; one daemon thread serves the scrapes in turn.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector

from gpuagent.agent.status import StatusSnapshot

log = logging.getLogger("gpuagent.exporter")

DCGM_LABELS = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "hpc_job"]
MIB = 1024 * 1024

# (dcgm-exporter name, GpuStatus field, scale, kind, help). Kinds as in dcgm-exporter's
# etc/default-counters.csv; units are dcgm-exporter's (MiB, W, mJ, MHz, %), not base units, so its
# dashboards and alert rules read these unchanged.
DCGM_GPU = [
    ("DCGM_FI_DEV_GPU_UTIL", "util_percent", 1.0, "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_util_percent", 1.0, "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "memory_used_bytes", 1.0 / MIB, "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_POWER_USAGE", "power_watts", 1.0, "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_consumed_mj", 1.0, "counter",
     "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_GPU_TEMP", "temperature_celsius", 1.0, "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", 1.0, "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz", 1.0, "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "pcie_replay_count", 1.0, "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_XID_ERRORS", "last_xid", 1.0, "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_s", 1.0, "gauge",
     "The rate of data transmitted over the PCIe bus (in bytes per second)."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "pcie_rx_bytes_per_s", 1.0, "gauge",
     "The rate of data received over the PCIe bus (in bytes per second)."),
    ("DCGM_FI_PROF_NVLINK_TX_BYTES", "nvlink_tx_bytes_per_s", 1.0, "gauge",
     "The rate of data transmitted over NVLink, not including protocol headers (in bytes per second)."),
    ("DCGM_FI_PROF_NVLINK_RX_BYTES", "nvlink_rx_bytes_per_s", 1.0, "gauge",
     "The rate of data received over NVLink, not including protocol headers (in bytes per second)."),
    # DCGM's profiling ratios (0-1), from NVML GPM where the GPU has it (Hopper+); absent otherwise, never
    # filled from the utilization counters. Under MIG the per-instance values stay in gpuagent's own data.
    ("DCGM_FI_PROF_SM_ACTIVE", "sm_active_percent", 0.01, "gauge",
     "Share of SMs with at least one warp resident over the last tick, 0-1 (NVML GPM SM_UTIL)."),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy_percent", 0.01, "gauge",
     "Resident warps against the SMs' maximum over the last tick, 0-1 (NVML GPM SM_OCCUPANCY)."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active_percent", 0.01, "gauge",
     "Share of cycles any tensor pipe was busy over the last tick, 0-1 (NVML GPM ANY_TENSOR_UTIL)."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "dram_active_percent", 0.01, "gauge",
     "Device memory bandwidth used against its peak over the last tick, 0-1 (NVML GPM DRAM_BW_UTIL)."),
]

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


class SnapshotCollector:
    """A prometheus_client collector over the latest tick's snapshot (``update`` swaps it in)."""

    def __init__(self) -> None:
        self._snap: StatusSnapshot | None = None

    @property
    def snapshot(self) -> StatusSnapshot | None:
        return self._snap

    def update(self, snap: StatusSnapshot) -> None:
        self._snap = snap      # one reference store: atomic, and the snapshot is not mutated afterwards

    def describe(self) -> list[Metric]:
        return []              # names depend on what the node has; nothing to register up front

    def collect(self) -> Iterator[Metric]:
        snap = self._snap
        if snap is None:
            return
        yield from _gpu_families(snap)
        yield from _host_families(snap)
        yield from _probe_families(snap)
        yield from _job_families(snap)
        yield from _agent_families(snap)


def _gpu_families(snap: StatusSnapshot) -> Iterator[Metric]:
    host = snap.node.hostname
    jobs_on: dict[int, set[str]] = {}
    for j in snap.jobs:
        if j.gpu is not None and j.gpu >= 0:
            jobs_on.setdefault(j.gpu, set()).add(j.job_id)
    labels = {g.index: [str(g.index), g.uuid or "", g.pci_bus_id or "", f"nvidia{g.index}", g.name or "", host,
                        ",".join(sorted(jobs_on.get(g.index, ())))] for g in snap.gpus}
    for name, field, scale, kind, doc in DCGM_GPU:
        fam = _Untyped(name, doc, DCGM_LABELS) if kind == "counter" else \
            GaugeMetricFamily(name, doc, labels=DCGM_LABELS)
        for g in snap.gpus:
            v = getattr(g, field)
            if v is not None:
                fam.add_metric(labels[g.index], float(v) * scale)
        yield fam
    free = GaugeMetricFamily("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", labels=DCGM_LABELS)
    for g in snap.gpus:
        if g.memory_total_bytes is not None and g.memory_used_bytes is not None:
            free.add_metric(labels[g.index], (g.memory_total_bytes - g.memory_used_bytes) / MIB)
    yield free
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


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape; a client that stalls mid-request is dropped after 10 s."""

    timeout = 10.0

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


class _Untyped(Metric):
    """dcgm-exporter's counters (no _total in their names). prometheus_client's text format names every
    counter family <name>_total, which would not match the samples, so these go out untyped under
    the exact dcgm-exporter name: rate() and increase() work on them all the same."""

    def __init__(self, name: str, doc: str, labels: list[str]) -> None:
        super().__init__(name, doc, "unknown")
        self._labels = labels

    def add_metric(self, values: list[str], value: float) -> None:
        self.add_sample(self.name, dict(zip(self._labels, values)), value)


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


class Exporter:
    """The /metrics endpoint: a private registry (no default collectors that would touch the tick's
    state) with the snapshot collector and the process collector (the agent's own RSS and CPU)."""

    def __init__(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.collector = SnapshotCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(namespace="gpuagent", registry=self.registry)
        self._server = None
        self._render_lock = threading.Lock()
        self._rendered: dict[str, tuple[StatusSnapshot | None, bytes]] = {}

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition of the latest tick in the format ``accept`` asks for (text or OpenMetrics), formatted
        by prometheus_client once per tick and format: further scrapes of the same tick get the same bytes,
        so scraping often costs the tick loop no more than scraping once per tick."""
        encoder, content_type = choose_encoder(accept)
        snap = self.collector.snapshot
        with self._render_lock:
            cached = self._rendered.get(content_type)
            # the snapshot itself, not its id(): a freed snapshot's id can come back for a later one
            if cached is None or cached[0] is not snap:
                cached = self._rendered[content_type] = (snap, encoder(self.registry))
        return cached[1], content_type

    def _app(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "GET":
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b"use GET /metrics\n"]
        body, content_type = self.render(environ.get("HTTP_ACCEPT", ""))
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    def start(self) -> "Exporter":
        """Listen; OSError (e.g. the port is taken) goes to the caller."""
        family = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM)[0][0]
        # One thread serves scrapes in turn: each is a cached copy of the tick, and handler threads competing
        # for the GIL were what delayed the tick loop when /metrics was hammered.
        server_class = type("ExporterServer", (WSGIServer,), {"address_family": family})
        self._server = make_server(self.host, self.port, self._app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="gpuagent-exporter", daemon=True).start()
        self.port = self._server.server_address[1]
        log.info("serving Prometheus metrics on http://%s:%d/metrics", self.host, self.port)
        return self

    def update(self, snap: StatusSnapshot) -> None:
        self.collector.update(snap)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
