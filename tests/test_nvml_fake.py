"""GPU sampler and NVML choke point against the fake NVML backend (the one allowed fake).

Fixtures: tests/data/nvml_8gpu_h100_sxm.json (8x H100 SXM passthrough VM, GPU 3 power-capped + HW
slowdown, GPU 5 in MIG mode, XIDs 79 and 48 pending) and nvml_1gpu_a10_vgpu.json (vGPU guest where
many calls answer NotSupported).
"""

from __future__ import annotations

import logging

import pynvml
import pytest

from fake_nvml import A10_VGPU, H100_8GPU, FakeNvmlBackend
from gpuagent.agent.gpu_sampler import GpuSampler
from gpuagent.common.nvml import Nvml, decode_throttle
from gpuagent.agent.sampling import ListSink

T0 = 1_800_000_000_000_000_000
SEC = 1_000_000_000


def _tick(sampler, sink, k, backend=None):
    if backend is not None and k:
        backend.advance(1.0)
    sampler.sample(T0 + k * SEC, sink)


def _at(sink, metric, gpu, ts=None, labels=()):
    vals = [s.value for s in sink.samples
            if s.metric == metric and s.gpu == gpu and s.labels == labels and (ts is None or s.ts_ns == ts)]
    return vals[-1] if vals else None


@pytest.fixture
def h100():
    backend = FakeNvmlBackend(H100_8GPU)
    sampler = GpuSampler(Nvml(backend=backend))
    yield backend, sampler
    sampler.close()


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
    assert [g["numa_node"] for g in inv] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inv[0]["memory_total_bytes"] == 85520809984
    assert s.nvml.driver_version() == "550.54.15" and s.nvml.cuda_version() == "12.4"


def test_metrics_units_and_throttle_decoding(h100):
    b, s = h100
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
    _tick(s, sink, 1, b)
    assert len([e for e in sink.events if e.kind == "throttle_change"]) == 1
    b.set_throttle(3, 0x4)
    _tick(s, sink, 2, b)
    thr = [e for e in sink.events if e.kind == "throttle_change"]
    assert len(thr) == 2 and thr[-1].attrs["removed"] == "hw_slowdown" and thr[-1].attrs["reasons"] == "sw_power_cap"
    assert s.last[3]["gpu_power_watts"] == pytest.approx(699.0)


def test_xid_events_through_event_set_without_blocking(h100):
    b, s = h100
    sink = ListSink()
    _tick(s, sink, 0)
    xids = sorted((e.gpu, e.value) for e in sink.events if e.kind == "xid")
    assert xids == [(3, 79.0), (6, 48.0)]
    msg79 = next(e.message for e in sink.events if e.kind == "xid" and e.value == 79)
    assert msg79 == "XID 79 on GPU 3 (GPU has fallen off the bus)"
    assert b.wait_timeouts_ms and set(b.wait_timeouts_ms) == {0}
    _tick(s, sink, 1, b)
    assert len([e for e in sink.events if e.kind == "xid"]) == 2     # delivered once, not repeated
    b.inject_xid(1, 94)
    _tick(s, sink, 2, b)
    last = [e for e in sink.events if e.kind == "xid"][-1]
    assert (last.gpu, last.value, last.attrs["xid"]) == (1, 94.0, "94")


def test_nvlink_and_pcie_rates_from_counter_deltas(h100):
    b, s = h100
    sink = ListSink()
    _tick(s, sink, 0)
    assert _at(sink, "gpu_nvlink_active_links", 0) == 18
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 0) is None   # needs two ticks
    assert _at(sink, "gpu_pcie_tx_bytes_per_s", 0) is None
    _tick(s, sink, 1, b)
    assert _at(sink, "gpu_pcie_tx_bytes_per_s", 0) == pytest.approx(412000 * 1024)
    assert _at(sink, "gpu_pcie_rx_bytes_per_s", 7) == pytest.approx((1650000 + 3000 * 7) * 1024)
    assert b.pcie_throughput_calls == 0       # the blocking 20 ms call is not needed with counters
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 0) == pytest.approx(97000000 * 1024)
    assert _at(sink, "gpu_nvlink_rx_bytes_per_s", 0) == pytest.approx(96500000 * 1024)
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 5) == 0.0


def test_mig_gpu_unsupported_metric_reported_once_and_not_retried(h100):
    b, s = h100
    sink = ListSink()
    for k in range(4):
        _tick(s, sink, k, b)
    assert _at(sink, "gpu_util_percent", 5) is None
    assert _at(sink, "gpu_util_percent", 4) == 96
    unavailable = [e for e in sink.events if e.kind == "metric_unavailable"]
    assert [e.gpu for e in unavailable] == [5]
    assert "nvmlDeviceGetUtilizationRates" in unavailable[0].message
    # 8 calls on the first tick (one per GPU), then 7 per tick: GPU 5 is never asked again
    assert b.calls["nvmlDeviceGetUtilizationRates"] == 8 + 3 * 7
    assert any("GPU 5" in u for u in s.nvml.unavailable)


