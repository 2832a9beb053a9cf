"""The agent's GPU sampler and NVML choke point over the REAL pynvml, answered by the NVML emulator
(sim/nvmlemu; the `nvml_emulator` fixture). Every value is SYNTHETIC, from the fixtures:
tests/data/nvml_8gpu_h100_sxm.json (8x H100 SXM passthrough VM, GPU 3 power-capped + HW slowdown,
GPU 5 in MIG mode, XIDs 79 and 48 pending) and nvml_1gpu_a10_vgpu.json (vGPU guest where many calls
answer NotSupported). Call counts come from the emulator's per-process counters, so they count what
pynvml really called in the library.
"""

from __future__ import annotations

import logging
import os

import pynvml
import pytest

from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.common.nvml import Nvml, decode_throttle
from nvml_emulator_fixture import A10_VGPU, H100_8GPU, numa_sysfs

T0 = 1_800_000_000_000_000_000
SEC = 1_000_000_000


def _tick(sampler, sink, k, emu=None):
    if emu is not None and k:
        emu.advance(1.0)
    sampler.sample(T0 + k * SEC, sink)


def _at(sink, metric, gpu, ts=None, labels=()):
    vals = [s.value for s in sink.samples
            if s.metric == metric and s.gpu == gpu and s.labels == labels and (ts is None or s.ts_ns == ts)]
    return vals[-1] if vals else None


def _calls(emu, symbol):
    return emu.calls(pid=os.getpid()).get(symbol, 0)


