"""The one module that talks to NVML (``pynvml``, from the ``nvidia-ml-py`` package).

Every NVML call goes through :meth:`Nvml.query`, which returns ``None`` ("not available") instead of
raising -- the pattern of nvitop's ``libnvml.nvmlQuery``. Why: a node without a GPU, without the
library, or with a driver that lacks one call must still run with everything else. Each reason a
metric is unavailable is logged ONCE and kept in :attr:`Nvml.unavailable` so `gpuagent status` can
show it. Only an answer that cannot change while the driver is loaded makes a call permanent for a
device (NotSupported, FunctionNotFound -- also pynvml's NVMLLibraryMismatchError, its FunctionNotFound
for an unversioned name -- and NoPermission, except where the caller says a refusal may pass, as on the
parent handle of a MIG GPU); every other error (Unknown, Timeout, NotReady, InsufficientResources, ...)
is reported once and the call is made again on later ticks.

The backend is injectable: ``Nvml(backend=...)``, anything exposing pynvml's function names and
constants and raising exceptions with a ``.value`` NVML return code. The agent and the tests use the
real pynvml (``backend=None``); tests answer it with the NVML emulator (sim/nvmlemu), a C library
that pynvml loads as libnvidia-ml.so.1.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("gpuagent.nvml")

# NVML return codes (nvml.h, nvmlReturn_t); used when the backend lacks the constant.
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_DRIVER_NOT_LOADED = 9
ERROR_TIMEOUT = 10
ERROR_LIBRARY_NOT_FOUND = 12
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_GPU_IS_LOST = 15
ERROR_RESET_REQUIRED = 16      # nvml.h: "The GPU requires a reset before it can be used again"
ERROR_NOT_READY = 27

# Errors that mean "this device will never answer this call": stop asking.
_PERMANENT = {ERROR_NOT_SUPPORTED, ERROR_FUNCTION_NOT_FOUND, ERROR_NO_PERMISSION}
# Errors that are a normal "nothing to report" answer, never worth a log line.
_QUIET = {ERROR_TIMEOUT, ERROR_NOT_FOUND}

# Clock-event ("throttle") reason bits, nvml.h nvmlClocksEventReason*/nvmlClocksThrottleReason*.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x0000000000000001, "gpu_idle"),
    (0x0000000000000002, "applications_clocks_setting"),
    (0x0000000000000004, "sw_power_cap"),
    (0x0000000000000008, "hw_slowdown"),
    (0x0000000000000010, "sync_boost"),
    (0x0000000000000020, "sw_thermal"),
    (0x0000000000000040, "hw_thermal"),
    (0x0000000000000080, "hw_power_brake"),
    (0x0000000000000100, "display_clock_setting"),
)

# nvmlGpuVirtualizationMode_t -> the GpuInfo.virtualization_mode vocabulary.
VIRT_MODES = {0: "none", 1: "passthrough", 2: "vgpu", 3: "host_vgpu", 4: "host_vsga"}

EVENT_TYPE_XID = 0x0000000000000008  # nvmlEventTypeXidCriticalError


def decode_throttle(mask: int) -> list[str]:
    """Names of the reason bits set in an NVML clocks-event bitmask (unknown bits as ``bit_0x..``)."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return names


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's PCI bus id ("00000000:1B:00.0": 8 hex digits of domain, upper case) in the form the kernel
    uses under /sys/bus/pci/devices ("0000:1b:00.0": domain printed with at least 4 digits, lower case).
    A domain above 0xffff (some hypervisors' virtual PCI buses) keeps all its digits, as sysfs does.
    "" for an id that is not domain:bus:device.function."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) != 3 or "." not in parts[2]:
        return ""
    try:
        dom, bus = int(parts[0], 16), int(parts[1], 16)
        dev, fn = (int(x, 16) for x in parts[2].split(".", 1))
    except ValueError:
        return ""
    return f"{dom:04x}:{bus:02x}:{dev:02x}.{fn:x}"


def _code(exc: BaseException) -> int | None:
    """The NVML return code of an exception from the binding. pynvml raises NVMLLibraryMismatchError
    (no ``.value``) when an unversioned wrapper (nvmlDeviceGetComputeRunningProcesses -> _v3) finds its
    versioned symbol missing in the driver: that is FunctionNotFound."""
    code = getattr(exc, "value", None)
    if code is None and type(exc).__name__ == "NVMLLibraryMismatchError":
        return ERROR_FUNCTION_NOT_FOUND
    return code


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class Nvml:
    """NVML behind one choke point. ``available`` is False (with ``reason``) when there is no NVML."""

    def __init__(self, backend: Any = None) -> None:
        self._lock = threading.Lock()
        self._unsupported: set[tuple[str, int]] = set()
        self._reported: set[str] = set()
        self.unavailable: list[str] = []       # every reason, in order, once each (for status)
        self._new_unavailable: list[tuple[int, str]] = []  # not yet turned into events
        self.backend = backend
        self.available = False
        self.reason = ""
        self._handles: list[Any] = []
        self.lost: set[int] = set()            # GPUs that answered GPU_IS_LOST
        self.reset_required: set[int] = set()  # GPUs that answered RESET_REQUIRED since the sampler last asked
        if backend is None:
            try:
                import pynvml  # noqa: PLC0415  (only here: the one module that touches NVML)
            except ImportError as exc:  # nvidia-ml-py not installed
                self._mark_off(f"NVML unavailable: the pynvml module is not installed ({exc})")
                return
            self.backend = pynvml
        try:
            self.backend.nvmlInit()
        except Exception as exc:  # noqa: BLE001 -- any failure means "host-only"
            self._mark_off(f"NVML unavailable: nvmlInit failed ({self._describe(exc)}); running host-only")
            return
        count = self.query("nvmlDeviceGetCount")
        if count is None:
            self._mark_off("NVML unavailable: nvmlDeviceGetCount failed; running host-only")
            return
        if int(count) == 0:
            self.query("nvmlShutdown")
            self._mark_off("NVML reports no GPUs on this node; running host-only")
            return
        for i in range(int(count)):
            h = self.query("nvmlDeviceGetHandleByIndex", i, gpu=i)
            self._handles.append(h)
        self.available = True

    # ------------------------------------------------------------------ the choke point
    def query(self, fn: str, *args: Any, gpu: int = -1, report: bool = True, key: str | None = None,
              permission_final: bool = True) -> Any:
        """Call ``backend.fn(*args)``; return its value, or None when it is not available.

        A permanent failure (NotSupported, FunctionNotFound, NoPermission) for ``(key or fn, gpu)`` is
        reported once and the call is never made again for that GPU; any other error is retried on
        the next call. ``report=False`` for a call that has a fallback: its failure is remembered but
        not reported. ``key`` names the read when one function serves two (a second struct version, a
        MIG device handle), so one's refusal does not switch the other off. ``permission_final=False``:
        NoPermission is not permanent (the parent handle of a MIG GPU answers it to a process without
        privileges, which a restart with them, or MIG off, changes).
        """
        key = (key or fn, gpu)
        if key in self._unsupported or gpu in self.lost or self.backend is None:
            return None
        func: Callable[..., Any] | None = getattr(self.backend, fn, None)
        if func is None:
            self._unsupported.add(key)
            if report:
                self._note(gpu, f"{fn}: not in this NVML binding")
            return None
        try:
            return func(*args)
        except Exception as exc:  # noqa: BLE001 -- the whole point: never raise past here
            code = _code(exc)
            if code in _QUIET:
                return None
            if code == ERROR_GPU_IS_LOST and gpu >= 0:
                # fell off the bus (often with XID 79): every call would fail; stop asking this GPU
                self.lost.add(gpu)
                self._note(gpu, f"lost (NVML GPU_IS_LOST during {fn}); not queried again until restart")
                return None
            if code == ERROR_RESET_REQUIRED and gpu >= 0:
                self.reset_required.add(gpu)   # asked again next time: a reset clears it
            if code in _PERMANENT and (permission_final or code != ERROR_NO_PERMISSION):
                self._unsupported.add(key)
            if report:
                self._note(gpu, f"{key[0]}: {self._describe(exc)}")
            return None

    def query_first(self, calls: tuple[tuple[str, tuple[Any, ...]], ...], gpu: int = -1, suffix: str = "") -> Any:
        """The first of ``calls`` ((function, args) pairs, newest NVML name first) this driver answers.

        A call that is permanently unsupported (not in the driver, not in the binding) passes to the
        next one; a transient error gives None for this time, and the same call is tried next time.
        Only the last call's failure is reported (the older ones are the fallback). ``suffix`` is
        added to each function's name in the seam's memo (see ``key`` in :meth:`query`)."""
        last = len(calls) - 1
        for k, (fn, args) in enumerate(calls):
            key = fn + suffix
            if self.is_unsupported(key, gpu):
                continue
            v = self.query(fn, *args, gpu=gpu, report=k == last, key=key)
            if v is not None or not self.is_unsupported(key, gpu):
                return v
        return None

    def query_raw(self, fn: str, *args: Any) -> tuple[Any, int | None]:
        """Like query but also returns the NVML error code (for calls where 'Timeout' is the answer)."""
        func = getattr(self.backend, fn, None) if self.backend is not None else None
        if func is None:
            return None, ERROR_FUNCTION_NOT_FOUND
        try:
            return func(*args), None
        except Exception as exc:  # noqa: BLE001
            code = _code(exc)
            return None, -1 if code is None else code

    def is_unsupported(self, fn: str, gpu: int = -1) -> bool:
        return (fn, gpu) in self._unsupported

    def mark_unsupported(self, fn: str, gpu: int, why: str) -> None:
        if (fn, gpu) not in self._unsupported:
            self._unsupported.add((fn, gpu))
            self._note(gpu, f"{fn}: {why}")

    def const(self, name: str, default: Any) -> Any:
        return getattr(self.backend, name, default) if self.backend is not None else default

    # ------------------------------------------------------------------ bookkeeping
    def _describe(self, exc: BaseException) -> str:
        code = _code(exc)
        text = str(exc) or type(exc).__name__
        return f"{text} (NVML error {code})" if code is not None else text

    def _note(self, gpu: int, reason: str) -> None:
        where = f"GPU {gpu}: " if gpu >= 0 else ""
        line = where + reason
        with self._lock:
            if line in self._reported:
                return
            self._reported.add(line)
            self.unavailable.append(line)
            self._new_unavailable.append((gpu, line))
        log.warning("%s (reported once)", line)

    def _mark_off(self, reason: str) -> None:
        self.available = False
        self.reason = reason
        self._note(-1, reason)

    def drain_new_unavailable(self) -> list[tuple[int, str]]:
        """Reasons noted since the last call, as (gpu, text): the GPU sampler turns them into events."""
        with self._lock:
            out, self._new_unavailable = self._new_unavailable, []
        return out

    # ------------------------------------------------------------------ convenience
    @property
    def device_count(self) -> int:
        return len(self._handles) if self.available else 0

    def handle(self, i: int) -> Any:
        return self._handles[i]

    def driver_version(self) -> str:
        v = self.query("nvmlSystemGetDriverVersion") if self.available else None
        return _text(v) if v is not None else ""

    def cuda_version(self) -> str:
        v = self.query("nvmlSystemGetCudaDriverVersion") if self.available else None
        if v is None:
            return ""
        v = int(v)
        return f"{v // 1000}.{(v % 1000) // 10}"

    def text(self, fn: str, i: int) -> str:
        v = self.query(fn, self._handles[i], gpu=i)
        return _text(v) if v is not None else ""

    def shutdown(self) -> None:
        if self.available:
            self.query("nvmlShutdown")
            self.available = False


# GPM metrics (nvml.h, nvmlGpmMetricId_t; Hopper and newer): agent metric name, metric id, factor to
# the agent's unit. Percentages stay percentages; throughputs come in MiB/s and go out in bytes/s.
_MIB = 1024.0 * 1024.0
GPM_METRICS: tuple[tuple[str, int, float], ...] = (
    ("gpu_gr_engine_active_percent", 1, 1.0),   # NVML_GPM_METRIC_GRAPHICS_UTIL: DCGM's PROF_GR_ENGINE_ACTIVE
    ("gpu_sm_active_percent", 2, 1.0),          # NVML_GPM_METRIC_SM_UTIL: share of SMs busy
    ("gpu_sm_occupancy_percent", 3, 1.0),       # NVML_GPM_METRIC_SM_OCCUPANCY: warps active vs the maximum
    ("gpu_tensor_active_percent", 5, 1.0),      # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    ("gpu_dram_active_percent", 10, 1.0),       # NVML_GPM_METRIC_DRAM_BW_UTIL: DRAM bandwidth vs its peak
    ("gpu_gpm_pcie_tx_bytes_per_s", 20, _MIB),  # NVML_GPM_METRIC_PCIE_TX_PER_SEC (MiB/s)
    ("gpu_gpm_pcie_rx_bytes_per_s", 21, _MIB),
    ("gpu_gpm_nvlink_rx_bytes_per_s", 60, _MIB),  # NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC (MiB/s)
    ("gpu_gpm_nvlink_tx_bytes_per_s", 61, _MIB),
)


GPM_MIN_INTERVAL_S = 0.1   # nvml.h nvmlGpmMetricsGet: the samples' interval "should be greater than 100ms"


class Gpm:
    """GPM through the seam: two samples per (GPU, GPU instance); each :meth:`read` returns the metrics
    between the kept sample and a new one, taken only once :data:`GPM_MIN_INTERVAL_S` has passed
    since the kept one (NVML answers NOT_READY for closer samples), so any tick interval works.

    ``supported(i)`` asks nvmlGpmQueryDeviceSupport until it answers; a GPU without GPM (before
    Hopper, vGPU guests, old drivers or bindings) is reported once, and the caller falls back to the
    utilization counters. Under MIG, device-level samples are not used: ``read(i, gi, mig_handle)``
    samples one GPU instance, through its MIG device handle when given (no privileges needed), else
    with nvmlGpmMigSampleGet on the parent (which needs them).
    """

    def __init__(self, nvml: Nvml) -> None:
        self.nvml = nvml
        self._supported: dict[int, bool] = {}
        # key -> [kept sample, spare sample, time of the kept one (None: none kept), metrics-get structure]
        self._slots: dict[tuple[int, int | None, bool], list[Any]] = {}
        self.working: dict[tuple[int, int | None], bool] = {}   # (GPU, instance) -> last read gave values
        self._struct = nvml.const("c_nvmlGpmMetricsGet_t", None)
        self._version = nvml.const("NVML_GPM_METRICS_GET_VERSION", 1)

    def supported(self, i: int) -> bool:
        got = self._supported.get(i)
        if got is None:
            n = self.nvml
            fn = "nvmlGpmQueryDeviceSupport"
            info = n.query(fn, n.handle(i), gpu=i, report=False)
            if info is None and not n.is_unsupported(fn, i) and i not in n.lost:
                return False      # a transient error: ask again next tick
            got = bool(info is not None and int(getattr(info, "isSupportedDevice", 0)) and self._struct is not None)
            if not got:
                n.mark_unsupported("nvmlGpmSampleGet", i, "GPM is not supported (needs Hopper or newer, a "
                                   "driver and binding with GPM); activity comes from the utilization counters")
            self._supported[i] = got
        return got

    def read(self, i: int, gpu_instance: int | None = None, mig_handle: Any = None,
             now_s: float | None = None) -> dict[str, float] | None:
        """Metric name -> value over the interval since the kept sample of this GPU (instance); None
        when there is no kept sample yet, it is younger than 100 ms (kept for a later tick), NVML
        refused, or no metric had a value (a metric answering NOT_READY or NOT_SUPPORTED has none)."""
        n = self.nvml
        now = time.monotonic() if now_s is None else now_s
        if gpu_instance is not None and mig_handle is not None \
                and not n.is_unsupported("nvmlGpmSampleGet (MIG device)", i):
            via_mig = True
        else:
            via_mig = False
        key = (i, gpu_instance, via_mig)
        slot = self._slots.get(key)
        if slot is None:
            a = n.query("nvmlGpmSampleAlloc", gpu=i)
            b = n.query("nvmlGpmSampleAlloc", gpu=i)
            if a is None or b is None:
                return None
            mg = self._struct()           # ~25 KB (room for every metric id): built once per GPU (instance)
            mg.version = self._version
            mg.numMetrics = len(GPM_METRICS)
            for k, (_, mid, _) in enumerate(GPM_METRICS):
                mg.metrics[k].metricId = mid
            slot = self._slots[key] = [a, b, None, mg]
        kept, spare, kept_at, mg = slot
        if kept_at is not None and 0 <= now - kept_at <= GPM_MIN_INTERVAL_S:
            return None                   # too soon for NVML: keep the sample, report nothing this tick
        wkey = (i, gpu_instance)
        if via_mig:
            got = n.query("nvmlGpmSampleGet", mig_handle, spare, gpu=i, key="nvmlGpmSampleGet (MIG device)",
                          report=False)
            if got is None and n.is_unsupported("nvmlGpmSampleGet (MIG device)", i):
                self._drop(key)
                return self.read(i, gpu_instance, None, now_s)       # this driver: only from the parent
        elif gpu_instance is None:
            got = n.query("nvmlGpmSampleGet", n.handle(i), spare, gpu=i)
        else:
            got = n.query("nvmlGpmMigSampleGet", n.handle(i), gpu_instance, spare, gpu=i, permission_final=False)
        if got is None:
            slot[2] = None
            self.working[wkey] = False
            return None
        if kept_at is None or now < kept_at:
            slot[0], slot[1], slot[2] = spare, kept, now
            return None
        mg.sample1, mg.sample2 = kept, spare
        res = n.query("nvmlGpmMetricsGet", mg, gpu=i)
        if res is None:
            slot[0], slot[1], slot[2] = spare, kept, now
            self.working[wkey] = False
            return None
        out = {}
        not_ready = False
        metrics = res.metrics
        for k, (name, _, factor) in enumerate(GPM_METRICS):
            m = metrics[k]
            if m.nvmlReturn == 0:
                out[name] = m.value * factor
            elif m.nvmlReturn == ERROR_NOT_READY:
                not_ready = True
        if not_ready and not out:
            return None       # NVML found the interval too short: keep the older sample, try next tick
        slot[0], slot[1], slot[2] = spare, kept, now      # the new sample is the next read's kept one
        self.working[wkey] = bool(out)
        return out or None

    def _drop(self, key: tuple[int, int | None, bool]) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self.nvml.query("nvmlGpmSampleFree", slot[0])
            self.nvml.query("nvmlGpmSampleFree", slot[1])

    def close(self) -> None:
        for key in list(self._slots):
            self._drop(key)
