"""Analyzer on real DuckDB files built by the collector's migrations, with synthetic rows (labelled so)."""

from __future__ import annotations

import datetime as dt
import json
import random

import pytest

from analysis_helpers import migrated_db, run  # noqa: F401 - the con fixture
from gpuagent.collector.analysis import analyzer as A
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)




def flags(con, kind=None, state="open"):
    sql = "SELECT * FROM flags WHERE state = ?" + (" AND kind = ?" if kind else "") + " ORDER BY node_id, gpu, component"
    cur = con.execute(sql, [state] + ([kind] if kind else []))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def times(n=10, every_min=5, now=NOW):
    return [now - dt.timedelta(minutes=every_min * i + 1) for i in range(n)]


def bare_metal_fleet(con, n=4, h2d=53.6, seed=0, **kw):
    rng = random.Random(seed)
    for i in range(n):
        node = f"synthetic-bm{i}"
        S.add_node(con, node, virtualized=False, **kw)
        S.add_probe_runs(con, node, "pcie", {"h2d_gbps": S.noisy(rng, h2d, 0.0005, 10)}, times(), gpu=0)


# ----------------------------------------------------------------------------------------- rollups

def test_incremental_rollup_equals_full_group_by_including_late_rows(con):
    rng = random.Random(3)
    an = A.Analyzer()

    def batch(minutes, node):
        S.add_samples(con, [(NOW - dt.timedelta(minutes=m, seconds=s), node, g, "gpu_util_percent", "", rng.random() * 100)
                            for m in minutes for s in range(0, 60, 7) for g in (None, 0, 1)])

    batch(range(10, 5, -1), "synthetic-a")
    A.run_in_transaction(con, an.rollup)
    batch([5, 4], "synthetic-a")            # the minute after the watermark, and a new one
    batch([6, 6, 9], "synthetic-a")         # late rows for minutes already rolled up
    batch([7], "synthetic-b")
    S.add_job_samples(con, [(NOW - dt.timedelta(minutes=m, seconds=s), "synthetic-a", "job-1", 0, 50.0 + s)
                            for m in (3, 2) for s in (0, 30)])
    read = A.run_in_transaction(con, an.rollup)
    assert read == (2 + 3 + 1) * 9 * 3 + 4  # only the rows appended since the last pass
    S.add_job_samples(con, [(NOW - dt.timedelta(minutes=3, seconds=10), "synthetic-a", "job-1", 0, 10.0)])
    assert A.run_in_transaction(con, an.rollup) == 1
    assert A.run_in_transaction(con, an.rollup) == 0

    full = con.execute("""SELECT date_trunc('minute', ts), node_id, gpu, metric, labels, count(value), sum(value),
                                 min(value), max(value), avg(value)
                          FROM samples GROUP BY ALL ORDER BY ALL""").fetchall()
    rolled = con.execute("""SELECT minute, node_id, gpu, metric, labels, n, sum, min, max, avg
                            FROM samples_1m ORDER BY ALL""").fetchall()
    assert len(rolled) == len(full) > 0
    for a, b in zip(full, rolled):
        assert a[:6] == b[:6] and a[7:9] == b[7:9]
        assert a[6] == pytest.approx(b[6]) and a[9] == pytest.approx(b[9])
    jf = con.execute("""SELECT date_trunc('minute', ts), node_id, gpu, job_id, count(*), avg(gpu_util_percent)
                        FROM job_samples GROUP BY ALL ORDER BY ALL""").fetchall()
    jr = con.execute("SELECT minute, node_id, gpu, job_id, n, gpu_util_avg FROM job_samples_1m ORDER BY ALL").fetchall()
    assert [r[:5] for r in jf] == [r[:5] for r in jr]
    assert [r[5] for r in jf] == pytest.approx([r[5] for r in jr])


def _synthetic_minutes(con, first_minute, minutes, per_minute, salt):
    """``per_minute`` SYNTHETIC rows in each of ``minutes`` minutes, 4 GPU series, whole-number values
    (so sums are exact in any order)."""
    con.execute("""INSERT INTO samples
                   SELECT ?::TIMESTAMP + to_minutes(r // ?) + to_microseconds((r % ?) * (60000000 // ?)),
                          'synthetic-a', (r % 4)::SMALLINT, 'gpu_util_percent', '', ((r * 7919 + ?) % 101)::DOUBLE
                   FROM range(?::BIGINT) t(r)""",
                [first_minute, per_minute, per_minute, per_minute, salt, minutes * per_minute])


