"""Numbered migrations: a fresh file gets them all; an older file is upgraded in place; a newer one is refused."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import grpc
import pytest

from collector_helpers import NOW_NS, node_info, sample_batch
from gpuagent.collector.service import CollectorError, start_collector
from gpuagent.collector.ingest.validate import prepare_batch
from gpuagent.collector.store import schema, tables
from gpuagent.proto import pb, pb_grpc


def test_fresh_database_gets_every_migration(tmp_path):
    db = tmp_path / "c.duckdb"
    start_collector(db).stop()
    with duckdb.connect(str(db), read_only=True) as con:
        assert schema.current_version(con) == schema.LATEST_VERSION >= 1
        names = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert {"nodes", "gpus", "samples", "probe_results", "probe_metrics", "jobs", "job_samples", "job_steps",
            "events", "flags", "ingest_log", "schema_migrations", "v_node_gpus", "v_probe_metrics"} <= names


def test_file_at_version_1_opens_in_this_collector_and_keeps_its_data(tmp_path):
    db = tmp_path / "old.duckdb"
    with duckdb.connect(str(db)) as con:        # what a collector at schema version 1 left behind
        schema.migrate(con, target=1)
        con.execute("INSERT INTO nodes (node_id, machine_id, hostname, first_seen, last_seen) "
                    "VALUES ('old-node', 'm-old', 'old', TIMESTAMP '2026-01-01', TIMESTAMP '2026-01-01')")
        con.execute("INSERT INTO ingest_log VALUES ('old-node', 1, TIMESTAMP '2026-01-01', 6, 0, 0, 0, 0)")
        assert schema.current_version(con) == 1
    with start_collector(db) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        resp = stub.Register(pb.RegisterRequest(node=node_info("old", "m-old")))
        assert resp.node_id == "old-node" and resp.last_committed_seq == 1
        acks = list(stub.Stream(iter([sample_batch("old-node", 1), sample_batch("old-node", 2)])))
        assert [(a.seq, a.duplicate) for a in acks] == [(1, True), (2, False)]
    with duckdb.connect(str(db), read_only=True) as con:
        assert schema.current_version(con) == schema.LATEST_VERSION
        assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 6


def test_upgrade_applies_only_missing_migrations_in_order(tmp_path):
    shipped = schema.migrations()
    extra = schema.Migration(len(shipped) + 1, "test_extra",
                             "ALTER TABLE nodes ADD COLUMN rack VARCHAR; CREATE TABLE test_extra (x INTEGER);")
    db = tmp_path / "c.duckdb"
    with duckdb.connect(str(db)) as con:
        assert schema.migrate(con) == list(range(1, len(shipped) + 1))
        con.execute("INSERT INTO nodes (node_id, machine_id, hostname, first_seen, last_seen) "
                    "VALUES ('n', 'm', 'h', TIMESTAMP '2026-01-01', TIMESTAMP '2026-01-01')")
        assert schema.migrate(con) == []
        assert schema.migrate(con, available=[*shipped, extra]) == [len(shipped) + 1]
        assert con.execute("SELECT node_id, rack FROM nodes").fetchall() == [("n", None)]
        assert con.execute("SELECT max(version), count(*) FROM schema_migrations").fetchone() == (
            len(shipped) + 1, len(shipped) + 1)


def test_failed_migration_rolls_back_and_leaves_version(tmp_path):
    shipped = schema.migrations()
    broken = schema.Migration(len(shipped) + 1, "broken", "CREATE TABLE half (x INTEGER); SELECT * FROM nope;")
    with duckdb.connect(str(tmp_path / "c.duckdb")) as con:
        schema.migrate(con)
        with pytest.raises(duckdb.Error):
            schema.migrate(con, available=[*shipped, broken])
        assert schema.current_version(con) == len(shipped)
        assert not con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'half'").fetchone()[0]


def test_file_from_a_newer_collector_is_refused(tmp_path):
    db = tmp_path / "new.duckdb"
    with duckdb.connect(str(db)) as con:
        schema.migrate(con)
        con.execute("INSERT INTO schema_migrations VALUES (99, 'future', TIMESTAMP '2030-01-01')")
    with pytest.raises(CollectorError, match="schema version 99 .* upgrade gpuagent"):
        start_collector(db)


def test_every_table_declaration_matches_the_migrated_database(tmp_path):
    """store/tables.py and the migrations describe the same columns, in the same order, with the same types."""
    with duckdb.connect(str(tmp_path / "c.duckdb")) as con:
        schema.migrate(con)
        assert tables.schema_mismatches(con) == []
        described = con.execute("DESCRIBE job_steps").fetchall()
        assert [(r[0], r[1]) for r in described] == [(c.name, c.sql_type) for c in tables.JOB_STEPS.columns]
        # A migration that changed a declared column would be caught, by name and by type.
        con.execute("ALTER TABLE events RENAME COLUMN attrs TO attributes")
        con.execute("ALTER TABLE ingest_log ALTER n_events TYPE BIGINT")
        problems = tables.schema_mismatches(con)
    assert len(problems) == 2
    assert problems[0].startswith("table events:") and "attributes" in problems[0]
    assert problems[1].startswith("table ingest_log:") and "BIGINT" in problems[1]


def test_prepared_tables_have_the_declared_columns_and_types():
    """Validation builds every table from its declaration (samples dictionary-encode some columns)."""
    b = sample_batch("n", 1)
    t = NOW_NS - 10**9
    b.probe_results.add(probe="pcie", status="ok", params={"size_mb": "256"}, metrics={"gbps": 25.0},
                        started_ns=t, ended_ns=t + 10**6, gpu=0)
    b.job_samples.add(ts_ns=t, job_id="slurm:1", pid=7, gpu=0, rank=-1)
    b.job_steps.add(ts_ns=t, job_id="slurm:1", rank=0, steps=3)
    b.events.add(ts_ns=t, kind="job_end", gpu=-1, attrs={"job_id": "slurm:1", "duration_s": "5"})
    b.summaries.series.add(id=0, metric="gpu_temperature_celsius", gpu=0)
    b.summaries.interval_ns = 60 * 10**9
    start = t - t % b.summaries.interval_ns
    for name, v in (("start_ns", start), ("series_id", 0), ("count", 60), ("sum", 60.0), ("min", 0.5), ("max", 2.0)):
        getattr(b.summaries, name).append(v)
    w = b.raw_windows.add(request_id="r1", since_ns=start, until_ns=t, final=True, held_since_ns=start)
    w.samples.series.add(id=0, metric="gpu_temperature_celsius", gpu=0)
    w.samples.ts_ns.append(t)
    w.samples.series_id.append(0)
    w.samples.value.append(1.0)
    prepared = prepare_batch(b)
    for decl in tables.BATCH_TABLES:
        got = getattr(prepared, decl.name)
        assert got is not None, decl.name
        types = [f.type.value_type if isinstance(f.type, pa.DictionaryType) else f.type for f in got.schema]
        assert (got.schema.names, types) == (decl.names, [c.type for c in decl.columns]), decl.name


def test_a_collector_killed_right_after_migrating_opens_again(tmp_path):
    """The migrations' DDL must not be left in the WAL: DuckDB 1.5.6 cannot replay an ALTER TABLE of a table
    with a DEFAULT nextval column (007 adds flags.finding_id), so a kill before the first checkpoint used to
    leave a file that would not open."""
    import subprocess
    import sys

    db = tmp_path / "c.duckdb"
    code = ("import os, sys, duckdb\n"
            "from gpuagent.collector.store import schema\n"
            "con = duckdb.connect(sys.argv[1])\n"
            "con.execute(\"SET checkpoint_threshold = '1GB'\")\n"
            "schema.migrate(con)\n"
            "os._exit(0)\n")          # no close, no checkpoint at exit: what SIGKILL leaves behind
    subprocess.run([sys.executable, "-c", code, str(db)], check=True)
    with duckdb.connect(str(db)) as con:
        assert schema.current_version(con) == schema.LATEST_VERSION
        assert "finding_id" in [r[0] for r in con.execute("DESCRIBE flags").fetchall()]
