"""SYNTHETIC NVML under the real binding: a controller for the C emulator in ``sim/nvmlemu``.

The emulator is a shared library named ``libnvidia-ml.so.1`` that the real, unmodified ``pynvml``
(nvidia-ml-py) loads as if it were the driver's, so pynvml's ctypes structures, versioned entry points
and NVMLError classes all run. Its devices come from a JSON fixture (tests/data/nvml_*.json, SYNTHETIC)
and are scripted through this module while processes use them. It is for tests, benchmarks and
demos; nothing it answers is a measurement.

Use::

    emu = Emulator.start(tmp_path / "nvml", "tests/data/nvml_8gpu_h100_sxm.json", clock="frozen")
    with emu:                                   # this process: pynvml / gpuagent.common.nvml see it
        nv = Nvml()
    subprocess.run(cmd, env=emu.env())          # another process sees the same node
    emu.inject_xid(3, 79); emu.advance(1.0); emu.calls()["nvmlDeviceGetMemoryInfo"]

How it works (sim/nvmlemu/README.md has the file formats): ``start`` writes the node as a
``state`` file into a state directory; the library finds that directory through
``$GPUAGENT_NVMLEMU_DIR`` at every ``nvmlInit`` and reloads it, so each test gets a fresh node even
though a process loads the library once. Every change rewrites the whole node into ``control`` and
bumps a counter in ``generation`` that the library checks on each call. The library counts every
call per symbol in ``calls.<pid>``, which :meth:`Emulator.calls` reads, also from a live subprocess.

Counters (energy, PCIe and NVLink bytes, ECC, PCIe replays, violation time, GPM) are
``base + rate * (t - t0)`` on an emulated clock: real (CLOCK_MONOTONIC, the default) or frozen and
moved only by :meth:`Emulator.advance`. Changing a rate re-bases the counter at the current time, so
counters never jump back.

Driver profiles: "r550" (every entry point), "old" (no nvmlDeviceGetMemoryInfo_v2, TemperatureV,
ComputeRunningProcesses_v3, ClocksEventReasons) and "cuda14" (no nvmlDeviceGetTemperature, no
CurrentClocksThrottleReasons). :meth:`Emulator.env` points a subprocess at a library built for its
profile, where those symbols are really absent (dlsym fails, as on such a driver). In this process the
full library stays loaded, and a switched profile is enforced by answering
NVML_ERROR_FUNCTION_NOT_FOUND, which pynvml turns into the same NVMLError_FunctionNotFound.

Only the standard library and gpuagent.common/proto may be imported here (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import fcntl
import json
import mmap
import os
import secrets
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

ENV_DIR = "GPUAGENT_NVMLEMU_DIR"        # read by the library at nvmlInit
ENV_BUILD = "GPUAGENT_NVMLEMU_BUILD"    # where the built libraries are (default <repo>/build/nvmlemu)
REPO = Path(__file__).resolve().parent.parent
SOURCE_DIR = REPO / "sim" / "nvmlemu"
DEFAULT_BUILD = REPO / "build" / "nvmlemu"
LIB_NAME = "libnvidia-ml.so.1"
PROFILES = ("r550", "old", "cuda14")
CLOCKS = ("real", "frozen")

ENERGY_START_MJ = 3_600_000_000   # SYNTHETIC: 1 kWh before the node starts
MAX_GPUS = 32                     # the library's limits (sim/nvmlemu/nvmlemu.h)
MAX_PROCS = 128
MAX_MIG = 16
MAX_EVENTS = 1024
MAX_FAIL = 64
UINT_MAX = 0xFFFFFFFF

# nvmlReturn_t (nvml.h): names accepted by fail() besides the number
RETURN_CODES = {
    "SUCCESS": 0, "UNINITIALIZED": 1, "INVALID_ARGUMENT": 2, "NOT_SUPPORTED": 3, "NO_PERMISSION": 4,
    "NOT_FOUND": 6, "INSUFFICIENT_SIZE": 7, "DRIVER_NOT_LOADED": 9, "TIMEOUT": 10, "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12, "FUNCTION_NOT_FOUND": 13, "CORRUPTED_INFOROM": 14, "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16, "OPERATING_SYSTEM": 17, "LIB_RM_VERSION_MISMATCH": 18, "IN_USE": 19,
    "MEMORY": 20, "NO_DATA": 21, "ARGUMENT_VERSION_MISMATCH": 25, "NOT_READY": 27, "UNKNOWN": 999,
}
EVENT_TYPE_XID = 0x8              # nvmlEventTypeXidCriticalError (nvml.h)

# Fixture "gpm" / "gpm_mig" keys -> nvmlGpmMetricId_t (nvml.h). Percent or MiB/s, as NVML reports them.
GPM_METRIC_IDS = {
    "graphics_util": 1,           # NVML_GPM_METRIC_GRAPHICS_UTIL
    "gr_engine_active": 1,        # the same metric under DCGM's name (DCGM_FI_PROF_GR_ENGINE_ACTIVE)
    "sm_active": 2,               # NVML_GPM_METRIC_SM_UTIL
    "sm_occupancy": 3,            # NVML_GPM_METRIC_SM_OCCUPANCY
    "tensor_active": 5,           # NVML_GPM_METRIC_ANY_TENSOR_UTIL
    "dram_active": 10,            # NVML_GPM_METRIC_DRAM_BW_UTIL
    "pcie_tx_mib_per_s": 20,      # NVML_GPM_METRIC_PCIE_TX_PER_SEC
    "pcie_rx_mib_per_s": 21,      # NVML_GPM_METRIC_PCIE_RX_PER_SEC
    "nvlink_rx_mib_per_s": 60,    # NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC
    "nvlink_tx_mib_per_s": 61,    # NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC
}

# Clock-event bits (nvml.h nvmlClocksEventReason*) -> the duration counter (ns) they run, and the
# fixture name of that reason (key "clock_event_ns": reason -> ns, which sets the counter).
# nvml.h maps NVML_PERF_POLICY_POWER to NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP and
# NVML_PERF_POLICY_THERMAL to ..._SW_THERM_SLOWDOWN; the HW thermal / power brake durations are
# field values only (270, 271). NVML has no duration counter for the HW slowdown bit (0x8) itself.
_VIOLATION_BITS = (
    ("viol_power_ns", 0x4, "sw_power_cap"),
    ("viol_thermal_ns", 0x20, "sw_thermal"),
    ("viol_sync_boost_ns", 0x10, "sync_boost"),
    ("viol_hw_thermal_ns", 0x40, "hw_thermal"),
    ("viol_hw_power_brake_ns", 0x80, "hw_power_brake"),
)
CLOCK_EVENT_REASONS = tuple(r for _, _, r in _VIOLATION_BITS)
# nvmlNvLinkErrorCounter_t order (nvml.h): the names "nvlink_link_errors" takes per link
NVLINK_ERROR_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data", "ecc_data")

# Per-GPU fixture keys the emulator reads, with their kind and default (None: absent = not supported).
_NUM = (int, float)
GPU_KEYS: dict[str, tuple[Any, Any]] = {
    "index": (int, None), "name": (str, None), "uuid": (str, None), "serial": (str, None),
    "pci_bus_id": (str, None), "pci_device_id": (int, 0), "pci_subsystem_id": (int, 0),
    "numa_node": (int, -1), "memory_numa_node": (int, None), "cpu_affinity": (str, None),
    "cpu_affinity_socket": (str, None), "cuda_compute_capability": (list, None),
    "memory_total_bytes": (int, None), "memory_used_bytes": (int, None), "memory_reserved_bytes": (int, 0),
    "util_gpu_percent": (int, 0), "util_mem_percent": (int, 0), "enc_util_percent": (int, 0),
    "dec_util_percent": (int, 0), "power_mw": (int, 0), "power_limit_mw": (int, 0),
    "power_management_limit_mw": (int, None), "energy_start_mj": (_NUM, ENERGY_START_MJ),
    "temperature_c": (int, 0), "memory_temperature_c": (int, None), "memory_temp_c": (int, None),
    "graphics_clock_mhz": (int, None), "sm_clock_mhz": (int, None), "mem_clock_mhz": (int, None),
    "video_clock_mhz": (int, None), "graphics_clock_max_mhz": (int, None), "sm_clock_max_mhz": (int, None),
    "mem_clock_max_mhz": (int, None), "video_clock_max_mhz": (int, None), "throttle_mask": (int, 0),
    # the driver's recovery action (field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, nvmlDeviceGpuRecoveryAction_t)
    "recovery_action": (int, 0),
    "pcie_gen": (int, 0), "pcie_gen_max": (int, 0), "pcie_width": (int, 0), "pcie_width_max": (int, 0),
    "pcie_tx_kb_per_s": (int, 0), "pcie_rx_kb_per_s": (int, 0), "pcie_byte_counters": (bool, False),
    "pcie_replay_count": (int, 0), "pcie_replay_per_s": (_NUM, 0),
    "ecc_corrected": (int, 0), "ecc_uncorrected": (int, 0), "ecc_corrected_per_s": (_NUM, 0),
    "ecc_uncorrected_per_s": (_NUM, 0), "ecc_aggregate_corrected": (int, 0),
    "ecc_aggregate_uncorrected": (int, 0),
    "nvlink_links": (int, 0), "nvlink_max_links": (int, None), "nvlink_speed_mbps": (int, 0),
    "nvlink_tx_kib_per_s": (_NUM, 0), "nvlink_rx_kib_per_s": (_NUM, 0),
    "nvlink_raw_tx_kib_per_s": (_NUM, None), "nvlink_raw_rx_kib_per_s": (_NUM, None),
    "nvlink_replay_errors": (int, 0), "nvlink_replay_errors_per_s": (_NUM, 0),
    "nvlink_recovery_errors": (int, 0), "nvlink_recovery_errors_per_s": (_NUM, 0),
    "nvlink_crc_flit_errors": (int, 0), "nvlink_crc_flit_errors_per_s": (_NUM, 0),
    "nvlink_crc_data_errors": (int, 0), "nvlink_crc_data_errors_per_s": (_NUM, 0),
    "nvlink_ecc_data_errors": (int, 0), "nvlink_ecc_data_errors_per_s": (_NUM, 0),
    "mig_mode": (list, None), "mig_max_devices": (int, 7), "mig_instances": (list, []),
    "virtualization_mode": (int, 0), "processes": (list, []), "process_memory_unavailable": (bool, False),
    "not_supported": (list, []), "gpm": (dict, None), "gpm_mig": (dict, None), "gpm_supported": (bool, None),
    "remapped_rows": ((dict, list), {}), "retired_pages": (list, None), "grid_license": (dict, None),
    # health signals (SYNTHETIC): pages pending retirement (GPUs with retired_pages only), NVLink links
    # that are down, per-link NVLink error counts on top of the shared counters, clock-event durations
    "retired_pages_pending": (bool, False), "nvlink_down": (list, []), "nvlink_link_errors": (dict, {}),
    "clock_event_ns": (dict, {}),
    "vgpu_license": (dict, None),
    "supported_event_types": (int, EVENT_TYPE_XID), "lost": (bool, False),
}
# Global settings set(None, key, value) may change.
GLOBAL_KEYS: dict[str, Any] = {
    "driver_version": str, "nvml_version": str, "cuda_driver_version": int, "driver_profile": str,
    "privileged": bool, "proc_sample_period_us": int, "pcie_throughput_delay_us": int,
    "util_sample_period_us": int,
}
_REQUIRED = ("name", "uuid", "pci_bus_id", "memory_total_bytes", "memory_used_bytes")
_RETIRE_CAUSES = {"single_bit_ecc": 0, "double_bit_ecc": 1}   # nvmlPageRetirementCause_t (nvml.h)
_MAX_LINKS = 36                                                # NVML_NVLINK_MAX_LINKS (nvml.h 13.x)


class EmulatorError(ValueError):
    """One sentence saying what is wrong (a bad fixture or call, a missing build)."""


# ---------------------------------------------------------------------------------------------- build
def build_dir() -> Path:
    return Path(os.environ.get(ENV_BUILD) or DEFAULT_BUILD)


def library_path(profile: str = "r550", build: Path | None = None) -> Path:
    """The emulator library of a driver profile (r550 is the full one)."""
    _check_profile(profile)
    b = build or build_dir()
    return b / LIB_NAME if profile == "r550" else b / profile / LIB_NAME


def ensure_built(build: Path | None = None) -> Path:
    """Build the libraries (sim/nvmlemu/build.sh, what ``make nvmlemu`` runs) when they are missing or
    older than their sources; several processes may call this at once (a lock file serialises them)."""
    b = build or build_dir()
    outs = [library_path(p, b) for p in PROFILES] + [b / "symbols.txt"]
    if not SOURCE_DIR.is_dir():          # installed without the repository: only a prebuilt copy can serve
        if all(o.exists() for o in outs):
            return b
        raise EmulatorError(f"the NVML emulator is not built in {b} and its sources are not here; "
                            f"build it in a checkout (make nvmlemu) and point {ENV_BUILD} at the result")
    srcs = [p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h", ".sh")]

    def stale() -> bool:
        if not all(o.exists() for o in outs):
            return True
        newest = max(p.stat().st_mtime_ns for p in srcs)
        return min(o.stat().st_mtime_ns for o in outs) < newest

    if not stale():
        return b
    b.mkdir(parents=True, exist_ok=True)
    with open(b / ".lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if stale():
            r = subprocess.run(["sh", str(SOURCE_DIR / "build.sh"), sys.executable, str(b)],
                               capture_output=True, text=True, check=False)
            if r.returncode != 0:
                lines = (r.stderr or r.stdout).strip().splitlines()
                raise EmulatorError(lines[-1] if lines else f"building the NVML emulator failed ({r.returncode})")
    return b


def exported_symbols(build: Path | None = None) -> dict[str, set[str]]:
    """Every symbol the library exports -> its flags (mig_ok, absent_old, absent_cuda14)."""
    path = (build or build_dir()) / "symbols.txt"
    try:
        text = path.read_text()
    except OSError:
        raise EmulatorError(f"the NVML emulator is not built ({path} is missing): run `make nvmlemu`") from None
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = set(parts[1:])
    return out


def _base_name(sym: str) -> str:
    head, sep, tail = sym.rpartition("_v")
    return head if sep and tail.isdigit() else sym


def _check_profile(profile: str) -> None:
    if profile not in PROFILES:
        raise EmulatorError(f"driver profile {profile!r} is not one of {', '.join(PROFILES)}")


# ---------------------------------------------------------------------------------------------- the node
class Emulator:
    """One emulated node in a state directory; see the module docstring. Create with :meth:`start`
    (a new node) or :meth:`attach` (a node another process started). Every mutating method takes a
    lock on the directory, so several controllers may script the same node."""

    def __init__(self, state_dir: Path, build: Path) -> None:
        self.state_dir = Path(state_dir)
        self.build = build
        self._model: dict[str, Any] = {}
        self._model_stamp: tuple[int, int] | None = None
        self._saved_env: list[str | None] = []
        self._libs: list[ctypes.CDLL] = []
        self._symbols = exported_symbols(build)

    # ------------------------------------------------------------------ creation
    @classmethod
    def start(cls, state_dir: str | os.PathLike, fixture: str | os.PathLike | Mapping[str, Any], *,
              clock: str = "real", driver_profile: str | None = None, privileged: bool | None = None,
              build: str | os.PathLike | None = None) -> Emulator:
        """A fresh node from ``fixture`` (a JSON path or the parsed dict) in ``state_dir`` (created;
        it must not hold another node). ``clock`` is "real" or "frozen"; ``driver_profile`` and
        ``privileged`` override the fixture's. Builds the library first if needed."""
        if clock not in CLOCKS:
            raise EmulatorError(f"clock {clock!r} is not 'real' or 'frozen'")
        b = ensure_built(Path(build) if build else None)
        doc = _load_fixture(fixture)
        d = Path(state_dir)
        d.mkdir(parents=True, exist_ok=True)
        if (d / "model.json").exists():
            raise EmulatorError(f"{d} already holds an emulated node; give each node its own directory")
        emu = cls(d, b)
        emu._model = _node_model(doc, clock=clock, driver_profile=driver_profile, privileged=privileged)
        with emu._locked(load=False):
            (d / "generation").write_bytes(struct.pack("<Q", 0))
            emu._write_text("state", _render(emu._model))
            emu._write_model()
        return emu

    @classmethod
    def attach(cls, state_dir: str | os.PathLike, build: str | os.PathLike | None = None) -> Emulator:
        """A controller for the node another controller started in ``state_dir``."""
        d = Path(state_dir)
        if not (d / "model.json").exists():
            raise EmulatorError(f"{d} holds no emulated node (no model.json)")
        emu = cls(d, Path(build) if build else build_dir())
        with emu._locked():
            pass
        return emu

    # ------------------------------------------------------------------ pointing processes at it
    def env_vars(self, profile: str | None = None, ld_library_path: str | None = None) -> dict[str, str]:
        """The two variables a process needs: the state directory, and LD_LIBRARY_PATH with the library
        of ``profile`` (default: the node's driver profile) before ``ld_library_path`` (default: this
        process's)."""
        prof = profile or self._model["driver_profile"]
        libdir = str(library_path(prof, self.build).parent)
        rest = os.environ.get("LD_LIBRARY_PATH", "") if ld_library_path is None else ld_library_path
        return {ENV_DIR: str(self.state_dir), "LD_LIBRARY_PATH": libdir + (":" + rest if rest else "")}

    def env(self, base: Mapping[str, str] | None = None, profile: str | None = None) -> dict[str, str]:
        """``base`` (default os.environ) plus :meth:`env_vars`, for ``subprocess.Popen(env=...)``."""
        e = dict(os.environ if base is None else base)
        e.update(self.env_vars(profile, ld_library_path=e.get("LD_LIBRARY_PATH", "")))
        return e

    def activate(self) -> Emulator:
        """Point this process at the node: set $GPUAGENT_NVMLEMU_DIR and load the full library by
        path, so that pynvml's ``CDLL("libnvidia-ml.so.1")`` finds it already loaded (the dynamic
        loader matches it by soname). The next nvmlInit in this process loads this node."""
        path = library_path("r550", self.build)
        other = _loaded_nvml_libraries() - {str(path.resolve())}
        if other:
            raise EmulatorError(f"this process already loaded another libnvidia-ml.so.1 ({min(other)}); "
                                "use env() and a subprocess instead")
        self._libs.append(ctypes.CDLL(str(path)))
        self._saved_env.append(os.environ.get(ENV_DIR))
        os.environ[ENV_DIR] = str(self.state_dir)
        return self

    def deactivate(self) -> None:
        """Undo :meth:`activate`'s environment change (the library stays loaded: a process cannot
        unload it while pynvml holds it; nvmlInit without the variable answers DRIVER_NOT_LOADED)."""
        if not self._saved_env:
            return
        prev = self._saved_env.pop()
        if prev is None:
            os.environ.pop(ENV_DIR, None)
        else:
            os.environ[ENV_DIR] = prev

    def __enter__(self) -> Emulator:
        return self.activate()

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    # ------------------------------------------------------------------ clock
    def now(self) -> float:
        """Seconds on the node's emulated clock."""
        with self._locked():
            return self._now_ns() / 1e9

    def advance(self, seconds: float) -> None:
        """Move the emulated clock forward (frozen clock: the only way it moves; real clock: a jump)."""
        if seconds < 0:
            raise EmulatorError("advance: the emulated clock only moves forward")
        with self._locked():
            self._model["clock_offset_ns"] += round(seconds * 1e9)
            self._commit()

    # ------------------------------------------------------------------ scripting
    def set(self, gpu: int | None, key: str, value: Any) -> None:
        """Change one fixture value while the node runs: ``set(0, "temperature_c", 90)``,
        ``set(0, "gpm.sm_active", 12.5)``, ``set(5, "gpm_mig.1.sm_active", 3)``; ``gpu=None`` for the
        global keys (driver_profile, privileged, driver_version, ...). Rates re-base their counters."""
        with self._locked():
            if gpu is None:
                self._set_global(key, value)
            else:
                g = self._gpu(gpu)
                top = key.split(".", 1)[0]
                if top not in GPU_KEYS or top in ("index",):
                    raise EmulatorError(f"set: {key!r} is not a GPU key the emulator reads "
                                        f"(see GPU_KEYS in {Path(__file__).name})")
                _set_path(g, key, value)
                _validate_gpu(g, gpu)
                if top in ("mig_instances", "mig_mode"):
                    _resolve_mig(self._model, g, gpu)
                changed = {top}
                if top == "clock_event_ns":    # only the reasons named are set; the others keep running
                    named = value if key == top else {key.split(".", 1)[1]: value}
                    changed = {f"clock_event_ns.{r}" for r in named}
                _sync_counters(g, self._now_ns(), changed=changed)
            self._commit()

    def set_driver_profile(self, profile: str) -> None:
        self.set(None, "driver_profile", profile)

    def set_privileged(self, on: bool = True) -> None:
        self.set(None, "privileged", bool(on))

    def set_throttle(self, gpu: int, mask: int) -> None:
        self.set(gpu, "throttle_mask", int(mask))

    def inject_health(self, gpu: int, *, retired_pages: Mapping[str, int] | None = None,
                      retired_pending: bool | None = None, ecc_aggregate: Mapping[str, int] | None = None,
                      nvlink_errors: Mapping[int, Mapping[str, int]] | None = None,
                      nvlink_down: Iterable[int] | None = None,
                      clock_event_ns: Mapping[str, int] | None = None) -> None:
        """SYNTHETIC hardware-health state of ``gpu``, each given argument set as it is from now on (a
        lower value than before is a counter reset, as after a driver reload):

        - ``retired_pages``: {"single_bit_ecc": n, "double_bit_ecc": m} pages retired per cause (makes
          the GPU one with page retirement, as before Ampere; ``{}`` keeps it with none);
        - ``retired_pending``: pages waiting for a reboot to be retired;
        - ``ecc_aggregate``: {"corrected": n, "uncorrected": m} lifetime ECC counts before this driver load;
        - ``nvlink_errors``: {link: {"crc_flit": n, "crc_data": .., "replay": .., "recovery": ..}} per link;
        - ``nvlink_down``: the links whose state is DISABLED (the others of the GPU's links are up);
        - ``clock_event_ns``: {reason: ns} clock-event durations (sw_power_cap, sw_thermal, sync_boost,
          hw_thermal, hw_power_brake); they keep running while the reason's bit is in throttle_mask."""
        with self._locked():
            g = self._gpu(gpu)
            changed: set[str] = set()
            if retired_pages is not None:
                bad = set(retired_pages) - set(_RETIRE_CAUSES)
                if bad:
                    raise EmulatorError(f"inject_health: retired_pages causes must be of {', '.join(_RETIRE_CAUSES)}")
                pages = []
                for cause, n in retired_pages.items():   # SYNTHETIC page addresses, 2 MiB apart
                    pages += [{"cause": _RETIRE_CAUSES[cause], "address": (len(pages) + k + 1) << 21,
                               "timestamp_us": int(time.time() * 1e6)} for k in range(int(n))]   # retired now
                g["retired_pages"] = pages
            if retired_pending is not None:
                g["retired_pages_pending"] = bool(retired_pending)
            if ecc_aggregate is not None:
                for k, v in ecc_aggregate.items():
                    if k not in ("corrected", "uncorrected"):
                        raise EmulatorError("inject_health: ecc_aggregate keys are corrected and uncorrected")
                    g[f"ecc_aggregate_{k}"] = int(v)
            if nvlink_errors is not None:
                g["nvlink_link_errors"] = {str(int(link)): dict(c) for link, c in nvlink_errors.items()}
            if nvlink_down is not None:
                g["nvlink_down"] = sorted({int(x) for x in nvlink_down})
            if clock_event_ns is not None:
                g["clock_event_ns"] = {**g.get("clock_event_ns", {}), **{r: int(v) for r, v in clock_event_ns.items()}}
                changed = {f"clock_event_ns.{r}" for r in clock_event_ns}
            _validate_gpu(g, gpu)
            _sync_counters(g, self._now_ns(), changed=changed)
            self._commit()

    def inject_xid(self, gpu: int, xid: int, gpu_instance: int | None = None,
                   compute_instance: int | None = None) -> None:
        """An XID critical-error event on ``gpu``: every event set registered for it (in any process)
        receives it; a process that registers later gets it then."""
        with self._locked():
            self._gpu(gpu)
            m = self._model
            m["next_seq"] += 1
            m["events"].append({"seq": m["next_seq"], "gpu": gpu, "type": EVENT_TYPE_XID, "data": int(xid),
                                "gi": UINT_MAX if gpu_instance is None else int(gpu_instance),
                                "ci": UINT_MAX if compute_instance is None else int(compute_instance)})
            del m["events"][:-MAX_EVENTS]
            self._commit()

    def add_process(self, gpu: int, pid: int, used_bytes: int | None, gpu_instance: int | None = None, *,
                    compute_instance: int = 0, sm_util_percent: int = 0, mem_util_percent: int = 0) -> None:
        """A compute process on ``gpu`` (``used_bytes`` None: NVML_VALUE_NOT_AVAILABLE), in MIG
        instance ``gpu_instance`` when MIG is on."""
        with self._locked():
            g = self._gpu(gpu)
            p: dict[str, Any] = {"pid": int(pid), "used_memory_bytes": used_bytes,
                                 "sm_util_percent": int(sm_util_percent), "mem_util_percent": int(mem_util_percent)}
            if gpu_instance is not None:
                p["gpu_instance_id"] = int(gpu_instance)
                p["compute_instance_id"] = int(compute_instance)
            g["processes"] = [q for q in g.get("processes", []) if q["pid"] != pid] + [p]
            _validate_gpu(g, gpu)
            self._commit()

    def remove_process(self, pid: int, gpu: int | None = None) -> None:
        with self._locked():
            for i, g in enumerate(self._model["gpus"]):
                if gpu is None or i == gpu:
                    g["processes"] = [q for q in g.get("processes", []) if q["pid"] != pid]
            self._commit()

    def set_mig(self, gpu: int, enabled: bool, instances: Iterable[str | Mapping[str, Any]] = ()) -> None:
        """MIG on or off on ``gpu`` (current and pending mode) with these instances: profile names
        ("3g.40gb", from the fixture's mig_profiles; GPU instance ids 1, 2, ... in order) or dicts
        with gpu_instance_id, compute_instance_id, profile_id or profile, memory_used_bytes, uuid."""
        with self._locked():
            g = self._gpu(gpu)
            if g.get("mig_mode") is None:
                raise EmulatorError(f"set_mig: GPU {gpu} does not support MIG in this fixture (mig_mode null)")
            specs = []
            for k, inst in enumerate(instances):
                specs.append({"profile": inst, "gpu_instance_id": k + 1} if isinstance(inst, str) else dict(inst))
            g["mig_mode"] = [1, 1] if enabled else [0, 0]
            g["mig_instances"] = specs if enabled else []
            _resolve_mig(self._model, g, gpu)
            self._commit()

    def fail(self, call: str, code: int | str, gpu: int | None = None, times: int | None = None) -> int:
        """Make entry point ``call`` answer ``code`` (an nvmlReturn_t or its name: "UNKNOWN", "TIMEOUT")
        on ``gpu`` (None: every GPU, and calls without one) for ``times`` calls per process (None:
        until :meth:`clear_fail`). ``call`` is an exported symbol, or a name without its _vN suffix
        for every version of it. pynvml's nvmlInit() calls nvmlInitWithFlags. Returns the rule id."""
        rc = RETURN_CODES.get(code.upper().removeprefix("NVML_ERROR_")) if isinstance(code, str) else code
        if not isinstance(rc, int) or isinstance(rc, bool):
            raise EmulatorError(f"fail: {code!r} is not an NVML return code (a number or one of "
                                f"{', '.join(sorted(RETURN_CODES))})")
        if call not in self._symbols and call not in {_base_name(s) for s in self._symbols}:
            raise EmulatorError(f"fail: {call!r} is not an entry point the emulator exports "
                                f"(list: {self.build / 'symbols.txt'})")
        if times is not None and times < 0:
            raise EmulatorError("fail: times must be >= 0 (None: until cleared)")
        with self._locked():
            m = self._model
            if gpu is not None:
                self._gpu(gpu)
            if len(m["fails"]) >= MAX_FAIL:
                raise EmulatorError(f"fail: at most {MAX_FAIL} rules at once; clear_fail() some")
            m["next_fail_id"] += 1
            m["fails"].append({"id": m["next_fail_id"], "call": call, "code": int(rc),
                               "gpu": -1 if gpu is None else int(gpu), "times": -1 if times is None else int(times)})
            self._commit()
            return m["next_fail_id"]

    def clear_fail(self, rule: int | None = None) -> None:
        """Remove one fail rule (by the id fail() returned), or all of them."""
        with self._locked():
            self._model["fails"] = [f for f in self._model["fails"] if rule is not None and f["id"] != rule]
            self._commit()

    def drop_field(self, field_id: int, gpu: int | None = None) -> None:
        """nvmlDeviceGetFieldValues answers NOT_SUPPORTED for this field id (on one GPU or all)."""
        with self._locked():
            key = [int(field_id), -1 if gpu is None else int(gpu)]
            if key not in self._model["dropped"]:
                self._model["dropped"].append(key)
            self._commit()

    def restore_field(self, field_id: int, gpu: int | None = None) -> None:
        with self._locked():
            key = [int(field_id), -1 if gpu is None else int(gpu)]
            self._model["dropped"] = [d for d in self._model["dropped"] if d != key]
            self._commit()

    def lose_gpu(self, gpu: int) -> None:
        """The GPU falls off the bus: every call on it answers NVML_ERROR_GPU_IS_LOST from now on."""
        self.set(gpu, "lost", True)

    # ------------------------------------------------------------------ reading back
    def calls(self, pid: int | None = None) -> dict[str, int]:
        """Calls per exported symbol, summed over every process that used this node (or one pid);
        every symbol is present, 0 when never called."""
        out = dict.fromkeys(self._symbols, 0)
        for p, counts in self._count_files():
            if pid is None or p == pid:
                for name, n in counts.items():
                    out[name] = out.get(name, 0) + n
        return out

    def called(self, pid: int | None = None) -> dict[str, int]:
        """Only the symbols called at least once."""
        return {k: v for k, v in self.calls(pid).items() if v}

    def pids(self) -> list[int]:
        """Processes that initialised NVML on this node (they each have a call counter file)."""
        return sorted(p for p, _ in self._count_files())

    def reset_calls(self) -> None:
        """Zero every process's counters (live: the processes keep counting from 0)."""
        for path in self.state_dir.glob("calls.*"):
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
                nsyms, ent = _counter_header(mm, path)
                for i in range(nsyms):
                    off = 64 + i * ent + 56
                    mm[off:off + 8] = b"\0" * 8

    def library_error(self) -> str:
        """The last sentence the library wrote about this node (a bad state file, ...), or ""."""
        try:
            return (self.state_dir / "error").read_text().strip()
        except OSError:
            return ""

    @property
    def model(self) -> dict[str, Any]:
        """A copy of the node as the controller holds it (fixture keys plus counters)."""
        with self._locked():
            return copy.deepcopy(self._model)

    @property
    def driver_profile(self) -> str:
        return self._model["driver_profile"]

    # ------------------------------------------------------------------ internals
    def _gpu(self, gpu: int) -> dict[str, Any]:
        gpus = self._model["gpus"]
        if not isinstance(gpu, int) or not 0 <= gpu < len(gpus):
            raise EmulatorError(f"GPU {gpu!r} does not exist on this node (0-{len(gpus) - 1})")
        return gpus[gpu]

    def _set_global(self, key: str, value: Any) -> None:
        kind = GLOBAL_KEYS.get(key)
        if kind is None:
            raise EmulatorError(f"set: {key!r} is not a global key ({', '.join(sorted(GLOBAL_KEYS))})")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise EmulatorError(f"set: {key} must be a {kind.__name__}, not {value!r}")
        if key == "driver_profile":
            _check_profile(value)
        self._model[key] = value

    def _now_ns(self) -> int:
        m = self._model
        if m["clock"] == "frozen":
            return int(m["clock_offset_ns"])
        return time.monotonic_ns() - int(m["clock_origin_ns"]) + int(m["clock_offset_ns"])

    @contextlib.contextmanager
    def _locked(self, load: bool = True) -> Iterator[None]:
        with open(self.state_dir / "lock", "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            if load:
                self._load_model()
            try:
                yield
            except BaseException:
                self._model_stamp = None     # a refused change may have touched the model: re-read it
                raise

    def _load_model(self) -> None:
        path = self.state_dir / "model.json"
        st = path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._model_stamp:
            self._model = json.loads(path.read_text())
            self._model_stamp = stamp

    def _write_text(self, name: str, text: str) -> None:
        tmp = self.state_dir / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.state_dir / name)

    def _write_model(self) -> None:
        self._write_text("model.json", json.dumps(self._model))
        st = (self.state_dir / "model.json").stat()
        self._model_stamp = (st.st_mtime_ns, st.st_size)

    def _commit(self) -> None:
        """Write the node to ``control`` (whole), then bump ``generation`` in place (the library maps
        that file, so it must never be replaced)."""
        m = self._model
        m["generation"] += 1
        self._write_text("control", _render(m))
        self._write_model()
        with open(self.state_dir / "generation", "r+b") as f:
            f.write(struct.pack("<Q", m["generation"]))

    def _count_files(self) -> list[tuple[int, dict[str, int]]]:
        out = []
        for path in self.state_dir.glob("calls.*"):
            try:
                pid = int(path.suffix[1:])
                with open(path, "rb") as f:
                    data = f.read()
            except (ValueError, OSError):
                continue
            if len(data) < 64:
                continue
            nsyms, ent = _counter_header(data, path)
            counts = {}
            for i in range(nsyms):
                off = 64 + i * ent
                if off + ent > len(data):
                    break
                name = data[off:off + 56].split(b"\0", 1)[0].decode()
                counts[name] = struct.unpack_from("<Q", data, off + 56)[0]
            out.append((pid, counts))
        return out


