"""Resolution where it pays (issue 44, docs/RESOLUTION.md): series no rule reads per sample travel as
per-interval summaries, their 1 s samples wait in the agent's ring, and the collector gets a raw window of them
when a flag opens on the node or a person asks.

- the batcher: summaries equal the raw samples' count, sum, min and max; rule-read series stay raw; the ring
  answers a request once, in parts, and forgets what is older than raw_keep_s;
- the collector: summaries merge into samples_1m exactly as the same samples sent raw do, and leave the queue;
  a malformed summary is refused with one sentence and stores nothing;
- end to end (the real agent on the NVML emulator, the real collector over gRPC): at the default resolution the
  summarised series are absent from `samples`, a flag opened on the node brings its raw window in, and
  `gpuagent-collector raw-window` asks for one.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time

import grpc
import pytest

from agent_helpers import ROOT, start_agent, stop, wait_running
from collector_helpers import NOW_NS, node_info, sample_batch
from conftest import wait_for
from gpuagent.agent.config import ConfigError, load_config
from gpuagent.agent.pipeline.batcher import Batcher, SeqAllocator
from gpuagent.collector import service as server
from gpuagent.collector.views import client
from gpuagent.common.resolution import ON_CHANGE, RAW, SUMMARY, needs_raw, raw_metrics, resolution_of
from gpuagent.proto import pb, pb_grpc

MIN = 60 * 10**9


def collector_stub(address: str) -> pb_grpc.CollectorStub:
    return pb_grpc.CollectorStub(grpc.insecure_channel(address))


def _batcher(tmp_path, keep_s: float = 900.0, max_samples: int = 50_000) -> Batcher:
    return Batcher(SeqAllocator(tmp_path), 5.0, max_samples, summary_interval_s=60, raw_keep_s=keep_s)


def _minute_start() -> int:
    now = time.time_ns()
    return now - now % MIN - 3 * MIN


def test_rule_read_series_are_raw_and_the_rest_summarised():
    assert needs_raw("job_progress_percent") and needs_raw("cpu_steal_percent")
    assert needs_raw("gpu_ecc_uncorrected_total") and needs_raw("gpu_pcie_link_gen")  # 70_hardware_fault
    assert not needs_raw("gpu_util_percent")            # 70_'s load, read per minute from samples_1m
    assert needs_raw("job_anything_new")                                               # the job sampler's
    assert not needs_raw("gpu_temperature_celsius") and not needs_raw("mem_used_bytes")
    assert "psi_cpu_some_avg10_percent" in raw_metrics()
    assert resolution_of("gpu_ecc_uncorrected_total") == ON_CHANGE and resolution_of("gpu_nvlink_link_up") == ON_CHANGE
    assert resolution_of("cpu_steal_percent") == RAW and resolution_of("gpu_power_watts") == SUMMARY


def _rise(values: list[float]) -> tuple[float, int]:
    """70_hardware_fault's reading of a counter: the sum of its positive consecutive differences, and resets."""
    d = [b - a for a, b in zip(values, values[1:])]
    return sum(x for x in d if x > 0), sum(1 for x in d if x < 0)


