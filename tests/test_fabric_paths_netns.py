"""The cheap fabric layer (path probes, issue 43) end to end on the namespace testbed (scripts/netns_fleet.py):
4 real agent daemons (tests/fabric_agent.py: the real pynvml over the NVML emulator), each in its own network
namespace with its UDP echo responder and prober, and a collector in a fifth that sends every node its
pinglist every epoch and runs the real analysis (the Analyze RPC, `gpuagent-collector analyze --target`).

* healthy: every node stores an epoch summary (probe_results/probe_metrics, probe path_probe, role summary)
  and the analysis raises no network_degraded flag of the path layer (node_paths, link_paths);
* one node's link throttled with tc mid-run (tbf, 100 -> 20 Mbit/s) opens node_paths on that node within a
  few epochs, named by its healthy peers, and no link_paths flag between two unthrottled nodes;
* one pair throttled (htb + u32 on both ends) opens link_paths for exactly that pair;
* with the collector restarted on ``sweep = "targeted"``, that pair's suspect gets a net_pair run.

Every link is shaped from the start, to 100 Mbit/s (tbf per node; htb per pair in the pair tests), with a
16 KiB bucket: the default bucket (>= 64 KiB) lets a 45 KB train through unshaped (scripts/netns_fleet.py),
as a link that really came up slow would not. Why shaped and not the bare veths: unshaped, a train reads
the pace at which Python sends and echoes datagrams, 0.4-1.35 Gbit/s here and bimodal (about 0.65 and 1.3),
so with both cores busy (another benchmark beside the test) a healthy path's best of four readings fell
under half its node's median 1-9 times a minute among 228 paths, each a suspect and a link_paths flag
(2026-12-07, 60 s each: 9, 1, 7 suspects unshaped; 0, 0, 0 shaped). Shaped, a healthy train reads
0.104-0.145 Gbit/s (the shaper's rate, the bucket's share at once) and a throttled one about 0.03.

Net_pair runs are off for the first tests (``sweep = "full"``, ``interval_s = 3600``: see collector_toml).
With ``sweep = "targeted"`` from the start, a throttled node's suspects got net_pair runs, and each run at
100 Mbit/s filled both its ends' shaped links for 3 s: every path probe through those nodes meanwhile read
slow and late (trains 0.04-0.1 Gbit/s, rtt 3-18 ms), was confirmed (the confirmations, 0.19 s apart in
epochs of 3 s, fell inside the same 3 s) and became a suspect of its own, which got the next round's runs: two runs a round and 3-12
suspects an epoch, still so 70 s after n2 was back at the base rate, with link_paths flags between nodes
never throttled (2026-12-07, twice; a product issue, not the testbed's: the coordinator and the tomography
now leave out suspects probed during a run). So the targeted test comes last and
throttles a pair (an htb class of its own, which its runs fill without touching the two nodes' other paths).

Settings, and why: epochs of 3 s and ``path_cover_s = 3``, so each node probes all 3 of its peers every
epoch (k = 3). With 1-2 peers an epoch (k = ceil(3 x epoch / cover)), a 4-node pool's cycle would have an
epoch in which each node probes one peer, and the node whose one path that epoch is the throttled node's has a
newest summary made of that slow path alone: the tomography, which judges a node by its newest summary,
then counts it as a bad own view, and the throttled node's healthy namers can drop below 2. A pool of
dozens (k >= 7) has no such epoch. PathSettings are the defaults (min_reference 4: reached after two
epochs). The analyzer's path window is 12 s (4 epochs), and each throttle test waits its suspects out of it.
The test asks the collector once an epoch, after that epoch's summaries landed: each query is a CLI process
in the collector's namespace, and polling every second took CPU the probes' own timing needs.

One fleet serves the module and the tests run in file order (tests/conftest.py IN_FILE_ORDER)."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import pytest

from conftest import wait_for
from fabric_helpers import ROOT, load_netns_fleet, netns_testbed_or_skip

pytestmark = pytest.mark.slow

AGENTS = ("n0", "n1", "n2", "n3")
COLLECTOR = "n4"
TOKEN = "fabric-paths-" + os.urandom(8).hex()
EPOCH_S = 3.0
WINDOW_S = 12.0
BASE_RATE, SLOW_RATE, BURST = "100mbit", "20mbit", 16384
LAND_S = 2.0             # after an epoch's end, its summaries are in (the agents' batches go every second)
DETECT_EPOCHS = 6        # epochs after the throttle within which the flag must open (2-3 seen)
PATH_COMPONENTS = ("node_paths", "link_paths")
MEASURED: dict[str, object] = {}      # what the tests saw, printed when the module's fleet goes (pytest -s)


def collector_toml(sweep: str) -> str:
    """``sweep = "off"``: full sweeps an hour apart, which is none here (the coordinator's loop finds no node
    ready as the collector starts, and sleeps the hour; were one ready, one sweep, which the fixture waits
    out); "targeted": the suspects' runs alone (no rolling share)."""
    runs = ('sweep = "full"\ninterval_s = 3600' if sweep == "off" else
            'sweep = "targeted"\ninterval_s = 0\ntargeted_interval_s = 2\nrolling_runs_per_hour = 0')
    return f"""
[analyzer]
interval = "1h"
fabric_runs = 1
path_window_s = {WINDOW_S:g}

[fabric]
enabled = true
{runs}
scope_key = "pool"
answer_timeout_s = 15
run_timeout_s = 15
port_lo = 42000
port_hi = 42100
paths = true
path_epoch_s = {EPOCH_S:g}
path_cover_s = {EPOCH_S:g}

[fabric.params]
streams = 2
duration_s = 1.0
warmup_s = 0.2
rtt_count = 50
"""


