"""Property-based fault tests (hypothesis), each bounded to a few dozen examples:

* random batches, valid and invalid, sent over real gRPC to a real collector, are either refused whole or
  stored exactly as sent (read back through the Query RPC);
* random bytes in the agent's spool are set aside and counted, never crash it, and never hide a good file;
* random statements from a small SQL grammar never write or read a file through the SQL guard.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collector_helpers import node_info
from gpuagent.agent.pipeline.spool import Spool, encode_record
from gpuagent.collector.service import start_collector
from gpuagent.collector.store.db import open_database
from gpuagent.collector.ingest.validate import labels_text
from gpuagent.collector.views import sqlguard
from gpuagent.proto import pb, pb_grpc

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
NOW = time.time_ns()
DAY = 86_400 * 10**9

# ------------------------------------------------------------------------------ random batches

_text = st.text(alphabet="ab=,\\ é_", min_size=1, max_size=6)
_series = st.builds(lambda metric, gpu, labels: (metric, gpu, labels),
                    st.sampled_from(["gpu_util_percent", "load1", "m=x,y", "mé\\tric"]),
                    st.integers(-1, 7), st.dictionaries(_text, _text, max_size=3))
CORRUPTIONS = [None, None, None, "unknown_series", "ts_before_2000", "ts_far_future", "length_mismatch",
               "duplicate_series_id", "empty_metric", "gpu_below_host", "gpu_over_smallint"]


@st.composite
def batches(draw):
    series = draw(st.lists(_series, min_size=1, max_size=4))
    n = draw(st.integers(0, 20))
    picks = [draw(st.integers(0, len(series) - 1)) for _ in range(n)]
    # µs-aligned: samples.ts is a microsecond TIMESTAMP, so that is the precision "as sent" can mean
    ts = [draw(st.integers((NOW - DAY) // 1000, (NOW + 3600 * 10**9) // 1000)) * 1000 for _ in range(n)]
    values = [draw(st.floats(allow_nan=True, allow_infinity=True)) for _ in range(n)]
    corruption = draw(st.sampled_from(CORRUPTIONS))
    if n == 0:     # without samples the series dictionary is never read: nothing to refuse
        corruption = None
    return series, picks, ts, values, corruption


def _build(node_id: str, seq: int, spec) -> tuple[pb.Batch, list[tuple]]:
    series, picks, ts, values, corruption = spec
    prefix = f"p{seq}_"
    b = pb.Batch(node_id=node_id, seq=seq, created_ns=NOW)
    for i, (metric, gpu, labels) in enumerate(series):
        s = b.samples.series.add(id=100 + i, metric=prefix + metric, gpu=gpu)
        s.labels.update(labels)
    b.samples.ts_ns.extend(ts)
    b.samples.series_id.extend(100 + p for p in picks)
    b.samples.value.extend(values)
    expected = [(t, None if series[p][1] < 0 else series[p][1], prefix + series[p][0], labels_text(series[p][2]), v)
                for t, p, v in zip(ts, picks, values)]
    if corruption == "unknown_series":
        b.samples.series_id[0] = 99
    elif corruption == "ts_before_2000":
        b.samples.ts_ns[0] = 1000
    elif corruption == "ts_far_future":
        b.samples.ts_ns[0] = NOW + 3 * DAY
    elif corruption == "length_mismatch":
        b.samples.value.append(1.0)
    elif corruption == "duplicate_series_id":
        b.samples.series.add(id=100, metric=prefix + "other", gpu=-1)
    elif corruption == "empty_metric":
        b.samples.series.add(id=999, metric="", gpu=-1)
    elif corruption == "gpu_below_host":
        b.samples.series.add(id=999, metric=prefix + "x", gpu=-2)
    elif corruption == "gpu_over_smallint":
        b.samples.series.add(id=999, metric=prefix + "x", gpu=40_000)
    return b, expected


def _same_value(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.fixture(scope="module")
def live_collector(tmp_path_factory):
    db = tmp_path_factory.mktemp("prop") / "c.duckdb"
    with start_collector(db, analyze=False) as h:
        with grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            stub = pb_grpc.CollectorStub(ch)
            node = stub.Register(pb.RegisterRequest(node=node_info()), timeout=30).node_id
            yield stub, node


_seq = iter(range(1, 10**6))


def _query(stub, sql: str):
    return json.loads(stub.Query(pb.QueryRequest(sql=sql), timeout=30).rows_json or "[]")


@SETTINGS
@given(spec=batches())
@example(spec=([("load1", 0, {})], [0], [NOW // 1000 * 1000], [1.0], "gpu_over_smallint"))   # was INTERNAL
def test_random_batch_refused_whole_or_stored_exactly(live_collector, spec):
    stub, node = live_collector
    seq = next(_seq)
    batch, expected = _build(node, seq, spec)
    corruption = spec[4]
    try:
        acks = list(stub.Stream(iter([batch]), metadata=(("gpuagent-node-id", node),), timeout=30))
        refused = None
    except grpc.RpcError as exc:
        acks, refused = [], exc
    stored = _query(stub, f"SELECT epoch_ns(ts), gpu, metric, labels, CAST(value AS VARCHAR) FROM samples "
                          f"WHERE metric LIKE 'p{seq}\\_%' ESCAPE '\\'")
    logged = _query(stub, f"SELECT count(*) FROM ingest_log WHERE node_id = '{node}' AND seq = {seq}")[0][0]
    if corruption is None:
        assert refused is None, f"a valid batch was refused: {refused}"
        assert [(a.seq, a.duplicate) for a in acks] == [(seq, False)]
        # NaN is stored as NULL ("not measured", docs/COLLECTOR.md); everything else bit for bit
        got = [(r[0], r[1], r[2], r[3], math.nan if r[4] is None else float(r[4])) for r in stored]
        # a host series' gpu is NULL (None): order it before GPU 0 (None and int do not compare)
        order = lambda r: (r[0], -1 if r[1] is None else r[1], r[2], r[3], repr(r[4]))  # noqa: E731
        want = sorted(expected, key=order)
        got.sort(key=order)
        assert len(got) == len(want) and logged == 1
        for g, w in zip(got, want):
            assert g[:4] == w[:4] and _same_value(g[4], w[4]), (g, w)
    else:
        assert refused is not None, f"batch with {corruption} was stored"
        assert refused.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), \
            (corruption, refused.code(), refused.details())
        assert "\n" not in refused.details()
        assert stored == [] and logged == 0, "part of a refused batch was stored"


# ------------------------------------------------------------------------------ spool bytes

@SETTINGS
@given(junk=st.lists(st.one_of(st.binary(max_size=200),
                               st.builds(lambda n, cut: encode_record(7, b"x" * n, 1, 0)[:cut],
                                         st.integers(0, 40), st.integers(0, 60)),
                               st.builds(lambda i, x: bytes(b ^ (x if k == i else 0) for k, b in
                                                            enumerate(encode_record(7, b"payload!", 1, 0))),
                                         st.integers(0, 35), st.integers(1, 255))),
                     min_size=1, max_size=5))
def test_random_bytes_in_spool_set_aside_never_crash(tmp_path_factory, junk):
    d = tmp_path_factory.mktemp("spool")
    good = encode_record(1, pb.Batch(seq=1).SerializeToString(), 0, 0)
    (d / f"{1:020d}.batch").write_bytes(good)
    bad = 0
    for i, data in enumerate(junk, start=2):
        (d / f"{i:020d}.batch").write_bytes(data)
        bad += 1
    events = []
    sp = Spool(d, on_event=lambda kind, msg, attrs: events.append(kind))
    seqs = sp.seqs()
    readable = [s for s in seqs if sp.read(s) is not None]
    # A junk file can only stay if it happens to be a complete record for its own seq: with a CRC-32 and the
    # seq in the header that does not come out of these strategies, so every junk file is set aside.
    assert readable == [1]
    assert sp.stats()["corrupt_files"] == bad
    assert len(list((d / "corrupt").iterdir())) == bad
    assert events.count("spool_corrupt") == bad
    sp.put(100, b"after", 0)          # the spool still works
    assert sp.read(100) == b"after"


# ------------------------------------------------------------------------------ SQL guard

CANARY = "canary-7f3e9b"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard")
    secret = d / "secret.csv"
    secret.write_text(f"a\n{CANARY}\n")
    (d / "secret.parquet").write_bytes(b"PAR1")
    con = open_database(d / "g.duckdb")
    con.execute("BEGIN; INSERT INTO ingest_log VALUES ('n', 1, now(), 1, 0, 0, 0, 0); COMMIT")
    yield con, d, secret
    con.close()


def _paths(d):
    return st.sampled_from([str(d / "secret.csv"), str(d / "secret.parquet"), str(d / "*.csv"), str(d / "out.csv"),
                            str(d / "new.duckdb"), "/etc/passwd", "~/.bashrc"])


@st.composite
def statements(draw, d):
    p = draw(_paths(d))
    source = draw(st.sampled_from([
        f"read_csv('{p}')", f"read_csv_auto('{p}')", f"read_parquet('{p}')", f"glob('{p}')", f"'{p}'",
        f"read_text('{p}')", f"read_blob('{p}')", f"sniff_csv('{p}')", f"query_table('ingest_log')",
        "ingest_log", "duckdb_settings()"]))
    select = draw(st.sampled_from([f"SELECT * FROM {source}", f"SELECT count(*) FROM {source}",
                                   f"SELECT (SELECT count(*) FROM {source})",
                                   f"SELECT * FROM ingest_log WHERE seq IN (SELECT 1 FROM {source})"]))
    wrapped = draw(st.sampled_from([select, f"WITH t AS ({select}) SELECT * FROM t",
                                    f"SELECT * FROM ({select}) s", f"EXPLAIN {select}",
                                    f"WITH t AS MATERIALIZED ({select}) SELECT * FROM t UNION ALL SELECT * FROM t"]))
    return draw(st.sampled_from([
        wrapped,
        f"COPY ({select}) TO '{d / 'out.csv'}'", f"COPY ingest_log TO '{d / 'out.csv'}'",
        f"COPY ingest_log FROM '{p}'", f"ATTACH '{d / 'new.duckdb'}' AS x", "INSTALL httpfs", "LOAD httpfs",
        "PRAGMA enable_external_access", "SET enable_external_access = true", "CALL checkpoint()",
        f"CALL read_csv('{p}')", f"EXPORT DATABASE '{d / 'exp'}'", f"{wrapped}; COPY ingest_log TO '{d / 'out.csv'}'",
        "SET lock_configuration = false", f"CREATE TABLE z AS {select}", "DELETE FROM ingest_log",
        f"INSERT INTO ingest_log SELECT * FROM ingest_log",
    ]))


@SETTINGS
@given(data=st.data())
def test_sql_grammar_never_reads_or_writes_files_through_the_guard(guarded, data):
    con, d, secret = guarded
    sql = data.draw(statements(d))
    before = sorted(p.name for p in d.iterdir())
    try:
        result = sqlguard.run_readonly(con.cursor(), sql, max_rows=100, timeout_s=10)
        text = json.dumps(result.rows, default=str)
    except (sqlguard.QueryRefused, sqlguard.QueryFailed) as exc:
        text = str(exc)
    assert CANARY not in text, f"{sql!r} read a file: {text[:200]}"
    assert "root:" not in text, f"{sql!r} read /etc/passwd"
    assert sorted(p.name for p in d.iterdir()) == before, f"{sql!r} created a file"
    assert con.execute("SELECT count(*) FROM ingest_log").fetchone()[0] == 1, f"{sql!r} wrote"
    assert con.execute("SELECT current_setting('enable_external_access')").fetchone()[0] is False


def test_profiled_database_keeps_each_statements_profile_and_stays_locked(tmp_path):
    """open_database(profile=True), as benchmarks/analysis_scale.py opens it: the last statement's profile
    says how many rows it scanned, nothing is printed, and the settings are locked as without it."""
    import duckdb

    con = open_database(tmp_path / "p.duckdb", profile=True)
    con.execute("CREATE TEMP TABLE t AS SELECT range AS x FROM range(1000)")
    con.execute("SELECT count(*) FROM t WHERE x % 2 = 0").fetchall()
    assert json.loads(con.get_profiling_information(format="json"))["cumulative_rows_scanned"] == 1000
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_profiling = 'json'")
    plain = open_database(tmp_path / "q.duckdb")
    with pytest.raises(duckdb.Error, match="locked"):
        plain.execute("SET enable_profiling = 'no_output'")
    con.close()
    plain.close()


def test_opening_a_database_clears_the_spill_files_a_killed_process_left_and_sets_the_memory_limit(tmp_path):
    """A process killed in a pass that spilled leaves DuckDB's temp files in <db>.tmp (15 GB after a 30,000-node
    pass); the next process to hold the lock removes them. Other files there are left alone. Every opener gets
    the collector's memory limit unless it asks for another (DuckDB's own default is 80 % of RAM)."""
    db = tmp_path / "c.duckdb"
    open_database(db).close()
    spill = Path(str(db) + ".tmp")
    spill.mkdir(exist_ok=True)
    for name in ("duckdb_temp_storage_DEFAULT-0.tmp", "duckdb_temp_block-4611686018427388032.block"):
        (spill / name).write_bytes(b"\0" * 4096)
    (spill / "operator-notes.txt").write_text("not DuckDB's\n")
    con = open_database(db)
    assert sorted(p.name for p in spill.iterdir()) == ["operator-notes.txt"]
    assert con.execute("SELECT current_setting('memory_limit')").fetchone()[0] in ("488.2 MiB", "512.0 MB")
    con.close()
    con = open_database(db, "1GB")
    assert con.execute("SELECT current_setting('memory_limit')").fetchone()[0] in ("953.6 MiB", "1.0 GB")
    con.close()
