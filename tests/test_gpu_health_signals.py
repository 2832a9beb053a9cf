"""NVML hardware-health signals of the GPU sampler (issue 23, part B) over the REAL pynvml, answered by the
NVML emulator (sim/nvmlemu). Every value is SYNTHETIC: injected with ``Emulator.inject_health`` /
``set_throttle`` / ``inject_xid`` / ``drop_field`` on tests/data/nvml_8gpu_h100_healthy.json (8x H100,
nothing wrong) or nvml_1gpu_a10_vgpu.json (a vGPU guest without NVLink or field values).
Names and labels: docs/METRICS.md "GPU sampler".
"""

from __future__ import annotations

import os

import pynvml
import pytest
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.common.nvml import Nvml
from gpuagent.sim.nvml_emulator import EmulatorError
from nvml_emulator_fixture import A10_VGPU, DATA

HEALTHY = DATA / "nvml_8gpu_h100_healthy.json"
T0 = 1_800_000_000_000_000_000
SEC = 1_000_000_000
LINKS = 18          # NVLink 4 on H100 SXM (the fixture's _sources)


def _tick(s, emu, k):
    """Tick k: the emulated clock and the tick time move 1 s together; a fresh sink (as the batcher
    drains each tick)."""
    if k:
        emu.advance(1.0)
    sink = ListSink()
    s.sample(T0 + k * SEC, sink)
    return sink


def _series(sink, metric, gpu=None):
    """{labels dict as a sorted tuple: value} of one metric (on one GPU)."""
    return {s.labels: s.value for s in sink.samples if s.metric == metric and (gpu is None or s.gpu == gpu)}


def _one(sink, metric, gpu, **labels):
    want = tuple(sorted(labels.items()))
    got = [s.value for s in sink.samples if s.metric == metric and s.gpu == gpu and s.labels == want]
    return got[-1] if got else None


@pytest.fixture
def node(nvml_emulator):
    emu = nvml_emulator(HEALTHY)
    s = GpuSampler(Nvml(), health_every=5)
    yield emu, s
    s.close()


def test_a_healthy_8_gpu_node_shows_zero_errors_and_every_nvlink_up(node):
    emu, s = node
    sink = _tick(s, emu, 0)
    for i in range(8):
        up = _series(sink, "gpu_nvlink_link_up", i)
        assert up == {(("link", str(k)),): 1.0 for k in range(LINKS)}
        errs = _series(sink, "gpu_nvlink_errors_total", i)
        assert len(errs) == LINKS * 4 and set(errs.values()) == {0.0}
        assert {lab[0][1] for lab in errs} == {"crc_flit", "crc_data", "recovery", "replay"}
        assert _one(sink, "gpu_ecc_aggregate_corrected_total", i) == 0
        assert _one(sink, "gpu_ecc_aggregate_uncorrected_total", i) == 0
        clocks = _series(sink, "gpu_clock_event_duration_seconds_total", i)
        assert {lab[0][1] for lab in clocks} == {"sw_power_cap", "sync_boost", "sw_thermal", "hw_thermal",
                                                 "hw_power_brake"} and set(clocks.values()) == {0.0}
        assert _series(sink, "gpu_retired_pages_total", i) == {}     # Hopper remaps rows instead
        assert _one(sink, "gpu_remapped_rows_pending", i) == 0
    # the row-remapping GPU's NOT_SUPPORTED retired pages are no missing metric: nothing to report
    assert [e for e in sink.events if e.kind in ("metric_unavailable", "xid")] == []
    later = _tick(s, emu, 1)                    # between the health reads (every 5th tick here)
    assert later.events == [] and _series(later, "gpu_nvlink_link_up") == {}
    assert _series(later, "gpu_clock_event_duration_seconds_total") == {}
    assert s.last[0]["clock_event_seconds"]["hw_thermal"] == 0          # the last read, kept for status


