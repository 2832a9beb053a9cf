"""The agent's Prometheus ``/metrics`` (``[exporter]``): GPU metrics under dcgm-exporter's names, types,
units and labels (in the naming generation ``[exporter] dcgm_names`` picks), everything else under
``gpuagent_*``. Names, units, sources and the PromQL job join: docs/EXPORTER.md.

A scrape renders the latest tick's :class:`StatusSnapshot` and nothing else: the daemon swaps in a new
(never mutated) snapshot after each tick with one reference assignment, so a scrape never calls NVML,
never takes a lock the tick loop holds, and never delays a tick. Each tick is formatted once per format;
one daemon thread serves the scrapes in turn.

Why the DCGM families have their own text writer: dcgm-exporter types TOTAL_ENERGY_CONSUMPTION and
four other defaults ``counter`` without a ``_total`` suffix. prometheus_client names every counter family
``<name>_total`` in its TYPE line, and OpenMetrics requires the suffix on a counter's samples, so neither
can say "counter" for those names. The Prometheus text format (0.0.4) can, and it is what dcgm-exporter
serves: scrapers that accept it (Prometheus does) get it; a client that accepts only OpenMetrics gets
OpenMetrics with those counters typed ``unknown``.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from gpuagent.agent.config import ExporterConfig
from gpuagent.agent.samplers.gpu import XID_DESCRIPTIONS
from gpuagent.agent.snapshot import GpuInstanceStatus, GpuStatus, StatusSnapshot

log = logging.getLogger("gpuagent.exporter")

MIB = 1024 * 1024
GENERATION_410 = ("4.10",)
NEW_NAMES = ("4.9", "4.10")          # generations with DCGM 4.7's field names and base units


@dataclass(frozen=True)
class DcgmMetric:
    """One dcgm-exporter metric: its name before 4.9.0 (etc/default-counters.csv) and from 4.9.0 (the
    DCGM 4.7 field name), its type as the CSV gives it, and how to read it from a GPU's status."""
    old: str                                               # DCGM_FI_* before dcgm-exporter 4.9.0
    new: str                                               # from 4.9.0
    kind: str                                              # gauge | counter (the CSV's type)
    value: Callable[[GpuStatus], float | None]             # in the pre-4.9 unit
    new_scale: float                                       # pre-4.9 unit -> the 4.9 unit
    help_old: str
    help_new: str
    per_instance: Callable[[GpuInstanceStatus], float | None] | None = None   # MIG: one series per GPU instance
    default: bool = True                                   # an active row of etc/default-counters.csv
    value_new: Callable[[GpuStatus], float | None] | None = None   # from 4.9.0, when not a rescale of value

    def name(self, generation: str) -> str:
        if generation in GENERATION_410 and self.old in RENAMED_410:
            return RENAMED_410[self.old]
        return self.new if generation in NEW_NAMES else self.old


# dcgm-exporter 4.10.0 renamed the four PCIe/NVLink rates (release notes, 4.10.0).
RENAMED_410 = {"DCGM_FI_PROF_PCIE_TX_BYTES": "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND",
               "DCGM_FI_PROF_PCIE_RX_BYTES": "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND",
               "DCGM_FI_PROF_NVLINK_TX_BYTES": "DCGM_FI_PROF_NVLINK_TX_BYTES_PER_SECOND",
               "DCGM_FI_PROF_NVLINK_RX_BYTES": "DCGM_FI_PROF_NVLINK_RX_BYTES_PER_SECOND"}


