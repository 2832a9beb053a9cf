"""dcgm-exporter compatibility of the agent's /metrics (issue 22), in process: the 25 metrics of
dcgm-exporter's default CSV and its driver-version label, with the CSV's types, each naming generation's
names and units, XID at 0 with err_code/err_msg, per-MIG-instance series, job attribution without
splitting GPU series, and NVLink bytes with headers. The agent runs in process over the NVML emulator
(the real pynvml answered by sim/nvmlemu; SYNTHETIC node from tests/data); the real-Prometheus side is
tests/test_exporter_prometheus.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
from exporter_helpers import MIB, parse_exposition, per_gpu, per_instance
from exporter_helpers import ticks as run_ticks
from nvml_emulator_fixture import A10_VGPU, H100_8GPU, nvml_emulator  # noqa: F401  (the fixture)

from gpuagent.agent.config import ConfigError, ExporterConfig, load_config
from gpuagent.agent.daemon import Agent, build_node_info
from gpuagent.agent.surface.dcgm_families import dcgm_families, job_info_family
from gpuagent.agent.surface.exporter import Exporter, wants_openmetrics
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.host import HostSampler
from gpuagent.agent.snapshot import JobStatus
from gpuagent.common.hardware_faults import xid_description
from gpuagent.common.nvml import Nvml

# The active rows of dcgm-exporter's etc/default-counters.csv (github.com/NVIDIA/dcgm-exporter at tag
# 4.5.3-4.8.2 and at d5e5f51, the Hostname->hostname commit): name and Prometheus type, in the CSV's order,
# then the name from 4.9.0 on (DCGM 4.7's field names: DCGM's dcgm_fields.h deprecation aliases and
# go-dcgm's base-unit fields; 4.9.0 release notes) and 4.10.0's renames of the PCIe rates (4.10.0 release
# notes). The 26th row, DCGM_FI_DRIVER_VERSION, is of type label.
DEFAULT_CSV = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "DCGM_FI_DEV_SM_CLOCK_HERTZ"),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "DCGM_FI_DEV_MEMORY_CLOCK_HERTZ"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "DCGM_FI_DEV_MEMORY_TEMP_CELSIUS"),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "DCGM_FI_DEV_GPU_TEMP_CELSIUS"),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "DCGM_FI_DEV_BOARD_POWER_WATTS"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "DCGM_FI_DEV_GPU_ENERGY_JOULES_TOTAL"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "DCGM_FI_DEV_PCIE_REPLAY_TOTAL"),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "DCGM_FI_DEV_GPU_UTIL_RATIO"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "DCGM_FI_DEV_MEMORY_UTIL_RATIO"),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "DCGM_FI_DEV_ENC_UTIL_RATIO"),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "DCGM_FI_DEV_DEC_UTIL_RATIO"),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "DCGM_FI_DEV_XID_ERROR"),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "DCGM_FI_DEV_FB_FREE_BYTES"),
    ("DCGM_FI_DEV_FB_USED", "gauge", "DCGM_FI_DEV_FB_USED_BYTES"),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "DCGM_FI_DEV_FB_RESERVED_BYTES"),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter", "DCGM_FI_DEV_NVLINK_THROUGHPUT_BYTES_PER_SECOND"),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "DCGM_FI_DEV_VGPU_LICENSE_STATUS"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "DCGM_FI_DEV_ROW_REMAP_UNCORRECTABLE_TOTAL"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "DCGM_FI_DEV_ROW_REMAP_CORRECTABLE_TOTAL"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "DCGM_FI_DEV_ROW_REMAP_FAILED"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "DCGM_FI_PROF_TENSOR_UTIL_RATIO"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", "DCGM_FI_PROF_DRAM_UTIL_RATIO"),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "DCGM_FI_PROF_PCIE_TX_BYTES"),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "DCGM_FI_PROF_PCIE_RX_BYTES"),
]
RENAMED_410 = {"DCGM_FI_PROF_PCIE_TX_BYTES": "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND",
               "DCGM_FI_PROF_PCIE_RX_BYTES": "DCGM_FI_PROF_PCIE_RX_BYTES_PER_SECOND"}
GENERATIONS = ("pre-4.8.3", "4.8.3", "4.9", "4.10")
MIG_GPU = 5           # MIG on in the fixture: two 3g.40gb GPU instances, ids 1 and 2


def csv_name(old: str, generation: str) -> str:
    if generation == "4.10" and old in RENAMED_410:
        return RENAMED_410[old]
    return {o: n for o, _, n in DEFAULT_CSV}[old] if generation in ("4.9", "4.10") else old


def fixture_doc(path=H100_8GPU) -> dict:
    """The SYNTHETIC node the emulator answers from (tests/data), for the expected values."""
    return json.loads(path.read_text())


def tick_agent(make_emulator, tmp_path, settings: ExporterConfig, fixture=H100_8GPU, ticks: int = 3,
               xid: tuple | None = None, mig_work: bool = True, setup=None, **start):
    """Three ticks of an in-process agent (running as root, so NVML answers its MIG calls) over a fresh
    emulated node; a process in each MIG instance of GPU 5 so GPM reads them. Returns (fixture as parsed,
    snapshot, exposition text, Exporter, Nvml)."""
    emu = make_emulator(fixture, privileged=start.pop("privileged", True), **start)
    if mig_work and fixture == H100_8GPU:
        emu.add_process(MIG_GPU, 50001, 2 * 2 ** 30, 1, sm_util_percent=40)
        emu.add_process(MIG_GPU, 50002, 2 ** 30, 2, sm_util_percent=10)
    if setup:
        setup(emu)
    cfg = load_config(None, env={}, state_dir=str(tmp_path / "state"), collector="127.0.0.1:9")
    nvml = Nvml()
    assert nvml.available, nvml.reason
    gpu = GpuSampler(nvml=nvml)
    samplers = [HostSampler(), gpu]
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    exp = Exporter("127.0.0.1:0", settings)
    try:
        if xid:
            emu.inject_xid(*xid)
        run_ticks(agent, emu, ticks)
        snap = agent.status_snapshot()
        unavailable = list(nvml.unavailable)
    finally:
        agent.shutdown()
    exp.update(snap)
    body, ctype = exp.render("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    return fixture_doc(fixture), snap, body.decode(), exp, unavailable


@pytest.mark.parametrize("generation", GENERATIONS)
def test_the_25_default_metrics_with_their_csv_types_names_and_units(nvml_emulator, tmp_path, generation):
    fx, snap, text, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(dcgm_names=generation))
    m, types = parse_exposition(text)
    new = generation in ("4.9", "4.10")
    for old, kind, _new in DEFAULT_CSV:
        name = csv_name(old, generation)
        assert types.get(name) == kind, (name, types.get(name))
        assert m.get(name), f"{name}: no series"
        assert old == name or old not in types, f"{old} still exported under {generation}"
    assert len(DEFAULT_CSV) == 25
    # Labels: dcgm-exporter's, the hostname label as renamed in 4.8.3, the driver-version label as renamed in 4.9.0
    host = "hostname" if generation != "pre-4.8.3" else "Hostname"
    driver = "DCGM_FI_SYSTEM_DRIVER_VERSION" if new else "DCGM_FI_DRIVER_VERSION"
    (lab0, _), = [s for s in m[csv_name("DCGM_FI_DEV_POWER_USAGE", generation)] if s[0]["gpu"] == "0"]
    assert lab0 == {"gpu": "0", "UUID": fx["gpus"][0]["uuid"], "pci_bus_id": fx["gpus"][0]["pci_bus_id"],
                    "device": "nvidia0", "modelName": fx["gpus"][0]["name"], host: snap.node.hostname,
                    driver: fx["driver_version"]}
    # Units: before 4.9.0 dcgm-exporter's (MHz, mJ, %, whole MiB); from 4.9.0 base units (Hz, J, ratio, bytes).
    gpus = {g.index: g for g in snap.gpus}
    g0 = gpus[0]
    v = {old: per_gpu(m, csv_name(old, generation))[0] for old, _, _ in DEFAULT_CSV}
    f0 = fx["gpus"][0]
    assert v["DCGM_FI_DEV_SM_CLOCK"] == f0["sm_clock_mhz"] * (1e6 if new else 1)
    assert v["DCGM_FI_DEV_MEM_CLOCK"] == f0["mem_clock_mhz"] * (1e6 if new else 1)
    assert v["DCGM_FI_DEV_MEMORY_TEMP"] == f0["memory_temperature_c"]
    assert v["DCGM_FI_DEV_GPU_TEMP"] == f0["temperature_c"]
    assert v["DCGM_FI_DEV_POWER_USAGE"] == f0["power_mw"] / 1000
    assert v["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == pytest.approx(g0.energy_consumed_mj * (1e-3 if new else 1))
    assert v["DCGM_FI_DEV_GPU_UTIL"] == pytest.approx(f0["util_gpu_percent"] * (0.01 if new else 1))
    assert v["DCGM_FI_DEV_MEM_COPY_UTIL"] == pytest.approx(f0["util_mem_percent"] * (0.01 if new else 1))
    assert v["DCGM_FI_DEV_ENC_UTIL"] == v["DCGM_FI_DEV_DEC_UTIL"] == 0
    reserved = f0["memory_reserved_bytes"]
    used_v2, free = f0["memory_used_bytes"] - reserved, f0["memory_total_bytes"] - f0["memory_used_bytes"]
    for old, b in (("DCGM_FI_DEV_FB_USED", used_v2), ("DCGM_FI_DEV_FB_FREE", free), ("DCGM_FI_DEV_FB_RESERVED", reserved)):
        assert v[old] == (b if new else b // MIB), old
    # NVLink: DCGM's BANDWIDTH_TOTAL is (data tx + rx) KiB/s / 1000, truncated; from 4.9.0 bytes per second
    data = g0.nvlink_tx_bytes_per_s + g0.nvlink_rx_bytes_per_s
    assert v["DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"] == (data if new else int(data / 1024 / 1000))
    assert v["DCGM_FI_DEV_VGPU_LICENSE_STATUS"] == 0        # an H100 without GRID licensing
    assert per_gpu(m, csv_name("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", generation)) == {
        i: g["remapped_rows"]["uncorrectable"] for i, g in enumerate(fx["gpus"])}
    assert per_gpu(m, csv_name("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", generation))[6] == 1
    assert v["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"] == v["DCGM_FI_DEV_ROW_REMAP_FAILURE"] == 0
    assert v["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(f0["gpm"]["graphics_util"] / 100)
    assert v["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"] == pytest.approx(f0["gpm"]["tensor_active"] / 100)
    assert v["DCGM_FI_PROF_DRAM_ACTIVE"] == pytest.approx(f0["gpm"]["dram_active"] / 100)
    assert v["DCGM_FI_PROF_PCIE_TX_BYTES"] == g0.pcie_tx_bytes_per_s


def test_xid_is_zero_from_the_start_with_dcgm_exporters_err_labels(nvml_emulator, tmp_path):
    fx, snap, text, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(), xid=(1, 13))
    m, _ = parse_exposition(text)
    recorded = {e["gpu"]: e["xid"] for e in fx["events"]}          # GPU 3: 79, GPU 6: 48
    want = {i: {1: 13, **recorded}.get(i, 0) for i in range(8)}
    got = {int(lab["gpu"]): (v, lab["err_code"], lab["err_msg"]) for lab, v in m["DCGM_FI_DEV_XID_ERRORS"]}
    assert {i: x[0] for i, x in got.items()} == want, "one XID series per GPU, 0 before any XID"
    assert all(code == str(int(v)) for v, code, _ in got.values())
    assert got[0][2] == "No Error" and got[1][2] == xid_description(13)     # the XID catalogue's words
    assert got[3][2] == "GPU has fallen off the bus"
    # err labels off: the same values, without them
    _, _, text, _, _ = tick_agent(nvml_emulator, tmp_path / "nolabels", ExporterConfig(xid_labels=False), xid=(1, 13))
    m, _ = parse_exposition(text)
    assert {int(lab["gpu"]): v for lab, v in m["DCGM_FI_DEV_XID_ERRORS"]} == want
    assert not any("err_code" in lab for lab, _ in m["DCGM_FI_DEV_XID_ERRORS"])


def test_an_xid_without_a_description_is_unknown_error(nvml_emulator, tmp_path):
    _, _, text, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(), xid=(2, 250))
    m, _ = parse_exposition(text)
    (lab, v), = [s for s in m["DCGM_FI_DEV_XID_ERRORS"] if s[0]["gpu"] == "2"]
    assert (v, lab["err_code"], lab["err_msg"]) == (250, "250", "Unknown Error")


@pytest.mark.parametrize("generation", ("pre-4.8.3", "4.10"))
def test_a_mig_gpu_has_one_series_per_gpu_instance(nvml_emulator, tmp_path, generation):
    fx, snap, text, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(dcgm_names=generation))
    m, _ = parse_exposition(text)
    new = generation == "4.10"
    profile_mb = {p["id"]: p["memory_mb"] for p in fx["mig_profiles"]}
    insts = {x["gpu_instance_id"]: x for x in fx["gpus"][MIG_GPU]["mig_instances"]}
    def n(old):
        return csv_name(old, generation)
    # Framebuffer per instance (nvmlMemory_v2 of each MIG device), profile names as DCGM makes them
    profiles = {int(lab["GPU_I_ID"]): lab["GPU_I_PROFILE"] for lab, _ in m[n("DCGM_FI_DEV_FB_USED")]
                if lab["gpu"] == str(MIG_GPU)}
    assert profiles == {1: "3g.40gb", 2: "3g.40gb"}
    for old, key in (("DCGM_FI_DEV_FB_USED", "used"), ("DCGM_FI_DEV_FB_FREE", "free"),
                     ("DCGM_FI_DEV_FB_RESERVED", "reserved")):
        want = {}
        for gi, x in insts.items():
            total = profile_mb[x["profile_id"]] * MIB       # a MIG device's memory is its profile's
            b = {"used": x["memory_used_bytes"], "reserved": 0, "free": total - x["memory_used_bytes"]}[key]
            want[(MIG_GPU, gi)] = b if new else b // MIB
        assert per_instance(m, n(old)) == want, old
        assert MIG_GPU not in per_gpu(m, n(old)), f"{old}: a MIG GPU has per-instance series only"
    # Profiling ratios and GPU_UTIL per instance, from GPM per GPU instance (SYNTHETIC fixture values)
    gpm = fx["gpus"][MIG_GPU]["gpm_mig"]
    for old, key in (("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active"), ("DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                                                                           "graphics_util"),
                     ("DCGM_FI_PROF_DRAM_ACTIVE", "dram_active")):
        assert per_instance(m, n(old)) == pytest.approx({(MIG_GPU, int(gi)): v[key] / 100 for gi, v in gpm.items()})
    util = per_instance(m, n("DCGM_FI_DEV_GPU_UTIL"))
    assert util == pytest.approx({(MIG_GPU, int(gi)): v["graphics_util"] * (0.01 if new else 1)
                                  for gi, v in gpm.items()})
    # GPU-level values stay one series per GPU (not repeated per instance)
    for old in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS"):
        assert [lab for lab, _ in m[n(old)] if lab["gpu"] == str(MIG_GPU)] and \
            all("GPU_I_ID" not in lab for lab, _ in m[n(old)]), old
    assert snap.gpus[MIG_GPU].instances is not None and len(snap.gpus[MIG_GPU].instances) == 2


def _with_jobs(snap, jobs):
    return dataclasses.replace(snap, jobs=[JobStatus(job_id=j, job_name=f"name-{j}", gpu=g) for j, g in jobs])


def test_jobs_split_no_gpu_series_by_default_and_join_through_the_info_series(nvml_emulator, tmp_path):
    _, snap, _, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(), mig_work=False)
    before = _with_jobs(snap, [("a", 0)])
    during = _with_jobs(snap, [("a", 0), ("b", 0), ("b", 1)])
    after = _with_jobs(snap, [])
    series = {}
    for label, s in (("before", before), ("during", during), ("after", after)):
        series[label] = {(f.name, tuple(lab)) for f in dcgm_families(s, ExporterConfig()) for lab, _ in f.samples}
    assert series["before"] == series["during"] == series["after"], "a job starting or stopping changes no GPU series"
    assert not any(k == "hpc_job" for _, lab in series["during"] for k, _ in lab)
    info = job_info_family(during, ExporterConfig())
    assert info.name == "gpuagent_gpu_job_info"
    assert sorted((dict(lab)["gpu"], dict(lab)["job_id"]) for lab, _ in info.samples) == [
        ("0", "a"), ("0", "b"), ("1", "b")]
    assert {dict(lab)["job_name"] for lab, _ in info.samples} == {"name-a", "name-b"}
    assert all(v == 1 for _, v in info.samples)
    assert "Hostname" in dict(info.samples[0][0])
    assert "hostname" in dict(job_info_family(during, ExporterConfig(dcgm_names="4.10")).samples[0][0])


def test_hpc_job_mode_repeats_each_series_per_job_as_dcgm_exporter_does(nvml_emulator, tmp_path):
    settings = ExporterConfig(job_labels="hpc_job")
    _, snap, _, _, _ = tick_agent(nvml_emulator, tmp_path, settings, mig_work=False)
    during = _with_jobs(snap, [("a", 0), ("b", 0), ("b", 1)])
    fam = {f.name: f for f in dcgm_families(during, settings)}["DCGM_FI_DEV_POWER_USAGE"]
    jobs = sorted((dict(lab)["gpu"], dict(lab).get("hpc_job")) for lab, _ in fam.samples)
    assert [j for j in jobs if j[0] in ("0", "1", "2")] == [("0", "a"), ("0", "b"), ("1", "b"), ("2", None)]
    assert not any("," in (j or "") for _, j in jobs), "one series per job, never comma-joined"


def test_nvlink_prof_bytes_include_protocol_headers_and_the_data_rate_is_gpuagents(nvml_emulator, tmp_path):
    fx, snap, text, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig())
    m, _ = parse_exposition(text)
    g0 = {g.index: g for g in snap.gpus}[0]
    assert per_gpu(m, "DCGM_FI_PROF_NVLINK_TX_BYTES")[0] == g0.nvlink_raw_tx_bytes_per_s
    assert per_gpu(m, "DCGM_FI_PROF_NVLINK_RX_BYTES")[0] == g0.nvlink_raw_rx_bytes_per_s
    assert per_gpu(m, "gpuagent_gpu_nvlink_data_transmit_bytes_per_second")[0] == g0.nvlink_tx_bytes_per_s
    f0 = fx["gpus"][0]
    # header + payload over payload: the fixture's raw/data rates (SYNTHETIC), measured over the same ticks
    assert g0.nvlink_raw_tx_bytes_per_s / g0.nvlink_tx_bytes_per_s == pytest.approx(
        f0["nvlink_raw_tx_kib_per_s"] / f0["nvlink_tx_kib_per_s"], rel=1e-6)
    assert g0.nvlink_raw_tx_bytes_per_s > g0.nvlink_tx_bytes_per_s
    # a GPU without NVLink has neither
    assert 0 in per_gpu(m, "DCGM_FI_PROF_NVLINK_TX_BYTES") and len(per_gpu(m, "DCGM_FI_PROF_NVLINK_TX_BYTES")) == \
        sum(1 for g in fx["gpus"] if g["nvlink_links"])


def test_vgpu_license_status_by_dcgms_rule_and_what_a_vgpu_guest_lacks(nvml_emulator, tmp_path):
    """DCGM reports the license state of the vGPU feature (code 1) only; this A10-24Q guest holds an RTX
    Virtual Workstation license (code 2), so DCGM, and gpuagent, report nothing for it."""
    _, snap, text, _, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(), fixture=A10_VGPU)
    m, types = parse_exposition(text)
    assert "DCGM_FI_DEV_VGPU_LICENSE_STATUS" not in m
    # no NVLink, no row remapper in a vGPU guest: those series are absent, not 0
    assert "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" not in m and "DCGM_FI_DEV_ROW_REMAP_FAILURE" not in m
    assert per_gpu(m, "DCGM_FI_DEV_XID_ERRORS") == {0: 0.0}
    for feature, licensed, want in ((1, True, 1.0), (1, False, 0.0)):
        lic = dict(fixture_doc(A10_VGPU)["gpus"][0]["grid_license"], feature_code=feature, licensed=licensed)
        _, _, text, _, _ = tick_agent(nvml_emulator, tmp_path / f"lic{feature}{licensed}", ExporterConfig(),
                                      fixture=A10_VGPU, ticks=1, setup=lambda emu, lic=lic: emu.set(0, "grid_license", lic))
        assert per_gpu(parse_exposition(text)[0], "DCGM_FI_DEV_VGPU_LICENSE_STATUS") == {0: want}, (feature, licensed)


def test_a_driver_without_memory_v2_keeps_the_v1_read(nvml_emulator, tmp_path):
    """The v2 read shares the seam's function name with the v1 read: its refusal must not switch v1 off.
    The emulator's "old" driver profile has no nvmlDeviceGetMemoryInfo_v2 (FUNCTION_NOT_FOUND)."""
    fx, snap, text, _, unavailable = tick_agent(nvml_emulator, tmp_path, ExporterConfig(), mig_work=False,
                                                driver_profile="old")
    g0 = snap.gpus[0]
    assert g0.memory_used_bytes == fx["gpus"][0]["memory_used_bytes"] and g0.memory_reserved_bytes is None
    m, _ = parse_exposition(text)
    assert per_gpu(m, "DCGM_FI_DEV_FB_USED")[0] == fx["gpus"][0]["memory_used_bytes"] // MIB
    assert "DCGM_FI_DEV_FB_RESERVED" not in m
    assert sum("nvmlDeviceGetMemoryInfo_v2:" in u for u in unavailable) == 8, unavailable    # once per GPU


