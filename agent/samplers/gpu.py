"""GPU sampler: per-GPU NVML telemetry, XID and throttle-change events, per-process GPU usage.

All NVML access goes through :class:`gpuagent.common.nvml.Nvml` (one choke point). A metric the driver
does not offer is skipped after being reported once (as a ``metric_unavailable`` event and in
``Nvml.unavailable``); without NVML at all the sampler emits one ``nvml_unavailable`` event and then
does nothing, so the agent runs host-only. Metric names: docs/METRICS.md ("GPU sampler").

GPM (Hopper and newer, through :class:`gpuagent.common.nvml.Gpm`): SM activity, SM occupancy,
tensor-pipe activity, DRAM bandwidth utilization and PCIe/NVLink throughput over each tick. Where GPM
is missing, the only activity figure is ``gpu_util_percent`` (time any kernel ran), and the status
says so (``activity_source``). Under MIG the GPM values are per GPU instance (label ``gpu_instance``)
for the instances that run compute processes.

For the exporter's dcgm-exporter defaults (``_dcgm_values``, docs/EXPORTER.md): memory temperature, the
video engines, row remapping, the vGPU license, NVLink bytes with protocol headers, and under MIG each GPU
instance's id, profile name and framebuffer (from the one MIG device listing, ``_mig_devices``). The
framebuffer's used/free/reserved come from the tick's one memory read (nvmlMemory_v2, v1 fallback).

Hardware health (issue 23; ``_health_values``): aggregate ECC, retired pages per cause and pending,
clock-event durations per reason (field values, in the tick's one nvmlDeviceGetFieldValues call, every
``health_every`` ticks), NVLink state per link (every ``health_every`` ticks) and error counters per link
(read when the NVLink error totals, fields asked every tick, change). docs/METRICS.md says how often.

Events:
- ``xid``: value = the XID number, from nvmlEventSetWait with a 0 ms timeout each tick (never blocks); attrs
  source "nvml" and pci_bus_id (kernel form, "0000:3a:00.0"), for the kernel-log reader's deduplication.
- ``gpu_lost``: the GPU answered GPU_IS_LOST (fell off the bus); it is not queried again.
- ``throttle_change``: the decoded set of clock-event reasons changed (``gpu_idle`` alone does not
  trigger it: an idle GPU is not throttled in any way that matters); attrs carry old/new names.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping

from gpuagent.common.nvml import (
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_SUPPORTED,
    EVENT_TYPE_XID,
    VIRT_MODES,
    Gpm,
    Nvml,
    decode_throttle,
    sysfs_bus_id,
)

log = logging.getLogger("gpuagent.gpu_sampler")

_HEALTH_EVERY = 10        # ticks between reads of NVLink link state / per-link errors (and retired pages by call)
_STATIC_RECHECK_S = 60.0  # max clocks and max PCIe link: re-read this often
_PCIE_RETRY_S = 60.0      # PCIe byte counters (fields 197/198) dropped out: ask for them again this often
_MIG_RECHECK_S = 60.0     # MIG devices (GPU instances) of a MIG GPU: re-list this often
_UINT_MAX = 0xFFFFFFFF
_MIG_DEV = " (MIG device)"   # suffix of the seam's key for a call on a MIG device handle
_MEMORY_V2 = 0x02000028   # nvml.h nvmlMemory_v2: NVML_STRUCT_VERSION(Memory, 2) (pynvml.nvmlMemory_v2)
# Compute-process calls, newest first: pynvml's unversioned name calls _v3 and raises
# NVMLLibraryMismatchError on drivers without it; _v2 is in every driver since R450.
_PROC_CALLS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
               "nvmlDeviceGetComputeRunningProcesses")
_MAX_EVENTS_PER_TICK = 256
# GPM metric (common/nvml.py GPM_METRICS, labelled gpu_instance under MIG) -> GpuInstanceStatus field
_GPM_INSTANCE_FIELDS = {"gpu_gr_engine_active_percent": "gr_engine_active_percent",
                        "gpu_sm_active_percent": "sm_active_percent",
                        "gpu_sm_occupancy_percent": "sm_occupancy_percent",
                        "gpu_tensor_active_percent": "tensor_active_percent",
                        "gpu_dram_active_percent": "dram_active_percent"}

# Hardware-health field values (nvml.h NVML_FI_DEV_*), read in the one field-values call per GPU per tick.
_FI_ECC_AGG = ((5, "gpu_ecc_aggregate_corrected_total", 0),       # NVML_FI_DEV_ECC_SBE_AGG_TOTAL
               (6, "gpu_ecc_aggregate_uncorrected_total", 1))     # NVML_FI_DEV_ECC_DBE_AGG_TOTAL
_FI_RETIRED_SBE, _FI_RETIRED_DBE, _FI_RETIRED_PENDING = 29, 30, 31  # NVML_FI_DEV_RETIRED_SBE/_DBE/_PENDING
# Clock-event durations in ns (nvml.h "Field values for Clock Throttle Reason Counters"): 74 and 76 are
# NVML_FI_DEV_PERF_POLICY_POWER / _SYNC_BOOST, which nvml.h names ..._CLOCKS_EVENT_REASON_SW_POWER_CAP /
# _SYNC_BOOST. NVML has no duration for the HW slowdown bit itself; its causes are hw_thermal and hw_power_brake.
_FI_CLOCK_EVENTS = ((74, "sw_power_cap"), (76, "sync_boost"), (269, "sw_thermal"), (270, "hw_thermal"),
                    (271, "hw_power_brake"))
# NVLink error totals over all links (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL): a change says a per-link read is due.
_FI_NVLINK_ERR_TOTALS = ((38, "crc_flit"), (45, "crc_data"), (52, "replay"), (59, "recovery"))
# nvmlNvLinkErrorCounter_t (nvml.h): the per-link counters, by the label they get
_NVLINK_ERRORS = (("crc_flit", 2), ("crc_data", 3), ("replay", 0), ("recovery", 1))
# Read every ``health_every`` ticks (they change seldom, or are cumulative: nothing is lost between reads) ...
_SLOW_FIDS = frozenset([f for f, _, _ in _FI_ECC_AGG] + [_FI_RETIRED_SBE, _FI_RETIRED_DBE, _FI_RETIRED_PENDING]
                       + [f for f, _ in _FI_CLOCK_EVENTS])
# ... and every tick: the NVLink error totals (a change triggers the per-link read)
_TICK_FIDS = frozenset(f for f, _ in _FI_NVLINK_ERR_TOTALS)
_HEALTH_FIDS = _SLOW_FIDS | _TICK_FIDS

# Common XIDs and their meaning, from NVIDIA's "XID Errors" table (docs.nvidia.com/deploy/xid-errors).
XID_DESCRIPTIONS = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors", 48: "double bit ECC error",
    61: "internal micro-controller breakpoint/warning", 62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}


def mig_mode_text(mode: Any) -> str:
    if mode is None:
        return "unsupported"
    try:
        current = mode[0]
    except (TypeError, IndexError):
        current = mode
    return "enabled" if int(current) == 1 else "disabled"


def virt_mode_text(mode: Any) -> str:
    if mode is None:
        return "unknown"
    return VIRT_MODES.get(int(mode), "unknown")


class GpuSampler:
    """Sampler (agent/samplers/sampling.py) over all GPUs NVML sees."""

    name = "gpu"

    def __init__(self, nvml: Nvml | None = None, pcie_fallback_every: int = 10, gpm: bool = True,
                 sys_root: str = "/sys", pcie_retry_s: float = _PCIE_RETRY_S,
                 health_every: int = _HEALTH_EVERY) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self.sys_root = sys_root                    # sysfs root (tests give a tmp tree): NUMA nodes, PCI devices
        self.pcie_retry_s = pcie_retry_s
        self._pcie_retry_at: dict[int, float] = {}  # GPU -> tick time (s) to ask the PCIe byte counters again
        self._mig_devs: dict[int, tuple[float, list[dict[str, Any]]]] = {}   # GPU -> (when, MIG devices)
        self.memory_numa_node: dict[int, int] = {}  # GPU -> NUMA node of the GPU's own memory (GH200), if any
        self.gpm = Gpm(self.nvml) if gpm and self.nvml.available else None
        self._announced_off = False
        self._prev_reasons: dict[int, frozenset[str]] = {}
        self._counter_prev: dict[tuple[str, int], tuple[float, int, int]] = {}
        self._static: dict[int, dict[str, Any]] = {}
        self._pcie_counters: dict[int, bool] = {}
        self._pcie_fallback_tick: dict[int, int] = {}
        self.pcie_fallback_every = pcie_fallback_every
        self._nvlink_links: dict[int, int | None] = {}
        self.health_every = max(1, int(health_every))
        self._ticks: dict[int, int] = {}                 # GPU -> ticks sampled so far
        self._nvlink_up: dict[int, dict[int, int] | None] = {}     # GPU -> {link: 1 up / 0 down}; None: no NVLink
        self._nvlink_err: dict[int, dict[int, dict[str, int]]] = {}  # GPU -> link -> counter -> count
        self._nvlink_totals: dict[int, tuple[int, ...] | None] = {}  # GPU -> the error totals at the last per-link read
        self._nvlink_bad: dict[int, dict[int, dict[str, int]]] = {}  # GPU -> the links with a non-zero error count
        self._fields_off: dict[int, set[int]] = {}       # GPU -> health field ids that answered NOT_SUPPORTED
        self._clock_s: dict[int, dict[str, float]] = {}   # GPU -> reason -> clock-event seconds (last read)
        # GPU -> (last tick's ns, HW_SLOWDOWN bit then, seconds counted so far, the gap before that tick):
        # NVML has no duration for it
        self._hw_slowdown: dict[int, tuple[int, bool, float, int]] = {}
        self._bus_ids: dict[int, str] = {}               # GPU -> PCI bus id, kernel form ("0000:18:00.0")
        self._proc_last_seen_us: dict[int, int] = {}
        self._event_set: Any = None
        self._event_gpus: set[int] = set()
        self._events_ready = False
        self.last: dict[int, dict[str, Any]] = {}   # latest values per GPU, for `gpuagent status`
        self.last_xid: dict[int, int] = {}          # GPU -> the latest XID seen (dcgm-exporter's XID_ERRORS)
        self.pods: Any = None                       # agent/kubelet.PodResources on a Kubernetes node, else None
        self._uuids: dict[int, str] = {}
        n = self.nvml
        if n.available:
            self._sm = n.const("NVML_CLOCK_SM", 1)
            self._mem = n.const("NVML_CLOCK_MEM", 2)
            self._temp_gpu = n.const("NVML_TEMPERATURE_GPU", 0)
            self._tx = n.const("NVML_PCIE_UTIL_TX_BYTES", 0)
            self._rx = n.const("NVML_PCIE_UTIL_RX_BYTES", 1)
            self._ecc_corr = n.const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
            self._ecc_unc = n.const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
            self._ecc_vol = n.const("NVML_VOLATILE_ECC", 0)
            self._fi_pcie_tx = n.const("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197)
            self._fi_pcie_rx = n.const("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198)
            self._fi_nvl_tx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
            self._fi_nvl_rx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
            self._nvl_max = n.const("NVML_NVLINK_MAX_LINKS", 18)
            self._feature_on = n.const("NVML_FEATURE_ENABLED", 1)
            # Reads for the exporter's dcgm-exporter defaults (_dcgm_values); nvml.h field ids and versions.
            self._fi_mem_temp = n.const("NVML_FI_DEV_MEMORY_TEMP", 82)
            self._fi_nvl_raw_tx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", 140)
            self._fi_nvl_raw_rx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX", 141)
            self._ecc_agg = n.const("NVML_AGGREGATE_ECC", 1)
            for i in range(n.device_count):   # before any XID 79: a GPU off the bus answers nothing
                self._bus_ids[i] = sysfs_bus_id(_bus_id(n.query("nvmlDeviceGetPciInfo", n.handle(i), gpu=i)))
            self._setup_events()

    # ------------------------------------------------------------------ inventory
    def gpu_inventory(self) -> list[dict[str, Any]]:
        """One dict per GPU with the proto GpuInfo field names (for Register and `status`)."""
        n = self.nvml
        out = []
        for i in range(n.device_count):
            h = n.handle(i)
            pci = n.query("nvmlDeviceGetPciInfo", h, gpu=i)
            mem = self._memory_info(i, h)
            bus = _bus_id(pci)
            numa = self._cpu_numa_node(i, h, bus)
            out.append({
                "index": i,
                "uuid": n.text("nvmlDeviceGetUUID", i),
                "name": n.text("nvmlDeviceGetName", i),
                "pci_bus_id": bus,
                "pcie_gen_max": _int(n.query("nvmlDeviceGetMaxPcieLinkGeneration", h, gpu=i)),
                "pcie_gen_current": _int(n.query("nvmlDeviceGetCurrPcieLinkGeneration", h, gpu=i)),
                "pcie_width_max": _int(n.query("nvmlDeviceGetMaxPcieLinkWidth", h, gpu=i)),
                "pcie_width_current": _int(n.query("nvmlDeviceGetCurrPcieLinkWidth", h, gpu=i)),
                "memory_total_bytes": int(mem.total) if mem is not None else 0,
                "mig_mode": mig_mode_text(n.query("nvmlDeviceGetMigMode", h, gpu=i)),
                "virtualization_mode": virt_mode_text(n.query("nvmlDeviceGetVirtualizationMode", h, gpu=i)),
                "numa_node": int(numa) if numa is not None else -1,
            })
        return out

    def _cpu_numa_node(self, i: int, h: Any, bus: str) -> int | None:
        """The NUMA node of the CPUs next to the GPU (what the probes pin to): NVML's CPU affinity
        (within the NODE scope, else the plain one) mapped through <sys_root>/devices/system/node, else
        the PCI device's numa_node in sysfs. nvmlDeviceGetNumaNodeId is another thing: the node of the
        GPU's own memory on coherent systems (GH200), NOT_SUPPORTED on x86; kept in memory_numa_node."""
        n = self.nvml
        gmem = n.query("nvmlDeviceGetNumaNodeId", h, gpu=i, report=False)
        if gmem is not None and int(gmem) >= 0:
            self.memory_numa_node[i] = int(gmem)
        nodes = _sysfs_numa_cpus(self.sys_root)
        if nodes:
            words = max(16, (max(max(c) for c in nodes.values() if c) // 64) + 1)   # 64 CPUs per word
            scope = n.const("NVML_AFFINITY_SCOPE_NODE", 0)
            mask = n.query_first((("nvmlDeviceGetCpuAffinityWithinScope", (h, words, scope)),
                                  ("nvmlDeviceGetCpuAffinity", (h, words))), gpu=i)
            if mask is not None:
                cpus = {w * 64 + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1}
                best = max(nodes, key=lambda node: (len(nodes[node] & cpus), -node))
                if nodes[best] & cpus:
                    return best
        return _numa_from_sysfs(bus, self.sys_root)

    def _memory_info(self, i: int, h: Any, suffix: str = "") -> Any:
        """nvmlMemory_v2 (``used`` without the driver's reservation, ``reserved`` apart), or v1 (where
        ``used`` includes it, no ``reserved``) on drivers without nvmlDeviceGetMemoryInfo_v2. The one
        memory read of a GPU (or, with ``suffix`` _MIG_DEV, of a MIG device handle) per tick. A driver
        without _v2 is reported once per GPU: the reservation is then unknown."""
        n = self.nvml
        v2 = "nvmlDeviceGetMemoryInfo_v2" + suffix
        if not n.is_unsupported(v2, i):
            # pynvml: nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2) calls the _v2 symbol
            mem = n.query("nvmlDeviceGetMemoryInfo", h, n.const("nvmlMemory_v2", _MEMORY_V2), gpu=i, key=v2)
            if mem is not None or not n.is_unsupported(v2, i):
                return mem
        return n.query("nvmlDeviceGetMemoryInfo", h, gpu=i, key="nvmlDeviceGetMemoryInfo" + suffix)

    # ------------------------------------------------------------------ per-process usage
    def processes(self) -> list[dict[str, Any]]:
        """Processes on each GPU: {pid, gpu, gpu_memory_bytes, gpu_util_percent, gpu_instance_id}.

        For job discovery. Utilization is the mean SM utilization of the process's samples from
        nvmlDeviceGetProcessUtilization newer than the previous call. NVML only keeps samples for
        processes that ran kernels, so a listed process without one was idle (0); -1 means unknown
        (the call is not supported, e.g. under MIG). ``gpu_memory_bytes`` is -1 when NVML has no
        figure (NVML_VALUE_NOT_AVAILABLE). Under MIG the processes come from each GPU instance's
        MIG device handle, which needs no privileges (the parent handle answers NO_PERMISSION).
        """
        n = self.nvml
        fn = "nvmlDeviceGetProcessUtilization"
        out: list[dict[str, Any]] = []
        for i in range(n.device_count):
            if i in n.lost:
                continue
            h = n.handle(i)
            procs = self._compute_processes(i, h)
            if not procs:
                continue
            last = self._proc_last_seen_us.get(i, 0)
            samples = n.query(fn, h, last, gpu=i)
            known = not n.is_unsupported(fn, i) and i not in n.lost
            util: dict[int, list[float]] = {}
            for smp in samples or ():
                ts = int(smp.timeStamp)
                if ts <= last:
                    continue
                util.setdefault(int(smp.pid), []).append(float(smp.smUtil))
                self._proc_last_seen_us[i] = max(self._proc_last_seen_us.get(i, 0), ts)
            for pid, used, gi in procs:
                vals = util.get(pid)
                out.append({"pid": pid, "gpu": i,
                            "gpu_memory_bytes": float(used) if used is not None else -1.0,
                            "gpu_util_percent": (sum(vals) / len(vals)) if vals else (0.0 if known else -1.0),
                            # MIG: the GPU instance the process runs in (-1 when MIG is off)
                            "gpu_instance_id": gi})
        return out

    def _compute_processes(self, i: int, h: Any) -> list[tuple[int, int | None, int]]:
        """(pid, used bytes or None when NVML has no figure, GPU instance id or -1) of the compute
        processes of GPU ``i``; under MIG read per GPU instance, from the parent only when the MIG
        device handles give nothing (its NO_PERMISSION is not taken as permanent)."""
        n = self.nvml
        rows: dict[tuple[int, int], int | None] = {}
        if self._static_values(i, h)["mig"]:
            answered = False
            for d in self._mig_devices(i, h):
                procs = n.query_first(tuple((c, (d["handle"],)) for c in _PROC_CALLS), gpu=i, suffix=_MIG_DEV)
                if procs is None:
                    continue
                answered = True
                for p in procs:      # the instance's id when NVML does not fill it in; one row per (pid, id)
                    pgi = getattr(p, "gpuInstanceId", None)
                    gi = d["gpu_instance_id"] if pgi in (None, _UINT_MAX) else int(pgi)
                    rows.setdefault((int(p.pid), gi), _used(p))
            procs = None if answered else self._parent_processes_mig(i, h)
        else:
            procs = n.query_first(tuple((c, (h,)) for c in _PROC_CALLS), gpu=i)
        for p in procs or ():
            gi = getattr(p, "gpuInstanceId", _UINT_MAX)
            rows.setdefault((int(p.pid), -1 if gi in (None, _UINT_MAX) else int(gi)), _used(p))
        return [(pid, used, gi) for (pid, gi), used in rows.items()]

    def _parent_processes_mig(self, i: int, h: Any) -> Any:
        """The parent handle's process list on a MIG GPU (privileged agents only; NO_PERMISSION retried)."""
        n = self.nvml
        for c in _PROC_CALLS:
            if n.is_unsupported(c, i):
                continue
            v = n.query(c, h, gpu=i, report=c == _PROC_CALLS[-1], permission_final=False)
            if v is not None or not n.is_unsupported(c, i):
                return v
        return None

    def _mig_devices(self, i: int, h: Any) -> list[dict[str, Any]]:
        """The MIG devices of GPU ``i`` (the first of each GPU instance): {handle, gpu_instance_id,
        profile}, from calls NVML answers without privileges: nvmlDeviceGetMaxMigDeviceCount,
        nvmlDeviceGetMigDeviceHandleByIndex and, on the MIG device handle, nvmlDeviceGetGpuInstanceId
        and its name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> profile "1g.10gb"). Re-listed every minute."""
        now = time.monotonic()
        got = self._mig_devs.get(i)
        if got is not None and now - got[0] <= _MIG_RECHECK_S:
            return got[1]
        n = self.nvml
        q = n.query
        seen: dict[int, dict[str, Any]] = {}
        count = q("nvmlDeviceGetMaxMigDeviceCount", h, gpu=i)
        for idx in range(int(count or 0)):
            mh = q("nvmlDeviceGetMigDeviceHandleByIndex", h, idx, gpu=i)   # NOT_FOUND (quiet): an empty slot
            if mh is None:
                continue
            gi = q("nvmlDeviceGetGpuInstanceId", mh, gpu=i)
            if gi is None or int(gi) in seen:
                continue
            name = q("nvmlDeviceGetName", mh, gpu=i, key="nvmlDeviceGetName" + _MIG_DEV)
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name or "")
            _, sep, prof = name.rpartition(" MIG ")
            uuid = q("nvmlDeviceGetUUID", mh, gpu=i, key="nvmlDeviceGetUUID" + _MIG_DEV, report=False)
            seen[int(gi)] = {"handle": mh, "gpu_instance_id": int(gi), "profile": prof.strip() if sep else "",
                             "uuid": uuid.decode(errors="replace") if isinstance(uuid, bytes) else str(uuid or "")}
        devs = [seen[k] for k in sorted(seen)]
        if devs:      # none listed (yet, or a transient error): ask again next time
            self._mig_devs[i] = (now, devs)
        return devs

    def gpu_instances(self, i: int) -> list[dict[str, Any]]:
        """The GPU instances of MIG GPU ``i``: [{gpu_instance_id, profile}] ([] when MIG is off)."""
        n = self.nvml
        if i >= n.device_count or i in n.lost or not self._static_values(i, n.handle(i))["mig"]:
            return []
        return [{"gpu_instance_id": d["gpu_instance_id"], "profile": d["profile"]}
                for d in self._mig_devices(i, n.handle(i))]

    # ------------------------------------------------------------------ events
    def _setup_events(self) -> None:
        n = self.nvml
        if n.device_count == 0:
            return
        es = n.query("nvmlEventSetCreate")
        if es is None:
            return
        xid_type = n.const("nvmlEventTypeXidCriticalError", EVENT_TYPE_XID)
        for i in range(n.device_count):
            ok, code = n.query_raw("nvmlDeviceRegisterEvents", n.handle(i), xid_type, es)
            if code is None:
                self._event_gpus.add(i)
            else:
                n.mark_unsupported("nvmlDeviceRegisterEvents", i, f"XID events not available (NVML error {code})")
        self._event_set = es
        self._events_ready = bool(self._event_gpus)

    def _poll_events(self, ts_ns: int, sink) -> None:
        n = self.nvml
        timeout_code = n.const("NVML_ERROR_TIMEOUT", 10)
        for _ in range(_MAX_EVENTS_PER_TICK):
            data, code = n.query_raw("nvmlEventSetWait", self._event_set, 0)
            if code is not None:
                if code != timeout_code:
                    n.mark_unsupported("nvmlEventSetWait", -1, f"event wait failed (NVML error {code})")
                    self._events_ready = False
                return
            gpu = n.query("nvmlDeviceGetIndex", data.device)
            if gpu is None:   # a lost GPU answers GPU_IS_LOST even here (XID 79): match the handle itself
                gpu = next((k for k in range(n.device_count) if _same_handle(n.handle(k), data.device)), None)
            gpu = int(gpu) if gpu is not None else -1
            xid = int(data.eventData)
            what = XID_DESCRIPTIONS.get(xid, "")
            bus = self._bus_ids.get(gpu, "") if gpu >= 0 else ""
            if gpu >= 0:
                self.last_xid[gpu] = xid
            sink.event("xid", f"XID {xid} on GPU {gpu}" + (f" ({what})" if what else ""), gpu=gpu,
                       value=float(xid), attrs={"xid": str(xid), "description": what, "source": "nvml",
                                                "pci_bus_id": bus, "event_type": hex(int(data.eventType))},
                       ts_ns=ts_ns)

    # ------------------------------------------------------------------ the tick
    def sample(self, ts_ns: int, sink) -> None:
        n = self.nvml
        if not n.available:
            if not self._announced_off:
                self._announced_off = True
                sink.event("nvml_unavailable", n.reason or "NVML unavailable; running host-only",
                           ts_ns=ts_ns)
                n.drain_new_unavailable()
            return
        for i in range(n.device_count):
            if i not in n.lost:
                self._sample_gpu(i, ts_ns, sink)
        if self._events_ready:
            self._poll_events(ts_ns, sink)
        for gpu, why in n.drain_new_unavailable():
            kind = "gpu_lost" if gpu in n.lost and why.startswith(f"GPU {gpu}: lost") else "metric_unavailable"
            sink.event(kind, why, gpu=gpu, ts_ns=ts_ns)

    def _sample_gpu(self, i: int, ts: int, sink) -> None:
        n = self.nvml
        h = n.handle(i)
        q = n.query
        cur: dict[str, Any] = {}

        def put(metric: str, value: Any, labels: Mapping[str, str] | None = None) -> None:
            if value is None:
                return
            v = float(value)
            sink.add(metric, v, gpu=i, labels=labels, ts_ns=ts)
            if labels is None:
                cur[metric] = v
            elif "gpu_instance" in labels:   # per-MIG-instance values, for the exporter's GPU_I_ID series
                cur.setdefault("by_instance", {}).setdefault(str(labels["gpu_instance"]), {})[metric] = v

        util = q("nvmlDeviceGetUtilizationRates", h, gpu=i)
        if util is not None:
            put("gpu_util_percent", util.gpu)
            put("gpu_mem_util_percent", util.memory)
        self._gpm_values(i, h, put, cur, ts)
        mem = self._memory_info(i, h)     # v2: used without the driver's reservation (v1 on old drivers)
        if mem is not None:
            put("gpu_memory_used_bytes", mem.used)
            put("gpu_memory_total_bytes", mem.total)
            put("gpu_memory_free_bytes", mem.free)
            put("gpu_memory_reserved_bytes", getattr(mem, "reserved", None))    # v2 only
        pw = q("nvmlDeviceGetPowerUsage", h, gpu=i)
        put("gpu_power_watts", pw / 1000.0 if pw is not None else None)
        lim = q("nvmlDeviceGetEnforcedPowerLimit", h, gpu=i)
        put("gpu_power_limit_watts", lim / 1000.0 if lim is not None else None)
        # nvmlDeviceGetTemperatureV is the successor (the old name is gone in CUDA 14 drivers)
        put("gpu_temperature_celsius", n.query_first((("nvmlDeviceGetTemperatureV", (h, self._temp_gpu)),
                                                      ("nvmlDeviceGetTemperature", (h, self._temp_gpu))), gpu=i))
        # mJ since the driver was loaded (Volta and newer); a counter, as dcgm-exporter exports it
        put("gpu_energy_consumed_mj", q("nvmlDeviceGetTotalEnergyConsumption", h, gpu=i))
        static = self._static_values(i, h)
        put("gpu_sm_clock_mhz", q("nvmlDeviceGetClockInfo", h, self._sm, gpu=i))
        put("gpu_sm_clock_max_mhz", static["sm_max"])
        put("gpu_mem_clock_mhz", q("nvmlDeviceGetClockInfo", h, self._mem, gpu=i))
        put("gpu_mem_clock_max_mhz", static["mem_max"])

        mask = self._throttle_mask(i, h)
        if mask is not None:
            put("gpu_throttle_reasons_bitmask", mask)
            names = decode_throttle(int(mask))
            for name in names:
                put("gpu_throttle_active", 1, {"reason": name})
            cur["throttle_reasons"] = names
            self._throttle_event(i, frozenset(names), int(mask), ts, sink)
            put("gpu_clock_event_sampled_seconds_total", self._hw_slowdown_seconds(i, "hw_slowdown" in names, ts),
                {"reason": "hw_slowdown"})

        put("gpu_pcie_link_gen", q("nvmlDeviceGetCurrPcieLinkGeneration", h, gpu=i))
        put("gpu_pcie_link_width", q("nvmlDeviceGetCurrPcieLinkWidth", h, gpu=i))
        put("gpu_pcie_link_gen_max", static["gen_max"])
        put("gpu_pcie_link_width_max", static["width_max"])
        put("gpu_pcie_replay_count", q("nvmlDeviceGetPcieReplayCounter", h, gpu=i))
        put("gpu_ecc_corrected_total", q("nvmlDeviceGetTotalEccErrors", h, self._ecc_corr, self._ecc_vol, gpu=i))
        put("gpu_ecc_uncorrected_total", q("nvmlDeviceGetTotalEccErrors", h, self._ecc_unc, self._ecc_vol, gpu=i))
        tick = self._ticks.get(i, 0)
        self._ticks[i] = tick + 1
        links = self._nvlink_links_active(i, h, tick)
        if links is not None:
            put("gpu_nvlink_active_links", links)
        want_pcie = self._pcie_counters.get(i, True)
        if not want_pcie and ts / 1e9 >= self._pcie_retry_at.get(i, 0.0):
            want_pcie = True      # time to see whether the counters answer again
        slow = tick % self.health_every == 0
        got = self._field_values(i, h, want_pcie, links, slow)
        self._counters(i, h, ts, put, got, want_pcie)
        self._dcgm_values(i, h, ts, put, cur, got)
        self._health_values(i, h, put, cur, got or {}, tick)
        if self.pods is not None:
            self._pod_values(i, h, put, cur)
        self.last[i] = cur

    def _pod_values(self, i: int, h: Any, put, cur: dict[str, Any]) -> None:
        """``gpu_pod_allocated`` = 1 per container the kubelet says holds this GPU (labels pod, namespace,
        container) or one of its MIG devices (and gpu_instance); ``cur["pods"]`` for the status and exporter.
        A GPU allocated to a pod that runs nothing on it is held all the same (agent/schedulers/kubelet.py)."""
        held: list[dict[str, Any]] = []
        uuid = self._uuids.get(i)
        if uuid is None:
            uuid = self._uuids[i] = self.nvml.text("nvmlDeviceGetUUID", i)
        for ref in self.pods.holders(uuid):
            held.append({**ref.labels(), "gpu_instance": None})
        alloc = [self.pods.allocatable(uuid)]
        if self._static_values(i, h)["mig"]:
            for d in self._mig_devices(i, h):
                for ref in self.pods.holders(d.get("uuid", "")):
                    held.append({**ref.labels(), "gpu_instance": d["gpu_instance_id"]})
                alloc.append(self.pods.allocatable(d.get("uuid", "")))
        known = [a for a in alloc if a is not None]
        if known:       # 1: the kubelet can hand out the GPU (or one of its MIG devices); 0: its plugin withdrew it
            put("gpu_kubelet_allocatable", 1 if any(known) else 0)
        for row in held:
            labels = {k: v for k, v in row.items() if k != "gpu_instance"}
            if row["gpu_instance"] is not None:
                labels["gpu_instance"] = str(row["gpu_instance"])
            put("gpu_pod_allocated", 1, labels)
        cur["pods"] = held

    def _gpm_values(self, i: int, h: Any, put, cur: dict[str, Any], ts: int) -> None:
        """GPM metrics of the GPU (of each busy GPU instance under MIG, read through the instance's MIG
        device handle); ``cur['activity_source']``: 'gpm', 'gpm per GPU instance' (only while an
        instance's read gives values), or 'utilization counter' when only gpu_util_percent exists."""
        gpm = self.gpm
        cur["activity_source"] = "utilization counter"
        if gpm is None or not gpm.supported(i):
            return
        now = ts / 1e9
        if self._static_values(i, h)["mig"]:
            busy = {gi for _, _, gi in self._compute_processes(i, h) if gi >= 0}
            for d in self._mig_devices(i, h):
                gi = d["gpu_instance_id"]
                if gi not in busy:
                    continue
                for name, v in (gpm.read(i, gi, d["handle"], now_s=now) or {}).items():
                    put(name, v, {"gpu_instance": str(gi)})
            if any(gpm.working.get((i, gi)) for gi in busy):
                cur["activity_source"] = "gpm per GPU instance"
            return
        for name, v in (gpm.read(i, now_s=now) or {}).items():
            put(name, v)
        if gpm.working.get((i, None)):
            cur["activity_source"] = "gpm"

    def _static_values(self, i: int, h: Any) -> dict[str, Any]:
        """Maxima that do not change while the driver is loaded: asked once a minute, sent every tick."""
        now = time.monotonic()
        got = self._static.get(i)
        if got is None or now - got["at"] > _STATIC_RECHECK_S:
            q = self.nvml.query
            got = {"at": now,
                   "sm_max": q("nvmlDeviceGetMaxClockInfo", h, self._sm, gpu=i),
                   "mem_max": q("nvmlDeviceGetMaxClockInfo", h, self._mem, gpu=i),
                   "gen_max": q("nvmlDeviceGetMaxPcieLinkGeneration", h, gpu=i),
                   "width_max": q("nvmlDeviceGetMaxPcieLinkWidth", h, gpu=i),
                   "mig": mig_mode_text(q("nvmlDeviceGetMigMode", h, gpu=i, report=False)) == "enabled"}
            self._static[i] = got
        return got

    def _throttle_mask(self, i: int, h: Any) -> Any:
        """Clock-event reasons; drivers before R535 only have the older ThrottleReasons name (and
        CUDA 14 drivers only the new one)."""
        return self.nvml.query_first((("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
                                      ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,))), gpu=i)

    def _hw_slowdown_seconds(self, i: int, active: bool, ts: int) -> float:
        """Seconds of HW_SLOWDOWN as the ticks saw it: nvml.h has clock-event duration fields for power cap,
        sync boost, SW/HW thermal and power brake (NVML_FI_DEV_CLOCKS_EVENT_REASON_*), none for HW_SLOWDOWN,
        so the gap between two ticks that both saw its bit set counts: at most 10 s or three times the gap
        before it, whichever is longer (a tick late by far, after a stall, is not known to have held; a
        steady interval of minutes still counts). A counter from the agent's start; a restart resets it.
        The driver sets HW_SLOWDOWN together with HW thermal or power-brake slowdown, so on those both the
        hw_slowdown and the hw_thermal (or hw_power_brake) rules can hold, in one clocks flag."""
        prev_ts, prev_active, total, prev_gap = self._hw_slowdown.get(i, (ts, False, 0.0, 0))
        gap = ts - prev_ts
        if active and prev_active and gap > 0:
            total += min(gap, max(10_000_000_000, 3 * prev_gap)) / 1e9
        self._hw_slowdown[i] = (ts, active, total, max(gap, 0))
        return total

    def _throttle_event(self, i: int, names: frozenset[str], mask: int, ts: int, sink) -> None:
        relevant = names - {"gpu_idle"}
        prev = self._prev_reasons.get(i, frozenset())
        if relevant != prev:
            added = sorted(relevant - prev)
            removed = sorted(prev - relevant)
            msg = (f"GPU {i} clock-event reasons now {', '.join(sorted(relevant)) or 'none'}"
                   + (f" (added {', '.join(added)})" if added else "")
                   + (f" (cleared {', '.join(removed)})" if removed else ""))
            sink.event("throttle_change", msg, gpu=i, value=float(mask),
                       attrs={"reasons": ",".join(sorted(relevant)), "previous": ",".join(sorted(prev)),
                              "added": ",".join(added), "removed": ",".join(removed)}, ts_ns=ts)
        self._prev_reasons[i] = relevant

    def _nvlink_links_active(self, i: int, h: Any, tick: int) -> int | None:
        """Active NVLink links, from the state of each link (nvmlDeviceGetNvLinkState, links 0, 1, ...
        until one answers an error), re-read every ``health_every`` ticks; None when the GPU has no NVLink."""
        if i not in self._nvlink_links or tick % self.health_every == 0:
            self._read_nvlink_state(i, h)
        return self._nvlink_links.get(i)

    def _read_nvlink_state(self, i: int, h: Any) -> None:
        n = self.nvml
        if n.is_unsupported("nvmlDeviceGetNvLinkState", i) or i in n.lost:
            self._nvlink_links.setdefault(i, None)
            self._nvlink_up.setdefault(i, None)
            return
        up: dict[int, int] | None = None
        for link in range(self._nvl_max):
            st, code = n.query_raw("nvmlDeviceGetNvLinkState", h, link)
            if code is not None:
                if link == 0:   # no NVLink on this GPU (PCIe card, vGPU): say so once
                    n.mark_unsupported("nvmlDeviceGetNvLinkState", i, f"no NVLink (NVML error {code})")
                break
            up = up if up is not None else {}
            up[link] = 1 if int(st) == self._feature_on else 0
        self._nvlink_up[i] = up
        self._nvlink_links[i] = sum(up.values()) if up is not None else None

    def _field_values(self, i: int, h: Any, want_pcie: bool, links: int | None, slow: bool) -> dict[int, Any] | None:
        """The GPU's one nvmlDeviceGetFieldValues call per tick: field id -> value union of the fields
        that answered; None when the whole call failed. It carries the PCIe byte counters (when wanted)
        and NVLink bytes (``_counters``), the memory temperature and raw NVLink bytes (``_dcgm_values``)
        and the health fields (``_health_values``) this GPU has not refused: the NVLink error totals every
        tick, the others when ``slow`` (every ``health_every`` ticks). A health field answering NOT_SUPPORTED
        is not asked again (``_health_values`` says so once, or falls back to a call)."""
        n = self.nvml
        fields: list[tuple[int, int]] = []
        if want_pcie:
            fields += [(self._fi_pcie_tx, 0), (self._fi_pcie_rx, 0)]
        if links is not None:
            # scopeId UINT_MAX: the sum over all links (nvml.h, NVLink throughput field values)
            fields += [(self._fi_nvl_tx, 0xFFFFFFFF), (self._fi_nvl_rx, 0xFFFFFFFF)]
        fields.append((self._fi_mem_temp, 0))
        if links is not None:
            # Data + protocol overhead (nvml.h), summed over all links (scopeId UINT_MAX): DCGM's
            # PROF_NVLINK_*_BYTES count header and payload.
            fields += [(self._fi_nvl_raw_tx, 0xFFFFFFFF), (self._fi_nvl_raw_rx, 0xFFFFFFFF)]
        off = self._fields_off.setdefault(i, set())
        if links is not None:
            fields += [(fid, 0) for fid, _ in _FI_NVLINK_ERR_TOTALS if fid not in off]
        if slow:
            fields += [(fid, 0) for fid in sorted(_SLOW_FIDS - off)]
        vals = n.query("nvmlDeviceGetFieldValues", h, fields, gpu=i)
        if vals is None:
            return None
        got: dict[int, Any] = {}
        for v in vals:
            fid, rc = int(v.fieldId), int(v.nvmlReturn)
            if rc == 0:
                got[fid] = v.value
            elif fid in _HEALTH_FIDS and rc in (ERROR_NOT_SUPPORTED, ERROR_INVALID_ARGUMENT):
                off.add(fid)      # INVALID_ARGUMENT: a field id newer than this driver
        return got

    def _counters(self, i: int, h: Any, ts: int, put, got: dict[int, Any] | None, want_pcie: bool) -> None:
        """PCIe and NVLink byte rates from cumulative counters, from the tick's field-values call.

        Why counters: nvmlDeviceGetPcieThroughput samples for 20 ms per call (2 calls per GPU per
        tick would block the tick for 40 ms x GPUs). When the PCIe byte counter fields
        (NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES) do not answer, it falls back to that snapshot, once every
        ``pcie_fallback_every`` ticks, and asks for the counters again every ``pcie_retry_s`` seconds
        (tick time), so they are used again once they answer.
        """
        n = self.nvml
        t = ts / 1e9
        if got is None and want_pcie and self._pcie_counters.get(i, True) \
                and not n.is_unsupported("nvmlDeviceGetFieldValues", i):
            return    # the whole call failed for now (UNKNOWN, ...): no rates this tick, same mode next
        got = {fid: int(v.ullVal) for fid, v in (got or {}).items()
               if fid in (self._fi_pcie_tx, self._fi_pcie_rx, self._fi_nvl_tx, self._fi_nvl_rx)}
        if want_pcie and self._fi_pcie_tx in got and self._fi_pcie_rx in got:
            if not self._pcie_counters.get(i, True):
                self._pcie_counters[i] = True      # back: the snapshot stops
                self._pcie_fallback_tick.pop(i, None)
            self._rate(("pcie", i), t, got[self._fi_pcie_tx], got[self._fi_pcie_rx], 1.0,
                       "gpu_pcie_tx_bytes_per_s", "gpu_pcie_rx_bytes_per_s", put)
        else:
            if want_pcie:     # dropped out (or still out at a retry): the snapshot until the next retry
                self._pcie_counters[i] = False
                self._pcie_retry_at[i] = t + self.pcie_retry_s
                self._counter_prev.pop(("pcie", i), None)   # no rate across the gap
            self._pcie_fallback(i, h, put)
        if self._fi_nvl_tx in got and self._fi_nvl_rx in got:
            self._rate(("nvlink", i), t, got[self._fi_nvl_tx], got[self._fi_nvl_rx], 1024.0,
                       "gpu_nvlink_tx_bytes_per_s", "gpu_nvlink_rx_bytes_per_s", put)

    # ------------------------------------------------------------------ hardware health
    def _health_values(self, i: int, h: Any, put, cur: dict[str, Any], got: dict[int, Any], tick: int) -> None:
        """Aggregate ECC, retired pages, clock-event durations (from the field values, every ``health_every``
        ticks) and NVLink per-link state and errors (docs/METRICS.md "GPU sampler"). A field this GPU
        refuses falls back to its call (ECC, retired pages) or is reported once (clock events)."""
        n = self.nvml
        if i in n.lost:
            return
        if tick % self.health_every:
            cur["clock_event_seconds"] = self._clock_s.get(i, {})
            self._nvlink_health(i, h, put, cur, got, tick)
            return
        refused = self._fields_off.get(i, set())       # fields this GPU answered NOT_SUPPORTED
        # without field values at all (the call is NOT_SUPPORTED: said once for the call), every field is off
        off = _HEALTH_FIDS if n.is_unsupported("nvmlDeviceGetFieldValues", i) else refused
        for fid, metric, etype in _FI_ECC_AGG:   # lifetime counts (volatile + earlier driver loads)
            if fid in got:
                put(metric, got[fid].ullVal)
            elif fid in off:
                put(metric, n.query("nvmlDeviceGetTotalEccErrors", h, etype, self._ecc_agg, gpu=i,
                                    key="nvmlDeviceGetTotalEccErrors (aggregate)"))
        self._retired_pages(i, h, put, cur, got, off)
        clocks: dict[str, float] = {}
        for fid, reason in _FI_CLOCK_EVENTS:
            if fid in got:
                clocks[reason] = int(got[fid].ullVal) / 1e9      # ns -> s
                put("gpu_clock_event_duration_seconds_total", clocks[reason], {"reason": reason})
            elif fid in refused:
                n.mark_unsupported(f"clock-event duration {reason}", i,
                                   f"field value {fid} not supported by this GPU or driver")
        self._clock_s[i] = clocks
        cur["clock_event_seconds"] = clocks
        self._nvlink_health(i, h, put, cur, got, tick)

    def _retired_pages(self, i: int, h: Any, put, cur: dict[str, Any], got: dict[int, Any], off: set[int]) -> None:
        """Pages retired per cause and pages pending retirement: the field values, else (a driver without
        them) nvmlDeviceGetRetiredPages per cause and ...PendingStatus; both every ``health_every`` ticks. GPUs from
        Ampere on remap rows instead and answer NOT_SUPPORTED: never asked again, and said once only
        where the GPU has no row remapping either."""
        n = self.nvml
        if _FI_RETIRED_SBE in got and _FI_RETIRED_DBE in got:
            sbe, dbe = int(got[_FI_RETIRED_SBE].ullVal), int(got[_FI_RETIRED_DBE].ullVal)
            pend = int(got[_FI_RETIRED_PENDING].ullVal) if _FI_RETIRED_PENDING in got else None
        elif _FI_RETIRED_SBE in off or _FI_RETIRED_DBE in off:
            if n.is_unsupported("nvmlDeviceGetRetiredPages", i):
                return
            # NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS (0), _DOUBLE_BIT_ECC_ERROR (1)
            got_sbe = n.query("nvmlDeviceGetRetiredPages", h, 0, gpu=i, report=False)
            if got_sbe is None:
                # GPUs from Ampere on remap rows instead: nothing is missing where gpu_remapped_rows_* come
                if n.is_unsupported("nvmlDeviceGetRetiredPages", i) and "gpu_remapped_rows_pending" not in cur:
                    n.mark_unsupported("retired pages", i, "nvmlDeviceGetRetiredPages not supported and no "
                                       "row remapping either: no memory page retirement figures")
                return
            got_dbe = n.query("nvmlDeviceGetRetiredPages", h, 1, gpu=i)
            if got_dbe is None:
                return
            sbe, dbe = len(got_sbe), len(got_dbe)
            pend = n.query("nvmlDeviceGetRetiredPagesPendingStatus", h, gpu=i)
        else:
            return
        put("gpu_retired_pages_total", sbe, {"cause": "single_bit_ecc"})
        put("gpu_retired_pages_total", dbe, {"cause": "double_bit_ecc"})
        if pend is not None:
            put("gpu_retired_pages_pending", 1 if pend else 0)

    def _nvlink_health(self, i: int, h: Any, put, cur: dict[str, Any], got: dict[int, Any], tick: int) -> None:
        """gpu_nvlink_link_up{link} for each link that answers its state, and
        gpu_nvlink_errors_total{link,counter} (nvmlDeviceGetNvLinkErrorCounter per link and counter: the
        per-link field ids stop at link 11, an H100 has 18). The link state is read every ``health_every``
        ticks; the per-link errors on the first tick and whenever one of the GPU's NVLink error totals (4
        field values, every tick) changed (then the state too), so unchanged totals mean unchanged links;
        where the totals do not answer, every ``health_every`` ticks. Both series are emitted on those
        ticks only."""
        n = self.nvml
        if self._nvlink_up.get(i) is None:
            return
        fids = [f for f, _ in _FI_NVLINK_ERR_TOTALS]
        totals = tuple(int(got[f].ullVal) for f in fids) if all(f in got for f in fids) else None
        regular = tick % self.health_every == 0
        changed = totals is not None and totals != self._nvlink_totals.get(i)
        if i not in self._nvlink_err or changed or (regular and totals is None):
            if not regular:                   # a total moved between the regular reads: the state too
                self._read_nvlink_state(i, h)
            errs: dict[int, dict[str, int]] = {}
            for link in self._nvlink_up.get(i) or {}:
                row: dict[str, int] = {}
                for name, cid in _NVLINK_ERRORS:
                    v = n.query("nvmlDeviceGetNvLinkErrorCounter", h, link, cid, gpu=i,
                                key=f"nvmlDeviceGetNvLinkErrorCounter ({name})")
                    if v is not None:
                        row[name] = int(v)
                errs[link] = row
            self._nvlink_err[i] = errs
            self._nvlink_totals[i] = totals
            self._nvlink_bad[i] = {k: v for k, v in errs.items() if any(v.values())}
        elif not regular:
            cur["nvlink_link_up"], cur["nvlink_errors"] = self._nvlink_up.get(i) or {}, self._nvlink_bad.get(i, {})
            return
        up = self._nvlink_up.get(i) or {}
        errs = self._nvlink_err.get(i, {})
        for link, state in up.items():
            put("gpu_nvlink_link_up", state, {"link": str(link)})
            for name, v in errs.get(link, {}).items():
                put("gpu_nvlink_errors_total", v, {"link": str(link), "counter": name})
        cur["nvlink_link_up"], cur["nvlink_errors"] = up, self._nvlink_bad.get(i, {})

    def _rate(self, key, t: float, tx: int, rx: int, scale: float, m_tx: str, m_rx: str, put) -> None:
        prev = self._counter_prev.get(key)
        self._counter_prev[key] = (t, tx, rx)
        if prev is not None and t > prev[0] and tx >= prev[1] and rx >= prev[2]:   # skip resets
            dt = t - prev[0]
            put(m_tx, (tx - prev[1]) * scale / dt)
            put(m_rx, (rx - prev[2]) * scale / dt)

    def _pcie_fallback(self, i: int, h: Any, put) -> None:
        k = self._pcie_fallback_tick.get(i, 0)
        self._pcie_fallback_tick[i] = k + 1
        if k % self.pcie_fallback_every:
            return
        q = self.nvml.query
        tx = q("nvmlDeviceGetPcieThroughput", h, self._tx, gpu=i)   # KB/s over a 20 ms window
        if tx is None:
            return
        rx = q("nvmlDeviceGetPcieThroughput", h, self._rx, gpu=i)
        put("gpu_pcie_tx_bytes_per_s", tx * 1024.0)
        put("gpu_pcie_rx_bytes_per_s", rx * 1024.0 if rx is not None else None)

    # ------------------------------------------------------------------ dcgm-exporter's defaults
    def _dcgm_values(self, i: int, h: Any, ts: int, put, cur: dict[str, Any], got: dict[int, Any] | None) -> None:
        """The values behind dcgm-exporter's default metrics that the reads above do not cover
        (docs/EXPORTER.md): memory temperature, video engines, row remapping, the vGPU license, NVLink
        bytes with protocol headers, and the MIG GPU instances."""
        n = self.nvml
        q = n.query
        if i in n.lost:
            return
        enc = q("nvmlDeviceGetEncoderUtilization", h, gpu=i)       # [percent, sampling period in us]
        put("gpu_encoder_util_percent", enc[0] if enc else None)
        dec = q("nvmlDeviceGetDecoderUtilization", h, gpu=i)
        put("gpu_decoder_util_percent", dec[0] if dec else None)
        rows = q("nvmlDeviceGetRemappedRows", h, gpu=i)     # (correctable, uncorrectable, pending, failure)
        if rows is not None:
            put("gpu_remapped_rows_correctable_total", rows[0])
            put("gpu_remapped_rows_uncorrectable_total", rows[1])
            put("gpu_remapped_rows_pending", rows[2])
            put("gpu_row_remap_failure", rows[3])
        put("gpu_vgpu_license_status", self._vgpu_license(i, h))
        got = got or {}
        if self._fi_mem_temp in got:
            temp = int(got[self._fi_mem_temp].uiVal)
            put("gpu_memory_temperature_celsius", temp if temp <= 200 else None)   # DCGM drops > 200 too
        if self._fi_nvl_raw_tx in got and self._fi_nvl_raw_rx in got:
            self._rate(("nvlink_raw", i), ts / 1e9, int(got[self._fi_nvl_raw_tx].ullVal),
                       int(got[self._fi_nvl_raw_rx].ullVal), 1024.0, "gpu_nvlink_raw_tx_bytes_per_s",
                       "gpu_nvlink_raw_rx_bytes_per_s", put)
        if self._static_values(i, h)["mig"]:
            cur["mig_instances"] = self._mig_instances(i, h, put, cur.get("by_instance", {}))

    def _vgpu_license(self, i: int, h: Any) -> int | None:
        """DCGM's DCGM_FI_DEV_VGPU_LICENSE_STATUS: 1 when the vGPU feature's state is non-zero, 0 when the
        GPU has no GRID licensing (DcgmCacheManager.cpp, DCGM_FI_DEV_VGPU_LICENSE_STATUS)."""
        lic = self.nvml.query("nvmlDeviceGetGridLicensableFeatures_v4", h, gpu=i)
        if lic is None:
            return None
        if not int(lic.isGridLicenseSupported):
            return 0
        vgpu = self.nvml.const("NVML_GRID_LICENSE_FEATURE_CODE_VGPU", 1)
        for k in range(min(int(lic.licensableFeaturesCount), len(lic.gridLicensableFeatures))):
            feat = lic.gridLicensableFeatures[k]
            if int(feat.featureCode) == vgpu:
                return 1 if int(feat.featureState) > 0 else 0
        return None

    def _mig_instances(self, i: int, h: Any, put, by_instance: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
        """The GPU instances of a MIG GPU, from the one MIG device listing (``_mig_devices``: instance id
        and profile from the MIG device handle, no privileges needed): each instance's framebuffer
        (nvmlMemory_v2 on the MIG device handle, v1 without it) and the GPM values read per instance
        this tick (GpuInstanceStatus fields)."""
        out = []
        for d in self._mig_devices(i, h):
            gi = d["gpu_instance_id"]
            row: dict[str, Any] = {"gpu_instance_id": gi, "profile": d["profile"]}
            mem = self._memory_info(i, d["handle"], _MIG_DEV)
            if mem is not None:
                labels = {"gpu_instance": str(gi), "profile": d["profile"]}
                for key, v in (("memory_used_bytes", mem.used), ("memory_free_bytes", mem.free),
                               ("memory_total_bytes", mem.total),
                               ("memory_reserved_bytes", getattr(mem, "reserved", None))):   # v2 only
                    if v is not None:
                        row[key] = float(v)
                        put(f"gpu_instance_{key}", v, labels)
            for metric, field in _GPM_INSTANCE_FIELDS.items():
                v = by_instance.get(str(gi), {}).get(metric)
                if v is not None:
                    row[field] = v
            out.append(row)
        if not out:
            self.nvml.mark_unsupported("MIG GPU instances", i, "MIG is on but NVML listed no GPU instance (none "
                                       "created, or nvmlDeviceGetMigDeviceHandleByIndex is not available)")
        return out

    def close(self) -> None:
        if self.gpm is not None:
            self.gpm.close()
        if self._event_set is not None:
            self.nvml.query("nvmlEventSetFree", self._event_set)
            self._event_set = None
        self.nvml.shutdown()


def _used(p: Any) -> int | None:
    """A process's usedGpuMemory; None for NVML_VALUE_NOT_AVAILABLE (pynvml already turns it into None)."""
    used = getattr(p, "usedGpuMemory", None)
    return None if used is None or int(used) == 0xFFFFFFFFFFFFFFFF else int(used)


def _same_handle(a: Any, b: Any) -> bool:
    """Whether two nvmlDevice_t (ctypes pointers, which compare by identity) point at the same device."""
    import ctypes  # noqa: PLC0415  (only for this rare path)
    try:
        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return a is b


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def _bus_id(pci: Any) -> str:
    if pci is None:
        return ""
    b = getattr(pci, "busId", "")
    return b.decode() if isinstance(b, bytes) else str(b)


def _sysfs_numa_cpus(sys_root: str) -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from <sys_root>/devices/system/node/node*/cpulist ({} when absent)."""
    out: dict[int, set[int]] = {}
    base = os.path.join(sys_root, "devices", "system", "node")
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        try:
            with open(os.path.join(base, name, "cpulist")) as f:
                text = f.read().strip()
            cpus: set[int] = set()
            for part in filter(None, text.split(",")):
                a, _, b = part.partition("-")
                cpus.update(range(int(a), int(b or a) + 1))
        except (OSError, ValueError):
            continue
        out[int(name[4:])] = cpus
    return out


def _numa_from_sysfs(bus_id: str, sys_root: str = "/sys") -> int | None:
    """NUMA node of a PCI device from sysfs (NVML's bus id has 8 domain digits, sysfs has 4)."""
    dev = sysfs_bus_id(bus_id)
    if not dev:
        return None
    path = f"{sys_root}/bus/pci/devices/{dev}/numa_node"
    try:
        with open(path) as f:
            v = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return v if v >= 0 else None
