"""Fleet fabric probes end to end on the namespace testbed (scripts/netns_fleet.py): 4 agents, each the real
daemon (`gpuagent run` via tests/fabric_agent.py: the real pynvml over an NVML emulator node) in its own network namespace
with its own hostname and machine-id, and a collector in a fifth namespace running pair rounds on its own.
Throttles are real tc shaping (tbf per node, htb per pair) on the veth links.

One fleet serves the module; the tests run in file order and each builds on the state the last left
(the stopped agent comes last)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_helpers import read_status
from conftest import wait_for
from fabric_helpers import ROOT, load_netns_fleet, netns_testbed_or_skip

pytestmark = pytest.mark.slow

AGENTS = ("n0", "n1", "n2", "n3")
COLLECTOR = "n4"
# Every link is shaped from the start, at rates far below what this machine moves with both cores busy: a
# pair's throughput is the shaper's, not the CPU's, so the tests can share the machine with others (at
# 400 Mbit/s and unshaped, a loaded machine read a 400 Mbit/s link slow enough to flag it), and a run moves
# a few MB instead of hundreds (the unshaped sweep took 60 CPU-seconds).
BASE_RATE, SLOW_RATE = "40mbit", "10mbit"
TOKEN = "fabric-e2e-" + os.urandom(8).hex()
# How long an agent has to answer an offer, and a pair run to end, before the collector skips the pair or
# times it out. These tests run among the suite's other workers, where an agent in its namespace can wait
# seconds for a core: at 3 s a sweep once lost a pair to "did not answer within 3 s" (a shuffled run,
# 2026-12-02), and the sweep test, which needs every pair, failed by chance. What the tests prove does not
# depend on these limits: a stopped agent's pairs end at once (its stream is gone), and a busy node refuses.
ANSWER_S, RUN_S = 15.0, 15.0     # a run takes about 3.4 s here; a stopped agent's run waits out RUN_S

def _bed_class():
    nf = load_netns_fleet()

    class Bed(nf.FabricProcesses):
        """The script's collector + agents (agents on emulated NVML nodes), plus what the tests read back."""

        def __init__(self, fleet, tmp: Path):
            super().__init__(fleet, tmp, AGENTS, COLLECTOR, token=TOKEN,
                             collector_toml=nf.fabric_collector_toml(analyze_every="1h", interval_s=0,
                                                                     answer_timeout_s=ANSWER_S, run_timeout_s=RUN_S),
                             agent_cmd=[sys.executable, str(ROOT / "tests" / "fabric_agent.py")],
                             agent_env=lambda name: {"GPUAGENT_TEST_JOB_FILE": str(tmp / f"{name}.job")},
                             cwd=str(ROOT))
            self.tmp = tmp
            self.ids: dict[str, str] = {}      # fleet node name -> collector node id

        def run_cli(self, *args: str) -> str:
            out = self.cli(*args)
            assert out.returncode == 0, out.stderr[-500:]
            return out.stdout

        def sql(self, query: str) -> list[dict]:
            return json.loads(self.run_cli("sql", "--target", self.addr, "--format", "json", query))

        def flags(self) -> list[dict]:
            return [f for f in json.loads(self.run_cli("analyze", "--target", self.addr, "--format", "json"))
                    ["open_flags"] if f["kind"] == "network_degraded"]

        def rounds(self) -> list[tuple[int, list[tuple[str, str, str]]]]:
            """The collector's finished rounds, from its log: (round, [(node_a, node_b, status)])."""
            out = []
            for line in self.rounds_done():
                m = re.match(r"fabric round (\d+) done: (.*)", line)
                if m:
                    out.append((int(m.group(1)), [tuple(re.split(r"[>=]", x)) for x in m.group(2).split()]))
            return out

        def wait_rounds(self, after: int, n: int, timeout: float = 90.0) -> list:
            """Wait until ``n`` rounds numbered ``after`` or later are done; those rounds."""
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                got = [r for r in self.rounds() if r[0] >= after]
                if len(got) >= n:
                    return got[:n]
                for name, p in self.agents.items():
                    assert p.poll() is None or name == "n3", \
                        f"agent {name} exited: {(self.tmp / f'{name}.log').read_text()[-1500:]}"
                assert self.collector.poll() is None, self.col_log.read_text()[-2000:]
                time.sleep(0.3)
            raise AssertionError(f"{n} rounds from {after} not done in {timeout} s: {self.rounds()[-3:]}")

        def next_round(self) -> int:
            rounds = self.rounds()
            return (rounds[-1][0] + 1) if rounds else 0

        def sweep_after_now(self, extra_rounds: int = 0, every_pair: bool = False) -> list:
            """3 rounds for 4 nodes that start after now; waits for the batches to land too. With
            ``every_pair``, more rounds until every pair has a run that started after now: 3 rounds cover
            every pair only when they line up with the planner's sweep (they need not: a link then kept the
            previous test's last run, and its node looked degraded)."""
            changed = time.time()
            start = self.next_round() + 1     # the round in flight may have started before the change
            got = self.wait_rounds(start, 3 + extra_rounds)
            self.wait_stored(got, changed)
            end = time.monotonic() + 60
            while every_pair and self.pairs_run_since(changed) < len(AGENTS) * (len(AGENTS) - 1) // 2:
                assert time.monotonic() < end, f"not every pair ran after the change: {self.rounds()[-4:]}"
                more = self.wait_rounds(self.next_round(), 1)
                self.wait_stored(more, changed)
                got += more
            return got

        def wait_stored(self, rounds: list, since: float, timeout: float = 30.0) -> None:
            """Until both ends' rows of every ok pair run in ``rounds`` (started after ``since``) are in
            link_results, which the analysis reads: the agents send them in batches, 1 s apart."""
            want = {frozenset((a, b)) for _r, ps in rounds for a, b, st in ps if st == "ok"}

            def stored() -> bool:
                rows = self.sql("SELECT node_a, node_b, count(DISTINCT reported_by) AS ends FROM link_results "
                                f"WHERE reported_by <> 'collector' AND started_at > make_timestamp({int(since * 1e6)}) "
                                "GROUP BY ALL")
                return want <= {frozenset((r["node_a"], r["node_b"])) for r in rows if r["ends"] == 2}
            wait_for(stored, timeout=timeout, interval=0.5, what=f"both ends' rows of the runs of {rounds}")

        def pairs_run_since(self, t: float) -> int:
            return self.sql("SELECT count(DISTINCT least(node_a, node_b) || '|' || greatest(node_a, node_b)) AS n "
                            f"FROM link_results WHERE probe = 'net_pair' AND status = 'ok' "
                            f"AND started_at > make_timestamp({int(t * 1e6)})")[0]["n"]

    return Bed


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    nf = netns_testbed_or_skip()
    fleet = nf.Fleet.up(len(AGENTS) + 1)
    tb = _bed_class()(fleet, tmp_path_factory.mktemp("fabric"))
    try:
        for name in AGENTS:
            fleet.throttle_node(name, BASE_RATE)
        tb.start()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            assert tb.collector.poll() is None, tb.col_log.read_text()[-1000:]
            try:
                rows = tb.sql("SELECT node_id, hostname FROM nodes")
            except AssertionError:
                rows = []
            if len(rows) == len(AGENTS):
                break
            time.sleep(1.0)
        host = {n.hostname: name for name, n in fleet.nodes.items()}
        tb.ids = {host[r["hostname"]]: r["node_id"] for r in rows}
        assert sorted(tb.ids) == list(AGENTS), rows
        yield tb
    finally:
        tb.stop()
        fleet.down()


