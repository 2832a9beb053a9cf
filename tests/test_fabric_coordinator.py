"""The fabric coordinator and the agent's FabricClient over real gRPC on loopback, with real net_pair runs
between in-process agents (each its own FabricClient, probe lock and fabric address 127.0.0.1)."""

from __future__ import annotations

import itertools
import json
import time

import grpc
import pytest

from collector_helpers import node_info
from conftest import worker_ports
from fabric_helpers import Results  # noqa: F401 - test_fabric_budget and _groups take it from here
from sysfs_helpers import add_nic
from gpuagent.agent.probing.fabric import FabricClient
from gpuagent.collector.fabric.coordinator import Coordinator, FabricConfig
from gpuagent.collector.service import start_collector
from gpuagent.probes.lock import ProbeLock
from gpuagent.proto import pb, pb_grpc

PORTS = worker_ports(1)   # this worker's own range for fabric listeners and rendezvous ports
# Short, but long enough that stream processes a loaded 2-core machine schedules late still send inside the
# window (with 0.1 s warmup and 0.3 s, a pair under the full suite once measured 0 bytes).
FAST = {"streams": "2", "duration_s": "0.4", "warmup_s": "0.4", "rtt_count": "50"}


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fabric_fleet(tmp_path):
    cfg = FabricConfig(enabled=True, answer_timeout_s=2.0, run_timeout_s=20.0, params=dict(FAST),
                       port_lo=PORTS[0], port_hi=PORTS[1])
    col = start_collector(tmp_path / "c.duckdb", analyze=False, fabric=cfg, fabric_rounds=False)
    channels, clients = [], {}

    def add(i, busy=lambda: "", **client_kw):
        ch = grpc.insecure_channel(col.address)
        channels.append(ch)
        stub = pb_grpc.CollectorStub(ch)
        info = node_info(hostname=f"n{i}", machine_id=f"m-{i:04d}")
        info.fabric_address = "127.0.0.1"
        node_id = stub.Register(pb.RegisterRequest(node=info)).node_id
        sink = Results()
        client = FabricClient(ch, lambda: node_id, "127.0.0.1", sink, busy=busy,
                              lock=ProbeLock(str(tmp_path / f"lock{i}")), retry_s=0.2, **client_kw).start()
        clients[node_id] = (client, sink)
        return node_id

    try:
        yield col, add, clients
    finally:
        for client, _ in clients.values():
            client.stop()
        for ch in channels:
            ch.close()
        col.stop()


def test_full_sweep_measures_every_pair_in_n_minus_1_rounds(fabric_fleet):
    col, add, clients = fabric_fleet
    nodes = [add(i) for i in range(4)]
    assert _wait(lambda: len(col.fabric.ready_nodes()) == 4)
    outcomes = col.fabric_sweep(timeout=120)
    assert len(col.fabric.last_plan.rounds) == 3
    pairs = {frozenset((o.node_a, o.node_b)) for o in outcomes}
    assert pairs == {frozenset(p) for p in itertools.combinations(nodes, 2)}
    assert all(o.status == "ok" for o in outcomes), [(o.status, o.reason) for o in outcomes]
    # Both ends record each pair, with both node ids and the same metrics.
    assert _wait(lambda: sum(len(s.rows) for _, s in clients.values()) == 12)
    by_pair = {}
    for _, sink in clients.values():
        for rec in sink.rows:
            assert rec["probe"] == "net_pair" and rec["status"] == "ok"
            by_pair.setdefault(rec["params"]["pair_id"], []).append(rec)
    assert len(by_pair) == 6
    for recs in by_pair.values():
        assert {r["env"]["role"] for r in recs} == {"listen", "connect"}
        assert recs[0]["params"]["node_a"] == recs[1]["params"]["node_a"]
        assert recs[0]["metrics"]["send_gbits_per_s"] == recs[1]["metrics"]["send_gbits_per_s"] > 0
    assert "secret" not in str([r["params"] for _, s in clients.values() for r in s.rows])

    # What `gpuagent status` shows of each node: its 3 runs, newest first, as its end measured them.
    from gpuagent.agent import snapshot as st
    from gpuagent.agent.surface.status import _render_fabric
    from gpuagent.common.typed_json import load_typed
    for node_id, (client, sink) in clients.items():
        fab = client.fabric_status()
        assert fab.address == "127.0.0.1" and fab.stream_open and fab.stream_error == ""
        assert fab.counts == {"accepted": 3, "result:ok": 3} and fab.last_message_ns > 0
        assert [r.ended_ns for r in fab.recent] == sorted((r.ended_ns for r in fab.recent), reverse=True)
        mine = {rec["params"]["pair_id"]: rec for rec in sink.rows}
        assert {r.pair_id for r in fab.recent} == set(mine) and len(fab.recent) == 3
        for run in fab.recent:
            rec = mine[run.pair_id]
            peer = rec["params"]["node_b"] if rec["params"]["node_a"] == node_id else rec["params"]["node_a"]
            assert (run.peer, run.role, run.status) == (peer, rec["env"]["role"], "ok")
            assert (run.send_gbits_per_s, run.recv_gbits_per_s, run.rtt_p50_us) == (
                rec["metrics"]["send_gbits_per_s"], rec["metrics"]["recv_gbits_per_s"], rec["metrics"]["rtt_p50_us"])
        # the status file's JSON form reads back to the same section
        assert load_typed(st.FabricStatus, json.loads(json.dumps(st._dump(fab))), "fabric") == fab
        text = "\n".join(_render_fabric(fab, time.time_ns()))
        assert "peers reach this node at 127.0.0.1  assignments stream open" in text
        assert all(r.peer[:20] in text for r in fab.recent) and text.count("  ok  ") == 3