def test_each_health_field_travels_in_the_one_field_values_call_per_gpu(node):
    emu, s = node
    s.sample(T0, ListSink())
    before = emu.calls(pid=os.getpid())
    for k in range(1, 5):                       # no regular NVLink read in ticks 1-4 (health_every=5)
        _tick(s, emu, k)
    calls = emu.calls(pid=os.getpid())
    assert calls["nvmlDeviceGetFieldValues"] - before["nvmlDeviceGetFieldValues"] == 8 * 4    # one per GPU per tick
    assert calls["nvmlDeviceGetNvLinkErrorCounter"] == before["nvmlDeviceGetNvLinkErrorCounter"] == 8 * LINKS * 4
    assert calls["nvmlDeviceGetNvLinkState"] == before["nvmlDeviceGetNvLinkState"]
    sink = _tick(s, emu, 5)                     # the regular read: link state; errors unchanged (same totals)
    calls = emu.calls(pid=os.getpid())
    assert calls["nvmlDeviceGetNvLinkState"] - before["nvmlDeviceGetNvLinkState"] == 8 * (LINKS + 1)   # link 18: the end
    assert calls["nvmlDeviceGetNvLinkErrorCounter"] == 8 * LINKS * 4
    assert sum(x.metric == "gpu_nvlink_errors_total" for x in sink.samples) == 8 * LINKS * 4   # from the last read


def test_without_the_error_totals_the_per_link_errors_are_read_at_each_regular_read(node):
    emu, s = node
    emu.drop_field(38, gpu=1)               # NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL
    _tick(s, emu, 0)
    emu.inject_health(1, nvlink_errors={0: {"crc_flit": 9}})
    for k in range(1, 5):                   # nothing says the link changed until the regular read
        assert _series(_tick(s, emu, k), "gpu_nvlink_errors_total", 1) == {}
    sink = _tick(s, emu, 5)
    assert _one(sink, "gpu_nvlink_errors_total", 1, link="0", counter="crc_flit") == 9


def test_nvlink_errors_on_one_link_show_on_the_next_tick_and_a_reset_shows_lower(node):
    emu, s = node
    _tick(s, emu, 0)
    emu.inject_health(2, nvlink_errors={3: {"crc_flit": 40, "replay": 2}, 7: {"crc_data": 5, "recovery": 1}})
    sink = _tick(s, emu, 1)             # off the regular cadence: the changed error totals trigger the read
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="3", counter="crc_flit") == 40
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="3", counter="replay") == 2
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="7", counter="crc_data") == 5
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="7", counter="recovery") == 1
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="4", counter="crc_flit") == 0
    assert _series(sink, "gpu_nvlink_errors_total", 1) == {}        # GPU 1 unchanged: not re-read
    assert s.last[2]["nvlink_errors"] == {3: {"crc_flit": 40, "crc_data": 0, "replay": 2, "recovery": 0},
                                          7: {"crc_flit": 0, "crc_data": 5, "replay": 0, "recovery": 1}}
    emu.inject_health(2, nvlink_errors={3: {"crc_flit": 1}})       # driver reload: the counter starts again
    sink = _tick(s, emu, 2)
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="3", counter="crc_flit") == 1
    assert _one(sink, "gpu_nvlink_errors_total", 2, link="7", counter="crc_data") == 0
    assert [e for e in sink.events if e.kind == "metric_unavailable"] == []


def test_a_link_that_goes_down_reads_0_at_the_next_link_read(node):
    emu, s = node
    _tick(s, emu, 0)
    emu.inject_health(4, nvlink_down=[5, 11])
    for k in range(1, 5):
        assert _series(_tick(s, emu, k), "gpu_nvlink_link_up", 4) == {}
    sink = _tick(s, emu, 5)
    up = _series(sink, "gpu_nvlink_link_up", 4)
    assert [int(lab[0][1]) for lab, v in up.items() if v == 0] == [5, 11] and len(up) == LINKS
    assert _one(sink, "gpu_nvlink_active_links", 4) == LINKS - 2
    assert s.last[4]["nvlink_link_up"][5] == 0 and s.last[4]["nvlink_link_up"][0] == 1
    assert set(_series(sink, "gpu_nvlink_link_up", 3).values()) == {1.0}
    emu.inject_health(4, nvlink_down=[])
    for k in range(6, 11):
        sink = _tick(s, emu, k)
    assert set(_series(sink, "gpu_nvlink_link_up", 4).values()) == {1.0}


