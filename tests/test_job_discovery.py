"""Job discovery with real subprocesses (env and torchrun rules), a fixture procfs for k8s/docker
cgroups, and GPU-mode discovery through the real pynvml over the NVML emulator (SYNTHETIC node)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import BUSY, IDLE, spawn_python, wait_for
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.job_discovery import JobDiscovery, identify
from gpuagent.common.nvml import Nvml
from gpuagent.agent.samplers.sampling import ListSink, now_ns
from nvml_emulator_fixture import H100_8GPU

DATA = Path(__file__).parent / "data"


def _tick_until(jd, sink, pred, what, timeout=20.0):
    def step():
        jd.sample(now_ns(), sink)
        return pred()
    return wait_for(step, timeout=timeout, interval=0.2, what=what)


def test_env_rules_find_real_processes(procs):
    tag = f"{os.getpid()}x{time.monotonic_ns() % 100000}"   # unique: other runs share this machine
    slurm = spawn_python(BUSY, SLURM_JOB_ID=tag, SLURM_JOB_NAME="pretrain", SLURM_PROCID="3", SLURM_LOCALID="1",
                   SLURM_NTASKS="8")
    elastic = spawn_python(IDLE, TORCHELASTIC_RUN_ID=f"run-{tag}", RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    ranked = spawn_python(IDLE, RANK="0", WORLD_SIZE="1")
    plain = spawn_python(IDLE)
    procs.extend([slurm, elastic, ranked, plain])
    jd = JobDiscovery(scan_interval_s=0, end_grace_s=0.5, orphan_grace_s=0)
    sink = ListSink()

    def by_pid():
        return {s["pid"]: s for s in sink.job_samples}
    _tick_until(jd, sink, lambda: {slurm.pid, elastic.pid, ranked.pid} <= set(by_pid()), "3 job processes")
    # a second look gives CPU rates for the busy one
    _tick_until(jd, sink, lambda: by_pid()[slurm.pid]["cpu_percent"] > 20, "slurm rank busy")
    s = by_pid()
    assert plain.pid not in s
    assert (s[slurm.pid]["job_id"], s[slurm.pid]["job_name"], s[slurm.pid]["source"]) == (f"slurm:{tag}", "pretrain", "slurm")
    assert (s[slurm.pid]["rank"], s[slurm.pid]["local_rank"], s[slurm.pid]["world_size"]) == (3, 1, 8)
    assert s[slurm.pid]["rss_bytes"] > 1 << 20 and s[slurm.pid]["gpu"] == -1
    assert (s[elastic.pid]["job_id"], s[elastic.pid]["rank"], s[elastic.pid]["world_size"]) == (f"torchelastic:run-{tag}", 1, 2)
    assert s[ranked.pid]["source"] == "rule" and s[ranked.pid]["job_id"] == f"pid:{ranked.pid}"
    starts = {e.attrs["job_id"] for e in sink.events if e.kind == "job_start"}
    assert {f"slurm:{tag}", f"torchelastic:run-{tag}"} <= starts
    assert {j["job_id"] for j in jd.active_jobs()} >= {f"slurm:{tag}", f"torchelastic:run-{tag}"}
    # the slurm job ends: one job_end with its attrs, the others stay
    slurm.kill()
    slurm.wait(timeout=10)
    def my_ends():
        return [e for e in sink.events if e.kind == "job_end" and tag in e.attrs["job_id"]]
    _tick_until(jd, sink, my_ends, "job_end")
    ends = my_ends()
    assert [e.attrs["job_id"] for e in ends] == [f"slurm:{tag}"]
    # no GPU utilization was ever sampled: the mean is unknown (NaN, stored as NULL), not 0 %
    assert ends[0].attrs["job_name"] == "pretrain" and math.isnan(ends[0].value)
    assert f"torchelastic:run-{tag}" in {j["job_id"] for j in jd.active_jobs()}


def test_short_job_duration_runs_from_its_process_start_to_last_seen(procs):
    """A job that lives ~6 s while the /proc scan runs every 5 s, started just after a scan, so the scan
    finds it about 5 s late: its start is still its process's start, and its duration its wall time
    (to within the gap between two ticks: the end is the last tick that saw it alive)."""
    tag = f"{os.getpid()}d{time.monotonic_ns() % 100000}"
    jd = JobDiscovery(scan_interval_s=5.0, end_grace_s=1.0, orphan_grace_s=0)
    sink = ListSink()
    ticks: list[int] = []

    def tick():
        ticks.append(now_ns())
        jd.sample(ticks[-1], sink)
    tick()   # a scan now, before the job exists: the next one is 5 s away
    exited: list[int] = []
    t_spawn = time.time_ns()
    job = spawn_python("import time\ntime.sleep(6)\n", SLURM_JOB_ID=tag)
    procs.append(job)
    reaper = threading.Thread(target=lambda: (job.wait(), exited.append(time.time_ns())), daemon=True)
    reaper.start()

    def ended():
        tick()
        return [e for e in sink.events if e.kind == "job_end" and e.attrs["job_id"] == f"slurm:{tag}"]
    (end,) = wait_for(ended, timeout=30, interval=0.5, what="the short job's job_end")
    reaper.join(10)
    wall_s = (exited[0] - t_spawn) / 1e9
    duration_s = float(end.attrs["duration_s"])
    max_gap_s = max(b - a for a, b in zip(ticks, ticks[1:])) / 1e9
    print(f"wall {wall_s:.3f} s, duration_s {duration_s:.3f} s, largest tick gap {max_gap_s:.2f} s")
    assert wall_s - max_gap_s - 0.2 <= duration_s <= wall_s + 0.02
    assert 5.5 < duration_s < 6.0 + max_gap_s + 1.0     # and well within one scan interval (5 s) of ~6 s
    started_ns, last_ns = int(end.attrs["started_ns"]), int(end.attrs["last_seen_ns"])
    first_ns = int(end.attrs["first_seen_ns"])
    print(f"start {(started_ns - t_spawn) / 1e6:+.1f} ms "
          f"from spawn, first seen {(first_ns - t_spawn) / 1e9:.2f} s after spawn, last seen "
          f"{(exited[0] - last_ns) / 1e9:.2f} s before exit, largest tick gap {max_gap_s:.2f} s")
    assert first_ns - t_spawn > 3e9                     # the scan did find it late
    assert abs(started_ns - t_spawn) < 1e9              # ... but it starts when its process started
    assert t_spawn - 20e6 <= started_ns <= last_ns <= exited[0]
    assert duration_s == pytest.approx((last_ns - started_ns) / 1e9, abs=1e-3)


def test_torchrun_launcher_and_workers_share_a_job(tmp_path):
    """A real torchrun (gloo-free: the workers only sleep). Other runs on this shared machine may have
    job processes too, so only this launcher's own children are looked at (and cleaned up)."""
    script = tmp_path / "worker.py"
    script.write_text("import time\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    launcher_proc = psutil.Process(p.pid)
    workers_seen: set[int] = set()
    jd = JobDiscovery(scan_interval_s=0)
    sink = ListSink()

    def note_children():
        try:
            workers_seen.update(c.pid for c in launcher_proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def mine():
        note_children()
        return [s for s in sink.job_samples if s["pid"] in workers_seen]

    try:
        _tick_until(jd, sink, lambda: {0, 1} <= {s["rank"] for s in mine()}, "2 torchrun workers", timeout=90)
        workers = mine()
        assert len({s["job_id"] for s in workers}) == 1 and workers[0]["job_id"].startswith("torchelastic:")
        assert {s["world_size"] for s in workers} == {2} and {s["local_rank"] for s in workers} == {0, 1}
        # The launcher (matched by the torchrun cmdline rule, no job env of its own) joins its workers'
        # job instead of appearing as a pid:<launcher> job of its own.
        _tick_until(jd, sink, lambda: [s for s in sink.job_samples if s["pid"] == p.pid], "the launcher's sample")
        launcher = [s for s in sink.job_samples if s["pid"] == p.pid]
        assert {s["job_id"] for s in launcher} == {workers[0]["job_id"]} and launcher[-1]["rank"] == -1
        assert not [e for e in sink.events if e.kind == "job_start" and e.attrs["job_id"] == f"pid:{p.pid}"]
    finally:
        # SIGTERM makes torchrun stop its workers (each runs in its own session); then make sure
        note_children()
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
        for pid in workers_seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_fixture_procfs_k8s_docker_and_rules():
    jd = JobDiscovery(proc_root=str(DATA / "proc_jobs"), scan_interval_s=0)
    sink = ListSink()
    jd.sample(1_000_000_000_000, sink)
    got = {s["pid"]: s for s in sink.job_samples}
    assert set(got) == {100, 200, 400}           # 300: no job env; 500: bash, not python
    pod = got[100]
    assert (pod["job_id"], pod["source"], pod["job_name"]) == ("k8s:7f1e6c52-9a3b-4d8e-b1f0-2c6d8e9a0b14", "kubernetes", "llama-train-worker-1")
    assert pod["attrs"]["container_id"] == "4b9f0c1e2d3a" and (pod["rank"], pod["world_size"]) == (4, 16)
    assert pod["rss_bytes"] == 25600 * os.sysconf("SC_PAGE_SIZE")
    assert (got[200]["job_id"], got[200]["source"]) == ("container:e3b0c44298fc", "container")
    assert got[400]["job_id"] == "torchelastic:none-77"      # run id "none": grouped by the elastic agent (ppid)


def test_identity_from_cgroup_variants():
    cid = "a" * 64
    docker = identify(10, {}, f"0::/system.slice/docker-{cid}.scope\n", 1, True)
    assert (docker["job_id"], docker["attrs"]) == (f"container:{cid[:12]}", {"container_id": cid[:12]})
    k8s = identify(10, {"HOSTNAME": "pod-a"}, f"4:memory:/kubepods/burstable/pod0a1b2c3d-0000-4000-8000-00000000abcd/{cid}\n", 1, False)
    assert (k8s["job_id"], k8s["source"], k8s["job_name"]) == ("k8s:0a1b2c3d-0000-4000-8000-00000000abcd", "kubernetes", "pod-a")
    # the agent's own container is not a job boundary
    own = identify(10, {}, f"0::/docker/{cid}\n", 1, True, own_container=cid[:12])
    assert (own["job_id"], own["source"], own["attrs"]) == ("pid:10", "rule", {})
    assert identify(10, {}, "0::/user.slice\n", 1, False)["source"] == "process"


def _idle_node(make, **kw):
    """The H100 fixture without its own processes (they would be other jobs)."""
    emu = make(H100_8GPU, **kw)
    for pid in {p["pid"] for g in emu.model["gpus"] for p in g.get("processes", ())}:
        emu.remove_process(pid)
    return emu


def test_gpu_mode_uses_nvml_processes_and_reports_mean_util(procs, nvml_emulator):
    worker = spawn_python(IDLE, SLURM_JOB_ID="99", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    procs.append(worker)
    emu = _idle_node(nvml_emulator)
    emu.add_process(0, worker.pid, 40 << 30, sm_util_percent=80)
    emu.add_process(1, worker.pid, 40 << 30, sm_util_percent=60)
    gpu = GpuSampler(Nvml())
    jd = JobDiscovery(gpu_sampler=gpu, end_grace_s=1.0)
    sink = ListSink()
    t = 2_000 * 1_000_000_000
    for k in range(3):
        emu.advance(1)
        jd.sample(t + k * 1_000_000_000, sink)
    rows = [s for s in sink.job_samples if s["ts_ns"] == t + 2 * 1_000_000_000]
    assert sorted((r["gpu"], r["gpu_util_percent"], r["job_id"]) for r in rows) == [(0, 80.0, "slurm:99"), (1, 60.0, "slurm:99")]
    assert all(r["gpu_memory_bytes"] == 40 << 30 for r in rows)
    emu.set_throttle(0, 0)
    emu.remove_process(worker.pid, gpu=1)
    emu.remove_process(worker.pid, gpu=0)
    emu.add_process(0, worker.pid, 40 << 30, sm_util_percent=20)
    emu.advance(1)
    jd.sample(t + 3 * 1_000_000_000, sink)      # one tick at 20 % on GPU 0 only
    emu.remove_process(worker.pid)
    emu.advance(1)
    jd.sample(t + 5 * 1_000_000_000, sink)
    end = [e for e in sink.events if e.kind == "job_end"]
    assert len(end) == 1 and end[0].attrs["job_id"] == "slurm:99" and end[0].attrs["gpus"] == "0,1"
    # ticks: 3 x mean(80, 60) = 70, then 1 x 20  -> (3*70 + 20) / 4
    assert end[0].value == pytest.approx((3 * 70 + 20) / 4)
    assert end[0].attrs["gpu_util_samples"] == "4"
    assert jd.active_jobs() == []


def test_mig_process_without_per_process_util(procs, nvml_emulator):
    """GPU 5 of the fixture runs in MIG mode (GPU instances 1 and 2), where NVML has no per-process
    utilization. Privileged: on the parent handle of a MIG GPU, nvmlDeviceGetComputeRunningProcesses
    answers NO_PERMISSION to an unprivileged caller (nvml.h), as the emulator models."""
    worker = spawn_python(IDLE, TORCHELASTIC_RUN_ID="mig-run", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    procs.append(worker)
    emu = _idle_node(nvml_emulator, privileged=True)
    emu.add_process(5, worker.pid, 9 << 30, gpu_instance=2, sm_util_percent=55)
    jd = JobDiscovery(gpu_sampler=GpuSampler(Nvml()), end_grace_s=1.0)
    sink = ListSink()
    t = 3_000 * 1_000_000_000
    for k in range(2):
        emu.advance(1)
        jd.sample(t + k * 1_000_000_000, sink)
    row = sink.job_samples[-1]
    assert (row["job_id"], row["gpu"], row["gpu_memory_bytes"]) == ("torchelastic:mig-run", 5, 9 << 30)
    assert row["gpu_util_percent"] == 0.0 and row["attrs"]["gpu_util_known"] == "false"
    assert row["attrs"]["mig_gpu_instance"] == "2"
    emu.remove_process(worker.pid)
    jd.sample(t + 3 * 1_000_000_000, sink)
    end = [e for e in sink.events if e.kind == "job_end"]
    assert len(end) == 1 and math.isnan(end[0].value) and end[0].attrs["gpu_util_samples"] == "0"


def test_gpu_process_that_matches_no_rule_is_still_a_job(procs, nvml_emulator):
    """The /proc scan runs on GPU nodes too; a process it saw first as "not a job" must still count
    once NVML lists it on a GPU."""
    plain = spawn_python(IDLE)
    procs.append(plain)
    emu = _idle_node(nvml_emulator)
    jd = JobDiscovery(gpu_sampler=GpuSampler(Nvml()), scan_interval_s=0)
    sink = ListSink()
    t = 4_000 * 1_000_000_000
    jd.sample(t, sink)                               # the scan sees it, no rule matches
    assert plain.pid not in {s["pid"] for s in sink.job_samples}
    emu.add_process(2, plain.pid, 1 << 30, sm_util_percent=70)
    emu.advance(1)
    jd.sample(t + 1_000_000_000, sink)
    rows = [s for s in sink.job_samples if s["pid"] == plain.pid]
    assert rows and (rows[-1]["job_id"], rows[-1]["source"], rows[-1]["gpu"]) == (f"pid:{plain.pid}", "process", 2)


def test_bad_rule_is_one_clear_sentence():
    from gpuagent.agent.samplers.job_discovery import JobRules
    with pytest.raises(ValueError, match=r"job rule cmdline_regex 'torchrun\(' is not a valid regular expression"):
        JobRules(cmdline_regex=("torchrun(",))
