"""GPU facts the CUDA probes need beyond torch: NVML handle, PCIe link, NUMA placement.

Runs only inside probe subprocesses. NVML goes through the agent's one choke point
(gpuagent.common.nvml.Nvml): a node without NVML gets empty answers, never an exception.

Theoretical PCIe rate per lane and direction (PCI-SIG base specifications; PCI-SIG's "PCI Express
specifications" overview lists the per-lane transfer rates): Gen1 2.5 GT/s and Gen2 5 GT/s with 8b/10b line
coding (80 % of the bits carry data); Gen3 8, Gen4 16, Gen5 32 GT/s with 128b/130b; Gen6 64 GT/s with PAM4
signalling in FLIT mode, where no line code is used but every 256-byte flit carries 8 bytes of CRC and 6 bytes
of FEC (the other 242 bytes are 236 of TLP payload and 6 of DLLP), so 242/256 is Gen6's equivalent of the
line-coding factor. TLP headers, DLLPs and flow control are not deducted at any generation, so a healthy
Gen4/Gen5 x16 measures ~80-90 % of this rate.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

PCIE_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}
# Fraction of the raw bits left for link-layer data (see the module docstring for each generation's source).
PCIE_ENCODING = {1: 8 / 10, 2: 8 / 10, 3: 128 / 130, 4: 128 / 130, 5: 128 / 130, 6: 242 / 256}


def pcie_theoretical_gbps(gen: int, width: int) -> float | None:
    """Raw link rate per direction in GB/s (10^9 B/s) for the given generation and lane count."""
    if gen not in PCIE_GT_PER_S or width <= 0:
        return None
    return PCIE_GT_PER_S[gen] * PCIE_ENCODING[gen] * width / 8.0


_NVML: Any = None


def nvml():
    """The agent's NVML choke point (gpuagent.common.nvml.Nvml), or None when NVML is unavailable."""
    global _NVML
    if _NVML is None:
        from gpuagent.common.nvml import Nvml
        _NVML = Nvml()
    return _NVML if _NVML.available else None


def nvml_error() -> str:
    return "" if _NVML is None or _NVML.available else _NVML.reason


def nvml_handle(torch_index: int):
    """NVML handle of the GPU torch calls ``torch_index`` (by UUID, then PCI bus id; CUDA and NVML
    may number GPUs differently)."""
    n = nvml()
    if n is None:
        return None
    import torch
    props = torch.cuda.get_device_properties(torch_index)
    uuid = getattr(props, "uuid", None)
    h = None
    if uuid is not None:
        h = n.query("nvmlDeviceGetHandleByUUID", f"GPU-{uuid}", report=False)
    if h is None and pci_bus_id(torch_index):
        h = n.query("nvmlDeviceGetHandleByPciBusId", pci_bus_id(torch_index), report=False)
    return h


def pci_bus_id(torch_index: int) -> str:
    """"0000:18:00.0" style (sysfs form), or ""."""
    import torch
    p = torch.cuda.get_device_properties(torch_index)
    dom, bus, dev = (getattr(p, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is None:
        return ""
    return f"{dom or 0:04x}:{bus:02x}:{dev or 0:02x}.0"


def link(handle, gpu: int = -1) -> dict[str, int]:
    """Current and maximum PCIe generation and width from NVML ({} without NVML). ``gpu`` keys NVML's
    "not supported" memo, so one GPU's unsupported call does not silence the others'."""
    n = nvml()
    out: dict[str, int] = {}
    if n is None or handle is None:
        return out
    for key, fn in (("link_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                    ("link_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                    ("link_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                    ("link_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
        v = n.query(fn, handle, gpu=gpu)
        if v is not None:
            out[key] = int(v)
    return out


def gpu_numa_node(bus_id: str, sys_root: str = "/sys") -> int:
    """The GPU's NUMA node from sysfs (-1: unknown; the kernel also writes -1 when firmware gives none)."""
    from gpuagent.common.nvml import sysfs_bus_id
    dev = sysfs_bus_id(bus_id)
    if not dev:
        return -1
    try:
        with open(f"{sys_root}/bus/pci/devices/{dev}/numa_node") as f:
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


_SCHED_GETCPU: Any = None


def current_cpu() -> int:
    """The CPU this thread runs on now (glibc sched_getcpu), or -1."""
    global _SCHED_GETCPU
    try:
        if _SCHED_GETCPU is None:
            _SCHED_GETCPU = ctypes.CDLL(None, use_errno=True).sched_getcpu
        return int(_SCHED_GETCPU())
    except (OSError, AttributeError):
        return -1


def cpu_numa_node(cpu: int) -> int:
    for node, cpus in numa_nodes().items():
        if cpu in cpus:
            return node
    return -1


def numa_local(gpu_node: int, cpu_nodes: set[int], node_count: int) -> int | None:
    """1 when every CPU seen issuing the copies sat on the GPU's NUMA node, 0 when any did not, None
    when unknown (GPU node or a CPU's node unknown). A machine with a single NUMA node is local."""
    if node_count == 1:
        return 1
    if gpu_node < 0 or not cpu_nodes or any(n < 0 for n in cpu_nodes):
        return None
    return 1 if cpu_nodes == {gpu_node} else 0
