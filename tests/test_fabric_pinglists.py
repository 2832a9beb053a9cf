"""The collector's half of the cheap fabric layer: pinglists per epoch, suspects for targeted bandwidth runs,
and the [fabric] keys that drive them (collector/fabric/pinglists.py, coordinator.py)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gpuagent.collector.fabric.coordinator import Coordinator, FabricConfig
from gpuagent.common import path_planner, path_probe
from gpuagent.proto import pb


def _fleet(n=6, pools=("a",), ports=True, **cfg):
    co = Coordinator(FabricConfig(enabled=True, path_epoch_s=60, path_cover_s=120, **cfg))
    queues = {}

    async def attach():
        for i in range(n):
            node = f"n{i}"
            co.register(node, f"10.0.0.{i + 1}", {"pool": pools[i % len(pools)]}, 42000 + i if ports else 0)
            queues[node] = co.attach(node)
    asyncio.run(attach())
    return co, queues


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_every_path_node_gets_the_planners_pinglist_with_its_peers_responders():
    co, queues = _fleet(7, pools=("a", "b"))
    assert co.paths.send_epoch(5) == 7
    labels = {f"n{i}": {"pool": ("a", "b")[i % 2]} for i in range(7)}
    want = path_planner.pinglists(labels, "pool", 5, co.paths.plan)
    for node, q in queues.items():
        (msg,) = _drain(q)
        assert msg.kind == "pinglist" and msg.probe == path_probe.PROBE and msg.epoch == 5
        assert list(msg.members) == want[node]
        assert list(msg.peer_addresses) == [f"10.0.0.{int(p[1:]) + 1}:{42000 + int(p[1:])}" for p in msg.members]
        assert msg.deadline_ns == 6 * 60 * 1_000_000_000
        assert isinstance(path_probe.PathSettings.from_params(msg.params), path_probe.PathSettings)
        assert all(labels[p]["pool"] == labels[node]["pool"] for p in msg.members)   # never across a scope
    assert co.paths.last_counts == {"a": 4, "b": 3}


def test_a_node_without_a_path_port_gets_no_pinglist_and_is_nobodys_peer():
    co, queues = _fleet(4, ports=False)
    co.register("n9", "10.0.0.9", {"pool": "a"}, 0)
    assert co.paths.send_epoch(0) == 0 and all(q.empty() for q in queues.values())
    co.register("n0", "10.0.0.1", {"pool": "a"}, 42000)
    co.register("n1", "10.0.0.2", {"pool": "a"}, 42001)
    assert co.paths.send_epoch(0) == 2
    assert [list(m.members) for m in _drain(queues["n0"])] == [["n1"]]
    assert _drain(queues["n2"]) == []


def test_an_ipv6_responder_is_bracketed():
    co = Coordinator(FabricConfig(enabled=True))

    async def go():
        co.register("x", "fd00::1", {}, 4000)
        co.register("y", "fd00::2", {}, 4001)
        return co.attach("x"), co.attach("y")
    qx, _ = asyncio.run(go())
    co.paths.send_epoch(0)
    assert list(_drain(qx)[0].peer_addresses) == ["[fd00::2]:4001"]


def _suspect(a, b):
    return pb.ProbeResult(probe="path_probe", status="ok", params=path_probe.result_params(a, 1, b))


def test_targeted_rounds_run_the_newest_suspects_first_each_node_once_then_a_rolling_share():
    co, _ = _fleet(40, sweep="targeted", targeted_interval_s=90, rolling_runs_per_hour=40)
    batch = pb.Batch(node_id="n1", probe_results=[
        _suspect("n1", "n2"), _suspect("n3", "n1"), _suspect("n5", "n6"),
        pb.ProbeResult(probe="path_probe", status="ok", params=path_probe.result_params("n1", 1))])  # a summary
    assert co.paths.note_batch(batch) == 3
    rnd = co.paths.targeted_round()
    # newest first: n5-n6, then n3-n1; n1-n2 waits (n1 is busy this round)
    assert rnd[:2] == [("n5", "n6"), ("n3", "n1")]
    nodes = list(itertools.chain.from_iterable(rnd))
    assert len(nodes) == len(set(nodes))
    # 40 nodes x 40 runs an hour x 90 s / 3600 / 2 = 20 rolling pairs, fewer where a node is taken
    assert 15 <= len(rnd) - 2 <= 20
    second = co.paths.targeted_round()
    assert second[0] == ("n1", "n2") and not co.paths.suspects


def test_the_rolling_share_walks_the_whole_tournament():
    co, _ = _fleet(8, sweep="targeted", targeted_interval_s=3600, rolling_runs_per_hour=1)
    seen = set()
    for _ in range(28):
        seen.update(frozenset(p) for p in co.paths.targeted_round())
    assert len(seen) == 28     # every pair of 8 nodes


@pytest.mark.parametrize("table, sentence", [
    ({"sweep": "sometimes"}, 'fabric.sweep must be "full" or "targeted", not \'sometimes\''),
    ({"path_epoch_s": 0}, "fabric.paths needs epoch_s >= 1"),
    ({"path_cover_s": 10}, "fabric.paths needs epoch_s >= 1, cover_s >= epoch_s"),
    ({"path_params": {"pings": "lots"}}, "[fabric.path_params]: path probe setting pings = 'lots' is not a number"),
    ({"path_params": {"train_packets": 1}}, "[fabric.path_params]: path probe pings must be 1-100 and train_packets"),
    ({"path_params": {"colour": 3}}, "unknown key fabric.path_params.colour"),
    ({"path_params": 3}, "[fabric.path_params] must be a table"),
    ({"paths": "yes"}, "fabric.paths must be true or false"),
    ({"targeted_interval_s": 0}, "fabric targeted_interval_s must be at least 1"),
])
def test_bad_path_keys_are_one_sentence(table, sentence):
    with pytest.raises(ValueError) as exc:
        FabricConfig.from_mapping({"enabled": True, **table})
    assert str(exc.value).startswith(sentence) and "\n" not in str(exc.value)


def test_path_params_reach_the_pinglist():
    co, queues = _fleet(3, path_params={"train_packets": 8, "confirm": 1})
    co.paths.send_epoch(0)
    got = path_probe.PathSettings.from_params(_drain(queues["n0"])[0].params)
    assert got.train_packets == 8 and got.confirm == 1 and got.pings == path_probe.PathSettings().pings


def test_a_suspect_probed_while_either_end_ran_a_bandwidth_run_is_dropped():
    from gpuagent.collector.fabric.coordinator import Outcome
    co, _ = _fleet(6, sweep="targeted", targeted_interval_s=10, rolling_runs_per_hour=0)
    s = 1_000_000_000
    co._keep(Outcome("p1", "n1", "n2", "ok", "", 100 * s, 104 * s, 0))
    during = _suspect("n2", "n4")
    during.started_ns, during.ended_ns = 103 * s, 103 * s + 5_000_000
    later = _suspect("n3", "n4")
    later.started_ns, later.ended_ns = 110 * s, 110 * s + 5_000_000
    assert co.paths.note_batch(pb.Batch(probe_results=[during, later])) == 1
    assert co.paths.dropped_overlap == 1 and co.paths.targeted_round() == [("n3", "n4")]



def test_a_suspect_path_is_probed_from_its_other_end_in_the_next_epoch():
    """The second report a lossless suspect needs comes from the other end within an epoch: the next
    pinglists add the reverse probe to the plan's, and the epoch after is the plan's again."""
    co, queues = _fleet(8)
    labels = {f"n{i}": {"pool": "a"} for i in range(8)}
    want = {e: path_planner.pinglists(labels, "pool", e, co.paths.plan) for e in (1, 2)}
    # a path whose peer does not probe its reporter in epoch 1 already
    reporter, peer = next((a, b) for a in sorted(labels) for b in want[1][a] if a not in want[1][b])
    assert co.paths.note_batch(pb.Batch(probe_results=[_suspect(reporter, peer)])) == 1
    for e in (1, 2):
        co.paths.send_epoch(e)
        got = {n: list(_drain(q)[0].members) for n, q in queues.items()}
        extra = {peer: want[1][peer] + [reporter]} if e == 1 else {}
        assert got == {**want[e], **extra}, e
    assert co.paths.rechecks_sent == 1


def test_in_the_default_full_sweep_a_streamed_suspect_is_still_rechecked(tmp_path):
    """The servicer hands suspects to the path layer whatever the sweep: in the default (full) one they are
    rechecked from their other end, and no targeted run is queued for them."""
    import time

    import grpc

    from collector_helpers import node_info
    from gpuagent.collector.service import start_collector
    from gpuagent.proto import pb_grpc

    handle = start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False,
                             fabric=FabricConfig(enabled=True), fabric_rounds=False)
    try:
        with grpc.insecure_channel(handle.address) as ch:
            stub = pb_grpc.CollectorStub(ch)
            ids = []
            for i in range(2):
                info = node_info(f"gpu-{i}", f"m-{i}")
                info.fabric_address, info.path_port = f"10.0.0.{i + 1}", 42050
                ids.append(stub.Register(pb.RegisterRequest(node=info)).node_id)
            now = time.time_ns()
            batch = pb.Batch(node_id=ids[0], seq=1, created_ns=now)
            batch.probe_results.add(probe=path_probe.PROBE, status="ok", gpu=-1, started_ns=now - 10**9, ended_ns=now,
                                    params=path_probe.result_params(ids[0], 7, ids[1]), metrics={"loss_ratio": 0.0})
            acks = list(stub.Stream(iter([batch]), metadata=(("gpuagent-node-id", ids[0]),)))
            assert acks and acks[0].seq == 1
        assert handle.fabric.config.sweep == "full"
        assert list(handle.fabric.paths.rechecks) == [(ids[0], ids[1])]
        assert not handle.fabric.paths.suspects
    finally:
        handle.stop()


def test_rechecks_are_capped_per_node_and_skip_what_is_not_needed():
    lists = {"a": ["b"], "b": ["c"], "c": ["a"], "d": []}
    suspects = [("a", "b"), ("c", "d"), ("b", "d"), ("a", "d"), ("x", "d"), ("d", "d"), ("a", "c")]
    assert path_planner.with_rechecks(lists, suspects, per_node=2) == 3
    # b probes a; d probes c and b, then has its 2 (a is left out); x is not in the plan; no node probes
    # itself; c probes a already
    assert lists == {"a": ["b"], "b": ["c", "a"], "c": ["a"], "d": ["c", "b"]}


def test_a_node_the_passive_counters_flag_gets_a_bandwidth_run_with_a_healthy_peer_of_its_pool_once():
    co, _ = _fleet(8, pools=("a", "b"), sweep="targeted", targeted_interval_s=10, rolling_runs_per_hour=0)
    assert co.paths.note_counters(["n2", "n4"]) == 2          # n0 n2 n4 n6 are pool a
    rnd = co.paths.targeted_round()
    assert [a for a, _b in rnd] == ["n2", "n4"]
    for a, b in rnd:
        assert b in ("n0", "n6"), rnd           # the same pool, not flagged itself
    assert co.paths.targeted_round() == []      # one run a flag episode
    assert co.paths.note_counters(["n2", "n4"]) == 0 and co.paths.targeted_round() == []
    co.paths.note_counters(["n4"])              # n2's flag closed ...
    assert co.paths.note_counters(["n2", "n4"]) == 1   # ... and opened again: another run
    assert [a for a, _b in co.paths.targeted_round()] == ["n2"]
    # path suspects go first; a flagged node already in a suspect pair waits for the next round
    assert co.paths.note_counters(["n4", "n6"]) == 1            # n6 is new; n2 no longer flagged
    co.paths.note_batch(pb.Batch(probe_results=[_suspect("n6", "n0")]))
    assert co.paths.targeted_round() == [("n6", "n0")]
    ((a, b),) = co.paths.targeted_round()
    assert a == "n6" and b in ("n0", "n2")


def test_the_collectors_coordinator_reads_the_counter_flags_a_real_pass_opened(tmp_path, monkeypatch):
    """Through the collector's own wiring (service.start_fabric) and its running coordinator: an eth_link flag
    from a real analysis pass over SYNTHETIC counter rows reaches the targeted rounds' pending nodes (polled
    every 0.2 s here, COUNTER_POLL_S in service)."""
    import datetime as dt

    from conftest import wait_for
    from gpuagent.collector.analysis import analyzer as A
    from gpuagent.collector.fabric import coordinator
    from gpuagent.collector.service import start_collector
    from gpuagent.sim import synthetic_rows as S

    monkeypatch.setattr(coordinator, "COUNTER_POLL_S", 0.2)
    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None, microsecond=0)
    handle = start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False,
                             fabric=FabricConfig(enabled=True, sweep="targeted", targeted_interval_s=1, paths=False))
    try:
        co = handle.fabric
        assert co.paths.counter_flagged == set()

        def rows(con):
            for node, fault in (("syn-nic-bad", "eth_link"), ("syn-nic-ok", None)):
                S.add_node(con, node, virtualized=False, gpu_count=2)
                samples, events = S.hardware_rows(node, start=now - dt.timedelta(minutes=55), gpus=2, fault=fault)
                S.add_samples(con, samples)
                S.add_events(con, events)
            A.Analyzer().run_pass(con, now)
        handle.writer.call(rows).result(60)
        wait_for(lambda: co.paths.counter_flagged == {"syn-nic-bad"}, timeout=10, interval=0.1,
                 what="the coordinator's poll of the counter flags")
        assert list(co.paths.counter_pending) == ["syn-nic-bad"]     # no ready peer yet: it waits
    finally:
        handle.stop()