def test_aggregate_ecc_counts_what_earlier_driver_loads_saw_plus_the_volatile_count(node):
    emu, s = node
    emu.inject_health(6, ecc_aggregate={"corrected": 120, "uncorrected": 2})
    emu.set(6, "ecc_uncorrected", 1)                    # volatile: since this driver load
    sink = _tick(s, emu, 0)
    assert _one(sink, "gpu_ecc_aggregate_corrected_total", 6) == 120
    assert _one(sink, "gpu_ecc_aggregate_uncorrected_total", 6) == 3
    assert _one(sink, "gpu_ecc_uncorrected_total", 6) == 1
    assert _one(sink, "gpu_ecc_aggregate_uncorrected_total", 5) == 0
    emu.inject_health(6, ecc_aggregate={"corrected": 0, "uncorrected": 0})   # cleared (nvidia-smi -p)
    emu.set(6, "ecc_uncorrected", 0)
    for k in range(1, 5):                   # read every 5th tick here (health_every)
        assert _one(_tick(s, emu, k), "gpu_ecc_aggregate_corrected_total", 6) is None
    sink = _tick(s, emu, 5)
    assert _one(sink, "gpu_ecc_aggregate_corrected_total", 6) == 0
    assert _one(sink, "gpu_ecc_aggregate_uncorrected_total", 6) == 0


def test_clock_event_durations_in_seconds_per_reason_and_a_reset(node):
    emu, s = node
    _tick(s, emu, 0)
    emu.set_throttle(1, 0x40 | 0x08)        # HW thermal slowdown (and the HW slowdown bit it sets)
    emu.inject_health(3, clock_event_ns={"hw_power_brake": 7_500_000_000, "sw_power_cap": 250_000_000})
    for k in range(1, 6):
        sink = _tick(s, emu, k)             # tick 5 reads them: 5 s after the throttle began
    assert _one(sink, "gpu_clock_event_duration_seconds_total", 1, reason="hw_thermal") == pytest.approx(5.0)
    assert _one(sink, "gpu_clock_event_duration_seconds_total", 1, reason="sw_thermal") == 0
    assert _one(sink, "gpu_clock_event_duration_seconds_total", 3, reason="hw_power_brake") == 7.5
    assert _one(sink, "gpu_clock_event_duration_seconds_total", 3, reason="sw_power_cap") == 0.25
    assert s.last[3]["clock_event_seconds"]["hw_power_brake"] == 7.5
    assert _one(sink, "gpu_throttle_active", 1, reason="hw_slowdown") == 1
    emu.set_throttle(1, 0)
    emu.inject_health(1, clock_event_ns={"hw_thermal": 0})         # driver reload: counts from 0 again
    for k in range(6, 11):
        sink = _tick(s, emu, k)
    assert _one(sink, "gpu_clock_event_duration_seconds_total", 1, reason="hw_thermal") == 0
    assert _one(sink, "gpu_clock_event_duration_seconds_total", 3, reason="hw_power_brake") == 7.5


