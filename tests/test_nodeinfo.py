"""NodeInfo for Register: this machine through real psutil and /proc, GPUs from the fake NVML."""

from __future__ import annotations

import platform
from pathlib import Path

import psutil

from fake_nvml import H100_8GPU, FakeNvmlBackend
from gpuagent import __version__
from gpuagent.agent.gpu_sampler import GpuSampler
from gpuagent.agent.nodeinfo import build_node_info, machine_id
from gpuagent.common.nvml import Nvml


def test_this_machine_without_nvml():
    node = build_node_info({"pool": "dev", "price_per_gpu_hour": "2.5"}, GpuSampler(Nvml(backend=FakeNvmlBackend(
        H100_8GPU, init_error=9))))
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


def test_gpus_and_versions_from_nvml():
    gpu = GpuSampler(Nvml(backend=FakeNvmlBackend(H100_8GPU)))
    node = build_node_info({}, gpu)
    assert len(node.gpus) == 8 and node.gpus[5].mig_mode == "enabled"
    assert node.gpus[0].name == "NVIDIA H100 80GB HBM3" and node.gpus[7].numa_node == 1
    assert (node.driver_version, node.cuda_version) == ("550.54.15", "12.4")
    assert node.fingerprint.nvml_virtualization_mode == "passthrough" and node.fingerprint.virtualized


def test_machine_id_fallbacks(tmp_path):
    (tmp_path / "var/lib/dbus").mkdir(parents=True)
    (tmp_path / "var/lib/dbus/machine-id").write_text("abc123\n")
    assert machine_id(str(tmp_path)) == "abc123"
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/machine-id").write_text("feedface\n")
    assert machine_id(str(tmp_path)) == "feedface"
    assert machine_id(str(tmp_path / "empty")).startswith("host-")
