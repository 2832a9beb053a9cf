"""GPM sampling (issue 15) through the NVML seam, on the real pynvml over the NVML emulator.

The GPM values are SYNTHETIC (tests/data/nvml_8gpu_h100_sxm.json, "gpm" keys, derived from the metric
definitions in nvml.h, not recorded on a GPU). The seam builds pynvml's real c_nvmlGpmMetricsGet_t
structure and the emulator (a C library) reads it, so the ctypes layout the agent fills is checked by
a reader of nvml.h's layout, not by Python. The emulator's GPM model is its own (not derived from the
PCIe/NVLink counters), so the two paths agree only where the fixture states the same traffic.
"""

from __future__ import annotations

import json
import os

import pynvml
import pytest

from nvml_emulator_fixture import A10_VGPU, H100_8GPU
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.common.nvml import GPM_METRICS, Nvml

T0 = 1_800_000_000_000_000_000
SEC = 1_000_000_000
GPM_NAMES = {name for name, _, _ in GPM_METRICS}
FIXTURE = json.loads(H100_8GPU.read_text())["gpus"]
MIB = 1024.0 * 1024.0


def _calls(emu):
    return emu.calls(pid=os.getpid())


def _ticks(emu, sampler, n):
    sinks = []
    for k in range(n):
        if k:
            emu.advance(1.0)
        sink = ListSink()
        sampler.sample(T0 + k * SEC, sink)
        sinks.append(sink)
    return sinks


def _vals(sink, gpu, labels=()):
    return {s.metric: s.value for s in sink.samples if s.gpu == gpu and s.labels == labels}


