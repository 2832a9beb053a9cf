"""Health checks Slurm runs (agent/surface/slurm_hooks.py, issue 24 must-show 2): `gpuagent slurm healthcheck` as
HealthCheckProgram, `gpuagent slurm prolog` as Prolog and `gpuagent slurm epilog` as Epilog, on a REAL
single-node Slurm 22.05 cluster (tests/slurm_cluster.py: munged, slurmctld, slurmd, real sbatch/scontrol).

The GPUs are the NVML emulator's (SYNTHETIC 8x H100, real pynvml); the hardware fault is injected there
(an NVLink link down: a critical state rule of common/hardware_faults.toml, which clears when the link comes
back, unlike an XID, which the emulator hands every new NVML client). sysfs and the kernel log the
commands read are empty SYNTHETIC trees, so the host's own /sys and /dev/kmsg cannot decide the verdict.
slurmd starts the three programs with a bare environment: each is packaging/slurm/'s wrapper (the lines a
site installs), called from a SYNTHETIC outer one that sets SLURM_CONF, the emulator's variables and the
gpuagent command of this environment.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent_helpers import read_status, start_agent, stop, wait_running
from conftest import wait_for
from gpuagent.agent.schedulers.slurm import parse_listpids
from slurm_cluster import SlurmCluster

HEALTH_INTERVAL_S = 3
FAULT_GPU, FAULT_LINK = 6, 3
ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging" / "slurm"
SLEEPER = (f"exec {sys.executable} -c \"import time; [time.sleep(0.1) for _ in range(int({{n}}))]\"\n")


def _wrapper(path: Path, env: dict[str, str], script: str, args: list[str], pre: str = "") -> Path:
    """A SYNTHETIC outer wrapper: the test's environment, then packaging/slurm/'s script (the exact lines a
    site installs) with the test's arguments."""
    lines = ["#!/bin/sh", "# SYNTHETIC test wrapper: slurmd gives its programs no environment"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += [pre] if pre else []
    lines += [" ".join(shlex.quote(a) for a in [str(PACKAGING / script), *args])]
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The cluster with HealthCheckProgram (every 5 s), Prolog and Epilog running gpuagent, the emulator node,
    and the agent (its status file is the epilog's view)."""
    from gpuagent.sim.nvml_emulator import Emulator
    from nvml_emulator_fixture import H100_8GPU, built_or_skip
    built_or_skip()
    root = tmp_path_factory.mktemp("slurmhc")
    doc = json.loads(H100_8GPU.read_text())
    doc["events"] = []                      # no queued XIDs: this node starts healthy
    emu = Emulator.start(root / "nvmlemu", doc, clock="real")
    sysfs, kmsg = root / "sys", root / "kmsg"
    sysfs.mkdir()
    kmsg.write_text("")
    state = root / "state"
    conf = root / "slurm" / "slurm.conf"
    gpuagent = Path(sys.executable).with_name("gpuagent")      # the console script of this environment
    env = {"SLURM_CONF": str(conf), "GPUAGENT": str(gpuagent), **emu.env_vars()}
    local = ["--source", "local", "--state-dir", str(state), "--sys-root", str(sysfs), "--kmsg", str(kmsg)]
    hc_log = root / "healthcheck.log"
    hooks = root / "hooks"
    hooks.mkdir()
    # the test pauses the health check while it shows what the prolog does (else the health check's drain
    # comes first and the job never reaches a prolog); each run's start and end go to healthcheck.log
    hc = _wrapper(hooks / "healthcheck.sh", env, "gpuagent-healthcheck.sh", local,
                  pre=f'[ -e {root}/healthcheck.paused ] && exit 0\necho "start $(date +%s.%N) ${{SLURMD_NODENAME:-unset}}" >> {hc_log}\n'
                      f'trap \'echo "end $(date +%s.%N)" >> {hc_log}\' EXIT')
    pro = _wrapper(hooks / "prolog.sh", env, "gpuagent-prolog.sh", local)
    epi = _wrapper(hooks / "epilog.sh", env, "gpuagent-epilog.sh", ["--state-dir", str(state)])
    cluster = SlurmCluster(root / "slurm", extra_conf=(f"HealthCheckProgram={hc}",
                                                       f"HealthCheckInterval={HEALTH_INTERVAL_S}",
                                                       f"Prolog={pro}", f"Epilog={epi}")).start()
    assert cluster.conf == conf
    cfg = root / "agent.toml"
    cfg.write_text("[probes]\nenabled = false\n[jobs]\nslurm = \"on\"\nslurm_refresh_s = 0.5\nend_grace_s = 1.0\n")
    agent = start_agent(root, "127.0.0.1:9", state, interval=0.5, batch_interval=1.0, GPUAGENT_CONFIG=str(cfg),
                        SLURM_CONF=str(conf), **emu.env_vars())
    try:
        wait_running(state, agent)
        yield cluster, emu, state, root
    finally:
        stop(agent)
        cluster.stop()


def _show(cluster: SlurmCluster, what: str, name: str) -> dict[str, str]:
    from gpuagent.agent.surface.slurm_hooks import key_values
    return key_values(cluster.run("scontrol", "show", what, "-o", name, check=False).strip())


def _healthy(cluster: SlurmCluster, emu, root: Path) -> None:
    emu.inject_health(FAULT_GPU, nvlink_down=[])
    (root / "healthcheck.paused").unlink(missing_ok=True)
    if "DRAIN" in _show(cluster, "node", cluster.node).get("State", ""):
        cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME")
    _wait_ready(cluster)


def _wait_ready(cluster: SlurmCluster) -> None:
    """Idle and responding (no "*" in sinfo, no flag in scontrol): after a RESUME slurmctld pings the node
    again before the next job is submitted."""
    def ready():
        return (cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%T", check=False).strip() == "idle"
                and _show(cluster, "node", cluster.node).get("State") == "IDLE")
    wait_for(ready, timeout=15, interval=0.1, what="the node idle and responding")


def _no_run_in_progress(log: Path) -> bool:
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(ln.startswith("start") for ln in lines) == sum(ln.startswith("end") for ln in lines)


def _runs(log: Path) -> list[tuple[float, float]]:
    """(start, end) of each finished health-check run."""
    out, start = [], None
    for line in log.read_text().splitlines() if log.exists() else []:
        k, t = line.split()[:2]
        if k == "start":
            start = float(t)
        elif start is not None:
            out.append((start, float(t)))
            start = None
    return out


@pytest.mark.slow
def test_healthcheck_drains_prolog_refuses_resume_runs(node):
    """Must-show 2: a critical fault drains the node within one HealthCheckInterval with the fault's sentence;
    the prolog refuses a new job there (Slurm 22.05: the job is requeued and held, the node drained); after
    the fault clears and the node is resumed, the job runs."""
    cluster, emu, _state, root = node
    _healthy(cluster, emu, root)
    log = root / "healthcheck.log"
    # a healthy node: the health check runs and leaves it alone
    n_runs = len(_runs(log))
    wait_for(lambda: len(_runs(log)) > n_runs, timeout=HEALTH_INTERVAL_S * 2 + 5, interval=0.2,
             what="one health-check run on the healthy node")
    assert cluster.node_state() == "idle"
    # slurmd names the node to its health check program (what `gpuagent slurm healthcheck` drains)
    assert {ln.split()[2] for ln in log.read_text().splitlines() if ln.startswith("start")} == {cluster.node}

    t0 = time.time()
    emu.inject_health(FAULT_GPU, nvlink_down=[FAULT_LINK])              # SYNTHETIC: NVLink 3 of GPU 6 down
    wait_for(lambda: "DRAIN" in _show(cluster, "node", cluster.node).get("State", ""),
             timeout=HEALTH_INTERVAL_S * 3, interval=0.1, what="the health check draining the node")
    took = time.time() - t0
    wait_for(lambda: _no_run_in_progress(log), timeout=20, interval=0.1, what="the draining run's end")
    reason = cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%E").strip()
    assert reason.startswith(f"gpuagent: GPU {FAULT_GPU} NVLink {FAULT_LINK}: NVLink down"), reason
    run_s = max(e - s for s, e in _runs(log))
    assert took <= HEALTH_INTERVAL_S + run_s + 1.0, (took, run_s)       # the next run after the fault drained it
    # A node someone else drained keeps their reason: the health check drains, it never re-labels
    cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=DRAIN", "Reason=by hand: maintenance")
    p = subprocess.run([str(root / "hooks" / "healthcheck.sh")], capture_output=True, text=True, timeout=30,
                       env={"SLURMD_NODENAME": cluster.node}, check=False)
    assert p.returncode == 0, p.stderr
    assert cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%E").strip() == "by hand: maintenance"

    # The prolog: resume the still-faulted node with the health check paused, submit a job
    (root / "healthcheck.paused").touch()
    wait_for(lambda: _no_run_in_progress(log), timeout=20, interval=0.1, what="a started health check's end")
    cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME")
    _wait_ready(cluster)
    job = cluster.sbatch(SLEEPER.format(n=10), "-J", "refused")
    # Slurm 22.05, slurm.conf(5) Prolog: the node DRAIN, the batch job requeued in a held state
    def requeued_held():
        j = _show(cluster, "job", job)
        return (j.get("JobState"), j.get("Reason")) == ("PENDING", "launch_failed_requeued_held")
    try:
        wait_for(requeued_held, timeout=40, interval=0.2, what="the refused job requeued and held")
    except AssertionError as exc:
        slurmd = (cluster.root / "log" / "slurmd.log").read_text().splitlines()[-15:]
        raise AssertionError(f"{exc}; job {_show(cluster, 'job', job)}; node {_show(cluster, 'node', cluster.node)}; "
                             f"slurmd.log: {slurmd}") from None
    j = _show(cluster, "job", job)
    assert j["JobState"] == "PENDING" and j["Priority"] == "0" and int(j["Restarts"]) >= 1, j
    assert "DRAIN" in _show(cluster, "node", cluster.node)["State"]
    reason = cluster.run("sinfo", "-h", "-n", cluster.node, "-o", "%E").strip()
    assert reason.startswith(f"gpuagent: GPU {FAULT_GPU} NVLink {FAULT_LINK}"), reason   # the prolog said which fault

    # The fault clears, the node resumes, the held job is released and runs
    emu.inject_health(FAULT_GPU, nvlink_down=[])
    cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=RESUME")
    _wait_ready(cluster)
    cluster.run("scontrol", "release", job)
    # a requeued batch job is eligible only after the credential lifetime (cred_expire, 120 s by default)
    # has passed; an operator who wants it now says so
    assert _slurm_ts(_show(cluster, "job", job)["EligibleTime"]) > time.time() + 30, _show(cluster, "job", job)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    wait_for(lambda: cluster.job_state(job) in ("RUNNING", "COMPLETING", "GONE"), timeout=20, interval=0.2,
             what="the released job running")
    assert _show(cluster, "job", job).get("JobState") in ("RUNNING", "COMPLETING", "COMPLETED"), \
        _show(cluster, "job", job)
    (root / "healthcheck.paused").unlink()
    n_runs = len(_runs(log))
    wait_for(lambda: len(_runs(log)) > n_runs, timeout=HEALTH_INTERVAL_S * 2 + 5, interval=0.2,
             what="a health-check run after the fault cleared")
    assert "DRAIN" not in _show(cluster, "node", cluster.node)["State"]     # healthy again: left alone
    cluster.run("scancel", job, check=False)


@pytest.mark.slow
def test_epilog_records_the_job_on_its_gpu(node):
    """The epilog's line for a job that ran on emulated GPU 2 at 60 % SM utilization: its GPU, GPU-hours and
    effective utilization from the agent's job_end, in <state_dir>/slurm-epilog.jsonl."""
    cluster, emu, state, root = node
    _healthy(cluster, emu, root)
    job = cluster.sbatch(SLEEPER.format(n=40), "-J", "short")
    pid = _job_python_pid(cluster, job)
    emu.add_process(2, pid, 4 << 30, sm_util_percent=60)          # SYNTHETIC: the job holds GPU 2
    rec = _epilog_line(state, job)
    emu.remove_process(pid)
    assert (rec["job_id"], rec["source"], rec["partition"], rec["user"]) == (f"slurm:{job}", "agent",
                                                                          cluster.partition, "root")
    assert rec["gpus"] == [2] and rec["util_basis"].startswith("job_end"), rec
    assert rec["effective_gpu_util"] == pytest.approx(0.60, abs=0.02), rec
    assert 1.0 <= rec["duration_s"] <= 10.0, rec
    assert rec["gpu_hours"] == pytest.approx(rec["duration_s"] / 3600, rel=1e-3)
    assert rec["faults"] == [] and rec["account"] is None, rec


def test_epilog_records_the_faults_the_job_met(node):
    """An application XID on the job's GPU while it runs: the agent ties it to the job, and the epilog's line
    lists it among the faults the job met (XID 13 is a warning: no drain, the job runs to its end)."""
    cluster, emu, state, root = node
    _healthy(cluster, emu, root)
    job = cluster.sbatch(SLEEPER.format(n=60), "-J", "meets-xid")
    pid = _job_python_pid(cluster, job)
    emu.add_process(2, pid, 4 << 30, sm_util_percent=40)          # SYNTHETIC: the job holds GPU 2
    def agent_sees_job():
        st = read_status(state) or {}
        return any(j.get("job_id") == f"slurm:{job}" and j.get("gpu") == 2 for j in st.get("jobs", []))
    wait_for(agent_sees_job, timeout=20, interval=0.2, what="the agent's status showing the job on GPU 2")
    emu.inject_xid(2, 13)
    rec = _epilog_line(state, job)
    emu.remove_process(pid)
    met = [f for f in rec["faults"] if f.get("event") == "xid"]
    assert [(f["gpu"], f["value"]) for f in met] == [(2, 13)], rec["faults"]
    assert "13" in met[0]["message"], met
    assert "DRAIN" not in _show(cluster, "node", cluster.node).get("State", "")


def _job_python_pid(cluster: SlurmCluster, job: str) -> int:
    def python_pid():
        pids = [p for p, (j, _s) in parse_listpids(cluster.run("scontrol", "listpids", job, check=False)).items()
                if j == job and _cmd(p).startswith(sys.executable)]
        return pids[0] if pids else None
    return wait_for(python_pid, timeout=20, interval=0.1, what="the job's python process")


def _epilog_line(state: Path, job: str) -> dict:
    path = state / "slurm-epilog.jsonl"
    def record():
        for line in path.read_text().splitlines() if path.exists() else []:
            r = json.loads(line)
            if r["slurm_job_id"] == job:
                return r
        return None
    return wait_for(record, timeout=40, interval=0.2, what="the epilog's line")


def _slurm_ts(text: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(text).timestamp()


def _cmd(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_prolog_and_epilog_outside_slurm_exit_0_with_one_sentence(tmp_path, nvml_emulator):
    """No verdict (nothing readable: no NVML, empty sysfs, no kernel log) never refuses a job, and an epilog
    without SLURM_JOB_ID says so; both exit 0, since a failing Prolog or Epilog drains the node."""
    from click.testing import CliRunner
    from gpuagent.agent.cli import main
    nvml_emulator().fail("nvmlInitWithFlags", "DRIVER_NOT_LOADED")        # no driver: the GPUs cannot be read
    r = CliRunner().invoke(main, ["slurm", "prolog", "--source", "local", "--state-dir", str(tmp_path),
                                  "--sys-root", str(tmp_path / "nosys"), "--kmsg", ""],
                           env={"SLURM_JOB_ID": "7"})
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith("gpuagent prolog: job 7 allowed, health unknown: HEALTH UNKNOWN"), r.stderr
    r = CliRunner().invoke(main, ["slurm", "epilog", "--state-dir", str(tmp_path)], env={"SLURM_JOB_ID": None})
    assert r.exit_code == 0 and r.stdout == ""
    assert r.stderr.strip() == ("gpuagent slurm epilog: SLURM_JOB_ID is not set: `gpuagent slurm epilog` is for "
                                "slurm.conf's Epilog.")
    assert not (tmp_path / "slurm-epilog.jsonl").exists()