def _ts(t: float) -> str:
    return f"make_timestamp({int(t * 1e6)})"


def _ev(flag: dict) -> dict:
    return json.loads(flag["evidence"]) if isinstance(flag["evidence"], str) else flag["evidence"]


def _epoch(t: float) -> int:
    return int(t // EPOCH_S)


def _after_next_epoch() -> None:
    """Sleep until the epoch in progress has ended and its summaries landed."""
    time.sleep(max(0.0, (_epoch(time.time()) + 1) * EPOCH_S + LAND_S - time.time()))


class Bed:
    def __init__(self, nf, fleet, tmp):
        self.nf, self.fleet, self.tmp = nf, fleet, tmp
        self.procs = nf.FabricProcesses(fleet, tmp, AGENTS, COLLECTOR, token=TOKEN,
                                        collector_toml=collector_toml("off"),
                                        agent_cmd=[sys.executable, str(ROOT / "tests" / "fabric_agent.py")],
                                        cwd=str(ROOT))
        self.ids: dict[str, str] = {}       # fleet node name -> collector node id
        self.names: dict[str, str] = {}     # and back

    def alive(self) -> None:
        p = self.procs
        assert p.collector.poll() is None, p.col_log.read_text()[-2000:]
        for name, a in p.agents.items():
            assert a.poll() is None, f"agent {name} exited: {(self.tmp / f'{name}.log').read_text()[-1500:]}"

    def sql(self, query: str) -> list[dict]:
        out = self.procs.cli("sql", "--target", self.procs.addr, "--format", "json", query)
        assert out.returncode == 0, out.stderr[-500:]
        return json.loads(out.stdout)

    def answers(self) -> bool:
        """Does the collector answer queries (yet)?"""
        self.alive()
        out = self.procs.cli("sql", "--target", self.procs.addr, "--format", "json", "SELECT 1 AS one")
        return out.returncode == 0

    def path_flags(self) -> list[dict]:
        """One analysis pass now (the Analyze RPC); the open network_degraded flags of the path layer."""
        out = self.procs.cli("analyze", "--target", self.procs.addr, "--format", "json", timeout_s=120)
        assert out.returncode == 0, out.stderr[-500:]
        return [f for f in json.loads(out.stdout)["open_flags"]
                if f["kind"] == "network_degraded" and f["component"] in PATH_COMPONENTS]

    def summaries(self, since: float) -> list[dict]:
        """The path-probe summaries that started after ``since``, with their metrics."""
        return self.sql(
            "SELECT r.node_id, epoch(r.started_at) AS t, json_extract_string(r.params, '$.epoch') AS epoch, "
            "r.status, max(m.value) FILTER (WHERE m.metric = 'paths') AS paths, "
            "max(m.value) FILTER (WHERE m.metric = 'paths_suspect') AS paths_suspect, "
            "max(m.value) FILTER (WHERE m.metric = 'train_gbits_per_s') AS train, "
            "max(m.value) FILTER (WHERE m.metric = 'rtt_p50_us') AS rtt_us, "
            "max(m.value) FILTER (WHERE m.metric = 'loss_ratio') AS loss "
            "FROM probe_results r LEFT JOIN probe_metrics m ON m.node_id = r.node_id AND m.probe = r.probe "
            "AND m.started_at = r.started_at "
            "WHERE r.probe = 'path_probe' AND json_extract_string(r.params, '$.role') = 'summary' "
            f"AND r.started_at > {_ts(since)} GROUP BY ALL ORDER BY t")

    def wait_summaries(self, since: float, n: int, timeout: float = 60.0) -> list[dict]:
        """Until every node has ``n`` summaries with paths that started after ``since``; all of them."""
        end = time.monotonic() + timeout
        while True:
            self.alive()
            rows = self.summaries(since)
            per = {nid: sum(1 for r in rows if r["node_id"] == nid and (r["paths"] or 0) > 0) for nid in self.names}
            if min(per.values()) >= n:
                return rows
            assert time.monotonic() < end, f"not {n} summaries per node since {since:.1f} in {timeout} s: {per}"
            _after_next_epoch()

    def suspects(self, since: float) -> list[dict]:
        """The suspect paths (link_results rows of probe path_probe) that started after ``since``."""
        return self.sql("SELECT node_a, node_b, reported_by, train_gbits_per_s, rtt_p50_us, loss_ratio, "
                        "epoch(started_at) AS t, epoch(ended_at) AS t_end FROM link_results "
                        f"WHERE probe = 'path_probe' AND started_at > {_ts(since)} ORDER BY started_at")

    def wait_window_clean(self, touching: set[str] | None = None, timeout: float = 60.0) -> None:
        """Until the analysis window holds no suspect path (with an end in ``touching``, when given)."""
        def clean():
            sus = self.suspects(time.time() - WINDOW_S - 1)
            return not [s for s in sus if touching is None or {s["node_a"], s["node_b"]} & touching]
        wait_for(clean, timeout=timeout, interval=EPOCH_S, what=f"no suspect path of {touching or 'any node'} "
                                                                 "in the analysis window")

    def analyze_until(self, found, deadline: float, what: str):
        """An analysis pass once an epoch until ``found(flags)`` is truthy; (its value, the flags)."""
        while True:
            self.alive()
            flags = self.path_flags()
            got = found(flags)
            if got:
                return got, flags
            assert time.time() < deadline, f"{what}: not by the deadline; open path flags: {flags}"
            _after_next_epoch()

    def base_throttles(self) -> None:
        """Every node's link at BASE_RATE (tbf), no pair throttles."""
        for name in AGENTS:
            self.fleet.unthrottle(name)
            self.fleet.throttle_node(name, BASE_RATE, burst=BURST)

    def sweeps_over(self) -> bool:
        """Every net_pair round the collector started (often none: see collector_toml) is done, and stays so
        for a second."""
        def over():
            text = self.procs.col_log.read_text(errors="replace")
            return text.count("fabric round ") == 2 * text.count(" done: ")
        if not over():
            return False
        time.sleep(1.0)
        return over()


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    nf = netns_testbed_or_skip()
    fleet = nf.Fleet.up(len(AGENTS) + 1)
    try:
        tb = Bed(nf, fleet, tmp_path_factory.mktemp("paths"))
        tb.base_throttles()
        try:
            t0 = time.monotonic()
            tb.procs.start()
            host = {n.hostname: name for name, n in fleet.nodes.items()}

            def registered():
                rows = tb.sql("SELECT node_id, hostname FROM nodes") if tb.answers() else []
                return rows if len(rows) == len(AGENTS) else None
            rows = wait_for(registered, timeout=90, interval=2.0, what="the 4 agents registered")
            tb.ids = {host[r["hostname"]]: r["node_id"] for r in rows}
            tb.names = {v: k for k, v in tb.ids.items()}
            # No net_pair sweep in progress; then two epochs of 3 paths each, so every node's reference
            # (min_reference = 4 paths) is there, and a window without suspects.
            wait_for(tb.sweeps_over, timeout=90, interval=2.0, what="no net_pair sweep in progress")
            tb.wait_summaries(time.time(), 2, timeout=90)
            tb.wait_window_clean()
            MEASURED["setup_s"] = round(time.monotonic() - t0, 1)
            yield tb
        finally:
            tb.procs.stop()
    finally:
        fleet.down()
        if MEASURED:
            print("\npath-probe netns measurements:", json.dumps(MEASURED, indent=1, default=str))


def test_parse_burst_takes_bytes_or_k_and_refuses_too_small_buckets():
    nf = load_netns_fleet()
    assert nf.parse_burst(None, 20_000_000) == 64 * 1024
    assert nf.parse_burst(16384, 20_000_000) == nf.parse_burst("16k", 20_000_000) == 16384
    assert nf.parse_burst("2k", 10_000_000_000) == 2048
    for bad, why in (("lots", "is not a size"), ("-5", "is not a size"), (1000, "below 2048 bytes")):
        with pytest.raises(nf.FleetError, match=why):
            nf.parse_burst(bad, 20_000_000)


def test_healthy_testbed_stores_summaries_for_every_node_and_raises_no_path_flag(bed):
    bed.base_throttles()
    since = time.time()
    rows = bed.wait_summaries(since, 3)
    for nid in bed.names:
        mine = [r for r in rows if r["node_id"] == nid]
        assert all(r["status"] == "ok" for r in mine), mine
        # k = 3: every peer each epoch (a probe not done by the epoch's end is left out, so at least 2)
        assert all(2 <= r["paths"] <= 3 and r["train"] > 0 and r["rtt_us"] > 0 for r in mine), mine
    flags = bed.path_flags()
    assert flags == [], flags
    trains = sorted(r["train"] for r in rows)
    MEASURED["healthy"] = {
        "summaries": len(rows), "paths": sum(r["paths"] for r in rows), "suspects": len(bed.suspects(since)),
        "train_gbits_per_s_min_median_max": [round(trains[0], 3), round(trains[len(trains) // 2], 3),
                                             round(trains[-1], 3)],
        "rtt_p50_us_median": round(sorted(r["rtt_us"] for r in rows)[len(rows) // 2], 1)}


def test_one_node_throttled_mid_run_opens_node_paths_for_it_named_by_its_healthy_peers(bed):
    bed.base_throttles()
    slow, fine = bed.ids["n2"], {bed.ids[n] for n in AGENTS if n != "n2"}
    t_thr = time.time()
    bed.fleet.throttle_node("n2", SLOW_RATE, burst=BURST)
    shown = bed.fleet.exec("n2", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in shown and "rate 20Mbit" in shown and "burst 16Kb" in shown, shown
    # The epoch after the throttle's is the first whose every probe is shaped; its summaries and suspects land
    # within a second or two of its end.
    deadline = (_epoch(t_thr) + 1 + DETECT_EPOCHS) * EPOCH_S + LAND_S + 1
    try:
        mine, flags = bed.analyze_until(
            lambda fl: [f for f in fl if f["component"] == "node_paths" and f["node_id"] == slow], deadline,
            f"a node_paths flag for n2 within {DETECT_EPOCHS} epochs of its throttle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; summaries: {bed.summaries(t_thr)}; suspects: {bed.suspects(t_thr)}") from None
    t_found = time.time()
    (flag,) = mine
    first = {k: _ev(flag)[k] for k in ("slow", "late", "lossy")}
    # The flag can open on the throttle's own epoch, half shaped: n2's newest summary then reads late or
    # lossy (tbf queues and drops) before its median train is slow. That is right; the slow reading must
    # follow once a whole epoch is shaped.
    if not _ev(flag)["slow"]:
        mine, flags = bed.analyze_until(
            lambda fl: [f for f in fl if f["component"] == "node_paths" and f["node_id"] == slow
                        and _ev(f)["slow"]], deadline + 2 * EPOCH_S,
            "n2's node_paths flag reading slow once a whole epoch is shaped")
        (flag,) = mine
    ev = _ev(flag)
    assert ev["slow"] is True and ev["train_gbits_per_s"] < 0.5 * ev["pool_train_gbits_per_s"], json.dumps(ev)
    assert ev["named_by_healthy_peers"] >= 2 and ev["pool_nodes"] == 4, json.dumps(ev)
    assert flag["unit"] == "gbits_per_s" and flag["value"] < 0.5 * flag["baseline"], flag
    assert "drain node " + bed.fleet.node("n2").hostname in flag["sentence"], flag["sentence"]
    # n2 alone: no other node is the bad node, and no path between two unthrottled nodes is a link's fault.
    assert [f["node_id"] for f in flags if f["component"] == "node_paths"] == [slow], flags
    for f in flags:
        if f["component"] == "link_paths":
            assert not set(_ev(f)["pair"]) <= fine, f
    sus = bed.suspects(t_thr)
    MEASURED["node_throttle"] = {
        "epochs_to_detection": _epoch(t_found) - _epoch(t_thr), "seconds_to_detection": round(t_found - t_thr, 1),
        "first_reading": first,
        "evidence": {k: ev[k] for k in ("train_gbits_per_s", "pool_train_gbits_per_s", "rtt_p50_us",
                                        "pool_rtt_p50_us", "loss_ratio", "slow", "late", "lossy", "named_by",
                                        "named_by_healthy_peers")},
        "severity": flag.get("severity"),
        "suspect_trains_gbits_per_s": sorted(round(s["train_gbits_per_s"], 4) for s in sus if
                                             s["train_gbits_per_s"] is not None and slow in (s["node_a"], s["node_b"])),
        "suspects_between_unthrottled": sum(1 for s in sus if {s["node_a"], s["node_b"]} <= fine),
        "link_paths_flags": [_ev(f)["pair"] for f in flags if f["component"] == "link_paths"]}

    # Back at the base rate, n2's next summary is fine again and the flag closes; then its suspects leave the
    # window, so the next test's analysis no longer reads them.
    bed.fleet.throttle_node("n2", BASE_RATE, burst=BURST)
    t_back = time.time()
    bed.analyze_until(lambda fl: not any(f["component"] == "node_paths" for f in fl) or None,
                      t_back + 6 * EPOCH_S + 30, "n2's node_paths flag closed after its throttle went")
    MEASURED["node_throttle"]["seconds_to_close"] = round(time.time() - t_back, 1)
    bed.wait_window_clean({slow})


def test_one_pair_throttled_opens_link_paths_for_that_pair_only(bed):
    pair = sorted((bed.ids["n0"], bed.ids["n3"]))
    for name in AGENTS:
        bed.fleet.unthrottle(name)        # a node carries a node throttle or pair throttles, never both
    # Every pair at the base rate (htb) first, so the test changes one thing: the pair n0-n3's rate.
    for a, b in itertools.combinations(AGENTS, 2):
        bed.fleet.throttle_pair(a, b, BASE_RATE, burst=BURST)
    bed.wait_summaries(time.time(), 1)
    t_thr = time.time()
    bed.fleet.throttle_pair("n0", "n3", SLOW_RATE, burst=BURST)
    shown = bed.fleet.exec("n0", ["tc", "class", "show", "dev", "eth0"]).stdout
    assert "rate 20Mbit" in shown and "burst 16Kb" in shown, shown
    deadline = (_epoch(t_thr) + 1 + DETECT_EPOCHS) * EPOCH_S + LAND_S + 1

    def flagged(fl):
        return [f for f in fl if f["component"] == "link_paths" and _ev(f)["pair"] == pair]
    try:
        _, flags = bed.analyze_until(flagged, deadline, f"a link_paths flag for n0-n3 within {DETECT_EPOCHS} epochs")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; summaries: {bed.summaries(t_thr)}; suspects: {bed.suspects(t_thr)}") from None
    t_found = time.time()
    links = [f for f in flags if f["component"] == "link_paths"]
    assert [_ev(f)["pair"] for f in links] == [pair], links
    assert [f for f in flags if f["component"] == "node_paths"] == [], flags
    (flag,) = links
    ev = _ev(flag)
    assert flag["node_id"] == pair[0]
    assert ev["train_gbits_per_s"] < 0.5 * ev["pool_train_gbits_per_s"], ev
    assert set(ev["reporters"]) <= set(pair), ev
    hn = [bed.fleet.node(n).hostname for n in ("n0", "n3")]
    assert all(h in flag["sentence"] for h in hn) and "check the cable" in flag["sentence"], flag["sentence"]
    MEASURED["pair_throttle"] = {
        "epochs_to_detection": _epoch(t_found) - _epoch(t_thr), "seconds_to_detection": round(t_found - t_thr, 1),
        "evidence": {k: ev.get(k) for k in ("train_gbits_per_s", "pool_train_gbits_per_s", "reports", "reporters",
                                            "rtt_p50_us", "loss_ratio")},
        "other_suspects": sum(1 for s in bed.suspects(t_thr) if sorted((s["node_a"], s["node_b"])) != pair)}


def test_targeted_sweep_runs_net_pair_on_the_suspect_pair(bed):
    """The collector again, on ``sweep = "targeted"`` (same database; the agents reconnect): the throttled pair's
    next suspect reaches the servicer, which hands it to the coordinator, whose next round runs net_pair on it."""
    pair = sorted((bed.ids["n0"], bed.ids["n3"]))
    if bed.fleet._root_kind(["-n", bed.fleet.node("n0").ns], "eth0") != "htb":      # run alone
        for name in AGENTS:
            bed.fleet.unthrottle(name)
        for a, b in itertools.combinations(AGENTS, 2):
            bed.fleet.throttle_pair(a, b, SLOW_RATE if {a, b} == {"n0", "n3"} else BASE_RATE, burst=BURST)
    bed.procs.stop_collector()
    bed.procs.collector_toml = collector_toml("targeted")
    t_restart = time.time()
    bed.procs.start_collector()
    wait_for(bed.answers, timeout=60, interval=1.0, what="the restarted collector answering")
    sus = wait_for(lambda: [s for s in bed.suspects(t_restart) if sorted((s["node_a"], s["node_b"])) == pair],
                   timeout=90, interval=EPOCH_S, what="a suspect of n0-n3 stored after the restart")
    first = min(s["t_end"] for s in sus)

    def runs_after():
        return bed.sql("SELECT node_a, node_b, status, send_gbits_per_s, recv_gbits_per_s, epoch(started_at) AS t "
                       "FROM link_results WHERE probe = 'net_pair' AND reported_by <> 'collector' "
                       f"AND least(node_a, node_b) = '{pair[0]}' AND greatest(node_a, node_b) = '{pair[1]}' "
                       f"AND started_at > {_ts(first)} AND status = 'ok'")
    runs = wait_for(runs_after, timeout=60, interval=EPOCH_S, what="a net_pair run of n0-n3 after its suspect")
    # The run is the throttled pair's own (about 20 Mbit/s each way), both ends' rows in time.
    assert all(r["send_gbits_per_s"] < 0.05 and r["recv_gbits_per_s"] < 0.05 for r in runs), runs
    others = bed.sql("SELECT DISTINCT least(node_a, node_b) AS a, greatest(node_a, node_b) AS b FROM link_results "
                     f"WHERE probe = 'net_pair' AND started_at > {_ts(t_restart)}")
    MEASURED["targeted"] = {
        "first_suspect_after_restart_s": round(first - t_restart, 1),
        "net_pair_after_suspect_s": round(min(r["t"] for r in runs) - first, 1),
        "net_pair_gbits_per_s": [round(r["send_gbits_per_s"], 4) for r in runs],
        "net_pair_pairs_since_restart": [[bed.names[r["a"]], bed.names[r["b"]]] for r in others],
        "other_suspects_since_restart": sum(1 for s in bed.suspects(t_restart)
                                            if sorted((s["node_a"], s["node_b"])) != pair)}
