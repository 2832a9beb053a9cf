"""Same answer at scale: one SYNTHETIC fleet (same seed, same timestamps) sent whole to one collector and split
by pool across three collector shards that export to one lake. Spark local[2] computes the fleet-wide steps
(bare-metal baselines, each hardware class's median noise) and the pool comparison from the lake; after their
next pass with those, the shards' open flags (and findings) together are the single collector's, and the
comparison is its comparison. DuckDB over the same lake gives the same numbers.

The collectors are real processes on loopback gRPC (scheduled analysis off, so every pass runs at one chosen
time); the passes then run on their stopped database files at that time. Needs pyspark and Java 17+."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time

import duckdb
import pytest

from conftest import free_port
from gpuagent import local_run
from gpuagent.collector.analysis.analyzer import analyze_db
from gpuagent.collector.lake import layout
from gpuagent.collector.lake.engines import open_engine
from gpuagent.collector.lake.export import export_db
from gpuagent.collector.lake.fleet import (LakeBaselineLoader, compute_baselines, compute_noise_medians,
                                           publish_baselines, publish_noise_medians)
from gpuagent.collector.views.compare import DbSource, compare_pools
from gpuagent.sim.run import SimConfig, run_sim
from sim_helpers import FLEET_SPEC, TOKEN, fleet
from test_lake import assert_same

from tools import needs, python_module_or_skip
python_module_or_skip("pyspark", reason="the lake extra (pyspark) is part of the test environment in .ci/run")

# Four collectors, two sends of the fleet and a Spark start on two shared cores: minutes (~3 idle).
# Spark needs Java 17+: without it each test skips with a missing-tool line (fails under CI=true)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs("java")]
POOLS = sorted({pool for pool, *_ in FLEET_SPEC})
HOUR_NS = 3600 * 10**9


def _start(db, log):
    port = free_port()
    cmd = [sys.executable, "-m", "gpuagent.collector.cli", "serve", "--db", str(db),
           "--listen", f"127.0.0.1:{port}", "--no-analyze"]
    proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "GPUAGENT_COLLECTOR_TOKEN": TOKEN})
    return proc, port


def _send(port, nodes, end_ns):
    cfg = SimConfig(collector=f"127.0.0.1:{port}", token=TOKEN, sim_hours=2.0, interval_s=30.0, batch_s=600.0,
                    seed=7, streams=8, end_ns=end_ns)
    summary = run_sim(cfg, nodes)
    assert summary.nodes_ok == len(nodes), summary.errors
    return summary


def _open_flags(db_path) -> dict[tuple, dict]:
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        cur = con.execute("SELECT n.hostname, f.gpu, f.kind, f.component, f.severity, f.value, f.unit, f.baseline, "
                          "f.baseline_source, f.evidence, f.sentence, f.first_seen, f.last_seen "
                          "FROM flags f JOIN nodes n USING (node_id) WHERE f.state = 'open'")
        cols = [d[0] for d in cur.description]
        rows = [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()
    out = {}
    for r in rows:
        key = (r.pop("hostname"), r.pop("gpu"), r.pop("kind"), r.pop("component"))
        assert key not in out, key
        r["evidence"] = json.loads(r["evidence"])
        out[key] = r
    return out


def _open_findings(db_path) -> list[tuple]:
    """Open findings without their ids and times (a shard's first pass opened some at the same `now`)."""
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.execute("SELECT finding_key, scope, kind, node_id, pool, family, severity, flags, nodes, "
                           "pool_nodes, components, gpus, sentence "
                           "FROM findings WHERE state = 'open'").fetchall()
    finally:
        con.close()


def _count(db_path, sql) -> int:
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def _baselines_of(db_path) -> list[list]:
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return [list(r) for r in con.execute("SELECT class_label, component, params_key, baseline, nodes, runs "
                                              "FROM fleet_baselines ORDER BY ALL").fetchall()]
    finally:
        con.close()


def _strip(rows, drop=("computed_at",)):
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def test_three_shards_through_the_lake_give_one_collectors_flags_and_comparison(tmp_path):
    end_ns = time.time_ns() // HOUR_NS * HOUR_NS           # hour-aligned: at `now` every hour is closed
    now = dt.datetime.fromtimestamp(end_ns / 1e9, dt.timezone.utc).replace(tzinfo=None)
    whole = tmp_path / "whole.duckdb"
    shards = {pool: tmp_path / f"{pool}.duckdb" for pool in POOLS}
    procs = {name: _start(db, tmp_path / f"{name}.log") for name, db in [("whole", whole), *shards.items()]}
    try:
        for name, (proc, port) in procs.items():
            local_run.wait_port(port, proc, tmp_path / f"{name}.log")
        nodes = fleet()
        sent = _send(procs["whole"][1], nodes, end_ns)
        split = sum(_send(procs[pool][1], [n for n in nodes if n.pool == pool], end_ns).samples for pool in POOLS)
        assert split == sent.samples > 0
    finally:
        for proc, _ in procs.values():
            local_run.stop_process(proc, timeout=30)

    # The single collector: two passes at `now` (the shards get two as well).
    analyze_db(str(whole), now=now)
    analyze_db(str(whole), now=now)
    want_flags = _open_flags(whole)
    kinds = {k[2] for k in want_flags}
    assert {"virtualization_overhead", "noisy_neighbor_variance", "utilization_gap"} <= kinds, kinds
    assert any(f["baseline_source"] == "fleet_class_median" for f in want_flags.values())

    # Each shard: its own pass (rollups; flags from its part of the fleet), then export to the one lake. Step
    # windows are stamped at their end, so the last ones (ts = now) are in the hour that starts at `now`: the
    # export runs once that hour has closed too. (Live, the lake lags by up to an hour plus the grace.)
    lake = tmp_path / "lake"
    first_pass = {}
    for pool, db in shards.items():
        analyze_db(str(db), now=now)
        first_pass.update(_open_flags(db))
        res = export_db(str(db), str(lake), pool, grace_s=0, now=now + dt.timedelta(hours=1))
        assert res.rows > 0
    # Without the fleet-wide numbers a shard's flags are not the fleet's (the reason for the lake step): a noisy
    # node's class peers sit in other pools, so its shard has too few to give the class median.
    assert first_pass != want_flags
    by_median = [k for k, f in want_flags.items() if f["baseline_source"] == "fleet_class_median"]
    assert all(first_pass.get(k, {}).get("baseline") != want_flags[k]["baseline"] for k in by_median)
    total = _count(whole, "SELECT count(*) FROM samples")
    steps = _count(whole, "SELECT count(*) FROM job_steps")

    def from_lake(engine, work):
        master = "local[2]" if engine == "spark" else None
        src = open_engine(engine, str(lake), master)   # Spark: one JVM for the test (the session is kept)
        try:
            return work(src)
        finally:
            src.close()

    # The fleet-wide steps from the lake, on Spark and on DuckDB.
    def fleet_steps(src):
        assert src.query("SELECT count(*) AS n FROM samples")[0]["n"] == total
        assert src.query("SELECT count(*) AS n FROM job_steps")[0]["n"] == steps
        return compute_baselines(src, now=now), compute_noise_medians(src, now=now)

    spark_baselines, spark_noise = from_lake("spark", fleet_steps)
    duck_baselines, duck_noise = from_lake("duckdb", fleet_steps)
    assert_same(_strip(spark_baselines), _strip(duck_baselines))
    assert_same(_strip(spark_noise), _strip(duck_noise))
    assert spark_noise and all(r["nodes"] > 0 for r in spark_noise)
    assert_same([[r[k] for k in ("class_label", "component", "params_key", "baseline", "nodes", "runs")]
                 for r in spark_baselines], _baselines_of(whole))

    lake_obj = layout.open_lake(str(lake))
    publish_baselines(lake_obj, spark_baselines)
    publish_noise_medians(lake_obj, spark_noise)

    # Each shard's next pass takes the fleet-wide numbers from the lake.
    got_flags = {}
    for pool, db in shards.items():
        analyze_db(str(db), now=now, baselines_loader=LakeBaselineLoader(str(lake)))
        flags = _open_flags(db)
        assert not set(flags) & set(got_flags)
        got_flags.update(flags)
    assert set(got_flags) == set(want_flags)
    assert_same(got_flags, want_flags)
    # Findings group flags per node or per pool; with the fleet split by pool each shard holds whole pools.
    want_findings = sorted(_open_findings(whole))
    assert want_findings
    assert sorted(f for db in shards.values() for f in _open_findings(db)) == want_findings

    # The pool comparison counts flagged nodes: it reads the flags snapshot the shards' next export writes.
    for pool, db in shards.items():
        assert export_db(str(db), str(lake), pool, grace_s=0, now=now + dt.timedelta(hours=1)).snapshots == 3
    spark_compare = from_lake("spark", lambda src: compare_pools(src, 86400.0).to_dict())
    assert_same(from_lake("duckdb", lambda src: compare_pools(src, 86400.0).to_dict()), spark_compare)
    src = DbSource(str(whole))
    try:
        want_compare = compare_pools(src, 86400.0).to_dict()
    finally:
        src.close()
    assert len(want_compare["pools"]) == len(POOLS)
    assert_same(spark_compare, want_compare)
