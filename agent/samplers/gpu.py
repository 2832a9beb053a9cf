"""GPU sampler: per-GPU NVML telemetry each tick, XID and throttle-change events, per-process GPU usage.

All NVML access goes through :class:`gpuagent.common.nvml.Nvml` (one choke point). A metric the driver
does not offer is skipped after being reported once (as a ``metric_unavailable`` event and in
``Nvml.unavailable``); without NVML at all the sampler emits one ``nvml_unavailable`` event and then
does nothing, so the agent runs host-only. Metric names: docs/METRICS.md ("GPU sampler").

This module is the tick: utilization, memory, power, temperature, clocks, clock-event reasons, PCIe link and
volatile ECC, and the order of the reads. The other jobs of the one sampler live beside it, each a mixin
of :class:`GpuSampler` that owns its state: the inventory and NUMA placement (gpu_inventory.py), the
per-process usage (gpu_processes.py), MIG GPU instances (gpu_mig.py), GPM (gpu_gpm.py), the one field-values
call and the PCIe/NVLink byte rates (gpu_fields.py), hardware health (gpu_health.py), the values behind
dcgm-exporter's defaults (gpu_dcgm.py) and XID events (gpu_events.py).

The framebuffer's used/free/reserved come from the tick's one memory read (nvmlMemory_v2, v1 fallback).

Events:
- ``xid``: gpu_events.py.
- ``gpu_lost``: the GPU answered GPU_IS_LOST (fell off the bus); it is not queried again.
- ``throttle_change``: the decoded set of clock-event reasons changed (``gpu_idle`` alone does not
  trigger it: an idle GPU is not throttled in any way that matters); attrs carry old/new names.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from gpuagent.agent.samplers.gpu_dcgm import GpuDcgmMixin
from gpuagent.agent.samplers.gpu_events import GpuEventsMixin
from gpuagent.agent.samplers.gpu_fields import PCIE_RETRY_S, GpuFieldsMixin
from gpuagent.agent.samplers.gpu_gpm import GpuGpmMixin
from gpuagent.agent.samplers.gpu_health import GpuHealthMixin
from gpuagent.agent.samplers.gpu_inventory import GpuInventoryMixin, mig_mode_text
from gpuagent.agent.samplers.gpu_mig import GpuMigMixin
from gpuagent.agent.samplers.gpu_processes import GpuProcessesMixin
from gpuagent.common.nvml import Nvml, decode_throttle

log = logging.getLogger("gpuagent.gpu_sampler")

_HEALTH_EVERY = 10        # ticks between reads of NVLink link state / per-link errors (and retired pages by call)
_STATIC_RECHECK_S = 60.0  # max clocks and max PCIe link: re-read this often
_MEMORY_V2 = 0x02000028   # nvml.h nvmlMemory_v2: NVML_STRUCT_VERSION(Memory, 2) (pynvml.nvmlMemory_v2)


class GpuSampler(GpuInventoryMixin, GpuProcessesMixin, GpuMigMixin, GpuGpmMixin, GpuFieldsMixin, GpuHealthMixin,
                 GpuDcgmMixin, GpuEventsMixin):
    """Sampler (agent/samplers/sampling.py) over all GPUs NVML sees."""

    name = "gpu"

    def __init__(self, nvml: Nvml | None = None, pcie_fallback_every: int = 10, gpm: bool = True,
                 sys_root: str = "/sys", pcie_retry_s: float = PCIE_RETRY_S,
                 health_every: int = _HEALTH_EVERY) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self._init_inventory(sys_root)
        self._init_processes()
        self._init_mig()
        self._init_gpm(gpm)
        self._init_fields(pcie_fallback_every, pcie_retry_s)
        self._init_health(health_every)
        self._announced_off = False
        self._prev_reasons: dict[int, frozenset[str]] = {}
        self._static: dict[int, dict[str, Any]] = {}
        self._ticks: dict[int, int] = {}                 # GPU -> ticks sampled so far
        # GPU -> (last tick's ns, HW_SLOWDOWN bit then, seconds counted so far, the gap before that tick):
        # NVML has no duration for it
        self._hw_slowdown: dict[int, tuple[int, bool, float, int]] = {}
        self.last: dict[int, dict[str, Any]] = {}   # latest values per GPU, for `gpuagent status`
        self.pods: Any = None                       # agent/kubelet.PodResources on a Kubernetes node, else None
        self._uuids: dict[int, str] = {}
        n = self.nvml
        if n.available:
            self._sm = n.const("NVML_CLOCK_SM", 1)
            self._mem = n.const("NVML_CLOCK_MEM", 2)
            self._temp_gpu = n.const("NVML_TEMPERATURE_GPU", 0)
            self._ecc_corr = n.const("NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
            self._ecc_unc = n.const("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
            self._ecc_vol = n.const("NVML_VOLATILE_ECC", 0)
        self._init_events()

    def _memory_info(self, i: int, h: Any, suffix: str = "") -> Any:
        """nvmlMemory_v2 (``used`` without the driver's reservation, ``reserved`` apart), or v1 (where
        ``used`` includes it, no ``reserved``) on drivers without nvmlDeviceGetMemoryInfo_v2. The one
        memory read of a GPU (or, with ``suffix`` gpu_mig.MIG_DEV, of a MIG device handle) per tick. A driver
        without _v2 is reported once per GPU: the reservation is then unknown."""
        n = self.nvml
        v2 = "nvmlDeviceGetMemoryInfo_v2" + suffix
        if not n.is_unsupported(v2, i):
            # pynvml: nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2) calls the _v2 symbol
            mem = n.query("nvmlDeviceGetMemoryInfo", h, n.const("nvmlMemory_v2", _MEMORY_V2), gpu=i, key=v2)
            if mem is not None or not n.is_unsupported(v2, i):
                return mem
        return n.query("nvmlDeviceGetMemoryInfo", h, gpu=i, key="nvmlDeviceGetMemoryInfo" + suffix)

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
        want_pcie = self._want_pcie(i, ts)
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

    def close(self) -> None:
        if self.gpm is not None:
            self.gpm.close()
        self._close_events()
        self.nvml.shutdown()
