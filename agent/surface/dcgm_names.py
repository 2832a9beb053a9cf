"""dcgm-exporter's metrics as gpuagent exports them: for each, its name before dcgm-exporter 4.9.0 and from
it (and 4.10.0's renames), its type, help and unit, and which GpuStatus field it reads; the label names of
each naming generation (``[exporter] dcgm_names``); the err_msg of the XID series.

A table, apart from the code that walks it (dcgm_families.py), so a name or unit is checked against
dcgm-exporter's etc/default-counters.csv in one place (docs/EXPORTER.md, tests/test_exporter_dcgm_compat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from gpuagent.agent.snapshot import GpuInstanceStatus, GpuStatus
from gpuagent.common.hardware_faults import xid_description

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
# dcgm-exporter's err_msg for XID 0 and for an XID it has no text for (internal/pkg/collector).
XID_NO_ERROR, XID_UNKNOWN = "No Error", "Unknown Error"


def xid_message(xid: int) -> str:
    """err_msg: dcgm-exporter's words for 0 and unknown XIDs; the XID catalogue's description
    (common/hardware_faults.toml, NVIDIA's XID catalog) for the others, so the text may differ from
    dcgm-exporter's."""
    if xid == 0:
        return XID_NO_ERROR
    what = xid_description(xid)
    return what[:1].upper() + what[1:] if what else XID_UNKNOWN


class Naming:
    """Label and metric names of one dcgm-exporter generation."""

    def __init__(self, generation: str) -> None:
        self.generation = generation
        self.hostname = "Hostname" if generation == "pre-4.8.3" else "hostname"     # 4.8.3 renamed it
        self.driver = "DCGM_FI_SYSTEM_DRIVER_VERSION" if generation in NEW_NAMES else "DCGM_FI_DRIVER_VERSION"
        self.new = generation in NEW_NAMES


def in_unit(m: DcgmMetric, v: float, naming: Naming) -> float:
    """A value read in the pre-4.9 unit, in the unit of the naming generation."""
    if naming.new and m.value_new is not None:
        return float(v)
    if m.old in _MIB_FIELDS:
        return float(v) if naming.new else _mib(v)
    return float(v) * m.new_scale if naming.new else float(v)
