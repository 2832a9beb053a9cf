"""`gpuagent probe list|run` through click, with real probe subprocesses."""

from __future__ import annotations

import json

from click.testing import CliRunner

from gpuagent.agent.cli import main
from gpuagent.probes.lock import ProbeLock


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