def _rollup_rows(con, where="TRUE", params=()):
    return con.execute(f"SELECT minute, node_id, gpu, metric, labels, n, sum, avg, min, max FROM samples_1m "
                       f"WHERE {where} ORDER BY ALL", list(params)).fetchall()


def test_rollup_keeps_deleted_minutes_and_rebuilds_the_rest_after_rowids_renumber(con):
    # Retention deletes raw rows but keeps their 1-minute rollups (issue #13), so a shrinking source no
    # longer empties samples_1m: the minutes whose raw rows are gone stay as rolled up, and the minutes raw
    # still holds must come out exactly as a full GROUP BY, even when DuckDB renumbered rowids under the
    # watermark and the table has since grown past it again.
    an = A.Analyzer()
    m0 = NOW - dt.timedelta(minutes=5)
    _synthetic_minutes(con, m0, 5, 60_000, 1)                                    # minutes m0..m0+4
    assert A.run_in_transaction(con, an.rollup) == 300_000
    lo = con.execute("SELECT last_rowid FROM rollup_watermarks WHERE source = 'samples'").fetchone()[0]
    cut = m0 + dt.timedelta(minutes=2)
    kept = _rollup_rows(con, "minute < ?", [cut])
    assert len(kept) == 2 * 4 and sum(r[5] for r in kept) == 120_000

    con.execute("DELETE FROM samples WHERE ts < ?", [cut])                       # as retention does
    con.execute("CHECKPOINT")
    assert con.execute("SELECT min(rowid), max(rowid), count(*) FROM samples").fetchone() == (0, 179_999, 180_000)
    _synthetic_minutes(con, m0 + dt.timedelta(minutes=3), 1, 50_000, 2)          # late rows for a rolled-up minute
    _synthetic_minutes(con, NOW, 1, 100_000, 3)                                  # a new minute
    hi, count = con.execute("SELECT max(rowid), count(*) FROM samples").fetchone()
    # Past the old watermark again, by exactly as much as the count grew: only the row at the watermark
    # tells that rowids moved.
    assert hi > lo and hi - lo == count - 300_000

    assert A.run_in_transaction(con, an.rollup) == 330_000                      # every raw row still held
    assert _rollup_rows(con, "minute < ?", [cut]) == kept
    full = con.execute("""SELECT date_trunc('minute', ts), node_id, gpu, metric, labels, count(value), sum(value),
                                 avg(value), min(value), max(value)
                          FROM samples GROUP BY ALL ORDER BY ALL""").fetchall()
    assert _rollup_rows(con, "minute >= ?", [cut]) == full and len(full) == 4 * 4
    assert con.execute("SELECT sum(n) FROM samples_1m").fetchone()[0] == 300_000 + 50_000 + 100_000
    assert A.run_in_transaction(con, an.rollup) == 0


# ----------------------------------------------------------------------------------------- virtualization_overhead

@pytest.mark.parametrize("penalty,flagged", [(9.0, False), (11.0, True)])
def test_penalty_just_under_threshold_is_not_flagged_just_over_is(con, penalty, flagged):
    bare_metal_fleet(con)
    S.add_node(con, "synthetic-vm", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [53.6 * (1 - penalty / 100)] * 10}, times(), gpu=0)
    run(con)
    got = flags(con, "virtualization_overhead")
    if not flagged:
        assert got == []
        return
    (f,) = got
    assert (f["node_id"], f["gpu"], f["component"], f["severity"]) == ("synthetic-vm", 0, "h2d", "warning")
    assert f["baseline_source"] == "fleet_bare_metal"
    assert f["baseline"] == pytest.approx(53.6, rel=0.01)
    assert f["sentence"].startswith("GPU 0 H2D 47.7 GB/s is 11 % below the bare-metal median 53.6 GB/s for "
                                    "NVIDIA H100 80GB HBM3 PCIe Gen5 x16 ×8 (4 nodes)")
    ev = json.loads(f["evidence"])
    assert ev["overhead"] == pytest.approx(11.0, abs=0.5) and ev["baseline_nodes"] == 4
    assert ev["fingerprint"]["cpuid_hypervisor_vendor"] == "KVMKVMKVM"


def test_bare_metal_nodes_are_never_flagged_for_virtualization(con):
    bare_metal_fleet(con)
    S.add_node(con, "synthetic-bm-slow", virtualized=False)
    S.add_probe_runs(con, "synthetic-bm-slow", "pcie", {"h2d_gbps": [30.0] * 10}, times(), gpu=0)
    run(con)
    assert flags(con, "virtualization_overhead") == []


