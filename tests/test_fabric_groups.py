"""Collective groups scheduled by the fabric coordinator, over real gRPC on loopback: in-process agents (each
its own FabricClient and probe lock, fabric address 127.0.0.1) run the real collective probe as subprocesses
(torch.distributed with gloo, one rank per node) with the rendezvous the coordinator handed them."""

from __future__ import annotations

import json
import re
import subprocess
import time

import grpc
import pytest

from collector_helpers import node_info
from conftest import worker_ports
from fabric_helpers import ROOT
from test_fabric_coordinator import Results, _query, _send_results, _wait
from gpuagent.agent.config import ProbesConfig
from gpuagent.agent.probing.fabric import COLLECTIVE_FIRST_ESTIMATE_S, FabricBudget, FabricClient
from gpuagent.agent.probing.scheduler import ProbeScheduler
from gpuagent.collector.fabric.coordinator import FabricConfig
from gpuagent.collector.service import start_collector
from gpuagent.collector.views.compare_sql import NOT_FABRIC_GROUP
from gpuagent.collector.views.fabric import run_fabric
from gpuagent.probes import rdma_pair
from gpuagent.probes.lock import ProbeLock
from gpuagent.proto import pb, pb_grpc

from tools import python_module_or_skip
python_module_or_skip("torch")

# One gloo rank per node, small messages: a run is mostly torch's start-up (about 8 s on 2 cores).
PORTS = worker_ports(2)   # this worker's own range for fabric listeners and rendezvous ports
SMALL = {"backend": "gloo", "nprocs": "1", "max_bytes": "1048576", "iters": "5", "warmup": "2",
         "latency_iters": "20"}


@pytest.fixture
def group_fleet(tmp_path):
    made = []

    def make(n, busy=None, budgets=None, **cfg_kw):
        cfg = FabricConfig(enabled=True, answer_timeout_s=3.0, port_lo=PORTS[0], port_hi=PORTS[1], scope_key=None,
                           **{"group_size": n, "collective_params": dict(SMALL), **cfg_kw})
        col = start_collector(tmp_path / "c.duckdb", analyze=False, fabric=cfg, fabric_rounds=False)
        made.append(col)
        nodes = []
        for i in range(n):
            ch = grpc.insecure_channel(col.address)
            info = node_info(hostname=f"g{i}", machine_id=f"g-{i:04d}")
            info.fabric_address = "127.0.0.1"
            node_id = pb_grpc.CollectorStub(ch).Register(pb.RegisterRequest(node=info)).node_id
            sink = Results()
            budget = None
            if budgets and i in budgets:     # the node's probe scheduler's budget, as the daemon wires it
                sched = ProbeScheduler(Results(), ProbesConfig.from_mapping({
                    "budget_window_s": 3600, "budget_fraction": budgets[i] / 3600,
                    "lock_path": str(tmp_path / f"lock{i}")}))
                budget = FabricBudget(sched)
            client = FabricClient(ch, lambda nid=node_id: nid, "127.0.0.1", sink, retry_s=0.2,
                                  busy=(busy or {}).get(i, lambda: ""), budget=budget,
                                  lock=ProbeLock(str(tmp_path / f"lock{i}"))).start()
            made.append((client, ch))
            nodes.append((node_id, client, sink))
        assert _wait(lambda: len(col.fabric.ready_nodes()) == n)
        return col, nodes

    try:
        yield make
    finally:
        for item in reversed(made):
            if isinstance(item, tuple):
                item[0].stop()
                item[1].close()
            else:
                item.stop()


