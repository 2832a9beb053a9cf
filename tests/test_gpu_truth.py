"""The agent's NVML reads (gpuagent.common.nvml.Nvml with NO backend, i.e. the real pynvml, and
GpuSampler) over the NVML emulator (sim/nvmlemu): the gaps the emulator showed (issue #22), each with
the driver behaviour that exposed it. Every value is SYNTHETIC (tests/data/nvml_8gpu_h100_sxm.json);
call counts are the emulator's per-process counters, i.e. what pynvml really called in the library.
"""

from __future__ import annotations

import json
import os

import pynvml
import pytest

from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.common.nvml import Gpm, Nvml
from nvml_emulator_fixture import H100_8GPU

T0 = 1_800_000_000_000_000_000
SEC = 1_000_000_000
MS = 1_000_000
MIB = 1 << 20
FIXTURE = json.loads(H100_8GPU.read_text())["gpus"]
MIG_GPU = 5


def _at(sink, metric, gpu, labels=()):
    vals = [s.value for s in sink.samples if s.metric == metric and s.gpu == gpu and s.labels == labels]
    return vals[-1] if vals else None


def _ts(sink, metric, gpu, labels=()):
    return [s.ts_ns for s in sink.samples if s.metric == metric and s.gpu == gpu and s.labels == labels]


def _calls(emu, symbol):
    return emu.calls(pid=os.getpid()).get(symbol, 0)


def _ticks(emu, sampler, sink, n, *, start=0, step_s=1.0):
    for k in range(start, start + n):
        if k:
            emu.advance(step_s)
        sampler.sample(T0 + round(k * step_s * SEC), sink)


def _one_gpu_node():
    """SYNTHETIC: the H100 fixture cut to its GPU 0, so the long PCIe test ticks one GPU."""
    doc = json.loads(H100_8GPU.read_text())
    doc["gpus"] = doc["gpus"][:1]
    doc["events"] = []
    return doc


# ---------------------------------------------------------------------------------------------- 1. MIG
@pytest.fixture
def mig_node(nvml_emulator):
    """GPU 5 in MIG mode with a 1g.10gb and a 3g.40gb instance, one process in each; no privileges."""
    emu = nvml_emulator(H100_8GPU, privileged=False)
    emu.set_mig(MIG_GPU, True, ["1g.10gb", "3g.40gb"])
    emu.add_process(MIG_GPU, 50001, 3 << 30, gpu_instance=1)
    emu.add_process(MIG_GPU, 50002, 5 << 30, gpu_instance=2)
    return emu


def test_mig_unprivileged_processes_gpm_and_profiles_come_from_the_instance_handles(mig_node):
    emu = mig_node
    s = GpuSampler(Nvml())
    sink = ListSink()
    _ticks(emu, s, sink, 3)
    got = {(p["pid"], p["gpu_instance_id"], p["gpu_memory_bytes"]) for p in s.processes() if p["gpu"] == MIG_GPU}
    assert got == {(50001, 1, float(3 << 30)), (50002, 2, float(5 << 30))}
    assert s.gpu_instances(MIG_GPU) == [{"gpu_instance_id": 1, "profile": "1g.10gb"},
                                        {"gpu_instance_id": 2, "profile": "3g.40gb"}]
    mig = FIXTURE[MIG_GPU]["gpm_mig"]
    for gi in ("1", "2"):
        v = _at(sink, "gpu_sm_active_percent", MIG_GPU, (("gpu_instance", gi),))
        assert v == pytest.approx(mig[gi]["sm_active"])
    assert s.last[MIG_GPU]["activity_source"] == "gpm per GPU instance"
    # the status/exporter rows come from the same listing: framebuffer by nvmlMemory_v2 on each MIG device
    parent = pynvml.nvmlDeviceGetHandleByIndex(MIG_GPU)
    want = {}
    for idx in range(2):
        mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, idx)
        want[pynvml.nvmlDeviceGetGpuInstanceId(mh)] = pynvml.nvmlDeviceGetMemoryInfo(mh, version=pynvml.nvmlMemory_v2)
    rows = {r["gpu_instance_id"]: r for r in s.last[MIG_GPU]["mig_instances"]}
    assert [(gi, r["profile"]) for gi, r in sorted(rows.items())] == [(1, "1g.10gb"), (2, "3g.40gb")]
    for gi, v2 in want.items():
        assert (rows[gi]["memory_used_bytes"], rows[gi]["memory_free_bytes"], rows[gi]["memory_total_bytes"],
                rows[gi]["memory_reserved_bytes"]) == (v2.used, v2.free, v2.total, v2.reserved)
        assert rows[gi]["sm_active_percent"] == pytest.approx(mig[str(gi)]["sm_active"])
    # nothing of it needed the parent handle, which refuses an unprivileged process under MIG
    assert _calls(emu, "nvmlGpmMigSampleGet") == 0
    assert _calls(emu, "nvmlDeviceGetGpuInstanceById") == 0 and _calls(emu, "nvmlGpuInstanceGetInfo") == 0
    assert _calls(emu, "nvmlGpmSampleGet") > 0
    s.close()