@pytest.fixture(autouse=True)
def all_agents_running(bed):
    """Every test starts with the 4 agents in the plan, in any order: the test that stops an agent (n3) leaves it
    stopped, and a test after it (a shuffled order) would see a 3-node sweep. Restart it and wait for a round
    that ran one of its pairs; in the file's own order the stop test is last and this never runs."""
    stopped = [name for name, p in bed.agents.items() if p.poll() is not None]
    for name in stopped:
        bed.start_agent(name)
    end = time.monotonic() + 90
    while stopped:
        assert time.monotonic() < end, f"restarted agents {stopped} not back in the plan: {bed.rounds()[-3:]}"
        (_r, pairs), = bed.wait_rounds(bed.next_round(), 1)
        stopped = [name for name in stopped if not any(bed.ids[name] in (a, b) and st == "ok" for a, b, st in pairs)]
    yield


def test_full_sweep_measures_every_pair_within_n_minus_1_rounds(bed):
    first = bed.wait_rounds(0, 3)
    # The first rounds may start before the last agent attached (under load, several of them); the first
    # round with all 4 nodes starts a sweep.
    end = time.monotonic() + 90
    while not any(len(pairs) == 2 for _r, pairs in bed.rounds()):
        assert time.monotonic() < end, f"no round with all 4 nodes in 90 s: {bed.rounds()[-3:]}"
        bed.wait_rounds(bed.next_round(), 1)
    start = next(r for r, pairs in bed.rounds() if len(pairs) == 2)
    sweep = bed.wait_rounds(start, 3)
    pairs = [(a, b, st) for _r, ps in sweep for a, b, st in ps]
    assert len(first) == 3
    assert {frozenset((a, b)) for a, b, _ in pairs} == {frozenset(p) for p in itertools.combinations(bed.ids.values(), 2)}
    assert all(st == "ok" for *_, st in pairs), pairs
    # Each node is in at most one pair per round.
    for _r, ps in sweep:
        ends = [n for a, b, _ in ps for n in (a, b)]
        assert len(ends) == len(set(ends))
    bed.wait_stored(sweep, 0.0)
    rows = bed.sql("SELECT node_a, node_b, reported_by, send_gbits_per_s, recv_gbits_per_s, rtt_p50_us "
                   "FROM link_results WHERE status = 'ok'")
    by_link: dict[frozenset, set] = {}
    for r in rows:
        assert r["send_gbits_per_s"] > 0 and r["recv_gbits_per_s"] > 0 and r["rtt_p50_us"] > 0
        by_link.setdefault(frozenset((r["node_a"], r["node_b"])), set()).add(r["reported_by"])
    assert len(by_link) == 6 and all(ends == set(link) for link, ends in by_link.items())
    names = {r["hostname"] for r in bed.sql("SELECT hostname FROM nodes")}
    assert names == {bed.fleet.node(n).hostname for n in AGENTS}

    # `gpuagent status` on each node shows its last fabric runs, the values its end reported.
    rows = bed.sql("SELECT pair_id, node_a, node_b, reported_by, status, send_gbits_per_s, recv_gbits_per_s, "
                   "rtt_p50_us FROM link_results WHERE reported_by <> 'collector'")
    stored = {(r["pair_id"], r["reported_by"]): r for r in rows}
    for name in AGENTS:
        me = bed.ids[name]
        out = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--json",
                              "--state-dir", str(bed.tmp / name)], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        fab = json.loads(out.stdout)["fabric"]
        assert fab["stream_open"] and fab["address"] == bed.fleet.node(name).ip
        assert len(fab["recent"]) >= 3 and fab["counts"]["result:ok"] >= 3
        for run in fab["recent"]:
            row = stored.get((run["pair_id"], me))
            if row is None:          # a run that ended after the query above
                continue
            assert run["peer"] == (row["node_b"] if row["node_a"] == me else row["node_a"])
            assert run["role"] == ("connect" if row["node_a"] == me else "listen")
            # Runs of earlier tests (in any order) can be among the recent ones: one that did not end ok has
            # the figures it got (often none), the same in the status and in the table.
            assert run["status"] == row["status"], (name, run, row)
            for k in ("send_gbits_per_s", "recv_gbits_per_s", "rtt_p50_us"):
                if row["status"] == "ok":
                    assert run[k] == pytest.approx(row[k]), (name, k)
                else:
                    assert (run.get(k) is None and row[k] is None) or run.get(k) == pytest.approx(row[k]), \
                        (name, k, run, row)
        text = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--state-dir",
                               str(bed.tmp / name)], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
        assert f"Fabric    peers reach this node at {bed.fleet.node(name).ip}" in text