def _mib(v: float | None) -> float | None:
    """Whole MiB, as DCGM stores FB fields (bytes / 2^20, integer division; DcgmCacheManager.cpp)."""
    return None if v is None else float(int(v) // MIB)


def _fb_used(g: GpuStatus) -> float | None:
    """NVML's v2 "used" (reservation excluded), as DCGM reads it on R510+ drivers: total - free - reserved;
    the v1 "used" where the v2 read is missing."""
    if None not in (g.memory_total_bytes, g.memory_free_bytes, g.memory_reserved_bytes):
        return max(0.0, g.memory_total_bytes - g.memory_free_bytes - g.memory_reserved_bytes)
    return g.memory_used_bytes


def _fb_free(g: GpuStatus) -> float | None:
    if g.memory_free_bytes is not None:
        return g.memory_free_bytes
    if g.memory_total_bytes is not None and g.memory_used_bytes is not None:
        return g.memory_total_bytes - g.memory_used_bytes
    return None


def _inst_used(x: GpuInstanceStatus) -> float | None:
    if None not in (x.memory_total_bytes, x.memory_free_bytes, x.memory_reserved_bytes):
        return max(0.0, x.memory_total_bytes - x.memory_free_bytes - x.memory_reserved_bytes)
    return x.memory_used_bytes


def _nvlink_bandwidth_total(g: GpuStatus) -> float | None:
    """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL as DCGM computes it: the NVML data-throughput counters
    (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX + _RX, KiB, all links) differenced over its sampling
    interval and divided by 1000 (DcgmCacheManager.cpp ReadAndCacheNvLinkBandwidth): a rate despite
    the CSV's "counter"."""
    if g.nvlink_tx_bytes_per_s is None or g.nvlink_rx_bytes_per_s is None:
        return None
    return float(int((g.nvlink_tx_bytes_per_s + g.nvlink_rx_bytes_per_s) / 1024.0 / 1000.0))


def _nvlink_sum(g: GpuStatus, counter: str) -> float | None:
    """A DCGM NVLink error total: the counter summed over all links (None when no link reports it)."""
    vals = [c[counter] for c in (g.nvlink_errors or {}).values() if counter in c]
    return float(sum(vals)) if vals else None


def _pct(field: str) -> Callable[[GpuStatus], float | None]:
    return lambda g: getattr(g, field)


def _ratio(field: str) -> Callable[[object], float | None]:
    return lambda g: None if getattr(g, field) is None else getattr(g, field) / 100.0


def _gr_util_of_instance(x: GpuInstanceStatus) -> float | None:
    """GPU_UTIL of a MIG GPU instance: NVML has no utilization counter under MIG, so gpuagent reports
    the instance's GPM graphics-engine activity (%), the measurement DCGM's GR_ENGINE_ACTIVE is."""
    return x.gr_engine_active_percent


# The 25 metrics of dcgm-exporter's etc/default-counters.csv (github.com/NVIDIA/dcgm-exporter, at
# 4.5.3-4.8.2), in its order, then the profiling extras gpuagent has always exported. 4.9.0 names: the
# DCGM 4.7 field names (DCGM's dcgm_fields.h deprecation aliases; go-dcgm's *_HERTZ/*_JOULES_TOTAL fields).
DCGM_METRICS: list[DcgmMetric] = [
    DcgmMetric("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_SM_CLOCK_HERTZ", "gauge", _pct("sm_clock_mhz"), 1e6,
               "SM clock frequency (in MHz).", "SM clock frequency (in Hz)."),
    DcgmMetric("DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ", "gauge", _pct("mem_clock_mhz"), 1e6,
               "Memory clock frequency (in MHz).", "Memory clock frequency (in Hz)."),
    DcgmMetric("DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS", "gauge",
               _pct("memory_temperature_celsius"), 1.0, "Memory temperature (in C).", "Memory temperature (in C)."),
    DcgmMetric("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_GPU_TEMP_CELSIUS", "gauge", _pct("temperature_celsius"), 1.0,
               "GPU temperature (in C).", "GPU temperature (in C)."),
    DcgmMetric("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_BOARD_POWER_WATTS", "gauge", _pct("power_watts"), 1.0,
               "Power draw (in W).", "Board power draw (in W)."),
    DcgmMetric("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL", "counter",
               _pct("energy_consumed_mj"), 1e-3, "Total energy consumption since boot (in mJ).",
               "Total energy consumption since the driver was loaded (in J)."),
    DcgmMetric("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL", "counter",
               _pct("pcie_replay_count"), 1.0, "Total number of PCIe retries.", "Total number of PCIe retries."),
    DcgmMetric("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO", "gauge", _pct("util_percent"), 0.01,
               "GPU utilization (in %).", "GPU utilization (ratio 0-1).", per_instance=_gr_util_of_instance),
    DcgmMetric("DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_MEMORY_UTIL_RATIO", "gauge", _pct("mem_util_percent"), 0.01,
               "Memory utilization (in %).", "Memory utilization (ratio 0-1)."),
    DcgmMetric("DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_ENC_UTIL_RATIO", "gauge", _pct("encoder_util_percent"), 0.01,
               "Encoder utilization (in %).", "Encoder utilization (ratio 0-1)."),
    DcgmMetric("DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_DEC_UTIL_RATIO", "gauge", _pct("decoder_util_percent"), 0.01,
               "Decoder utilization (in %).", "Decoder utilization (ratio 0-1)."),
    DcgmMetric("DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_XID_ERROR", "gauge", lambda g: float(g.last_xid or 0), 1.0,
               "Value of the last XID error encountered.", "Value of the last XID error encountered."),
    DcgmMetric("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_FREE_BYTES", "gauge", lambda g: _fb_free(g), 1.0,
               "Framebuffer memory free (in MiB).", "Framebuffer memory free (in bytes).",
               per_instance=lambda x: x.memory_free_bytes),
    DcgmMetric("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED_BYTES", "gauge", _fb_used, 1.0,
               "Framebuffer memory used (in MiB).", "Framebuffer memory used (in bytes).", per_instance=_inst_used),
    DcgmMetric("DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_FB_RESERVED_BYTES", "gauge", _pct("memory_reserved_bytes"),
               1.0, "Framebuffer memory reserved (in MiB).", "Framebuffer memory reserved (in bytes).",
               per_instance=lambda x: x.memory_reserved_bytes),
    DcgmMetric("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_NVLINK_THROUGHPUT_BYTES_PER_SECOND", "counter",
               _nvlink_bandwidth_total, 1.0, "Total number of NVLink bandwidth counters for all lanes.",
               "NVLink data throughput, transmit plus receive, all links (in bytes per second).",
               value_new=lambda g: None if g.nvlink_tx_bytes_per_s is None or g.nvlink_rx_bytes_per_s is None
               else g.nvlink_tx_bytes_per_s + g.nvlink_rx_bytes_per_s),
    DcgmMetric("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge",
               _pct("vgpu_license_status"), 1.0, "vGPU License status", "vGPU License status"),
    DcgmMetric("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL", "counter",
               _pct("remapped_rows_uncorrectable_total"), 1.0, "Number of remapped rows for uncorrectable errors",
               "Number of rows remapped for uncorrectable errors."),
    DcgmMetric("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL", "counter",
               _pct("remapped_rows_correctable_total"), 1.0, "Number of remapped rows for correctable errors",
               "Number of rows remapped for correctable errors."),
    DcgmMetric("DCGM_FI_DEV_ROW_REMAP_FAILURE", "DCGM_FI_DEV_ROW_REMAP_FAILED", "gauge", _pct("row_remap_failure"),
               1.0, "Whether remapping of rows has failed", "1 when remapping of rows has failed."),
    DcgmMetric("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", "gauge",
               _ratio("gr_engine_active_percent"), 1.0, "Ratio of time the graphics engine is active.",
               "Ratio of time the graphics engine is active (0-1).", per_instance=_ratio("gr_engine_active_percent")),
    DcgmMetric("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_TENSOR_UTIL_RATIO", "gauge",
               _ratio("tensor_active_percent"), 1.0, "Ratio of cycles the tensor (HMMA) pipe is active.",
               "Ratio of cycles any tensor pipe is active (0-1).", per_instance=_ratio("tensor_active_percent")),
    DcgmMetric("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO", "gauge", _ratio("dram_active_percent"),
               1.0, "Ratio of cycles the device memory interface is active sending or receiving data.",
               "Ratio of cycles the device memory interface is active (0-1).",
               per_instance=_ratio("dram_active_percent")),
    DcgmMetric("DCGM_FI_PROF_PCIE_TX_BYTES", "DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", _pct("pcie_tx_bytes_per_s"), 1.0,
               "The rate of data transmitted over the PCIe bus (in bytes per second).",
               "The rate of data transmitted over the PCIe bus (in bytes per second)."),
    DcgmMetric("DCGM_FI_PROF_PCIE_RX_BYTES", "DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", _pct("pcie_rx_bytes_per_s"), 1.0,
               "The rate of data received over the PCIe bus (in bytes per second).",
               "The rate of data received over the PCIe bus (in bytes per second)."),
    # Profiling fields outside the default CSV (dcp-metrics-included.csv), exported since issue 15.
    DcgmMetric("DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_PROF_SM_UTIL_RATIO", "gauge", _ratio("sm_active_percent"), 1.0,
               "The ratio of cycles an SM has at least 1 warp assigned.",
               "Ratio of cycles an SM has at least one warp assigned (0-1).",
               per_instance=_ratio("sm_active_percent"), default=False),
    DcgmMetric("DCGM_FI_PROF_SM_OCCUPANCY", "DCGM_FI_PROF_SM_OCCUPANCY_RATIO", "gauge",
               _ratio("sm_occupancy_percent"), 1.0, "The ratio of number of warps resident on an SM.",
               "Ratio of warps resident on an SM to its maximum (0-1).",
               per_instance=_ratio("sm_occupancy_percent"), default=False),
    DcgmMetric("DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_TX_BYTES", "gauge",
               _pct("nvlink_raw_tx_bytes_per_s"), 1.0,
               "The rate of data transmitted over NVLink, including protocol headers (in bytes per second).",
               "The rate of data transmitted over NVLink, including protocol headers (in bytes per second).",
               default=False),
    DcgmMetric("DCGM_FI_PROF_NVLINK_RX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES", "gauge",
               _pct("nvlink_raw_rx_bytes_per_s"), 1.0,
               "The rate of data received over NVLink, including protocol headers (in bytes per second).",
               "The rate of data received over NVLink, including protocol headers (in bytes per second).",
               default=False),
]
# Hardware health (issue 23): rows dcgm-exporter ships commented out in etc/default-counters.csv and
# dcp-metrics-included.csv (at 4.5.3-4.8.2), with the CSV's types and help; from 4.9.0 the DCGM 4.7 field
# names where DCGM renamed them (dcgm_fields.h deprecation aliases, go-dcgm legacyDCGMFields).
# (name before 4.9.0, from 4.9.0, type, value, help)
HEALTH_COUNTERS: list[tuple[str, str, str, Callable[[GpuStatus], float | None], str]] = [
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", _pct("ecc_corrected_total"),
     "Total number of single-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", _pct("ecc_uncorrected_total"),
     "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter",
     _pct("ecc_aggregate_corrected_total"), "Total number of single-bit persistent ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter",
     _pct("ecc_aggregate_uncorrected_total"), "Total number of double-bit persistent ECC errors."),
    ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_PAGE_RETIRED_SBE_TOTAL", "counter", _pct("retired_pages_sbe_total"),
     "Total number of retired pages due to single-bit errors."),
    ("DCGM_FI_DEV_RETIRED_DBE", "DCGM_FI_DEV_PAGE_RETIRED_DBE_TOTAL", "counter", _pct("retired_pages_dbe_total"),
     "Total number of retired pages due to double-bit errors."),
    ("DCGM_FI_DEV_RETIRED_PENDING", "DCGM_FI_DEV_PAGE_RETIRED_PENDING", "counter", _pct("retired_pages_pending"),
     "Total number of pages pending retirement."),
    # DCGM field 396, in no dcgm-exporter CSV
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", _pct("remapped_rows_pending"),
     "1 when a row remap is pending (a GPU reset applies it)."),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL", "counter",
     lambda g: _nvlink_sum(g, "crc_flit"), "Total number of NVLink flow-control CRC errors."),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_TOTAL", "counter",
     lambda g: _nvlink_sum(g, "crc_data"), "Total number of NVLink data CRC errors."),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_TOTAL", "counter",
     lambda g: _nvlink_sum(g, "replay"), "Total number of NVLink retries."),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_TOTAL", "counter",
     lambda g: _nvlink_sum(g, "recovery"), "Total number of NVLink recovery errors."),
]
# Clock-event durations: DCGM's DCGM_FI_DEV_CLOCKS_EVENT_REASON_*_NS fields (1420-1424, dcgm_fields.h), in no
# dcgm-exporter CSV; nanoseconds, typed counter (NVML's cumulative NVML_FI_DEV_CLOCKS_EVENT_REASON_* counters).
# HW_SLOWDOWN has no NVML duration nor DCGM field: the agent counts it from the sampled clock-event mask
# (gpu_clock_event_sampled_seconds_total, for the collector and the health check; not exported here).
CLOCK_EVENT_FIELDS = {"sw_power_cap": ("SW_POWER_CAP", "Throttling to not exceed currently set power limits"),
                      "sync_boost": ("SYNC_BOOST", "Throttling to match minimum possible clock across Sync Boost Group"),
                      "sw_thermal": ("SW_THERM_SLOWDOWN", "Throttling to keep GPU and memory below their max operating temperature"),
                      "hw_thermal": ("HW_THERM_SLOWDOWN", "Throttling due to temperature being too high"),
                      "hw_power_brake": ("HW_POWER_BRAKE_SLOWDOWN", "Throttling due to external power brake assertion")}