def test_a_counter_is_sent_when_it_changes_and_once_per_interval_and_reads_the_same(tmp_path):
    b = _batcher(tmp_path)
    t0 = _minute_start()
    values = [5.0] * 70 + [7.0] * 40 + [9.0, 9.0, 2.0] + [2.0] * 100 + [4.0] * 7     # rises, a reset, a rise
    for i, v in enumerate(values):
        b.add("gpu_ecc_corrected_total", v, gpu=3, ts_ns=t0 + i * 10**9)
    batch = b.cut(0)
    sent = list(zip(batch.samples.ts_ns, batch.samples.value))
    # each change with its own time, and the unchanged value again 60 s after the last one sent
    assert [((t - t0) // 10**9, v) for t, v in sent] == [(0, 5.0), (60, 5.0), (70, 7.0), (110, 9.0), (112, 2.0),
                                                         (172, 2.0), (213, 4.0)]
    assert _rise([v for _, v in sent]) == _rise(values) == (6.0, 1)
    assert b.latest[("gpu_ecc_corrected_total", 3, ())][1] == 4.0


def test_summaries_equal_the_raw_samples_and_raw_series_stay_raw(tmp_path):
    b = _batcher(tmp_path)
    t0 = _minute_start()
    values = [40.0 + (i * 7) % 13 for i in range(150)]
    for i, v in enumerate(values):
        b.add("gpu_temperature_celsius", v, gpu=0, ts_ns=t0 + i * 10**9)
        b.add("cpu_steal_percent", 0.5, ts_ns=t0 + i * 10**9)
    b.add("gpu_temperature_celsius", math.nan, gpu=0, ts_ns=t0 + 2 * MIN + 40 * 10**9)   # counted in nothing
    batch = b.cut(0)
    assert len(batch.samples.ts_ns) == 150 and {s.metric for s in batch.samples.series} == {"cpu_steal_percent"}
    s = batch.summaries
    assert s.interval_ns == MIN and list(s.start_ns) == [t0, t0 + MIN, t0 + 2 * MIN]
    for k, start in enumerate(s.start_ns):
        chunk = [v for i, v in enumerate(values) if t0 + i * 10**9 - start in range(0, MIN)]
        assert (s.count[k], s.sum[k], s.min[k], s.max[k]) == (len(chunk), sum(chunk), min(chunk), max(chunk))
    assert b.cut(0) is None                 # nothing more to send; the open interval was closed by the clock


def test_an_open_interval_waits_for_its_end_and_stopping_sends_it(tmp_path):
    b = _batcher(tmp_path)
    now = time.time_ns()
    b.add("gpu_power_watts", 300.0, gpu=2, ts_ns=now)
    first = b.cut(0)
    assert first is None or len(first.summaries.start_ns) == 0 or now - now % MIN + MIN <= time.time_ns()
    b.close_open_summaries()
    last = b.cut(0)
    assert list(last.summaries.count) == [1] and last.summaries.sum[0] == 300.0


def test_raw_window_answered_once_in_parts_and_the_ring_forgets_old_samples(tmp_path):
    b = _batcher(tmp_path, keep_s=120, max_samples=100)
    now = time.time_ns()
    for i in range(300):                        # 300 s of one summarised series, the oldest 180 s past keep_s
        b.add("gpu_temperature_celsius", float(i), gpu=1, ts_ns=now - (299 - i) * 10**9 - 5 * 10**8)
        if i % 10 == 9:
            b.cut(0)
    req = pb.RawWindowRequest(request_id="r1", since_ns=now - 600 * 10**9, until_ns=now)
    assert b.request_raw([req]) == 1 and b.request_raw([req]) == 0       # the same id twice: answered once
    got, finals = [], 0
    while (batch := b.cut(0)) is not None:
        for w in batch.raw_windows:
            assert w.request_id == "r1" and len(w.samples.ts_ns) <= 100
            got += list(w.samples.value)
            finals += w.final
    assert finals == 1
    kept = [float(i) for i in range(180, 300)]      # one block per cut (10 s): a block wholly past 120 s goes
    assert got == kept and w.held_since_ns > req.since_ns          # partial: the ring holds less than asked


def test_summary_interval_must_divide_a_minute():
    assert load_config(None, env={}, summary_interval_s=15).summary_interval_s == 15
    assert load_config(None, env={}).summary_interval_s == 60
    with pytest.raises(ConfigError, match="divides a minute"):
        load_config(None, env={}, summary_interval_s=45)


def _summary_of(batch: pb.Batch) -> pb.Batch:
    """The same samples as ``batch``, sent as 1-minute summaries by another node."""
    out = pb.Batch(node_id=batch.node_id, seq=batch.seq, created_ns=batch.created_ns)
    groups: dict = {}
    names = {s.id: s for s in batch.samples.series}
    for ts, sid, v in zip(batch.samples.ts_ns, batch.samples.series_id, batch.samples.value):
        groups.setdefault((sid, ts - ts % MIN), []).append(v)
    out.summaries.interval_ns = MIN
    for s in batch.samples.series:
        out.summaries.series.add(id=s.id, metric=s.metric, gpu=s.gpu, labels=dict(names[s.id].labels))
    for (sid, start), vals in sorted(groups.items()):
        out.summaries.start_ns.append(start)
        out.summaries.series_id.append(sid)
        out.summaries.count.append(len(vals))
        out.summaries.sum.append(sum(vals))
        out.summaries.min.append(min(vals))
        out.summaries.max.append(max(vals))
    return out


def test_summaries_roll_up_exactly_as_the_raw_samples_and_leave_the_queue(tmp_path):
    col = server.start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False)
    try:
        stub = collector_stub(col.address)
        raw_id = stub.Register(pb.RegisterRequest(node=node_info("raw", "m-raw"))).node_id
        summ_id = stub.Register(pb.RegisterRequest(node=node_info("summarised", "m-summ"))).node_id
        raws = [sample_batch(raw_id, seq, n=90, ts0=NOW_NS - 5 * MIN) for seq in (1, 2, 3)]
        summaries = [_summary_of(b) for b in raws]
        for b in summaries:
            b.node_id = summ_id
        assert len(list(stub.Stream(iter(raws)))) == 3 and len(list(stub.Stream(iter(summaries)))) == 3
        assert client.query(col.address, "SELECT count(*) FROM samples_summary").rows[0][0] > 0
        client.analyze(col.address, window_s=3600)
        q = ("SELECT minute, gpu, metric, labels, n, sum, min, max FROM samples_1m WHERE node_id = '{}' "
             "ORDER BY ALL")
        raw, summ = (client.query(col.address, q.format(n)).rows for n in (raw_id, summ_id))
        assert raw and raw == summ
        assert client.query(col.address, "SELECT count(*) FROM samples_summary").rows[0][0] == 0
        client.analyze(col.address, window_s=3600)       # a second pass merges nothing twice
        assert client.query(col.address, q.format(summ_id)).rows == summ
    finally:
        col.stop()


