"""`gpuagent-collector fabric`'s cheap-layer section (path probes) on a real, migrated DuckDB file whose path
rows went in as an agent sends them (pb.ProbeResult in a Batch, validated and committed by the real Writer,
which also keeps the suspects as link_results rows), and through a real collector's Query RPC: coverage
per pool, the suspect paths worst first, the open node_paths/link_paths flags, a database without path
rows, and one from before schema 20."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future

import duckdb
import pytest
from click.testing import CliRunner

from collector_helpers import node_info
from gpuagent.collector.cli import main
from gpuagent.collector.ingest.validate import prepare_batch
from gpuagent.collector.store import schema
from gpuagent.collector.store.nodes import register_node
from gpuagent.collector.store.writer import Writer
from gpuagent.collector.views.fabric_paths import NOT_REPORTED
from gpuagent.common import path_probe as pp
from gpuagent.proto import pb
from gpuagent.sim import synthetic_rows as S

NS = 1_000_000_000
END_NS = (time.time_ns() // NS - 30) * NS        # the newest summary's start: the end of the hour read
MIN = 60 * NS
POOLS = {"p": ["GPU-P1", "GPU-P2", "GPU-P3", "GPU-P4"], "q": ["GPU-Q1", "GPU-Q2", "GPU-Q3"]}

# Summaries in the hour: (hostname, minutes before END, paths, suspect, sent, lost, rtt p50 us, train Gbit/s).
SUMMARIES = [
    ("GPU-P1", 0, 3, 1, 105, 0, 40.0, 2.0),
    ("GPU-P1", 1, 3, 0, 105, 1, 44.0, 2.4),
    ("GPU-P2", 2, 2, 1, 70, 0, 50.0, 2.2),
    ("GPU-P2", 3, 2, 0, 70, 6, 60.0, 0.2),
    ("GPU-P3", 4, 2, 0, 70, 0, 42.0, 2.6),
    ("GPU-P4", 5, 1, 1, 35, 0, 1000.0, 2.5),
    ("GPU-Q1", 6, 1, 1, 35, 0, 40.0, 2.5),
    ("GPU-Q2", 7, 1, 0, 35, 1, 900.0, 2.4),
]
OLD = ("GPU-P1", 120, 50, 9, 1750, 900, 9999.0, 0.01)          # two hours before: outside the hour
# Suspects: (prober, peer, minutes before END, train, rtt p50, rtt p99, loss).
SUSPECTS = [
    ("GPU-P1", "GPU-P4", 10, 0.2, 45.0, 90.0, 0.0),
    ("GPU-P4", "GPU-P1", 5, 0.3, 50.0, 95.0, 0.0),             # the same pair from its other end, newer
    ("GPU-P2", "GPU-P3", 20, 2.2, 48.0, 70.0, 0.05),
    ("GPU-Q1", "GPU-Q2", 3, 2.5, 900.0, 1500.0, 0.0),
    ("GPU-P2", "GPU-P4", 125, 0.01, 40.0, 50.0, 0.5),           # outside the hour
]


def _id(host: str) -> str:
    return host.lower()


def _summary(b: pb.Batch, row, epoch: int) -> None:
    host, ago, paths, suspect, sent, lost, rtt, train = row
    t = END_NS - ago * MIN
    b.probe_results.add(probe=pp.PROBE, status="ok", params={**pp.result_params(_id(host), epoch),
                                                             "link_params": "pings=3"},
                        metrics={"paths": paths, "paths_suspect": suspect, "probes": paths + 3 * suspect,
                                 "datagrams_sent": sent, "datagrams_lost": lost, "loss_ratio": lost / sent,
                                 "bytes_sent": sent * 1000.0, "rtt_p50_us": rtt, "rtt_p99_us": 2 * rtt,
                                 "train_gbits_per_s": train},
                        started_ns=t, ended_ns=t + MIN, gpu=-1, env={"scheduler": "fabric"})


def _suspect(b: pb.Batch, row, epoch: int) -> None:
    a, peer, ago, train, rtt, p99, loss = row
    t = END_NS - ago * MIN
    b.probe_results.add(probe=pp.PROBE, status="ok",
                        params={**pp.result_params(_id(a), epoch, _id(peer)), "link_params": "pings=3"},
                        metrics={"loss_ratio": loss, "probes": 4.0, "rtt_p50_us": rtt, "rtt_p99_us": p99,
                                 "train_gbits_per_s": train},
                        started_ns=t, ended_ns=t + NS, gpu=-1, env={"scheduler": "fabric", "suspect": "slow"})


def _flag(con, node, component, state, sentence):
    t = dt.datetime.fromtimestamp(END_NS / NS, dt.timezone.utc).replace(tzinfo=None)
    con.execute("INSERT INTO flags (node_id, kind, component, severity, state, first_seen, last_seen, evidence, "
                "sentence) VALUES (?, 'network_degraded', ?, 'critical', ?, ?, ?, ?, ?)",
                [node, component, state, t, t, json.dumps({"layer": "path_probe"}), sentence])


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("fabric-paths") / "collector.duckdb"
    con = duckdb.connect(str(path))
    schema.migrate(con)
    for pool, hosts in POOLS.items():
        for h in hosts:
            assert register_node(con, node_info(h, "m-" + h, labels={"pool": pool})) == _id(h)
    batches: dict[str, pb.Batch] = {}

    def batch(host):
        return batches.setdefault(host, pb.Batch(node_id=_id(host), seq=1, created_ns=END_NS))

    for row in SUMMARIES + [OLD]:
        _summary(batch(row[0]), row, 1000 - row[1])
    for row in SUSPECTS:
        _suspect(batch(row[0]), row, 1000 - row[2])
    # GPU-Q3 took part but probed nothing in its one epoch: a skipped summary without metrics
    batch("GPU-Q3").probe_results.add(probe=pp.PROBE, status="skipped", reason="the pinglist names no peer",
                                      params=pp.result_params("gpu-q3", 999), started_ns=END_NS - 8 * MIN,
                                      ended_ns=END_NS - 7 * MIN, gpu=-1)
    writer = Writer(con)
    try:
        for b in batches.values():
            done: Future = Future()
            writer.submit(prepare_batch(b, now_ns=END_NS + MIN), lambda ack, exc: done.set_result(exc))
            assert done.result(timeout=30) is None
        writer.call(lambda c: _flag(c, "gpu-p4", "node_paths", "open", "Node GPU-P4's 9 probed paths are slow.")
                    ).result(30)
        writer.call(lambda c: _flag(c, "gpu-p2", "link_paths", "open", "The path between GPU-P2 and GPU-P3 is bad.")
                    ).result(30)
        writer.call(lambda c: _flag(c, "gpu-q1", "node_paths", "closed", "CLOSED, NOT SHOWN")).result(30)
    finally:
        writer.stop(30)
    con.close()
    return path


def _run(args, fmt=None):
    res = CliRunner().invoke(main, ["fabric", *args] + (["--format", fmt] if fmt else []))
    assert res.exit_code == 0, res.output
    return json.loads(res.output) if fmt == "json" else res.output


def test_coverage_per_pool_against_hand_computed_numbers(db):
    paths = _run(["--db", str(db)], "json")["paths"]
    assert paths["reported"] is True and paths["window_s"] == 3600 and paths["newest"] == END_NS / NS
    pools = {p["pool"]: p for p in paths["pools"]}
    assert set(pools) == {"p", "q"}
    p, q = pools["p"], pools["q"]
    # pool p: 4 nodes, 6 summaries in the hour (the one two hours old is not), 3+3+2+2+2+1 path probes
    assert (p["nodes"], p["summaries"], p["skipped_summaries"]) == (4, 6, 0)
    assert p["path_probes"] == 13 and p["pairs"] == 6 and p["probes_per_pair_capped"] == 1.0
    assert p["paths_suspect"] == 3
    assert (p["datagrams_sent"], p["datagrams_lost"]) == (455, 7)
    assert p["loss_ratio"] == pytest.approx(7 / 455)
    assert p["rtt_p50_us_median"] == pytest.approx((44 + 50) / 2)      # of 40 42 44 50 60 1000
    assert p["train_gbits_per_s_median"] == pytest.approx((2.2 + 2.4) / 2)   # of 0.2 2.0 2.2 2.4 2.5 2.6
    # pool q: GPU-Q3's skipped summary makes it a reporting node: 3 nodes, 3 pairs, 2 probes
    assert (q["nodes"], q["summaries"], q["skipped_summaries"]) == (3, 2, 1)
    assert q["path_probes"] == 2 and q["pairs"] == 3
    assert q["probes_per_pair_capped"] == pytest.approx(2 / 3)
    assert (q["datagrams_sent"], q["datagrams_lost"]) == (70, 1)
    assert q["rtt_p50_us_median"] == pytest.approx(470) and q["train_gbits_per_s_median"] == pytest.approx(2.45)
    assert paths["notes"] == []


def test_suspects_newest_report_per_pair_worst_first(db):
    sus = _run(["--db", str(db)], "json")["paths"]["suspects"]
    assert [(s["a"], s["b"]) for s in sus] == [("gpu-p1", "gpu-p4"), ("gpu-p2", "gpu-p3"), ("gpu-q1", "gpu-q2")]
    first = sus[0]
    assert (first["hostname_a"], first["hostname_b"]) == ("GPU-P1", "GPU-P4")
    assert first["reports"] == 2 and first["reporters"] == ["gpu-p1", "gpu-p4"]
    # the newest report (GPU-P4's, 5 minutes before the end), against pool p's median train of 2.3
    assert (first["train_gbits_per_s"], first["rtt_p50_us"], first["rtt_p99_us"], first["loss_ratio"]) == \
        (0.3, 50.0, 95.0, 0.0)
    assert first["last_at"] == (END_NS - 5 * MIN) / NS
    assert first["share"] == pytest.approx(0.3 / 2.3) and first["pool_train_gbits_per_s"] == pytest.approx(2.3)
    assert sus[1]["loss_ratio"] == 0.05 and sus[1]["reports"] == 1
    assert sus[2]["share"] == pytest.approx(2.5 / 2.45) and sus[2]["rtt_p50_us"] == 900.0
    assert set(first) >= {"a", "b", "hostname_a", "hostname_b", "pool", "reports", "reporters",
                          "train_gbits_per_s", "pool_train_gbits_per_s", "share", "rtt_p50_us", "rtt_p99_us",
                          "loss_ratio", "last_at"}


def test_text_shows_coverage_suspects_and_the_path_flags(db):
    out = _run(["--db", str(db)])
    section = out.split("cheap layer (path probes)")[1].split("open network_degraded flags")[0]
    rows = {line.split()[0]: line.split() for line in section.splitlines() if line.startswith("  p ")
            or line.startswith("  q ")}
    # pool nodes summaries probes pairs probes/pair suspect datagrams lost loss% rtt train
    assert rows["p"] == ["p", "4", "6", "13", "6", "1.00", "3", "455", "7", "1.538", "47", "2.30"]
    assert rows["q"] == ["q", "3", "2", "+1", "skipped", "2", "3", "0.67", "1", "70", "1", "1.429", "470", "2.45"]
    assert "capped at 1" in section and "probes/pair (cap 1)" in section
    assert "suspect paths in the hour: 3 pairs, worst first:" in section
    sus = [line for line in section.splitlines() if " - GPU-" in line]
    assert sus[0].split()[:8] == ["GPU-P1", "-", "GPU-P4", "2", "0.30", "13", "50", "95"]
    assert [s.split()[0] for s in sus] == ["GPU-P1", "GPU-P2", "GPU-Q1"]
    flags = out.split("open network_degraded flags:")[1]
    assert flags.startswith(" 2\n")
    assert "[critical] link_paths gpu-p2: The path between GPU-P2 and GPU-P3 is bad." in flags
    assert "[critical] node_paths gpu-p4: Node GPU-P4's 9 probed paths are slow." in flags
    assert "CLOSED" not in out


def test_json_flags_carry_the_path_components(db):
    flags = {(f["component"], f["node_id"]) for f in _run(["--db", str(db)], "json")["flags"]}
    assert flags == {("node_paths", "gpu-p4"), ("link_paths", "gpu-p2")}


def test_text_lists_at_most_20_suspects_and_json_all(tmp_path, db):
    many = tmp_path / "many.duckdb"
    shutil.copy(db, many)
    con = duckdb.connect(str(many))
    t = dt.datetime.fromtimestamp((END_NS - 30 * MIN) / NS, dt.timezone.utc).replace(tzinfo=None)
    for i in range(25):
        con.execute("INSERT INTO link_results (pair_id, node_a, node_b, probe, started_at, ended_at, status, "
                    "reported_by, rtt_p50_us, loss_ratio, train_gbits_per_s) VALUES (?, ?, ?, 'path_probe', ?, ?, "
                    "'ok', ?, 40, 0, ?)", [f"x{i}", "gpu-p3", f"ghost-{i:02d}", t, t, "gpu-p3", 1.0 + i / 100])
    con.close()
    assert len(_run(["--db", str(many)], "json")["paths"]["suspects"]) == 28
    out = _run(["--db", str(many)])
    assert "suspect paths in the hour: 28 pairs, worst first, the 20 worst shown (--format json has all):" in out
    section = out.split("suspect paths in the hour")[1].split("open network_degraded")[0]
    assert sum(1 for line in section.splitlines() if " - " in line) == 20
    assert "GPU-P1 - GPU-P4" in section and "GPU-Q1 - GPU-Q2" not in section   # the least bad is cut


def test_no_path_rows_is_one_sentence(tmp_path):
    path = tmp_path / "net-only.duckdb"
    con = duckdb.connect(str(path))
    schema.migrate(con)
    now = dt.datetime(2026, 1, 1, 12)
    for n in ("a-n0", "a-n1"):
        S.add_node(con, n, virtualized=False, pool="a", now=now)
    S.add_link_runs(con, "a-n0", "a-n1", [9.0], [now - dt.timedelta(minutes=5)])
    con.close()
    doc = _run(["--db", str(path)], "json")
    assert doc["paths"] == {"reported": False, "sentence": NOT_REPORTED}
    out = _run(["--db", str(path)])
    lines = [line for line in out.splitlines() if "path probe" in line]
    assert lines == [NOT_REPORTED]
    assert "fabric is disabled" in NOT_REPORTED and "older than this collector" in NOT_REPORTED


def test_a_database_from_before_schema_20_still_shows_the_layer(tmp_path):
    path = tmp_path / "v19.duckdb"
    con = duckdb.connect(str(path))
    schema.migrate(con, target=19)
    assert "loss_ratio" not in {r[0] for r in con.execute("DESCRIBE link_results").fetchall()}
    for h in ("GPU-P1", "GPU-P2"):
        register_node(con, node_info(h, "m-" + h, labels={"pool": "p"}))
    t = dt.datetime(2026, 1, 1, 12)
    for node, paths, rtt in (("gpu-p1", 1, 40.0), ("gpu-p2", 1, 60.0)):
        key = f"epoch=5,node={node}"
        con.execute("INSERT INTO probe_results (node_id, probe, status, params, params_key, env, started_at, "
                    "ended_at) VALUES (?, 'path_probe', 'ok', ?, ?, '{}', ?, ?)",
                    [node, json.dumps(pp.result_params(node, 5)), key, t, t])
        for metric, value in (("paths", paths), ("datagrams_sent", 35), ("datagrams_lost", 0), ("rtt_p50_us", rtt)):
            con.execute("INSERT INTO probe_metrics VALUES (?, 'path_probe', NULL, ?, ?, ?, ?)",
                        [node, key, t, metric, value])
    con.execute("INSERT INTO link_results (pair_id, node_a, node_b, probe, started_at, ended_at, status, "
                "reported_by, rtt_p50_us, rtt_p99_us) VALUES ('x', 'gpu-p1', 'gpu-p2', 'path_probe', ?, ?, 'ok', "
                "'gpu-p1', 55, 99)", [t, t])
    con.close()
    paths = _run(["--db", str(path)], "json")["paths"]
    (pool,) = paths["pools"]
    assert (pool["nodes"], pool["path_probes"], pool["pairs"], pool["probes_per_pair_capped"]) == (2, 2, 1, 1.0)
    assert pool["rtt_p50_us_median"] == 50.0
    (s,) = paths["suspects"]
    assert (s["a"], s["b"], s["rtt_p50_us"], s["loss_ratio"], s["train_gbits_per_s"]) == \
        ("gpu-p1", "gpu-p2", 55.0, None, None)
    assert any("predates schema 20" in n for n in paths["notes"])
    out = _run(["--db", str(path)])
    assert "GPU-P1 - GPU-P2" in out and "predates schema 20" in out


def test_live_collector_gives_the_same_paths(db, tmp_path):
    live_db = tmp_path / "live.duckdb"
    shutil.copy(db, live_db)
    local = _run(["--db", str(live_db)], "json")
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                             "--db", str(live_db), "--port-file", str(port_file), "--no-analyze", "--log-level",
                             "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        live = _run(["--target", f"127.0.0.1:{int(port_file.read_text())}"], "json")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode == 0
    assert live["paths"]["reported"] is True and len(live["paths"]["suspects"]) == 3
    assert live["paths"] == local["paths"]
    assert {(f["component"], f["node_id"]) for f in live["flags"]} == {("node_paths", "gpu-p4"),
                                                                        ("link_paths", "gpu-p2")}
