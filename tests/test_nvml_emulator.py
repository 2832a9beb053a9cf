"""The NVML emulator (sim/nvmlemu, gpuagent.sim.nvml_emulator) through the REAL, unmodified pynvml.

Every test loads the emulator as libnvidia-ml.so.1 and talks to it only through pynvml (or through
gpuagent.common.nvml.Nvml() without a backend, which imports pynvml), so pynvml's ctypes structures,
versioned entry points and NVMLError classes run. The node is SYNTHETIC (tests/data fixtures); the call
counters prove which symbol pynvml used.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pynvml
import pytest

import nvml_emulator_fixture
from conftest import wait_for
from gpuagent.common.nvml import Gpm, Nvml
from gpuagent.sim import nvml_emulator as ne
from gpuagent.sim.nvml_emulator import Emulator, EmulatorError
from nvml_emulator_fixture import A10_VGPU, H100_8GPU, built_or_skip

nvml_emulator = nvml_emulator_fixture.nvml_emulator      # the fixture, for this module
REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
UINT_MAX = 0xFFFFFFFF
MIG_GPU = 5   # MIG on in the H100 fixture: GPU instances 1 and 2 (3g.40gb each)


@pytest.fixture
def node(nvml_emulator):
    """The H100 x8 fixture on a frozen clock, with this process's pynvml initialised on it."""
    emu = nvml_emulator()
    pynvml.nvmlInit()
    yield emu
    pynvml.nvmlShutdown()


def fixture_gpu(i: int, path: Path = H100_8GPU) -> dict:
    return json.loads(path.read_text())["gpus"][i]


def handle(i: int):
    return pynvml.nvmlDeviceGetHandleByIndex(i)


def field(h, fid: int, scope: int = 0):
    (v,) = pynvml.nvmlDeviceGetFieldValues(h, [(fid, scope)])
    return v


def txt(v) -> str:
    """pynvml gives char arrays back as str or bytes depending on the structure."""
    return v.decode() if isinstance(v, bytes) else str(v)


def loaded_library() -> str:
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if line.rstrip().endswith("libnvidia-ml.so.1")}
    assert len(paths) == 1, paths
    return paths.pop()


# ---------------------------------------------------------------------------------------------- the binding
def test_the_real_pynvml_loads_the_emulator_and_the_counts_show_the_versioned_symbols(node):
    assert loaded_library() == str(ne.library_path("r550").resolve())
    assert pynvml.nvmlDeviceGetCount() == 8
    h = handle(0)
    g = fixture_gpu(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)                                   # pynvml: the v1 symbol
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)     # pynvml: the _v2 symbol
    assert (v1.total, v1.used) == (g["memory_total_bytes"], g["memory_used_bytes"])
    assert isinstance(v2, pynvml.c_nvmlMemory_v2_t) and v2.total == g["memory_total_bytes"]
    calls = node.calls(pid=os.getpid())
    assert calls["nvmlInitWithFlags"] == 1 and calls["nvmlInit_v2"] == 0 and calls["nvmlInit"] == 0
    assert calls["nvmlDeviceGetCount_v2"] == 1 and calls["nvmlDeviceGetCount"] == 0
    assert calls["nvmlDeviceGetHandleByIndex_v2"] == 1 and calls["nvmlDeviceGetHandleByIndex"] == 0
    assert calls["nvmlDeviceGetMemoryInfo_v2"] == 1 and calls["nvmlDeviceGetMemoryInfo"] == 1
    pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    assert node.calls()["nvmlDeviceGetMemoryInfo_v2"] == 2 and node.calls()["nvmlDeviceGetMemoryInfo"] == 1
    node.reset_calls()
    assert node.called() == {}
    pynvml.nvmlDeviceGetPciInfo(h)
    assert node.called() == {"nvmlDeviceGetPciInfo_v3": 1}
    # every symbol the build lists is exported, and nothing else
    lib = ctypes.CDLL(loaded_library())
    assert all(hasattr(lib, s) for s in ne.exported_symbols())
    assert not hasattr(lib, "nvmlDeviceGetFanSpeed") and not hasattr(lib, "emu_parse")