def test_retired_pages_per_cause_and_pending_on_a_gpu_that_retires_pages(node):
    emu, s = node
    emu.inject_health(0, retired_pages={"single_bit_ecc": 3, "double_bit_ecc": 1}, retired_pending=True)
    sink = _tick(s, emu, 0)
    assert _one(sink, "gpu_retired_pages_total", 0, cause="single_bit_ecc") == 3
    assert _one(sink, "gpu_retired_pages_total", 0, cause="double_bit_ecc") == 1
    assert _one(sink, "gpu_retired_pages_pending", 0) == 1
    assert _series(sink, "gpu_retired_pages_total", 1) == {}
    emu.inject_health(0, retired_pages={"single_bit_ecc": 3, "double_bit_ecc": 2}, retired_pending=False)
    for k in range(1, 6):
        sink = _tick(s, emu, k)
    assert _one(sink, "gpu_retired_pages_total", 0, cause="double_bit_ecc") == 2
    assert _one(sink, "gpu_retired_pages_pending", 0) == 0


def test_a_refused_field_is_reported_once_and_not_asked_again(node):
    emu, s = node
    emu.drop_field(270, gpu=2)              # NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN
    events = []
    for k in range(11):                     # three health reads: ticks 0, 5, 10
        sink = _tick(s, emu, k)
        events += [e for e in sink.events if e.kind == "metric_unavailable"]
        assert _one(sink, "gpu_clock_event_duration_seconds_total", 2, reason="hw_thermal") is None
        assert _one(sink, "gpu_clock_event_duration_seconds_total", 2, reason="hw_power_brake") == (0 if k % 5 == 0 else None)
    assert [(e.gpu, e.message) for e in events] == [
        (2, "GPU 2: clock-event duration hw_thermal: field value 270 not supported by this GPU or driver")]
    assert 270 in s._fields_off[2] and 270 not in s._fields_off[3]
    emu.restore_field(270, gpu=2)           # NOT_SUPPORTED is permanent while the driver is loaded
    assert _one(_tick(s, emu, 15), "gpu_clock_event_duration_seconds_total", 2, reason="hw_thermal") is None


def test_a_gpu_without_nvlink_or_field_values_has_no_nvlink_series_and_says_so_once(nvml_emulator):
    emu = nvml_emulator(A10_VGPU)
    s = GpuSampler(Nvml(), health_every=2)
    sinks = [_tick(s, emu, k) for k in range(5)]
    s.close()
    names = {x.metric for sink in sinks for x in sink.samples}
    assert not {n for n in names if n.startswith("gpu_nvlink")}
    assert "gpu_util_percent" in names and "gpu_retired_pages_total" not in names
    msgs = [e.message for sink in sinks for e in sink.events if e.kind == "metric_unavailable"]
    assert len(msgs) == len(set(msgs))                                    # each reason once
    assert "GPU 0: retired pages: nvmlDeviceGetRetiredPages not supported and no row remapping either: " \
           "no memory page retirement figures" in msgs
    assert any(m.startswith("GPU 0: nvmlDeviceGetTotalEccErrors (aggregate): ") for m in msgs)
    assert not [m for m in msgs if "clock-event duration" in m]   # the field-values call's own line covers them
    assert all(not sink.events for sink in sinks[1:])


def test_an_nvml_xid_says_its_source_and_bus_id(node):
    emu, s = node
    _tick(s, emu, 0)
    emu.inject_xid(2, 79)
    sink = _tick(s, emu, 1)
    (ev,) = [e for e in sink.events if e.kind == "xid"]
    assert (ev.gpu, ev.value) == (2, 79)
    assert ev.attrs["source"] == "nvml" and ev.attrs["pci_bus_id"] == "0000:3a:00.0"   # GPU 2: bus 3A
    assert ev.attrs["xid"] == "79" and ev.attrs["description"] == "GPU has fallen off the bus"