HEALTH_COUNTERS += [(f"DCGM_FI_DEV_CLOCKS_EVENT_REASON_{f}_NS", f"DCGM_FI_DEV_CLOCKS_EVENT_REASON_{f}_NS", "counter",
                     lambda g, r=reason: None if not g.clock_event_seconds or r not in g.clock_event_seconds
                     else float(int(g.clock_event_seconds[r] * 1e9)), f"{doc} (in ns).")
                    for reason, (f, doc) in CLOCK_EVENT_FIELDS.items()]
DCGM_METRICS += [DcgmMetric(old, new, kind, value, 1.0, doc, doc, default=False)
                 for old, new, kind, value, doc in HEALTH_COUNTERS]
# MiB fields: DCGM's whole MiB before 4.9.0, exact bytes from 4.9.0 (new_scale applies to bytes there).
_MIB_FIELDS = {"DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED"}
XID = "DCGM_FI_DEV_XID_ERRORS"
JOB_INFO = "gpuagent_gpu_job_info"
POD_INFO = "gpuagent_gpu_pod_info"
# dcgm-exporter's err_msg for XID 0 and for an XID it has no text for (internal/pkg/collector).
XID_NO_ERROR, XID_UNKNOWN = "No Error", "Unknown Error"


def xid_message(xid: int) -> str:
    """err_msg: dcgm-exporter's words for 0 and unknown XIDs; gpuagent's own short description (NVIDIA's
    XID table, agent/samplers/gpu.py) for the others, so the text may differ from dcgm-exporter's."""
    if xid == 0:
        return XID_NO_ERROR
    what = XID_DESCRIPTIONS.get(xid)
    return what[:1].upper() + what[1:] if what else XID_UNKNOWN