def _render(snap, settings: ExporterConfig | None = None) -> str:
    exp = Exporter("127.0.0.1:0", settings or ExporterConfig())
    exp.update(snap)
    return exp.render("text/plain")[0].decode()


def test_prometheus_gets_text_with_counter_types_and_openmetrics_only_clients_get_unknown(nvml_emulator, tmp_path):
    _, snap, _, exp, _ = tick_agent(nvml_emulator, tmp_path, ExporterConfig(), ticks=2)
    prometheus_accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                         "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")       # Prometheus 2.x scrape header
    assert not wants_openmetrics(prometheus_accept) and wants_openmetrics("application/openmetrics-text")
    body, ctype = exp.render(prometheus_accept)
    assert ctype.startswith("text/plain; version=0.0.4")
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in body.decode()
    om, octype = exp.render("application/openmetrics-text; version=1.0.0")
    assert octype.startswith("application/openmetrics-text") and om.decode().endswith("# EOF\n")
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION unknown\n" in om.decode()
    assert "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n" in om.decode()


def test_exporter_settings_and_their_one_sentence_errors(nvml_emulator, tmp_path):
    cfg = load_config(None, env={}).exporter
    assert (cfg.dcgm_names, cfg.job_labels, cfg.xid_labels) == ("pre-4.8.3", "info", True)
    p = tmp_path / "a.toml"
    p.write_text('[exporter]\nlisten = "127.0.0.1:9402"\ndcgm_names = "4.10"\njob_labels = "hpc_job"\n'
                 'xid_labels = false\n')
    cfg = load_config(str(p), env={}).exporter
    assert (cfg.dcgm_names, cfg.job_labels, cfg.xid_labels) == ("4.10", "hpc_job", False)
    env = {"GPUAGENT_EXPORTER_DCGM_NAMES": "4.9", "GPUAGENT_EXPORTER_JOB_LABELS": "info",
           "GPUAGENT_EXPORTER_XID_LABELS": "true"}
    cfg = load_config(str(p), env=env).exporter
    assert (cfg.dcgm_names, cfg.job_labels, cfg.xid_labels) == ("4.9", "info", True)
    for body, match in (('dcgm_names = "4.11"', r"exporter\.dcgm_names .* must be one of 'pre-4.8.3', '4.8.3', "
                                                 r"'4.9', '4.10', not '4.11'\."),
                        ('job_labels = "comma"', r"exporter\.job_labels .* must be one of 'info', 'hpc_job'"),
                        ('xid_labels = "maybe"', r"exporter\.xid_labels .* must be true or false")):
        p.write_text(f"[exporter]\n{body}\n")
        with pytest.raises(ConfigError, match=match) as exc:
            load_config(str(p), env={})
        assert "\n" not in str(exc.value)
