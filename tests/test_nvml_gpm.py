"""GPM sampling (issue 15) through the NVML seam, against the fake NVML backend (the one allowed fake).

The fake's GPM values are SYNTHETIC (tests/data/nvml_8gpu_h100_sxm.json, "gpm" keys, derived from the
metric definitions in nvml.h, not recorded on a GPU). The seam builds pynvml's real
c_nvmlGpmMetricsGet_t structure, so the ctypes layout the agent fills is the one real NVML reads.
"""

from __future__ import annotations

import json

import pytest

from fake_nvml import A10_VGPU, H100_8GPU, FakeNvmlBackend
from gpuagent.agent.gpu_sampler import GpuSampler
from gpuagent.agent.sampling import ListSink
from gpuagent.common.nvml import GPM_METRICS, Nvml

T0 = 1_800_000_000_000_000_000
SEC = 1_000_000_000
GPM_NAMES = {name for name, _, _ in GPM_METRICS}
FIXTURE = json.loads(H100_8GPU.read_text())["gpus"]


def _ticks(backend, sampler, n):
    sinks = []
    for k in range(n):
        if k:
            backend.advance(1.0)
        sink = ListSink()
        sampler.sample(T0 + k * SEC, sink)
        sinks.append(sink)
    return sinks


def _vals(sink, gpu, labels=()):
    return {s.metric: s.value for s in sink.samples if s.gpu == gpu and s.labels == labels}


def test_gpm_values_and_units_on_hopper():
    backend = FakeNvmlBackend(H100_8GPU)
    sampler = GpuSampler(Nvml(backend=backend))
    first, second, third = _ticks(backend, sampler, 3)
    assert not GPM_NAMES & {s.metric for s in first.samples}, "GPM needs two samples: nothing on the first tick"
    for sink in (second, third):
        for g in FIXTURE:
            if g["index"] == 5:
                continue            # MIG: see test_mig_gpm_is_per_gpu_instance
            v = _vals(sink, g["index"])
            gpm = g["gpm"]
            assert v["gpu_sm_active_percent"] == gpm["sm_active"]
            assert v["gpu_sm_occupancy_percent"] == gpm["sm_occupancy"]
            assert v["gpu_tensor_active_percent"] == gpm["tensor_active"]
            assert v["gpu_dram_active_percent"] == gpm["dram_active"]
            # MiB/s from GPM -> bytes/s; equal to the rate from the cumulative counters over the same tick
            assert v["gpu_gpm_pcie_tx_bytes_per_s"] == pytest.approx(g["pcie_tx_kb_per_s"] * 1024.0)
            assert v["gpu_gpm_pcie_tx_bytes_per_s"] == pytest.approx(v["gpu_pcie_tx_bytes_per_s"], rel=1e-6)
            assert v["gpu_gpm_pcie_rx_bytes_per_s"] == pytest.approx(v["gpu_pcie_rx_bytes_per_s"], rel=1e-6)
            assert v["gpu_gpm_nvlink_tx_bytes_per_s"] == pytest.approx(v["gpu_nvlink_tx_bytes_per_s"], rel=1e-6)
            assert v["gpu_gpm_nvlink_rx_bytes_per_s"] == pytest.approx(v["gpu_nvlink_rx_bytes_per_s"], rel=1e-6)
            assert 0.0 <= v["gpu_sm_active_percent"] <= 100.0
            assert sampler.last[g["index"]]["activity_source"] == "gpm"
    # GPU 7 is "busy but idle inside": the utilization counter says 97 %, GPM says 4 % of SMs were busy
    v7 = _vals(third, 7)
    assert v7["gpu_util_percent"] == 97 and v7["gpu_sm_active_percent"] == pytest.approx(4.2)
    assert backend.calls["nvmlGpmMetricsGet"] == 2 * 7       # one call per GPU per tick after the first
    sampler.close()
    assert not backend._gpm_samples, "every GPM sample allocated is freed on close"


