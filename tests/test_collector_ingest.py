"""Register, Stream and Ack against a real in-process collector on loopback with a real DuckDB file."""

from __future__ import annotations

import json
import math
import threading
import time

import duckdb
import grpc
import pytest

from collector_helpers import NOW_NS, node_info, sample_batch
from gpuagent.collector.service import start_collector
from gpuagent.proto import pb, pb_grpc


@pytest.fixture
def collector(tmp_path):
    handle = start_collector(tmp_path / "c.duckdb")
    yield handle
    handle.stop()


@pytest.fixture
def stub(collector):
    with grpc.insecure_channel(f"127.0.0.1:{collector.port}") as ch:
        yield pb_grpc.CollectorStub(ch)


def rows(db_path, sql):
    with duckdb.connect(str(db_path), read_only=True) as con:
        return con.execute(sql).fetchall()


def test_register_gives_stable_readable_ids_and_stores_node(tmp_path):
    db = tmp_path / "c.duckdb"
    with start_collector(db) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        first = stub.Register(pb.RegisterRequest(node=node_info("GPU-01", "m-1")))
        again = stub.Register(pb.RegisterRequest(node=node_info("GPU-01", "m-1", gpus=1)))
        other = stub.Register(pb.RegisterRequest(node=node_info("gpu-01", "m-2")))
        assert first.node_id == again.node_id == "gpu-01"
        assert first.last_committed_seq == 0
        assert other.node_id != first.node_id and other.node_id.startswith("gpu-01-")
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(pb.RegisterRequest(node=pb.NodeInfo(hostname="x")))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        list(stub.Stream(iter([sample_batch("gpu-01", 1), sample_batch("gpu-01", 2)])))
    # a restart keeps the id and reports what is stored; a node is (machine id, hostname), so the same
    # machine under a new hostname is a new node (docs/COLLECTOR.md, "Node identity") and the old one keeps its rows
    with start_collector(db) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        resp = stub.Register(pb.RegisterRequest(node=node_info("Gpu-01", "m-1")))
        assert resp.node_id == "gpu-01" and resp.last_committed_seq == 2
        renamed = stub.Register(pb.RegisterRequest(node=node_info("renamed", "m-1")))
        assert renamed.node_id == "renamed" and renamed.last_committed_seq == 0
    node = rows(db, "SELECT hostname, pool, provider, price_per_gpu_hour, virtualized, virt_type, gpu_count, "
                    "gpu_model, labels['pool'], fingerprint FROM nodes WHERE node_id = 'gpu-01'")[0]
    assert node[:9] == ("Gpu-01", "a", "onprem", 2.5, True, "kvm", 2, "NVIDIA H100 80GB HBM3", "a")
    assert json.loads(node[9])["cpuid_hypervisor_vendor"] == "KVMKVMKVM"
    # re-registering with one GPU fewer removed gpu 1 at that time; the restart registered two again
    assert rows(db, "SELECT count(*) FROM gpus WHERE node_id = 'gpu-01'")[0][0] == 2


def test_stream_stores_samples_and_acks_after_commit(collector, stub):
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    acks = list(stub.Stream(iter([sample_batch(node_id, s) for s in (1, 2, 3)])))
    assert [a.seq for a in acks] == [1, 2, 3]
    assert not any(a.duplicate for a in acks)
    assert acks[-1].highest_committed_seq == 3
    # acked means committed: a separate cursor sees the rows now
    got = collector.writer.stats
    assert got["batches"] == 3 and got["samples"] == 18
    res = stub.Query(pb.QueryRequest(sql="SELECT gpu, metric, labels, value FROM samples "
                                         "WHERE value = 1000 OR value = 1001 OR value = 1002 ORDER BY value"))
    assert json.loads(res.rows_json) == [[0, "gpu_throttle_active", "a=1,reason=sw_power_cap", 1000.0],
                                         [None, "cpu_steal_percent", "", 1001.0],
                                         [1, "gpu_util_percent", "", 1002.0]]
    res = stub.Query(pb.QueryRequest(sql="SELECT count(*), count(DISTINCT ts) FROM samples"))
    assert json.loads(res.rows_json) == [[18, 18]]
    res = stub.Query(pb.QueryRequest(sql="SELECT seq, n_samples FROM ingest_log ORDER BY seq"))
    assert json.loads(res.rows_json) == [[1, 6], [2, 6], [3, 6]]


