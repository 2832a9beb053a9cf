"""The analyzer inside a real collector: the scheduled thread, the Analyze RPC and `gpuagent-collector analyze`."""

from __future__ import annotations

import datetime as dt
import json

import duckdb
import pytest

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S
from gpuagent.collector.views.client import analyze as remote_analyze
from gpuagent.collector.service import start_collector
from gpuagent.common.timeutil import utc_now

from conftest import wait_for
from test_collector_cli import run_cli, start_serve, stop


def slow_vm_fleet(con, now):
    """4 bare-metal nodes at 53.6 GB/s H2D and one VM at 42 GB/s (synthetic rows)."""
    runs = [now - dt.timedelta(minutes=5 * i + 1) for i in range(8)]
    for i in range(4):
        S.add_node(con, f"synthetic-bm{i}", virtualized=False)
        S.add_probe_runs(con, f"synthetic-bm{i}", "pcie", {"h2d_gbps": [53.6] * 8}, runs, gpu=0)
    S.add_node(con, "synthetic-vm", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [42.0] * 8}, runs, gpu=0)


def test_scheduled_passes_run_on_the_writer_and_analyze_rpc_answers(tmp_path):
    db = tmp_path / "c.duckdb"
    cfg = A.AnalyzerConfig(interval_s=0.2)
    handle = start_collector(db, "127.0.0.1:0", analyzer_config=cfg)
    try:
        # Rows go in through the writer (the single-writer rule), like ingest would.
        handle.writer.call(lambda con: slow_vm_fleet(con, utc_now())).result(timeout=30)
        wait_for(lambda: handle.analyzer.passes >= 2, timeout=60, what="two scheduled analysis passes")
        assert handle.analyzer.last_error is None
        res = remote_analyze(handle.address, window_s=1800)
        assert res.run["conditions"] >= 1 and res.run["rollup_rows_in"] == 0
        (flag,) = [f for f in res.flags if f["kind"] == "virtualization_overhead"]
        assert flag["node_id"] == "synthetic-vm" and flag["component"] == "h2d"
        assert "22 % below the bare-metal median 53.6 GB/s" in flag["sentence"]
        # A bad window is one clear sentence, not a traceback.
        with pytest.raises(Exception) as exc:
            remote_analyze(handle.address, window_s=-5)
        assert "window_s must be positive" in str(exc.value)
    finally:
        handle.stop()
    con = duckdb.connect(str(db), read_only=True)
    try:
        n_runs, opened = con.execute("SELECT count(*), sum(opened) FROM analysis_runs").fetchone()
    finally:
        con.close()
    assert n_runs >= 3 and opened >= 1


@pytest.mark.slow
def test_analyze_cli_live_collector_and_stopped_file(tmp_path):
    db = tmp_path / "c.duckdb"
    con = duckdb.connect(str(db))
    schema.migrate(con)
    slow_vm_fleet(con, utc_now())
    con.close()
    proc, port = start_serve(tmp_path, db=db)
    try:
        r = run_cli("analyze", "--target", f"127.0.0.1:{port}", "--window", "30m")
        assert r.returncode == 0, r.stderr
        # Findings by default; the flags under them on request.
        lines = r.stdout.splitlines()
        assert lines[1].startswith("[warning] node virtualization_overhead: virtualization overhead on synthetic-vm")
        assert "virtualization_overhead/h2d" not in r.stdout and "--flags" in r.stdout
        r = run_cli("analyze", "--target", f"127.0.0.1:{port}", "--window", "30m", "--flags")
        assert r.returncode == 0, r.stderr
        assert "[warning] virtualization_overhead/h2d synthetic-vm gpu 0: GPU 0 H2D 42.0 GB/s is 22 % below" in r.stdout
        assert r.stdout.splitlines()[2].startswith("    [warning] virtualization_overhead/h2d synthetic-vm")
        r = run_cli("analyze", "--db", str(db))
        assert r.returncode == 1 and "held by a running collector" in r.stderr and "Traceback" not in r.stderr
        r = run_cli("analyze", "--target", f"127.0.0.1:{port}", "--window", "soon")
        assert r.returncode == 1 and "cannot read duration 'soon'" in r.stderr
    finally:
        code, err = stop(proc)
    assert code == 0, err
    r = run_cli("analyze", "--db", str(db), "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [f["component"] for f in out["open_flags"]] == ["h2d"] and out["pass"]["updated"] == 1
    (finding,) = out["open_findings"]
    assert finding["finding_id"] == out["open_flags"][0]["finding_id"] and finding["node_id"] == "synthetic-vm"
    bad = tmp_path / "bad.toml"
    bad.write_text("[analyzer]\nwindw = '1h'\n")
    r = run_cli("analyze", "--db", str(db), "--config", str(bad))
    assert r.returncode == 1 and "unknown [analyzer] setting 'windw'" in r.stderr


def test_serve_with_a_bad_analyzer_config_is_one_sentence(tmp_path):
    bad = tmp_path / "collector.toml"
    bad.write_text("[pricing]\ncloud-a = 'cheap'\n")
    r = run_cli("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.duckdb"), "--config", str(bad))
    assert r.returncode == 1 and "[pricing] cloud-a must be a price per GPU-hour" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.duckdb"),
                "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 1 and "does not exist" in r.stderr
