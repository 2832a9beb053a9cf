"""collector/analysis/sql/62_path_tomography.sql on a real, migrated DuckDB (SYNTHETIC path-probe rows, as
the Writer stores an agent's: summaries in probe_metrics, suspects in link_results): a lossless suspect
needs a second report, the other end's, before it is a link's; and probes taken while either end ran a
bandwidth run are not the fabric's."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from analysis_helpers import migrated_db, run  # noqa: F401 - the con fixture
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
NODES = [f"p-n{i}" for i in range(8)]
EPOCH = dt.timedelta(minutes=1)


def summaries(con, node, epochs_ago=(1, 2, 3), train=2.5, rtt=40.0):
    """One summary per epoch (SYNTHETIC), its probe_results row and its metrics: 7 paths at ``train`` Gbit/s
    and ``rtt`` us."""
    results, metrics = [], []
    for k in epochs_ago:
        t = NOW - k * EPOCH
        results.append([node, "path_probe", None, "ok", '{"role":"summary"}', "synthetic=1", "{}", t, t + EPOCH,
                        60.0])
        for metric, value in (("paths", 7), ("paths_suspect", 0), ("probes", 7), ("datagrams_sent", 245),
                              ("datagrams_lost", 0), ("rtt_p50_us", rtt), ("train_gbits_per_s", train)):
            metrics.append([node, "path_probe", None, "synthetic=1", t, metric, value])
    S.insert_rows(con, "probe_results (node_id, probe, gpu, status, params, params_key, env, started_at, ended_at, "
                       "duration_s)", results)
    S.insert_rows(con, "probe_metrics (node_id, probe, gpu, params_key, started_at, metric, value)", metrics)


def suspect(con, prober, peer, at, train=0.25, loss=0.0):
    """One suspect report of prober -> peer (its probes took 6 s from ``at``)."""
    S.insert_rows(con, "link_results (pair_id, node_a, node_b, probe, params_key, rtt_p50_us, started_at, ended_at, "
                       "status, reported_by, loss_ratio, train_gbits_per_s)",
                  [[f"path-{prober}-{peer}-{at:%H%M%S}", prober, peer, "path_probe", "synthetic=1", 45.0, at,
                    at + dt.timedelta(seconds=6), "ok", prober, loss, train]])


def fleet(con):
    for n in NODES:
        S.add_node(con, n, virtualized=False, pool="p")
        summaries(con, n)


def link_flags(con):
    rows = con.execute("SELECT node_id, evidence FROM flags WHERE kind = 'network_degraded' AND "
                       "component = 'link_paths' AND state = 'open' ORDER BY node_id").fetchall()
    return [(n, json.loads(ev)) for n, ev in rows]


def path_flags(con):
    return con.execute("SELECT node_id, component FROM flags WHERE kind = 'network_degraded' AND state = 'open' "
                       "AND component IN ('node_paths', 'link_paths') ORDER BY ALL").fetchall()


def test_a_lossless_suspect_needs_the_other_ends_report(con):
    fleet(con)
    suspect(con, "p-n1", "p-n4", NOW - 3 * EPOCH + dt.timedelta(seconds=10))
    run(con)
    assert path_flags(con) == [], "one lossless report is not enough"
    suspect(con, "p-n4", "p-n1", NOW - 2 * EPOCH + dt.timedelta(seconds=10))     # the recheck from the other end
    run(con)
    ((node, ev),) = link_flags(con)
    assert node == "p-n1" and ev["pair"] == ["p-n1", "p-n4"] and ev["reports"] == 2
    assert ev["reporters"] == ["p-n1", "p-n4"]
    assert path_flags(con) == [("p-n1", "link_paths")]


def test_a_lossy_suspect_is_a_links_on_one_report(con):
    fleet(con)
    suspect(con, "p-n2", "p-n5", NOW - 2 * EPOCH, train=2.4, loss=0.05)
    run(con)
    ((node, ev),) = link_flags(con)
    assert node == "p-n2" and ev["reports"] == 1 and ev["loss_ratio"] == 0.05


def test_one_datagram_lost_beside_a_slow_reading_is_not_loss(con):
    """1 of 140 datagrams (0.7 %, under path_loss_floor) lost on a slow suspect: chance, not a lossy link, so
    the path still needs its second report."""
    fleet(con)
    suspect(con, "p-n2", "p-n5", NOW - 2 * EPOCH, train=0.4, loss=1 / 140)
    run(con)
    assert path_flags(con) == []


@pytest.mark.parametrize("end", ["reporter", "peer"])
def test_suspects_probed_during_a_bandwidth_run_through_either_end_are_left_out(con, end):
    """Two reports of p-n1 -> p-n4 (lossless); the first was probed while one end (the reporter p-n1, or the
    peer p-n4) ran net_pair with p-n6: it is left out, one report stays, and a third, outside any run, makes
    the flag."""
    fleet(con)
    t1, t2 = NOW - 4 * EPOCH + dt.timedelta(seconds=10), NOW - 3 * EPOCH + dt.timedelta(seconds=10)
    suspect(con, "p-n1", "p-n4", t1)
    suspect(con, "p-n4", "p-n1", t2)
    S.add_link_runs(con, {"reporter": "p-n1", "peer": "p-n4"}[end], "p-n6", [9.0], [t1 + dt.timedelta(seconds=2)])
    run(con)
    assert path_flags(con) == [], "the first report read a bandwidth run's traffic"
    suspect(con, "p-n1", "p-n4", NOW - 2 * EPOCH + dt.timedelta(seconds=10))
    run(con)
    ((node, ev),) = link_flags(con)
    assert node == "p-n1" and ev["reports"] == 2


@pytest.mark.parametrize("bandwidth_run", [True, False])
def test_a_summary_taken_during_a_bandwidth_run_gives_way_to_one_outside_it(con, bandwidth_run):
    """p-n1's newest summary is slow; its summary before is fine, and p-n1 and p-n4 named each other.
    With a net_pair run of p-n1's in that newest epoch, the rule reads the summary before: p-n1 is healthy
    and the pair's two reports make a link flag. Without the run, p-n1's own view is the slow one, so the
    path is not a link's alone (and no two healthy peers named p-n1, so it is no node flag either)."""
    for n in NODES:
        S.add_node(con, n, virtualized=False, pool="p")
        summaries(con, n, epochs_ago=(2, 3) if n == "p-n1" else (1, 2, 3))
    summaries(con, "p-n1", epochs_ago=(1,), train=0.3)
    suspect(con, "p-n1", "p-n4", NOW - 3 * EPOCH + dt.timedelta(seconds=10))
    suspect(con, "p-n4", "p-n1", NOW - 2 * EPOCH + dt.timedelta(seconds=10))
    if bandwidth_run:
        S.add_link_runs(con, "p-n1", "p-n6", [9.0], [NOW - EPOCH + dt.timedelta(seconds=20)])
    run(con)
    assert path_flags(con) == ([("p-n1", "link_paths")] if bandwidth_run else [])
