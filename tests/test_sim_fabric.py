"""`gpuagent-sim --fabric-sweeps`: SYNTHETIC net_pair runs through the real ingest path (real collector
subprocess, DuckDB file, loopback gRPC), both ends reporting each run, and the analyzer finding the
injected bad node and bad link."""

from __future__ import annotations

import itertools

import duckdb
import pytest

from conftest import free_port
from gpuagent import local_run
from gpuagent.collector.analysis.analyzer import analyze_db
from gpuagent.sim.fabric import FabricSim, link_factors
from gpuagent.sim.fleet import NodeSpec, ScenarioError, validate
from gpuagent.sim.run import SimConfig, run_sim

SWEEPS = 2


def fleet() -> list[NodeSpec]:
    out = []
    for i in range(10):
        pool = "p" if i < 7 else "q"
        inject = {"net_factor": 0.25} if i == 2 else {}
        labels = {"inject_net_links": "fab-0006:0.3"} if i == 4 else {}
        out.append(validate(NodeSpec(i, f"fab-{i + 1:04d}", pool, False, gpu_count=1, inject=inject,
                                     extra_labels=labels)))
    return out


def test_schedule_covers_every_pair_of_each_pool_once_per_sweep():
    f = fleet()
    sched = FabricSim(sweeps=SWEEPS).schedule(f, 0, 3600 * 10**9)
    runs = {(pid, a, b) for lst in sched.values() for _t, pid, a, b in lst}
    assert len(runs) == SWEEPS * (21 + 3)
    for s in range(SWEEPS):
        pairs = [frozenset((a, b)) for pid, a, b in runs if pid.split("-")[1] == f"s{s}"]
        assert sorted(map(sorted, pairs)) == sorted(map(sorted, {frozenset(p) for pool in "pq" for p in
                                                                  itertools.combinations(
                                                                      [n.hostname for n in f if n.pool == pool], 2)}))
    # each node is in one pair per round
    for host, lst in sched.items():
        assert len({t for t, *_ in lst}) == len(lst)


def test_bad_link_labels_are_checked():
    bad = [validate(NodeSpec(0, "x-1", "p", False, extra_labels={"inject_net_links": "nobody:0.3"})),
           validate(NodeSpec(1, "x-2", "p", False))]
    with pytest.raises(ScenarioError, match="inject_net_links entry 'nobody:0.3'"):
        link_factors(bad)
    with pytest.raises(ScenarioError, match="net_factor must be in"):
        validate(NodeSpec(0, "x-1", "p", False, inject={"net_factor": 1.5}))


def test_fabric_results_reach_link_results_and_the_analyzer_localizes(tmp_path):
    db = tmp_path / "fab.duckdb"
    port = free_port()
    proc = local_run.start_collector(db, port, tmp_path / "collector.log")
    try:
        local_run.wait_port(port, proc, tmp_path / "collector.log")
        summary = run_sim(SimConfig(collector=f"127.0.0.1:{port}", sim_hours=0.25, interval_s=30.0, batch_s=300.0,
                                    gpu_metrics="util", gpus=1, seed=3, fabric_sweeps=SWEEPS), fleet())
        assert summary.nodes_ok == 10, summary.errors
    finally:
        local_run.stop_process(proc, timeout=30)
    analyze_db(str(db))
    con = duckdb.connect(str(db), read_only=True)
    try:
        per_end = con.execute("SELECT count(*), count(DISTINCT pair_id), count(DISTINCT reported_by) "
                              "FROM link_results WHERE probe = 'net_pair' AND status = 'ok'").fetchone()
        ends_agree = con.execute("SELECT count(*) FROM (SELECT pair_id FROM link_results GROUP BY pair_id "
                                 "HAVING count(*) <> 2 OR count(DISTINCT send_gbits_per_s) <> 1)").fetchone()[0]
        flags = con.execute("SELECT component, node_id, evidence FROM flags WHERE kind = 'network_degraded' "
                            "AND state = 'open' ORDER BY component").fetchall()
    finally:
        con.close()
    assert per_end == (2 * SWEEPS * 24, SWEEPS * 24, 10)
    assert ends_agree == 0
    assert [(c, n) for c, n, _e in flags] == [("link", "fab-0005"), ("node", "fab-0003")]
    assert '"pair":["fab-0005","fab-0006"]' in flags[0][2]
