"""Issue 6, "a slowed job is noticed": the same real DDP job (gloo, CPU, torchrun) run normally and with
a slowed data loader, on a node whose GPUs come from the NVML emulator under the real pynvml (GPU
utilization here is SYNTHETIC: the emulated node reports 30 % for every GPU and for every job process
this test places on a GPU). The real agent (in-process: the real Agent class, the real binding behind
its NVML seam) and the real collector (loopback gRPC, DuckDB in tmp_path) run their real analyzer: the slowed
job's GPUs get an input-bound utilization_gap from its measured data-wait fraction; the normal job's
do not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tools import python_module_or_skip
python_module_or_skip("torch")

import psutil  # noqa: E402

from gpuagent.collector.analysis import analyzer  # noqa: E402
from gpuagent.collector.views import client
from gpuagent.collector import service as server
from gpuagent.agent.config import AgentConfig, CollectorConfig, JobsConfig  # noqa: E402
from gpuagent.agent.daemon import Agent, build_node_info  # noqa: E402
from gpuagent.agent.samplers.gpu import GpuSampler  # noqa: E402
from gpuagent.agent.samplers.host import HostSampler  # noqa: E402
from gpuagent.agent.samplers.job_discovery import JobDiscovery  # noqa: E402
from gpuagent.common.nvml import Nvml  # noqa: E402
from agent_helpers import kill_tree  # noqa: E402
from nvml_emulator_fixture import H100_8GPU  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
STEPS = 50
SYNTHETIC_GPU_UTIL = 30


def test_slowed_loader_raises_input_bound_utilization_gap(tmp_path, nvml_emulator):
    col = server.start_collector(tmp_path / "collector.duckdb", "127.0.0.1:0",
                                 analyzer_config=analyzer.AnalyzerConfig(min_minutes=1), analyze=False)
    emu = nvml_emulator(H100_8GPU, clock="real")    # the agent ticks in real time: process samples must move
    for pid in {p["pid"] for g in emu.model["gpus"] for p in g.get("processes", ())}:
        emu.remove_process(pid)
    for i in range(len(emu.model["gpus"])):
        emu.set(i, "util_gpu_percent", SYNTHETIC_GPU_UTIL)
    gpu = GpuSampler(Nvml())
    samplers = [HostSampler(), gpu, JobDiscovery(gpu_sampler=gpu, scan_interval_s=0.25, end_grace_s=2)]
    sock = str(tmp_path / "jobs.sock")
    cfg = AgentConfig(collector=CollectorConfig(address=col.address), interval_s=0.25, batch_interval_s=0.5,
                      state_dir=str(tmp_path / "state"),
                      jobs=JobsConfig(step_socket=sock, step_window_s=60.0))     # the default resolution
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    runner = threading.Thread(target=agent.run, name="agent", daemon=True)
    runner.start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        wait_for(lambda: agent.job_steps is not None and agent.ticks >= 1, timeout=30, what="the agent running")
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                            "GPUAGENT_JOB_ID", "MASTER_ADDR", "MASTER_PORT")}
        env.update(GPUAGENT_JOBS_SOCKET=sock, OMP_NUM_THREADS="1")
        first_gpu = {"normal": 0, "slowed": 2}
        for name, extra in (("normal", []), ("slowed", ["--data-sleep-ms", "50"])):
            (tmp_path / name).mkdir()
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(ROOT / "examples" / "train_ddp.py"), "--steps", str(STEPS), "--name", name,
                 "--results-dir", str(tmp_path / name), *extra],
                env=env, cwd=ROOT, stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                start_new_session=True)
        placed: set[int] = set()
        gone: set[int] = set()

        def place_workers_and_check_done():
            # A worker that exited leaves NVML's process list (left in the emulator, the agent would name it
            # "pid:N" and count it as a job on the GPU until the end of the test).
            for pid in placed - gone:
                try:
                    alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    alive = False
                if not alive:
                    emu.remove_process(pid)
                    gone.add(pid)
            # Each rank of a job "runs on" its own emulated GPU: rank r of job j on GPU first_gpu[j] + r.
            for name, p in procs.items():
                try:
                    kids = psutil.Process(p.pid).children()
                except psutil.NoSuchProcess:
                    continue
                for k in kids:
                    if k.pid in placed:
                        continue
                    try:
                        rank = int(k.environ().get("RANK", "-1"))
                    except (psutil.Error, ValueError):
                        continue
                    if rank >= 0:
                        emu.add_process(first_gpu[name] + rank, k.pid, 8 << 30, sm_util_percent=SYNTHETIC_GPU_UTIL)
                        placed.add(k.pid)
            return all(p.poll() is not None for p in procs.values())

        wait_for(place_workers_and_check_done, timeout=150, interval=0.1, what="both jobs to finish")
        wait_for(lambda: place_workers_and_check_done() and gone == placed, timeout=10, what="the workers to leave")
        for name, p in procs.items():
            assert p.returncode == 0, (tmp_path / f"{name}.log").read_text()[-2000:]
        assert len(placed) == 4, placed
        job_ids = {name: json.loads((tmp_path / name / "rank0.json").read_text())["job_id"] for name in procs}

        def q(sql):
            return client.query(col.address, sql).rows

        stored: dict[str, int] = {}

        def steps_stored():
            stored.update({n: q(f"SELECT coalesce(sum(steps), 0) FROM job_steps WHERE job_id = '{j}'")[0][0]
                           for n, j in job_ids.items()})
            return all(v == 2 * STEPS for v in stored.values())
        # A tracker's bye closes its window at once; without one the window closes step_window_s (60 s) after
        # it opened, so the wait lasts past that.
        try:
            wait_for(steps_stored, timeout=75, what="both jobs' steps in job_steps")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; stored steps per job (want {2 * STEPS}): {stored}") from None
        wait_for(lambda: q("SELECT count(DISTINCT gpu) FROM job_samples WHERE gpu >= 0")[0][0] >= 4,
                 timeout=30, what="job samples naming the four GPUs")
        # GPU utilization arrives as one summary per minute (the default, docs/RESOLUTION.md), when the minute
        # ends: passes run until every minute the jobs held GPUs 0-3 has its utilization in samples_1m, and the
        # flags are that pass's.
        uncovered = ("SELECT count(*) FROM (SELECT DISTINCT node_id, gpu, minute FROM job_samples_1m WHERE gpu "
                     "BETWEEN 0 AND 3) j ANTI JOIN (SELECT node_id, gpu, minute FROM samples_1m WHERE metric = "
                     "'gpu_util_percent' AND labels = '') s USING (node_id, gpu, minute)")
        passes = []

        def a_pass_with_every_held_minute():
            passes.append(client.analyze(col.address))
            return q("SELECT count(*) FROM job_samples_1m WHERE gpu BETWEEN 0 AND 3")[0][0] > 0 \
                and q(uncovered)[0][0] == 0
        wait_for(a_pass_with_every_held_minute, timeout=100, interval=2,
                 what="a pass with the utilization of every minute the jobs held their GPUs")
        result = passes[-1]
        gaps = {(f["gpu"], f["component"]): f for f in result.flags if f["kind"] == "utilization_gap"}
        for g in (2, 3):
            flag = gaps.get((g, "input_bound"))
            assert flag is not None, f"no input-bound gap on GPU {g}: {sorted(gaps)}"
            evidence = json.loads(flag["evidence"])
            assert evidence["data_wait_fraction"] >= 0.25 and job_ids["slowed"] in evidence["jobs"]
            print(f"GPU {g}: {flag['sentence']}")
        for g in (0, 1):
            assert (g, "input_bound") not in gaps, gaps[(g, "input_bound")]["sentence"]
    finally:
        for p in procs.values():
            kill_tree(p)
        agent.stop()
        runner.join(timeout=30)
        col.stop()
