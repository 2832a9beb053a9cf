"""Bearer-token auth and the read-only SQL guard of the Query RPC."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collector_helpers import node_info, sample_batch
from gpuagent.collector.views import client
from gpuagent.collector.service import start_collector
from gpuagent.proto import pb, pb_grpc

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    handle = start_collector(tmp_path_factory.mktemp("auth") / "c.duckdb", token=TOKEN)
    yield handle
    handle.stop()


def _md(token):
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("metadata, words", [
    ((), "requires a token"),
    (_md("wrong"), "does not match"),
    ((("authorization", TOKEN),), "does not match"),   # missing the Bearer scheme
])
def test_calls_without_the_right_token_are_unauthenticated(secured, metadata, words):
    stored = secured.writer.stats["batches"]    # the module's collector: another test may have stored one
    with grpc.insecure_channel(f"127.0.0.1:{secured.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        for call in (lambda: stub.Register(pb.RegisterRequest(node=node_info()), metadata=metadata),
                     lambda: list(stub.Stream(iter([sample_batch("gpu-01", 1)]), metadata=metadata)),
                     lambda: stub.Query(pb.QueryRequest(sql="SELECT 1"), metadata=metadata)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert words in err.value.details()
    assert secured.writer.stats["batches"] == stored


def test_right_token_is_accepted_and_health_needs_none(secured):
    with grpc.insecure_channel(f"127.0.0.1:{secured.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info()), metadata=_md(TOKEN)).node_id
        acks = list(stub.Stream(iter([sample_batch(node_id, 1)]), metadata=_md(TOKEN)))
        assert acks[0].seq == 1
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="gpuagent.v1.Collector"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    res = client.query(f"127.0.0.1:{secured.port}", "SELECT count(*) AS n FROM samples", token=TOKEN)
    assert res.columns == ["n"] and res.rows == [[6]]
    with pytest.raises(client.QueryError, match="requires a token"):
        client.query(f"127.0.0.1:{secured.port}", "SELECT 1")


# ------------------------------------------------------------------------ SQL guard

@pytest.fixture(scope="module")
def open_collector(tmp_path_factory):
    base = tmp_path_factory.mktemp("sql")
    secret = base / "secret.csv"
    secret.write_text("a,b\n1,2\n")
    handle = start_collector(base / "c.duckdb")
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
        list(stub.Stream(iter([sample_batch(node_id, 1)])))
    yield handle, base
    handle.stop()


REFUSED = [
    "INSERT INTO samples VALUES (now(), 'x', 0, 'm', '', 1)",
    "UPDATE nodes SET pool = 'evil'",
    "DELETE FROM samples",
    "DROP TABLE samples",
    "CREATE TABLE t AS SELECT 1",
    "ALTER TABLE nodes ADD COLUMN x INT",
    "ATTACH '{base}/other.duckdb' AS other",
    "DETACH other",
    "COPY samples TO '{base}/out.csv'",
    "COPY samples FROM '{base}/secret.csv'",
    "EXPORT DATABASE '{base}/export'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET threads = 1",
    "PRAGMA enable_profiling",
    "CHECKPOINT",
    "BEGIN TRANSACTION",
    "SELECT * FROM read_csv('{base}/secret.csv')",
    "SELECT * FROM '{base}/secret.csv'",
    "SELECT * FROM read_text('/etc/hostname')",
    "SELECT * FROM read_parquet('{base}/x.parquet')",
    "SELECT * FROM read_json_auto('{base}/x.json')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT nextval('flag_id_seq')",
    "SELECT * FROM query('SELECT 1')",
    "EXPLAIN ANALYZE DELETE FROM samples",
    "SELECT 1; DELETE FROM samples",
    "WITH x AS (SELECT 1) DELETE FROM samples",
]


@pytest.mark.parametrize("sql", REFUSED)
def test_sql_guard_refuses_writes_files_and_extensions(open_collector, sql):
    handle, base = open_collector
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Query(pb.QueryRequest(sql=sql.format(base=base)))
        # The guard itself refuses every one of them (a DuckDB parse/bind error would mean it reached DuckDB).
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert err.value.details()
        res = json.loads(stub.Query(pb.QueryRequest(sql="SELECT (SELECT count(*) FROM samples), "
                                                       "(SELECT count(*) FROM nodes WHERE pool = 'a'), "
                                                       "(SELECT count(*) FROM duckdb_databases() "
                                                       " WHERE NOT internal)")).rows_json)
        assert res == [[6, 1, 1]]
    assert not (base / "out.csv").exists() and not (base / "export").exists()
    assert not (base / "other.duckdb").exists()


def test_sql_guard_messages_say_why(open_collector):
    handle, base = open_collector
    target = f"127.0.0.1:{handle.port}"
    with pytest.raises(client.QueryError, match="refused: DELETE statements are not allowed.*only SELECT"):
        client.query(target, "DELETE FROM samples")
    with pytest.raises(client.QueryError, match="refused: the function read_csv"):
        client.query(target, f"SELECT * FROM read_csv('{base}/secret.csv')")
    with pytest.raises(client.QueryError, match="no file, network or extension access"):
        client.query(target, f"SELECT * FROM '{base}/secret.csv'")
    with pytest.raises(client.QueryError, match="exactly one statement"):
        client.query(target, "SELECT 1; SELECT 2")


@pytest.mark.parametrize("sql, expect", [
    ("SELECT count(*) FROM samples", [[6]]),
    ("WITH m AS (SELECT metric FROM samples) SELECT count(DISTINCT metric) FROM m", [[3]]),
    ("SELECT node_id, gpu FROM v_node_gpus ORDER BY gpu", [["gpu-01", 0], ["gpu-01", 1]]),
    ("SELECT count(*) > 5 FROM (SHOW TABLES)", [[True]]),
    ("FROM nodes SELECT hostname", [["gpu-01"]]),
])
def test_sql_guard_lets_reads_through(open_collector, sql, expect):
    handle, _ = open_collector
    assert client.query(f"127.0.0.1:{handle.port}", sql).rows == expect


def test_explain_and_describe_work(open_collector):
    handle, _ = open_collector
    res = client.query(f"127.0.0.1:{handle.port}", "EXPLAIN SELECT * FROM samples")
    assert res.rows and "samples" in json.dumps(res.rows).lower()
    res = client.query(f"127.0.0.1:{handle.port}", "DESCRIBE samples")
    assert ["ts", "TIMESTAMP"] == res.rows[0][:2]


def test_row_cap_truncates(open_collector):
    handle, _ = open_collector
    res = client.query(f"127.0.0.1:{handle.port}", "SELECT * FROM range(100)", max_rows=7)
    assert len(res.rows) == 7 and res.truncated


def test_table_format_aligns_numbers_and_avoids_exponents():
    res = client.QueryResult(["metric", "n", "v"], ["VARCHAR", "BIGINT", "DOUBLE"],
                             [["mem_used_bytes", 5, 2.35813e10], ["cpu", 12, 0.1234567], ["x", None, 1e-7]], True)
    assert client.format_result(res).splitlines() == [
        "metric             n            v",
        "--------------  ----  -----------",
        "mem_used_bytes     5  23581300000",
        "cpu               12     0.123457",
        "x               NULL        1e-07",
        "(3 rows, truncated)",
    ]
    assert json.loads(client.format_result(res, "json"))[0] == {"metric": "mem_used_bytes", "n": 5, "v": 2.35813e10}
    assert client.format_result(res, "csv").splitlines()[3] == "x,,1e-07"
    # A wide text column at the end pads no line, the header included (no trailing blanks to copy).
    wide = client.QueryResult(["node_id", "sentence"], ["VARCHAR", "VARCHAR"], [["n1", "a long sentence"]], False)
    assert client.format_result(wide).splitlines()[0] == "node_id  sentence"