def test_common_nvml_without_a_backend_reads_the_fixture_through_pynvml(nvml_emulator):
    nvml_emulator()
    nv = Nvml()                      # backend None: the real pynvml
    try:
        assert nv.available and nv.device_count == 8 and nv.backend is pynvml
        doc = json.loads(H100_8GPU.read_text())
        cuda = doc["cuda_driver_version"]
        assert nv.driver_version() == doc["driver_version"] and nv.cuda_version() == f"{cuda // 1000}.{cuda % 1000 // 10}"
        for i, g in enumerate(doc["gpus"]):
            h = nv.handle(i)
            assert nv.text("nvmlDeviceGetName", i) == g["name"] and nv.text("nvmlDeviceGetUUID", i) == g["uuid"]
            assert txt(nv.query("nvmlDeviceGetPciInfo", h, gpu=i).busId) == g["pci_bus_id"]
            assert nv.query("nvmlDeviceGetPowerUsage", h, gpu=i) == g["power_mw"]
            assert nv.query("nvmlDeviceGetTemperature", h, 0, gpu=i) == g["temperature_c"]
            assert nv.query("nvmlDeviceGetClockInfo", h, pynvml.NVML_CLOCK_SM, gpu=i) == g["sm_clock_mhz"]
            assert nv.query("nvmlDeviceGetMaxClockInfo", h, pynvml.NVML_CLOCK_MEM, gpu=i) == g["mem_clock_max_mhz"]
            assert nv.query("nvmlDeviceGetCurrentClocksEventReasons", h, gpu=i) == g["throttle_mask"]
            assert nv.query("nvmlDeviceGetCurrPcieLinkGeneration", h, gpu=i) == g["pcie_gen"]
            assert nv.query("nvmlDeviceGetMaxPcieLinkWidth", h, gpu=i) == g["pcie_width_max"]
            assert nv.query("nvmlDeviceGetVirtualizationMode", h, gpu=i) == g["virtualization_mode"]
            assert nv.query("nvmlDeviceGetMigMode", h, gpu=i) == g["mig_mode"]
            assert nv.query("nvmlDeviceGetTotalEccErrors", h, 1, 0, gpu=i) == g["ecc_uncorrected"]
            assert nv.query("nvmlDeviceGetEnforcedPowerLimit", h, gpu=i) == g["power_limit_mw"]
            if g["mig_mode"][0] == 0:
                u = nv.query("nvmlDeviceGetUtilizationRates", h, gpu=i)
                assert (u.gpu, u.memory) == (g["util_gpu_percent"], g["util_mem_percent"])
                procs = nv.query("nvmlDeviceGetComputeRunningProcesses", h, gpu=i)
                assert [(p.pid, p.usedGpuMemory) for p in procs] == \
                    [(p["pid"], p["used_memory_bytes"]) for p in g["processes"]]
        assert nv.unavailable == []
    finally:
        nv.shutdown()


def test_the_vgpu_fixture_lacks_what_its_not_supported_list_says(nvml_emulator):
    nvml_emulator(A10_VGPU)
    nv = Nvml()
    try:
        g = fixture_gpu(0, A10_VGPU)
        h = nv.handle(0)
        assert nv.device_count == 1 and nv.text("nvmlDeviceGetName", 0) == g["name"]
        assert nv.query("nvmlDeviceGetVirtualizationMode", h, gpu=0) == 2
        for fn, args in (("nvmlDeviceGetFieldValues", ([197],)), ("nvmlDeviceGetMigMode", ()),
                         ("nvmlDeviceGetTotalEccErrors", (0, 0))):
            assert nv.query(fn, h, *args, gpu=0) is None and nv.is_unsupported(fn, 0)
        lic = pynvml.nvmlDeviceGetGridLicensableFeatures(h)
        f = lic.gridLicensableFeatures[0]
        assert (lic.isGridLicenseSupported, lic.licensableFeaturesCount, f.featureState) == (1, 1, 1)
        assert txt(f.productName) == g["grid_license"]["product_name"]
        assert f.licenseExpiry.year == 2026 and f.licenseExpiry.status == 2     # NVML_GRID_LICENSE_EXPIRY_VALID
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetRemappedRows(h)
    finally:
        nv.shutdown()


# ---------------------------------------------------------------------------------------------- counters
def test_counters_advance_with_the_frozen_clock_at_the_fixture_rates(node):
    g = fixture_gpu(0)
    h = handle(0)
    e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    tx0, rx0 = field(h, 197).value.ullVal, field(h, 198).value.ullVal
    nv0 = field(h, 138, UINT_MAX).value.ullVal
    assert (tx0, rx0, nv0) == (0, 0, 0) and e0 == ne.ENERGY_START_MJ
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) == e0          # frozen: nothing moves by itself
    node.advance(2.5)
    assert node.now() == pytest.approx(2.5)
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) == e0 + g["power_mw"] * 2.5     # mW x s = mJ
    assert field(h, 197).value.ullVal == g["pcie_tx_kb_per_s"] * 1024 * 2.5
    assert field(h, 198).value.ullVal == g["pcie_rx_kb_per_s"] * 1024 * 2.5
    total_tx = field(h, 138, UINT_MAX).value.ullVal
    assert total_tx == g["nvlink_tx_kib_per_s"] * 2.5
    per_link = [field(h, 138, k).value.ullVal for k in range(g["nvlink_links"])]
    assert sum(per_link) == total_tx and max(per_link) - min(per_link) <= g["nvlink_links"]
    assert field(h, 138, 18).nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT        # no link 18
    assert field(h, 82).value.uiVal == g["memory_temperature_c"]                      # NVML_FI_DEV_MEMORY_TEMP
    raw = field(h, 140, UINT_MAX).value.ullVal                                        # THROUGHPUT_RAW_TX
    assert raw == g["nvlink_raw_tx_kib_per_s"] * 2.5 and raw >= total_tx
    # a changed rate re-bases the counter: it never jumps back
    node.set(0, "power_mw", 100_000)
    e1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    node.advance(1)
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) == e1 + 100_000