def test_busy_end_gives_skipped_with_reason_and_others_carry_on(fabric_fleet):
    col, add, clients = fabric_fleet
    busy_node = add(0, busy=lambda: "gpus busy: a job holds GPU 0")
    others = [add(i) for i in range(1, 4)]
    assert _wait(lambda: len(col.fabric.ready_nodes()) == 4)
    outcomes = col.fabric_sweep(timeout=120)
    for o in outcomes:
        if busy_node in (o.node_a, o.node_b):
            assert o.status == "skipped" and f"node {busy_node} is busy: gpus busy" in o.reason
        else:
            assert o.status == "ok", o.reason
    assert sum(o.status == "ok" for o in outcomes) == 3
    busy_client, busy_sink = clients[busy_node]
    assert busy_sink.rows == [] and busy_client.counts.get("busy") == 3
    assert all(not c.lock.held for c, _ in clients.values())


def test_silent_end_is_skipped_and_the_pair_never_hangs(fabric_fleet):
    col, add, clients = fabric_fleet
    nodes = [add(i) for i in range(4)]
    assert _wait(lambda: len(col.fabric.ready_nodes()) == 4)
    silent = nodes[2]
    # The agent's stream stays open but it ignores every message, as a hung agent would.
    client, _ = clients[silent]
    client._handle = lambda node_id, msg: None
    t0 = time.monotonic()
    outcomes = col.fabric_sweep(timeout=120)
    assert time.monotonic() - t0 < 60
    for o in outcomes:
        if silent in (o.node_a, o.node_b):
            assert o.status == "skipped"
            assert f"node {silent} did not answer within 2 s" in o.reason
        else:
            assert o.status == "ok", o.reason
    # The peers of the silent node got a cancel and released their lock and port.
    assert _wait(lambda: all(not c.lock.held for n, (c, _) in clients.items() if n != silent))


def test_config_problems_are_one_sentence():
    with pytest.raises(ValueError, match="port range"):
        Coordinator(FabricConfig(port_lo=5, port_hi=0))
    with pytest.raises(ValueError, match="max_pairs_per_round"):
        Coordinator(FabricConfig(max_pairs_per_round=-1))


def _query(col, sql):
    ch = grpc.insecure_channel(col.address)
    try:
        resp = pb_grpc.CollectorStub(ch).Query(pb.QueryRequest(sql=sql))
        return json.loads(resp.rows_json)
    finally:
        ch.close()


def _send_results(col, node_id, sink, seq):
    """Ship a client's results to the collector as the agent's batcher would: ProbeResult messages."""
    ch = grpc.insecure_channel(col.address)
    try:
        batch = pb.Batch(node_id=node_id, seq=seq, created_ns=time.time_ns())
        for rec in sink.rows:
            batch.probe_results.add(probe=rec["probe"], status=rec["status"], reason=rec["reason"],
                                    params={k: str(v) for k, v in rec["params"].items()},
                                    metrics=rec["metrics"], started_ns=rec["started_ns"],
                                    ended_ns=rec["ended_ns"], env={k: str(v) for k, v in rec["env"].items()},
                                    gpu=-1)
        acks = list(pb_grpc.CollectorStub(ch).Stream(iter([batch]), metadata=(("gpuagent-node-id", node_id),)))
        assert acks and acks[0].seq == seq
    finally:
        ch.close()