@pytest.mark.slow
def test_a_group_round_runs_one_collective_across_every_member(group_fleet):
    col, nodes = group_fleet(3)
    t0 = time.monotonic()
    [outcome] = col.fabric_group_round(timeout=180)
    took = time.monotonic() - t0
    ids = [n for n, _, _ in nodes]
    assert outcome.status == "ok", outcome.reason
    assert outcome.probe == "collective" and sorted(outcome.members) == sorted(ids)
    assert col.fabric.last_groups.groups == [outcome.members] and col.fabric.group_rounds_done == 1
    rows = {}
    for node_id, client, sink in nodes:
        assert _wait(lambda s=sink: len(s.rows) == 1)
        [rec] = sink.rows
        rows[node_id] = rec
        assert rec["probe"] == "collective" and rec["status"] == "ok", rec["reason"]
        p = rec["params"]
        assert p["group_id"] == outcome.pair_id and p["members"] == ",".join(outcome.members)
        assert p["nnodes"] == 3 and p["node_rank"] == outcome.members.index(node_id)
        assert "nprocs=1" in p["group_params"] and "backend=gloo" in p["group_params"]
        # The rendezvous is rank 0's address and the port it answered with, inside the configured range.
        host, port = rec["env"]["master"].rsplit(":", 1)
        assert host == "127.0.0.1" and PORTS[0] <= int(port) <= PORTS[1]
        assert rec["env"]["world_size"] == 3 and rec["env"]["backend"] == "gloo"
        assert rec["env"]["scheduler"] == "fabric"
        assert not client.lock.held
        [run] = client.fabric_status().recent
        assert run.role == f"rank {p['node_rank']}" and run.status == "ok"
        assert run.busbw_gbytes_per_s == rec["metrics"]["busbw_gbps"] > 0
        assert node_id not in run.peer.split(",") and len(run.peer.split(",")) == 2
    # Every rank times the same all-reduces and the probe averages over ranks: one figure for the group.
    assert len({r["metrics"]["busbw_gbps"] for r in rows.values()}) == 1
    # busbw = algbw x 2(n-1)/n (nccl-tests), n = 3 ranks
    any_rec = next(iter(rows.values()))
    assert any_rec["metrics"]["busbw_gbps"] == pytest.approx(any_rec["metrics"]["algbw_gbps"] * 4 / 3)
    assert took < 120

    for seq, (node_id, _c, sink) in enumerate(nodes, 1):
        _send_results(col, node_id, sink, seq=seq)
    got = _query(col, "SELECT group_id, members, group_size, node_rank, reported_by, backend, world_size, "
                      "busbw_gbytes_per_s, algbw_gbytes_per_s, small_msg_latency_us, largest_bytes, status, "
                      "params_key FROM group_results ORDER BY node_rank")
    assert [r[3] for r in got] == [0, 1, 2]
    assert [r[4] for r in got] == outcome.members
    for r in got:
        assert r[:3] == [outcome.pair_id, ",".join(outcome.members), 3]
        assert r[5:7] == ["gloo", 3] and r[7] == rows[r[4]]["metrics"]["busbw_gbps"] > 0
        assert r[8] > 0 and r[9] > 0 and r[10] == 1048576 and r[11] == "ok"
        assert r[12] == "backend=gloo,iters=5,latency_iters=20,max_bytes=1048576,nprocs=1,warmup=2"
    latest = _query(col, "SELECT node_rank, reported_by FROM group_results_latest")
    assert latest == [[0, outcome.members[0]]]
    # `gpuagent-collector fabric` shows the group's newest run.
    view = json.loads(run_fabric(None, col.address, fmt="json"))
    assert [(g["members"], g["status"], g["world_size"]) for g in view["groups"]] == [
        (",".join(outcome.members), "ok", 3)]
    assert view["groups"][0]["busbw_gbytes_per_s"] == rows[outcome.members[0]]["metrics"]["busbw_gbps"]
    text = run_fabric(None, col.address)
    assert "collective groups (newest run of each, 1; busbw by the nccl-tests formula):" in text
    assert ",".join(outcome.members) in text
    # The run also sits in probe_results as a collective with nnodes=3, which the analyzer leaves to
    # group_results: it is not this node's own collective figure.
    assert _query(col, "SELECT count(*) FROM probe_results WHERE probe = 'collective'") == [[3]]
    # (the filter of the analyzer's 20_node_class.sql and 25_fleet_baselines.sql and of the compare and report
    # views, against the keys as stored)
    assert _query(col, "SELECT count(*) FROM probe_metrics WHERE probe = 'collective'")[0][0] > 0
    assert _query(col, f"SELECT count(*) FROM probe_metrics m WHERE {NOT_FABRIC_GROUP}") == [[0]]
    assert NOT_FABRIC_GROUP in (ROOT / "collector/analysis/sql/20_node_class.sql").read_text()
    assert NOT_FABRIC_GROUP in (ROOT / "collector/analysis/sql/25_fleet_baselines.sql").read_text()


def test_a_busy_member_skips_the_whole_group_with_its_reason(group_fleet):
    col, nodes = group_fleet(3, busy={1: lambda: "gpus busy: a job holds GPU 0"})
    [outcome] = col.fabric_group_round(timeout=60)
    busy_id = nodes[1][0]
    assert outcome.status == "skipped"
    assert outcome.reason == f"node {busy_id} is busy: gpus busy: a job holds GPU 0"
    # The others had accepted and held their lock: the cancel released it, and nothing ran.
    assert _wait(lambda: all(not c.lock.held for _, c, _ in nodes))
    assert all(s.rows == [] for _, _, s in nodes)
    assert nodes[1][1].counts.get("busy") == 1
    assert _wait(lambda: _query(col, "SELECT status, reported_by, group_size, node_rank, reason "
                                     "FROM group_results") == [["skipped", "collector", 3, None, outcome.reason]])