def test_ecc_replay_violation_and_process_samples_advance(node):
    h6 = handle(6)
    g6 = fixture_gpu(6)
    node.set(6, "ecc_corrected_per_s", 2.0)
    node.set(6, "pcie_replay_per_s", 0.5)
    node.advance(10)
    assert pynvml.nvmlDeviceGetTotalEccErrors(h6, 0, pynvml.NVML_VOLATILE_ECC) == g6["ecc_corrected"] + 20
    assert pynvml.nvmlDeviceGetMemoryErrorCounter(h6, 0, 0, pynvml.NVML_MEMORY_LOCATION_DRAM) == \
        g6["ecc_corrected"] + 20
    assert pynvml.nvmlDeviceGetPcieReplayCounter(h6) == 5 and field(h6, 94).value.ullVal == 5
    node.set(6, "ecc_uncorrected", 7)                        # a value key: the count is 7 from now on
    assert pynvml.nvmlDeviceGetTotalEccErrors(h6, 1, 0) == 7
    assert pynvml.nvmlDeviceGetRemappedRows(h6) == tuple(g6["remapped_rows"][k] for k in
                                                          ("correctable", "uncorrectable", "pending", "failure"))
    # violation time runs while a clock-event reason holds (power: SW power cap 0x4)
    h0 = handle(0)
    node.set_throttle(0, 0x4)
    node.advance(3)
    node.set_throttle(0, 0)
    node.advance(5)
    assert pynvml.nvmlDeviceGetViolationStatus(h0, pynvml.NVML_PERF_POLICY_POWER).violationTime == 3_000_000_000
    assert pynvml.nvmlDeviceGetViolationStatus(h0, pynvml.NVML_PERF_POLICY_THERMAL).violationTime == 0
    # process utilization: one sample per running process per sampling period (1/6 s)
    first = pynvml.nvmlDeviceGetProcessUtilization(h0, 0)
    assert [(s.pid, s.smUtil) for s in first] == [(p["pid"], p["sm_util_percent"]) for p in fixture_gpu(0)["processes"]]
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(h0, first[0].timeStamp)
    node.advance(0.2)
    (later,) = pynvml.nvmlDeviceGetProcessUtilization(h0, first[0].timeStamp)
    step = later.timeStamp - first[0].timeStamp
    assert 0 < step <= 200_000 + 166_667 and step % 166_667 == 0   # stamped with its sampling period's start


def test_the_health_and_identity_entry_points_answer(node):
    g = fixture_gpu(0)
    h = handle(0)
    assert pynvml.nvmlSystemGetNVMLVersion() == "12." + json.loads(H100_8GPU.read_text())["driver_version"]
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12040
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    assert (pci.domain, pci.bus, pci.device, pci.pciDeviceId) == (0, 0x18, 0, g["pci_device_id"])
    assert txt(pci.busIdLegacy) == "0000:18:00.0"
    for bus in ("00000000:18:00.0", "0000:18:00.0", "0000:18:00.0".upper()):
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(bus)) == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByPciBusId("0000:99:00.0")
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(fixture_gpu(6)["uuid"])) == 6
    assert pynvml.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):          # the fixture has no serial numbers
        pynvml.nvmlDeviceGetSerial(h)
    assert pynvml.nvmlDeviceGetPowerManagementLimit(h) == g["power_limit_mw"]
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_GRAPHICS) == g["sm_clock_mhz"]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_VIDEO)
    assert pynvml.nvmlDeviceGetEncoderUtilization(h) == [0, 166_667]
    assert pynvml.nvmlDeviceGetDecoderUtilization(h) == [0, 166_667]
    links = g["nvlink_links"]
    assert [pynvml.nvmlDeviceGetNvLinkState(h, k) for k in range(links)] == [pynvml.NVML_FEATURE_ENABLED] * links
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetNvLinkState(h, links)
    node.set(0, "nvlink_crc_data_errors_per_s", 3.6)
    node.advance(10)
    per_link = [pynvml.nvmlDeviceGetNvLinkErrorCounter(h, k, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA) for k in range(links)]
    assert sum(per_link) == 36 and field(h, 45).value.ullVal == 36      # NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL
    assert field(h, 91).value.uiVal == links and field(h, 186).value.uiVal == g["power_mw"]
    assert field(h, 164).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED        # no NVLink speed in the fixture
    assert field(h, 9999).nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT    # beyond NVML_FI_MAX
    with pytest.raises(pynvml.NVMLError_NotSupported):          # Hopper remaps rows; no page retirement here
        pynvml.nvmlDeviceGetRetiredPages_v2(h, 0)
    node.set(0, "retired_pages", [{"cause": 1, "address": 0x1000, "timestamp_us": 5},
                                  {"cause": 1, "address": 0x3000, "timestamp_us": 9}])
    assert pynvml.nvmlDeviceGetRetiredPages_v2(h, 1) == [{"address": 0x1000, "timestamp": 5},
                                                          {"address": 0x3000, "timestamp": 9}]
    assert pynvml.nvmlDeviceGetRetiredPages(h, 1) == [0x1000, 0x3000]
    assert pynvml.nvmlDeviceGetRetiredPages(h, 0) == []
    lic = pynvml.nvmlDeviceGetGridLicensableFeatures(h)
    assert (lic.isGridLicenseSupported, lic.licensableFeaturesCount) == (0, 0)


def test_the_real_clock_moves_by_itself(nvml_emulator):
    emu = nvml_emulator(clock="real")
    pynvml.nvmlInit()
    try:
        h = handle(0)
        e0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        wait_for(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h) >= e0 + fixture_gpu(0)["power_mw"] * 0.05, timeout=10,
                 what="energy to grow with CLOCK_MONOTONIC")
        assert emu.now() > 0
    finally:
        pynvml.nvmlShutdown()