def test_link_results_hold_both_ends_and_the_collectors_skips(fabric_fleet):
    col, add, clients = fabric_fleet
    busy_node = add(0, busy=lambda: "budget: 30.0 s of probe time in the last 3600 s")
    others = [add(i) for i in range(1, 4)]
    assert _wait(lambda: len(col.fabric.ready_nodes()) == 4)
    outcomes = col.fabric_sweep(timeout=120)
    assert _wait(lambda: sum(len(s.rows) for _, s in clients.values()) == 6)
    for n in others:
        _send_results(col, n, clients[n][1], seq=1)
    rows = _query(col, "SELECT node_a, node_b, status, reported_by, send_gbits_per_s, rtt_p50_us, params_key, "
                       "reason FROM link_results ORDER BY node_a, node_b, reported_by")
    ok = [r for r in rows if r[2] == "ok"]
    skipped = [r for r in rows if r[2] == "skipped"]
    assert len(ok) == 6                       # 3 pairs among the free nodes, two ends each
    for a, b in {(r[0], r[1]) for r in ok}:
        ends = [r for r in ok if (r[0], r[1]) == (a, b)]
        assert {r[3] for r in ends} == {a, b}
        assert ends[0][4] == ends[1][4] > 0 and ends[0][5] == ends[1][5] > 0
        assert ends[0][6] == ends[1][6] and "duration_s=0.4" in ends[0][6]
    assert len(skipped) == 3 and all(r[3] == "collector" and busy_node in (r[0], r[1]) for r in skipped)
    assert all("budget: 30.0 s" in r[7] for r in skipped)
    matrix = _query(col, "SELECT count(*), count(DISTINCT least(node_a, node_b) || greatest(node_a, node_b)) "
                         "FROM link_matrix_latest")
    assert matrix == [[6, 6]]
    assert len(outcomes) == 6


def test_each_end_reports_its_nics_line_rate_into_link_results(fabric_fleet, tmp_path):
    # Each in-process agent reads its own fake sysfs tree (tests/sysfs_helpers.py); the runs are real.
    col, add, clients = fabric_fleet
    fast = add(0, interface="eth0", sys_class_net=str(add_nic(tmp_path / "sys0", "eth0", "100000")))
    slow = add(1, interface="eth0", sys_class_net=str(add_nic(tmp_path / "sys1", "eth0", "25000")))
    unknown = add(2, interface="veth0", sys_class_net=str(add_nic(tmp_path / "sys2", "veth0", "10000",
                                                                  virtual=True)))
    assert _wait(lambda: len(col.fabric.ready_nodes()) == 3)
    col.fabric_sweep(timeout=120)
    assert _wait(lambda: sum(len(s.rows) for _, s in clients.values()) == 6)
    for n in (fast, slow, unknown):
        assert {(r["env"]["nic"], r["env"].get("nic_speed_mbits")) for r in clients[n][1].rows} == {
            {fast: ("eth0", 100000), slow: ("eth0", 25000), unknown: ("veth0", None)}[n]}
        _send_results(col, n, clients[n][1], seq=1)
    rows = _query(col, "SELECT reported_by, nic_speed_mbits, count(*) FROM link_results WHERE status = 'ok' "
                       "GROUP BY ALL ORDER BY ALL")
    assert sorted(map(tuple, rows)) == sorted([(fast, 100000, 2), (slow, 25000, 2), (unknown, None, 2)])


def test_agent_fabric_table_and_collector_fabric_table(tmp_path):
    from gpuagent.agent.config import ConfigError, fabric_address, load_config
    from gpuagent.collector.analysis.analyzer import AnalyzerConfig

    p = tmp_path / "agent.toml"
    p.write_text('[fabric]\nenabled = true\ninterface = "lo"\nport_lo = 42000\nport_hi = 42010\n')
    cfg = load_config(str(p), env={})
    assert cfg.fabric.enabled and (cfg.fabric.port_lo, cfg.fabric.port_hi) == (42000, 42010)
    assert fabric_address(cfg.fabric) == "127.0.0.1"
    assert cfg.to_dict()["fabric"]["interface"] == "lo"
    for text, match in (('[fabric]\nenabled = true\n', "neither address nor interface"),
                        ('[fabric]\nport_lo = 5\n', "port_lo and fabric.port_hi"),
                        ('[fabric]\nports = 5\n', "unknown key 'fabric.ports'")):
        p.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_config(str(p), env={})
    p.write_text('[fabric]\nenabled = true\ninterface = "no-such-nic0"\n')
    with pytest.raises(ConfigError, match="does not exist on this host"):
        fabric_address(load_config(str(p), env={}).fabric)

    doc = {"fabric": {"enabled": True, "interval_s": 60, "scope_key": "", "max_pairs_per_round": 8,
                      "params": {"duration_s": 1.5}}, "analyzer": {}}
    fc = FabricConfig.from_mapping(doc["fabric"])
    assert fc.enabled and fc.scope_key is None and fc.max_pairs_per_round == 8
    assert fc.params["duration_s"] == "1.5" and fc.params["streams"] == "4"
    AnalyzerConfig.from_mapping(doc)      # the analyzer shares the file and leaves [fabric] alone
    with pytest.raises(ValueError, match="unknown key fabric.rounds"):
        FabricConfig.from_mapping({"rounds": 3})
    with pytest.raises(ValueError, match="fabric.interval_s must be a number"):
        FabricConfig.from_mapping({"interval_s": "soon"})
