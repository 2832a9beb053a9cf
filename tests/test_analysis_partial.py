"""A pass that fails loudly and partially (issue 27): one broken step is rolled back alone, the other kinds
still run, its flags stay as they were, and the failure is a row, an event, a flag and a finding. Real DuckDB
files with SYNTHETIC rows; the step is broken on purpose with DuckDB's error()."""

from __future__ import annotations

import datetime as dt
import json
import random

from analysis_helpers import migrated_db  # noqa: F401 - the con fixture
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.analysis import failures as F
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
BROKEN = "SELECT error('synthetic failure: this step was broken on purpose')"


def _fleet(con):
    """Bare-metal nodes and cloud nodes 20 % slower on PCIe: virtualization_overhead flags to keep."""
    rng = random.Random(5)
    times = [NOW - dt.timedelta(minutes=5 * i + 1) for i in range(10)]
    for i, (pool, virt, factor) in enumerate([("bm", False, 1.0)] * 3 + [("cloud", True, 0.8)] * 2):
        node = f"synthetic-{pool}{i}"
        S.add_node(con, node, virtualized=virt, pool=pool, gpu_count=1)
        S.add_probe_runs(con, node, "pcie", {"h2d_gbps": S.noisy(rng, 53.6 * factor, 0.0005, 10)}, times, gpu=0)


def _open(con, kind):
    return con.execute("SELECT node_id, component, sentence FROM flags WHERE state = 'open' AND kind = ? "
                       "ORDER BY node_id, component", [kind]).fetchall()


def test_a_broken_step_fails_alone_and_says_so(con):
    _fleet(con)
    an = A.Analyzer()
    an.sql["noisy_neighbor_variance"] = [BROKEN]
    result = an.run_pass(con, NOW)
    # The other kinds ran: the slow cloud nodes are flagged.
    assert [n for n, c, _ in _open(con, "virtualization_overhead")] == ["synthetic-cloud3", "synthetic-cloud4"]
    assert list(result.failed) == ["40_noisy_neighbor_variance.sql"]
    assert "broken on purpose" in result.failed["40_noisy_neighbor_variance.sql"]
    # ... and the failure is a row, an event, a flag and a finding, each naming the step and why.
    assert con.execute("SELECT step FROM analysis_failures").fetchall() == [("40_noisy_neighbor_variance.sql",)]
    (msg, attrs), = con.execute("SELECT message, attrs FROM events WHERE kind = 'analysis_step_failed'").fetchall()
    assert msg.startswith("analysis could not run step 40_noisy_neighbor_variance.sql: ") and "on purpose" in msg
    assert json.loads(attrs) == {"step": "40_noisy_neighbor_variance.sql"}
    ((node, comp, sentence),) = _open(con, F.INCOMPLETE_KIND)
    assert (node, comp) == (F.COLLECTOR_NODE, "40_noisy_neighbor_variance.sql")
    assert sentence.startswith("analysis could not run step 40_noisy_neighbor_variance.sql: ")
    (fsent,) = con.execute("SELECT sentence FROM findings WHERE state = 'open' AND kind = ?",
                           [F.INCOMPLETE_KIND]).fetchone()
    assert "40_noisy_neighbor_variance.sql" in fsent and "on purpose" in fsent
    assert con.execute("SELECT failed_steps FROM analysis_runs").fetchall() == [(1,)]

    # The next pass, with the step whole again, retries it: the incomplete flag and its finding close.
    an2 = A.Analyzer()
    assert an2.run_pass(con, NOW + dt.timedelta(minutes=1)).failed == {}
    assert _open(con, F.INCOMPLETE_KIND) == []
    assert con.execute("SELECT count(*) FROM findings WHERE state = 'open' AND kind = ?",
                       [F.INCOMPLETE_KIND]).fetchone() == (0,)


def test_flags_of_a_failed_kind_stay_open_instead_of_closing_as_stale(con):
    _fleet(con)
    A.Analyzer().run_pass(con, NOW)
    before = _open(con, "virtualization_overhead")
    assert len(before) == 2
    later = NOW + dt.timedelta(days=3)         # past both windows: nothing about them was seen since
    an = A.Analyzer()
    an.sql["virtualization_overhead"] = [BROKEN]
    assert list(an.run_pass(con, later).failed) == ["30_virtualization_overhead.sql"]
    assert _open(con, "virtualization_overhead") == before
    # Once the step runs again, the stale flags close as they would have.
    assert A.Analyzer().run_pass(con, later + dt.timedelta(minutes=1)).failed == {}
    assert _open(con, "virtualization_overhead") == []


