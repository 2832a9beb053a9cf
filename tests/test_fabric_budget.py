"""Fabric probing stays within each node's probe budget, measured.

A real collector and fabric coordinator on loopback; in-process agents, each with a FabricClient, its own
probe lock and a real ProbeScheduler whose budget the fabric shares (agent.fabric.FabricBudget, as the
daemon wires it); real net_pair runs over 127.0.0.1. The figures come from what was recorded: each end's
link_results row (started_at/ended_at, shipped as the agent's batches would be) and the scheduler's window.
Run with -s to see the FABRIC-BUDGET lines.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from collector_helpers import node_info
from conftest import worker_ports
from test_fabric_coordinator import Results, _query, _send_results, _wait
from gpuagent.agent.config import ProbesConfig
from gpuagent.agent.probing.fabric import FabricBudget, FabricClient
from gpuagent.agent.probing.scheduler import ProbeScheduler
from gpuagent.collector.fabric.coordinator import FabricConfig
from gpuagent.collector.service import start_collector
from gpuagent.probes.lock import ProbeLock
from gpuagent.probes.net_pair import NetPairListener
from gpuagent.proto import pb, pb_grpc

PORTS = worker_ports(3)   # this worker's own range for fabric listeners and rendezvous ports
FAST = {"streams": "2", "duration_s": "0.3", "warmup_s": "0.1", "rtt_count": "50"}   # about 0.9 s a run
FAST_HOST = {"repeats": 1, "syscall_iters": 10000, "clock_iters": 10000, "pipe_iters": 200, "fault_mib": 4,
             "memcpy_mib": 8}
WINDOW_S = 60.0


class Node:
    def __init__(self, node_id, client, sink, sched):
        self.id, self.client, self.sink, self.sched = node_id, client, sink, sched


@pytest.fixture
def fleet(tmp_path):
    made = {"col": None, "nodes": [], "channels": []}

    def start(params):
        cfg = FabricConfig(enabled=True, answer_timeout_s=2.0, run_timeout_s=30.0, params=dict(params),
                           port_lo=PORTS[0], port_hi=PORTS[1])
        made["col"] = start_collector(tmp_path / "c.duckdb", analyze=False, fabric=cfg, fabric_rounds=False)
        return made["col"]

    def add(i, budget_s):
        col = made["col"]
        ch = grpc.insecure_channel(col.address)
        made["channels"].append(ch)
        info = node_info(hostname=f"n{i}", machine_id=f"m-{i:04d}")
        info.fabric_address = "127.0.0.1"
        node_id = pb_grpc.CollectorStub(ch).Register(pb.RegisterRequest(node=info)).node_id
        sched = ProbeScheduler(Results(), ProbesConfig.from_mapping({
            "budget_window_s": WINDOW_S, "budget_fraction": budget_s / WINDOW_S,
            "lock_path": str(tmp_path / f"lock{i}"), "host": {"params": FAST_HOST}}))
        sink = Results()
        client = FabricClient(ch, lambda: node_id, "127.0.0.1", sink, lock=ProbeLock(sched.lock_path),
                              budget=FabricBudget(sched), retry_s=0.2).start()
        node = Node(node_id, client, sink, sched)
        made["nodes"].append(node)
        return node

    try:
        yield start, add
    finally:
        for n in made["nodes"]:
            n.client.stop()
        for ch in made["channels"]:
            ch.close()
        if made["col"] is not None:
            made["col"].stop()


def _sweeps(col, nodes, count):
    """``count`` full sweeps; then each node's results go to the collector as its batches would."""
    assert _wait(lambda: len(col.fabric.ready_nodes()) == len(nodes))
    outcomes = []
    for _ in range(count):
        outcomes += col.fabric_sweep(timeout=300)
    assert {o.status for o in outcomes} <= {"ok", "skipped"}, [(o.status, o.reason) for o in outcomes]
    ran = sum(o.status == "ok" for o in outcomes)
    # Exactly one row per end of each pair that ran: a pair skipped or cancelled leaves none at the agents.
    assert _wait(lambda: sum(len(n.sink.rows) for n in nodes) == 2 * ran), [
        (r["params"]["pair_id"], r["env"]["role"], r["status"], r["reason"]) for n in nodes for r in n.sink.rows]
    for seq, n in enumerate(nodes, 1):
        if n.sink.rows:
            _send_results(col, n.id, n.sink, seq=seq)
    return outcomes


