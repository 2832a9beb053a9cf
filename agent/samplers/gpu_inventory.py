"""What Register and ``gpuagent status`` say about each GPU (GpuInfo: identity, PCIe link, memory, MIG and
virtualization mode) and which NUMA node's CPUs sit next to it (what the probes pin to).

Not part of the tick: the daemon asks at Register and when it maps PCI bus ids to GPU indices, the health check
when it runs without an agent.
"""

from __future__ import annotations

import os
from typing import Any

from gpuagent.common.nvml import VIRT_MODES, Nvml, sysfs_bus_id


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


class GpuInventoryMixin:
    """GpuSampler's inventory (agent/samplers/gpu.py): one dict per GPU with the proto GpuInfo fields."""

    nvml: Nvml

    def _init_inventory(self, sys_root: str) -> None:
        self.sys_root = sys_root                    # sysfs root (tests give a tmp tree): NUMA nodes, PCI devices
        self.memory_numa_node: dict[int, int] = {}  # GPU -> NUMA node of the GPU's own memory (GH200), if any

    def gpu_inventory(self) -> list[dict[str, Any]]:
        """One dict per GPU with the proto GpuInfo field names (for Register and `status`)."""
        n = self.nvml
        out = []
        for i in range(n.device_count):
            h = n.handle(i)
            pci = n.query("nvmlDeviceGetPciInfo", h, gpu=i)
            mem = self._memory_info(i, h)
            bus = bus_id_of(pci)
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


def _int(v: Any) -> int:
    return int(v) if v is not None else 0


def bus_id_of(pci: Any) -> str:
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
