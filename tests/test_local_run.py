"""`make run` in its --once form: a real collector and agent, real numbers from this machine."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys

import psutil
import pytest
from conftest import clean_env, spawned, wait_for

from gpuagent.agent.samplers.fingerprint import fingerprint


def _columns(rule: str, row: str) -> list[str]:
    """Cells of one row of `gpuagent-collector sql`'s table, cut at the spans of its '----' rule line."""
    spans, start = [], None
    for i, ch in enumerate(rule + " "):
        if ch == "-" and start is None:
            start = i
        elif ch != "-" and start is not None:
            spans.append((start, i))
            start = None
    return [row[a:b].strip() for a, b in spans]


def test_local_run_once_shows_real_numbers(tmp_path):
    res = subprocess.run([sys.executable, "-m", "gpuagent.local_run", "--run-dir", str(tmp_path / "run"),
                          "--port", "0"],
                         capture_output=True, text=True, timeout=180, env=clean_env(GPUAGENT_RUN_ONCE="1"),
                         cwd=tmp_path)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "REAL data measured on this machine" in out
    assert re.search(r"The web console .*: http://127\.0\.0\.1:\d+/ \(answers: HTTP 200\)", out), out
    assert "connected" in out and "NOT connected" not in out          # gpuagent status of the live agent
    # The node row (hostname, virt_type, ...) says what this machine is, as the agent's fingerprint sees it.
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("hostname ") and "virt_type" in line)
    cols = dict(zip(lines[head].split(), _columns(lines[head + 1], lines[head + 2])))
    fp = fingerprint()
    assert (cols["hostname"], cols["virt_type"]) == (socket.gethostname(), fp.virt_type), lines[head:head + 3]
    assert cols["virtualized"] == str(fp.virtualized)
    # The SQL result has a load1 row with a count and numbers (the host sampler's real values).
    row = next(line for line in out.splitlines() if line.startswith("load1 "))
    n, lo, avg, hi = row.split()[1:5]
    assert int(n) >= 2 and 0 <= float(lo) <= float(avg) <= float(hi)
    assert (tmp_path / "run" / "gpuagent.duckdb").exists()
    # Both processes were stopped: nothing still holds the run dir's jobs socket or DuckDB file.
    assert not (tmp_path / "run" / "jobs.sock").exists()
    assert "Stopped. The data stays in" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_local_run_stopped_by_sigterm_or_hangup_leaves_no_process_behind(tmp_path, sig):
    """The collector and agent run in their own sessions (so Ctrl-C reaches only `make run`), so SIGTERM or a
    closed terminal (SIGHUP) to `make run` must stop them too, not leave both running."""
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out, spawned([sys.executable, "-m", "gpuagent.local_run", "--run-dir",
                                              str(tmp_path / "run"), "--port", "0"],
                                             stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path) as proc:
        wait_for(lambda: "Running. Ctrl-C stops both." in out_path.read_text() or proc.poll() is not None,
                 timeout=150, interval=0.2, what="make run's running message")
        children = psutil.Process(proc.pid).children()
        assert len(children) == 2, out_path.read_text()
        text = out_path.read_text()
        # What to paste in another shell so the README's commands reach this run.
        assert "GPUAGENT_STATE_DIR=" + str(tmp_path / "run" / "agent-state") in text and "GPUAGENT_COLLECTOR=127.0.0.1:" in text
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    text = out_path.read_text()
    assert f"{signal.Signals(sig).name}: stopping the agent, then the collector." in text
    assert "Traceback" not in text and "Stopped. The data stays in" in text
