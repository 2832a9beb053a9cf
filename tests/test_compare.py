"""`gpuagent-collector compare --by pool` on a SYNTHETIC fleet the real collector stored: the pools come out
as injected (cloud-a's PCIe copies ~20 % slower than bare metal, cloud-b's utilization lower), costs follow
price / utilization, and the live-collector and file paths agree."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from click.testing import CliRunner

from gpuagent.collector.views.compare import DbSource, compare_pools, run_compare
from sim_helpers import BAD_LINK, CLOUD_A_NET, FABRIC_GBITS, FABRIC_SWEEPS, GPUS, fleet_db


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return fleet_db(tmp_path_factory)


def _probe(doc, pool, metric):
    return next(r for r in doc["probes"] if r["pool"] == pool and r["metric"] == metric)


def _pool(doc, pool):
    return next(p for p in doc["pools"] if p["pool"] == pool)


def test_pools_side_by_side_match_the_injections(fx):
    doc = json.loads(run_compare(str(fx.db), None, window="24h", fmt="json"))
    assert [p["pool"] for p in doc["pools"]] == ["bare-metal", "cloud-a", "cloud-b"]
    assert doc["reference_pool"] == "bare-metal"
    assert doc["synthetic_nodes"] == doc["total_nodes"] == 8
    bare, a, b = (_pool(doc, p) for p in ("bare-metal", "cloud-a", "cloud-b"))
    assert (bare["nodes"], bare["virtualized_nodes"], a["virtualized_nodes"], b["gpus"]) == (3, 0, 3, 2 * GPUS)

    h2d_a = _probe(doc, "cloud-a", "h2d_gbps")
    assert h2d_a["vs_reference_percent"] == pytest.approx(-20, abs=4)     # injected 20 %
    assert _probe(doc, "cloud-b", "h2d_gbps")["vs_reference_percent"] == pytest.approx(0, abs=4)
    assert _probe(doc, "cloud-a", "busbw_gbps")["vs_reference_percent"] == pytest.approx(0, abs=5)
    assert h2d_a["p10"] <= h2d_a["median"] <= h2d_a["p90"] and h2d_a["runs"] > 3 * GPUS * 20
    # cloud-a holds the noisy node: its spread is wider than bare metal's.
    assert h2d_a["spread_percent"] > _probe(doc, "bare-metal", "h2d_gbps")["spread_percent"]

    # 2 h of GPU minutes per GPU; utilization: healthy ~92 %, cloud-b half idle / input-bound ~50 %.
    assert bare["gpu_hours"] == pytest.approx(3 * GPUS * 2.0, rel=0.03)
    assert bare["effective_util_percent"] == pytest.approx(92, abs=3)
    assert b["effective_util_percent"] == pytest.approx(48, abs=7)
    for p in (bare, a, b):
        assert p["cost_per_effective_gpu_hour"] == pytest.approx(
            p["price_per_gpu_hour"] / (p["effective_util_percent"] / 100), rel=0.01)
    assert b["cost_per_effective_gpu_hour"] > 1.7 * b["price_per_gpu_hour"]

    jobs = {j["pool"]: j for j in doc["jobs"] if j["job_name"] == "llama-8b-pretrain"}
    assert set(jobs) == {"bare-metal", "cloud-a", "cloud-b"}
    assert jobs["bare-metal"]["tokens_per_s_per_gpu"] == pytest.approx(8192 / (0.9 * 1.01), rel=0.03)
    assert jobs["bare-metal"]["ranks"] == 3 * GPUS
    assert jobs["cloud-b"]["tokens_per_s_per_gpu"] < 0.95 * jobs["bare-metal"]["tokens_per_s_per_gpu"]

    assert a["virtualization_overhead_nodes"] == 3 and bare["virtualization_overhead_nodes"] == 0
    assert a["nodes_flagged_percent"] == 100.0


def test_inter_node_bandwidth_and_latency_per_pool(fx):
    """SYNTHETIC net_pair sweeps (sim_helpers): cloud-a's links run at 0.6 x, one bare-metal path at 0.3 x."""
    doc = json.loads(run_compare(str(fx.db), None, window="24h", fmt="json"))
    bare, a, b = (_pool(doc, p) for p in ("bare-metal", "cloud-a", "cloud-b"))
    # Every pair within a pool once per sweep, each run counted once though both ends report it.
    assert (bare["links"], a["links"], b["links"]) == (3, 3, 1)
    assert (bare["link_runs"], a["link_runs"], b["link_runs"]) == (3 * FABRIC_SWEEPS, 3 * FABRIC_SWEEPS,
                                                                   FABRIC_SWEEPS)
    assert bare["link_gbits_median"] == pytest.approx(FABRIC_GBITS, rel=0.06)
    assert bare["link_gbits_p10"] == pytest.approx(FABRIC_GBITS * BAD_LINK[2], rel=0.1)   # the bad path
    assert a["link_gbits_median"] == pytest.approx(FABRIC_GBITS * CLOUD_A_NET, rel=0.06)
    assert a["link_gbits_vs_reference_percent"] == pytest.approx(-40, abs=5)
    assert b["link_gbits_median"] == pytest.approx(FABRIC_GBITS, rel=0.06)
    # the simulator's queueing: rtt / sqrt(rate factor) -> cloud-a ~1.29 x bare metal's
    assert a["link_rtt_p50_us"] / bare["link_rtt_p50_us"] == pytest.approx(CLOUD_A_NET ** -0.5, rel=0.08)

    text = run_compare(str(fx.db), None, fmt="table")
    row = next(line for line in text.splitlines() if line.startswith("inter-node Gbit/s"))
    cells = re.findall(r"([0-9.]+) \[([0-9.]+)\], (\d) links? ?(?:\(([-+]\d+)%\))?", row)
    assert [(n, pct and -45 <= int(pct) <= -35) for _, _, n, pct in cells] == [("3", ""), ("3", True), ("1", False)]
    assert "inter-node rtt p50 (median)" in text
    rows = list(csv.DictReader(io.StringIO(run_compare(str(fx.db), None, fmt="csv"))))
    got = {r["pool"]: float(r["value"]) for r in rows if r["section"] == "pool" and r["field"] == "link_gbits_median"}
    assert got == pytest.approx({"bare-metal": bare["link_gbits_median"], "cloud-a": a["link_gbits_median"],
                                 "cloud-b": b["link_gbits_median"]})


