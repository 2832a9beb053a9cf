"""NodeInfo for Register: this machine through real psutil and /proc, GPUs from the real pynvml over the
NVML emulator (SYNTHETIC 8x H100 node, the `nvml_emulator` fixture)."""

from __future__ import annotations

import platform
from pathlib import Path

import psutil

from gpuagent import __version__
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.nodeinfo import build_node_info, machine_id
from gpuagent.common.nvml import Nvml
from nvml_emulator_fixture import H100_8GPU, numa_sysfs


def test_this_machine_without_nvml(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    emu.fail("nvmlInitWithFlags", "DRIVER_NOT_LOADED")      # the node is there, its driver is not loaded
    node = build_node_info({"pool": "dev", "price_per_gpu_hour": "2.5"}, GpuSampler(Nvml()))
    assert dict(node.labels) == {"pool": "dev", "price_per_gpu_hour": "2.5"}
    assert node.agent_version == __version__
    mid = Path("/etc/machine-id")
    if mid.exists() and mid.read_text().strip():
        assert node.machine_id == mid.read_text().strip()
    assert node.machine_id == machine_id()
    assert node.cpu_cores_logical == psutil.cpu_count() and node.memory_total_bytes == psutil.virtual_memory().total
    assert node.kernel == platform.release() and node.numa_nodes >= 1
    assert abs(node.boot_time_ns / 1e9 - psutil.boot_time()) < 2
    assert len(node.gpus) == 0 and node.driver_version == "" and node.cuda_version == ""
    assert node.fingerprint.nvml_virtualization_mode == ""


def test_gpus_and_versions_from_nvml(nvml_emulator):
    nvml_emulator(H100_8GPU)
    gpu = GpuSampler(Nvml())
    node = build_node_info({}, gpu)
    assert len(node.gpus) == 8 and node.gpus[5].mig_mode == "enabled"
    assert node.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert (node.driver_version, node.cuda_version) == ("550.54.15", "12.4")
    assert node.fingerprint.nvml_virtualization_mode == "passthrough" and node.fingerprint.virtualized


def test_gpu_numa_node_in_node_info(nvml_emulator, tmp_path):
    """The CPU-side NUMA node of each GPU (NVML's CPU affinity over a SYNTHETIC sysfs node tree), as
    Register carries it; x86 drivers answer nvmlDeviceGetNumaNodeId with NOT_SUPPORTED."""
    nvml_emulator(H100_8GPU)
    node = build_node_info({}, GpuSampler(Nvml(), sys_root=str(numa_sysfs(tmp_path / "sys"))))
    assert [g.numa_node for g in node.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_machine_id_fallbacks(tmp_path):
    (tmp_path / "var/lib/dbus").mkdir(parents=True)
    (tmp_path / "var/lib/dbus/machine-id").write_text("abc123\n")
    assert machine_id(str(tmp_path)) == "abc123"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/machine-id").write_text("feedface\n")
    assert machine_id(str(tmp_path)) == "feedface"
    assert machine_id(str(tmp_path / "empty")).startswith("host-")
