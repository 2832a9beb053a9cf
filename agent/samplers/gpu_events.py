"""XID events from NVML: ``xid`` (value = the XID number) from nvmlEventSetWait with a 0 ms timeout each tick
(never blocks), the description from the one XID catalogue (common/hardware_faults.toml), attrs source
"nvml" and pci_bus_id (kernel form, "0000:3a:00.0") for the kernel-log reader's deduplication.

The latest XID per GPU (``last_xid``) is what the exporter reports as dcgm-exporter's XID_ERRORS.
"""

from __future__ import annotations

from typing import Any

from gpuagent.agent.samplers.gpu_inventory import bus_id_of
from gpuagent.common.hardware_faults import xid_description
from gpuagent.common.nvml import EVENT_TYPE_XID, Nvml, sysfs_bus_id

_MAX_EVENTS_PER_TICK = 256


class GpuEventsMixin:
    """GpuSampler's XID events (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _init_events(self) -> None:
        """Each GPU's PCI bus id (for the events' pci_bus_id), then the XID event registration."""
        self._bus_ids: dict[int, str] = {}               # GPU -> PCI bus id, kernel form ("0000:18:00.0")
        self._event_set: Any = None
        self._event_gpus: set[int] = set()
        self._events_ready = False
        self.last_xid: dict[int, int] = {}          # GPU -> the latest XID seen (dcgm-exporter's XID_ERRORS)
        n = self.nvml
        if n.available:
            for i in range(n.device_count):   # before any XID 79: a GPU off the bus answers nothing
                self._bus_ids[i] = sysfs_bus_id(bus_id_of(n.query("nvmlDeviceGetPciInfo", n.handle(i), gpu=i)))
            self._setup_events()

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
            what = xid_description(xid)
            bus = self._bus_ids.get(gpu, "") if gpu >= 0 else ""
            if gpu >= 0:
                self.last_xid[gpu] = xid
            sink.event("xid", f"XID {xid} on GPU {gpu}" + (f" ({what})" if what else ""), gpu=gpu,
                       value=float(xid), attrs={"xid": str(xid), "description": what, "source": "nvml",
                                                "pci_bus_id": bus, "event_type": hex(int(data.eventType))},
                       ts_ns=ts_ns)

    def _close_events(self) -> None:
        if self._event_set is not None:
            self.nvml.query("nvmlEventSetFree", self._event_set)
            self._event_set = None


def _same_handle(a: Any, b: Any) -> bool:
    """Whether two nvmlDevice_t (ctypes pointers, which compare by identity) point at the same device."""
    import ctypes  # noqa: PLC0415  (only for this rare path)
    try:
        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return a is b
