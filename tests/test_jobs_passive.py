"""Passive job sampling gaps closed for issue 6: a GPU job's non-GPU processes (launcher, data-loader
workers) and processes that only announce themselves through the step tracker."""

from __future__ import annotations

import os
import subprocess
import sys

from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.job_discovery import JobDiscovery
from gpuagent.common.nvml import Nvml
from nvml_emulator_fixture import H100_8GPU
from gpuagent.agent.samplers.sampling import ListSink, now_ns
from tests.conftest import BUSY, IDLE, spawn_python, wait_for



def test_gpu_job_includes_its_data_loader_process(procs, nvml_emulator):
    trainer = spawn_python(IDLE, SLURM_JOB_ID="5150", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    loader = spawn_python(BUSY, SLURM_JOB_ID="5150", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")   # no GPU
    stranger = spawn_python(IDLE, SLURM_JOB_ID="6000", RANK="0")          # another job, not on any GPU
    procs.extend([trainer, loader, stranger])
    emu = nvml_emulator(H100_8GPU)
    for pid in {p["pid"] for g in emu.model["gpus"] for p in g.get("processes", ())}:
        emu.remove_process(pid)           # the fixture's processes would be other jobs: only the trainer
    emu.add_process(3, trainer.pid, 20 << 30, sm_util_percent=90)
    jd = JobDiscovery(gpu_sampler=GpuSampler(Nvml()), scan_interval_s=0, end_grace_s=30)
    sink = ListSink()

    def loader_sampled_with_cpu():
        emu.advance(1)
        jd.sample(now_ns(), sink)
        return [r for r in sink.job_samples if r["pid"] == loader.pid and r["cpu_percent"] > 0]

    rows = wait_for(loader_sampled_with_cpu, timeout=20, interval=0.2, what="the loader's CPU sample")
    assert rows[-1]["job_id"] == "slurm:5150" and rows[-1]["gpu"] == -1
    assert rows[-1]["rss_bytes"] > 0
    trainer_rows = [r for r in sink.job_samples if r["pid"] == trainer.pid]
    assert trainer_rows and all(r["gpu"] == 3 and r["gpu_util_percent"] == 90.0 for r in trainer_rows)
    # A rule-matched process of a job that holds no GPU is not a GPU job on a GPU node.
    assert not [r for r in sink.job_samples if r["pid"] == stranger.pid]


def test_tracked_process_is_a_job_under_the_receivers_id(procs):
    plain = spawn_python(IDLE)                  # no launcher env, no rule matches it
    procs.append(plain)
    jd = JobDiscovery(scan_interval_s=0, end_grace_s=30)
    sink = ListSink()
    jd.sample(now_ns(), sink)
    assert not [r for r in sink.job_samples if r["pid"] == plain.pid]
    jd.tracked_pids = lambda: {plain.pid: "torchelastic:set-at-runtime"}
    jd.sample(now_ns(), sink)
    (row,) = [r for r in sink.job_samples if r["pid"] == plain.pid]
    assert (row["job_id"], row["source"]) == ("torchelastic:set-at-runtime", "tracker")


FORK_THEN_EXEC = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(1.0)      # seen in this window, the child still looks like its (job-less) parent
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", GPUAGENT_JOB_ID=sys.argv[1])
    os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(120)"], env)
print(pid, flush=True)
time.sleep(120)
"""


def test_process_seen_before_its_exec_is_identified_after_it(procs):
    import time as _time
    tag = f"forkexec-{os.getpid()}-{_time.monotonic_ns() % 100000}"
    parent = subprocess.Popen([sys.executable, "-c", FORK_THEN_EXEC, tag], stdout=subprocess.PIPE, text=True)
    procs.append(parent)
    child = int(parent.stdout.readline())
    jd = JobDiscovery(scan_interval_s=0, end_grace_s=30)
    sink = ListSink()
    try:
        jd.sample(now_ns(), sink)                 # the child is in its pre-exec second now
        assert jd.is_job_process(child) is False
        rows = wait_for(lambda: (jd.sample(now_ns(), sink),
                                 [r for r in sink.job_samples if r["pid"] == child])[1],
                        timeout=20, interval=0.2, what="the exec'd child as a job process")
        assert rows[-1]["job_id"] == tag and rows[-1]["rank"] == 0
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
