"""Findings: open flags grouped one per cause (95_findings.sql) on real DuckDB files with SYNTHETIC rows."""

from __future__ import annotations

import datetime as dt
import random

import duckdb
import pytest

from analysis_helpers import migrated_db  # noqa: F401 - the con fixture
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
H2D, D2H = 53.6, 52.0



def run(con, now=NOW):
    an = A.Analyzer()
    return an.run_pass(con, now)


def times(n=10, every_min=5, now=NOW):
    return [now - dt.timedelta(minutes=every_min * i + 1) for i in range(n)]


def rows(con, sql, params=()):
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def pcie_node(con, node, pool, virtualized, factor, rng, gpus=4, cv=0.0005, now=NOW):
    S.add_node(con, node, virtualized=virtualized, pool=pool, gpu_count=gpus)
    for g in range(gpus):
        S.add_probe_runs(con, node, "pcie", {"h2d_gbps": S.noisy(rng, H2D * factor, cv, 10),
                                             "d2h_gbps": S.noisy(rng, D2H * factor, cv, 10)},
                         times(now=now), gpu=g)


def test_pool_wide_penalty_is_one_pool_finding_not_one_per_node(con):
    rng = random.Random(3)
    for i in range(4):
        pcie_node(con, f"synthetic-bm{i}", "bare-metal", False, 1.0, rng)
    for i in range(5):
        pcie_node(con, f"synthetic-ca{i}", "cloud-a", True, 0.8, rng)
    result = run(con)
    flags = rows(con, "SELECT * FROM flags WHERE state = 'open'")
    assert len(flags) == 5 * 4 * 2      # one flag per node, GPU and direction ...
    (f,) = rows(con, "SELECT * FROM v_open_findings")      # ... and one finding about the pool
    assert (f["scope"], f["kind"], f["pool"], f["family"], f["node_id"]) == (
        "pool", "virtualization_overhead", "cloud-a", "pcie", None)
    assert (f["nodes"], f["pool_nodes"], f["flags"], f["severity"]) == (5, 5, 40, "warning")
    assert f["components"] == "d2h,h2d"
    assert f["sentence"].startswith("cloud-a: PCIe D2H/H2D -20 % against bare metal on 5 of 5 nodes (40 flags")
    assert result.findings_opened == 1
    assert {r["finding_id"] for r in flags} == {f["finding_id"]}


def test_pool_finding_needs_most_of_the_pool(con):
    rng = random.Random(4)
    for i in range(4):
        pcie_node(con, f"synthetic-bm{i}", "bare-metal", False, 1.0, rng)
    for i in range(5):   # 2 of 5 slow: a node matter, not a pool one
        pcie_node(con, f"synthetic-ca{i}", "cloud-a", True, 0.8 if i < 2 else 1.0, rng)
    run(con)
    found = rows(con, "SELECT * FROM v_open_findings ORDER BY node_id")
    assert [(f["scope"], f["node_id"], f["flags"]) for f in found] == [
        ("node", "synthetic-ca0", 8), ("node", "synthetic-ca1", 8)]
    assert found[0]["gpus"] == "0,1,2,3"
    assert found[0]["sentence"].startswith("virtualization overhead on synthetic-ca0 (cloud-a): D2H/H2D on GPUs 0,1,2,3 "
                                           "(8 flags, worst warning); worst: GPU ")