def test_node_throttled_to_a_quarter_opens_network_degraded_node_for_it_only(bed):
    for name in AGENTS:
        bed.fleet.unthrottle(name)     # a node carries a node throttle or pair throttles, never both
    for name in AGENTS:
        bed.fleet.throttle_node(name, SLOW_RATE if name == "n2" else BASE_RATE)
    bed.sweep_after_now(every_pair=True)
    flags = bed.flags()
    assert [(f["node_id"], f["component"]) for f in flags] == [(bed.ids["n2"], "node")], flags
    ev = json.loads(flags[0]["evidence"]) if isinstance(flags[0]["evidence"], str) else flags[0]["evidence"]
    assert ev["slow_links"] == 3 and ev["links"] == 3
    assert flags[0]["value"] < 0.4 * flags[0]["baseline"], flags[0]
    assert "drain node " + bed.fleet.node("n2").hostname in flags[0]["sentence"]


def test_one_pair_throttled_opens_network_degraded_link_for_that_pair_only(bed):
    for name in AGENTS:
        bed.fleet.unthrottle(name)
    for a, b in itertools.combinations(AGENTS, 2):
        bed.fleet.throttle_pair(a, b, SLOW_RATE if {a, b} == {"n0", "n3"} else BASE_RATE)
    bed.sweep_after_now(every_pair=True)
    flags = bed.flags()
    pair = sorted((bed.ids["n0"], bed.ids["n3"]))
    assert [(f["node_id"], f["component"]) for f in flags] == [(pair[0], "link")], flags
    ev = json.loads(flags[0]["evidence"]) if isinstance(flags[0]["evidence"], str) else flags[0]["evidence"]
    assert ev["pair"] == pair
    hn = {bed.fleet.node(n).hostname for n in ("n0", "n3")}
    assert all(h in flags[0]["sentence"] for h in hn) and "check the cable" in flags[0]["sentence"]


