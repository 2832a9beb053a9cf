"""Real NVML on a GPU machine (marked ``nvml``: needs the NVIDIA driver, not CUDA torch; skipped here):
the GPU sampler against the driver, checked against ``nvidia-smi``'s own answers (an independent
reader of the same driver). Run: ``.venv/bin/python -m pytest -m nvml -s tests/test_nvml_real.py``."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.common.nvml import Nvml
from gpuagent.agent.samplers.nodeinfo import build_node_info
from gpuagent.agent.samplers.sampling import ListSink, now_ns

pytestmark = pytest.mark.nvml


def _smi(fields: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


@pytest.fixture(scope="module")
def sampler():
    nv = Nvml()
    if not nv.available or nv.device_count == 0:
        pytest.skip(f"no usable NVML here: {nv.reason}")
    s = GpuSampler(nv)
    yield s
    s.close()


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not installed")
def test_inventory_matches_nvidia_smi(sampler):
    inv = sampler.gpu_inventory()
    smi = _smi("name,uuid,pci.bus_id,memory.total,pcie.link.gen.max,pcie.link.width.max")
    assert len(inv) == len(smi)
    for g, (name, uuid, bus, mem_mib, gen_max, width_max) in zip(inv, smi):
        assert g["name"] == name and g["uuid"] == uuid
        assert g["pci_bus_id"].lower() == bus.lower()
        assert abs(g["memory_total_bytes"] / 2**20 - float(mem_mib)) <= 1
        if gen_max.isdigit():
            assert g["pcie_gen_max"] == int(gen_max) and g["pcie_width_max"] == int(width_max)
        assert g["virtualization_mode"] in ("none", "passthrough", "vgpu", "host_vgpu", "host_vsga", "unknown")
        assert g["mig_mode"] in ("enabled", "disabled", "unsupported")


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not installed")
def test_node_info_against_the_driver(sampler):
    try:
        from gpuagent.proto import pb  # noqa: F401  (NodeInfo is a proto message)
    except Exception as exc:  # noqa: BLE001 - e.g. the image's protobuf runtime is older than the gencode
        pytest.skip(f"gpuagent.proto does not import with this Python's protobuf: {type(exc).__name__}: {exc}")
    node = build_node_info({"pool": "gpu-check"}, sampler)
    assert len(node.gpus) == sampler.nvml.device_count and node.driver_version == _smi("driver_version")[0][0]
    print("fingerprint:", node.fingerprint)


def test_sampling_ticks_against_the_driver(sampler):
    sink = ListSink()
    t0 = now_ns()
    sampler.sample(t0, sink)
    sampler.sample(now_ns(), sink)
    got = {(s.metric, s.gpu) for s in sink.samples}
    for i in range(sampler.nvml.device_count):
        for metric in ("gpu_util_percent", "gpu_memory_used_bytes", "gpu_power_watts", "gpu_temperature_celsius",
                       "gpu_sm_clock_mhz", "gpu_sm_clock_max_mhz", "gpu_throttle_reasons_bitmask",
                       "gpu_pcie_link_gen", "gpu_pcie_link_width"):
            assert (metric, i) in got, (metric, i, sampler.nvml.unavailable)
    vals = {(s.metric, s.gpu): s.value for s in sink.samples}
    for i in range(sampler.nvml.device_count):
        assert 0 <= vals[("gpu_util_percent", i)] <= 100
        assert 0 < vals[("gpu_power_watts", i)] <= vals.get(("gpu_power_limit_watts", i), 10_000) * 1.2
        assert 0 < vals[("gpu_sm_clock_mhz", i)] <= vals[("gpu_sm_clock_max_mhz", i)]
    # every unavailable reason appears once, as an event and in the list
    msgs = [e.message for e in sink.events if e.kind == "metric_unavailable"]
    assert len(msgs) == len(set(msgs))
    print("unavailable on this driver:", sampler.nvml.unavailable)
    print("processes:", sampler.processes())