def test_mig_parent_no_permission_is_not_permanent(mig_node):
    """Without MIG device handles the parent handle is the only way; its NO_PERMISSION passes once the
    agent has privileges (here: the node's setting changes under the running sampler)."""
    emu = mig_node
    emu.fail("nvmlDeviceGetMigDeviceHandleByIndex", "UNKNOWN")
    s = GpuSampler(Nvml())
    assert [p for p in s.processes() if p["gpu"] == MIG_GPU] == []
    emu.set_privileged(True)
    got = {(p["pid"], p["gpu_instance_id"]) for p in s.processes() if p["gpu"] == MIG_GPU}
    assert got == {(50001, 1), (50002, 2)}
    s.close()


def test_status_does_not_claim_gpm_per_instance_when_no_instance_read_works(mig_node):
    emu = mig_node
    emu.fail("nvmlGpmSampleGet", "UNKNOWN", gpu=MIG_GPU)
    emu.fail("nvmlGpmMigSampleGet", "UNKNOWN", gpu=MIG_GPU)
    s = GpuSampler(Nvml())
    sink = ListSink()
    _ticks(emu, s, sink, 3)
    assert s.last[MIG_GPU]["activity_source"] == "utilization counter"
    assert _at(sink, "gpu_sm_active_percent", MIG_GPU, (("gpu_instance", "1"),)) is None
    s.close()


