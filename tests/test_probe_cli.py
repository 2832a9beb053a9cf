"""`gpuagent probe list|run` through click, with real probe subprocesses."""

from __future__ import annotations

import json
import sys

import psutil
from click.testing import CliRunner
from conftest import interrupt, spawned, wait_for

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
    assert {d["name"]: d["limits"]["queue_depth"] for d in data if d["name"] == "storage"} == {"storage": [1, 256]}


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
    with spawned([sys.executable, "-m", "gpuagent.agent.cli", "probe", "run", "storage",
                  "--lock-path", str(lock), "--param", f"path={target}", "--param", "size_mib=64",
                  "--param", "seq_seconds=60", "--param", "min_free_percent=0"]) as proc:
        # The probe has written its file and is in the timed read loop.
        wait_for(lambda: any(p.stat().st_size >= 64 << 20 for p in target.iterdir()), timeout=60,
                 what="the storage probe's test file")
        probe_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert probe_pids
        out, err = interrupt(proc)
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


def _run_on_a_terminal(argv: list[str], timeout_s: float = 60.0) -> tuple[str, str, int]:
    """Run the real CLI with stderr on a pseudo-terminal (what a user sees); returns (stderr, stdout, rc)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed its end
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode()
        return seen.decode(errors="replace"), out, proc.wait(timeout=10)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_probe_run_shows_a_progress_bar_on_a_terminal(tmp_path):
    err, out, rc = _run_on_a_terminal(["probe", "run", "host", "--lock-path", str(tmp_path / "probe.lock"),
                                       "--param", "repeats=3", "--param", "pipe_iters=20000",
                                       "--param", "syscall_iters=400000"])
    assert rc == 0, err + out
    frames = [f for f in err.split("\r") if f.strip()]
    bars = [f for f in frames if f.startswith("host [")]
    # the probe reports 15 parts (3 rounds x 5 figures); the bar shows the part running and moves forward
    done = [int(f.split("] ")[1].split("/")[0]) for f in bars]
    assert bars and all("/15 round " in f for f in bars), frames[:5]
    assert done == sorted(done) and done[-1] > done[0], done
    assert frames[-1].startswith("host: done in") and "status  ok" in out


def test_runner_reports_the_probe_parts_to_its_progress_callback(tmp_path):
    from gpuagent.probes.runner import run_probe

    steps = []
    r = run_probe("storage", {"path": str(tmp_path), "size_mib": 8, "seq_seconds": 0.5, "rand_seconds": 0.5},
                  progress=lambda elapsed, timeout, step: steps.append(step), poll_s=0.05)
    assert r.status == "ok", r.reason
    parts = [s for s in steps if s is not None]
    assert {s[1] for s in parts} == {3}
    labels = {s[0]: s[2] for s in parts}
    assert labels.get(1) == "sequential read, 0.5 s" and labels.get(2) == "random 4 KiB reads at QD 4, 0.5 s"
    assert [s[0] for s in parts] == sorted(s[0] for s in parts)


def test_progress_file_reads_only_complete_lines(tmp_path, monkeypatch):
    from gpuagent.probes import progress

    path = tmp_path / "progress"
    path.write_bytes(b"")
    monkeypatch.delenv(progress.ENV, raising=False)
    progress.step(1, 2, "ignored")  # no file named: nothing written, nothing raised
    assert path.read_bytes() == b"" and progress.read_last(str(path)) is None
    monkeypatch.setenv(progress.ENV, str(path))
    progress.step(0, 4, "all-reduce 1 MiB")
    progress.step(1, 4, "all-reduce\n4 MiB")  # a newline in a label cannot split the line
    with open(path, "ab") as f:
        f.write(b"2 4 half-writ")
    assert progress.read_last(str(path)) == (1, 4, "all-reduce 4 MiB")
    assert progress.read_last(str(tmp_path / "missing")) is None


def test_host_probe_refuses_zero_rounds_instead_of_running_one(tmp_path):
    res = CliRunner().invoke(main, ["probe", "run", "host", "--json", "--lock-path", str(tmp_path / "probe.lock"),
                                    "--param", "repeats=0"])
    assert res.exit_code == 1   # refused before anything runs: one sentence, no result to store
    assert res.output.strip() == "Error: parameter repeats of probe host must be between 1 and 100, got 0"