def test_unsupported_gpu_falls_back_to_utilization_and_says_so():
    backend = FakeNvmlBackend(A10_VGPU)
    nvml = Nvml(backend=backend)
    sampler = GpuSampler(nvml)
    sinks = _ticks(backend, sampler, 3)
    metrics = {s.metric for sink in sinks for s in sink.samples}
    assert not GPM_NAMES & metrics
    assert "gpu_util_percent" in metrics
    assert sampler.last[0]["activity_source"] == "utilization counter"
    gpm_lines = [u for u in nvml.unavailable if "GPM" in u]
    assert len(gpm_lines) == 1 and gpm_lines[0].startswith("GPU 0: nvmlGpmSampleGet: GPM is not supported")
    assert "nvmlGpmSampleGet" not in backend.calls and "nvmlGpmMetricsGet" not in backend.calls
    # reported once, as a metric_unavailable event
    events = [e for sink in sinks for e in sink.events if "GPM" in e.message]
    assert len(events) == 1 and events[0].kind == "metric_unavailable"


def test_binding_without_gpm_falls_back():
    backend = FakeNvmlBackend(H100_8GPU)
    backend.nvmlGpmQueryDeviceSupport = None      # an nvidia-ml-py older than GPM: the name is missing
    nvml = Nvml(backend=backend)
    sampler = GpuSampler(nvml)
    sinks = _ticks(backend, sampler, 2)
    assert not GPM_NAMES & {s.metric for sink in sinks for s in sink.samples}
    assert sampler.last[0]["activity_source"] == "utilization counter"
    assert any(u.startswith("GPU 0: nvmlGpmSampleGet: GPM is not supported") for u in nvml.unavailable)


def test_gpm_off_by_switch_costs_no_calls():
    backend = FakeNvmlBackend(H100_8GPU)
    sampler = GpuSampler(Nvml(backend=backend), gpm=False)
    _ticks(backend, sampler, 3)
    assert not any(fn.startswith("nvmlGpm") for fn in backend.calls)


def test_mig_gpm_is_per_gpu_instance():
    backend = FakeNvmlBackend(H100_8GPU)
    sampler = GpuSampler(Nvml(backend=backend))
    idle = _ticks(backend, sampler, 2)
    assert not GPM_NAMES & set(_vals(idle[-1], 5)), "no instance runs processes: nothing to sample"
    backend.add_process(5, 50001, 10 << 30, 0, gpu_instance_id=1)
    backend.add_process(5, 50002, 5 << 30, 0, gpu_instance_id=2)
    sinks = _ticks(backend, sampler, 2)
    mig = FIXTURE[5]["gpm_mig"]
    for gi in ("1", "2"):
        v = _vals(sinks[-1], 5, (("gpu_instance", gi),))
        assert v["gpu_sm_active_percent"] == mig[gi]["sm_active"]
        assert v["gpu_tensor_active_percent"] == mig[gi]["tensor_active"]
        assert v["gpu_dram_active_percent"] == mig[gi]["dram_active"]
        assert "gpu_gpm_pcie_tx_bytes_per_s" not in v     # no per-instance PCIe figure
    assert not GPM_NAMES & set(_vals(sinks[-1], 5)), "no device-level GPM series on a MIG GPU"
    assert sampler.last[5]["activity_source"] == "gpm per GPU instance"
    # the device-level sample call is never made on the MIG GPU
    assert backend.calls.get("nvmlGpmMigSampleGet", 0) == 4
    sampler.close()


def test_lost_gpu_stops_gpm_without_raising():
    backend = FakeNvmlBackend(H100_8GPU)
    sampler = GpuSampler(Nvml(backend=backend))
    _ticks(backend, sampler, 2)
    backend.lose_gpu(2)
    sink = ListSink()
    backend.advance(1.0)
    sampler.sample(T0 + 5 * SEC, sink)
    assert not GPM_NAMES & set(_vals(sink, 2))
    assert _vals(sink, 0)["gpu_sm_active_percent"] == FIXTURE[0]["gpm"]["sm_active"]