def test_a_noisy_node_is_one_finding_listing_its_components_and_gpus(con):
    rng = random.Random(7)
    for i in range(6):
        S.add_node(con, f"synthetic-n{i}", virtualized=True, pool="cloud-b")
        for g in range(2):
            S.add_probe_runs(con, f"synthetic-n{i}", "pcie", {"h2d_gbps": S.noisy(rng, H2D, 0.01, 12),
                                                             "d2h_gbps": S.noisy(rng, D2H, 0.01, 12)},
                             times(n=12, every_min=4), gpu=g)
        S.add_probe_runs(con, f"synthetic-n{i}", "host", {"pipe_roundtrip_us": S.noisy(rng, 12.0, 0.03, 12)},
                         times(n=12, every_min=4))
    S.add_node(con, "synthetic-noisy", virtualized=True, pool="cloud-b")
    for g in range(2):
        S.add_probe_runs(con, "synthetic-noisy", "pcie", {"h2d_gbps": S.noisy(rng, H2D, 0.35, 12),
                                                         "d2h_gbps": S.noisy(rng, D2H, 0.35, 12)},
                         times(n=12, every_min=4), gpu=g)
    S.add_probe_runs(con, "synthetic-noisy", "host", {"pipe_roundtrip_us": [12.0] * 8 + [30.0, 45.0, 28.0, 40.0]},
                     times(n=12, every_min=4))
    S.add_samples(con, [(NOW - dt.timedelta(minutes=m), "synthetic-noisy", None, "cpu_steal_percent", "", 12.0)
                        for m in range(1, 20)])
    run(con)
    flags = rows(con, "SELECT * FROM flags WHERE state = 'open' AND kind = 'noisy_neighbor_variance'")
    assert len(flags) >= 3 and {f["node_id"] for f in flags} == {"synthetic-noisy"}
    (f,) = rows(con, "SELECT * FROM v_open_findings WHERE kind = 'noisy_neighbor_variance'")
    assert (f["scope"], f["node_id"], f["pool"], f["flags"]) == ("node", "synthetic-noisy", "cloud-b", len(flags))
    assert set(f["components"].split(",")) == {fl["component"] for fl in flags}
    assert f["gpus"] == "0,1"
    assert f["sentence"].startswith("noisy neighbor (hypervisor) on synthetic-noisy (cloud-b): ")
    assert f["severity"] == max((fl["severity"] for fl in flags), key=["info", "warning", "critical"].index)


def test_finding_closes_with_its_last_flag_and_reopens_as_a_new_row(con):
    rng = random.Random(5)
    for i in range(4):
        pcie_node(con, f"synthetic-bm{i}", "bare-metal", False, 1.0, rng)
    pcie_node(con, "synthetic-vm", "cloud-a", True, 0.7, rng, gpus=1)
    run(con)
    (first,) = rows(con, "SELECT * FROM findings")
    assert first["state"] == "open" and first["severity"] == "critical"
    # The VM recovers: newer runs at bare-metal speed, older ones out of the probe window.
    later = NOW + dt.timedelta(hours=7)
    for i in range(4):
        S.add_probe_runs(con, f"synthetic-bm{i}", "pcie", {"h2d_gbps": S.noisy(rng, H2D, 0.0005, 10),
                                                          "d2h_gbps": S.noisy(rng, D2H, 0.0005, 10)},
                         times(now=later), gpu=0)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": S.noisy(rng, H2D, 0.0005, 10),
                                                  "d2h_gbps": S.noisy(rng, D2H, 0.0005, 10)}, times(now=later), gpu=0)
    result = run(con, later)
    assert result.closed == 2 and result.findings_closed == 1
    (closed,) = rows(con, "SELECT * FROM findings")
    assert (closed["state"], closed["closed_at"]) == ("closed", later)
    assert rows(con, "SELECT * FROM v_open_findings") == []
    # Flags keep the finding they were grouped into.
    assert {r["finding_id"] for r in rows(con, "SELECT finding_id FROM flags")} == {first["finding_id"]}


def test_open_findings_come_worst_first(con):
    rng = random.Random(6)
    for i in range(4):
        pcie_node(con, f"synthetic-bm{i}", "bare-metal", False, 1.0, rng)
    pcie_node(con, "synthetic-warn", "cloud-a", True, 0.85, rng)
    pcie_node(con, "synthetic-crit", "cloud-a", True, 0.6, rng)
    pcie_node(con, "synthetic-ok1", "cloud-a", True, 1.0, rng)
    pcie_node(con, "synthetic-ok2", "cloud-a", True, 1.0, rng)
    run(con)
    found = A.open_findings(con)
    assert [(f["node_id"], f["severity"]) for f in found] == [("synthetic-crit", "critical"),
                                                              ("synthetic-warn", "warning")]


def test_report_leads_with_the_findings(tmp_path):
    from gpuagent.collector.views.compare import DbSource
    from gpuagent.collector.views.report import render_report

    path = tmp_path / "collector.duckdb"
    c = duckdb.connect(str(path))
    schema.migrate(c)
    rng = random.Random(3)
    for i in range(4):
        pcie_node(c, f"synthetic-bm{i}", "bare-metal", False, 1.0, rng)
    for i in range(3):
        pcie_node(c, f"synthetic-ca{i}", "cloud-a", True, 0.8, rng)
    run(c)
    c.close()
    src = DbSource(str(path))
    try:
        html = render_report(src)
    finally:
        src.close()
    assert html.index("id='findings'") < html.index("id='summary'") < html.index("id='flags'")
    assert html.count("<tr class='finding'>") == 1 and "cloud-a: PCIe D2H/H2D -20 % against bare metal on 3 of 3" in html
    assert html.count("<tr class='flag'>") == 3 * 4 * 2