def _measure(col, nodes, outcomes, extra=None):
    """Per node, from link_results: the runs it recorded, the most probe time inside any budget window
    (runs ending within WINDOW_S of each run's end, as the scheduler counts them), and the pairs skipped.
    ``extra``: node id -> [(ended_ns, seconds)] of the node's own probes (the scheduler's figures)."""
    rows = _query(col, "SELECT reported_by, status, reason, node_a, node_b, epoch_us(started_at), "
                       "epoch_us(ended_at) FROM link_results")
    figures = {}
    for n in nodes:
        mine = [r for r in rows if r[0] == n.id]
        assert all(r[1] == "ok" for r in mine), mine
        runs = [((r[6] - r[5]) / 1e6, r[6] * 1000, "connect" if r[3] == n.id else "listen") for r in mine]
        spans = [(end, s) for s, end, _ in runs] + list((extra or {}).get(n.id, []))
        worst = max((sum(s for e, s in spans if end - WINDOW_S * 1e9 <= e <= end) for end, _ in spans), default=0.0)
        skipped = [r for r in rows if r[0] == "collector" and n.id in (r[3], r[4])]
        offers = sum(n.id in (o.node_a, o.node_b) for o in outcomes)
        figures[n.id] = {"runs": [s for s, _, _ in runs], "used": sum(s for _, s in spans), "worst": worst,
                         "skipped": skipped, "offers": offers, "by_role": [(role, s) for s, _, role in runs]}
        f = figures[n.id]
        print(f"FABRIC-BUDGET node={n.id[:12]} used_s={f['used']:.3f} max_in_window_s={worst:.3f} "
              f"budget_s={n.sched.budget_s:.2f} window_s={WINDOW_S:g} runs={len(mine)} skipped={len(skipped)} "
              f"refused={n.client.counts.get('busy', 0)} offers={offers} "
              f"run_s=[{', '.join(f'{s:.3f}' for s in f['runs'])}]")
    return figures


def _check_accounting(n, f, own=()):
    """The scheduler's window holds one charge per run, equal to the run's recorded duration, and
    budget_used_s() (what the node's own probes check) is their sum."""
    charges = sorted(n.sched.charges_s())
    assert charges == pytest.approx(sorted(list(f["runs"]) + list(own)), abs=2e-6)
    assert n.sched.budget_used_s() == pytest.approx(f["used"], abs=1e-5)


def test_fabric_rounds_stay_within_each_nodes_probe_budget(fleet):
    start, add = fleet
    col = start(FAST)
    budget_s = 3.9      # about 0.9 s a run and 1.8 s estimated: 2 or 3 runs fit in the 60 s window
    nodes = [add(i, budget_s) for i in range(4)]
    # Node 0's own scheduled probe runs first (a real subprocess); the fabric must count it.
    host = nodes[0].sched.run_once("host")[0]
    assert host["status"] == "ok", host
    own = {nodes[0].id: [(time.time_ns(), nodes[0].sched.last_run_s("host"))]}   # its charge, ended now
    t0 = time.monotonic()
    outcomes = _sweeps(col, nodes, 4)          # 12 rounds: each node is offered 12 pairs
    took = time.monotonic() - t0
    figures = _measure(col, nodes, outcomes, own)
    print(f"FABRIC-BUDGET sweeps=4 rounds={col.fabric.rounds_done} pairs={len(outcomes)} "
          f"ran={sum(o.status == 'ok' for o in outcomes)} wall_s={took:.1f}")
    for role in ("connect", "listen"):     # the listening end's run includes waiting for the peer's go
        took_s = [s for f in figures.values() for r, s in f["by_role"] if r == role]
        print(f"FABRIC-BUDGET role={role} runs={len(took_s)} mean_s={sum(took_s) / max(1, len(took_s)):.3f}")
    for n in nodes:
        f = figures[n.id]
        assert f["worst"] <= n.sched.budget_s, (n.id, f)
        assert len(f["runs"]) >= 1 and len(f["runs"]) + len(f["skipped"]) == f["offers"] == 12
        _check_accounting(n, f, own=[s for _, s in own.get(n.id, [])])
        # A skipped pair names the first end that refused (the collector cancels the pair at once).
        mine = [r for r in f["skipped"] if f"node {n.id} is busy: budget: " in r[2]]
        assert len(mine) <= n.client.counts.get("busy", 0)
    assert all(o.status == "ok" or "is busy: budget: " in o.reason for o in outcomes)
    assert all(f"limit {budget_s:.1f} s" in o.reason for o in outcomes if o.status == "skipped")
    assert sum(o.status == "skipped" for o in outcomes) >= len(outcomes) // 2     # far more offered than fit


