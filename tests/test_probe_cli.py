"""`gpuagent probe list|run` through click, with real probe subprocesses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import psutil
from click.testing import CliRunner
from conftest import wait_for

from gpuagent.agent.cli import main
from gpuagent.probes.lock import ProbeLock
from gpuagent.probes.runner import run_probe


def test_probe_list_shows_every_probe_with_platform():
    res = CliRunner().invoke(main, ["probe", "list"])
    assert res.exit_code == 0, res.output
    for name, platform in (("host", "any"), ("storage", "any"), ("collective", "multi-gpu"), ("pcie", "cuda"),
                           ("gpu_compute", "cuda")):
        assert any(line.split()[:2] == [name, platform] for line in res.output.splitlines()), name
    data = json.loads(CliRunner().invoke(main, ["probe", "list", "--json"]).output)
    assert {d["name"]: d["defaults"]["size_mib"] for d in data if d["name"] == "storage"} == {"storage": 256}


def test_probe_run_json_and_readable(tmp_path):
    lock = str(tmp_path / "probe.lock")
    res = CliRunner().invoke(main, ["probe", "run", "host", "--json", "--lock-path", lock,
                                    "--param", "repeats=1", "--param", "pipe_iters=200"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["status"] == "ok" and d["params"]["repeats"] == 1 and d["metrics"]["syscall_ns"] > 0
    res = CliRunner().invoke(main, ["probe", "run", "storage", "--lock-path", lock, "--param", f"path={tmp_path}",
                                    "--param", "size_mib=8", "--param", "rand_seconds=0.2", "--param", "seq_seconds=0.2"])
    assert res.exit_code == 0, res.output
    assert "status  ok" in res.output and "rand_read_p99_latency_us" in res.output


def test_probe_run_bad_input_is_one_sentence(tmp_path):
    lock = str(tmp_path / "probe.lock")
    res = CliRunner().invoke(main, ["probe", "run", "storage", "--lock-path", lock, "--param", "size=1"])
    assert res.exit_code == 1
    assert res.output.strip().startswith("Error: unknown parameter 'size' for probe storage (known: file,")
    res = CliRunner().invoke(main, ["probe", "run", "nvlink", "--lock-path", lock])
    assert res.exit_code == 1 and "no probe named 'nvlink'" in res.output


def test_probe_run_timeout_exits_1(tmp_path):
    res = CliRunner().invoke(main, ["probe", "run", "storage", "--json", "--timeout", "1", "--lock-path",
                                    str(tmp_path / "probe.lock"), "--param", f"path={tmp_path}",
                                    "--param", "size_mib=4096", "--param", "rand_seconds=60",
                                    "--param", "min_free_percent=0"])
    assert res.exit_code == 1
    assert json.loads(res.output)["status"] == "timeout"


def test_probe_run_refuses_while_the_lock_is_held(tmp_path):
    lock_path = str(tmp_path / "probe.lock")
    other = ProbeLock(lock_path)
    assert other.acquire(what="storage")
    try:
        res = CliRunner().invoke(main, ["probe", "run", "host", "--lock-path", lock_path, "--lock-wait", "0.3"])
    finally:
        other.release()
    assert res.exit_code == 1
    assert f"another probe run holds {lock_path} (pid=" in res.output and "probe=storage" in res.output


def test_probe_run_with_an_unusable_lock_path_is_one_sentence(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = CliRunner().invoke(main, ["probe", "run", "host", "--lock-path", str(blocker / "probe.lock")])
    assert res.exit_code == 1
    assert res.output.startswith(f"Error: cannot open the probe lock {blocker / 'probe.lock'}: ")


def test_ctrl_c_during_a_probe_stops_it_cleanly_and_leaves_no_file(tmp_path):
    """SIGINT (Ctrl-C) to `gpuagent probe run storage` mid-run: one sentence, exit 130, the probe's process
    group gone, its 64 MiB test file removed (it used to be SIGKILLed at once, leaving the file), lock free."""
    target = tmp_path / "target"
    target.mkdir()
    lock = tmp_path / "probe.lock"
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "probe", "run", "storage",
                             "--lock-path", str(lock), "--param", f"path={target}", "--param", "size_mib=64",
                             "--param", "seq_seconds=60", "--param", "min_free_percent=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The probe has written its file and is in the timed read loop.
        wait_for(lambda: any(p.stat().st_size >= 64 << 20 for p in target.iterdir()), timeout=60,
                 what="the storage probe's test file")
        probe_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert probe_pids
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Interrupted: probe storage stopped after "), err
    assert lines[0].endswith("and cleaned up; no result.")
    assert list(target.iterdir()) == []
    for pid in probe_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    other = ProbeLock(str(lock))
    assert other.acquire(0)
    other.release()


def test_probe_that_cannot_start_is_a_failed_result(tmp_path):
    res = run_probe("host", {"repeats": 1}, python=str(tmp_path / "no-python"))
    assert res.status == "failed" and res.reason.startswith(f"cannot start the probe subprocess {tmp_path}")
