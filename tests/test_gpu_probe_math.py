"""The arithmetic and decisions of the GPU probes that need no GPU: PCIe theoretical rates, bus-id forms,
NUMA locality, collective iteration counts, the single-GPU skip, busbw, matmul TFLOP/s."""

from __future__ import annotations

import pytest

from gpuagent.agent.samplers.gpu_inventory import _numa_from_sysfs
from gpuagent.common.nvml import sysfs_bus_id
from gpuagent.probes import collective, gpuinfo
from gpuagent.probes.gpu_compute import matmul_tflops


@pytest.mark.parametrize("gen,width,gbps", [
    (1, 1, 0.25),                  # 2.5 GT/s x 8/10 / 8
    (2, 8, 4.0),                   # 5 GT/s x 8/10 x 8 lanes / 8
    (3, 16, 8 * 128 / 130 * 2),    # 15.75 GB/s
    (4, 16, 16 * 128 / 130 * 2),   # 31.51 GB/s
    (5, 16, 32 * 128 / 130 * 2),   # 63.02 GB/s: an H100/H200 SXM link
    (5, 8, 32 * 128 / 130),
    (6, 16, 64 * 242 / 256 * 2),   # 121 GB/s: FLIT mode, CRC + FEC deducted
])
def test_pcie_theoretical_rate_per_direction(gen, width, gbps):
    assert gpuinfo.pcie_theoretical_gbps(gen, width) == pytest.approx(gbps)


def test_pcie_theoretical_rate_unknown_link():
    assert gpuinfo.pcie_theoretical_gbps(0, 16) is None
    assert gpuinfo.pcie_theoretical_gbps(7, 16) is None
    assert gpuinfo.pcie_theoretical_gbps(5, 0) is None


@pytest.mark.parametrize("nvml_id,sysfs", [
    ("00000000:1B:00.0", "0000:1b:00.0"),        # NVML: 8 domain digits, upper case
    ("0000:1b:00.0", "0000:1b:00.0"),            # already the sysfs form
    ("00000001:C3:00.0", "0001:c3:00.0"),
    ("00010000:3A:00.0", "10000:3a:00.0"),       # a domain above 0xffff keeps its digits (Hyper-V vPCI)
    ("", ""), ("garbage", ""), ("0000:zz:00.0", ""),
])
def test_sysfs_bus_id(nvml_id, sysfs):
    assert sysfs_bus_id(nvml_id) == sysfs


def _pci_dev(root, name: str, node: str) -> None:
    d = root / "bus" / "pci" / "devices" / name
    d.mkdir(parents=True)
    (d / "numa_node").write_text(node + "\n")


def test_numa_node_of_a_gpu_from_sysfs(tmp_path):
    _pci_dev(tmp_path, "0000:1b:00.0", "1")
    _pci_dev(tmp_path, "10000:3a:00.0", "0")
    _pci_dev(tmp_path, "0000:c3:00.0", "-1")          # firmware gave no node
    assert _numa_from_sysfs("00000000:1B:00.0", str(tmp_path)) == 1
    assert _numa_from_sysfs("00010000:3A:00.0", str(tmp_path)) == 0
    assert _numa_from_sysfs("00000000:C3:00.0", str(tmp_path)) is None
    assert _numa_from_sysfs("00000000:99:00.0", str(tmp_path)) is None
    assert gpuinfo.gpu_numa_node("0000:1b:00.0", str(tmp_path)) == 1
    assert gpuinfo.gpu_numa_node("00000000:1B:00.0", str(tmp_path)) == 1
    assert gpuinfo.gpu_numa_node("0000:c3:00.0", str(tmp_path)) == -1
    assert gpuinfo.gpu_numa_node("", str(tmp_path)) == -1


def test_numa_locality_of_the_copying_cpus():
    assert gpuinfo.numa_local(0, {0}, 2) == 1
    assert gpuinfo.numa_local(1, {0}, 2) == 0
    assert gpuinfo.numa_local(1, {0, 1}, 2) == 0          # migrated across nodes during the copies
    assert gpuinfo.numa_local(-1, {0}, 1) == 1            # one node: everything is local
    assert gpuinfo.numa_local(-1, {0}, 2) is None         # GPU node unknown
    assert gpuinfo.numa_local(0, {-1}, 2) is None         # CPU unknown
    assert gpuinfo.numa_local(0, set(), 0) is None        # no NUMA information at all
    assert gpuinfo._parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


