"""Spark over the lake answers what DuckDB over the same lake answers, through the real CLI commands
(`lake sql`, `lake baselines`, `compare --by pool --lake`), on a SYNTHETIC fleet the real collector stored.

The commands run in this process (click's runner) so one Spark JVM (local[2]) serves all of them: a Spark
start costs ~20-30 s here. Needs pyspark and Java 17+ (the `lake` extra, installed by .ci/run)."""

from __future__ import annotations

import datetime as dt
import json
import shutil

import pytest
from click.testing import CliRunner

from gpuagent.collector.cli import main
from gpuagent.collector.lake.export import export_db
from gpuagent.collector.lake import layout
from sim_helpers import fleet_db
from test_lake import _far_future, assert_same

from tools import needs, python_module_or_skip
python_module_or_skip("pyspark", reason="the lake extra (pyspark) is part of the test environment in .ci/run")

# Spark on two shared cores under load: minutes, not seconds (~2 min on an idle machine).
# Spark needs Java 17+: without it each test skips with a missing-tool line (fails under CI=true)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), needs("java")]
SPARK = ("--engine", "spark", "--master", "local[2]")
DUCK = ("--engine", "duckdb")


@pytest.fixture(scope="module")
def lake_dir(tmp_path_factory):
    fx = fleet_db(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("sparklake")
    db = tmp / "shard.duckdb"
    shutil.copy(fx.db, db)
    lake = tmp / "lake"
    res = export_db(str(db), str(lake), "s1", grace_s=0, now=_far_future(db))
    assert res.rows > 0
    return lake


def cli(*args) -> str:
    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.stdout


# Aggregates of every kind the fleet-wide steps use: counts per partition, sums, medians, percentiles,
# FILTER, a join to the node snapshot, timestamps.
QUERIES = [
    "SELECT shard, date, hour, count(*) AS n, min(ts) AS first, max(ts) AS last FROM samples "
    "GROUP BY ALL ORDER BY ALL",
    "SELECT n.pool, s.metric, count(*) AS n, avg(s.value) AS mean, median(s.value) AS med, "
    "percentile_cont(0.9) WITHIN GROUP (ORDER BY s.value) AS p90, "
    "count(*) FILTER (WHERE s.value > 50) AS above_50 "
    "FROM samples s JOIN nodes n USING (node_id) GROUP BY ALL ORDER BY ALL",
    "SELECT p.probe, p.metric, count(*) AS n, sum(p.value) AS total, max(m.max) AS peak_1m "
    "FROM probe_metrics p LEFT JOIN (SELECT node_id, max(max) AS max FROM samples_1m GROUP BY ALL) m "
    "USING (node_id) GROUP BY ALL ORDER BY ALL",
]


def test_lake_sql_baselines_and_compare_on_spark_equal_duckdb(lake_dir, tmp_path):
    lake = ("--lake", str(lake_dir))
    for q in QUERIES:
        want = json.loads(cli("lake", "sql", q, *lake, *DUCK, "--format", "json"))
        got = json.loads(cli("lake", "sql", q, *lake, *SPARK, "--format", "json"))
        assert want, q
        assert [list(r) for r in got] == [list(r) for r in want], q   # same columns, same order
        assert_same(got, want, q)

    # Baselines: the same rows, computed as of one time (the windows end at it: two runs a minute apart on a
    # loaded machine would judge different windows); each run publishes the lake's file.
    as_of = ("--as-of", dt.datetime.now(dt.timezone.utc).replace(tzinfo=None).isoformat())
    def baselines(engine) -> dict[str, list[dict]]:
        out = json.loads(cli("lake", "baselines", *lake, *engine, *as_of, "--format", "json"))
        return {k: [{c: v for c, v in r.items() if c != "computed_at"} for r in rows] for k, rows in out.items()}

    both = baselines(DUCK)
    want = both["baselines"]
    assert want and all(r["baseline"] is not None and r["nodes"] > 0 for r in want)
    assert both["noise_medians"] and all(r["fleet_cv"] is not None and r["nodes"] > 0 for r in both["noise_medians"])
    got_both = baselines(SPARK)
    got = got_both["baselines"]
    assert_same(got, want)
    assert_same(got_both["noise_medians"], both["noise_medians"])
    import pyarrow.parquet as pq

    published = pq.read_table(layout.open_lake(str(lake_dir)).path(layout.BASELINES_FILE)).to_pylist()
    assert_same([{k: v for k, v in r.items() if k != "computed_at"} for r in published], want)

    want = json.loads(cli("compare", "--by", "pool", *lake, *DUCK, "--format", "json"))
    got = json.loads(cli("compare", "--by", "pool", *lake, *SPARK, "--format", "json"))
    assert len(want["pools"]) >= 2 and want["reference_pool"]
    assert_same(got, want)


def test_a_bad_query_on_spark_is_one_sentence(lake_dir):
    r = CliRunner().invoke(main, ["lake", "sql", "SELECT nope FROM samples", "--lake", str(lake_dir), *SPARK])
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: the query failed on spark:"), r.output