def test_resent_batch_is_acked_as_duplicate_and_not_stored_twice(tmp_path):
    db = tmp_path / "c.duckdb"
    with start_collector(db) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
        acks = list(stub.Stream(iter([sample_batch(node_id, 1), sample_batch(node_id, 1),
                                      sample_batch(node_id, 5)])))
        assert [(a.seq, a.duplicate) for a in acks] == [(1, False), (1, True), (5, False)]
        # highest_committed_seq is as of the commit that held the batch (batches may share one)
        assert acks[0].highest_committed_seq in (1, 5) and acks[-1].highest_committed_seq == 5
    # after a restart the dedupe state comes from ingest_log (with a gap between 1 and 5)
    with start_collector(db) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        acks = list(stub.Stream(iter([sample_batch(node_id, s) for s in (5, 1, 3)])))
        assert [(a.seq, a.duplicate) for a in acks] == [(5, True), (1, True), (3, False)]
        assert acks[-1].highest_committed_seq == 5
    assert rows(db, "SELECT count(*) FROM samples")[0][0] == 18
    assert rows(db, "SELECT count(*) FROM (SELECT DISTINCT * FROM samples)")[0][0] == 18
    assert rows(db, "SELECT list(seq ORDER BY seq) FROM ingest_log")[0][0] == [1, 3, 5]


def test_probe_results_jobs_and_events_land_in_their_tables(collector, stub):
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    b = pb.Batch(node_id=node_id, seq=1)
    t = NOW_NS - 100 * 10**9
    b.probe_results.add(probe="pcie", status="ok", params={"size_mb": "256", "direction": "h2d"},
                        metrics={"h2d_gbps": 24.5, "h2d_cv_percent": 1.5}, started_ns=t, ended_ns=t + 2 * 10**9,
                        env={"numa_node": "0"}, gpu=0)
    b.probe_results.add(probe="storage", status="skipped", reason="a job uses the disk", started_ns=t, gpu=-1)
    for k in range(3):
        b.job_samples.add(ts_ns=t + k * 10**9, job_id="slurm:42", job_name="llama", source="slurm", pid=100,
                          rank=0, local_rank=0, world_size=8, gpu=0, gpu_util_percent=90.0 + k)
    b.job_steps.add(ts_ns=t + 5 * 10**9, job_id="slurm:42", job_name="llama", rank=0, window_s=5, steps=10,
                    step_time_p50_s=0.5, data_wait_fraction=-1)
    b.job_steps.add(ts_ns=t + 10 * 10**9, job_id="slurm:42", rank=1, window_s=5, steps=10, data_wait_fraction=0.25)
    b.events.add(ts_ns=t + 1, kind="xid", gpu=1, message="Xid 79", value=79, attrs={"xid": "79"})
    acks = list(stub.Stream(iter([b])))
    assert acks[0].seq == 1
    b2 = pb.Batch(node_id=node_id, seq=2)
    b2.events.add(ts_ns=t + 20 * 10**9, kind="job_end", message="job ended", value=77.5,
                  attrs={"job_id": "slurm:42"}, gpu=-1)
    list(stub.Stream(iter([b2])))

    def q(sql):
        return json.loads(stub.Query(pb.QueryRequest(sql=sql)).rows_json)

    assert q("SELECT probe, gpu, status, reason, params, params_key, env, duration_s FROM probe_results "
             "ORDER BY probe") == [
        ["pcie", 0, "ok", None, '{"direction":"h2d","size_mb":"256"}', "direction=h2d,size_mb=256",
         '{"numa_node":"0"}', 2.0],
        ["storage", None, "skipped", "a job uses the disk", "{}", "", "{}", 0.0]]
    assert q("SELECT metric, value FROM v_probe_metrics ORDER BY metric") == [
        ["h2d_cv_percent", 1.5], ["h2d_gbps", 24.5]]
    assert q("SELECT count(*), max(gpu_util_percent) FROM job_samples") == [[3, 92.0]]
    assert q("SELECT rank, data_wait_fraction FROM job_steps ORDER BY rank") == [[0, None], [1, 0.25]]
    job = q("SELECT job_name, source, world_size, first_seen, last_seen, ended_at, duration_s, "
            "avg_gpu_util_percent FROM jobs")
    assert len(job) == 1
    name, source, world, first, last, ended, duration, util = job[0]
    assert (name, source, world, util) == ("llama", "slurm", 8, 77.5)
    assert ended == last and math.isclose(duration, 20.0)
    assert q("SELECT kind, gpu, value, attrs FROM events ORDER BY ts") == [
        ["xid", 1, 79.0, '{"xid":"79"}'], ["job_end", None, 77.5, '{"job_id":"slurm:42"}']]


