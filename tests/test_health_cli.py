"""`gpuagent health` (agent/surface/health.py): exit codes and lines for each hardware-fault class, the health section
of `gpuagent status` and /metrics, node-problem-detector's plugin protocol, and the no-agent path over the
NVML emulator with sysfs and /dev/kmsg fixture trees.

The per-class cases drive the real path: SYNTHETIC readings under the data contract's metric names go into
a real Agent's batcher, its status snapshot (the real dataclasses) gets the health section from
agent/surface/health.py's health_status (what the daemon calls each tick), the snapshot is written as status.json,
and `gpuagent health` reads it back. Expected severities and actions come from common/hardware_faults.toml
through its own loader, not from this file, so a rules change moves the expectation with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from exporter_helpers import parse_exposition
from gpuagent.agent.cli import main
from gpuagent.agent.config import load_config
from gpuagent.agent.daemon import Agent, build_node_info
from gpuagent.agent.surface.exporter import Exporter
from gpuagent.agent.surface.health import check, health_status
from gpuagent.agent.snapshot import STATUS_FILE, GpuStatus, JobStatus, StatusSnapshot, write_status
from gpuagent.agent.surface.status import render
from gpuagent.common.hardware_faults import rules, xid_rule

S = 10**9
WINDOW = 700          # seconds between the baseline and the latest reading


def _rule(name: str):
    return next(r for r in rules().rules if r.name == name)


def healthy_node() -> dict[tuple[str, int, tuple[tuple[str, str], ...]], float]:
    """A SYNTHETIC healthy 2-GPU node with one InfiniBand port and one Ethernet interface."""
    out = {}
    for g in (0, 1):
        for m, v in (("gpu_util_percent", 90), ("gpu_remapped_rows_pending", 0), ("gpu_row_remap_failure", 0),
                     ("gpu_remapped_rows_correctable_total", 0), ("gpu_remapped_rows_uncorrectable_total", 0),
                     ("gpu_retired_pages_pending", 0), ("gpu_ecc_corrected_total", 3), ("gpu_ecc_uncorrected_total", 0),
                     ("gpu_ecc_aggregate_corrected_total", 40), ("gpu_ecc_aggregate_uncorrected_total", 0),
                     ("gpu_pcie_link_gen", 5), ("gpu_pcie_link_gen_max", 5), ("gpu_pcie_link_width", 16),
                     ("gpu_pcie_link_width_max", 16)):
            out[(m, g, ())] = float(v)
        for cause in ("single_bit_ecc", "double_bit_ecc"):
            out[("gpu_retired_pages_total", g, (("cause", cause),))] = 0.0
        for link in ("0", "1"):
            out[("gpu_nvlink_link_up", g, (("link", link),))] = 1.0
            for c in ("crc_flit", "crc_data", "replay", "recovery"):
                out[("gpu_nvlink_errors_total", g, (("counter", c), ("link", link)))] = 0.0
        for r in ("sw_power_cap", "sw_thermal", "hw_thermal", "hw_power_brake", "sync_boost"):
            out[("gpu_clock_event_duration_seconds_total", g, (("reason", r),))] = 10.0
        out[("gpu_clock_event_sampled_seconds_total", g, (("reason", "hw_slowdown"),))] = 10.0
    ib = (("device", "mlx5_0"), ("link_layer", "InfiniBand"), ("port", "1"))
    out[("ib_port_state", -1, ib)] = 4.0
    out[("ib_port_phys_state", -1, ib)] = 5.0
    out[("ib_port_rate_gbps", -1, ib)] = 400.0
    for c in ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors", "port_xmit_discards",
              "local_link_integrity_errors", "excessive_buffer_overrun_errors"):
        out[("ib_port_errors_total", -1, (("counter", c), ("device", "mlx5_0"), ("port", "1")))] = 5.0
    out[("net_carrier_changes_total", -1, (("device", "eth0"),))] = 2.0
    out[("net_link_speed_mbps", -1, (("device", "eth0"),))] = 100000.0
    return out


def write_health_status(tmp_path: Path, after: dict | None = None, before: dict | None = None,
                        events: tuple = (), jobs: tuple = ()) -> tuple[Path, StatusSnapshot]:
    """status.json of a (still 'running': this process's pid) agent whose last tick saw ``after`` over
    the healthy node, WINDOW s after a baseline tick that saw ``before``."""
    state = tmp_path / "state"
    cfg = load_config(None, env={}, state_dir=str(state), collector="127.0.0.1:9")
    agent = Agent(cfg, samplers=[], node_info=build_node_info(cfg, []))
    now = time.time_ns()
    t0 = now - WINDOW * S
    try:
        b = agent.batcher
        for (m, g, lab), v in {**healthy_node(), **(before or {})}.items():
            b.add(m, v, gpu=g, labels=dict(lab), ts_ns=t0)
        # the baseline tick, judged at its own time (a status_snapshot() here would judge it at the real now)
        health_status(b, {g: GpuStatus(index=g) for g in {k[1] for k in healthy_node() if k[1] >= 0}}, [], now_ns=t0)
        for (m, g, lab), v in {**healthy_node(), **(after or {})}.items():
            b.add(m, v, gpu=g, labels=dict(lab), ts_ns=now)
        for kind, gpu, value, attrs, *ago_s in events:      # (..., seconds before now: default 30)
            b.event(kind, f"SYNTHETIC {kind} {value:g}", gpu=gpu, value=value, attrs=attrs,
                    ts_ns=now - int((ago_s[0] if ago_s else 30) * S))
        for i, j in enumerate(jobs):      # job discovery saw these on their GPUs in this tick
            b.job_sample(ts_ns=now, job_id=j.job_id, gpu=-1 if j.gpu is None else j.gpu, pid=40000 + i)
        snap = agent.status_snapshot()    # judges the node's health as the daemon does each tick
    finally:
        agent.shutdown()
    write_status(state, snap)           # after shutdown, which marks the file stopped
    return state, snap


def run_health(state: Path, *args: str) -> tuple[int, list[str]]:
    r = CliRunner().invoke(main, ["health", "--state-dir", str(state), "--source", "agent", *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    return r.exit_code, r.output.strip().splitlines()


def GPU(metric: str, gpu: int, **labels: str) -> tuple:
    return (metric, gpu, tuple(sorted(labels.items())))


def IB(counter: str) -> tuple:
    return ("ib_port_errors_total", -1, (("counter", counter), ("device", "mlx5_0"), ("port", "1")))


IB_STATE = ("ib_port_state", -1, (("device", "mlx5_0"), ("link_layer", "InfiniBand"), ("port", "1")))

# (case, readings after, readings before, events, the rule that must fire (or "xid_<n>"), subject)
CASES = [
    ("xid", {}, {}, (("xid", 1, 79.0, {"xid": "79", "source": "nvml"}),), "xid_79", "GPU 1"),
    ("ecc", {GPU("gpu_ecc_uncorrected_total", 0): 2.0}, {}, (), "ecc_uncorrected", "GPU 0"),
    ("row_remap_pending", {GPU("gpu_remapped_rows_pending", 1): 1.0}, {}, (), "row_remap_pending", "GPU 1"),
    ("row_remap_failure", {GPU("gpu_row_remap_failure", 0): 1.0}, {}, (), "row_remap_failure", "GPU 0"),
    ("retired_pages", {GPU("gpu_retired_pages_pending", 1): 1.0}, {}, (), "retired_pages_pending", "GPU 1"),
    ("nvlink", {GPU("gpu_nvlink_link_up", 0, link="1"): 0.0}, {}, (), "nvlink_down", "GPU 0 NVLink 1"),
    ("pcie_link", {GPU("gpu_pcie_link_gen", 1): 3.0}, {}, (), "pcie_gen_below_max", "GPU 1"),
    ("clocks", {GPU("gpu_clock_event_sampled_seconds_total", 0, reason="hw_slowdown"): 10.0 + 0.5 * WINDOW}, {}, (),
     "clocks_hw_slowdown", "GPU 0"),
    ("ib_port_state", {IB_STATE: 1.0}, {}, (), "ib_port_not_active", "mlx5_0 port 1"),
    ("ib_port_errors", {IB("symbol_error"): 5.0 + 60}, {}, (), "ib_symbol_error", "mlx5_0 port 1"),
    ("eth_link", {("net_carrier_changes_total", -1, (("device", "eth0"),)): 2.0 + 10}, {}, (), "eth_carrier_changes",
     "eth0"),
]


@pytest.mark.parametrize("case,after,before,events,rule,subject", CASES, ids=[c[0] for c in CASES])
def test_each_fault_class_exit_code_and_line(tmp_path, case, after, before, events, rule, subject):
    state, snap = write_health_status(tmp_path, after, before, events)
    if rule.startswith("xid_"):
        x = xid_rule(int(rule[4:]))
        severity, component, action = x.severity, "xid", x.action
    else:
        r = _rule(rule)
        severity, component, action = r.severity, r.component, r.action
    code, lines = run_health(state)
    assert code == {"warning": 1, "critical": 2}[severity], lines
    assert lines[0].startswith(f"HEALTH {severity.upper()}: 1 hardware fault"), lines
    fault_lines = [ln for ln in lines[1:] if ln.startswith(("CRITICAL ", "WARNING "))]
    assert len(fault_lines) == 1, lines          # exactly the injected fault, nothing else on the healthy node
    assert fault_lines[0].startswith(f"{severity.upper()} {component}: {subject}: "), fault_lines
    assert action in fault_lines[0]              # each line carries its action
    # node-problem-detector's codes: NonOK for both severities
    code, npd = run_health(state, "--format", "npd")
    assert code == 1 and len(npd) == 1 and npd[0].startswith(f"{severity.upper()}: {subject}: ")
    # the status section and /metrics say the same
    text = render(snap)
    assert "Health    1 hardware fault" in text and f"{severity.upper()} {component}: {subject}" in text
    exp = Exporter("127.0.0.1:0")
    exp.update(snap)
    m, types = parse_exposition(exp.render("text/plain")[0].decode())
    gpu = snap.health.faults[0].gpu
    assert types["gpuagent_hardware_fault"] == "gauge" and m["gpuagent_hardware_fault"] == [
        ({"component": component, "severity": severity, "subject": subject, "gpu": str(gpu) if gpu >= 0 else ""}, 1.0)]


def test_healthy_node_application_xid_and_counter_reset_are_ok(tmp_path):
    # an application XID (13) on GPU 0 with one job there: the job's error, not the hardware's; and the
    # volatile ECC counter and IB symbol errors went down (driver reload / port reset): never a fault
    app = xid_rule(13)
    assert app.application
    state, snap = write_health_status(
        tmp_path, after={GPU("gpu_ecc_uncorrected_total", 0): 0.0, IB("symbol_error"): 0.0},
        before={GPU("gpu_ecc_uncorrected_total", 0): 7.0},
        events=(("xid", 0, 13.0, {"xid": "13", "source": "nvml"}),),
        jobs=(JobStatus(job_id="SYNTHETIC-job-1", gpu=0),))
    code, lines = run_health(state)
    assert code == 0 and lines[0].startswith("HEALTH OK: no hardware faults on 2 GPUs (NVML), 1 InfiniBand/RoCE port, "
                                             "1 Ethernet interface"), lines
    assert snap.health.events and snap.health.events[0].attrs["job_id"] == "SYNTHETIC-job-1"
    code, npd = run_health(state, "--format", "npd")
    assert (code, npd) == (0, ["OK: no hardware faults"])
    assert "Health    OK: no hardware faults" in render(snap)
    # the same XID on GPU 0 again 20 minutes later (a second burst, the job restarted) may be the GPU's after all
    state2, _ = write_health_status(
        tmp_path / "again", events=(("xid", 0, 13.0, {"xid": "13", "job_id": "SYNTHETIC-job-1"}, 1230),
                                    ("xid", 0, 13.0, {"xid": "13", "job_id": "SYNTHETIC-job-1"}, 30)))
    code, lines = run_health(state2)
    assert code == 1 and "2 times on this GPU within 24 h" in lines[1] and "dcgmi diag" in lines[1], lines


def test_dcgm_names_for_the_health_counters(tmp_path):
    _, snap = write_health_status(tmp_path, after={
        GPU("gpu_nvlink_errors_total", 0, counter="crc_flit", link="0"): 4.0,
        GPU("gpu_nvlink_errors_total", 0, counter="crc_flit", link="1"): 3.0,
        GPU("gpu_retired_pages_total", 1, cause="double_bit_ecc"): 2.0,
        GPU("gpu_clock_event_duration_seconds_total", 0, reason="hw_thermal"): 1.5})
    from gpuagent.agent.config import ExporterConfig
    for generation, names in (("pre-4.8.3", ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_RETIRED_DBE")),
                              ("4.9", ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_TOTAL", "DCGM_FI_DEV_PAGE_RETIRED_DBE_TOTAL"))):
        exp = Exporter("127.0.0.1:0", ExporterConfig(dcgm_names=generation))
        exp.update(snap)
        m, types = parse_exposition(exp.render("text/plain")[0].decode())
        nvl, dbe = names
        assert types[nvl] == "counter" and {s[0]["gpu"]: s[1] for s in m[nvl]} == {"0": 7.0, "1": 0.0}
        assert types[dbe] == "counter" and {s[0]["gpu"]: s[1] for s in m[dbe]}["1"] == 2.0
        assert types["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == "counter"
        assert types["DCGM_FI_DEV_ROW_REMAP_PENDING"] == "gauge"
        ns = {s[0]["gpu"]: s[1] for s in m["DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN_NS"]}
        assert ns == {"0": 1.5e9, "1": 10e9}
        assert not any(n.startswith("DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_SLOWDOWN") for n in types)   # no DCGM field
    # the per-link values stay under gpuagent's names
    assert {tuple(sorted(s[0].items())): s[1] for s in m["gpuagent_gpu_nvlink_errors_total"]}[
        (("UUID", ""), ("counter", "crc_flit"), ("gpu", "0"), ("link", "1"))] == 3.0


def test_malformed_or_old_status_is_one_sentence(tmp_path):
    state, _ = write_health_status(tmp_path)
    good = json.loads((state / STATUS_FILE).read_text())
    for change, words in (({"version": 0}, "has status format 0 and this gpuagent reads format 1"),
                          ({"health": {"checked_ns": "soon"}}, "is damaged: health.checked_ns is 'soon', expected int")):
        (state / STATUS_FILE).write_text(json.dumps({**good, **change}))
        code, lines = run_health(state)
        assert code == 3 and len(lines) == 1 and lines[0].startswith("HEALTH UNKNOWN: ") and words in lines[0], lines
        code, npd = run_health(state, "--format", "npd")
        assert code == 2 and len(npd) == 1 and words in npd[0]
    # an agent from before hardware health: its status file has no health section
    (state / STATUS_FILE).write_text(json.dumps({k: v for k, v in good.items() if k != "health"}))
    code, lines = run_health(state)
    assert code == 3 and "reports no hardware health; restart it after upgrading." in lines[0]
    (state / STATUS_FILE).write_text("{not json")
    code, lines = run_health(state)
    assert code == 3 and len(lines) == 1 and "cannot read" in lines[0]


def test_npd_runs_it_as_a_custom_plugin(tmp_path):
    """As node-problem-detector's custom plugin monitor does (pkg/custompluginmonitor/plugin/plugin.go): run the
    plugin with a timeout (5 s, its default), take stdout trimmed and cut at max_output_length (80 by default),
    and read exit 0 as OK, 1 as NonOK and anything else as Unknown."""
    ok, _ = write_health_status(tmp_path / "ok")
    crit, _ = write_health_status(tmp_path / "crit", after={IB_STATE: 1.0})
    results = {}
    for name, state in (("ok", ok), ("crit", crit), ("unknown", tmp_path / "absent")):
        p = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "health", "--format", "npd", "--source", "agent",
                            "--state-dir", str(state)], capture_output=True, timeout=5, cwd=tmp_path, check=False)
        status = {0: "OK", 1: "NonOK"}.get(p.returncode, "Unknown")
        results[name] = (status, p.stdout.decode().strip()[:80])
    assert results["ok"] == ("OK", "OK: no hardware faults")
    assert results["crit"][0] == "NonOK" and results["crit"][1].startswith("CRITICAL: mlx5_0 port 1: port not ACTIVE")
    assert results["unknown"][0] == "Unknown" and results["unknown"][1].startswith("UNKNOWN: gpuagent is not running")


# ---------------------------------------------------------------------------------- no agent running

def _ib_port(root: Path, dev: str, port: int, state: str, phys: str) -> None:
    """A SYNTHETIC port in Documentation/ABI/stable/sysfs-class-infiniband's format."""
    d = root / "class" / "infiniband" / dev / "ports" / str(port)
    (d / "counters").mkdir(parents=True)
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text(phys + "\n")
    (d / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (d / "link_layer").write_text("InfiniBand\n")
    for c in ("symbol_error", "link_downed", "port_rcv_errors"):
        (d / "counters" / c).write_text("0\n")


def _kmsg_tree(tmp_path: Path, lines: list[str], boot_s_ago: float = 600.0) -> tuple[Path, Path]:
    """A SYNTHETIC /dev/kmsg (records "prio,seq,usec,flags;message") and a proc root whose btime dates them."""
    proc = tmp_path / "proc"
    (proc / "sys" / "kernel" / "random").mkdir(parents=True)
    (proc / "sys" / "kernel" / "random" / "boot_id").write_text("SYNTHETIC-boot\n")
    boot = int(time.time() - boot_s_ago)
    (proc / "stat").write_text(f"cpu  1 0 0 0 0 0 0 0 0 0\nbtime {boot}\n")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join(f"{prio},{seq},{usec},-;{msg}\n" for seq, (prio, usec, msg) in
                            enumerate((4, (i + 1) * 10_000_000, m) for i, m in enumerate(lines))))
    return kmsg, proc


def test_no_agent_reads_nvml_sysfs_and_kernel_log(tmp_path, nvml_emulator):
    from gpuagent.common.nvml import Nvml
    from nvml_emulator_fixture import H100_8GPU
    doc = json.loads(H100_8GPU.read_text())
    doc["events"] = []          # the fixture's own queued XIDs would reach the first event wait; this node has none
    emu = nvml_emulator(doc)
    fixture = doc["gpus"]
    emu.set(3, "remapped_rows.pending", 1)          # a pending row remap: warning
    emu.set(2, "pcie_gen", 3)                       # trained below gen 5 while 97 % busy: warning
    sysfs = tmp_path / "sys"
    _ib_port(sysfs, "mlx5_0", 1, "4: ACTIVE", "5: LinkUp")
    _ib_port(sysfs, "mlx5_1", 1, "1: DOWN", "3: Disabled")       # a port down: critical
    bus = fixture[5]["pci_bus_id"]                                 # e.g. 00000000:9A:00.0
    short = bus.split(":", 1)[1][:5].lower()
    kmsg, proc = _kmsg_tree(tmp_path, [
        "Linux version SYNTHETIC",
        f"NVRM: Xid (PCI:0000:{short}): 79, pid=4242, name=python3, GPU has fallen off the bus.",
    ])
    v = check(str(tmp_path / "no-agent"), source="auto", nvml=Nvml(), sys_root=str(sysfs), kmsg_path=str(kmsg),
              proc_root=str(proc))
    assert v.origin == "local" and v.state == "CRITICAL" and v.exit_code() == 2 and v.exit_code("npd") == 1
    faults = {(f.component, f.subject, f.severity) for f in v.health.faults}
    assert faults == {("row_remap", "GPU 3", "warning"), ("pcie_link", "GPU 2", "warning"),
                      ("ib_port", "mlx5_1 port 1", "critical"), ("xid", "GPU 5", "critical")}, v.lines
    assert "8 GPUs (NVML)" in v.summary and "2 InfiniBand/RoCE ports" in v.summary and "kernel log" in v.summary
    assert v.lines[0].startswith("CRITICAL ") and all(
        f.action in "\n".join(v.lines) for f in v.health.faults)
    assert any(n.startswith("gpuagent is not running") for n in v.lines)    # why it read for itself
    # healthy again: the same command answers OK
    emu.set(3, "remapped_rows.pending", 0)
    emu.set(2, "pcie_gen", 5)
    (sysfs / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "state").write_text("4: ACTIVE\n")
    kmsg.write_text("0,1,10000000,-;Linux version SYNTHETIC\n")
    v = check(str(tmp_path / "no-agent"), source="local", nvml=Nvml(), sys_root=str(sysfs), kmsg_path=str(kmsg),
              proc_root=str(proc))
    assert (v.state, v.exit_code()) == ("OK", 0), v.lines


def test_unknown_when_nothing_can_be_read(tmp_path, nvml_emulator):
    from gpuagent.common.nvml import Nvml
    emu = nvml_emulator()
    emu.fail("nvmlInitWithFlags", "DRIVER_NOT_LOADED")          # what pynvml's nvmlInit calls
    v = check(str(tmp_path / "no-agent"), source="local", nvml=Nvml(), sys_root=str(tmp_path / "empty-sys"),
              kmsg_path=str(tmp_path / "no-kmsg"), proc_root=str(tmp_path / "no-proc"))
    assert v.state == "UNKNOWN" and v.exit_code() == 3 and v.exit_code("npd") == 2
    assert v.summary.startswith("HEALTH UNKNOWN: nothing could be read on this node: GPUs not checked: "
                                "NVML unavailable: nvmlInit failed")
    assert any("kernel log" in n.lower() and "cannot be read" in n for n in v.lines), v.lines


def test_agent_path_over_the_emulator(tmp_path, nvml_emulator):
    """The in-process agent's own GPU sampler over the emulated node: an NVML XID event, a pending remap and
    an NVLink down reach status.json's health section through the batcher, and `gpuagent health` reads it."""
    from gpuagent.agent.samplers.gpu import GpuSampler
    from gpuagent.common.nvml import Nvml
    from nvml_emulator_fixture import H100_8GPU
    doc = json.loads(H100_8GPU.read_text())
    doc["events"] = []
    emu = nvml_emulator(doc)
    state = tmp_path / "state"
    cfg = load_config(None, env={}, state_dir=str(state), collector="127.0.0.1:9")
    samplers = [GpuSampler(nvml=Nvml(), health_every=1)]     # the health reads every tick (Part B default: slower)
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    try:
        emu.advance(1.0)
        agent.tick()
        snap = agent.status_snapshot()
        healthy = health_status(agent.batcher, {g.index: g for g in snap.gpus}, snap.jobs)
        assert healthy.faults == [] and healthy.checked == ["8 GPUs (NVML)"], [f.sentence for f in healthy.faults]
        emu.inject_xid(4, 79)
        emu.set(2, "remapped_rows.pending", 1)
        emu.inject_health(6, nvlink_down=[3])
        emu.advance(1.0)
        agent.tick()
        snap = agent.status_snapshot()
        snap.health = health_status(agent.batcher, {g.index: g for g in snap.gpus}, snap.jobs)
    finally:
        agent.shutdown()
    write_status(state, snap)
    assert snap.gpus[6].nvlink_link_up and snap.gpus[6].nvlink_link_up["3"] == 0.0
    code, lines = run_health(state)
    assert code == 2, lines
    assert lines[1].startswith("CRITICAL xid: GPU 4: XID 79") and xid_rule(79).action in lines[1]
    assert any(ln.startswith("CRITICAL nvlink: GPU 6 NVLink 3: NVLink down") for ln in lines), lines
    assert any(ln.startswith("WARNING row_remap: GPU 2: row remapping pending") for ln in lines), lines
    assert len([ln for ln in lines if ln.startswith(("CRITICAL ", "WARNING "))]) == 3, lines
    code, npd = run_health(state, "--format", "npd")
    assert code == 1 and npd == [npd[0]] and npd[0].startswith("CRITICAL (+2 more): GPU 4: XID 79")
    r = CliRunner().invoke(main, ["health", "--state-dir", str(state), "--format", "json"])
    body = json.loads(r.output)
    assert r.exit_code == 2 and body["state"] == "CRITICAL" and body["origin"] == "agent"
    assert len(body["health"]["faults"]) == 3 and body["lines"] == lines[1:]