def test_baseline_fallbacks_reference_then_declared_then_none(con):
    # Too few bare-metal nodes (2 < 3) of the class: the reference table (PCIe 5.0 theoretical) is used,
    # with the wider theoretical threshold: 50 GB/s is 21 % under 63.02 -> not flagged, 30 GB/s is.
    bare_metal_fleet(con, n=2)
    S.add_node(con, "synthetic-vm-ok", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm-ok", "pcie", {"h2d_gbps": [50.0] * 10}, times(), gpu=0)
    S.add_node(con, "synthetic-vm-slow", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm-slow", "pcie", {"h2d_gbps": [30.0] * 10}, times(), gpu=0)
    # Storage has no reference row: declared for H100, nothing for the other model.
    S.add_probe_runs(con, "synthetic-vm-slow", "storage", {"seq_read_gbps": [2.0] * 10}, times())
    S.add_node(con, "synthetic-vm-other", virtualized=True, gpu_model="NVIDIA L4", pcie_gen=4, pcie_width=16)
    S.add_probe_runs(con, "synthetic-vm-other", "storage", {"seq_read_gbps": [2.0] * 10}, times())
    cfg = A.AnalyzerConfig.from_mapping({"baselines": {"declared": [
        {"component": "storage_seq_read", "value": 3.0, "gpu_model_like": "NVIDIA H100%", "note": "acceptance 2025"}]}})
    run(con, config=cfg)
    got = {(f["node_id"], f["component"]): f for f in flags(con, "virtualization_overhead")}
    assert set(got) == {("synthetic-vm-slow", "h2d"), ("synthetic-vm-slow", "storage_seq_read")}
    ref = got[("synthetic-vm-slow", "h2d")]
    assert ref["baseline_source"] == "reference_table" and ref["baseline"] == pytest.approx(63.02)
    assert "theoretical reference 63.0 GB/s" in ref["sentence"] and "PCIe 5.0 spec" in ref["sentence"]
    dec = got[("synthetic-vm-slow", "storage_seq_read")]
    assert dec["baseline_source"] == "user_declared" and dec["baseline"] == 3.0 and dec["severity"] == "critical"
    assert "33 % below the declared baseline 3.0 GB/s" in dec["sentence"]
    # No baseline at all: not a virtualization_overhead flag (it would have no figure) but a no_baseline one.
    (none,) = flags(con, "no_baseline")
    assert (none["node_id"], none["component"]) == ("synthetic-vm-other", "storage_seq_read")
    assert none["baseline_source"] == "none" and none["baseline"] is None and none["severity"] == "info"
    assert "has no baseline for NVIDIA L4 PCIe Gen4 x16 ×8" in none["sentence"]


def test_a_vm_without_a_baseline_gets_no_virtualization_flag_without_a_figure(con):
    # Issue 45, point 2: a KVM guest, one host probe run, no bare-metal node and no reference row for the host
    # timer or syscall costs. Before, this opened virtualization_overhead flags whose evidence had
    # "overhead": null, "margin": null. Now no flag of that kind opens; a no_baseline flag says why, with what
    # was measured.
    S.add_node(con, "synthetic-kvm-guest", virtualized=True, virt_type="kvm")
    S.add_probe_runs(con, "synthetic-kvm-guest", "host",
                     {"clock_gettime_ns": [31.0], "syscall_ns": [240.0], "cpu_steal_percent": [0.2]}, times(1))
    run(con)
    for f in flags(con, "virtualization_overhead"):     # none expected; any that opens must carry its figure
        ev = json.loads(f["evidence"])
        assert ev["overhead"] is not None and ev["margin"] is not None, f
    assert flags(con, "virtualization_overhead") == []
    got = {f["component"]: f for f in flags(con, "no_baseline")}
    assert {"host_timer", "host_syscall"} <= set(got)
    timer = got["host_timer"]
    ev = json.loads(timer["evidence"])
    assert timer["severity"] == "info" and timer["value"] == pytest.approx(31.0)
    assert ev["runs"] == 1 and ev["baseline_nodes"] == 0 and ev["for_kind"] == "virtualization_overhead"
    assert "has no baseline" in timer["sentence"] and "not judged" in timer["sentence"]


def test_too_few_runs_raise_nothing_and_a_baseline_closes_no_baseline(con):
    # H2D on an H100 PCIe Gen5 x16 has a reference row (PCIe 5.0, theoretical 63.02 GB/s, threshold 40 %):
    # 30 GB/s is 52 % below it, but two runs are too few to take a margin from (vo_min_runs = 3).
    S.add_node(con, "synthetic-vm-a", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm-a", "pcie", {"h2d_gbps": [30.0, 30.1]}, times(2), gpu=0)
    run(con)
    assert flags(con, "virtualization_overhead") == [] and flags(con, "no_baseline") == []
    S.add_probe_runs(con, "synthetic-vm-a", "pcie", {"h2d_gbps": [30.2]}, [NOW - dt.timedelta(minutes=20)], gpu=0)
    run(con)
    (f,) = flags(con, "virtualization_overhead")
    ev = json.loads(f["evidence"])
    assert ev["runs"] == 3 and ev["overhead"] == pytest.approx(52.2, abs=0.5) and ev["margin"] is not None
    assert "over 3 runs" in f["sentence"]

    # Storage has no reference row: no_baseline, until a declared value gives it one and the flag closes.
    S.add_probe_runs(con, "synthetic-vm-a", "storage", {"seq_read_gbps": [2.0] * 3}, times(3))
    run(con)
    assert [f["component"] for f in flags(con, "no_baseline")] == ["storage_seq_read"]
    cfg = A.AnalyzerConfig.from_mapping({"baselines": {"declared": [{"component": "storage_seq_read", "value": 2.1}]}})
    run(con, config=cfg)
    assert flags(con, "no_baseline") == []
    (closed,) = flags(con, "no_baseline", state="closed")
    assert closed["component"] == "storage_seq_read"
    assert [f["component"] for f in flags(con, "virtualization_overhead")] == ["h2d"]   # 5 % below 2.1: not flagged


def test_steal_is_compared_in_points(con):
    for i in range(3):
        S.add_node(con, f"synthetic-bm{i}", virtualized=False)
        S.add_probe_runs(con, f"synthetic-bm{i}", "host", {"cpu_steal_percent": [0.0] * 10}, times())
    for node, steal in (("synthetic-vm-a", 1.5), ("synthetic-vm-b", 6.0)):
        S.add_node(con, node, virtualized=True)
        S.add_probe_runs(con, node, "host", {"cpu_steal_percent": [steal] * 10}, times())
    run(con)
    (f,) = flags(con, "virtualization_overhead")
    assert f["node_id"] == "synthetic-vm-b" and f["component"] == "steal"
    assert "CPU steal 6.0 % is 6.0 points above the bare-metal median" in f["sentence"]


# ----------------------------------------------------------------------------------------- lifecycle

def test_flag_opens_updates_and_closes(con):
    bare_metal_fleet(con)
    S.add_node(con, "synthetic-vm", virtualized=True)
    slow = times(n=6, every_min=5)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [40.0] * 6}, slow, gpu=0)
    first = run(con)
    assert first.opened == 1
    (f1,) = flags(con, "virtualization_overhead")
    # Still slow a bit later, worse: the same row is updated.
    later = NOW + dt.timedelta(minutes=10)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [20.0] * 8}, times(n=8, every_min=1, now=later), gpu=0)
    second = run(con, now=later)
    assert second.updated == 1    # (the jump from 40 to 20 GB/s also opens a noisy_neighbor_variance flag)
    (f2,) = flags(con, "virtualization_overhead")
    assert f2["flag_id"] == f1["flag_id"] and f2["first_seen"] == NOW and f2["last_seen"] == later
    assert f2["value"] < f1["value"] and f2["severity"] == "critical"
    # The VM recovers; once the slow runs leave the window, the flag closes.
    recovered = NOW + dt.timedelta(hours=7)   # the slow runs have left the 6 h probe window
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [53.5] * 10}, times(now=recovered), gpu=0)
    for i in range(4):
        S.add_probe_runs(con, f"synthetic-bm{i}", "pcie", {"h2d_gbps": [53.6] * 10}, times(now=recovered), gpu=0)
    third = run(con, now=recovered)
    assert third.closed == 2    # the overhead flag and the noisy one
    assert flags(con, "virtualization_overhead") == []
    (closed,) = flags(con, "virtualization_overhead", state="closed")
    assert closed["flag_id"] == f1["flag_id"] and closed["closed_at"] == recovered