def _counter_header(buf: Any, path: Path) -> tuple[int, int]:
    if bytes(buf[:8]) != b"NVEMUCN1":
        raise EmulatorError(f"{path} is not an emulator call counter file")
    _ver, nsyms, ent = struct.unpack_from("<III", buf, 8)
    return nsyms, ent


def _loaded_nvml_libraries() -> set[str]:
    """Paths of every libnvidia-ml.so.1 mapped into this process (Linux /proc/self/maps)."""
    out = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("/" + LIB_NAME):
                    out.add(os.path.realpath(line.split(None, 5)[-1].strip()))
    except OSError:
        pass
    return out


# ---------------------------------------------------------------------------------------------- model
def _load_fixture(fixture: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(fixture, Mapping):
        return copy.deepcopy(dict(fixture))
    path = Path(fixture)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise EmulatorError(f"cannot read the fixture {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise EmulatorError(f"the fixture {path} is not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict):
        raise EmulatorError(f"the fixture {path} is not a JSON object")
    return doc


def _node_model(doc: dict[str, Any], *, clock: str, driver_profile: str | None,
                privileged: bool | None) -> dict[str, Any]:
    gpus = doc.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        raise EmulatorError("the fixture has no 'gpus' list")
    if len(gpus) > MAX_GPUS:
        raise EmulatorError(f"the fixture has {len(gpus)} GPUs; the emulator holds at most {MAX_GPUS}")
    cuda = doc.get("cuda_driver_version", 12040)
    driver = str(doc.get("driver_version", "550.54.15"))
    profile = driver_profile or doc.get("driver_profile", "r550")
    _check_profile(profile)
    m: dict[str, Any] = {
        "node_id": secrets.token_hex(8), "generation": 0, "driver_version": driver,
        # NVML's own version is "<CUDA major>.<driver version>", e.g. 12.550.54.15 (nvidia-smi -q)
        "nvml_version": str(doc.get("nvml_version", f"{int(cuda) // 1000}.{driver}")),
        "cuda_driver_version": int(cuda), "driver_profile": profile,
        "privileged": bool(doc.get("privileged", False) if privileged is None else privileged),
        "clock": clock, "clock_origin_ns": time.monotonic_ns(), "clock_offset_ns": 0,
        "epoch_origin_us": time.time_ns() // 1000,
        # utilization sample period: NVML documents 1/6 s to 1 s depending on the product
        "proc_sample_period_us": int(doc.get("proc_sample_period_us", 166_667)),
        "util_sample_period_us": int(doc.get("util_sample_period_us", 166_667)),
        "pcie_throughput_delay_us": int(doc.get("pcie_throughput_delay_us", 20_000)),
        "mig_profiles": [dict(p) for p in doc.get("mig_profiles", [])],
        "gpus": [], "events": [], "next_seq": 0, "fails": [], "next_fail_id": 0, "dropped": [],
    }
    _validate_profiles(m["mig_profiles"])
    for i, g0 in enumerate(gpus):
        if not isinstance(g0, dict):
            raise EmulatorError(f"GPU {i} of the fixture is not an object")
        g = copy.deepcopy(g0)
        if g.get("index", i) != i:
            raise EmulatorError(f"GPU {i} of the fixture has index {g.get('index')!r}; indexes must be 0, 1, ...")
        _validate_gpu(g, i)
        _resolve_mig(m, g, i)
        g["_ctr"], g["_gpm"] = {}, {}
        _sync_counters(g, 0, changed=set())
        m["gpus"].append(g)
    for ev in doc.get("events", []):
        if ev.get("kind", "xid") != "xid" or not 0 <= int(ev.get("gpu", -1)) < len(gpus):
            raise EmulatorError(f"fixture event {ev!r} is not an XID on an existing GPU")
        m["next_seq"] += 1
        m["events"].append({"seq": m["next_seq"], "gpu": int(ev["gpu"]), "type": EVENT_TYPE_XID,
                            "data": int(ev["xid"]), "gi": UINT_MAX, "ci": UINT_MAX})
    return m


def _validate_profiles(profiles: list[dict[str, Any]]) -> None:
    for p in profiles:
        for k in ("profile", "id", "name", "slices", "memory_mb"):
            if k not in p:
                raise EmulatorError(f"mig_profiles entry {p!r} lacks {k!r}")


def _validate_gpu(g: dict[str, Any], i: int) -> None:
    for k in _REQUIRED:
        if k not in g:
            raise EmulatorError(f"GPU {i} of the fixture lacks {k!r}")
    for k, v in g.items():
        if k.startswith("_") or k not in GPU_KEYS or v is None:
            continue           # keys the emulator does not model are kept and ignored here
        kind = GPU_KEYS[k][0]
        if isinstance(v, bool) and kind is not bool:
            raise EmulatorError(f"GPU {i}: {k} must be a number, not {v!r}")
        if not isinstance(v, kind):
            name = kind.__name__ if isinstance(kind, type) else "number"
            raise EmulatorError(f"GPU {i}: {k} must be a {name}, not {v!r}")
        if isinstance(v, str) and ("\n" in v or not v.strip()):
            raise EmulatorError(f"GPU {i}: {k} must be one non-empty line")
    if g["memory_used_bytes"] > g["memory_total_bytes"]:
        raise EmulatorError(f"GPU {i}: memory_used_bytes is more than memory_total_bytes")
    if len(g.get("processes", [])) > MAX_PROCS:
        raise EmulatorError(f"GPU {i}: more than {MAX_PROCS} processes")
    for p in g.get("processes", []):
        if not isinstance(p, dict) or not isinstance(p.get("pid"), int):
            raise EmulatorError(f"GPU {i}: process {p!r} has no integer pid")
    mode = g.get("mig_mode")
    if mode is not None and (len(mode) != 2 or any(x not in (0, 1) for x in mode)):
        raise EmulatorError(f"GPU {i}: mig_mode must be [current, pending] of 0/1, or null")
    cc = g.get("cuda_compute_capability")
    if cc is not None and (len(cc) != 2 or not all(isinstance(x, int) for x in cc)):
        raise EmulatorError(f"GPU {i}: cuda_compute_capability must be [major, minor]")
    _validate_health(g, i)
    for key in ("gpm",):
        for name, val in (g.get(key) or {}).items():
            _gpm_metric_id(name, i)
            if not isinstance(val, _NUM):
                raise EmulatorError(f"GPU {i}: gpm.{name} must be a number")
    for gi, vals in (g.get("gpm_mig") or {}).items():
        if not str(gi).isdigit() or not isinstance(vals, dict):
            raise EmulatorError(f"GPU {i}: gpm_mig keys must be GPU instance ids with a dict of metrics")
        for name, val in vals.items():
            _gpm_metric_id(name, i)
            if not isinstance(val, _NUM):
                raise EmulatorError(f"GPU {i}: gpm_mig.{gi}.{name} must be a number")


def _validate_health(g: dict[str, Any], i: int) -> None:
    for link in g.get("nvlink_down") or ():
        if not isinstance(link, int) or isinstance(link, bool) or not 0 <= link < _MAX_LINKS:
            raise EmulatorError(f"GPU {i}: nvlink_down entries must be link numbers 0-{_MAX_LINKS - 1}, not {link!r}")
    for link, counters in (g.get("nvlink_link_errors") or {}).items():
        if not str(link).isdigit() or int(link) >= _MAX_LINKS or not isinstance(counters, dict):
            raise EmulatorError(f"GPU {i}: nvlink_link_errors keys must be link numbers 0-{_MAX_LINKS - 1} "
                                f"with a dict of counters")
        for name, val in counters.items():
            if name not in NVLINK_ERROR_COUNTERS:
                raise EmulatorError(f"GPU {i}: nvlink_link_errors.{link}: {name!r} is not one of "
                                    f"{', '.join(NVLINK_ERROR_COUNTERS)}")
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise EmulatorError(f"GPU {i}: nvlink_link_errors.{link}.{name} must be a count >= 0")
    for name, val in (g.get("clock_event_ns") or {}).items():
        if name not in CLOCK_EVENT_REASONS:
            raise EmulatorError(f"GPU {i}: clock_event_ns: {name!r} is not one of {', '.join(CLOCK_EVENT_REASONS)}")
        if not isinstance(val, _NUM) or isinstance(val, bool) or val < 0:
            raise EmulatorError(f"GPU {i}: clock_event_ns.{name} must be nanoseconds >= 0")


def _gpm_metric_id(name: str, i: int) -> int:
    if name in GPM_METRIC_IDS:
        return GPM_METRIC_IDS[name]
    if str(name).isdigit() and 0 < int(name) < 477:     # NVML_GPM_METRIC_MAX (nvml.h)
        return int(name)
    raise EmulatorError(f"GPU {i}: GPM metric {name!r} is not one of {', '.join(GPM_METRIC_IDS)} or a metric id")


def _resolve_mig(m: dict[str, Any], g: dict[str, Any], i: int) -> None:
    """Fill in each MIG instance's profile id, memory and UUID from the fixture's mig_profiles."""
    by_name = {p["name"].removeprefix("MIG ").strip(): p for p in m["mig_profiles"]}
    by_id = {p["id"]: p for p in m["mig_profiles"]}
    out, seen = [], set()
    for inst in g.get("mig_instances") or []:
        inst = dict(inst)
        prof = inst.pop("profile", None)
        if prof is not None:
            p = by_name.get(str(prof).removeprefix("MIG ").strip())
            if p is None:
                raise EmulatorError(f"GPU {i}: MIG profile {prof!r} is not in the fixture's mig_profiles")
            inst["profile_id"] = p["id"]
        p = by_id.get(inst.get("profile_id"))
        if p is None:
            raise EmulatorError(f"GPU {i}: MIG instance {inst!r} has no known profile_id")
        gi, ci = int(inst.get("gpu_instance_id", -1)), int(inst.setdefault("compute_instance_id", 0))
        if not (0 <= gi < 16 and 0 <= ci < 8) or (gi, ci) in seen:
            raise EmulatorError(f"GPU {i}: MIG instance ids ({gi}, {ci}) are outside 0-15 / 0-7 or repeated")
        seen.add((gi, ci))
        inst.setdefault("placement_start", 0)
        inst.setdefault("memory_total_bytes", int(p["memory_mb"]) * 1024 * 1024)
        inst.setdefault("memory_used_bytes", 0)
        inst.setdefault("uuid", f"MIG-{g['uuid'].removeprefix('GPU-')[:-4]}{gi:02x}{ci:02x}")
        out.append(inst)
    if len(out) > MAX_MIG:
        raise EmulatorError(f"GPU {i}: more than {MAX_MIG} MIG devices")
    g["mig_instances"] = sorted(out, key=lambda x: (x["gpu_instance_id"], x["compute_instance_id"]))


def _counter_specs(g: dict[str, Any]) -> dict[str, tuple[str | None, float, float]]:
    """counter -> (fixture key that sets its value, value at start, rate per second)."""
    def num(k: str) -> float:
        v = g.get(k, GPU_KEYS[k][1])
        return float(v or 0)

    s: dict[str, tuple[str | None, float, float]] = {
        "energy_mj": ("energy_start_mj", num("energy_start_mj"), num("power_mw")),   # mW = mJ/s
        "ecc_sbe": ("ecc_corrected", num("ecc_corrected"), num("ecc_corrected_per_s")),
        "ecc_dbe": ("ecc_uncorrected", num("ecc_uncorrected"), num("ecc_uncorrected_per_s")),
        "pcie_replay": ("pcie_replay_count", num("pcie_replay_count"), num("pcie_replay_per_s")),
    }
    if g.get("pcie_byte_counters"):
        s["pcie_tx_bytes"] = (None, 0.0, num("pcie_tx_kb_per_s") * 1024)
        s["pcie_rx_bytes"] = (None, 0.0, num("pcie_rx_kb_per_s") * 1024)
    if int(g.get("nvlink_links", 0)) > 0:
        s["nvlink_tx_kib"] = (None, 0.0, num("nvlink_tx_kib_per_s"))
        s["nvlink_rx_kib"] = (None, 0.0, num("nvlink_rx_kib_per_s"))
        for raw in ("tx", "rx"):
            if g.get(f"nvlink_raw_{raw}_kib_per_s") is not None:
                s[f"nvlink_raw_{raw}_kib"] = (None, 0.0, num(f"nvlink_raw_{raw}_kib_per_s"))
        for e in ("replay", "recovery", "crc_flit", "crc_data", "ecc_data"):
            s[f"nvlink_{e}"] = (f"nvlink_{e}_errors", num(f"nvlink_{e}_errors"), num(f"nvlink_{e}_errors_per_s"))
    mask = int(g.get("throttle_mask", 0))
    any_limiter = 0.0
    events = g.get("clock_event_ns") or {}
    for name, bits, reason in _VIOLATION_BITS:
        rate = 1e9 if mask & bits else 0.0          # ns of violation per second while the reason holds
        s[name] = (f"clock_event_ns.{reason}", float(events.get(reason, 0)), rate)
        any_limiter = max(any_limiter, rate)
    for name in ("viol_board_limit_ns", "viol_low_util_ns", "viol_reliability_ns", "viol_total_base_ns"):
        s[name] = (None, 0.0, 0.0)
    s["viol_total_app_ns"] = (None, 0.0, any_limiter)
    return s


def _gpm_specs(g: dict[str, Any]) -> dict[str, dict[str, float]]:
    """instance ("-1": the device) -> metric id -> rate (the metric's value over any interval)."""
    out: dict[str, dict[str, float]] = {}
    if g.get("gpm"):
        out["-1"] = {str(GPM_METRIC_IDS.get(k, k)): float(v) for k, v in g["gpm"].items()}
    for gi, vals in (g.get("gpm_mig") or {}).items():
        out[str(int(gi))] = {str(GPM_METRIC_IDS.get(k, k)): float(v) for k, v in vals.items()}
    return out


def _rebase(c: list[float], rate: float, now: int, value: float | None = None) -> None:
    base, old_rate, t0 = c
    if value is None:
        value = base + old_rate * max(0, now - t0) / 1e9
    c[:] = [value, rate, now]


def _sync_counters(g: dict[str, Any], now: int, changed: set[str]) -> None:
    """Bring every counter's rate in line with the fixture values, re-basing at ``now`` whatever
    changed (a value key sets the counter itself; e.g. ecc_corrected = 5 means 5 from now on)."""
    specs = _counter_specs(g)
    ctr = g["_ctr"]
    for name in list(ctr):
        if name not in specs:
            del ctr[name]
    for name, (vkey, start, rate) in specs.items():
        c = ctr.get(name)
        if c is None:
            ctr[name] = [start, rate, now]
        elif vkey is not None and vkey in changed:
            _rebase(c, rate, now, value=start)
        elif c[1] != rate:
            _rebase(c, rate, now)
    gpm = g["_gpm"]
    want = _gpm_specs(g)
    for inst in list(gpm):
        if inst not in want:
            del gpm[inst]
    for inst, metrics in want.items():
        have = gpm.setdefault(inst, {})
        for mid in list(have):
            if mid not in metrics:
                del have[mid]
        for mid, rate in metrics.items():
            c = have.get(mid)
            if c is None:
                have[mid] = [0.0, rate, now]
            elif c[1] != rate:
                _rebase(c, rate, now)


def _set_path(g: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    d = g
    for p in parts[:-1]:
        nxt = d.get(p)
        if nxt is None:
            nxt = d[p] = {}
        if not isinstance(nxt, dict):
            raise EmulatorError(f"set: {key!r} goes through {p!r}, which is not an object")
        d = nxt
    d[parts[-1]] = copy.deepcopy(value)


# ---------------------------------------------------------------------------------------------- render
def _num(v: float) -> str:
    return repr(float(v))


def _render(m: dict[str, Any]) -> str:
    """The node in the library's line format (sim/nvmlemu/README.md)."""
    out = ["nvmlemu 1", "# SYNTHETIC emulated NVML node written by gpuagent.sim.nvml_emulator; not a measurement",
           f"node_id {m['node_id']}", f"generation {m['generation']}",
           f"driver_version {m['driver_version']}", f"nvml_version {m['nvml_version']}",
           f"cuda_driver_version {m['cuda_driver_version']}", f"driver_profile {m['driver_profile']}",
           f"privileged {int(bool(m['privileged']))}", f"clock {m['clock']}",
           f"clock_origin_ns {m['clock_origin_ns']}", f"clock_offset_ns {m['clock_offset_ns']}",
           f"epoch_origin_us {m['epoch_origin_us']}", f"proc_sample_period_us {m['proc_sample_period_us']}",
           f"util_sample_period_us {m['util_sample_period_us']}",
           f"pcie_throughput_delay_us {m['pcie_throughput_delay_us']}", f"gpu_count {len(m['gpus'])}"]
    for p in m["mig_profiles"]:
        out.append(f"mig_profile {p['profile']} {p['id']} {p['slices']} {p.get('instances', 1)} "
                   f"{p.get('multiprocessors', 0)} {p.get('copy_engines', 0)} {p['memory_mb']} {p['name']}")
    for f in m["fails"]:
        out.append(f"fail {f['id']} {f['call']} {f['code']} {f['gpu']} {f['times']}")
    for fid, gpu in m["dropped"]:
        out.append(f"drop_field {fid} {gpu}")
    for e in m["events"]:
        out.append(f"event {e['seq']} {e['gpu']} {e['type']} {e['data']} {e['gi']} {e['ci']}")
    for i, g in enumerate(m["gpus"]):
        out.append(f"gpu {i}")
        out.extend(_render_gpu(g))
    return "\n".join(out) + "\n"


def _render_gpu(g: dict[str, Any]) -> list[str]:
    def get(k: str) -> Any:
        v = g.get(k)
        return GPU_KEYS[k][1] if v is None else v

    o = [f"name {g['name']}", f"uuid {g['uuid']}", f"pci_bus_id {g['pci_bus_id']}",
         f"pci_device_id {get('pci_device_id')}", f"pci_subsystem_id {get('pci_subsystem_id')}",
         f"memory_total {g['memory_total_bytes']}", f"memory_used {g['memory_used_bytes']}",
         f"memory_reserved {get('memory_reserved_bytes')}", f"util_gpu {get('util_gpu_percent')}",
         f"util_mem {get('util_mem_percent')}", f"util_enc {get('enc_util_percent')}",
         f"util_dec {get('dec_util_percent')}", f"power_mw {get('power_mw')}",
         f"power_limit_mw {get('power_limit_mw')}",
         f"power_mgmt_limit_mw {g.get('power_management_limit_mw') or get('power_limit_mw')}",
         f"temperature_c {get('temperature_c')}", f"throttle_mask {get('throttle_mask')}",
         f"recovery_action {get('recovery_action')}",
         f"pcie_gen {get('pcie_gen')}", f"pcie_gen_max {get('pcie_gen_max')}", f"pcie_width {get('pcie_width')}",
         f"pcie_width_max {get('pcie_width_max')}", f"pcie_tx_kbps {get('pcie_tx_kb_per_s')}",
         f"pcie_rx_kbps {get('pcie_rx_kb_per_s')}", f"pcie_byte_counters {int(bool(get('pcie_byte_counters')))}",
         f"virtualization_mode {get('virtualization_mode')}", f"lost {int(bool(get('lost')))}",
         f"process_memory_unavailable {int(bool(get('process_memory_unavailable')))}",
         f"event_types {get('supported_event_types')}",
         f"ecc_aggregate_sbe {get('ecc_aggregate_corrected')}", f"ecc_aggregate_dbe {get('ecc_aggregate_uncorrected')}"]
    if g.get("serial"):
        o.append(f"serial {g['serial']}")
    if g.get("memory_numa_node") is not None:
        o.append(f"memory_numa_node {g['memory_numa_node']}")
    if g.get("cpu_affinity"):
        o.append(f"cpu_affinity {g['cpu_affinity']}")
        if g.get("cpu_affinity_socket"):
            o.append(f"cpu_affinity_socket {g['cpu_affinity_socket']}")
    if g.get("cuda_compute_capability"):
        o.append(f"cc_major {g['cuda_compute_capability'][0]}")
        o.append(f"cc_minor {g['cuda_compute_capability'][1]}")
    mem_temp = g.get("memory_temperature_c", g.get("memory_temp_c"))
    if mem_temp is not None:
        o.append(f"memory_temperature_c {mem_temp}")
    sm = g.get("sm_clock_mhz")
    sm_max = g.get("sm_clock_max_mhz")
    clocks = [g.get("graphics_clock_mhz", sm), sm, g.get("mem_clock_mhz"), g.get("video_clock_mhz")]
    maxes = [g.get("graphics_clock_max_mhz", sm_max), sm_max, g.get("mem_clock_max_mhz"), g.get("video_clock_max_mhz")]
    o.append("clock " + " ".join(str(-1 if v is None else v) for v in clocks))
    o.append("clock_max " + " ".join(str(-1 if v is None else v) for v in maxes))
    links = int(get("nvlink_links"))
    max_links = g.get("nvlink_max_links")
    if max_links is None:
        max_links = 18 if links > 0 else 0          # NVLink 4 on H100 SXM: 18 links (fixture _sources)
    o += [f"nvlink_links {links}", f"nvlink_max_links {max_links}", f"nvlink_speed_mbps {get('nvlink_speed_mbps')}"]
    down = 0
    for link in g.get("nvlink_down") or ():
        down |= 1 << int(link)
    o.append(f"nvlink_down_mask {down}")
    for link, counters in sorted((g.get("nvlink_link_errors") or {}).items(), key=lambda kv: int(kv[0])):
        for name, val in counters.items():
            o.append(f"nvlink_link_error {int(link)} {NVLINK_ERROR_COUNTERS.index(name)} {int(val)}")
    mode = g.get("mig_mode")
    if mode is not None:
        o.append(f"mig_mode {mode[0]} {mode[1]}")
        o.append(f"mig_max_devices {get('mig_max_devices')}")
        for inst in g.get("mig_instances", []):
            o.append(f"mig {inst['gpu_instance_id']} {inst['compute_instance_id']} {inst['profile_id']} "
                     f"{inst['placement_start']} {inst['memory_total_bytes']} {inst['memory_used_bytes']} "
                     f"{inst.get('memory_reserved_bytes', 0)} {inst['uuid']}")
    rr = g.get("remapped_rows", {})
    if isinstance(rr, list):       # [correctable, uncorrectable, pending, failure], as pynvml returns them
        rr = dict(zip(("correctable", "uncorrectable", "pending", "failure"), rr))
    if rr is not None:
        o += ["remapped_supported 1", f"remapped_cor {rr.get('correctable', 0)}",
              f"remapped_unc {rr.get('uncorrectable', 0)}", f"remapped_pending {int(bool(rr.get('pending', 0)))}",
              f"remapped_failure {int(bool(rr.get('failure', 0)))}"]
    pages = g.get("retired_pages")
    if pages is not None:
        o.append("retired_supported 1")
        o.append(f"retired_pending {int(bool(g.get('retired_pages_pending')))}")
        for pg in pages:
            o.append(f"retired_page {int(pg.get('cause', 0))} {int(pg['address'])} {int(pg.get('timestamp_us', 0))}")
    lic = g.get("grid_license", g.get("vgpu_license"))
    if lic is not None:
        o.append("grid_supported 1")
        exp = lic.get("expiry", {})
        state = lic.get("feature_state", int(bool(lic.get("licensed", True))))
        if lic.get("feature_code", 1) is not None:    # 1 = NVML_GRID_LICENSE_FEATURE_CODE_VGPU
            o.append(f"grid_feature {lic.get('feature_code', 1)} {int(state)} "
                     f"{int(lic.get('enabled', True))} {exp.get('status', 0)} {exp.get('year', 0)} "
                     f"{exp.get('month', 0)} {exp.get('day', 0)} {exp.get('hour', 0)} {exp.get('minute', 0)} "
                     f"{exp.get('second', 0)} {lic.get('product_name', 'NVIDIA Virtual GPU')}")
    gpm_on = g.get("gpm_supported")
    if gpm_on is None:
        gpm_on = bool(g.get("gpm")) or bool(g.get("gpm_mig"))
    o.append(f"gpm_supported {int(bool(gpm_on))}")
    for name in g.get("not_supported", []):
        o.append(f"not_supported {name}")
    for name, (base, rate, t0) in g["_ctr"].items():
        o.append(f"counter {name} {_num(base)} {_num(rate)} {int(t0)}")
    for inst, metrics in g["_gpm"].items():
        for mid, (base, rate, t0) in metrics.items():
            o.append(f"gpm {inst} {mid} {_num(base)} {_num(rate)} {int(t0)}")
    for p in g.get("processes", []):
        used = p.get("used_memory_bytes")
        o.append(f"proc {p['pid']} {'na' if used is None else int(used)} "
                 f"{p.get('gpu_instance_id', 0)} {p.get('compute_instance_id', 0)} "
                 f"{p.get('sm_util_percent', 0)} {p.get('mem_util_percent', 0)} "
                 f"{p.get('enc_util_percent', 0)} {p.get('dec_util_percent', 0)}")
    return o
