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

Events:
- ``xid``: value = the XID number, from nvmlEventSetWait with a 0 ms timeout each tick (never blocks).
- ``gpu_lost``: the GPU answered GPU_IS_LOST (fell off the bus); it is not queried again.
- ``throttle_change``: the decoded set of clock-event reasons changed (``gpu_idle`` alone does not
  trigger it: an idle GPU is not throttled in any way that matters); attrs carry old/new names.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from gpuagent.common.nvml import EVENT_TYPE_XID, VIRT_MODES, Gpm, Nvml, decode_throttle, sysfs_bus_id

log = logging.getLogger("gpuagent.gpu_sampler")

_NVLINK_RECHECK_S = 60.0  # link state rarely changes; re-count active links this often
_STATIC_RECHECK_S = 60.0  # max clocks and max PCIe link: re-read this often
_MAX_EVENTS_PER_TICK = 256

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
    """Sampler (agent/sampling.py) over all GPUs NVML sees."""

    name = "gpu"

    def __init__(self, nvml: Nvml | None = None, pcie_fallback_every: int = 10, gpm: bool = True) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self.gpm = Gpm(self.nvml) if gpm and self.nvml.available else None
        self._announced_off = False
        self._prev_reasons: dict[int, frozenset[str]] = {}
        self._counter_prev: dict[tuple[str, int], tuple[float, int, int]] = {}
        self._static: dict[int, dict[str, Any]] = {}
        self._pcie_counters: dict[int, bool] = {}
        self._pcie_fallback_tick: dict[int, int] = {}
        self.pcie_fallback_every = pcie_fallback_every
        self._nvlink_links: dict[int, int | None] = {}
        self._nvlink_checked: dict[int, float] = {}
        self._proc_last_seen_us: dict[int, int] = {}
        self._event_set: Any = None
        self._event_gpus: set[int] = set()
        self._events_ready = False
        self.last: dict[int, dict[str, Any]] = {}   # latest values per GPU, for `gpuagent status`
        self.last_xid: dict[int, int] = {}          # GPU -> the latest XID seen (dcgm-exporter's XID_ERRORS)
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
            self._setup_events()

    # ------------------------------------------------------------------ inventory
    def gpu_inventory(self) -> list[dict[str, Any]]:
        """One dict per GPU with the proto GpuInfo field names (for Register and `status`)."""
        n = self.nvml
        out = []
        for i in range(n.device_count):
            h = n.handle(i)
            pci = n.query("nvmlDeviceGetPciInfo", h, gpu=i)
            mem = n.query("nvmlDeviceGetMemoryInfo", h, gpu=i)
            numa = n.query("nvmlDeviceGetNumaNodeId", h, gpu=i)
            bus = _bus_id(pci)
            if numa is None:
                numa = _numa_from_sysfs(bus)
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

    # ------------------------------------------------------------------ per-process usage
    def processes(self) -> list[dict[str, Any]]:
        """Processes on each GPU: {pid, gpu, gpu_memory_bytes, gpu_util_percent, gpu_instance_id}.

        For job discovery. Utilization is the mean SM utilization of the process's samples from
        nvmlDeviceGetProcessUtilization newer than the previous call. NVML only keeps samples for
        processes that ran kernels, so a listed process without one was idle (0); -1 means unknown
        (the call is not supported, e.g. under MIG).
        """
        n = self.nvml
        fn = "nvmlDeviceGetProcessUtilization"
        out: list[dict[str, Any]] = []
        for i in range(n.device_count):
            h = n.handle(i)
            procs = n.query("nvmlDeviceGetComputeRunningProcesses", h, gpu=i)
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
            for p in procs:
                pid = int(p.pid)
                used = getattr(p, "usedGpuMemory", None)
                gi = getattr(p, "gpuInstanceId", 0xFFFFFFFF)
                vals = util.get(pid)
                out.append({"pid": pid, "gpu": i,
                            "gpu_memory_bytes": float(used) if used is not None else 0.0,
                            "gpu_util_percent": (sum(vals) / len(vals)) if vals else (0.0 if known else -1.0),
                            # MIG: the GPU instance the process runs in (-1 when MIG is off)
                            "gpu_instance_id": -1 if gi in (None, 0xFFFFFFFF) else int(gi)})
        return out

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
            gpu = int(gpu) if gpu is not None else -1
            xid = int(data.eventData)
            what = XID_DESCRIPTIONS.get(xid, "")
            if gpu >= 0:
                self.last_xid[gpu] = xid
            sink.event("xid", f"XID {xid} on GPU {gpu}" + (f" ({what})" if what else ""), gpu=gpu,
                       value=float(xid), attrs={"xid": str(xid), "description": what,
                                                "event_type": hex(int(data.eventType))}, ts_ns=ts_ns)

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

        util = q("nvmlDeviceGetUtilizationRates", h, gpu=i)
        if util is not None:
            put("gpu_util_percent", util.gpu)
            put("gpu_mem_util_percent", util.memory)
        self._gpm_values(i, h, put, cur)
        mem = q("nvmlDeviceGetMemoryInfo", h, gpu=i)
        if mem is not None:
            put("gpu_memory_used_bytes", mem.used)
            put("gpu_memory_total_bytes", mem.total)
        pw = q("nvmlDeviceGetPowerUsage", h, gpu=i)
        put("gpu_power_watts", pw / 1000.0 if pw is not None else None)
        lim = q("nvmlDeviceGetEnforcedPowerLimit", h, gpu=i)
        put("gpu_power_limit_watts", lim / 1000.0 if lim is not None else None)
        put("gpu_temperature_celsius", q("nvmlDeviceGetTemperature", h, self._temp_gpu, gpu=i))
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

        put("gpu_pcie_link_gen", q("nvmlDeviceGetCurrPcieLinkGeneration", h, gpu=i))
        put("gpu_pcie_link_width", q("nvmlDeviceGetCurrPcieLinkWidth", h, gpu=i))
        put("gpu_pcie_link_gen_max", static["gen_max"])
        put("gpu_pcie_link_width_max", static["width_max"])
        put("gpu_pcie_replay_count", q("nvmlDeviceGetPcieReplayCounter", h, gpu=i))
        put("gpu_ecc_corrected_total", q("nvmlDeviceGetTotalEccErrors", h, self._ecc_corr, self._ecc_vol, gpu=i))
        put("gpu_ecc_uncorrected_total", q("nvmlDeviceGetTotalEccErrors", h, self._ecc_unc, self._ecc_vol, gpu=i))
        self._counters(i, h, ts, put)
        self.last[i] = cur

    def _gpm_values(self, i: int, h: Any, put, cur: dict[str, Any]) -> None:
        """GPM metrics of the GPU (of each busy GPU instance under MIG); ``cur['activity_source']``:
        'gpm', 'gpm per GPU instance', or 'utilization counter' when only gpu_util_percent exists."""
        gpm = self.gpm
        cur["activity_source"] = "utilization counter"
        if gpm is None or not gpm.supported(i):
            return
        if self._static_values(i, h)["mig"]:
            procs = self.nvml.query("nvmlDeviceGetComputeRunningProcesses", h, gpu=i) or ()
            instances = sorted({int(p.gpuInstanceId) for p in procs
                                if getattr(p, "gpuInstanceId", None) not in (None, 0xFFFFFFFF)})
            for gi in instances:
                for name, v in (gpm.read(i, gi) or {}).items():
                    put(name, v, {"gpu_instance": str(gi)})
            cur["activity_source"] = "gpm per GPU instance"
            return
        vals = gpm.read(i)
        if vals is None:
            return      # first tick: GPM needs two samples
        for name, v in vals.items():
            put(name, v)
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
        """Clock-event reasons; drivers before R535 only have the older ThrottleReasons name."""
        n = self.nvml
        new_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        if not n.is_unsupported(new_fn, i):
            v = n.query(new_fn, h, gpu=i, report=False)
            if v is not None or not n.is_unsupported(new_fn, i):
                return v
        return n.query("nvmlDeviceGetCurrentClocksThrottleReasons", h, gpu=i)

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

    def _nvlink_links_active(self, i: int, h: Any) -> int | None:
        """Active NVLink links (re-counted every minute); None when the GPU has no NVLink."""
        n = self.nvml
        now = time.monotonic()
        if i not in self._nvlink_links or now - self._nvlink_checked.get(i, 0.0) > _NVLINK_RECHECK_S:
            self._nvlink_checked[i] = now
            active = None
            for link in range(self._nvl_max):
                st, code = n.query_raw("nvmlDeviceGetNvLinkState", h, link)
                if code is not None:
                    if link == 0:   # no NVLink on this GPU (PCIe card, vGPU): say so once
                        n.mark_unsupported("nvmlDeviceGetNvLinkState", i, f"no NVLink (NVML error {code})")
                    break
                active = (active or 0) + (1 if int(st) == self._feature_on else 0)
            self._nvlink_links[i] = active
        return self._nvlink_links.get(i)

    def _counters(self, i: int, h: Any, ts: int, put) -> None:
        """PCIe and NVLink byte rates from cumulative counters, in one nvmlDeviceGetFieldValues call.

        Why counters: nvmlDeviceGetPcieThroughput samples for 20 ms per call (2 calls per GPU per
        tick would block the tick for 40 ms x GPUs). Drivers without the PCIe byte counter fields
        (NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES) fall back to it, once every ``pcie_fallback_every`` ticks.
        """
        n = self.nvml
        links = self._nvlink_links_active(i, h)
        if links is not None:
            put("gpu_nvlink_active_links", links)
        want_pcie = self._pcie_counters.get(i, True)
        fields: list[tuple[int, int]] = []
        if want_pcie:
            fields += [(self._fi_pcie_tx, 0), (self._fi_pcie_rx, 0)]
        if links is not None:
            # scopeId UINT_MAX: the sum over all links (nvml.h, NVLink throughput field values)
            fields += [(self._fi_nvl_tx, 0xFFFFFFFF), (self._fi_nvl_rx, 0xFFFFFFFF)]
        got: dict[int, int] = {}
        if fields:
            vals = n.query("nvmlDeviceGetFieldValues", h, fields, gpu=i)
            for v in vals or ():
                if int(v.nvmlReturn) == 0:
                    got[int(v.fieldId)] = int(v.value.ullVal)
        t = ts / 1e9
        if want_pcie and self._fi_pcie_tx in got and self._fi_pcie_rx in got:
            self._rate(("pcie", i), t, got[self._fi_pcie_tx], got[self._fi_pcie_rx], 1.0,
                       "gpu_pcie_tx_bytes_per_s", "gpu_pcie_rx_bytes_per_s", put)
        else:
            if want_pcie:
                self._pcie_counters[i] = False
            self._pcie_fallback(i, h, put)
        if self._fi_nvl_tx in got and self._fi_nvl_rx in got:
            self._rate(("nvlink", i), t, got[self._fi_nvl_tx], got[self._fi_nvl_rx], 1024.0,
                       "gpu_nvlink_tx_bytes_per_s", "gpu_nvlink_rx_bytes_per_s", put)

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

    def close(self) -> None:
        if self.gpm is not None:
            self.gpm.close()
        if self._event_set is not None:
            self.nvml.query("nvmlEventSetFree", self._event_set)
            self._event_set = None
        self.nvml.shutdown()


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def _bus_id(pci: Any) -> str:
    if pci is None:
        return ""
    b = getattr(pci, "busId", "")
    return b.decode() if isinstance(b, bytes) else str(b)


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
