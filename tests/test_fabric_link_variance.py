"""noisy_neighbor_variance/link from link_results (SYNTHETIC rows in a real, migrated DuckDB): a link whose
runs swing is flagged against its pool's typical link CV, with the ends' TCP retransmits and NIC drops as
evidence; steady links, and a steadily slow one (network_degraded's), are not."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import random

import duckdb
import pytest

from analysis_helpers import migrated_db  # noqa: F401 - the con fixture
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
RUNS = 8



def mesh(con, swinging=("p-n1", "p-n5"), steady_slow=("p-n2", "p-n6"), lossy=True):
    rng = random.Random(5)
    nodes = [f"p-n{i}" for i in range(8)]
    for n in nodes:
        S.add_node(con, n, virtualized=False, pool="p")
    times = [NOW - dt.timedelta(minutes=5 * k + 1) for k in range(RUNS)]
    for a, b in itertools.combinations(nodes, 2):
        if (a, b) == swinging:
            rates = [9.4 if k % 2 else 3.0 for k in range(RUNS)]      # fine at times, a third at others
        elif (a, b) == steady_slow:
            rates = [2.0 * rng.uniform(0.98, 1.02) for _ in range(RUNS)]
        else:
            rates = [9.4 * rng.uniform(0.97, 1.03) for _ in range(RUNS)]
        S.add_link_runs(con, a, b, rates, times)
    rows = []
    for m in range(40):
        ts = NOW - dt.timedelta(minutes=m)
        for n in nodes:
            bad = lossy and n == swinging[1] and m % 10 == 0
            rows.append((ts, n, None, "net_tcp_retrans_percent", "", 2.5 if bad else 0.01))
            rows.append((ts, n, None, "net_rx_drops_per_s", "nic=eth0", 40.0 if bad else 0.0))
    S.add_samples(con, rows)
    return nodes


def run(con):
    A.Analyzer().run_pass(con, NOW)


def open_flags(con, kind):
    return con.execute("SELECT node_id, component, severity, value, baseline, evidence, sentence FROM flags "
                       "WHERE kind = ? AND state = 'open' ORDER BY node_id, component", [kind]).fetchall()


def test_a_swinging_link_is_flagged_with_its_loss_evidence(con):
    mesh(con)
    run(con)
    got = [f for f in open_flags(con, "noisy_neighbor_variance") if f[1] == "link"]
    assert [(f[0], f[1]) for f in got] == [("p-n1", "link")]
    node, _c, severity, cv, pool_cv, evidence, sentence = got[0]
    ev = json.loads(evidence)
    assert ev["pair"] == ["p-n1", "p-n5"] and ev["runs"] == RUNS
    assert cv == pytest.approx(ev["cv"], abs=1e-4) and cv > 0.4 and severity == "critical"
    assert pool_cv < 0.05 and ev["pool_links"] == 28
    assert ev["tcp_retrans_percent_max"] == [pytest.approx(0.01), pytest.approx(2.5)]
    assert ev["nic_drops_per_s_max"] == [0.0, 40.0]
    assert "p-n1 and p-n5 swings from 3.0 to 9.4 Gbit/s" in sentence and "loses packets" in sentence
    # the steadily slow link is network_degraded's, not a noisy one (the swinging link, slow in two of its
    # last three runs, may be both)
    nd = [(f[0], f[1], json.loads(f[5])["pair"]) for f in open_flags(con, "network_degraded")]
    assert ("p-n2", "link", ["p-n2", "p-n6"]) in nd


def test_without_loss_the_sentence_points_at_shared_paths(con):
    mesh(con, lossy=False)
    run(con)
    got = [f for f in open_flags(con, "noisy_neighbor_variance") if f[1] == "link"]
    assert len(got) == 1 and "without retransmits or drops" in got[0][6]


def test_steady_links_raise_nothing_and_a_recovered_link_closes(con):
    nodes = mesh(con, swinging=("none", "none"), steady_slow=("none", "none"))
    run(con)
    assert [f for f in open_flags(con, "noisy_neighbor_variance") if f[1] == "link"] == []
    con.execute("DELETE FROM link_results")
    mesh_times = [NOW - dt.timedelta(minutes=5 * k + 1) for k in range(RUNS)]
    for a, b in itertools.combinations(nodes, 2):
        S.add_link_runs(con, a, b, [9.4 if (a, b) != ("p-n0", "p-n3") or k % 2 else 2.5 for k in range(RUNS)],
                        mesh_times)
    run(con)
    assert [(f[0], f[1]) for f in open_flags(con, "noisy_neighbor_variance") if f[1] == "link"] == [("p-n0", "link")]
    con.execute("DELETE FROM link_results")
    for a, b in itertools.combinations(nodes, 2):
        S.add_link_runs(con, a, b, [9.4 * (1 + 0.01 * (k % 3)) for k in range(RUNS)], mesh_times)
    run(con)
    assert [f for f in open_flags(con, "noisy_neighbor_variance") if f[1] == "link"] == []
    closed = con.execute("SELECT count(*) FROM flags WHERE kind = 'noisy_neighbor_variance' AND component = 'link' "
                         "AND state = 'closed'").fetchone()[0]
    assert closed == 1