def _eth0_bytes(bed, name: str) -> int:
    out = bed.fleet.exec(name, ["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                                "/sys/class/net/eth0/statistics/rx_bytes"]).stdout.split()
    return sum(int(x) for x in out)


def _gpu0_jobs(bed, name: str) -> list[dict]:
    """The jobs on GPU 0 in node ``name``'s status file (job discovery's view, as the fabric client's)."""
    st = read_status(bed.tmp / name) or {}
    return [j for j in st.get("jobs") or [] if j.get("gpu") == 0]


def test_a_job_on_the_gpus_keeps_fabric_traffic_off_the_node(bed):
    job = bed.tmp / "n1.job"
    job.write_text("hold GPU 0\n")
    try:
        # the emulated node lists the job's process on GPU 0; job discovery sees it at a tick
        wait_for(lambda: _gpu0_jobs(bed, "n1"), timeout=30, interval=0.2, what="n1's job on GPU 0 in its status")
        # The round in flight may have paired n1 before its job was seen, and that run's bytes would count
        # below: let it finish before counting (later rounds' offers reach n1 with the job already seen).
        bed.wait_rounds(bed.next_round(), 1)
        before, t_seen = _eth0_bytes(bed, "n1"), time.time()
        sweep = bed.sweep_after_now()
        moved = _eth0_bytes(bed, "n1") - before
    finally:
        job.unlink()
        # the job ends (its process leaves the GPU list; job discovery's end grace): the node is free again
        wait_for(lambda: not _gpu0_jobs(bed, "n1"), timeout=30, interval=0.2, what="n1's job gone from its status")
    n1 = bed.ids["n1"]
    mine = [(a, b, st) for _r, ps in sweep for a, b, st in ps if n1 in (a, b)]
    others = [(a, b, st) for _r, ps in sweep for a, b, st in ps if n1 not in (a, b)]
    assert len(mine) == 3 and all(st == "skipped" for *_, st in mine), mine
    assert len(others) == 3 and all(st == "ok" for *_, st in others), others
    # The skips of the rounds since the job was seen (earlier tests' rounds on a loaded machine may hold skips
    # for other reasons, such as "did not answer within 3 s", seen once in the parallel part).
    rows = bed.sql(f"SELECT reason FROM link_results WHERE status = 'skipped' AND '{n1}' IN (node_a, node_b) "
                   f"AND started_at > make_timestamp({int(t_seen * 1e6)})")
    assert len(rows) >= 3 and all(f"node {n1} is busy: gpus busy: a job holds GPU 0" in r["reason"] for r in rows)
    # Each ok pair run at 10-40 Mbit/s for 1 s each way moves >= 2.5 MB; the agent's own telemetry is a few kB/s.
    assert moved < 2_000_000, moved


@pytest.fixture
def n3_back_after(bed):
    """The test kills n3's agent: start it again after, so tests run after it have their four nodes. (The full
    sweep test still needs to run first in the module: it counts rounds from the planner's first sweep.)"""
    yield
    if bed.agents["n3"].poll() is not None:     # reaped: poll() waits for a process that has exited
        bed.start_agent("n3")


def test_stopping_an_agent_mid_round_gives_reasons_and_the_others_carry_on(bed, n3_back_after):
    n3 = bed.ids["n3"]
    t_stop = None
    end = time.monotonic() + 60
    log = bed.col_log
    seen = len(log.read_text(errors="replace"))
    while time.monotonic() < end and t_stop is None:
        text = log.read_text(errors="replace")
        m = re.search(rf"fabric round (\d+) started: .*{n3}", text[seen:])
        if m:
            time.sleep(0.7)                    # inside the run (warmup 0.2 s, duration 1 s)
            bed.agents["n3"].send_signal(signal.SIGKILL)
            t_stop = int(m.group(1))
        time.sleep(0.05)
    assert t_stop is not None
    got = bed.wait_rounds(t_stop, 4)
    hit = [(a, b, st) for r, ps in got for a, b, st in ps if r == t_stop and n3 in (a, b)]
    assert hit and all(st != "ok" for *_, st in hit), got
    # The rest of the sweep planned before the stop skips the stopped node's pairs at once (its stream is
    # gone); every other pair carries on, and the next plan leaves the node out.
    later = [(a, b, st) for r, ps in got[1:] for a, b, st in ps]
    assert all((st != "ok") if n3 in (a, b) else (st == "ok") for a, b, st in later), later
    assert any(n3 not in (a, b) for a, b, _ in later)
    rows = wait_for(lambda: bed.sql(f"SELECT status, reason, reported_by FROM link_results WHERE status <> 'ok' "
                                    f"AND '{n3}' IN (node_a, node_b) AND reason IS NOT NULL AND reason <> ''"),
                    timeout=30, interval=0.5, what="a failed/skipped/timeout row with a reason for the stopped "
                                                   "node's pair")