@dataclass
class Family:
    """One metric family as the text writer emits it."""
    name: str
    kind: str                       # gauge | counter | untyped
    help: str
    samples: list[tuple[list[tuple[str, str]], float]]


class Naming:
    """Label and metric names of one dcgm-exporter generation."""

    def __init__(self, generation: str) -> None:
        self.generation = generation
        self.hostname = "Hostname" if generation == "pre-4.8.3" else "hostname"     # 4.8.3 renamed it
        self.driver = "DCGM_FI_SYSTEM_DRIVER_VERSION" if generation in NEW_NAMES else "DCGM_FI_DRIVER_VERSION"
        self.new = generation in NEW_NAMES


def _gpu_labels(g: GpuStatus, naming: Naming, host: str, driver: str,
                inst: GpuInstanceStatus | None = None) -> list[tuple[str, str]]:
    """dcgm-exporter's labels, in its order (internal/pkg/rendermetrics): gpu, UUID, pci_bus_id, device,
    modelName, GPU_I_PROFILE and GPU_I_ID for a MIG GPU instance, the hostname, the driver-version label."""
    out = [("gpu", str(g.index)), ("UUID", g.uuid or ""), ("pci_bus_id", g.pci_bus_id or ""),
           ("device", f"nvidia{g.index}"), ("modelName", g.name or "")]
    if inst is not None:
        out += [("GPU_I_PROFILE", inst.profile), ("GPU_I_ID", str(inst.gpu_instance_id))]
    out.append((naming.hostname, host))
    if driver:
        out.append((naming.driver, driver))
    return out