def test_gpm_values_and_units_on_hopper(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    sampler = GpuSampler(Nvml())
    first, second, third = _ticks(emu, sampler, 3)
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
            # MiB/s from the emulator's GPM model -> bytes/s
            assert v["gpu_gpm_pcie_tx_bytes_per_s"] == pytest.approx(gpm["pcie_tx_mib_per_s"] * MIB)
            assert v["gpu_gpm_nvlink_rx_bytes_per_s"] == pytest.approx(gpm["nvlink_rx_mib_per_s"] * MIB)
            # the counter path, from its own model (fields 197/198 at pcie_*_kb_per_s x 1024)
            assert v["gpu_pcie_tx_bytes_per_s"] == pytest.approx(g["pcie_tx_kb_per_s"] * 1024.0)
            # the two models agree because the fixture states the same traffic in both
            assert v["gpu_gpm_pcie_tx_bytes_per_s"] == pytest.approx(v["gpu_pcie_tx_bytes_per_s"], rel=1e-6)
            assert v["gpu_gpm_pcie_rx_bytes_per_s"] == pytest.approx(v["gpu_pcie_rx_bytes_per_s"], rel=1e-6)
            assert v["gpu_gpm_nvlink_tx_bytes_per_s"] == pytest.approx(v["gpu_nvlink_tx_bytes_per_s"], rel=1e-6)
            assert v["gpu_gpm_nvlink_rx_bytes_per_s"] == pytest.approx(v["gpu_nvlink_rx_bytes_per_s"], rel=1e-6)
            assert 0.0 <= v["gpu_sm_active_percent"] <= 100.0
            assert sampler.last[g["index"]]["activity_source"] == "gpm"
    # GPU 7 is "busy but idle inside": the utilization counter says 97 %, GPM says 4 % of SMs were busy
    v7 = _vals(third, 7)
    assert v7["gpu_util_percent"] == 97 and v7["gpu_sm_active_percent"] == pytest.approx(4.2)
    assert _calls(emu)["nvmlGpmMetricsGet"] == 2 * 7       # one call per GPU per tick after the first
    sampler.close()
    calls = _calls(emu)
    assert calls["nvmlGpmSampleAlloc"] == calls["nvmlGpmSampleFree"] > 0, "every GPM sample allocated is freed"


def test_gpm_and_counter_paths_are_separate_models(nvml_emulator):
    """The emulator's GPM figures are not computed from the counters: change one and only its series moves."""
    emu = nvml_emulator(H100_8GPU)
    emu.set(0, "gpm.pcie_tx_mib_per_s", 100.0)
    sampler = GpuSampler(Nvml())
    v = _vals(_ticks(emu, sampler, 2)[-1], 0)
    assert v["gpu_gpm_pcie_tx_bytes_per_s"] == pytest.approx(100.0 * MIB)
    assert v["gpu_pcie_tx_bytes_per_s"] == pytest.approx(FIXTURE[0]["pcie_tx_kb_per_s"] * 1024.0)
    sampler.close()


def test_unsupported_gpu_falls_back_to_utilization_and_says_so(nvml_emulator):
    emu = nvml_emulator(A10_VGPU)
    nvml = Nvml()
    sampler = GpuSampler(nvml)
    sinks = _ticks(emu, sampler, 3)
    metrics = {s.metric for sink in sinks for s in sink.samples}
    assert not GPM_NAMES & metrics
    assert "gpu_util_percent" in metrics
    assert sampler.last[0]["activity_source"] == "utilization counter"
    gpm_lines = [u for u in nvml.unavailable if "GPM" in u]
    assert len(gpm_lines) == 1 and gpm_lines[0].startswith("GPU 0: nvmlGpmSampleGet: GPM is not supported")
    assert _calls(emu)["nvmlGpmSampleGet"] == 0 and _calls(emu)["nvmlGpmMetricsGet"] == 0
    # reported once, as a metric_unavailable event
    events = [e for sink in sinks for e in sink.events if "GPM" in e.message]
    assert len(events) == 1 and events[0].kind == "metric_unavailable"


def test_binding_without_gpm_falls_back(nvml_emulator, monkeypatch):
    """Python-level on purpose: an nvidia-ml-py older than GPM lacks the name in the binding itself (the
    driver may well have it), which only a change to the pynvml module can show."""
    emu = nvml_emulator(H100_8GPU)
    monkeypatch.delattr(pynvml, "nvmlGpmQueryDeviceSupport")
    nvml = Nvml()
    sampler = GpuSampler(nvml)
    sinks = _ticks(emu, sampler, 2)
    assert not GPM_NAMES & {s.metric for sink in sinks for s in sink.samples}
    assert sampler.last[0]["activity_source"] == "utilization counter"
    assert any(u.startswith("GPU 0: nvmlGpmSampleGet: GPM is not supported") for u in nvml.unavailable)


def test_gpm_off_by_switch_costs_no_calls(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    sampler = GpuSampler(Nvml(), gpm=False)
    _ticks(emu, sampler, 3)
    called = emu.called(pid=os.getpid())
    assert called.get("nvmlDeviceGetPowerUsage") == 3 * 8            # the sampler did run
    assert not any(fn.startswith("nvmlGpm") for fn in called)


@pytest.mark.parametrize("privileged", [True, False])
def test_mig_gpm_is_per_gpu_instance(nvml_emulator, privileged):
    """Privileged or not: unprivileged, the parent-handle calls under MIG answer NO_PERMISSION (nvml.h),
    so the instances must be sampled through their MIG device handles."""
    emu = nvml_emulator(H100_8GPU, privileged=privileged)
    sampler = GpuSampler(Nvml())
    idle = _ticks(emu, sampler, 2)
    assert not GPM_NAMES & set(_vals(idle[-1], 5)), "no instance runs processes: nothing to sample"
    emu.add_process(5, 50001, 10 << 30, gpu_instance=1)       # SYNTHETIC pids
    emu.add_process(5, 50002, 5 << 30, gpu_instance=2)
    emu.advance(1.0)
    emu.reset_calls()
    sinks = _ticks(emu, sampler, 2)
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
    # 2 ticks x (7 device-level samples + one per GPU instance, through the MIG device handle or
    # nvmlGpmMigSampleGet on the parent): a device-level sample of GPU 5 would make it 20
    calls = _calls(emu)
    assert calls["nvmlGpmSampleGet"] + calls["nvmlGpmMigSampleGet"] == 2 * (7 + 2)
    sampler.close()


def test_lost_gpu_stops_gpm_without_raising(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    sampler = GpuSampler(Nvml())
    _ticks(emu, sampler, 2)
    emu.lose_gpu(2)
    sink = ListSink()
    emu.advance(1.0)
    sampler.sample(T0 + 5 * SEC, sink)
    assert not GPM_NAMES & set(_vals(sink, 2))
    assert _vals(sink, 0)["gpu_sm_active_percent"] == FIXTURE[0]["gpm"]["sm_active"]
