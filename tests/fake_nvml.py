"""A fake NVML backend (the ONE allowed fake, at agent/nvml.py's seam) built from recorded-shape values.

It exposes pynvml's function names and constants and raises pynvml's own exception classes
(``pynvml.NVMLError(code)``), so agent/nvml.py cannot tell it from the library. Values come from a
JSON fixture in tests/data/ whose ``_sources`` say where each kind of value comes from; they are
SYNTHETIC, never presented as measurements.

Cumulative counters (NVLink KiB) only move when a test calls :meth:`FakeNvmlBackend.advance`, so rate
computations are deterministic. Tests can also flip throttle bits and inject XID events.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

DATA = Path(__file__).parent / "data"
H100_8GPU = DATA / "nvml_8gpu_h100_sxm.json"
ENERGY_START_MJ = 3_600_000_000   # SYNTHETIC: 1 kWh consumed before the fake clock starts
A10_VGPU = DATA / "nvml_1gpu_a10_vgpu.json"


def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class _Handle:
    """Stands for an nvmlDevice_t."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


class FakeNvmlBackend:
    def __init__(self, fixture: Path | str = H100_8GPU, *, init_error: int | None = None) -> None:
        doc = json.loads(Path(fixture).read_text())
        self.doc = doc
        self.gpus: list[dict[str, Any]] = [dict(g) for g in doc["gpus"]]
        self.handles = [_Handle(g["index"]) for g in self.gpus]
        self.init_error = init_error
        self.initialized = False
        self.calls: dict[str, int] = {}
        self.now_us = 1_700_000_000_000_000
        self.start_us = self.now_us
        self.nvlink_tx_kib = [0] * len(self.gpus)
        self.nvlink_rx_kib = [0] * len(self.gpus)
        self.pcie_tx_bytes = [0] * len(self.gpus)
        self.pcie_rx_bytes = [0] * len(self.gpus)
        self._event_sets: list[dict[str, Any]] = []
        self.wait_timeouts_ms: list[int] = []
        self.lost: set[int] = set()
        self.pcie_throughput_calls = 0
        self._pending_events = [dict(e) for e in doc.get("events", [])]
        self._gpm_samples: dict[int, Any] = {}     # sample address -> (buffer, taken: (gpu, gi, us) | None)

    # Constants and error classes come from the real binding.
    def __getattr__(self, name: str) -> Any:
        if (name.startswith("NVML") or name.startswith("nvmlEventType") or name.startswith("nvmlClocks")
                or name.startswith("c_nvmlGpm")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # ------------------------------------------------------------------ test controls
    def advance(self, seconds: float) -> None:
        """Let time pass on the fake GPUs: counters grow at the fixture's rates."""
        self.now_us += int(seconds * 1e6)
        for i, g in enumerate(self.gpus):
            self.nvlink_tx_kib[i] += int(g["nvlink_tx_kib_per_s"] * seconds)
            self.nvlink_rx_kib[i] += int(g["nvlink_rx_kib_per_s"] * seconds)
            self.pcie_tx_bytes[i] += int(g["pcie_tx_kb_per_s"] * 1024 * seconds)
            self.pcie_rx_bytes[i] += int(g["pcie_rx_kb_per_s"] * 1024 * seconds)

    def set_throttle(self, gpu: int, mask: int) -> None:
        self.gpus[gpu]["throttle_mask"] = mask

    def inject_xid(self, gpu: int, xid: int) -> None:
        self._deliver({"gpu": gpu, "kind": "xid", "xid": xid})

    def remove_process(self, pid: int) -> None:
        for g in self.gpus:
            g["processes"] = [p for p in g["processes"] if p["pid"] != pid]

    def add_process(self, gpu: int, pid: int, used_memory_bytes: int, sm_util_percent: int,
                    gpu_instance_id: int = 0) -> None:
        self.gpus[gpu]["processes"].append({"pid": pid, "used_memory_bytes": used_memory_bytes,
                                            "sm_util_percent": sm_util_percent, "mem_util_percent": 0,
                                            "gpu_instance_id": gpu_instance_id})

    def lose_gpu(self, gpu: int) -> None:
        """The GPU falls off the bus: every call on it answers GPU_IS_LOST from now on."""
        self.lost.add(gpu)

    def _deliver(self, ev: dict[str, Any]) -> None:
        delivered = False
        for s in self._event_sets:
            if ev["gpu"] in s["devices"]:
                s["queue"].append(ev)
                delivered = True
        if not delivered:
            self._pending_events.append(ev)

    # ------------------------------------------------------------------ helpers
    def _g(self, handle: _Handle, fn: str) -> dict[str, Any]:
        self.calls[fn] = self.calls.get(fn, 0) + 1
        if not self.initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        g = self.gpus[handle.index]
        if handle.index in self.lost:
            raise _err(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in g.get("not_supported", ()):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g

    # ------------------------------------------------------------------ pynvml API
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise _err(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.doc["driver_version"]

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self.doc["cuda_driver_version"])

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialized:
            raise _err(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> _Handle:
        if not 0 <= i < len(self.handles):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[i]

    def nvmlDeviceGetIndex(self, h: _Handle) -> int:
        return h.index

    def nvmlDeviceGetName(self, h):
        return self._g(h, "nvmlDeviceGetName")["name"]

    def nvmlDeviceGetUUID(self, h):
        return self._g(h, "nvmlDeviceGetUUID")["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        g = self._g(h, "nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=g["pci_bus_id"], busIdLegacy=g["pci_bus_id"][4:])

    def nvmlDeviceGetNumaNodeId(self, h):
        g = self._g(h, "nvmlDeviceGetNumaNodeId")
        if g["numa_node"] < 0:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g["numa_node"]

    def nvmlDeviceGetMemoryInfo(self, h):
        g = self._g(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=g["memory_total_bytes"], used=g["memory_used_bytes"],
                               free=g["memory_total_bytes"] - g["memory_used_bytes"])

    def nvmlDeviceGetUtilizationRates(self, h):
        g = self._g(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g["util_gpu_percent"], memory=g["util_mem_percent"])

    def nvmlDeviceGetPowerUsage(self, h):
        return self._g(h, "nvmlDeviceGetPowerUsage")["power_mw"]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        """mJ: SYNTHETIC, the fixture's power integrated over the fake clock plus a fixed start value
        (the fixtures hold no recorded energy counter)."""
        g = self._g(h, "nvmlDeviceGetTotalEnergyConsumption")
        return ENERGY_START_MJ + int(g["power_mw"] * (self.now_us - self.start_us) / 1e6)

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._g(h, "nvmlDeviceGetEnforcedPowerLimit")["power_limit_mw"]

    def nvmlDeviceGetTemperature(self, h, sensor):
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._g(h, "nvmlDeviceGetTemperature")["temperature_c"]

    def nvmlDeviceGetClockInfo(self, h, clock):
        g = self._g(h, "nvmlDeviceGetClockInfo")
        return {pynvml.NVML_CLOCK_SM: g["sm_clock_mhz"], pynvml.NVML_CLOCK_MEM: g["mem_clock_mhz"]}[clock]

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        g = self._g(h, "nvmlDeviceGetMaxClockInfo")
        return {pynvml.NVML_CLOCK_SM: g["sm_clock_max_mhz"], pynvml.NVML_CLOCK_MEM: g["mem_clock_max_mhz"]}[clock]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._g(h, "nvmlDeviceGetCurrentClocksEventReasons")["throttle_mask"]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._g(h, "nvmlDeviceGetCurrPcieLinkGeneration")["pcie_gen"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._g(h, "nvmlDeviceGetMaxPcieLinkGeneration")["pcie_gen_max"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._g(h, "nvmlDeviceGetCurrPcieLinkWidth")["pcie_width"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._g(h, "nvmlDeviceGetMaxPcieLinkWidth")["pcie_width_max"]

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        g = self._g(h, "nvmlDeviceGetPcieThroughput")
        self.pcie_throughput_calls += 1    # the real call samples for 20 ms
        return g["pcie_tx_kb_per_s"] if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else g["pcie_rx_kb_per_s"]

    def nvmlDeviceGetPcieReplayCounter(self, h):
        return self._g(h, "nvmlDeviceGetPcieReplayCounter")["pcie_replay_count"]

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        g = self._g(h, "nvmlDeviceGetTotalEccErrors")
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return g["ecc_corrected"]
        return g["ecc_uncorrected"]

    def nvmlDeviceGetNvLinkState(self, h, link):
        g = self._g(h, "nvmlDeviceGetNvLinkState")
        if link >= 18:  # H100 SXM has 18 NVLink 4 links
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if link < g["nvlink_links"] else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        self._g(h, "nvmlDeviceGetFieldValues")
        out = []
        links = max(1, self.gpus[h.index]["nvlink_links"])
        for item in field_ids:
            # like pynvml: an int, or a (fieldId, scopeId) pair; NVLink throughput fields take the
            # link id as scopeId (0 when not given), UINT_MAX for the sum over all links
            fid, scope = item if isinstance(item, tuple) else (item, 0)
            share = 1 if scope == 0xFFFFFFFF else (1 / links if scope < links else 0)
            g = self.gpus[h.index]
            if fid in (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES):
                if not g.get("pcie_byte_counters", False):
                    v, rc = 0, pynvml.NVML_ERROR_NOT_SUPPORTED
                else:
                    tx = fid == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
                    v, rc = (self.pcie_tx_bytes if tx else self.pcie_rx_bytes)[h.index], pynvml.NVML_SUCCESS
            elif fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
                v, rc = int(self.nvlink_tx_kib[h.index] * share), pynvml.NVML_SUCCESS
            elif fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
                v, rc = int(self.nvlink_rx_kib[h.index] * share), pynvml.NVML_SUCCESS
            else:
                v, rc = 0, pynvml.NVML_ERROR_NOT_SUPPORTED
            out.append(SimpleNamespace(fieldId=fid, scopeId=scope, timestamp=self.now_us, latencyUsec=0,
                                       valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlReturn=rc,
                                       value=SimpleNamespace(ullVal=v)))
        return out

    def nvmlDeviceGetMigMode(self, h):
        g = self._g(h, "nvmlDeviceGetMigMode")
        if g["mig_mode"] is None:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return list(g["mig_mode"])

    def nvmlDeviceGetVirtualizationMode(self, h):
        return self._g(h, "nvmlDeviceGetVirtualizationMode")["virtualization_mode"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        g = self._g(h, "nvmlDeviceGetComputeRunningProcesses")
        mig = g["mig_mode"] is not None and g["mig_mode"][0] == 1
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_memory_bytes"],
                                gpuInstanceId=p.get("gpu_instance_id", 0) if mig else 0xFFFFFFFF,
                                computeInstanceId=0 if mig else 0xFFFFFFFF)
                for p in g["processes"]]

    def nvmlDeviceGetProcessUtilization(self, h, last_seen_us):
        g = self._g(h, "nvmlDeviceGetProcessUtilization")
        # like the driver: samples only for processes that ran kernels, only newer than last_seen_us
        samples = [SimpleNamespace(pid=p["pid"], timeStamp=self.now_us, smUtil=p["sm_util_percent"],
                                   memUtil=p.get("mem_util_percent", 0), encUtil=0, decUtil=0)
                   for p in g["processes"] if self.now_us > last_seen_us and p["sm_util_percent"] > 0]
        if not samples:
            raise _err(pynvml.NVML_ERROR_NOT_FOUND)
        return samples

    # GPM (nvml.h "GPM"): SYNTHETIC values from the fixture's "gpm"/"gpm_mig" keys, see its _sources
    _GPM_KEYS = {2: "sm_active", 3: "sm_occupancy", 5: "tensor_active", 10: "dram_active"}

    def nvmlGpmQueryDeviceSupport(self, h):
        g = self._g(h, "nvmlGpmQueryDeviceSupport")
        return SimpleNamespace(version=1, isSupportedDevice=1 if ("gpm" in g or "gpm_mig" in g) else 0)

    def nvmlGpmSampleAlloc(self):
        buf = ctypes.create_string_buffer(16)
        ptr = ctypes.cast(buf, pynvml.c_nvmlGpmSample_t)
        self._gpm_samples[ctypes.addressof(buf)] = [buf, None]
        return ptr

    def nvmlGpmSampleFree(self, sample):
        self._gpm_samples.pop(ctypes.cast(sample, ctypes.c_void_p).value, None)

    def _gpm_take(self, h, gi, sample, fn):
        g = self._g(h, fn)
        mig = g["mig_mode"] is not None and g["mig_mode"][0] == 1
        if ("gpm" not in g and "gpm_mig" not in g) or (mig and gi is None):
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gi is not None and (not mig or str(gi) not in g.get("gpm_mig", {})):
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slot = self._gpm_samples.get(ctypes.cast(sample, ctypes.c_void_p).value)
        if slot is None:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        slot[1] = (h.index, gi, self.now_us)
        return sample

    def nvmlGpmSampleGet(self, h, sample):
        return self._gpm_take(h, None, sample, "nvmlGpmSampleGet")

    def nvmlGpmMigSampleGet(self, h, gpu_instance_id, sample):
        return self._gpm_take(h, int(gpu_instance_id), sample, "nvmlGpmMigSampleGet")

    def nvmlGpmMetricsGet(self, mg):
        self.calls["nvmlGpmMetricsGet"] = self.calls.get("nvmlGpmMetricsGet", 0) + 1
        if mg.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            raise _err(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        a = self._gpm_samples.get(ctypes.cast(mg.sample1, ctypes.c_void_p).value)
        b = self._gpm_samples.get(ctypes.cast(mg.sample2, ctypes.c_void_p).value)
        if not a or not b or a[1] is None or b[1] is None or a[1][:2] != b[1][:2] or b[1][2] <= a[1][2]:
            raise _err(pynvml.NVML_ERROR_INVALID_ARGUMENT)   # two samples of one GPU, the second later
        gpu, gi, _ = b[1]
        g = self.gpus[gpu]
        vals = g["gpm_mig"][str(gi)] if gi is not None else g["gpm"]
        # throughputs in MiB/s, from the same rates the counters grow at (under MIG: none per instance)
        rates = {} if gi is not None else {
            20: g["pcie_tx_kb_per_s"] / 1024.0, 21: g["pcie_rx_kb_per_s"] / 1024.0,
            60: g["nvlink_rx_kib_per_s"] / 1024.0, 61: g["nvlink_tx_kib_per_s"] / 1024.0}
        for k in range(mg.numMetrics):
            m = mg.metrics[k]
            key = self._GPM_KEYS.get(m.metricId)
            if key is not None and key in vals:
                m.value, m.nvmlReturn = float(vals[key]), pynvml.NVML_SUCCESS
            elif m.metricId in rates:
                m.value, m.nvmlReturn = rates[m.metricId], pynvml.NVML_SUCCESS
            else:
                m.value, m.nvmlReturn = 0.0, pynvml.NVML_ERROR_NOT_SUPPORTED
        return mg

    # events
    def nvmlEventSetCreate(self):
        s = {"devices": set(), "queue": []}
        self._event_sets.append(s)
        return s

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        self._g(h, "nvmlDeviceRegisterEvents")
        if not event_types & pynvml.nvmlEventTypeXidCriticalError:
            raise _err(pynvml.NVML_ERROR_NOT_SUPPORTED)
        event_set["devices"].add(h.index)
        keep = []
        for ev in self._pending_events:
            (event_set["queue"] if ev["gpu"] == h.index else keep).append(ev)
        self._pending_events = keep

    def nvmlEventSetWait(self, event_set, timeout_ms):
        self.calls["nvmlEventSetWait"] = self.calls.get("nvmlEventSetWait", 0) + 1
        self.wait_timeouts_ms.append(timeout_ms)
        if not event_set["queue"]:
            raise _err(pynvml.NVML_ERROR_TIMEOUT)
        ev = event_set["queue"].pop(0)
        return SimpleNamespace(device=self.handles[ev["gpu"]], eventType=pynvml.nvmlEventTypeXidCriticalError,
                               eventData=ev["xid"], gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    def nvmlEventSetFree(self, event_set):
        if event_set in self._event_sets:
            self._event_sets.remove(event_set)