def test_flag_closes_when_nothing_was_seen_for_a_window(con):
    bare_metal_fleet(con)
    S.add_node(con, "synthetic-vm", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [40.0] * 10}, times(), gpu=0)
    run(con)
    assert len(flags(con)) == 1
    run(con, now=NOW + dt.timedelta(minutes=30))
    assert len(flags(con)) == 1                     # runs still in the window: still open
    run(con, now=NOW + dt.timedelta(hours=8))        # no runs at all any more (node gone)
    assert flags(con) == [] and len(flags(con, state="closed")) == 1


# ----------------------------------------------------------------------------------------- noisy_neighbor_variance

def test_noisy_node_flagged_against_fleet_quiet_nodes_not(con):
    rng = random.Random(7)
    for i in range(6):
        S.add_node(con, f"synthetic-n{i}", virtualized=True)
        S.add_probe_runs(con, f"synthetic-n{i}", "host", {"pipe_roundtrip_us": S.noisy(rng, 12.0, 0.03, 12)},
                         times(n=12, every_min=4))
    S.add_node(con, "synthetic-noisy", virtualized=True)
    values = [12.0] * 8 + [30.0, 45.0, 28.0, 40.0]
    S.add_probe_runs(con, "synthetic-noisy", "host", {"pipe_roundtrip_us": values}, times(n=12, every_min=4))
    S.add_samples(con, [(NOW - dt.timedelta(minutes=m), "synthetic-noisy", None, "psi_cpu_some_avg10_percent", "", 35.0)
                        for m in range(1, 20)])
    run(con)
    (f,) = flags(con, "noisy_neighbor_variance")
    assert (f["node_id"], f["component"], f["baseline_source"]) == ("synthetic-noisy", "host_pipe", "fleet_class_median")
    ev = json.loads(f["evidence"])
    assert ev["runs"] == 12 and ev["peers"] == 6 and ev["cv"] > 0.5 and ev["tail_ratio"] > 2
    assert ev["psi_cpu_some_avg10_percent"]["max"] == 35.0
    assert "pipe round-trip latency varies with CV" in f["sentence"] and "contends for CPU" in f["sentence"]


