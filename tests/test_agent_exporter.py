"""The agent's Prometheus /metrics ([exporter] listen): dcgm-exporter names and units against the NVML
emulator's values (the real pynvml over gpuagent.sim.nvml_emulator; SYNTHETIC H100 node from tests/data),
a real agent subprocess scraped over HTTP and checked by `promtool check metrics`, values equal to
`gpuagent status --json` for the same tick, and ticks that stay regular while /metrics is hammered."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tools import need
from agent_helpers import ROOT, agent_env, free_port, stop, wait_running
from conftest import wait_for
from exporter_helpers import DCGM_NAME_LINTS, not_dcgm_lints, parse_exposition, per_gpu
from exporter_helpers import ticks as run_ticks
from nvml_emulator_fixture import H100_8GPU, nvml_emulator  # noqa: F401  (the fixture)

from gpuagent.agent.config import ConfigError, load_config
from gpuagent.agent.daemon import Agent, build_node_info
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.host import HostSampler
from gpuagent.common.nvml import Nvml

MIB = 2 ** 20


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return parse_exposition(text)[0]


_per_gpu = per_gpu     # the per-GPU series (a MIG GPU's per-instance ones: tests/test_exporter_dcgm_compat.py)


def _one(samples, name: str) -> float:
    (only,) = samples[name]
    return only[1]


def _start_agent(make_emulator, tmp_path, port: int, interval: float = 1.0) -> tuple[subprocess.Popen, object]:
    """`gpuagent run` (real pynvml) over a fresh emulated 8 x H100 node on the real clock."""
    emu = make_emulator(H100_8GPU, clock="real", privileged=True, activate=False)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[probes]\nenabled = false\n[exporter]\nlisten = "127.0.0.1:{port}"\n')
    state = tmp_path / "state"
    log = open(tmp_path / "agent.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "run",
                             "--collector", f"127.0.0.1:{free_port()}", "--state-dir", str(state),
                             "--interval", str(interval), "--batch-interval", "1"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=emu.env(agent_env(tmp_path, GPUAGENT_CONFIG=str(cfg))))
    return proc, state


# ------------------------------------------------------------------ units against the emulator's values

def test_dcgm_names_carry_nvml_values_in_dcgm_units(nvml_emulator, tmp_path):
    import pynvml
    emu = nvml_emulator(H100_8GPU, privileged=True)
    doc = json.loads(H100_8GPU.read_text())
    cfg = load_config(None, env={}, state_dir=str(tmp_path / "state"), collector="127.0.0.1:9")
    gpu = GpuSampler(nvml=Nvml())
    samplers = [HostSampler(), gpu]
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    from gpuagent.agent.surface.exporter import Exporter
    exp = Exporter("127.0.0.1:0").start()
    agent.exporter = exp
    try:
        emu.inject_xid(1, 13)
        run_ticks(agent, emu, 3)
        m = _samples(_scrape(exp.port))
        # the real binding, straight to the emulator (its frozen clock stood still since the last tick)
        energy_now = {i: pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(i))
                      for i in range(8)}
    finally:
        exp.stop()
        agent.shutdown()
    f = {g["index"]: g for g in doc["gpus"]}
    unsupported_util = {i for i, g in f.items() if "nvmlDeviceGetUtilizationRates" in g["not_supported"]}
    # Whole MiB of NVML's nvmlMemory_v2 figures, as DCGM stores them: "used" without the driver's reservation
    # (NVML's v1 "used" includes it); a MIG GPU's framebuffer is per GPU instance only.
    mig = {i for i, g in f.items() if g["mig_mode"] and g["mig_mode"][0] == 1}
    reserved = {i: min(g["memory_reserved_bytes"], g["memory_used_bytes"]) for i, g in f.items()}
    assert _per_gpu(m, "DCGM_FI_DEV_FB_USED") == {
        i: (g["memory_used_bytes"] - reserved[i]) // MIB for i, g in f.items() if i not in mig}
    assert _per_gpu(m, "DCGM_FI_DEV_FB_FREE") == {
        i: (g["memory_total_bytes"] - g["memory_used_bytes"]) // MIB for i, g in f.items() if i not in mig}
    assert _per_gpu(m, "DCGM_FI_DEV_FB_RESERVED") == {i: reserved[i] // MIB for i in f if i not in mig}
    assert _per_gpu(m, "DCGM_FI_DEV_POWER_USAGE") == {i: g["power_mw"] / 1000 for i, g in f.items()}
    # mJ exactly as nvmlDeviceGetTotalEnergyConsumption answers
    assert _per_gpu(m, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION") == energy_now
    assert _per_gpu(m, "DCGM_FI_DEV_GPU_TEMP") == {i: g["temperature_c"] for i, g in f.items()}
    assert _per_gpu(m, "DCGM_FI_DEV_SM_CLOCK") == {i: g["sm_clock_mhz"] for i, g in f.items()}
    assert _per_gpu(m, "DCGM_FI_DEV_MEM_CLOCK") == {i: g["mem_clock_mhz"] for i, g in f.items()}
    assert _per_gpu(m, "DCGM_FI_DEV_GPU_UTIL") == {
        i: g["util_gpu_percent"] for i, g in f.items() if i not in unsupported_util}
    assert _per_gpu(m, "DCGM_FI_DEV_MEM_COPY_UTIL") == {
        i: g["util_mem_percent"] for i, g in f.items() if i not in unsupported_util}
    assert _per_gpu(m, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER") == {i: g["pcie_replay_count"] for i, g in f.items()}
    # the last XID per GPU: the fixture's recorded events, then the one injected here; 0 for the others
    xids = {e["gpu"]: e["xid"] for e in doc["events"] if e.get("kind") == "xid"} | {1: 13}
    assert _per_gpu(m, "DCGM_FI_DEV_XID_ERRORS") == {i: xids.get(i, 0) for i in f}
    # NVLink rates (the sampler's, over real time) only for GPUs that have links
    assert set(_per_gpu(m, "DCGM_FI_PROF_NVLINK_TX_BYTES")) == {i for i, g in f.items() if g["nvlink_links"]}
    # PROF activity ratios: GPM's percentages / 100, only where GPM answered (not GPU 5, a MIG GPU whose
    # values are per GPU instance), never filled in from the utilization counters
    for name, key in (("DCGM_FI_PROF_SM_ACTIVE", "sm_active"), ("DCGM_FI_PROF_SM_OCCUPANCY", "sm_occupancy"),
                      ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor_active"), ("DCGM_FI_PROF_DRAM_ACTIVE", "dram_active")):
        want = {i: g["gpm"][key] / 100 for i, g in f.items() if "gpm" in g}
        assert 5 not in want and len(want) == 7
        assert _per_gpu(m, name) == pytest.approx(want, rel=1e-12), name
    labels = {lab["gpu"]: lab for lab, _ in m["DCGM_FI_DEV_FB_USED"]}
    assert labels["0"]["UUID"] == f[0]["uuid"] and labels["0"]["pci_bus_id"] == f[0]["pci_bus_id"]
    assert labels["0"]["device"] == "nvidia0" and labels["0"]["modelName"] == f[0]["name"]
    assert labels["0"]["DCGM_FI_DRIVER_VERSION"] == doc["driver_version"]
    # no job label on GPU series by default (jobs: gpuagent_gpu_job_info)
    assert set(labels["0"]) == {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"}


# ------------------------------------------------------------------ a real agent, scraped over HTTP

def _same_tick(port: int, state) -> tuple[dict, dict]:
    """A scrape and `gpuagent status --json` of one tick (retried until their tick counts agree)."""
    def attempt():
        m = _samples(_scrape(port))
        out = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--json", "--state-dir",
                              str(state)], capture_output=True, text=True, cwd=ROOT, timeout=30)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        return (m, st) if _one(m, "gpuagent_agent_ticks_total") == st["counters"]["ticks"] else None
    return wait_for(attempt, timeout=30, interval=0.01, what="a scrape and a status of the same tick")


def test_real_agent_metrics_match_status_and_pass_promtool(nvml_emulator, tmp_path):
    port = free_port()
    proc, state = _start_agent(nvml_emulator, tmp_path, port)
    try:
        wait_for(lambda: (read := wait_running(state, proc)) and read["counters"]["ticks"] >= 3, timeout=30,
                 what="3 ticks")
        m, st = _same_tick(port, state)
        text = _scrape(port)
    finally:
        assert stop(proc) == 0
    gpus = {g["index"]: g for g in st["gpus"]}
    assert len(gpus) == 8
    checks = [("DCGM_FI_DEV_GPU_UTIL", "util_percent", 1), ("DCGM_FI_DEV_FB_RESERVED", "memory_reserved_bytes", MIB),
              ("DCGM_FI_DEV_POWER_USAGE", "power_watts", 1), ("DCGM_FI_DEV_GPU_TEMP", "temperature_celsius", 1),
              ("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", 1), ("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz", 1),
              ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_consumed_mj", 1),
              ("DCGM_FI_DEV_MEMORY_TEMP", "memory_temperature_celsius", 1),
              ("DCGM_FI_PROF_NVLINK_RX_BYTES", "nvlink_raw_rx_bytes_per_s", 1)]
    for name, field, div in checks:
        # whole MiB as DCGM stores them; the framebuffer of a MIG GPU is per GPU instance only
        want = {i: (g[field] // div if div != 1 else g[field]) for i, g in gpus.items()
                if field in g and not (div != 1 and g.get("instances"))}
        assert want, f"status has no {field}"
        assert _per_gpu(m, name) == pytest.approx(want, rel=1e-12), name
    h = st["host"]
    assert _one(m, "gpuagent_host_cpu_busy_ratio") == pytest.approx(h["cpu_busy_percent"] / 100)
    assert _one(m, "gpuagent_host_cpu_steal_ratio") == pytest.approx(h["cpu_steal_percent"] / 100)
    assert _one(m, "gpuagent_host_load1") == h["load1"]
    assert _one(m, "gpuagent_host_memory_used_bytes") == h["mem_used_bytes"]
    assert _one(m, "gpuagent_host_memory_total_bytes") == h["mem_total_bytes"]
    for dev, vals in (h.get("disks") or {}).items():
        got = {lab["device"]: v for lab, v in m["gpuagent_host_disk_written_bytes_per_second"]}
        assert got[dev] == vals["disk_write_bytes_per_s"]
    assert _one(m, "gpuagent_spool_backlog_bytes") == st["spool"]["backlog_bytes"]
    assert _one(m, "gpuagent_collector_connected") == 0    # nothing listens at the collector address
    assert _one(m, "gpuagent_agent_last_tick_timestamp_seconds") == pytest.approx(st["updated_ns"] / 1e9)

    need("promtool")
    promtool = shutil.which("promtool")
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    # Only the lints dcgm-exporter's own names cause (exporter_helpers.DCGM_NAME_LINTS)
    assert not_dcgm_lints(problems) == [], problems
    assert len(DCGM_NAME_LINTS) == 4     # a new exception is a decision, not a side effect
    assert not any(p.startswith("gpuagent_") for p in problems)


def test_scrapes_do_not_disturb_the_tick_loop(nvml_emulator, tmp_path):
    port = free_port()
    interval = 0.25
    proc, state = _start_agent(nvml_emulator, tmp_path, port, interval=interval)
    try:
        wait_running(state, proc)
        before = _samples(_scrape(port))
        t0 = time.monotonic()
        stop_at = t0 + 5.0
        scrapes = [0]

        def hammer():
            while time.monotonic() < stop_at:
                _scrape(port)
                scrapes[0] += 1

        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        after = _samples(_scrape(port))
    finally:
        assert stop(proc) == 0
    ticks = _one(after, "gpuagent_agent_ticks_total") - _one(before, "gpuagent_agent_ticks_total")
    skipped = _one(after, "gpuagent_agent_skipped_ticks_total") - _one(before, "gpuagent_agent_skipped_ticks_total")
    assert scrapes[0] >= 50, f"only {scrapes[0]} scrapes: the hammer did not hammer"
    assert skipped == 0
    assert ticks >= 0.9 * elapsed / interval - 1, (ticks, elapsed)


def test_a_tick_is_formatted_once_and_served_as_text_or_openmetrics(tmp_path):
    import dataclasses

    from gpuagent.agent.surface.exporter import Exporter
    cfg = load_config(None, env={}, state_dir=str(tmp_path / "state"), collector="127.0.0.1:9")
    samplers = [HostSampler()]
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    exp = Exporter("127.0.0.1:0").start()
    try:
        agent.tick()
        snap = agent.status_snapshot()
        exp.update(snap)
        first = _scrape(exp.port)
        t_end = time.process_time() + 0.05
        while time.process_time() < t_end:     # burn CPU: a fresh rendering would show it in process_cpu
            pass
        assert _scrape(exp.port) == first       # the same tick: the same bytes
        exp.update(dataclasses.replace(snap, counters=dataclasses.replace(snap.counters, ticks=snap.counters.ticks + 1)))
        second = _scrape(exp.port)
        assert second != first and _one(_samples(second), "gpuagent_agent_ticks_total") == snap.counters.ticks + 1
        req = urllib.request.Request(f"http://127.0.0.1:{exp.port}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(req, timeout=5) as r:
            body, ctype = r.read().decode(), r.headers["Content-Type"]
        assert ctype.startswith("application/openmetrics-text") and body.endswith("# EOF\n")
    finally:
        exp.stop()
        agent.shutdown()


# ------------------------------------------------------------------ configuration

def test_exporter_listen_config(tmp_path):
    assert load_config(None, env={}).exporter.listen == ""        # off by default
    p = tmp_path / "a.toml"
    p.write_text('[exporter]\nlisten = "0.0.0.0:9402"\n')
    assert load_config(str(p), env={}).exporter.listen == "0.0.0.0:9402"
    p.write_text('[exporter]\nlisten = "9402"\n')
    with pytest.raises(ConfigError, match=r"exporter.listen .* must be HOST:PORT"):
        load_config(str(p), env={})
    p.write_text('[exporter]\nport = 9402\n')
    with pytest.raises(ConfigError, match="unknown key exporter.port"):
        load_config(str(p), env={})


def test_a_taken_port_leaves_the_agent_running(nvml_emulator, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc, state = _start_agent(nvml_emulator, tmp_path, port)
        try:
            def listed():
                x = wait_running(state, proc)
                return x if any("exporter" in u for u in x["unavailable"]) else None
            st = wait_for(listed, timeout=15, what="the exporter listed as unavailable")
        finally:
            assert stop(proc) == 0
    (msg,) = [u for u in st["unavailable"] if "exporter" in u]
    assert f"cannot listen on 127.0.0.1:{port}" in msg