# ---------------------------------------------------------------------------------------------- behaviours
def test_memory_v1_counts_reserved_as_used_and_v2_reports_it_apart(node):
    g = fixture_gpu(0)
    h = handle(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    reserved = g["memory_reserved_bytes"]
    assert reserved > 0 and v2.reserved == reserved
    assert v1.used == g["memory_used_bytes"] and v2.used == v1.used - reserved
    assert v1.free == v2.free == g["memory_total_bytes"] - g["memory_used_bytes"]
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(h, version=0x7F000001)


def test_mig_parent_needs_privileges_and_mig_devices_answer(node):
    parent = handle(MIG_GPU)
    node.add_process(MIG_GPU, 50001, 2 << 30, gpu_instance=1, sm_util_percent=40)
    node.add_process(MIG_GPU, 50002, 1 << 30, gpu_instance=2)
    for call in (lambda: pynvml.nvmlDeviceGetUtilizationRates(parent),
                 lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(parent),
                 lambda: pynvml.nvmlGpmSampleGet(parent, pynvml.nvmlGpmSampleAlloc()),
                 lambda: pynvml.nvmlDeviceGetGpuInstanceById(parent, 1)):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            call()
    with pytest.raises(pynvml.NVMLError_NotSupported):          # under MIG (nvml.h note)
        pynvml.nvmlDeviceGetProcessUtilization(parent, 0)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    migs = [pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, k) for k in range(2)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 2)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(parent).value == 0         # pynvml returns the c_uint
    assert [pynvml.nvmlDeviceIsMigDeviceHandle(m).value for m in migs] == [1, 1]
    assert [pynvml.nvmlDeviceGetGpuInstanceId(m) for m in migs] == [1, 2]
    assert [pynvml.nvmlDeviceGetComputeInstanceId(m) for m in migs] == [0, 0]
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migs[1])) == MIG_GPU
    assert pynvml.nvmlDeviceGetName(migs[0]) == f"{fixture_gpu(MIG_GPU)['name']} MIG 3g.40gb"
    uuid = pynvml.nvmlDeviceGetUUID(migs[0])
    assert uuid.startswith("MIG-") and pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
        pynvml.nvmlDeviceGetHandleByUUID(uuid))) == MIG_GPU
    profiles = {p["id"]: p for p in json.loads(H100_8GPU.read_text())["mig_profiles"]}
    assert pynvml.nvmlDeviceGetMemoryInfo(migs[0]).total == profiles[9]["memory_mb"] * MIB
    assert [(p.pid, p.gpuInstanceId, p.computeInstanceId) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(migs[1])] \
        == [(50002, 2, 0)]
    with pytest.raises(pynvml.NVMLError_NotSupported):          # not a query a MIG device answers
        pynvml.nvmlDeviceGetPowerUsage(migs[0])
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(parent)
    # GPU instance profile (dcgm-exporter's GPU_I_PROFILE "3g.40gb", GPU_I_ID)
    node.set_privileged(True)
    gi = pynvml.nvmlDeviceGetGpuInstanceById(parent, 1)
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    assert (info.id, info.profileId, pynvml.nvmlDeviceGetIndex(info.device)) == (1, 9, MIG_GPU)
    prof = pynvml.nvmlDeviceGetGpuInstanceProfileInfoById(parent, info.profileId)
    assert (txt(prof.name), prof.sliceCount, prof.memorySizeMB) == ("MIG 3g.40gb", 3, profiles[9]["memory_mb"])
    by_index = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    assert by_index.id == 9 and pynvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, 2, version=1).id == 9
    # privileged: the parent lists every process with its instance
    assert sorted((p.pid, p.gpuInstanceId) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(parent)) == \
        [(50001, 1), (50002, 2)]
    # MIG reconfigured while running: the old MIG handles go invalid, the new instances answer
    node.set_mig(MIG_GPU, True, ["1g.10gb"])
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMemoryInfo(migs[1])
    (only,) = [pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)]
    assert pynvml.nvmlDeviceGetMemoryInfo(only).total == profiles[19]["memory_mb"] * MIB      # 1g.10gb
    node.set_mig(MIG_GPU, False)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 0 and pynvml.nvmlDeviceGetMigMode(parent) == [0, 0]


def gpm_read(mg_samples, metric_ids):
    mg = pynvml.c_nvmlGpmMetricsGet_t()
    mg.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    mg.numMetrics = len(metric_ids)
    mg.sample1, mg.sample2 = mg_samples
    for k, mid in enumerate(metric_ids):
        mg.metrics[k].metricId = mid
    res = pynvml.nvmlGpmMetricsGet(mg)
    return {mid: (res.metrics[k].nvmlReturn, res.metrics[k].value) for k, mid in enumerate(metric_ids)}