def test_noise_needs_k_times_the_fleet_median(con):
    # The whole class is equally jittery (CV ~0.3 > 0.25): nothing stands out, nothing is flagged.
    rng = random.Random(11)
    for i in range(5):
        S.add_node(con, f"synthetic-n{i}", virtualized=True)
        S.add_probe_runs(con, f"synthetic-n{i}", "host", {"pipe_roundtrip_us": S.noisy(rng, 12.0, 0.3, 12)},
                         times(n=12, every_min=4))
    run(con)
    assert flags(con, "noisy_neighbor_variance") == []


@pytest.mark.parametrize("psi,flagged", [(0.0, False), (40.0, True)])
def test_lone_node_needs_corroborating_pressure(con, psi, flagged):
    S.add_node(con, "synthetic-alone", virtualized=False, gpu_model=None, gpu_count=0)
    S.add_probe_runs(con, "synthetic-alone", "host", {"pipe_roundtrip_us": [10.0] * 6 + [25.0, 40.0, 22.0]},
                     times(n=9, every_min=2))
    S.add_samples(con, [(NOW - dt.timedelta(minutes=m), "synthetic-alone", None, "psi_cpu_some_avg10_percent", "", psi)
                        for m in range(1, 20)])
    run(con)
    got = flags(con, "noisy_neighbor_variance")
    assert bool(got) is flagged
    if flagged:
        assert got[0]["baseline_source"] == "none" and "too few peers to compare: 0" in got[0]["sentence"]


def test_step_time_spread_is_noisy_neighbor_evidence(con):
    rng = random.Random(5)
    rows = []
    for i in range(5):
        node = f"synthetic-n{i}"
        S.add_node(con, node, virtualized=False)
        cv = 0.4 if i == 0 else 0.02
        for k, v in enumerate(S.noisy(rng, 0.5, cv, 20)):
            rows.append((NOW - dt.timedelta(seconds=10 * k + 5), node, "job-big", i * 8, v, 0.0))
    S.add_job_steps(con, rows)
    run(con)
    (f,) = flags(con, "noisy_neighbor_variance")
    assert f["node_id"] == "synthetic-n0" and f["component"] == "step_time"
    assert json.loads(f["evidence"])["series"] == "job=job-big,rank=0"


# ----------------------------------------------------------------------------------------- utilization_gap