def test_live_collector_and_file_agree(fx):
    via_target = json.loads(fx.compare_via_target_json)
    via_file = json.loads(run_compare(str(fx.db), None, window="24h", fmt="json"))
    assert [p["pool"] for p in via_target["pools"]] == [p["pool"] for p in via_file["pools"]]
    for r in via_target["probes"]:
        other = _probe(via_file, r["pool"], r["metric"])
        assert r["median"] == pytest.approx(other["median"]) and r["runs"] == other["runs"]
    for p in via_target["pools"]:
        assert p["effective_util_percent"] == pytest.approx(_pool(via_file, p["pool"])["effective_util_percent"],
                                                            rel=1e-6)
        for k in ("link_runs", "links", "link_gbits_median", "link_rtt_p50_us"):
            assert p[k] == pytest.approx(_pool(via_file, p["pool"])[k]), k


def test_formats_and_reference_pool(fx):
    text = run_compare(str(fx.db), None, fmt="table")
    assert text.startswith("SYNTHETIC data: 8 of 8 nodes are simulated")
    assert "cost per effective GPU-hour" in text and "pcie h2d_gbps (higher is better)" in text
    header = next(line for line in text.splitlines() if line.startswith("pool "))
    assert header.split() == ["pool", "bare-metal", "cloud-a", "cloud-b"]

    rows = list(csv.DictReader(io.StringIO(run_compare(str(fx.db), None, fmt="csv"))))
    h2d = {r["pool"]: float(r["value"]) for r in rows
           if r["section"] == "probe" and r["item"] == "pcie.h2d_gbps" and r["field"] == "median"}
    assert h2d["cloud-a"] == pytest.approx(0.8 * h2d["bare-metal"], rel=0.05)

    src = DbSource(str(fx.db))
    try:
        c = compare_pools(src, 86400.0, reference_pool="cloud-a")
    finally:
        src.close()
    bare = c.probe("bare-metal", "pcie", "h2d_gbps")
    assert bare["vs_reference_percent"] == pytest.approx(25, abs=5)         # 1/0.8 - 1


def test_compare_cli_errors_are_one_sentence(fx, tmp_path):
    from gpuagent.collector.cli import main

    runner = CliRunner()
    cases = [
        (["compare", "--db", str(fx.db), "--window", "soon"], "'soon' is not a positive duration"),
        (["compare", "--db", str(tmp_path / "nope.duckdb")], "does not exist"),
        (["compare", "--db", str(fx.db), "--target", "127.0.0.1:1"], "exactly one of --db PATH or --target"),
        (["compare", "--db", str(fx.db), "--reference-pool", "moon"], "reference pool 'moon' has no nodes"),
    ]
    for args, message in cases:
        res = runner.invoke(main, args, env={"GPUAGENT_COLLECTOR": ""})
        assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output, (args, res.output)
    res = runner.invoke(main, ["compare", "--by", "pool", "--db", str(fx.db), "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.output)["reference_pool"] == "bare-metal"


def test_heatmap_keeps_the_least_utilized_nodes(fx, monkeypatch):
    from gpuagent.collector.views import report_data

    monkeypatch.setattr(report_data, "MAX_HEATMAP_ROWS", 2)
    src = DbSource(str(fx.db))
    try:
        c = compare_pools(src, 86400.0)
        title, rows, cols, values, bucket = report_data._heatmap(src, c.window)
    finally:
        src.close()
    assert title.endswith("the 2 least-utilized of 8 nodes")
    assert rows == ["sim-0007 (cloud-b)", "sim-0008 (cloud-b)"]      # half idle, input-bound
    assert bucket == 300 and len(cols) == len(values[0]) and 20 <= len(cols) <= 30


def test_compare_and_report_without_db_or_target_ask_the_default_collector(tmp_path):
    """Like `sql` and `analyze`, they default to 127.0.0.1:7443 instead of demanding --db or --target."""
    from gpuagent.collector.cli import main

    for cmd in (["compare"], ["report", "--out", str(tmp_path / "r.html")]):
        res = CliRunner().invoke(main, cmd, env={"GPUAGENT_COLLECTOR": ""})
        assert "exactly one of" not in res.output, res.output
        if res.exit_code != 0:      # nothing on 7443 (the usual case in CI): one sentence naming it
            assert res.output.startswith("Error: cannot reach the collector at 127.0.0.1:7443"), res.output
            assert len(res.output.strip().splitlines()) == 1