def _gpu_jobs(snap: StatusSnapshot) -> dict[tuple[int, int | None], list[tuple[str, str]]]:
    """(GPU, MIG GPU instance or None) -> [(job_id, job_name)], each job once, in job-id order."""
    out: dict[tuple[int, int | None], dict[str, str]] = {}
    for j in snap.jobs:
        if j.gpu is not None and j.gpu >= 0:
            out.setdefault((j.gpu, j.gpu_instance), {}).setdefault(j.job_id, j.job_name or "")
    return {key: sorted(jobs.items()) for key, jobs in out.items()}


def _gpu_pods(snap: StatusSnapshot) -> dict[tuple[int, int | None], list[tuple[str, str, str]]]:
    """(GPU, MIG GPU instance or None) -> [(pod, namespace, container)] the kubelet says hold it, each once."""
    out: dict[tuple[int, int | None], set[tuple[str, str, str]]] = {}
    for g in snap.gpus:
        for p in g.pods or []:
            out.setdefault((g.index, p.gpu_instance), set()).add((p.pod, p.namespace, p.container))
    return {key: sorted(v) for key, v in out.items()}


def _attribution(snap: StatusSnapshot, mode: str) -> dict[tuple[int, int | None], list[list[tuple[str, str]]]]:
    """The extra labels each GPU series is repeated with: one hpc_job per job (``hpc_job``), or pod,
    namespace and container per holding container as dcgm-exporter's Kubernetes mapping names them (``pod``)."""
    if mode == "hpc_job":
        return {key: [[("hpc_job", job)] for job, _ in jobs] for key, jobs in _gpu_jobs(snap).items()}
    if mode == "pod":
        return {key: [[("pod", p), ("namespace", ns), ("container", c)] for p, ns, c in rows]
                for key, rows in _gpu_pods(snap).items()}
    return {}