def test_a_group_offer_over_a_nodes_probe_budget_is_refused_with_the_reason(group_fleet):
    # Node 1 has 10 s of probe time an hour: less than a first group run's estimate, so it refuses.
    col, nodes = group_fleet(2, budgets={0: 100.0, 1: 10.0})
    [outcome] = col.fabric_group_round(timeout=60)
    assert outcome.status == "skipped" and outcome.reason == (
        f"node {nodes[1][0]} is busy: budget: 0.0 s of probe time in the last 3600 s, next run estimated "
        f"{COLLECTIVE_FIRST_ESTIMATE_S:.1f} s, limit 10.0 s (0.277778 %)")
    assert _wait(lambda: all(not c.lock.held for _, c, _ in nodes))
    assert all(c.budget.sched.budget_used_s() == 0 for _, c, _ in nodes)     # nothing ran, nothing charged


@pytest.mark.slow
def test_a_group_run_is_charged_its_recorded_duration(group_fleet):
    col, nodes = group_fleet(2, budgets={0: 100.0, 1: 100.0})
    [outcome] = col.fabric_group_round(timeout=120)
    assert outcome.status == "ok", outcome.reason
    for _, client, sink in nodes:
        assert _wait(lambda s=sink: len(s.rows) == 1)
        rec = sink.rows[0]
        recorded_s = (rec["ended_ns"] - rec["started_ns"]) / 1e9
        assert client.budget.sched.budget_used_s() == pytest.approx(recorded_s, abs=1e-3)
        # the next offer is judged by the larger of the first estimate and this run
        assert client.budget.estimate_s({}, "collective") == max(COLLECTIVE_FIRST_ESTIMATE_S,
                                                                 client.budget.last_s["collective"])


def test_bad_group_settings_are_refused_in_one_sentence(group_fleet):
    col, nodes = group_fleet(2, collective_params={**SMALL, "iters": "many"})
    [outcome] = col.fabric_group_round(timeout=60)
    assert outcome.status == "skipped"
    assert "the group's collective settings do not parse: parameter iters of probe collective expects an " \
           "integer, got 'many'" in outcome.reason
    assert _wait(lambda: all(not c.lock.held for _, c, _ in nodes))


def _probe_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "gpuagent.probes collective"], capture_output=True, text=True)
    return [ln for ln in out.stdout.splitlines() if "pgrep" not in ln]


def test_a_run_past_its_deadline_is_killed_before_the_collectors_deadline(group_fleet):
    # A 10 s group deadline leaves each member about 6 s (10 % and the 3 s SIGTERM grace are kept back for the
    # kill and the report), far less than 100,000 all-reduces take: every member's probe is killed at its own
    # timeout, which is what the outcome says, not a missing report. (A 3 s deadline left a 1 s probe and a
    # 2 s margin, which a loaded machine overran: the outcome then said the report was missing.)
    col, nodes = group_fleet(2, group_run_timeout_s=10.0, collective_params={**SMALL, "iters": "100000"})
    before = set(_probe_processes())      # other tests' probes (other workers) are not this test's to reap
    t0 = time.monotonic()
    [outcome] = col.fabric_group_round(timeout=60)
    assert outcome.status == "timeout", outcome
    assert re.search(r"killed after its [0-9.]+ s timeout$", outcome.reason), outcome.reason
    assert time.monotonic() - t0 < 10 + 3     # the answer wait is at most answer_timeout_s (3 s)
    assert _wait(lambda: all(not c.lock.held for _, c, _ in nodes), timeout=15)
    assert _wait(lambda: not set(_probe_processes()) - before, timeout=10), set(_probe_processes()) - before
    # What each member recorded is its probe's timeout, not a measurement (a cancelled member records nothing).
    rows = [r for _, _, s in nodes for r in s.rows]
    assert rows and all(r["status"] == "timeout" and not r["metrics"] for r in rows)