def test_job_end_without_gpu_utilization_stores_null_not_zero(collector, stub):
    """A CPU-only job's mean GPU utilization is unknown: the agent sends NaN and the collector stores NULL."""
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    t = NOW_NS - 50 * 10**9
    b = pb.Batch(node_id=node_id, seq=1)
    b.job_samples.add(ts_ns=t, job_id="pid:7", job_name="cpu-job", source="process", pid=7, gpu=-1)
    b.events.add(ts_ns=t + 10**9, kind="job_end", message="job pid:7 ended", value=float("nan"),
                 attrs={"job_id": "pid:7", "duration_s": "1.0"}, gpu=-1)
    assert [a.seq for a in stub.Stream(iter([b]))] == [1]

    def q(sql):
        return json.loads(stub.Query(pb.QueryRequest(sql=sql)).rows_json)

    assert q("SELECT avg_gpu_util_percent, duration_s, ended_at IS NOT NULL FROM jobs") == [[None, 1.0, True]]
    assert q("SELECT kind, value FROM events") == [["job_end", None]]


def test_job_end_times_set_started_at_ended_at_and_duration(collector, stub):
    """The agent's job_end carries when the job's processes started and when they were last seen alive:
    started_at and ended_at store those, first_seen/last_seen keep the sample times, duration_s is the
    agent's. A job known only from its job_end takes first_seen from the event too."""
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    t = (NOW_NS - 60 * 10**9) // 1000 * 1000    # TIMESTAMP keeps microseconds
    b = pb.Batch(node_id=node_id, seq=1)
    b.job_samples.add(ts_ns=t + 5 * 10**9, job_id="slurm:7", job_name="short", source="slurm", pid=7, gpu=-1)
    b.events.add(ts_ns=t + 9 * 10**9, kind="job_end", message="job slurm:7 ended", value=float("nan"), gpu=-1,
                 attrs={"job_id": "slurm:7", "duration_s": "6.250", "started_ns": str(t),
                        "first_seen_ns": str(t + 5 * 10**9), "last_seen_ns": str(t + 6_250_000_000)})
    b.events.add(ts_ns=t + 9 * 10**9, kind="job_end", message="job pid:8 ended", value=50.0, gpu=-1,
                 attrs={"job_id": "pid:8", "duration_s": "2.000", "started_ns": str(t + 10**9),
                        "first_seen_ns": str(t + 2 * 10**9), "last_seen_ns": str(t + 3 * 10**9)})
    assert [a.seq for a in stub.Stream(iter([b]))] == [1]

    def q(sql):
        return json.loads(stub.Query(pb.QueryRequest(sql=sql)).rows_json)

    got = q(f"SELECT job_id, epoch_ns(started_at) - {t}, epoch_ns(first_seen) - {t}, epoch_ns(last_seen) - {t}, "
            f"epoch_ns(ended_at) - {t}, duration_s FROM jobs ORDER BY job_id")
    assert got == [["pid:8", 10**9, 2 * 10**9, 3 * 10**9, 3 * 10**9, 2.0],
                   ["slurm:7", 0, 5 * 10**9, 6_250_000_000, 6_250_000_000, 6.25]]


