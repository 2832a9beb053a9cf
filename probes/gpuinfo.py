"""GPU facts the CUDA probes need beyond torch: NVML handle, PCIe link, NUMA placement.

Runs only inside probe subprocesses (pynvml is imported lazily; a node without NVML gets empty answers,
never an exception). Theoretical PCIe rates per lane and direction come from the PCI-SIG base
specifications: Gen1 2.5 GT/s and Gen2 5 GT/s with 8b/10b encoding; Gen3 8, Gen4 16, Gen5 32 GT/s with
128b/130b; Gen6 64 GT/s (PAM4, FLIT mode, no 8b/10b or 128b/130b; FLIT FEC/CRC overhead not deducted).
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

PCIE_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
PCIE_ENCODING = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 1.0}


def pcie_theoretical_gbps(gen: int, width: int) -> float | None:
    """Raw link rate per direction in GB/s (10^9 B/s) for the given generation and lane count."""
    if gen not in PCIE_GT_PER_S or width <= 0:
        return None
    return PCIE_GT_PER_S[gen] * PCIE_ENCODING[gen] * width / 8.0


_NVML: Any = None
_NVML_ERR = ""


def nvml():
    """The initialised pynvml module, or None (see ``nvml_error()``)."""
    global _NVML, _NVML_ERR
    if _NVML is None and not _NVML_ERR:
        try:
            import pynvml
            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception as exc:  # noqa: BLE001 - no driver, no library: report, don't raise
            _NVML_ERR = f"NVML unavailable: {exc}"
    return _NVML


def nvml_error() -> str:
    return _NVML_ERR


def nvml_handle(torch_index: int):
    """NVML handle of the GPU torch calls ``torch_index`` (by UUID, then PCI bus id; CUDA and NVML
    may number GPUs differently)."""
    n = nvml()
    if n is None:
        return None
    import torch
    props = torch.cuda.get_device_properties(torch_index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            return n.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:  # noqa: BLE001
            pass
    bus = pci_bus_id(torch_index)
    if bus:
        try:
            return n.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001
            pass
    return None


def pci_bus_id(torch_index: int) -> str:
    """"0000:18:00.0" style (sysfs form), or ""."""
    import torch
    p = torch.cuda.get_device_properties(torch_index)
    dom, bus, dev = (getattr(p, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is None:
        return ""
    return f"{dom or 0:04x}:{bus:02x}:{dev or 0:02x}.0"


def link(handle) -> dict[str, int]:
    n = nvml()
    out: dict[str, int] = {}
    if n is None or handle is None:
        return out
    for key, fn in (("link_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                    ("link_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                    ("link_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                    ("link_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
        try:
            out[key] = int(getattr(n, fn)(handle))
        except Exception:  # noqa: BLE001
            pass
    return out


def gpu_numa_node(bus_id: str) -> int:
    try:
        with open(f"/sys/bus/pci/devices/{bus_id.lower()}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.update(range(int(a), int(b) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def numa_nodes() -> dict[int, set[int]]:
    out = {}
    for path in glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"):
        node = int(os.path.basename(os.path.dirname(path))[4:])
        with open(path) as f:
            out[node] = _parse_cpulist(f.read())
    return out


def current_cpu() -> int:
    try:
        return int(ctypes.CDLL(None, use_errno=True).sched_getcpu())
    except (OSError, AttributeError):
        return -1


def cpu_numa_node(cpu: int) -> int:
    for node, cpus in numa_nodes().items():
        if cpu in cpus:
            return node
    return -1