def _extra_for(attr: dict[tuple[int, int | None], list[list[tuple[str, str]]]], gpu: int,
               inst: GpuInstanceStatus | None) -> list[list[tuple[str, str]]]:
    """The extra label sets of one series: those of its GPU instance, or of the whole GPU for a GPU-level
    series (dcgm-exporter's mapping files are keyed <gpu> and <gpu>.<GPU instance> the same way)."""
    if inst is not None:
        return attr.get((gpu, inst.gpu_instance_id), [])
    return sorted({tuple(x) for (g, _gi), rows in attr.items() if g == gpu for x in rows})


def dcgm_families(snap: StatusSnapshot, settings: ExporterConfig) -> list[Family]:
    """The dcgm-exporter families of one tick, named for ``settings.dcgm_names``.

    A GPU-level value is one series per GPU. Under MIG, the values DCGM keeps per GPU instance (the
    framebuffer and the profiling ratios) are one series per GPU instance with GPU_I_PROFILE and
    GPU_I_ID, and GPU_UTIL too (from GPM; see _gr_util_of_instance). With ``job_labels = "hpc_job"``
    each series is repeated once per job on its GPU with ``hpc_job`` (dcgm-exporter's HPC job
    mapping); otherwise no job label is set and gpuagent_gpu_job_info carries the jobs.
    """
    naming = Naming(settings.dcgm_names)
    host, driver = snap.node.hostname, snap.node.driver_version
    attr = _attribution(snap, settings.job_labels)
    fams: list[Family] = []
    for m in DCGM_METRICS:
        samples: list[tuple[list[tuple[str, str]], float]] = []
        for g in snap.gpus:
            rows: list[tuple[list[tuple[str, str]], float | None, GpuInstanceStatus | None]] = []
            if g.instances and m.per_instance is not None:
                rows = [(_gpu_labels(g, naming, host, driver, x), m.per_instance(x), x) for x in g.instances]
            else:
                base = _gpu_labels(g, naming, host, driver)
                if m.old == XID and settings.xid_labels:
                    code = int(g.last_xid or 0)
                    base += [("err_code", str(code)), ("err_msg", xid_message(code))]
                rows = [(base, (m.value_new or m.value)(g) if naming.new else m.value(g), None)]
            for labels, v, inst in rows:
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    continue
                v = _unit(m, v, naming)
                extra = _extra_for(attr, g.index, inst) if attr else []
                if extra:
                    samples += [(labels + list(x), v) for x in extra]
                else:
                    samples.append((labels, v))
        if samples:
            fams.append(Family(m.name(settings.dcgm_names), m.kind, m.help_new if naming.new else m.help_old,
                               samples))
    return fams