def test_collective_iteration_counts_shrink_above_64_mib():
    assert collective.iteration_counts(1 << 20, 20, 5) == (5, 20)
    assert collective.iteration_counts(64 << 20, 20, 5) == (5, 20)
    assert collective.iteration_counts(256 << 20, 20, 5) == (2, 5)
    assert collective.iteration_counts(1 << 30, 20, 5) == (2, 5)
    assert collective.iteration_counts(256 << 20, 100, 10) == (2, 25)
    assert collective.iteration_counts(1 << 30, 3, 1) == (1, 3)      # never more than asked
    # the default GPU sweep moves at most ~4x the bytes of its 64 MiB step at each larger size
    for size in collective.sizes(*collective.GPU_SIZES, 4):
        w, k = collective.iteration_counts(size, 20, 5)
        assert 5 <= k <= 20 and (size <= 64 << 20 or size * k <= 4 * 20 * (64 << 20))


def test_collective_decides_backend_and_single_gpu_skip():
    backend, n, status, why = collective.decide("auto", 0, 1, 1)
    assert (backend, n, status) == ("nccl", 1, "skipped")
    assert "only one GPU" in why and ">= 2 GPUs" in why and "backend=gloo" in why
    assert collective.decide("auto", 0, 1, 8) == ("nccl", 8, "", "")
    assert collective.decide("auto", 0, 2, 1)[:3] == ("nccl", 1, "")      # one GPU on each of two nodes
    assert collective.decide("auto", 0, 1, 0)[:3] == ("gloo", 2, "")
    assert collective.decide("nccl", 0, 1, 0)[2:] == ("skipped", "backend nccl needs CUDA, which is not available here")
    assert collective.decide("nccl", 4, 1, 2)[2] == "failed"
    assert collective.decide("gloo", 1, 1, 8)[2] == "skipped"
    assert collective.decide("mpi", 0, 1, 8)[2] == "failed"


def test_collective_bus_bandwidth_is_nccl_tests_formula():
    m = collective.bandwidth_metrics({str(1 << 20): 1e-4, str(1 << 30): 0.01}, 20e-6, 8)
    assert m[f"algbw_gbps_{1 << 30}"] == pytest.approx((1 << 30) / 0.01 / 1e9)      # 107.37 GB/s
    assert m["busbw_gbps"] == pytest.approx((1 << 30) / 0.01 / 1e9 * 2 * 7 / 8)
    assert m["algbw_gbps"] == m[f"algbw_gbps_{1 << 30}"]
    assert m[f"busbw_gbps_{1 << 20}"] == pytest.approx((1 << 20) / 1e-4 / 1e9 * 1.75)
    assert m["small_msg_latency_us"] == pytest.approx(20.0)
    two = collective.bandwidth_metrics({"1000": 1e-6}, 1e-6, 2)
    assert two["busbw_gbps"] == pytest.approx(two["algbw_gbps"])                    # n = 2: factor 1


def test_matmul_tflops_counts_two_flops_per_multiply_add():
    # 20 products of 8192^3 in 31.4 ms: 2 * 8192^3 * 20 / 0.0314 s = 700 TFLOP/s
    assert matmul_tflops(8192, 20, 31.4) == pytest.approx(2 * 8192 ** 3 * 20 / 0.0314 / 1e12)
    assert matmul_tflops(8192, 20, 31.4) == pytest.approx(700.3, rel=1e-3)


def test_link_reads_current_and_max_pcie_through_the_nvml_choke_point(monkeypatch, nvml_emulator):
    """The real pynvml over the NVML emulator (SYNTHETIC H100 node)."""
    import json

    from gpuagent.common.nvml import Nvml
    from nvml_emulator_fixture import H100_8GPU
    emu = nvml_emulator(H100_8GPU)
    nv = Nvml()
    monkeypatch.setattr(gpuinfo, "_NVML", nv)
    g = json.loads(H100_8GPU.read_text())["gpus"][3]
    got = gpuinfo.link(nv.handle(3), 3)
    assert got == {"link_gen": g["pcie_gen"], "link_width": g["pcie_width"],
                   "link_gen_max": g["pcie_gen_max"], "link_width_max": g["pcie_width_max"]}
    assert gpuinfo.link(None, 3) == {}
    emu.fail("nvmlInitWithFlags", "DRIVER_NOT_LOADED")
    monkeypatch.setattr(gpuinfo, "_NVML", Nvml())   # driver not loaded
    assert gpuinfo.link(object(), 0) == {} and "nvmlInit failed" in gpuinfo.nvml_error()