def test_vgpu_guest_with_missing_calls(caplog):
    b = FakeNvmlBackend(A10_VGPU)
    s = GpuSampler(Nvml(backend=b))
    sink = ListSink()
    with caplog.at_level(logging.WARNING, logger="gpuagent.nvml"):
        for k in range(5):
            _tick(s, sink, k, b)
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
    b, s = h100
    procs = {(p["pid"], p["gpu"]): p for p in s.processes()}
    assert len(procs) == 7                      # GPU 5 (MIG, idle) has none
    p = procs[(41233, 3)]
    assert p["gpu_util_percent"] == 41 and p["gpu_memory_bytes"] == 71303168000 + 3 * 1048576 * 37 - 536870912
    # no new sample since the last call (the process went idle): 0, not the stale 41
    assert {(q["pid"], q["gpu"]): q["gpu_util_percent"] for q in s.processes()}[(41233, 3)] == 0.0
    b.advance(1)
    assert {(q["pid"], q["gpu"]): q["gpu_util_percent"] for q in s.processes()}[(41233, 3)] == 41
    b.remove_process(41233)
    b.advance(1)
    assert (41233, 3) not in {(q["pid"], q["gpu"]) for q in s.processes()}


def test_no_nvml_library_runs_host_only_and_says_so_once(caplog):
    """Real pynvml on this GPU-less machine: nvmlInit fails (no libnvidia-ml)."""
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


def test_driver_not_loaded_and_exceptions_never_escape():
    nv = Nvml(backend=FakeNvmlBackend(H100_8GPU, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert not nv.available and "Driver Not Loaded" in nv.reason

    class Broken(FakeNvmlBackend):
        def nvmlDeviceGetTemperature(self, h, sensor):
            raise RuntimeError("driver exploded")

    b = Broken(H100_8GPU)
    s = GpuSampler(Nvml(backend=b))
    sink = ListSink()
    _tick(s, sink, 0)
    _tick(s, sink, 1, b)
    assert _at(sink, "gpu_temperature_celsius", 0) is None and _at(sink, "gpu_power_watts", 0) is not None
    # a transient (non-NotSupported) error is reported once per GPU but still retried
    assert len([u for u in s.nvml.unavailable if "driver exploded" in u]) == 8
    assert not s.nvml.is_unsupported("nvmlDeviceGetTemperature", 0)


def test_old_driver_without_clocks_event_reasons_falls_back_quietly():
    """A driver before R535 lacks nvmlDeviceGetCurrentClocksEventReasons (FunctionNotFound)."""

    class OldDriver(FakeNvmlBackend):
        def nvmlDeviceGetCurrentClocksEventReasons(self, h):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

        def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
            return self._g(h, "nvmlDeviceGetCurrentClocksThrottleReasons")["throttle_mask"]

    b = OldDriver(H100_8GPU)
    s = GpuSampler(Nvml(backend=b))
    sink = ListSink()
    _tick(s, sink, 0)
    _tick(s, sink, 1, b)
    assert _at(sink, "gpu_throttle_reasons_bitmask", 3) == 0x4 | 0x8
    assert not any("ClocksEventReasons" in u for u in s.nvml.unavailable)
    assert b.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 16


def test_gpu_lost_is_reported_once_and_no_longer_queried(h100):
    b, s = h100
    sink = ListSink()
    _tick(s, sink, 0)
    b.lose_gpu(2)
    b.inject_xid(2, 79)
    for k in range(1, 5):
        _tick(s, sink, k, b)
    lost = [e for e in sink.events if e.kind == "gpu_lost"]
    assert [(e.gpu) for e in lost] == [2]
    assert not [e for e in sink.events if e.kind == "metric_unavailable" and e.gpu == 2]
    assert [e.value for e in sink.events if e.kind == "xid" and e.gpu == 2] == [79.0]
    last_ts = T0 + 4 * SEC
    assert _at(sink, "gpu_power_watts", 2, ts=last_ts) is None
    assert _at(sink, "gpu_power_watts", 1, ts=last_ts) is not None   # the others carry on
    # the first failing call of tick 1 marks GPU 2 lost: no power query reaches it afterwards
    assert b.calls["nvmlDeviceGetPowerUsage"] == 8 + 4 * 7


def test_pcie_throughput_fallback_is_rate_limited():
    """Without PCIe byte counters (drivers before R550), the 20 ms-blocking nvmlDeviceGetPcieThroughput
    is used once every 10 ticks, not every tick."""
    b = FakeNvmlBackend(H100_8GPU)
    for g in b.gpus:
        g["pcie_byte_counters"] = False
    s = GpuSampler(Nvml(backend=b))
    sink = ListSink()
    for k in range(20):
        _tick(s, sink, k, b)
    assert b.pcie_throughput_calls == 2 * 8 * 2          # tx + rx, 8 GPUs, ticks 0 and 10
    tx0 = [x for x in sink.samples if x.metric == "gpu_pcie_tx_bytes_per_s" and x.gpu == 0]
    assert [x.ts_ns for x in tx0] == [T0, T0 + 10 * SEC] and tx0[0].value == 412000 * 1024
    assert _at(sink, "gpu_nvlink_tx_bytes_per_s", 0) == pytest.approx(97000000 * 1024)


def test_driver_with_zero_gpus_is_host_only():
    b = FakeNvmlBackend(H100_8GPU)
    b.gpus, b.handles = [], []
    s = GpuSampler(Nvml(backend=b))
    sink = ListSink()
    for k in range(3):
        _tick(s, sink, k)
    assert not s.nvml.available and [e.kind for e in sink.events] == ["nvml_unavailable"]
    assert "no GPUs" in sink.events[0].message and sink.samples == []