def test_utilization_gap_components_and_cost(con):
    S.add_node(con, "synthetic-g", virtualized=True, gpu_count=4, pool="cloud-a", price_per_gpu_hour=3.0)
    samples, jobs, steps = [], [], []
    for m in range(60):
        t = NOW - dt.timedelta(minutes=60 - m, seconds=-5)
        # GPU 0 busy job; GPU 1 held by job-idle but idle for 45 min; GPU 2 no job for 40 min;
        # GPU 3 input-bound job (data wait 0.5, util 45 %).
        util = {0: 92.0, 1: 2.0 if m < 45 else 80.0, 2: 0.0 if m < 40 else 90.0, 3: 45.0}
        for g, u in util.items():
            samples.append((t, "synthetic-g", g, "gpu_util_percent", "", u))
        jobs += [(t, "synthetic-g", "job-busy", 0, 92.0), (t, "synthetic-g", "job-idle", 1, util[1]),
                 (t, "synthetic-g", "job-input", 3, 45.0)]
        if m >= 40:
            jobs.append((t, "synthetic-g", "job-late", 2, 90.0))
        steps += [(t, "synthetic-g", "job-input", 3, 0.4, 0.5), (t, "synthetic-g", "job-busy", 0, 0.4, 0.02)]
    S.add_samples(con, samples)
    S.add_job_samples(con, jobs)
    S.add_job_steps(con, steps)
    run(con)
    got = {(f["gpu"], f["component"]): f for f in flags(con, "utilization_gap")}
    assert set(got) == {(1, "held_idle"), (2, "no_job"), (3, "input_bound")}
    idle, nojob, inp = got[(1, "held_idle")], got[(2, "no_job")], got[(3, "input_bound")]
    assert idle["value"] == pytest.approx(45 / 60) and idle["unit"] == "gpu_hours" and idle["severity"] == "critical"
    assert json.loads(idle["evidence"])["cost"] == pytest.approx(2.25)
    assert "GPU 1 was held by job-idle but under 10 % busy for 45 of 60 held minutes: 0.75 GPU-h lost (2.25 at 3.00/GPU-h in pool cloud-a)" in idle["sentence"]
    assert nojob["value"] == pytest.approx(40 / 60)
    assert inp["value"] == pytest.approx(0.5) and "50 % of step time waits for data" in inp["sentence"]


def test_utilization_gap_uses_gpm_sm_activity(con):
    """SYNTHETIC rows: GPU 0's utilization counter says 97 % but GPM says 4 % of its SMs were busy (held-idle
    in effect); GPU 1 is 97 % with 80 % SM activity (busy); GPU 2 has no GPM and 97 % utilization (busy by the
    counter); GPU 3 is a MIG GPU whose only SM activity is per GPU instance (labelled), which the whole-GPU
    judgement must not use."""
    S.add_node(con, "synthetic-gpm", virtualized=False, gpu_count=4, pool="cloud-a", price_per_gpu_hour=2.0)
    samples, jobs = [], []
    for m in range(30):
        t = NOW - dt.timedelta(minutes=30 - m, seconds=-5)
        for g in range(4):
            samples.append((t, "synthetic-gpm", g, "gpu_util_percent", "", 97.0))
            jobs.append((t, "synthetic-gpm", f"job-{g}", g, 97.0))
        samples += [(t, "synthetic-gpm", 0, "gpu_sm_active_percent", "", 4.0),
                    (t, "synthetic-gpm", 1, "gpu_sm_active_percent", "", 80.0),
                    (t, "synthetic-gpm", 3, "gpu_sm_active_percent", "gpu_instance=1", 3.0)]
    S.add_samples(con, samples)
    S.add_job_samples(con, jobs)
    run(con)
    got = {(f["gpu"], f["component"]): f for f in flags(con, "utilization_gap")}
    assert set(got) == {(0, "held_idle")}
    f = got[(0, "held_idle")]
    ev = json.loads(f["evidence"])
    assert ev["held_sm_active_percent"] == pytest.approx(4.0) and ev["held_gpu_util_percent"] == pytest.approx(97.0)
    assert ev["busy_but_idle_minutes"] == 30 and ev["activity_source"] == "gpm_sm_active"
    assert f["value"] == pytest.approx(30 / 60)
    assert ("under 10 % busy for 30 of 30 held minutes (SM activity 4 % by GPM, utilization counter 97 %; "
            "busy but idle inside for 30 min)") in f["sentence"]