def test_the_first_run_is_not_underestimated(fleet):
    # net_pair measures each direction for warmup_s + duration_s: at these settings a run takes about
    # 4.7 s, so a node with 4 s of budget must refuse its first offer.
    start, add = fleet
    col = start({"streams": "2", "duration_s": "2.0", "warmup_s": "0.3", "rtt_count": "200"})
    small, big1 = add(0, 4.0), add(1, 8.0)
    outcomes = _sweeps(col, [small, big1], 1)
    figures = _measure(col, [small, big1], outcomes)
    for n in (small, big1):
        assert figures[n.id]["worst"] <= n.sched.budget_s, figures[n.id]
        _check_accounting(n, figures[n.id])
    assert [o.status for o in outcomes] == ["skipped"] and small.client.counts.get("busy") == 1
    assert f"node {small.id} is busy: budget: 0.0 s" in outcomes[0].reason and "limit 4.0 s" in outcomes[0].reason

    # Two nodes with room run the pair; the estimate the offer was judged by is not below what it took.
    small.client.stop()
    big2 = add(2, 8.0)
    assert _wait(lambda: set(col.fabric.ready_nodes()) == {big1.id, big2.id})
    second = _sweeps(col, [big1, big2], 1)
    assert [o.status for o in second] == ["ok"]
    figures = _measure(col, [big1, big2], outcomes + second)
    estimate = big1.client.budget.estimate_s(second[0].params)
    took = max(figures[big1.id]["runs"] + figures[big2.id]["runs"])
    print(f"FABRIC-BUDGET default-like settings: estimate_s={estimate:.2f} measured_s={took:.3f}")
    # link_results keeps microseconds: each end of a run is truncated to one, so a run read back from the
    # table can be up to 2 us longer than the duration the budget learned (seen: 5.780182 against 5.780181064).
    assert took <= estimate + 2e-6
    for n in (big1, big2):
        assert figures[n.id]["worst"] <= n.sched.budget_s, figures[n.id]
        _check_accounting(n, figures[n.id])


def test_a_scheduled_probe_that_waited_for_the_lock_sees_the_run_that_held_it(tmp_path):
    # lock_wait_s > 0: the scheduler checks the budget, then waits for the lock while another run (as a
    # fabric pair would) holds it and charges its time; the probe must not run past the budget.
    sink = Results()
    sched = ProbeScheduler(sink, ProbesConfig.from_mapping({
        "budget_window_s": WINDOW_S, "budget_fraction": 0.01, "lock_wait_s": 10,
        "lock_path": str(tmp_path / "lock"), "host": {"params": FAST_HOST}}))
    other = ProbeLock(sched.lock_path)
    assert other.acquire(0.0, what="net_pair test")
    got = {}
    waiter = threading.Thread(target=lambda: got.setdefault("rec", sched.run_once("host")[0]))
    t0 = time.monotonic()
    waiter.start()
    time.sleep(1.0)
    sched.charge(time.monotonic() - t0)      # the holder's run: 1 s against a 0.6 s budget
    other.release()
    waiter.join(30)
    rec = got["rec"]
    assert rec["status"] == "skipped" and rec["reason"].startswith("budget: 1.0 s of probe time"), rec
    assert sched.budget_used_s() == pytest.approx(1.0, abs=0.1)


def test_a_pair_cancelled_before_its_listener_waits_records_and_charges_nothing(tmp_path):
    # The interleaving a refusing peer can cause: this end accepted as listener, and the collector's cancel
    # closed its socket before the serve thread reached accept(). Driven through the client's own handlers
    # in that order; nothing ran, so there must be no net_pair row and no charge.
    sched = ProbeScheduler(Results(), ProbesConfig.from_mapping({
        "budget_window_s": WINDOW_S, "lock_path": str(tmp_path / "lock")}))
    sink = Results()
    ch = grpc.insecure_channel("127.0.0.1:9")       # never called: a cancelled pair sends no finish report
    client = FabricClient(ch, lambda: "n0", "127.0.0.1", sink, lock=ProbeLock(sched.lock_path),
                          budget=FabricBudget(sched))
    offer = pb.Assignment(kind="offer", pair_id="t-r0-1", role="listen", node_a="n1", node_b="n0",
                          params=FAST, deadline_ns=time.time_ns() + 2_000_000_000)
    try:
        assert client.lock.acquire(0.0, what="net_pair t-r0-1")
        listener = NetPairListener("secret", "127.0.0.1", accept_timeout_s=5)
        client._pending[offer.pair_id] = (offer, listener)          # as _offer leaves an accepted listen
        client._handle("n0", pb.Assignment(kind="cancel", pair_id=offer.pair_id, reason="node n1 is busy"))
        assert not client.lock.held
        client._serve("n0", offer, listener)                         # the serve thread, starting late
        assert sink.rows == [] and sched.budget_used_s() == 0.0 and client.counts == {"cancelled": 1}
    finally:
        ch.close()