def test_gpm_needs_samples_over_100_ms_apart_and_has_its_own_model(node):
    h = handle(0)
    g = fixture_gpu(0)
    assert pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice == 1
    a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    ids = [1, 2, 3, 5, 10, 20, 61, 42]
    pynvml.nvmlGpmSampleGet(h, a)
    node.advance(0.05)
    pynvml.nvmlGpmSampleGet(h, b)
    close = gpm_read((a, b), ids)
    assert {rc for mid, (rc, _) in close.items() if mid != 42} == {pynvml.NVML_ERROR_NOT_READY}
    node.advance(0.5)
    pynvml.nvmlGpmSampleGet(h, b)
    got = gpm_read((a, b), ids)
    assert got[42][0] == pynvml.NVML_ERROR_NOT_SUPPORTED           # a metric the model does not have
    gpm = g["gpm"]
    want = {1: gpm["graphics_util"], 2: gpm["sm_active"], 3: gpm["sm_occupancy"], 5: gpm["tensor_active"],
            10: gpm["dram_active"], 20: gpm["pcie_tx_mib_per_s"], 61: gpm["nvlink_tx_mib_per_s"]}
    assert {m: v for m, (rc, v) in got.items() if rc == 0} == pytest.approx(want)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):          # the second sample must be the later one
        gpm_read((b, a), ids)
    # the GPM path and the counter path agree on the fixture, and are separate models
    tx0 = field(h, 197).value.ullVal
    pynvml.nvmlGpmSampleGet(h, a)
    node.advance(1)
    pynvml.nvmlGpmSampleGet(h, b)
    counter_mib_s = (field(h, 197).value.ullVal - tx0) / MIB
    assert gpm_read((a, b), [20])[20][1] == pytest.approx(counter_mib_s)
    node.set(0, "gpm.pcie_tx_mib_per_s", 10.0)
    pynvml.nvmlGpmSampleGet(h, a)
    node.advance(1)
    pynvml.nvmlGpmSampleGet(h, b)
    assert gpm_read((a, b), [20])[20][1] == pytest.approx(10.0)
    assert (field(h, 197).value.ullVal - tx0) / MIB == pytest.approx(2 * counter_mib_s)
    # per GPU instance (MIG), through the agent's own Gpm reader
    nv = Nvml()
    try:
        reader = Gpm(nv)
        assert reader.supported(MIG_GPU) and reader.read(MIG_GPU, 1, now_s=node.now()) is None
        node.advance(1)
        vals = reader.read(MIG_GPU, 1, now_s=node.now())   # the reader's 100 ms gate on the node's clock
        assert vals["gpu_sm_active_percent"] == pytest.approx(fixture_gpu(MIG_GPU)["gpm_mig"]["1"]["sm_active"])
        reader.close()
    finally:
        nv.shutdown()
    for s in (a, b):
        pynvml.nvmlGpmSampleFree(s)


def test_used_gpu_memory_can_be_not_available(node):
    h = handle(0)
    node.add_process(0, 777, None)
    procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    assert procs[777] is None and procs[fixture_gpu(0)["processes"][0]["pid"]] is not None
    node.set(0, "process_memory_unavailable", True)
    assert {p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)} == {None}
    node.remove_process(777)
    node.set(0, "process_memory_unavailable", False)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)] == [fixture_gpu(0)["processes"][0]["pid"]]


def test_driver_profiles_switched_at_run_time_answer_function_not_found(node):
    h = handle(0)
    node.set_driver_profile("cuda14")
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetTemperature(h, 0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
    assert pynvml.nvmlDeviceGetTemperatureV(h, 0) == fixture_gpu(0)["temperature_c"]
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == fixture_gpu(0)["throttle_mask"]
    node.set_driver_profile("old")
    for call in (lambda: pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2),
                 lambda: pynvml.nvmlDeviceGetTemperatureV(h, 0),
                 lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)):
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            call()
    with pytest.raises(pynvml.NVMLLibraryMismatchError):      # pynvml's unversioned wrapper calls _v3 only
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    g = fixture_gpu(0)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)] == [p["pid"] for p in g["processes"]]
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == g["temperature_c"]
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h) == g["throttle_mask"]
    node.set_driver_profile("r550")
    assert pynvml.nvmlDeviceGetTemperatureV(h, 0) == g["temperature_c"]


PROFILE_PROBE = r"""
import ctypes, json, pynvml
lib = ctypes.CDLL("libnvidia-ml.so.1")
maps = [l.split()[-1] for l in open("/proc/self/maps") if l.rstrip().endswith("libnvidia-ml.so.1")]
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
out = {"lib": maps[0], "count": pynvml.nvmlDeviceGetCount()}
for name in ("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetComputeRunningProcesses_v3",
             "nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksThrottleReasons"):
    out[name] = hasattr(lib, name)
try:
    pynvml.nvmlDeviceGetTemperature(h, 0); out["temp_v1"] = "ok"
except pynvml.NVMLError_FunctionNotFound:
    out["temp_v1"] = "function not found"
print(json.dumps(out))
"""