def test_a_gpu_allocated_to_an_idle_pod_is_pod_idle_not_free(con):
    """SYNTHETIC rows: GPU 0 is allocated by the kubelet to pod research/notebook-1, which runs nothing on it
    (no job samples, 0 % util); GPU 1 is allocated to ml/train-0 and busy; GPU 2 has no pod and no job (free);
    GPU 3's only allocation is a MIG slice, which the whole-GPU utilization cannot judge."""
    S.add_node(con, "synthetic-k8s", virtualized=True, gpu_count=4, pool="cloud-a", price_per_gpu_hour=2.0)
    samples = []
    for m in range(30):
        t = NOW - dt.timedelta(minutes=30 - m, seconds=-5)
        samples += [(t, "synthetic-k8s", 0, "gpu_util_percent", "", 0.0),
                    (t, "synthetic-k8s", 1, "gpu_util_percent", "", 90.0),
                    (t, "synthetic-k8s", 2, "gpu_util_percent", "", 0.0),
                    (t, "synthetic-k8s", 3, "gpu_util_percent", "", 0.0),
                    (t, "synthetic-k8s", 0, "gpu_pod_allocated", "container=jupyter,namespace=research,pod=notebook-1",
                     1.0),
                    (t, "synthetic-k8s", 1, "gpu_pod_allocated", "container=trainer,namespace=ml,pod=train-0", 1.0),
                    (t, "synthetic-k8s", 3, "gpu_pod_allocated",
                     "container=c,gpu_instance=1,namespace=ml,pod=slice-0", 1.0)]
    S.add_samples(con, samples)
    run(con)
    got = {(f["gpu"], f["component"]): f for f in flags(con, "utilization_gap")}
    assert set(got) == {(0, "pod_idle"), (2, "no_job"), (3, "no_job")}, set(got)
    f = got[(0, "pod_idle")]
    ev = json.loads(f["evidence"])
    assert ev["pods"] == ["research/notebook-1"] and ev["pod_minutes"] == 30 and ev["pod_idle_minutes"] == 30
    assert ev["no_job_minutes"] == 0
    assert f["value"] == pytest.approx(30 / 60) and ev["cost"] == pytest.approx(1.0)
    assert "allocated to pod research/notebook-1 with no process on it" in f["sentence"]
    assert "delete or scale down the idle pod" in f["sentence"]


def test_input_bound_from_host_iowait_without_step_data(con):
    S.add_node(con, "synthetic-io", virtualized=False, gpu_count=1)
    rows, jobs = [], []
    for m in range(30):
        t = NOW - dt.timedelta(minutes=30 - m, seconds=-5)
        rows += [(t, "synthetic-io", 0, "gpu_util_percent", "", 35.0),
                 (t, "synthetic-io", None, "cpu_iowait_percent", "", 40.0),
                 (t, "synthetic-io", None, "cpu_iowait_percent", "cpu=0", 99.0)]
        jobs.append((t, "synthetic-io", "job-x", 0, 35.0))
    S.add_samples(con, rows)
    S.add_job_samples(con, jobs)
    run(con)
    (f,) = flags(con, "utilization_gap")
    assert f["component"] == "input_bound" and "CPU iowait 40 %" in f["sentence"]
    assert f["value"] == pytest.approx(30 / 60 * 0.65)
    assert "no price for pool" in f["sentence"]


# ----------------------------------------------------------------------------------------- config

@pytest.mark.parametrize("doc,message", [
    ({"analyzer": {"windw": "1h"}}, "unknown [analyzer] setting 'windw'"),
    ({"analyzer": {"window": "soon"}}, "cannot read duration 'soon'"),
    ({"analyzer": {"thresholds": {"virtualization_overhead.h3d": 5}}}, "unknown threshold"),
    ({"baselines": {"declared": [{"component": "nope", "value": 1}]}}, "unknown component 'nope'"),
    ({"pricing": {"cloud-a": "cheap"}}, "[pricing] cloud-a must be a price"),
    # A typo'd table or key used to be ignored silently (prices or baselines quietly missing).
    ({"pricng": {"cloud-a": 3.4}}, "unknown table or key 'pricng'"),
    ({"baselines": {"declard": []}}, "unknown key baselines.declard"),
    ({"baselines": {"declared": [{"component": "h2d", "value": 50, "gpu_model_lik": "NVIDIA%"}]}},
     "unknown key 'gpu_model_lik'"),
    ({"analyzer": {"thresholds": {"virtualization_overhead.h2d": "8%"}}}, "threshold virtualization_overhead.h2d must be a number"),
    ({"analyzer": {"thresholds": 8}}, "thresholds must be a table"),
    ({"analyzer": 3}, "[analyzer] in the collector config must be a table"),
])
def test_bad_config_is_one_clear_sentence(doc, message):
    with pytest.raises(A.AnalyzerError, match=None) as exc:
        A.AnalyzerConfig.from_mapping(doc)
    assert message in str(exc.value)


