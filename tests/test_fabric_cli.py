"""`gpuagent-collector fabric` on SYNTHETIC link rows in a real, migrated DuckDB file and through a real
collector's Query RPC: the plan, the last round (with a skipped pair and its reason), the link matrix, and
the worst node and link coming out as injected."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random
import signal
import subprocess
import sys
import time

import duckdb
import pytest
from click.testing import CliRunner

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.cli import main
from gpuagent.collector.store import schema
from gpuagent.common import pair_planner as planner
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
NODES = [f"p-n{i}" for i in range(6)] + [f"q-n{i}" for i in range(4)]
SLOW_NODE, SLOW_LINK = "p-n2", ("p-n0", "p-n4")
LINK_COLS = ("pair_id, node_a, node_b, probe, params_key, send_gbits_per_s, recv_gbits_per_s, rtt_p50_us, "
             "rtt_p99_us, started_at, ended_at, status, reason, reported_by")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("fabric-cli") / "collector.duckdb"
    con = duckdb.connect(str(path))
    schema.migrate(con)
    rng = random.Random(3)
    for n in NODES:
        S.add_node(con, n, virtualized=False, pool=n[0], now=NOW)
    times = [NOW - dt.timedelta(minutes=10 * k + 5) for k in range(3)]
    for pool in ("p", "q"):
        for a, b in itertools.combinations([n for n in NODES if n[0] == pool], 2):
            slow = SLOW_NODE in (a, b) or (a, b) == SLOW_LINK
            base = 2.0 if slow else 9.0
            S.add_link_runs(con, a, b, [base * rng.uniform(0.95, 1.05) for _ in times], times)
    # The last round, as the coordinator records it: pair ids {tag}-r{round}-{n}, one pair skipped.
    t = NOW - dt.timedelta(minutes=1)
    con.execute(f"INSERT INTO link_results ({LINK_COLS}) VALUES ('abc-r7-1', 'p-n1', 'p-n3', 'net_pair', "
                "'synthetic=1', 9.1, 9.2, 40, 80, ?, ?, 'ok', NULL, 'p-n1')", [t, t + dt.timedelta(seconds=3)])
    con.execute(f"INSERT INTO link_results ({LINK_COLS}) VALUES ('abc-r7-2', 'q-n0', 'q-n1', 'net_pair', "
                "'synthetic=1', NULL, NULL, NULL, NULL, ?, ?, 'skipped', 'node q-n1 is busy: a job holds the GPUs', "
                "'collector')", [t, t + dt.timedelta(seconds=1)])
    con.execute(f"INSERT INTO link_results ({LINK_COLS}) VALUES ('abc-r6-9', 'p-n0', 'p-n5', 'net_pair', "
                "'synthetic=1', 9.0, 9.0, 40, 80, ?, ?, 'ok', NULL, 'p-n0')",
                [t - dt.timedelta(seconds=30), t - dt.timedelta(seconds=27)])
    A.Analyzer().run_pass(con, NOW)
    con.close()
    return path


def _json(args):
    res = CliRunner().invoke(main, ["fabric", *args, "--format", "json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_plan_last_round_matrix_and_worst(db):
    doc = _json(["--db", str(db)])
    plan = doc["plan"]
    assert plan["nodes"] == 10 and plan["scopes"] == {"p": 6, "q": 4}
    # pools are planned side by side: the larger pool's 5 rounds, every pair of each pool once
    assert len(plan["rounds"]) == 5 and plan["pairs"] == 15 + 6
    assert {frozenset(p) for rnd in plan["rounds"] for p in rnd} == {
        frozenset(p) for pool in "pq" for p in itertools.combinations([n for n in NODES if n[0] == pool], 2)}
    expected = planner.plan_pairs({n: {"pool": n[0]} for n in NODES})
    assert plan["rounds"] == [[list(p) for p in r] for r in expected.rounds]

    lr = doc["last_round"]
    assert lr["round"] == "abc-r7"
    got = {(r["node_a"], r["node_b"]): r for r in lr["pairs"]}
    assert set(got) == {("p-n1", "p-n3"), ("q-n0", "q-n1")}
    assert got[("q-n0", "q-n1")]["status"] == "skipped" and "busy" in got[("q-n0", "q-n1")]["reason"]

    assert len(doc["links"]) == 21
    assert doc["nodes"][0]["node_id"] == SLOW_NODE and doc["nodes"][0]["slow_links"] == 5
    slow = {(ln["a"], ln["b"]) for ln in doc["links"] if ln["slow"]}
    assert slow == {tuple(sorted((SLOW_NODE, n))) for n in NODES if n[0] == "p" and n != SLOW_NODE} | {SLOW_LINK}
    flags = {(f["component"], f["node_id"]) for f in doc["flags"]}
    assert flags == {("node", SLOW_NODE), ("link", SLOW_LINK[0])}


def test_text_output_shows_each_section(db):
    res = CliRunner().invoke(main, ["fabric", "--db", str(db), "--rounds", "2", "--top", "3"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert out.startswith("NOTE: includes SYNTHETIC nodes")
    assert "plan: 10 nodes" in out and "5 rounds, 21 pairs per full sweep" in out
    assert out.count("  round ") == 2 and "... 3 more rounds" in out
    assert "last round: round abc-r7, 2 pairs" in out and "node q-n1 is busy" in out
    assert "link matrix:" in out and "link table (the 3 worst of 21 links):" in out
    worst_nodes = out.split("worst nodes")[1].splitlines()[3]
    assert worst_nodes.split()[0] == SLOW_NODE
    assert "[warning] node p-n2:" in out or "[critical] node p-n2:" in out


def test_live_collector_gives_the_same_view(db, tmp_path):
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                             "--db", str(db), "--port-file", str(port_file), "--no-analyze", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        live = _json(["--target", f"127.0.0.1:{int(port_file.read_text())}"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    local = _json(["--db", str(db)])
    # the collector may re-register nothing; everything read is the same
    for key in ("plan", "last_round", "flags"):
        assert live[key] == local[key]
    assert [(ln["a"], ln["b"], round(ln["gbits"], 6)) for ln in live["links"]] == \
        [(ln["a"], ln["b"], round(ln["gbits"], 6)) for ln in local["links"]]


def test_bad_input_is_one_sentence(tmp_path):
    res = CliRunner().invoke(main, ["fabric", "--db", str(tmp_path / "none.duckdb")])
    assert res.exit_code != 0 and "does not exist" in res.output
    res = CliRunner().invoke(main, ["fabric", "--db", str(tmp_path / "none.duckdb"), "--window", "soon"])
    assert res.exit_code != 0 and res.output.count("\n") == 1
    empty = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(empty))
    schema.migrate(con)
    con.close()
    res = CliRunner().invoke(main, ["fabric", "--db", str(empty)])
    assert res.exit_code != 0 and "no nodes and no fabric results" in res.output


def test_matrix_labels_keep_what_tells_nodes_apart():
    from gpuagent.collector.views.fabric import grid_labels
    assert grid_labels(["gpu-017.cluster.local", "gpu-018.cluster.local"]) == (["017", "018"], "")
    assert grid_labels(["gpa1-n0", "gpa1-n1", "gpa1-n2"]) == (["n0", "n1", "n2"], "")
    assert grid_labels(["p-n1", "p-n2", "q-n1"]) == (["p-n1", "p-n2", "q-n1"], "")
    long = ["a-" + "x" * 20 + ".dc", "b-" + "y" * 20 + ".dc"]
    assert grid_labels(long) == (["#1", "#2"], f"#1 {long[0]}; #2 {long[1]}")
