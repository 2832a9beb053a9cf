"""Helpers for tests that run the real agent (and collector) as subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from conftest import free_port, wait_for  # noqa: F401  (free_port re-exported to the tests that import it from here)

ROOT = Path(__file__).resolve().parents[1]


def agent_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAGENT_") and k != "NOTIFY_SOCKET"}
    env["GPUAGENT_JOBS_SOCKET"] = str(tmp_path / "jobs.sock")
    env["GPUAGENT_CONFIG"] = str(_empty_config(tmp_path))
    env["MALLOC_ARENA_MAX"] = "2"
    env.update(extra)
    return env


def _empty_config(tmp_path: Path) -> Path:
    p = tmp_path / "agent-test.toml"
    if not p.exists():
        # Everything else from flags/env. Probes off: these tests are about the data path (a test that
        # wants probes passes its own GPUAGENT_CONFIG).
        p.write_text("[probes]\nenabled = false\n")
    return p


def start_agent(tmp_path: Path, collector: str, state_dir: Path, interval: float = 1.0,
                batch_interval: float = 1.0, extra_args: tuple[str, ...] = (), log_name: str = "agent.log",
                up_longer_s: int = 0, **env_extra: str) -> subprocess.Popen:
    """The agent as a subprocess. ``up_longer_s``: the agent sees a node up that much longer than this machine
    (a time namespace, ``unshare --time --boottime``; needs root). A test that injects a link-down needs it
    on a machine booted minutes ago, as CI's are: the agent's start is then a reboot
    (common/hardware_faults.toml [reboot]), and a link down that soon after one is silenced, by design."""
    log = open(tmp_path / log_name, "ab")
    cmd = [sys.executable, "-m", "gpuagent.agent.cli", "run", "--collector", collector,
           "--state-dir", str(state_dir), "--interval", str(interval), "--batch-interval", str(batch_interval),
           *extra_args]
    if up_longer_s:
        cmd = ["unshare", "--time", "--boottime", str(int(up_longer_s)), *cmd]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=agent_env(tmp_path, **env_extra),
                            cwd=ROOT)


def read_status(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None


def wait_running(state_dir: Path, proc: subprocess.Popen, timeout: float = 30.0) -> dict:
    def ok():
        if proc.poll() is not None:
            raise AssertionError(f"agent exited early with {proc.returncode}")
        st = read_status(state_dir)
        return st if st and st.get("pid") == proc.pid and st.get("counters", {}).get("ticks", 0) >= 1 else None
    return wait_for(ok, timeout=timeout, what="agent status file")


def kill_tree(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILL a launcher started with start_new_session and every process under it, and wait for them.
    Killing its process group is not enough for torchrun: it starts each rank in a session of its own, and
    ranks orphaned that way went on training for their whole --duration-s, under the next test's job."""
    if proc.poll() is not None:
        return
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in below:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=timeout)
    _, alive = psutil.wait_procs(below, timeout=timeout)
    assert not alive, f"processes still alive after SIGKILL: {alive}"


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
    """Signal the agent and wait for it. One that does not stop in ``timeout`` first gets SIGUSR2, so that its
    log ends with every thread's stack (agent/cli.py registers faulthandler), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if "gpuagent.agent.cli" in proc.args:
                proc.send_signal(signal.SIGUSR2)
                time.sleep(1.0)
            proc.kill()
            proc.wait(timeout=5)
            raise
    return proc.returncode