def test_a_failed_step_leaves_nothing_half_written(con):
    """The step's statements before the failing one are rolled back with it: no conditions of its kind."""
    _fleet(con)
    an = A.Analyzer()
    an.sql["virtualization_overhead"] = an.sql["virtualization_overhead"] + [BROKEN]
    an.run_pass(con, NOW)
    assert _open(con, "virtualization_overhead") == []
    assert len(_open(con, F.INCOMPLETE_KIND)) == 1


def test_the_failure_is_a_metrics_series_from_zero(con, tmp_path):
    """/metrics of a real collector on the file: every step's failure counter from 0, the broken one at 1."""
    import urllib.request

    from gpuagent.collector.service import start_collector

    _fleet(con)
    an = A.Analyzer()
    an.sql["utilization_gap"] = [BROKEN]
    an.run_pass(con, NOW)
    con.close()
    handle = start_collector(tmp_path / "collector.duckdb", "127.0.0.1:0", analyze=False,
                             metrics_listen="127.0.0.1:0")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{handle.metrics.port}/metrics", timeout=30).read().decode()
    finally:
        handle.stop()
    lines = [x for x in body.splitlines() if x.startswith("gpuagent_collector_analysis_")]
    assert 'gpuagent_collector_analysis_step_failures_total{step="50_utilization_gap.sql"} 1.0' in lines
    assert 'gpuagent_collector_analysis_step_failures_total{step="30_virtualization_overhead.sql"} 0.0' in lines
    assert 'gpuagent_collector_analysis_step_failures_total{step="rollup"} 0.0' in lines
    assert "gpuagent_collector_analysis_last_pass_failed_steps 1.0" in lines


def test_a_broken_flags_step_fails_the_pass_after_recording_which_step(con):
    _fleet(con)
    an = A.Analyzer()
    an.sql["findings"] = [BROKEN]
    try:
        an.run_pass(con, NOW)
        raise AssertionError("a pass whose findings step fails returned")
    except A.AnalyzerError as exc:
        assert str(exc).startswith("analysis pass could not update the flags: ") and "on purpose" in str(exc)
    ((step, error),) = con.execute("SELECT step, error FROM analysis_failures").fetchall()
    assert step == "95_findings.sql" and error.startswith("Invalid Input Error: synthetic failure")
    assert _open(con, "virtualization_overhead") == []      # the flags of that pass were rolled back with it


def test_a_failed_lake_baseline_load_closes_its_flag_once_it_loads(con):
    _fleet(con)

    def broken(c, now):
        raise RuntimeError("synthetic failure: the lake is unreachable")

    A.Analyzer(baselines_loader=broken).run_pass(con, NOW)
    ((node, comp, sentence),) = _open(con, F.INCOMPLETE_KIND)
    assert comp == "25_fleet_baselines.sql" and "lake is unreachable" in sentence
    A.Analyzer(baselines_loader=lambda c, now: 0).run_pass(con, NOW + dt.timedelta(minutes=1))
    assert _open(con, F.INCOMPLETE_KIND) == []


def test_a_step_that_reads_a_failed_steps_table_says_so_and_its_temp_tables_are_gone(con):
    """60_network_degraded.sql and 61_link_variance.sql read _nd_links and _nd_runs of 59_network_links.sql:
    with 59 broken they are not run and say why, instead of a catalog error; and the tables of the steps that
    ran are dropped when no later step reads them."""
    _fleet(con)
    an = A.Analyzer()
    an.sql["network_links"] = [BROKEN]
    seen: dict[str, set[str]] = {}
    run_step = an._run_step

    def watched(c, step, params):   # the temp tables there are when each step starts
        seen[step.name] = {r[0] for r in c.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()}
        return run_step(c, step, params)

    an._run_step = watched
    result = an.run_pass(con, NOW)
    assert set(result.failed) == {"59_network_links.sql", "60_network_degraded.sql", "61_link_variance.sql"}
    assert result.failed["60_network_degraded.sql"] == ("not run: it reads _nd_links of 59_network_links.sql, "
                                                        "which failed this pass")
    assert result.failed["61_link_variance.sql"] == ("not run: it reads _nd_runs of 59_network_links.sql, "
                                                     "which failed this pass")
    assert [n for n, c, _ in _open(con, "virtualization_overhead")] == ["synthetic-cloud3", "synthetic-cloud4"]
    # When the hardware step starts, the earlier kinds' intermediates are gone; the context tables are not.
    assert not seen["hardware_fault"] & {"_vo", "_vo_values", "_nn_points", "_ug", "_ug_wait"}, seen["hardware_fault"]
    assert {"_node_class", "_ok_metrics"} <= seen["hardware_fault"]
