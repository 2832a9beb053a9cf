"""`make run` in its --once form: a real collector and agent, real numbers from this machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("gpuagent.collector.cli", reason="the collector is not in this tree yet")


def test_local_run_once_shows_real_numbers(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAGENT_")}
    env["GPUAGENT_RUN_ONCE"] = "1"
    res = subprocess.run([sys.executable, "-m", "gpuagent.agent.local_run", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "REAL data measured on this machine" in out
    assert "connected" in out and "NOT connected" not in out          # gpuagent status of the live agent
    assert "kvm" in out or "none" in out                               # the node row's virt_type column
    # The SQL result has a load1 row with a count and numbers (the host sampler's real values).
    row = next(line for line in out.splitlines() if line.startswith("load1 "))
    n, lo, avg, hi = row.split()[1:5]
    assert int(n) >= 2 and 0 <= float(lo) <= float(avg) <= float(hi)
    assert (tmp_path / "run" / "gpuagent.duckdb").exists()
    # Both processes were stopped: nothing still holds the run dir's jobs socket or DuckDB file.
    assert not (tmp_path / "run" / "jobs.sock").exists()