@pytest.mark.slow
def test_a_member_that_fails_ends_the_group_and_the_others_are_cancelled(group_fleet):
    # One member accepts and then does nothing on go (a hung agent); the other's rendezvous gives up after
    # init_timeout_s, and its failure ends the group long before the 120 s group deadline.
    col, nodes = group_fleet(2, group_run_timeout_s=120.0, collective_params={**SMALL, "init_timeout_s": "3"})
    hung_id, hung, _ = nodes[1]
    hung._group_run = lambda node_id, go, cancel: None
    t0 = time.monotonic()
    [outcome] = col.fabric_group_round(timeout=150)
    took = time.monotonic() - t0
    ok_id, ok_client, ok_sink = nodes[0]
    assert outcome.status == "failed" and outcome.reason.startswith(f"node {ok_id}: a rank failed"), outcome
    assert took < 60
    assert _wait(lambda: not ok_client.lock.held)
    [rec] = ok_sink.rows
    assert rec["status"] == "failed" and rec["params"]["group_id"] == outcome.pair_id
    assert _wait(lambda: hung.counts.get("cancelled") == 1)    # the hung member was told


def test_rdma_pairs_without_a_device_are_skipped_with_the_probes_reason(group_fleet):
    why = rdma_pair.unavailable_reason()
    if not why:
        pytest.skip("this machine has an RDMA device and perftest: the skip path cannot be seen here")
    col, nodes = group_fleet(3, group_size=0, rdma_pairs=True, rdma_params={"duration_s": "2"})
    outcomes = col.fabric_rdma_sweep(timeout=60)
    ids = {n for n, _, _ in nodes}
    assert len(outcomes) == 3 and {frozenset((o.node_a, o.node_b)) for o in outcomes} == {
        frozenset((a, b)) for a in ids for b in ids if a < b}
    for o in outcomes:
        assert o.probe == "rdma_pair" and o.status == "skipped"
        assert o.members == [o.node_b, o.node_a]          # the listener is rank 0
        assert f"is busy: {why}" in o.reason
    assert _wait(lambda: all(not c.lock.held for _, c, _ in nodes))
    query = "SELECT probe, status, reported_by, params_key, reason FROM link_results"
    assert _wait(lambda: len(_query(col, query)) == 3)
    rows = _query(col, query)
    assert all(r[:4] == ["rdma_pair", "skipped", "collector", "duration_s=2"] and why in r[4] for r in rows)
    text = run_fabric(None, col.address)
    assert "rdma_pair links (newest run of each, 3):" in text and text.count("  skipped  ") == 3


def test_an_rdma_pair_end_runs_through_the_probe_runner_as_the_agent_starts_it():
    # What an accepted rdma pair runs at each end: the runner's subprocess with the offer's settings and the
    # coordinator's port (registry.PAIR_PROBE_MODULES: runnable, but never scheduled on one node alone).
    from gpuagent.probes import registry
    from gpuagent.probes.runner import run_probe
    assert "rdma_pair" not in registry.names() and "rdma_pair" not in {s.name for s in registry.specs()}
    for role, peer in (("listen", ""), ("connect", "127.0.0.1")):
        params = registry.parse_params("rdma_pair", {"duration_s": "2", "role": role})
        params.update(tcp_port=42210, peer=peer)
        res = run_probe("rdma_pair", params, 30)
        why = rdma_pair.unavailable_reason()
        if why:      # no RDMA here: the probe itself says so, with the same reason the agent refuses with
            assert (res.status, res.reason, res.params["tcp_port"]) == ("skipped", why, 42210)
        else:        # a node with RDMA: one end alone cannot finish, but the tool ran
            assert res.status in ("failed", "timeout") and res.params["tcp_port"] == 42210


def test_group_config_problems_are_one_sentence():
    with pytest.raises(ValueError, match="group_size must be 0 .no group rounds. or at least 2, got 1"):
        FabricConfig.from_mapping({"enabled": True, "group_size": 1})
    with pytest.raises(ValueError, match="may not set master_port: the coordinator sets"):
        FabricConfig.from_mapping({"enabled": True, "group_size": 2, "collective_params": {"master_port": 1}})
    with pytest.raises(ValueError, match=r"\[fabric.collective_params\] must be a table"):
        FabricConfig.from_mapping({"collective_params": "gloo"})
    with pytest.raises(ValueError, match="fabric.rdma_params may not set tcp_port"):
        FabricConfig.from_mapping({"rdma_pairs": True, "rdma_params": {"tcp_port": 5}})
    with pytest.raises(ValueError, match="fabric.rdma_pairs must be true or false, not 'yes'"):
        FabricConfig.from_mapping({"rdma_pairs": "yes"})
    cfg = FabricConfig.from_mapping({"group_size": 4, "collective_params": {"nprocs": 1, "backend": "gloo"}})
    assert cfg.collective_params == {"backend": "gloo", "nprocs": "1"} and cfg.group_size == 4