@pytest.fixture
def h100(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    sampler = GpuSampler(Nvml())
    yield emu, sampler
    sampler.close()


def test_the_sampler_runs_on_the_real_binding(h100):
    """Proof the GPU path is pynvml over the emulator: the library counted the versioned symbols
    pynvml resolves (a Python-level fake would leave these counters at zero)."""
    emu, s = h100
    assert s.nvml.backend is pynvml
    s.sample(T0, ListSink())
    calls = emu.calls(pid=os.getpid())
    assert calls["nvmlInitWithFlags"] >= 1 and calls["nvmlDeviceGetCount_v2"] >= 1
    assert calls["nvmlDeviceGetHandleByIndex_v2"] == 8
    assert calls["nvmlDeviceGetPowerUsage"] == 8 and calls["nvmlEventSetWait_v2"] >= 1


def test_inventory_of_8_h100(h100):
    _, s = h100
    inv = s.gpu_inventory()
    assert len(inv) == 8
    assert {g["name"] for g in inv} == {"NVIDIA H100 80GB HBM3"}
    assert len({g["uuid"] for g in inv}) == 8
    assert inv[0]["pci_bus_id"] == "00000000:18:00.0" and inv[7]["pci_bus_id"] == "00000000:DB:00.0"
    assert all((g["pcie_gen_max"], g["pcie_width_max"]) == (5, 16) for g in inv)
    assert [g["mig_mode"] for g in inv] == ["disabled"] * 5 + ["enabled"] + ["disabled"] * 2
    assert {g["virtualization_mode"] for g in inv} == {"passthrough"}
    assert inv[0]["memory_total_bytes"] == 85520809984
    assert s.nvml.driver_version() == "550.54.15" and s.nvml.cuda_version() == "12.4"


def test_inventory_numa_node_from_cpu_affinity(nvml_emulator, tmp_path):
    """On x86 nvmlDeviceGetNumaNodeId is NOT_SUPPORTED, as on real drivers: the node comes from the
    GPU's CPU affinity (NVML) mapped onto the node cpulists of a SYNTHETIC sysfs tree."""
    emu = nvml_emulator(H100_8GPU)
    s = GpuSampler(Nvml(), sys_root=str(numa_sysfs(tmp_path / "sys")))
    try:
        assert [g["numa_node"] for g in s.gpu_inventory()] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert _calls(emu, "nvmlDeviceGetCpuAffinityWithinScope") == 8
        # without the node cpulists (and no PCI device numa_node) the agent says it does not know
        bare = GpuSampler(Nvml(), sys_root=str(tmp_path / "empty"))
        assert [g["numa_node"] for g in bare.gpu_inventory()] == [-1] * 8
        bare.close()
    finally:
        s.close()


def test_metrics_units_and_throttle_decoding(h100):
    emu, s = h100
    sink = ListSink()
    _tick(s, sink, 0)
    assert _at(sink, "gpu_power_watts", 3) == pytest.approx(699.0)
    assert _at(sink, "gpu_power_limit_watts", 3) == pytest.approx(700.0)
    assert _at(sink, "gpu_sm_clock_mhz", 3) == 1275 and _at(sink, "gpu_sm_clock_max_mhz", 3) == 1980
    assert _at(sink, "gpu_pcie_replay_count", 3) == 12
    assert _at(sink, "gpu_ecc_uncorrected_total", 6) == 1
    assert _at(sink, "gpu_throttle_reasons_bitmask", 3) == 0x4 | 0x8
    active3 = {dict(x.labels)["reason"] for x in sink.samples if x.metric == "gpu_throttle_active" and x.gpu == 3}
    assert active3 == {"sw_power_cap", "hw_slowdown"}
    assert decode_throttle(0x4 | 0x8 | 0x400) == ["sw_power_cap", "hw_slowdown", "bit_0x400"]
    thr = [e for e in sink.events if e.kind == "throttle_change"]
    assert [(e.gpu, e.attrs["reasons"]) for e in thr] == [(3, "hw_slowdown,sw_power_cap")]
    # unchanged next tick: no new event; then the HW slowdown clears: one event saying so
    _tick(s, sink, 1, emu)
    assert len([e for e in sink.events if e.kind == "throttle_change"]) == 1
    emu.set_throttle(3, 0x4)
    _tick(s, sink, 2, emu)
    thr = [e for e in sink.events if e.kind == "throttle_change"]
    assert len(thr) == 2 and thr[-1].attrs["removed"] == "hw_slowdown" and thr[-1].attrs["reasons"] == "sw_power_cap"
    assert s.last[3]["gpu_power_watts"] == pytest.approx(699.0)


def test_xid_events_through_event_set_without_blocking(h100, monkeypatch):
    emu, s = h100
    timeouts: list[int] = []
    real_wait = pynvml.nvmlEventSetWait

    def spy(es, timeout_ms):     # records the timeout the agent asks for, then calls the real binding
        timeouts.append(timeout_ms)
        return real_wait(es, timeout_ms)

    monkeypatch.setattr(pynvml, "nvmlEventSetWait", spy)
    sink = ListSink()
    _tick(s, sink, 0)
    xids = sorted((e.gpu, e.value) for e in sink.events if e.kind == "xid")
    assert xids == [(3, 79.0), (6, 48.0)]
    msg79 = next(e.message for e in sink.events if e.kind == "xid" and e.value == 79)
    assert msg79 == "XID 79 on GPU 3 (GPU has fallen off the bus)"
    assert timeouts and set(timeouts) == {0}
    assert _calls(emu, "nvmlEventSetWait_v2") == len(timeouts)
    _tick(s, sink, 1, emu)
    assert len([e for e in sink.events if e.kind == "xid"]) == 2     # delivered once, not repeated
    emu.inject_xid(1, 94)
    _tick(s, sink, 2, emu)
    last = [e for e in sink.events if e.kind == "xid"][-1]
    assert (last.gpu, last.value, last.attrs["xid"]) == (1, 94.0, "94")


def test_nvlink_and_pcie_rates_from_counter_deltas(h100):
    emu, s = h100
    sink = ListSink()
    _tick(s, sink, 0)
    assert _at(sink, "gpu_nvlink_active_links", 0) == 18
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 0) is None   # needs two ticks
    assert _at(sink, "gpu_pcie_tx_bytes_per_s", 0) is None
    _tick(s, sink, 1, emu)
    assert _at(sink, "gpu_pcie_tx_bytes_per_s", 0) == pytest.approx(412000 * 1024)
    assert _at(sink, "gpu_pcie_rx_bytes_per_s", 7) == pytest.approx((1650000 + 3000 * 7) * 1024)
    assert _calls(emu, "nvmlDeviceGetPcieThroughput") == 0   # the blocking 20 ms call is not needed with counters
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 0) == pytest.approx(97000000 * 1024)
    assert _at(sink, "gpu_nvlink_rx_bytes_per_s", 0) == pytest.approx(96500000 * 1024)
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 5) == 0.0


def test_mig_gpu_unsupported_metric_reported_once_and_not_retried(h100):
    emu, s = h100
    sink = ListSink()
    for k in range(4):
        _tick(s, sink, k, emu)
    assert _at(sink, "gpu_util_percent", 5) is None
    assert _at(sink, "gpu_util_percent", 4) == 96
    unavailable = [e for e in sink.events if e.kind == "metric_unavailable" and "UtilizationRates" in e.message]
    assert [e.gpu for e in unavailable] == [5]
    assert "nvmlDeviceGetUtilizationRates" in unavailable[0].message
    # 8 calls on the first tick (one per GPU), then 7 per tick: GPU 5 is never asked again
    assert _calls(emu, "nvmlDeviceGetUtilizationRates") == 8 + 3 * 7
    assert any("GPU 5" in u for u in s.nvml.unavailable)