def test_thresholds_are_configurable(con):
    bare_metal_fleet(con)
    S.add_node(con, "synthetic-vm", virtualized=True)
    S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [53.6 * 0.93] * 10}, times(), gpu=0)
    cfg = A.AnalyzerConfig.from_mapping({"analyzer": {"window": "2h",
                                                      "thresholds": {"virtualization_overhead.h2d": 5}}})
    assert cfg.window_s == 7200
    run(con, config=cfg)
    assert [f["component"] for f in flags(con)] == ["h2d"]


def test_every_reference_row_cites_a_source():
    rows = A.load_reference()
    assert rows and all(r["source"] and r["basis"] in ("theoretical", "measured", "definition") for r in rows)
    comps = {c.component for c in A.COMPONENTS} | {"net_pair_gbits"}    # network_degraded's link rate
    assert all(r["component"] in comps for r in rows)


def test_analyze_db_refuses_a_missing_file(tmp_path):
    with pytest.raises(A.AnalyzerError, match="does not exist"):
        A.analyze_db(tmp_path / "nope.duckdb")


def test_steal_corroborates_and_is_blamed_when_it_dominates(con):
    S.add_node(con, "synthetic-vm-alone", virtualized=True, gpu_model=None, gpu_count=0)
    S.add_probe_runs(con, "synthetic-vm-alone", "host", {"syscall_ns": [300.0] * 6 + [900.0, 1200.0, 700.0]},
                     times(n=9, every_min=2))
    S.add_samples(con, [(NOW - dt.timedelta(minutes=m, seconds=s), "synthetic-vm-alone", None, "cpu_steal_percent",
                         "", 6.0 if m < 5 else 0.0) for m in range(1, 20) for s in (0, 20, 40)]
                  + [(NOW - dt.timedelta(minutes=m), "synthetic-vm-alone", None, "psi_cpu_some_avg10_percent", "", 4.0)
                     for m in range(1, 20)])
    run(con)
    (f,) = flags(con, "noisy_neighbor_variance")
    assert f["component"] == "host_syscall"
    assert "worst minute 6.0 %" in f["sentence"] and "the hypervisor is giving this VM's CPU time" in f["sentence"]
    assert json.loads(f["evidence"])["cpu_steal_percent"]["max_1m_avg"] == 6.0


@pytest.mark.parametrize("steal, flagged", [(1.3, False), (20.0, True)])
def test_passive_hypervisor_needs_steal_that_can_explain_the_lost_cpu_share(con, steal, flagged):
    """SYNTHETIC ticks of a job seen passively on a 2-CPU VM (progress = the CPU share of its processes, % of
    one core): 130 % except 4 s at 100 %, with steal rising to ``steal`` points in those 4 s. 1.3 points of
    steal on 2 CPUs take 2.6 % of one core, which cannot explain 30 points lost (a c16 run saw just this, in
    the job's own I/O phase); 20 points take 40 % of a core, which can."""
    S.add_node(con, "synthetic-steal", virtualized=True, gpu_count=0)
    con.execute("UPDATE nodes SET cpu_cores_logical = 2 WHERE node_id = 'synthetic-steal'")
    start = NOW - dt.timedelta(seconds=70)
    rows = []
    for i in range(120):                       # 0.5 s ticks for 60 s
        t = start + dt.timedelta(seconds=0.5 * i)
        contended = 80 <= i < 88                # 4 s, well after the job's 10 s start-up
        rows += [(t, "synthetic-steal", None, "job_progress_percent", "job_id=job-a,source=cpu_share",
                  100.0 if contended else 130.0),
                 (t, "synthetic-steal", None, "job_neighbour_cpu_percent", "job_id=job-a", 10.0),
                 (t, "synthetic-steal", None, "cpu_steal_percent", "", steal if contended else 0.0)]
    S.add_samples(con, rows)
    run(con, now=NOW)
    got = [(f["component"], f["evidence"]) for f in flags(con, "noisy_neighbor_variance")]
    if flagged:
        ((component, evidence),) = got
        ev = json.loads(evidence)
        assert component == "hypervisor" and ev["progress_source"] == "cpu_share"
        assert ev["progress_lost_fraction"] == pytest.approx(30 / 130, abs=0.01)
    else:
        assert got == []