def test_the_controller_refuses_bad_health_input_in_one_sentence(node):
    emu, s = node
    for kw, words in (({"nvlink_errors": {3: {"crc": 1}}}, "'crc' is not one of"),
                      ({"nvlink_down": [99]}, "nvlink_down entries must be link numbers"),
                      ({"clock_event_ns": {"hw_slowdown": 1}}, "'hw_slowdown' is not one of"),
                      ({"retired_pages": {"triple_bit": 1}}, "retired_pages causes must be of"),
                      ({"nvlink_errors": {3: {"replay": -1}}}, "must be a count >= 0")):
        with pytest.raises(EmulatorError, match=words) as err:
            emu.inject_health(1, **kw)
        assert "\n" not in str(err.value)
    sink = _tick(s, emu, 0)                 # nothing of the refused input reached the node
    assert set(_series(sink, "gpu_nvlink_link_up", 1).values()) == {1.0}
    assert set(_series(sink, "gpu_nvlink_errors_total", 1).values()) == {0.0}


def test_the_emulator_answers_the_health_entry_points_as_nvml_h_documents_them(node):
    """Straight through pynvml: the field ids, nvmlDeviceGetRetiredPagesPendingStatus and the per-link
    counters agree with each other (a link's count adds to the *_TOTAL field)."""
    emu, _ = node
    h = pynvml.nvmlDeviceGetHandleByIndex(1)

    def fields(*ids):
        return {int(v.fieldId): (int(v.nvmlReturn), int(v.value.ullVal))
                for v in pynvml.nvmlDeviceGetFieldValues(h, list(ids))}

    with pytest.raises(pynvml.NVMLError_NotSupported):      # Hopper: no page retirement
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
    assert fields(29, 30, 31)[31][0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    emu.inject_health(1, retired_pages={"double_bit_ecc": 2}, retired_pending=True,
                      ecc_aggregate={"corrected": 11}, nvlink_errors={17: {"recovery": 4}},
                      clock_event_ns={"sw_thermal": 3_000_000_000})
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED
    assert len(pynvml.nvmlDeviceGetRetiredPages(h, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)) == 2
    got = fields(5, 29, 30, 31, 59, 75, 269, 270)
    assert {k: v[1] for k, v in got.items()} == {5: 11, 29: 0, 30: 2, 31: 1, 59: 4, 75: 3_000_000_000,
                                                 269: 3_000_000_000, 270: 0}
    assert pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                              pynvml.NVML_AGGREGATE_ECC) == 11
    assert pynvml.nvmlDeviceGetNvLinkErrorCounter(h, 17, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY) == 4
    assert pynvml.nvmlDeviceGetViolationStatus(h, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 3_000_000_000


def test_hw_slowdown_seconds_are_counted_from_the_sampled_mask(nvml_emulator):
    """NVML keeps no HW_SLOWDOWN duration: the sampler counts the gaps between ticks that both saw the bit set
    (capped at 10 s a gap), and nothing while it is clear."""
    from gpuagent.agent.samplers.gpu import GpuSampler
    from gpuagent.agent.samplers.sampling import ListSink
    from gpuagent.common.nvml import Nvml

    emu = nvml_emulator()
    s = GpuSampler(Nvml())
    def tick(ts_s):
        sink = ListSink()
        s.sample(int(ts_s * 1e9), sink)
        got = [r for r in sink.samples if r.metric == "gpu_clock_event_sampled_seconds_total" and r.gpu == 1]
        assert [dict(r.labels) for r in got] == [{"reason": "hw_slowdown"}]
        return got[0].value
    emu.set_throttle(1, 0)
    assert tick(1000.0) == 0.0 and tick(1001.0) == 0.0
    emu.set_throttle(1, 0x8)                       # HW_SLOWDOWN set from here on
    assert tick(1002.0) == 0.0                     # the first tick that sees it: not known to have held yet
    assert tick(1003.0) == pytest.approx(1.0)
    assert tick(1005.5) == pytest.approx(3.5)
    assert tick(1100.0) == pytest.approx(13.5)     # a 94.5 s gap after a 2.5 s one counts 10 s at most
    assert tick(1200.0) == pytest.approx(113.5)    # a steady 100 s interval counts whole
    emu.set_throttle(1, 0)
    assert tick(1201.0) == pytest.approx(113.5)
    s.close()