def _unit(m: DcgmMetric, v: float, naming: Naming) -> float:
    if naming.new and m.value_new is not None:
        return float(v)
    if m.old in _MIB_FIELDS:
        return float(v) if naming.new else _mib(v)
    return float(v) * m.new_scale if naming.new else float(v)


def job_info_family(snap: StatusSnapshot, settings: ExporterConfig) -> Family:
    """gpuagent_gpu_job_info: 1 per (GPU, job) the job discovery saw this tick, to join GPU series with
    (docs/EXPORTER.md): a job starting or stopping changes these series only, never a GPU series."""
    naming = Naming(settings.dcgm_names)
    uuid = {g.index: g.uuid or "" for g in snap.gpus}
    samples = []
    for (gpu, gi), jobs in sorted(_gpu_jobs(snap).items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None
                                                                          else kv[0][1])):
        for job_id, job_name in jobs:
            labels = [("gpu", str(gpu)), ("UUID", uuid.get(gpu, ""))]
            if gi is not None:
                labels.append(("GPU_I_ID", str(gi)))
            labels += [(naming.hostname, snap.node.hostname), ("job_id", job_id), ("job_name", job_name)]
            samples.append((labels, 1.0))
    return Family(JOB_INFO, "gauge", "1 for each job with a process on the GPU (GPU instance under MIG); "
                  "join on instance and gpu.", samples)


def render_text(families: Iterable[Family]) -> bytes:
    """The Prometheus text format (0.0.4), with each family's own type, counters without _total."""
    out: list[str] = []
    for f in families:
        out.append(f"# HELP {f.name} {_escape_help(f.help)}")
        out.append(f"# TYPE {f.name} {f.kind}")
        for labels, v in f.samples:
            lab = ",".join(f'{k}="{_escape_label(val)}"' for k, val in labels)
            out.append(f"{f.name}{{{lab}}} {floatToGoString(v)}" if lab else f"{f.name} {floatToGoString(v)}")
    return ("\n".join(out) + "\n").encode() if out else b""


def _escape_help(s: str) -> str:
    return s.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(s: str) -> str:
    return s.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _as_client_metric(f: Family) -> Metric:
    """A Family for prometheus_client's OpenMetrics encoder: counters without _total go out ``unknown``."""
    m = Metric(f.name, f.help, f.kind if f.kind == "gauge" else "unknown")
    for labels, v in f.samples:
        m.add_sample(f.name, dict(labels), v)
    return m


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
    """A prometheus_client collector over the latest tick's snapshot (``update`` swaps it in): the
    gpuagent_* families. The DCGM families are written by render_text (see the module docstring)."""

    def __init__(self, settings: ExporterConfig | None = None) -> None:
        self._snap: StatusSnapshot | None = None
        self.settings = settings or ExporterConfig()

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
        yield from _gpu_families(snap, self.settings)
        yield from _host_families(snap)
        yield from _probe_families(snap)
        yield from _job_families(snap)
        yield from _agent_families(snap)
        yield from _health_families(snap)