@pytest.mark.parametrize("profile", ["old", "cuda14"])
def test_a_subprocess_gets_a_library_without_the_profiles_symbols(nvml_emulator, profile):
    emu = nvml_emulator(activate=False, driver_profile=profile)
    r = subprocess.run([sys.executable, "-c", PROFILE_PROBE], env=emu.env(), capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["lib"] == str(ne.library_path(profile).resolve()) and out["count"] == 8
    flags = ne.exported_symbols()
    for name in ("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetComputeRunningProcesses_v3",
                 "nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        assert out[name] == (f"absent_{profile}" not in flags[name]), name   # dlsym fails, as on such a driver
    assert out["temp_v1"] == ("function not found" if profile == "cuda14" else "ok")
    assert emu.calls()["nvmlDeviceGetTemperature"] == (1 if profile == "old" else 0)


def test_numa_node_is_the_memory_node_and_affinity_the_cpu_node(node):
    h = handle(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):       # x86: the GPU is not a NUMA node (nvml.h)
        pynvml.nvmlDeviceGetNumaNodeId(h)

    def mask(cpulist: str, words: int) -> list[int]:
        out = [0] * words
        for part in cpulist.split(","):
            a, _, b = part.partition("-")
            for c in range(int(a), int(b or a) + 1):
                out[c // 64] |= 1 << (c % 64)
        return out

    want = mask(fixture_gpu(4)["cpu_affinity"], 4)
    assert list(pynvml.nvmlDeviceGetCpuAffinity(handle(4), 4)) == want
    assert list(pynvml.nvmlDeviceGetCpuAffinityWithinScope(handle(4), 4, pynvml.NVML_AFFINITY_SCOPE_NODE)) == want
    node.set(0, "memory_numa_node", 2)          # GH200 class: the HBM is its own node, the CPUs stay on 0
    assert pynvml.nvmlDeviceGetNumaNodeId(h) == 2
    assert list(pynvml.nvmlDeviceGetCpuAffinity(h, 4)) == mask(fixture_gpu(0)["cpu_affinity"], 4)


def test_pcie_byte_fields_can_be_dropped_and_come_back(node):
    h = handle(1)
    rate = fixture_gpu(1)["pcie_tx_kb_per_s"] * 1024
    node.advance(1)
    node.drop_field(197)
    tx, rx = pynvml.nvmlDeviceGetFieldValues(h, [197, 198])
    assert tx.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED and rx.nvmlReturn == pynvml.NVML_SUCCESS
    node.advance(1)
    node.restore_field(197)
    assert field(h, 197).value.ullVal == 2 * rate          # the counter kept counting while hidden
    node.drop_field(198, gpu=2)
    assert field(handle(2), 198).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED and field(h, 198).nvmlReturn == 0


def test_transient_errors_then_success(node):
    h = handle(0)
    node.fail("nvmlDeviceGetPowerUsage", "UNKNOWN", times=2)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetPowerUsage(h)
    assert pynvml.nvmlDeviceGetPowerUsage(h) == fixture_gpu(0)["power_mw"]
    rule = node.fail("nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_TIMEOUT, gpu=1)      # until cleared
    assert field(handle(0), 197).nvmlReturn == 0
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_Timeout):
            field(handle(1), 197)
    node.clear_fail(rule)
    assert field(handle(1), 197).nvmlReturn == 0
    # through the agent's seam: UNKNOWN is not permanent, so the value comes back after the failures
    nv = Nvml()
    try:
        node.fail("nvmlDeviceGetTemperature", "UNKNOWN", gpu=3, times=1)
        assert nv.query("nvmlDeviceGetTemperature", nv.handle(3), 0, gpu=3) is None
        assert nv.query("nvmlDeviceGetTemperature", nv.handle(3), 0, gpu=3) == fixture_gpu(3)["temperature_c"]
    finally:
        nv.shutdown()
    node.fail("nvmlInitWithFlags", "DRIVER_NOT_LOADED", times=1)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


def test_lost_gpu_answers_gpu_is_lost_everywhere(node):
    h3 = handle(3)
    node.lose_gpu(3)
    for call in (lambda: pynvml.nvmlDeviceGetPowerUsage(h3), lambda: pynvml.nvmlDeviceGetMemoryInfo(h3),
                 lambda: pynvml.nvmlDeviceGetFieldValues(h3, [197]), lambda: handle(3)):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert pynvml.nvmlDeviceGetPowerUsage(handle(2)) == fixture_gpu(2)["power_mw"]
    assert pynvml.nvmlDeviceGetCount() == 8


def test_xid_events_with_device_and_instance_ids(node):
    es = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_Timeout):                 # 0 ms and nothing pending
        pynvml.nvmlEventSetWait(es, 0)
    assert pynvml.nvmlDeviceGetSupportedEventTypes(handle(0)) == pynvml.nvmlEventTypeXidCriticalError
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeClock, es)
    for i in range(8):
        pynvml.nvmlDeviceRegisterEvents(handle(i), pynvml.nvmlEventTypeXidCriticalError, es)
    got = []
    for _ in range(2):                                            # the fixture's two events were pending
        d = pynvml.nvmlEventSetWait(es, 0)
        got.append((pynvml.nvmlDeviceGetIndex(d.device), d.eventData, d.eventType))
    assert sorted(got) == [(3, 79, 8), (6, 48, 8)]
    node.inject_xid(MIG_GPU, 94, gpu_instance=2, compute_instance=0)
    d = pynvml.nvmlEventSetWait(es, 0)
    assert (pynvml.nvmlDeviceGetIndex(d.device), d.eventData, d.gpuInstanceId, d.computeInstanceId) == (5, 94, 2, 0)
    node.inject_xid(1, 13)
    d = pynvml.nvmlEventSetWait(es, 0)
    assert (d.eventData, d.gpuInstanceId, d.computeInstanceId) == (13, UINT_MAX, UINT_MAX)
    # a wait with a timeout receives an event injected while it waits (from another thread)
    before = node.calls()["nvmlEventSetWait_v2"]

    def inject_when_waiting():
        wait_for(lambda: node.calls()["nvmlEventSetWait_v2"] > before, timeout=10, what="the wait to start")
        node.inject_xid(7, 31)

    t = threading.Thread(target=inject_when_waiting)
    t.start()
    d = pynvml.nvmlEventSetWait(es, 20_000)
    t.join()
    assert (pynvml.nvmlDeviceGetIndex(d.device), d.eventData) == (7, 31)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(es, 10)
    pynvml.nvmlEventSetFree(es)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlEventSetWait(es, 0)


def test_values_change_while_running_from_another_process(node):
    h = handle(0)
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == fixture_gpu(0)["temperature_c"]
    script = ("import sys; from gpuagent.sim.nvml_emulator import Emulator; "
              "e = Emulator.attach(sys.argv[1]); e.set(0, 'temperature_c', 88); e.advance(4)")
    subprocess.run([sys.executable, "-c", script, str(node.state_dir)], check=True, timeout=60)
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 88              # no re-init: seen at the next call
    assert pynvml.nvmlDeviceGetTotalEnergyConsumption(h) == ne.ENERGY_START_MJ + fixture_gpu(0)["power_mw"] * 4
    node.set(0, "util_gpu_percent", 12)                             # this controller saw the other's change
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 88 and pynvml.nvmlDeviceGetUtilizationRates(h).gpu == 12


SUBPROCESS_AGENT = r"""
import json, sys, time, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(2)
es = pynvml.nvmlEventSetCreate()
pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
print(json.dumps({"count": pynvml.nvmlDeviceGetCount(), "used": pynvml.nvmlDeviceGetMemoryInfo(h).used}), flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        d = pynvml.nvmlEventSetWait(es, 200)
    except pynvml.NVMLError_Timeout:
        continue
    print(json.dumps({"gpu": pynvml.nvmlDeviceGetIndex(d.device), "xid": d.eventData}), flush=True)
    break
"""


def test_a_subprocess_sees_the_node_and_receives_an_injected_xid(nvml_emulator):
    emu = nvml_emulator(activate=False)
    proc = subprocess.Popen([sys.executable, "-c", SUBPROCESS_AGENT], env=emu.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        assert first == {"count": 8, "used": fixture_gpu(2)["memory_used_bytes"]}
        live = wait_for(lambda: emu.calls(pid=proc.pid)["nvmlEventSetWait_v2"] >= 1 and emu.calls(pid=proc.pid),
                        timeout=30, what="the subprocess to wait for events")
        assert live["nvmlDeviceRegisterEvents"] == 1 and live["nvmlInitWithFlags"] == 1
        assert emu.pids() == [proc.pid]
        emu.inject_xid(2, 79)
        assert json.loads(proc.stdout.readline()) == {"gpu": 2, "xid": 79}
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


NVITOP_PROBE = r"""
import json
from nvitop import Device
d = Device(0)
print(json.dumps({"memory_used": d.memory_used(), "memory_total": d.memory_total(), "util": d.gpu_utilization(),
                  "power": d.power_usage(), "temp": d.temperature(), "clocks": list(d.clock_infos()),
                  "pids": sorted(d.processes())}))
"""


def test_the_entry_points_nvitop_reads_answer(nvml_emulator):
    pytest.importorskip("nvitop")
    emu = nvml_emulator(activate=False, clock="real")
    r = subprocess.run([sys.executable, "-c", NVITOP_PROBE], env=emu.env(), capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    g = fixture_gpu(0)
    assert out["memory_total"] == g["memory_total_bytes"]
    assert out["memory_used"] == g["memory_used_bytes"] - g["memory_reserved_bytes"]     # nvitop uses _v2
    assert (out["util"], out["power"], out["temp"]) == (g["util_gpu_percent"], g["power_mw"], g["temperature_c"])
    assert out["clocks"][1:3] == [g["sm_clock_mhz"], g["mem_clock_mhz"]]
    assert out["pids"] == [p["pid"] for p in g["processes"]]
    called = emu.called()
    assert called["nvmlDeviceGetMemoryInfo_v2"] >= 1 and called["nvmlDeviceGetTemperatureV"] >= 1


def test_concurrent_calls_are_all_counted_while_the_node_changes(node):
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            h = handle(i)
            for _ in range(300):
                assert pynvml.nvmlDeviceGetPowerUsage(h) in (fixture_gpu(i)["power_mw"], 1000)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    node.reset_calls()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for k in range(20):
        node.set(4, "temperature_c", 40 + k)          # each change makes the library reload the node
    for t in threads:
        t.join()
    assert errors == []
    calls = node.calls()
    assert calls["nvmlDeviceGetPowerUsage"] == 1200 and calls["nvmlDeviceGetHandleByIndex_v2"] == 4
    assert pynvml.nvmlDeviceGetTemperature(handle(4), 0) == 59


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_fixtures_and_calls_are_one_sentence(tmp_path):
    built_or_skip()
    doc = json.loads(H100_8GPU.read_text())
    cases = [({"gpus": []}, "no 'gpus' list"),
             ({"gpus": [{k: v for k, v in doc["gpus"][0].items() if k != "uuid"}]}, "lacks 'uuid'"),
             ({"gpus": [{**doc["gpus"][0], "power_mw": "lots"}]}, "power_mw must be"),
             ({"gpus": [{**doc["gpus"][0], "mig_mode": [1, 1], "mig_instances": [{"profile": "9g.90gb"}]}]},
              "not in the fixture's mig_profiles")]
    for k, (bad, words) in enumerate(cases):
        with pytest.raises(EmulatorError, match=words) as err:
            Emulator.start(tmp_path / f"bad{k}", bad)
        assert "\n" not in str(err.value)
    (tmp_path / "notjson.json").write_text("{nope")
    with pytest.raises(EmulatorError, match="is not JSON"):
        Emulator.start(tmp_path / "bad-json", tmp_path / "notjson.json")
    emu = Emulator.start(tmp_path / "ok", H100_8GPU)
    with pytest.raises(EmulatorError, match="already holds"):
        Emulator.start(tmp_path / "ok", H100_8GPU)
    for bad_call in (lambda: emu.fail("nvmlDeviceGetNoSuchThing", 3), lambda: emu.fail("nvmlDeviceGetPowerUsage", "MEH"),
                     lambda: emu.set(0, "no_such_key", 1), lambda: emu.set(9, "power_mw", 1),
                     lambda: emu.set(None, "driver_profile", "r999"), lambda: emu.advance(-1),
                     lambda: emu.set_mig(0, True, ["9g.90gb"])):
        with pytest.raises(EmulatorError):
            bad_call()


def test_a_malformed_state_file_is_one_sentence_and_the_previous_state_is_kept(node):
    h = handle(0)
    control = node.state_dir / "control"
    node.set(0, "temperature_c", 70)
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 70
    control.write_text(control.read_text().replace("temperature_c 70", "temperature_c seventy"))
    with open(node.state_dir / "generation", "r+b") as f:
        f.write(struct.pack("<Q", 10_000))
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 70                 # the bad file was not applied
    err = node.library_error()
    assert "temperature_c: 'seventy' is not an integer" in err and "keeping the previous state" in err
    node.set(0, "temperature_c", 71)                                    # a good file again
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 71


def test_nvml_init_without_a_node_or_with_a_broken_one(nvml_emulator, tmp_path, monkeypatch):
    nvml_emulator()             # loads the library and points this process at a node
    monkeypatch.setenv(ne.ENV_DIR, str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "state").write_text("nvmlemu 1\nnode_id x\ngpu_count 1\ngpu 0\nname A\nwattage 5\n")
    monkeypatch.setenv(ne.ENV_DIR, str(broken))
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    assert (broken / "error").read_text().strip().endswith("line 6: unknown GPU key 'wattage'")
    monkeypatch.delenv(ne.ENV_DIR)
    nv = Nvml()
    assert not nv.available and "Driver Not Loaded" in nv.reason


# ---------------------------------------------------------------------------------------------- build
def test_make_nvmlemu_builds_from_clean(tmp_path):
    built_or_skip()             # needs cc and nvml.h, like the real build
    out = tmp_path / "b"
    r = subprocess.run(["make", "-s", "-C", str(REPO), "nvmlemu", f"NVMLEMU_OUT={out}"], capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    # loaded in a subprocess: a second libnvidia-ml.so.1 in this process would take pynvml's soname lookup
    probe = ("import ctypes, json, sys; so = ctypes.CDLL(sys.argv[1]); print(json.dumps([hasattr(so, n) for n in "
             "('nvmlInitWithFlags', 'nvmlDeviceGetTemperature', 'nvmlDeviceGetMemoryInfo_v2')]))")
    for profile in ne.PROFILES:
        r = subprocess.run([sys.executable, "-c", probe, str(ne.library_path(profile, out))], capture_output=True,
                           text=True, timeout=60, check=True)
        assert json.loads(r.stdout) == [True, profile != "cuda14", profile != "old"], profile
    assert ne.exported_symbols(out) == ne.exported_symbols()
    bad = subprocess.run(["sh", str(REPO / "sim/nvmlemu/build.sh"), sys.executable, str(tmp_path / "c")],
                         capture_output=True, text=True, check=False, env={**os.environ, "NVML_INCLUDE": str(tmp_path)})
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "nvml.h was not found" in bad.stderr
    bad = subprocess.run(["sh", str(REPO / "sim/nvmlemu/build.sh"), sys.executable, str(tmp_path / "c")],
                         capture_output=True, text=True, check=False, env={**os.environ, "CC": "no-such-cc"})
    assert bad.returncode == 1 and "no C compiler 'no-such-cc'" in bad.stderr


def test_a_refused_change_leaves_the_node_as_it_was(node):
    with pytest.raises(EmulatorError, match="power_mw must be"):
        node.set(0, "power_mw", "lots")
    node.set(0, "temperature_c", 50)               # the next change must not carry the refused one
    assert node.model["gpus"][0]["power_mw"] == fixture_gpu(0)["power_mw"]
    assert pynvml.nvmlDeviceGetPowerUsage(handle(0)) == fixture_gpu(0)["power_mw"]
    assert pynvml.nvmlDeviceGetTemperature(handle(0), 0) == 50
