"""A peer NVML client on the same GPUs: nvitop 1.7.2 (over the same real pynvml) and a real agent
subprocess (`python -m gpuagent.agent.cli run`, then `gpuagent status --json`, and its exporter's /metrics
under dcgm-exporter's default names) read one emulated node (SYNTHETIC 8x H100,
tests/data/nvml_8gpu_h100_sxm.json) at the same moment: the clock is frozen, so every value is stable
while both read. They must agree.

Which nvitop call corresponds to which agent field (both end in the same NVML symbol):
  Device.memory_used() / memory_total()      nvmlDeviceGetMemoryInfo_v2 .used / .total   memory_used_bytes / memory_total_bytes
  Device.gpu_utilization() / memory_utilization()  nvmlDeviceGetUtilizationRates  util_percent / mem_util_percent
  Device.power_usage() (mW)                  nvmlDeviceGetPowerUsage                     power_watts (x 1000)
  Device.temperature()                       nvmlDeviceGetTemperatureV (GPU sensor)      temperature_celsius
  Device.sm_clock() / memory_clock()         nvmlDeviceGetClockInfo(SM / MEM)            sm_clock_mhz / mem_clock_mhz
  Device.processes() pids, .gpu_memory()     nvmlDeviceGetComputeRunningProcesses_v3     jobs[].pid on jobs[].gpu; the
                                             status has no per-process memory, so that is compared with the
                                             agent's GpuSampler.processes() gpu_memory_bytes on the same node.
Memory is v2 on both sides (used excludes the driver's reservation), so like is compared with like.
/metrics (dcgm-exporter's pre-4.9 names, the agent's default): DCGM_FI_DEV_FB_USED / FB_FREE in whole MiB
(bytes // 2^20, as DCGM stores them), GPU_TEMP, POWER_USAGE in W, SM_CLOCK / MEM_CLOCK in MHz, GPU_UTIL /
MEM_COPY_UTIL in %; the MIG GPU's framebuffer per GPU instance (GPU_I_ID), compared with nvitop's MIG devices.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent_helpers import ROOT, agent_env, free_port, read_status, stop
from conftest import wait_for
from exporter_helpers import MIB, parse_exposition, per_gpu, per_instance, scrape
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.common.nvml import Nvml
from nvml_emulator_fixture import H100_8GPU

nvitop = pytest.importorskip("nvitop", reason="nvitop is in the test extra (pip install -e '.[test]')")
MIG_GPU = 5    # MIG on, unprivileged: utilization answers NO_PERMISSION to both clients


def test_nvitop_and_the_agent_agree_on_the_same_emulated_gpus(tmp_path, nvml_emulator, procs):
    emu = nvml_emulator(H100_8GPU)                     # frozen clock; this process (nvitop) points at it
    for pid in {p["pid"] for g in emu.model["gpus"] for p in g.get("processes", ())}:
        emu.remove_process(pid)                        # the fixture's pids are not processes on this machine
    sleepers = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
    procs.extend(sleepers)                             # killed by the fixture however the test ends
    placed = {sleepers[0].pid: (0, 3 << 30), sleepers[1].pid: (2, 5 << 30), sleepers[2].pid: (7, 7 << 30)}
    for pid, (gpu, used) in placed.items():
        emu.add_process(gpu, pid, used)
    state = tmp_path / "state"
    port = free_port()
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[probes]\nenabled = false\n[exporter]\nlisten = "127.0.0.1:{port}"\n')
    env = emu.env(base=agent_env(tmp_path, GPUAGENT_CONFIG=str(cfg)))
    log = open(tmp_path / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "run", "--collector", "127.0.0.1:9",
                              "--state-dir", str(state), "--interval", "0.5", "--batch-interval", "0.5"],
                             stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        def jobs_seen():
            if agent.poll() is not None:
                pytest.fail(f"agent exited: {(tmp_path / 'agent.log').read_text()[-2000:]}")
            st = read_status(state)
            return st if st and st.get("pid") == agent.pid and len(st.get("gpus", [])) == 8 and \
                {j.get("pid") for j in st.get("jobs", [])} >= set(placed) else None

        wait_for(jobs_seen, timeout=60, interval=0.25, what="the agent's status with the three GPU processes")
        out = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--json", "--state-dir",
                              str(state)], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        # the exporter serves the latest tick; the frozen clock keeps every GPU value the same across ticks
        metrics, _ = parse_exposition(scrape(port))
        assert emu.calls(pid=agent.pid)["nvmlDeviceGetMemoryInfo_v2"] > 0     # the agent ran on the emulator
    finally:
        stop(agent, timeout=30)
        log.close()

    compared = 0
    for g in status["gpus"]:
        i = g["index"]
        d = nvitop.Device(i)
        assert g["memory_total_bytes"] == d.memory_total()
        assert g["memory_used_bytes"] == d.memory_used()
        assert g["power_watts"] * 1000 == pytest.approx(d.power_usage())
        assert g["temperature_celsius"] == d.temperature()
        assert g["sm_clock_mhz"] == d.sm_clock() and g["mem_clock_mhz"] == d.memory_clock()
        if i == MIG_GPU:
            assert d.gpu_utilization() == nvitop.NA and "util_percent" not in g
        else:
            assert (g["util_percent"], g["mem_util_percent"]) == (d.gpu_utilization(), d.memory_utilization())
        # the same values under dcgm-exporter's names and units
        def dcgm(name, i=i):
            return per_gpu(metrics, name).get(i)
        assert dcgm("DCGM_FI_DEV_GPU_TEMP") == d.temperature()
        assert dcgm("DCGM_FI_DEV_POWER_USAGE") == pytest.approx(d.power_usage() / 1000)
        assert (dcgm("DCGM_FI_DEV_SM_CLOCK"), dcgm("DCGM_FI_DEV_MEM_CLOCK")) == (d.sm_clock(), d.memory_clock())
        if i == MIG_GPU:       # dcgm-exporter's way: the framebuffer per GPU instance, no GPU-level series
            assert dcgm("DCGM_FI_DEV_FB_USED") is None and dcgm("DCGM_FI_DEV_GPU_UTIL") is None
            migs = {m.gpu_instance_id(): m for m in d.mig_devices()}
            assert len(migs) == 2
            for name, of in (("DCGM_FI_DEV_FB_USED", "memory_used"), ("DCGM_FI_DEV_FB_FREE", "memory_free")):
                got = {gi: v for (gpu, gi), v in per_instance(metrics, name).items() if gpu == i}
                assert got == {gi: getattr(m, of)() // MIB for gi, m in migs.items()}, name
        else:
            assert dcgm("DCGM_FI_DEV_FB_USED") == d.memory_used() // MIB
            assert dcgm("DCGM_FI_DEV_FB_FREE") == d.memory_free() // MIB
            assert (dcgm("DCGM_FI_DEV_GPU_UTIL"), dcgm("DCGM_FI_DEV_MEM_COPY_UTIL")) == \
                (d.gpu_utilization(), d.memory_utilization())
        compared += 1
    assert compared == 8

    # processes: the same pids on the same GPUs
    agent_pids = {(j["pid"], j["gpu"]) for j in status["jobs"] if j.get("pid") in placed}
    peer = {}
    for i in range(8):
        for pid, p in nvitop.Device(i).processes().items():
            peer[(pid, i)] = p.gpu_memory()
    assert agent_pids == {(pid, gpu) for pid, (gpu, _) in placed.items()} == set(peer)
    sampler = GpuSampler(Nvml())
    try:
        mine = {(p["pid"], p["gpu"]): p["gpu_memory_bytes"] for p in sampler.processes()}
    finally:
        sampler.close()
    assert mine == {k: float(v) for k, v in peer.items()} == {(pid, gpu): float(u) for pid, (gpu, u) in placed.items()}