class _DcgmForOpenMetrics:
    """The DCGM families for prometheus_client's OpenMetrics encoder (clients that refuse text/plain)."""

    def __init__(self, collector: SnapshotCollector) -> None:
        self._collector = collector

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._collector.snapshot
        if snap is not None:
            for f in dcgm_families(snap, self._collector.settings):
                yield _as_client_metric(f)


def pod_info_family(snap: StatusSnapshot, settings: ExporterConfig) -> Family:
    """gpuagent_gpu_pod_info: 1 per (GPU or MIG GPU instance, container) the kubelet says holds it, with a
    process on it or not (an idle pod's GPU is held all the same); join on instance and gpu like the job info."""
    naming = Naming(settings.dcgm_names)
    uuid = {g.index: g.uuid or "" for g in snap.gpus}
    samples = []
    for (gpu, gi), rows in sorted(_gpu_pods(snap).items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None
                                                                          else kv[0][1])):
        for pod, ns, container in rows:
            labels = [("gpu", str(gpu)), ("UUID", uuid.get(gpu, ""))]
            if gi is not None:
                labels.append(("GPU_I_ID", str(gi)))
            labels += [(naming.hostname, snap.node.hostname), ("pod", pod), ("namespace", ns), ("container", container)]
            samples.append((labels, 1.0))
    return Family(POD_INFO, "gauge", "1 for each container the kubelet says holds the GPU (GPU instance under "
                  "MIG); join on instance and gpu.", samples)


def _gpu_families(snap: StatusSnapshot, settings: ExporterConfig) -> Iterator[Metric]:
    yield _as_client_metric(job_info_family(snap, settings))
    yield _as_client_metric(pod_info_family(snap, settings))
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


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape; a client that stalls mid-request is dropped after 10 s."""

    timeout = 10.0

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics only for a client that does not take the text format: Prometheus lists both and gets
    text, the one format in which dcgm-exporter's counters keep their type (module docstring)."""
    types = [part.split(";")[0].strip().lower() for part in (accept or "").split(",")]
    return "application/openmetrics-text" in types and not {"text/plain", "text/*", "*/*"} & set(types)


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


class Exporter:
    """The /metrics endpoint: private registries (no default collectors that would touch the tick's
    state) with the snapshot collector and the process collector (the agent's own RSS and CPU)."""

    def __init__(self, listen: str, settings: ExporterConfig | None = None) -> None:
        host, _, port = listen.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.settings = settings or ExporterConfig(listen=listen)
        self.collector = SnapshotCollector(self.settings)
        self.registry = CollectorRegistry(auto_describe=False)          # text: gpuagent_* after the DCGM text
        self.registry.register(self.collector)
        ProcessCollector(namespace="gpuagent", registry=self.registry)
        self.om_registry = CollectorRegistry(auto_describe=False)       # OpenMetrics: everything
        self.om_registry.register(_DcgmForOpenMetrics(self.collector))
        self.om_registry.register(self.collector)
        ProcessCollector(namespace="gpuagent", registry=self.om_registry)
        self._server = None
        self._render_lock = threading.Lock()
        self._rendered: dict[str, tuple[StatusSnapshot | None, bytes]] = {}

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition of the latest tick, text (0.0.4) unless the client takes only OpenMetrics,
        formatted once per tick and format: further scrapes of the same tick get the same bytes, so
        scraping often costs the tick loop no more than scraping once per tick."""
        snap = self.collector.snapshot
        if wants_openmetrics(accept):
            encoder, content_type = choose_encoder(accept)
            make = lambda: encoder(self.om_registry)
        else:
            content_type = CONTENT_TYPE_PLAIN_0_0_4
            make = lambda: (render_text(dcgm_families(snap, self.settings)) if snap is not None else b"") \
                + generate_latest(self.registry)
        with self._render_lock:
            cached = self._rendered.get(content_type)
            # the snapshot itself, not its id(): a freed snapshot's id can come back for a later one
            if cached is None or cached[0] is not snap:
                cached = self._rendered[content_type] = (snap, make())
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
