"""network_degraded from link_results (SYNTHETIC rows in a real, migrated DuckDB): the node and link
components, the pool-median baseline and its fallbacks, and flags closing when the fabric recovers."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random

import duckdb
import pytest

from analysis_helpers import migrated_db, run  # noqa: F401 - the con fixture
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)




def nd_flags(con, state="open"):
    cur = con.execute("SELECT node_id, component, severity, value, baseline, baseline_source, evidence, sentence "
                      "FROM flags WHERE kind = 'network_degraded' AND state = ? ORDER BY node_id, component", [state])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def mesh(con, n, rate, *, slow_nodes=(), slow_links=(), slow_rate=None, pool="p", runs=3, seed=0, start=NOW,
         add_nodes=True, nic_speed_mbits=(None, None)):
    """n nodes, every pair measured ``runs`` times at ~rate Gbit/s; slow nodes' and links' runs at slow_rate.
    ``nic_speed_mbits``: the line rate the lower and the higher node of each pair report for their NICs."""
    rng = random.Random(seed)
    nodes = [f"{pool}-n{i}" for i in range(n)]
    if add_nodes:
        for node in nodes:
            S.add_node(con, node, virtualized=False, pool=pool)
    times = [start - dt.timedelta(minutes=10 * k + 1) for k in range(runs)]
    for a, b in itertools.combinations(nodes, 2):
        slow = a in slow_nodes or b in slow_nodes or {a, b} in [set(x) for x in slow_links]
        base = slow_rate if slow else rate
        S.add_link_runs(con, a, b, [base * rng.uniform(0.93, 1.07) for _ in times], times,
                        nic_speed_mbits=nic_speed_mbits)
    return nodes


def test_one_slow_node_is_flagged_and_no_other_node_or_link(con):
    nodes = mesh(con, 8, 9.4, slow_nodes=("p-n3",), slow_rate=2.3)
    run(con)
    got = nd_flags(con)
    assert [(f["node_id"], f["component"]) for f in got] == [("p-n3", "node")]
    f = got[0]
    ev = json.loads(f["evidence"])
    assert f["baseline_source"] == "fleet_pool_median" and 8.7 < f["baseline"] < 10.1
    assert ev["links"] == 7 and ev["slow_links"] == 7 and ev["peers_fine_with_others"] == 7
    assert len(ev["pairs"]) == 7 and all(p["slow"] for p in ev["pairs"])
    assert f["severity"] == "critical" and f["value"] < 2.5
    assert "drain node p-n3" in f["sentence"] and "7 of its 7 measured peers" in f["sentence"]
    assert len(nodes) == 8


def test_one_slow_link_is_flagged_for_that_pair_only(con):
    mesh(con, 6, 9.4, slow_links=(("p-n4", "p-n1"),), slow_rate=3.0)
    run(con)
    got = nd_flags(con)
    assert [(f["node_id"], f["component"]) for f in got] == [("p-n1", "link")]
    ev = json.loads(got[0]["evidence"])
    assert ev["pair"] == ["p-n1", "p-n4"] and ev["a_slow_links"] == 1 and ev["b_slow_links"] == 1
    assert got[0]["severity"] == "warning"
    assert "check the cable, switch ports and route between p-n1 and p-n4" in got[0]["sentence"]


def test_flags_close_when_the_fabric_recovers(con):
    mesh(con, 5, 9.4, slow_nodes=("p-n2",), slow_rate=2.0)
    run(con)
    assert [f["node_id"] for f in nd_flags(con)] == ["p-n2"]
    later = NOW + dt.timedelta(hours=1)
    mesh(con, 5, 9.4, start=later, add_nodes=False, seed=1)      # three fresh healthy runs of every link
    run(con, now=later)
    assert nd_flags(con) == []
    assert [f["node_id"] for f in nd_flags(con, "closed")] == ["p-n2"]


def test_pools_are_judged_apart_and_small_pools_use_a_declared_baseline(con):
    # Pool "fast" at ~9.4, pool "slow" (an older network) at ~2.3: neither is degraded against itself.
    mesh(con, 5, 9.4, pool="fast")
    mesh(con, 5, 2.3, pool="slow", seed=2)
    run(con)
    assert nd_flags(con) == []
    # Two nodes are too few for a pool median: the declared value decides, and says so.
    mesh(con, 2, 1.0, pool="tiny")
    cfg = A.AnalyzerConfig.from_mapping({"analyzer": {"fabric_min_links": 1}, "baselines": {"declared": [
        {"component": "net_pair_gbits", "value": 10.0, "note": "25 GbE, measured at install"}]}})
    run(con, config=cfg)
    got = nd_flags(con)
    assert {(f["node_id"], f["component"], f["baseline_source"]) for f in got} == {("tiny-n0", "link", "user_declared")}


def test_skipped_and_failed_runs_are_counted_not_measured(con):
    nodes = mesh(con, 4, 9.4, slow_nodes=("p-n0",), slow_rate=1.5)
    S.add_link_runs(con, "p-n0", "p-n2", [0.0], [NOW - dt.timedelta(minutes=2)], status="failed",
                    reason="connect: connection refused")
    S.add_link_runs(con, "p-n0", "p-n1", [0.0], [NOW - dt.timedelta(minutes=3)], status="skipped",
                    reason="node p-n0 is busy: gpus busy: a job holds GPU 0")
    run(con)
    got = nd_flags(con)
    assert [(f["node_id"], f["component"]) for f in got] == [("p-n0", "node")]
    ev = json.loads(got[0]["evidence"])
    assert ev["failed_runs"] == 1 and ev["skipped_runs"] == 1 and ev["links"] == 3
    assert len(nodes) == 4


def test_small_pools_fall_back_to_the_cited_ceiling_of_their_line_rate(con):
    # Two-node pools (below min_fleet_nodes) with nothing declared: the reference row of the link's line rate,
    # the lower of the two ends' known NIC rates, is the baseline; an unknown rate has none.
    mesh(con, 2, 30.0, pool="slow100", nic_speed_mbits=(100000, 100000))
    mesh(con, 2, 91.0, pool="fine100", nic_speed_mbits=(100000, 100000))
    mesh(con, 2, 20.0, pool="mixed", nic_speed_mbits=(100000, 25000))      # 25 GbE ceiling: fine
    mesh(con, 2, 30.0, pool="onesided", nic_speed_mbits=(None, 100000))    # one end knows: 100 GbE
    mesh(con, 2, 5.0, pool="unknown")                                      # no rate: no baseline
    run(con)
    got = nd_flags(con)
    assert [(f["node_id"], f["component"], f["baseline_source"]) for f in got] == [
        ("onesided-n0", "link", "reference_table"), ("slow100-n0", "link", "reference_table")]
    for f in got:
        ev = json.loads(f["evidence"])
        assert f["baseline"] == pytest.approx(100 * 1448 / 1538, abs=0.005) and 27 < f["value"] < 33
        assert ev["link_mbits"] == 100000 and ev["reference"]["basis"] == "theoretical"
        assert ev["reference"]["source"].startswith("100 GbE at MTU 1500: 100 Gbit/s x 1448/1538")
        assert f["severity"] == "warning" and "of the theoretical reference" in f["sentence"]
        assert "for a 100 GbE link" in f["sentence"]
    assert "slow100-n0" in got[1]["sentence"] and "slow100-n1" in got[1]["sentence"]


def test_theoretical_rows_are_judged_with_the_wider_threshold(con):
    # 65 Gbit/s on 100 GbE is 69 % of the ceiling: slow for fabric_slow_fraction 0.8, but a theoretical row
    # allows theoretical_threshold_percent below it (40 % -> 0.6), unless that is the narrower one.
    mesh(con, 2, 65.0, pool="tiny", nic_speed_mbits=(100000, 100000))
    run(con, config=A.AnalyzerConfig.from_mapping({"analyzer": {"fabric_slow_fraction": 0.8}}))
    assert nd_flags(con) == []
    run(con, config=A.AnalyzerConfig.from_mapping(
        {"analyzer": {"fabric_slow_fraction": 0.8, "theoretical_threshold_percent": 10}}))
    (f,) = nd_flags(con)
    assert f["baseline_source"] == "reference_table" and json.loads(f["evidence"])["slow_fraction"] == 0.8


def test_shipped_line_rate_rows_follow_their_cited_formula_and_bad_rows_are_one_sentence(tmp_path):
    rows = [r for r in A.load_reference() if r["component"] == "net_pair_gbits"]
    assert sorted(r["link_mbits"] for r in rows) == [10000, 25000, 40000, 50000, 100000, 200000, 400000]
    for r in rows:
        assert r["value"] == round(r["link_mbits"] / 1000 * 1448 / 1538, 2) and r["basis"] == "theoretical"
        assert f"{r['link_mbits'] // 1000} GbE at MTU 1500" in r["source"]
    bad = tmp_path / "ref.toml"
    bad.write_text('[[row]]\ncomponent = "net_pair_gbits"\nlink_mbits = "100G"\nvalue = 94.15\n'
                   'unit = "gbits_per_s"\nbasis = "theoretical"\nsource = "x"\n')
    with pytest.raises(A.AnalyzerError, match=r"row 1: link_mbits must be a line rate in whole Mbit/s"):
        A.load_reference(bad)
    bad.write_text(bad.read_text().replace('"net_pair_gbits"', '"net_pair"'))
    with pytest.raises(A.AnalyzerError, match=r"row 1: unknown component 'net_pair' \(one of "):
        A.load_reference(bad)