@pytest.mark.parametrize("attrs, word", [({"started_ns": "soon"}, "non-integer started_ns 'soon'"),
                                         ({"last_seen_ns": "12"}, "has last_seen_ns 12, not a plausible Unix time")])
def test_job_end_with_bad_times_is_refused_and_stores_nothing(collector, stub, attrs, word):
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    b = sample_batch(node_id, 1, n=3)
    b.events.add(ts_ns=NOW_NS - 10**9, kind="job_end", message="job x ended", value=1.0, gpu=-1,
                 attrs={"job_id": "x", "duration_s": "1.0", **attrs})
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Stream(iter([b])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in err.value.details()
    counts = json.loads(stub.Query(pb.QueryRequest(
        sql="SELECT (SELECT count(*) FROM samples), (SELECT count(*) FROM jobs)")).rows_json)
    assert counts == [[0, 0]]


def test_nan_values_are_stored_as_null(collector, stub):
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    b = sample_batch(node_id, 1, n=3)
    b.samples.value[1] = float("nan")
    list(stub.Stream(iter([b])))
    res = json.loads(stub.Query(pb.QueryRequest(sql="SELECT count(*), count(value) FROM samples")).rows_json)
    assert res == [[3, 2]]


def test_many_concurrent_streams_share_the_writer(collector, stub):
    ids = [stub.Register(pb.RegisterRequest(node=node_info(f"n{i}", f"m{i}"))).node_id for i in range(8)]
    results: dict[str, list] = {}

    def run(node_id):
        results[node_id] = list(stub.Stream(iter([sample_batch(node_id, s, n=300) for s in range(1, 21)])))

    threads = [threading.Thread(target=run, args=(n,)) for n in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all([a.seq for a in results[n]] == list(range(1, 21)) for n in ids)
    res = json.loads(stub.Query(pb.QueryRequest(sql="SELECT count(*) FROM samples")).rows_json)
    assert res == [[8 * 20 * 300]]
    assert collector.writer.stats["groups"] <= 8 * 20


def test_probe_result_without_times_takes_the_batch_time(collector, stub):
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    created = NOW_NS - 5 * 10**9
    b = pb.Batch(node_id=node_id, seq=1, created_ns=created)
    b.probe_results.add(probe="collective", status="failed", reason="gloo init timed out", gpu=-1)
    b.probe_results.add(probe="host", status="ok", ended_ns=created - 10**9, metrics={"syscall_ns": 80.0})
    assert [a.seq for a in stub.Stream(iter([b]))] == [1]
    got = json.loads(stub.Query(pb.QueryRequest(
        sql="SELECT probe, epoch_us(started_at), epoch_us(ended_at), duration_s FROM probe_results "
            "ORDER BY probe")).rows_json)
    assert got == [["collective", created // 1000, created // 1000, 0.0],
                   ["host", (created - 10**9) // 1000, (created - 10**9) // 1000, 0.0]]


def test_in_flight_bound_makes_streams_wait_but_loses_nothing(tmp_path):
    from gpuagent.collector.service import ServerOptions

    with start_collector(tmp_path / "c.duckdb", options=ServerOptions(max_inflight_samples=1000)) as h, \
            grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        ids = [stub.Register(pb.RegisterRequest(node=node_info(f"w{i}", f"mw{i}"))).node_id for i in range(4)]
        results: dict[str, list] = {}

        def run(node_id):
            # 600 samples per batch: two batches never fit the 1000-sample bound together
            results[node_id] = [a.seq for a in stub.Stream(iter([sample_batch(node_id, s, n=600)
                                                                  for s in range(1, 11)]))]

        threads = [threading.Thread(target=run, args=(n,)) for n in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(results[n] == list(range(1, 11)) for n in ids)
        assert h.writer.stats["samples"] == 4 * 10 * 600
        assert h.writer.stats["groups"] == 40     # the bound admits one batch at a time


def test_re_registering_changed_gpus_updates_them_and_unchanged_ones_are_left_alone(tmp_path):
    """Register skips the gpus upsert when a reconnecting agent sends the same GPUs (it scanned the whole gpus
    table every time); the rows stay as they were, and a changed GPU (PCIe downtrained to gen 4, a GPU gone) is
    still written at once."""
    from gpuagent.collector.store import schema
    from gpuagent.collector.store.nodes import register_node

    class Recording:
        """The connection, with the statements register_node runs written down."""
        def __init__(self, con):
            self.con, self.sql = con, []

        def execute(self, sql, *args):
            self.sql.append(" ".join(sql.split()))
            return self.con.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self.con, name)

    con = duckdb.connect(str(tmp_path / "r.duckdb"))
    schema.migrate(con)
    node = register_node(con, node_info(gpus=3))
    gpus = "SELECT gpu, pcie_gen_current, uuid FROM gpus WHERE node_id = ? ORDER BY gpu"
    before = con.execute(gpus, [node]).fetchall()
    assert [r[1] for r in before] == [5, 5, 5]
    rec = Recording(con)
    assert register_node(rec, node_info(gpus=3)) == node
    assert con.execute(gpus, [node]).fetchall() == before
    assert not [q for q in rec.sql if q.startswith(("INSERT INTO gpus", "DELETE FROM gpus"))], rec.sql
    changed = node_info(gpus=2)
    changed.gpus[1].pcie_gen_current = 4
    rec = Recording(con)
    assert register_node(rec, changed) == node
    assert con.execute(gpus, [node]).fetchall() == [(0, 5, before[0][2]), (1, 4, before[1][2])]
    assert [q for q in rec.sql if q.startswith("INSERT INTO gpus")] and \
        [q for q in rec.sql if q.startswith("DELETE FROM gpus")], rec.sql
    con.close()


def test_nodes_last_seen_is_each_nodes_newest_commit_written_once_an_interval(tmp_path):
    """The writer keeps each node's newest commit time and writes them in one UPDATE per touch interval (an
    UPDATE per commit scanned ``nodes`` every time); each node gets its own time, not the touch's."""
    from concurrent.futures import Future

    from gpuagent.collector.ingest.validate import prepare_batch
    from gpuagent.collector.store import schema
    from gpuagent.collector.store.nodes import register_node
    from gpuagent.collector.store.writer import Writer

    con = duckdb.connect(str(tmp_path / "w.duckdb"))
    schema.migrate(con)
    a, b = register_node(con, node_info("a", "m-a")), register_node(con, node_info("b", "m-b"))
    con.execute("UPDATE nodes SET last_seen = TIMESTAMP '2000-01-01'")
    writer = Writer(con, node_touch_interval_s=3600.0)    # the test says when the interval is over

    def store(node, seq):
        done: Future = Future()
        writer.submit(prepare_batch(sample_batch(node, seq)), lambda ack, exc: done.set_result(exc))
        assert done.result(timeout=30) is None

    def seen():
        return dict(writer.call(lambda c: c.execute("SELECT node_id, last_seen FROM nodes").fetchall()).result())

    try:
        store(a, 1)                       # the first commit touches at once
        first = seen()
        assert first[a].year > 2000 and first[b].year == 2000
        store(b, 1)                       # within the interval: held back ...
        assert seen()[b].year == 2000
        writer._touch_due = 0.0           # the interval is over
        store(a, 2)                       # ... and written with the next touch, at its own commit time
        after = seen()
        assert first[a] < after[a] and first[a] <= after[b] < after[a]
        store(b, 2)                       # held back again: stopping the writer writes it
    finally:
        writer.stop()
    assert con.execute("SELECT last_seen FROM nodes WHERE node_id = ?", [b]).fetchone()[0] > after[b]
    con.close()
