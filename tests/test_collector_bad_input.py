"""Malformed, oversized and unregistered batches are refused whole; other streams keep going."""

from __future__ import annotations

import json
import threading

import grpc
import pytest

from collector_helpers import NOW_NS, node_info, sample_batch
from gpuagent.collector.service import start_collector
from gpuagent.collector.ingest.validate import Limits
from gpuagent.proto import pb, pb_grpc


@pytest.fixture
def env(tmp_path):
    handle = start_collector(tmp_path / "c.duckdb", limits=Limits(max_samples_per_batch=1000))
    ch = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = pb_grpc.CollectorStub(ch)
    node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
    yield stub, node_id
    ch.close()
    handle.stop()


def count(stub, table="samples"):
    return json.loads(stub.Query(pb.QueryRequest(sql=f"SELECT count(*) FROM {table}")).rows_json)[0][0]


def _mismatch(b):
    b.samples.value.append(1.0)


def _unknown_series(b):
    b.samples.series_id[2] = 999


def _duplicate_series(b):
    b.samples.series.add(id=3, metric="other_percent", gpu=-1)


def _seconds_not_ns(b):
    b.samples.ts_ns[0] = NOW_NS // 10**9


def _future(b):
    b.samples.ts_ns[0] = NOW_NS + 30 * 86400 * 10**9


def _bad_status(b):
    b.probe_results.add(probe="pcie", status="great", started_ns=NOW_NS)


def _seq0(b):
    b.seq = 0


def _empty_metric(b):
    b.samples.series[0].metric = ""


def _job_without_id(b):
    b.job_samples.add(ts_ns=NOW_NS)


def _bad_gpu_index(b):
    b.samples.series[1].gpu = -7


@pytest.mark.parametrize("breaker, code, words", [
    (_mismatch, grpc.StatusCode.INVALID_ARGUMENT, "differ in length"),
    (_unknown_series, grpc.StatusCode.INVALID_ARGUMENT, "series id 999"),
    (_duplicate_series, grpc.StatusCode.INVALID_ARGUMENT, "same series id twice"),
    (_seconds_not_ns, grpc.StatusCode.INVALID_ARGUMENT, "plausible Unix time"),
    (_future, grpc.StatusCode.INVALID_ARGUMENT, "plausible Unix time"),
    (_bad_status, grpc.StatusCode.INVALID_ARGUMENT, "status 'great'"),
    (_seq0, grpc.StatusCode.INVALID_ARGUMENT, "seq must be 1 or more"),
    (_empty_metric, grpc.StatusCode.INVALID_ARGUMENT, "empty metric name"),
    (_job_without_id, grpc.StatusCode.INVALID_ARGUMENT, "without a job_id"),
    (_bad_gpu_index, grpc.StatusCode.INVALID_ARGUMENT, "gpu index -7"),
])
def test_bad_batch_aborts_stream_and_stores_nothing_of_it(env, breaker, code, words):
    stub, node_id = env
    good = sample_batch(node_id, 1)
    bad = sample_batch(node_id, 2)
    breaker(bad)
    acks = []
    with pytest.raises(grpc.RpcError) as err:
        for ack in stub.Stream(iter([good, bad, sample_batch(node_id, 3)])):
            acks.append(ack)
    assert err.value.code() == code
    assert words in err.value.details()
    assert ("gpuagent-seq", str(bad.seq)) in tuple(err.value.trailing_metadata())
    assert [a.seq for a in acks] == [1]          # the good batch before it was committed and acked
    assert count(stub) == 6 and count(stub, "probe_results") == 0 and count(stub, "job_samples") == 0
    assert count(stub, "ingest_log") == 1


def test_oversized_batch_gets_resource_exhausted(env):
    stub, node_id = env
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Stream(iter([sample_batch(node_id, 1, n=1001)])))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 1000" in err.value.details()
    assert count(stub) == 0


def test_too_many_series_gets_resource_exhausted(tmp_path):
    with start_collector(tmp_path / "c.duckdb", limits=Limits(max_series_per_batch=10)) as h, \
            grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
        b = sample_batch(node_id, 1)
        for i in range(100, 108):
            b.samples.series.add(id=i, metric="unused_percent", gpu=-1)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Stream(iter([b])))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "11 series" in err.value.details()


def test_register_with_a_non_numeric_price_is_refused(env):
    stub, _ = env
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(pb.RegisterRequest(node=node_info("p", "m-p", labels={"price_per_gpu_hour": "cheap"})))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "price_per_gpu_hour" in err.value.details()
    assert count(stub, "nodes") == 1


def test_message_over_grpc_size_limit_is_refused(tmp_path):
    from gpuagent.collector.service import ServerOptions

    with start_collector(tmp_path / "c.duckdb", options=ServerOptions(max_message_bytes=64 * 1024)) as h, \
            grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Stream(iter([sample_batch(node_id, 1, n=20_000)])))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert count(stub) == 0


def test_unregistered_node_gets_failed_precondition(env):
    stub, _ = env
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Stream(iter([sample_batch("nobody", 1)])))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Register" in err.value.details()


def test_a_bad_stream_does_not_disturb_a_good_one(env):
    stub, node_id = env
    other = stub.Register(pb.RegisterRequest(node=node_info("gpu-02", "m-2"))).node_id
    gate = threading.Event()
    good_acks = []

    def good_batches():
        for s in range(1, 11):
            if s == 5:
                gate.wait(30)   # hold the good stream open while the bad one fails
            yield sample_batch(other, s)

    def run_good():
        good_acks.extend(stub.Stream(good_batches()))

    t = threading.Thread(target=run_good)
    t.start()
    bad = sample_batch(node_id, 1)
    bad.samples.series_id[0] = 12345
    with pytest.raises(grpc.RpcError):
        list(stub.Stream(iter([bad])))
    gate.set()
    t.join(60)
    assert [a.seq for a in good_acks] == list(range(1, 11))
    assert count(stub) == 60


def test_analyze_with_an_astronomical_window_gets_invalid_argument(env):
    """1e300 s used to overflow the window's datetime arithmetic and answer UNKNOWN (issue 23)."""
    stub, _ = env
    with pytest.raises(grpc.RpcError) as err:
        stub.Analyze(pb.AnalyzeRequest(window_s=1e300), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most" in err.value.details() and "OverflowError" not in err.value.details()


@pytest.mark.parametrize("wait", [-1.0, float("nan"), 1e9])
def test_analyze_with_a_bad_actions_wait_gets_one_sentence(env, wait):
    stub, _ = env
    with pytest.raises(grpc.RpcError) as err:
        stub.Analyze(pb.AnalyzeRequest(wait_actions_s=wait), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"wait_actions_s must be from 0 to 120 seconds, not {wait:g}"
