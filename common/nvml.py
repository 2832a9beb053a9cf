"""The one module that talks to NVML (``pynvml``, from the ``nvidia-ml-py`` package).

Every NVML call goes through :meth:`Nvml.query`, which returns ``None`` ("not available") instead of
raising -- the pattern of nvitop's ``libnvml.nvmlQuery``. Why: a node without a GPU, without the
library, or with a driver that lacks one call must still run with everything else. Each reason a
metric is unavailable is logged ONCE and kept in :attr:`Nvml.unavailable` so `gpuagent status` can
show it; a call that answered NotSupported / FunctionNotFound for a device is not retried.

The backend is injectable: ``Nvml(backend=fake)`` -- the single seam where tests put a fake
(tests/fake_nvml.py). A backend is anything exposing pynvml's function names and constants, and
raising exceptions with a ``.value`` NVML return code.
"""

from __future__ import annotations

import logging
import threading
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
    def query(self, fn: str, *args: Any, gpu: int = -1, report: bool = True) -> Any:
        """Call ``backend.fn(*args)``; return its value, or None when it is not available.

        A permanent failure (NotSupported, FunctionNotFound, NoPermission) for ``(fn, gpu)`` is
        reported once and the call is never made again for that GPU. ``report=False`` for a call
        that has a fallback: its failure is remembered but not reported.
        """
        key = (fn, gpu)
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
            code = getattr(exc, "value", None)
            if code in _QUIET:
                return None
            if code == ERROR_GPU_IS_LOST and gpu >= 0:
                # fell off the bus (often with XID 79): every call would fail; stop asking this GPU
                self.lost.add(gpu)
                self._note(gpu, f"lost (NVML GPU_IS_LOST during {fn}); not queried again until restart")
                return None
            if code in _PERMANENT:
                self._unsupported.add(key)
            if report:
                self._note(gpu, f"{fn}: {self._describe(exc)}")
            return None

    def query_raw(self, fn: str, *args: Any) -> tuple[Any, int | None]:
        """Like query but also returns the NVML error code (for calls where 'Timeout' is the answer)."""
        func = getattr(self.backend, fn, None) if self.backend is not None else None
        if func is None:
            return None, ERROR_FUNCTION_NOT_FOUND
        try:
            return func(*args), None
        except Exception as exc:  # noqa: BLE001
            return None, getattr(exc, "value", -1)

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
        code = getattr(exc, "value", None)
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