# ---------------------------------------------------------------------------------------------- 2. GPM
def test_gpm_samples_are_100_ms_apart_whatever_the_interval(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    s = GpuSampler(Nvml())
    sink = ListSink()
    _ticks(emu, s, sink, 10, step_s=0.05)       # 50 ms ticks: NVML answers NOT_READY for samples <= 100 ms apart
    assert _ts(sink, "gpu_sm_active_percent", 0) == [T0 + 150 * MS, T0 + 300 * MS, T0 + 450 * MS]
    assert _at(sink, "gpu_sm_active_percent", 0) == pytest.approx(FIXTURE[0]["gpm"]["sm_active"])
    assert s.last[0]["activity_source"] == "gpm"
    s.close()


def test_gpm_not_ready_is_no_value_and_keeps_the_older_sample(nvml_emulator):
    """The agent's clock says 200 ms passed, NVML's only 50 ms: every metric answers NOT_READY. That is
    no value (not 0), and the kept sample stays, so the next read spans the whole interval."""
    emu = nvml_emulator(H100_8GPU)
    nv = Nvml()
    reader = Gpm(nv)
    assert reader.supported(0) and reader.read(0, now_s=10.0) is None
    emu.advance(0.05)
    assert reader.read(0, now_s=10.2) is None
    emu.advance(0.1)
    vals = reader.read(0, now_s=10.4)
    assert vals["gpu_sm_active_percent"] == pytest.approx(FIXTURE[0]["gpm"]["sm_active"])
    reader.close()
    nv.shutdown()


# ---------------------------------------------------------------------------------------------- 3. memory
def test_memory_used_excludes_the_reservation_through_the_v2_symbol(nvml_emulator):
    emu = nvml_emulator(H100_8GPU)
    emu.set_mig(MIG_GPU, False)             # only the device-level memory read in the tick
    s = GpuSampler(Nvml())
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert v2.reserved > 0 and v1.used == v2.used + v2.reserved      # the fixture's reservation
    emu.reset_calls()
    sink = ListSink()
    _ticks(emu, s, sink, 1)
    assert _at(sink, "gpu_memory_used_bytes", 0) == v2.used
    assert _at(sink, "gpu_memory_reserved_bytes", 0) == v2.reserved
    assert _at(sink, "gpu_memory_total_bytes", 0) == v2.total
    # the real binding: the versioned symbol is what pynvml called, never the v1 one; and once per GPU
    # per tick (used, free and reserved all come from that one read)
    assert _calls(emu, "nvmlDeviceGetMemoryInfo_v2") == 8
    assert _calls(emu, "nvmlDeviceGetMemoryInfo") == 0
    s.close()


def test_memory_falls_back_to_v1_on_a_driver_without_v2(nvml_emulator):
    emu = nvml_emulator(H100_8GPU, driver_profile="old")
    s = GpuSampler(Nvml())
    sink = ListSink()
    _ticks(emu, s, sink, 2)
    assert _at(sink, "gpu_memory_used_bytes", 0) == FIXTURE[0]["memory_used_bytes"]
    assert s.gpu_inventory()[0]["memory_total_bytes"] == FIXTURE[0]["memory_total_bytes"]
    assert _calls(emu, "nvmlDeviceGetMemoryInfo") > 0
    s.close()


# ---------------------------------------------------------------------------------------------- 4. temperature
@pytest.mark.parametrize("profile", ["cuda14", "old", "r550"])
def test_temperature_and_clock_event_reasons_on_every_driver_profile(nvml_emulator, profile):
    emu = nvml_emulator(H100_8GPU, driver_profile=profile)
    s = GpuSampler(Nvml())
    sink = ListSink()
    _ticks(emu, s, sink, 2)
    assert _at(sink, "gpu_temperature_celsius", 0) == FIXTURE[0]["temperature_c"]
    assert _at(sink, "gpu_throttle_reasons_bitmask", 3) == FIXTURE[3]["throttle_mask"]
    new = {"cuda14": "nvmlDeviceGetTemperatureV", "r550": "nvmlDeviceGetTemperatureV",
           "old": "nvmlDeviceGetTemperature"}[profile]
    assert _calls(emu, new) > 0
    assert not [u for u in s.nvml.unavailable if "Temperature" in u or "Clocks" in u and profile != "old"]
    s.close()


# ---------------------------------------------------------------------------------------------- 5. processes
@pytest.mark.parametrize("profile", ["old", "r550"])
def test_processes_on_old_drivers_and_memory_not_available_is_unknown(nvml_emulator, profile):
    emu = nvml_emulator(H100_8GPU, driver_profile=profile)
    emu.add_process(0, 4242, 1 << 30)
    emu.add_process(1, 4343, None)                     # NVML_VALUE_NOT_AVAILABLE
    s = GpuSampler(Nvml())
    got = {p["pid"]: p["gpu_memory_bytes"] for p in s.processes()}
    assert got[4242] == float(1 << 30)
    assert got[4343] == -1.0                           # unknown: neither 2^64-1 bytes nor a silent 0
    versioned = "nvmlDeviceGetComputeRunningProcesses_v2" if profile == "old" else \
        "nvmlDeviceGetComputeRunningProcesses_v3"
    assert _calls(emu, versioned) > 0
    s.close()


# ---------------------------------------------------------------------------------------------- 6. NUMA
def test_numa_node_is_the_cpu_side_and_the_gpu_memory_node_is_apart(nvml_emulator, tmp_path):
    emu = nvml_emulator(H100_8GPU)
    for node, cpus in ((0, "0-55,112-167"), (1, "56-111,168-223")):   # SYNTHETIC sysfs: DGX H100's sockets
        d = tmp_path / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    s = GpuSampler(Nvml(), sys_root=str(tmp_path))
    assert [g["numa_node"] for g in s.gpu_inventory()] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert s.memory_numa_node == {}                    # x86: nvmlDeviceGetNumaNodeId is NOT_SUPPORTED
    assert _calls(emu, "nvmlDeviceGetCpuAffinityWithinScope") == 8
    s.close()
    emu.set(2, "memory_numa_node", 7)                  # GH200 class: the GPU's own memory is NUMA node 7
    s = GpuSampler(Nvml(), sys_root=str(tmp_path))
    inv = s.gpu_inventory()
    assert inv[2]["numa_node"] == 0 and s.memory_numa_node == {2: 7}
    s.close()


def test_numa_node_falls_back_to_the_pci_device_in_sysfs(nvml_emulator, tmp_path):
    nvml_emulator(H100_8GPU)
    d = tmp_path / "bus/pci/devices/0000:18:00.0"       # GPU 0's bus id; no node cpulists in this tree
    d.mkdir(parents=True)
    (d / "numa_node").write_text("1\n")
    s = GpuSampler(Nvml(), sys_root=str(tmp_path))
    assert s.gpu_inventory()[0]["numa_node"] == 1
    s.close()


# ---------------------------------------------------------------------------------------------- 7. PCIe
def test_pcie_counters_come_back_after_dropping_out(nvml_emulator):
    emu = nvml_emulator(_one_gpu_node())
    s = GpuSampler(Nvml(), pcie_retry_s=20.0)
    sink = ListSink()
    _ticks(emu, s, sink, 3)
    assert _ts(sink, "gpu_pcie_tx_bytes_per_s", 0) == [T0 + SEC, T0 + 2 * SEC]     # counter deltas
    emu.drop_field(197)
    emu.drop_field(198)
    _ticks(emu, s, sink, 20, start=3)                  # ticks 3..22: the snapshot, every 10th tick only
    snap = _calls(emu, "nvmlDeviceGetPcieThroughput")
    assert snap == 2 * 2                               # tx + rx at ticks 3 and 13
    emu.restore_field(197)
    emu.restore_field(198)
    _ticks(emu, s, sink, 20, start=23)                 # retried at tick 23 (20 s after the drop): back
    assert _calls(emu, "nvmlDeviceGetPcieThroughput") == snap
    every = _ts(sink, "gpu_pcie_tx_bytes_per_s", 0)
    assert every[-19:] == [T0 + k * SEC for k in range(24, 43)]
    assert _at(sink, "gpu_pcie_tx_bytes_per_s", 0) == pytest.approx(FIXTURE[0]["pcie_tx_kb_per_s"] * 1024)
    s.close()


# ---------------------------------------------------------------------------------------------- 8. transient
def test_transient_errors_are_retried_not_taken_as_unsupported(nvml_emulator):
    emu = nvml_emulator(_one_gpu_node())
    for call in ("nvmlGpmQueryDeviceSupport", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetFieldValues",
                 "nvmlDeviceGetMemoryInfo_v2"):
        emu.fail(call, "UNKNOWN", times=2)
    s = GpuSampler(Nvml())
    sink = ListSink()
    _ticks(emu, s, sink, 5)
    # each read is back once its two failures are used up (a call may be made more than once a tick)
    assert _at(sink, "gpu_sm_active_percent", 0) == pytest.approx(FIXTURE[0]["gpm"]["sm_active"])
    assert _calls(emu, "nvmlDeviceGetPcieThroughput") == 0                             # no snapshot mode
    assert _ts(sink, "gpu_pcie_tx_bytes_per_s", 0)[-2:] == [T0 + 3 * SEC, T0 + 4 * SEC]   # counters
    assert _ts(sink, "gpu_temperature_celsius", 0) == [T0 + 2 * SEC, T0 + 3 * SEC, T0 + 4 * SEC]
    assert _ts(sink, "gpu_memory_used_bytes", 0)[-3:] == [T0 + 2 * SEC, T0 + 3 * SEC, T0 + 4 * SEC]
    n = s.nvml
    for fn in ("nvmlGpmQueryDeviceSupport", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetFieldValues",
               "nvmlDeviceGetMemoryInfo_v2"):
        assert not n.is_unsupported(fn, 0), fn
    assert any("UNKNOWN" in u.upper() or "error 999" in u for u in n.unavailable)   # said once, not silent
    s.close()