def test_vgpu_guest_with_missing_calls(nvml_emulator, caplog):
    emu = nvml_emulator(A10_VGPU)
    s = GpuSampler(Nvml())
    sink = ListSink()
    with caplog.at_level(logging.WARNING, logger="gpuagent.nvml"):
        for k in range(5):
            _tick(s, sink, k, emu)
    inv = s.gpu_inventory()
    assert inv[0]["virtualization_mode"] == "vgpu" and inv[0]["mig_mode"] == "unsupported"
    assert inv[0]["numa_node"] == -1
    assert _at(sink, "gpu_util_percent", 0) == 23
    assert _at(sink, "gpu_nvlink_active_links", 0) is None
    assert _at(sink, "gpu_pcie_replay_count", 0) is None
    missing = {e.message.split(": ")[1] for e in sink.events if e.kind == "metric_unavailable"}
    assert {"nvmlDeviceGetNvLinkState", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetPcieThroughput",
            "nvmlDeviceGetTotalEccErrors"} <= missing
    # each reason once, in events and in the log, although 5 ticks ran
    msgs = [e.message for e in sink.events if e.kind == "metric_unavailable"]
    assert len(msgs) == len(set(msgs))
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == len(set(logged))
    assert sum("nvmlDeviceGetPcieReplayCounter" in m for m in logged) == 1
    s.close()


def test_per_process_gpu_usage(h100):
    emu, s = h100
    procs = {(p["pid"], p["gpu"]): p for p in s.processes()}
    assert len(procs) == 7                      # GPU 5 (MIG, idle) has none
    p = procs[(41233, 3)]
    assert p["gpu_util_percent"] == 41 and p["gpu_memory_bytes"] == 71303168000 + 3 * 1048576 * 37 - 536870912
    # no new sample since the last call (the process went idle): 0, not the stale 41
    assert {(q["pid"], q["gpu"]): q["gpu_util_percent"] for q in s.processes()}[(41233, 3)] == 0.0
    emu.advance(1)
    assert {(q["pid"], q["gpu"]): q["gpu_util_percent"] for q in s.processes()}[(41233, 3)] == 41
    emu.remove_process(41233)
    emu.advance(1)
    assert (41233, 3) not in {(q["pid"], q["gpu"]) for q in s.processes()}


def test_no_nvml_library_runs_host_only_and_says_so_once(caplog):
    """Real pynvml with no emulated node: nvmlInit fails (no libnvidia-ml, or the emulator pointed away:
    DRIVER_NOT_LOADED)."""
    with caplog.at_level(logging.WARNING, logger="gpuagent.nvml"):
        nv = Nvml()
        s = GpuSampler(nv)
        sink = ListSink()
        for k in range(5):
            s.sample(T0 + k * SEC, sink)
    if nv.available:
        pytest.skip("this machine has a working NVML")
    assert sink.samples == []
    ev = [e for e in sink.events]
    assert [e.kind for e in ev] == ["nvml_unavailable"]
    assert "host-only" in ev[0].message and nv.reason == ev[0].message
    assert s.gpu_inventory() == [] and s.processes() == []
    assert len([r for r in caplog.records if "NVML unavailable" in r.getMessage()]) == 1
    assert nv.unavailable == [nv.reason]