@pytest.mark.parametrize("change, sentence", [
    (lambda s: s.count.__setitem__(0, 0), "count below 1"),
    (lambda s: setattr(s, "interval_ns", 45 * 10**9), "divides a minute"),
    (lambda s: s.start_ns.__setitem__(0, s.start_ns[0] + 1), "not a multiple of its interval_ns"),
    (lambda s: s.min.__setitem__(0, s.max[0] + 1), "min above max"),
    (lambda s: s.series_id.__setitem__(0, 99), "series id 99"),
    (lambda s: s.sum.append(1.0), "arrays differ in length"),
], ids=["count-0", "interval-45s", "unaligned-start", "min-over-max", "unknown-series", "lengths"])
def test_a_malformed_summary_is_refused_in_one_sentence_and_stores_nothing(tmp_path, change, sentence):
    col = server.start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False)
    try:
        stub = collector_stub(col.address)
        node = stub.Register(pb.RegisterRequest(node=node_info("summarised", "m-summ"))).node_id
        bad = _summary_of(sample_batch(node, 1, n=30))
        change(bad.summaries)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Stream(iter([bad])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and sentence in err.value.details()
        assert "\n" not in err.value.details()
        good = _summary_of(sample_batch(node, 2, n=30))
        assert len(list(stub.Stream(iter([good])))) == 1
        assert client.query(col.address, "SELECT count(*), sum(n) FROM samples_summary").rows == [[3, 30]]
    finally:
        col.stop()


@pytest.mark.slow
def test_a_flagged_node_and_a_person_get_its_raw_window_at_the_default_resolution(tmp_path):
    from gpuagent.sim.nvml_emulator import Emulator
    from nvml_emulator_fixture import H100_8GPU, built_or_skip

    built_or_skip()
    import json
    emu = Emulator.start(tmp_path / "nvmlemu", json.loads(H100_8GPU.read_text()), clock="real")
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[probes]\nenabled = false\n")
    col = server.start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False)
    state = tmp_path / "state"
    agent = start_agent(tmp_path, col.address, state, interval=0.5, batch_interval=0.5, up_longer_s=86400,
                        GPUAGENT_CONFIG=str(cfg), **emu.env_vars())
    n = lambda sql: client.query(col.address, sql).rows[0][0]  # noqa: E731
    try:
        wait_running(state, agent)
        node = wait_for(lambda: client.query(col.address, "SELECT node_id FROM nodes").rows, timeout=20,
                        what="the node registered")[0][0]
        wait_for(lambda: n("SELECT count(DISTINCT ts) FROM samples WHERE metric = 'gpu_ecc_uncorrected_total' "
                           "AND gpu = 1") >= 1, timeout=40, interval=0.5, what="a health read")
        # The default resolution: the rules' series raw, GPU temperature (read by no rule per sample) not.
        assert n("SELECT count(*) FROM samples WHERE metric = 'gpu_temperature_celsius'") == 0
        assert n("SELECT count(*) FROM samples WHERE metric = 'gpu_util_percent'") == 0
        assert n("SELECT count(*) FROM samples WHERE metric = 'gpu_pcie_link_gen'") > 0
        time.sleep(3)
        emu.set(1, "ecc_uncorrected", 1)
        # sent as it changes (a counter: common/resolution.py ON_CHANGE), not a minute later
        wait_for(lambda: n("SELECT count(DISTINCT ts) FROM samples WHERE metric = 'gpu_ecc_uncorrected_total' "
                           "AND gpu = 1 AND value > 0") >= 1, timeout=40, interval=0.5, what="the ECC error stored")
        res = client.analyze(col.address, window_s=600)
        assert any(f["kind"] == "hardware_fault" and f["gpu"] == 1 for f in res.flags), res.flags
        row = wait_for(lambda: client.query(col.address, "SELECT request_id, reason, rows, held_since, since "
                                                         "FROM raw_requests WHERE answered_at IS NOT NULL").rows,
                       timeout=30, interval=0.5, what="the flagged node's raw window")[0]
        rid, reason, rows, held_since, since = row
        assert "hardware_fault" in reason and rows > 0
        temp = client.query(col.address, f"SELECT count(*), count(DISTINCT ts), min(epoch(ts)), max(epoch(ts)) "
                                         f"FROM raw_windows WHERE request_id = '{rid}' AND node_id = '{node}' "
                                         f"AND metric = 'gpu_temperature_celsius' AND gpu = 1").rows[0]
        first = n("SELECT min(epoch(ts)) FROM samples")
        # every tick since the agent started (it held less than the 15 minutes asked), 0.5 s apart
        assert temp[0] == temp[1] and temp[0] >= 5 and abs((temp[3] - temp[2]) / 0.5 + 1 - temp[0]) <= 2, temp
        assert abs(temp[2] - first) <= 1.0 and held_since > since, (temp, first, row)
        assert n(f"SELECT count(*) FROM raw_windows WHERE request_id = '{rid}' AND metric = 'cpu_steal_percent'") == 0

        out = subprocess.run([sys.executable, "-m", "gpuagent.collector.cli", "raw-window", "--target", col.address,
                              "--node", node, "--last", "20s"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert "samples arrived" in out.stdout, out.stdout
        bad = subprocess.run([sys.executable, "-m", "gpuagent.collector.cli", "raw-window", "--target", col.address,
                              "--node", "no-such-node"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert bad.returncode != 0 and "not registered" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr
    finally:
        stop(agent)
        col.stop()
    # Stopping sent the open interval's summaries: the queue holds the whole run's GPU temperatures.
    con = __import__("duckdb").connect(str(tmp_path / "c.duckdb"), read_only=True)
    try:
        got = con.execute("SELECT sum(n) FROM samples_summary WHERE metric = 'gpu_temperature_celsius' "
                          "AND gpu = 1").fetchone()[0]
        assert got and got >= temp[0]
    finally:
        con.close()


def test_an_agent_sending_every_sample_raw_answers_a_raw_window_request_empty_and_keeps_running(tmp_path):
    # The CI run at c216998 failed here: a flag on a raw-mode agent's node asked for its window, and the cut
    # that answered it raised AttributeError (no ring), which stopped the agent.
    b = Batcher(SeqAllocator(tmp_path), 5.0, 100, summary_interval_s=0)
    b.add("gpu_temperature_celsius", 50.0, gpu=0)
    now = time.time_ns()
    assert b.request_raw([pb.RawWindowRequest(request_id="r0", since_ns=now - 60 * 10**9, until_ns=now)]) == 1
    batch = b.cut(0)
    assert list(batch.samples.value) == [50.0]                      # the sample itself went raw, as always
    [w] = batch.raw_windows
    assert w.request_id == "r0" and w.final and len(w.samples.ts_ns) == 0 and w.held_since_ns == 0
    assert b.cut(0) is None                                          # answered once