def test_driver_not_loaded_and_transient_errors_never_escape(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    rule = emu.fail("nvmlInitWithFlags", "DRIVER_NOT_LOADED")     # what pynvml's nvmlInit calls
    nv = Nvml()
    assert not nv.available and "Driver Not Loaded" in nv.reason
    emu.clear_fail(rule)
    emu.fail("nvmlDeviceGetPowerUsage", "UNKNOWN")          # every call, every GPU, until cleared
    s = GpuSampler(Nvml())
    sink = ListSink()
    _tick(s, sink, 0)
    _tick(s, sink, 1, emu)
    assert _at(sink, "gpu_power_watts", 0) is None and _at(sink, "gpu_temperature_celsius", 0) is not None
    # a transient (non-NotSupported) error is reported once per GPU but still retried
    assert len([u for u in s.nvml.unavailable if "nvmlDeviceGetPowerUsage" in u and "Unknown Error" in u]) == 8
    assert not s.nvml.is_unsupported("nvmlDeviceGetPowerUsage", 0)
    assert _calls(emu, "nvmlDeviceGetPowerUsage") == 16
    s.close()


def test_an_exception_that_is_not_an_nvml_error_never_escapes(nvml_emulator, monkeypatch):
    """Python-level on purpose: a C library under pynvml can only produce NVMLError, but the seam also
    promises that a binding bug (any other exception) stays inside Nvml.query."""
    nvml_emulator(H100_8GPU)

    def exploded(h):
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetPowerUsage", exploded)
    s = GpuSampler(Nvml())
    sink = ListSink()
    _tick(s, sink, 0)
    _tick(s, sink, 1)
    assert _at(sink, "gpu_power_watts", 0) is None and _at(sink, "gpu_temperature_celsius", 0) is not None
    assert len([u for u in s.nvml.unavailable if "driver exploded" in u]) == 8
    assert not s.nvml.is_unsupported("nvmlDeviceGetPowerUsage", 0)
    s.close()


def test_old_driver_without_clocks_event_reasons_falls_back_quietly(nvml_emulator):
    """A driver before R535 lacks nvmlDeviceGetCurrentClocksEventReasons: the emulator's "old" profile
    answers FUNCTION_NOT_FOUND for it in a process that loaded the full library."""
    emu = nvml_emulator(H100_8GPU, driver_profile="old")
    s = GpuSampler(Nvml())
    sink = ListSink()
    _tick(s, sink, 0)
    _tick(s, sink, 1, emu)
    assert _at(sink, "gpu_throttle_reasons_bitmask", 3) == 0x4 | 0x8
    assert not any("ClocksEventReasons" in u for u in s.nvml.unavailable)
    assert _calls(emu, "nvmlDeviceGetCurrentClocksThrottleReasons") == 16
    s.close()


def test_gpu_lost_is_reported_once_and_no_longer_queried(h100):
    emu, s = h100
    sink = ListSink()
    _tick(s, sink, 0)
    emu.lose_gpu(2)
    emu.inject_xid(2, 79)
    for k in range(1, 5):
        _tick(s, sink, k, emu)
    lost = [e for e in sink.events if e.kind == "gpu_lost"]
    assert [(e.gpu) for e in lost] == [2]
    assert not [e for e in sink.events if e.kind == "metric_unavailable" and e.gpu == 2]
    assert [e.value for e in sink.events if e.kind == "xid" and e.gpu == 2] == [79.0]
    last_ts = T0 + 4 * SEC
    assert _at(sink, "gpu_power_watts", 2, ts=last_ts) is None
    assert _at(sink, "gpu_power_watts", 1, ts=last_ts) is not None   # the others carry on
    # the first failing call of tick 1 marks GPU 2 lost: no power query reaches it afterwards
    assert _calls(emu, "nvmlDeviceGetPowerUsage") == 8 + 4 * 7


def test_pcie_throughput_fallback_is_rate_limited(nvml_emulator):
    """Without PCIe byte counters (fields 197/198 dropped, as on drivers before R550), the 20 ms-blocking
    nvmlDeviceGetPcieThroughput is used once every 10 ticks, not every tick."""
    emu = nvml_emulator(H100_8GPU)
    emu.drop_field(197)
    emu.drop_field(198)
    s = GpuSampler(Nvml())
    sink = ListSink()
    for k in range(20):
        _tick(s, sink, k, emu)
    assert _calls(emu, "nvmlDeviceGetPcieThroughput") == 2 * 8 * 2          # tx + rx, 8 GPUs, ticks 0 and 10
    tx0 = [x for x in sink.samples if x.metric == "gpu_pcie_tx_bytes_per_s" and x.gpu == 0]
    assert [x.ts_ns for x in tx0] == [T0, T0 + 10 * SEC] and tx0[0].value == 412000 * 1024
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 0) == pytest.approx(97000000 * 1024)
    s.close()


def test_driver_with_zero_gpus_is_host_only(nvml_emulator, monkeypatch):
    """Python-level on purpose: the emulator models nodes with at least one GPU (it refuses an empty
    fixture), so the real nvmlDeviceGetCount is wrapped to answer 0 as a driver with no devices does;
    init and shutdown still go to the emulator."""
    emu = nvml_emulator(H100_8GPU)
    real_count = pynvml.nvmlDeviceGetCount
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: real_count() * 0)
    s = GpuSampler(Nvml())
    sink = ListSink()
    for k in range(3):
        _tick(s, sink, k)
    assert not s.nvml.available and [e.kind for e in sink.events] == ["nvml_unavailable"]
    assert "no GPUs" in sink.events[0].message and sink.samples == []
    assert _calls(emu, "nvmlDeviceGetCount_v2") == 1 and _calls(emu, "nvmlShutdown") == 1
