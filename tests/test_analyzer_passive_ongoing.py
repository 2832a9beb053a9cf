"""Passive noisy neighbours while they are still there (issue 26): 41_noisy_neighbor_passive.sql on a real
DuckDB file with SYNTHETIC agent ticks (sim.synthetic_rows.passive_job_rows), passes at chosen times.

A job seen passively on a 2-CPU node, 1 s ticks (the agent's default), its progress the CPU share of its
processes (130 % of a core, 3 % noise)."""

from __future__ import annotations

import datetime as dt
import json
import random
import re

import pytest

from analysis_helpers import migrated_db, run  # noqa: F401 - the con fixture
from gpuagent.sim import synthetic_rows as S

START = dt.datetime(2026, 1, 1, 11, 0)
NODE = "synthetic-passive"


def _job(con, **kw) -> None:
    S.add_node(con, NODE, virtualized=False, gpu_count=0, now=START)
    con.execute("UPDATE nodes SET cpu_cores_logical = 2 WHERE node_id = ?", [NODE])
    rows, events = S.passive_job_rows(NODE, "job-a", start=START, rng=random.Random(7), **kw)
    S.add_samples(con, rows)
    S.add_events(con, events)


def _pass(con, at_s: float) -> list[dict]:
    """One pass at START + at_s; the open passive co_tenant flags, evidence decoded."""
    run(con, now=START + dt.timedelta(seconds=at_s))
    rows = con.execute("SELECT flag_id, evidence, sentence, baseline_source FROM flags WHERE state = 'open' "
                       "AND kind = 'noisy_neighbor_variance' AND component = 'co_tenant'").fetchall()
    return [{"flag_id": r[0], "evidence": json.loads(r[1]), "sentence": r[2], "baseline_source": r[3]} for r in rows]


def test_flag_opens_while_the_co_tenant_is_there_and_after_evidence_keeps_it(con):
    """Co-tenant from 60 s to 100 s of a 140 s job: no flag before it; open 10 s in, judged against the
    minute before it and updated as it goes on; still the same flag once the job has recovered after it."""
    _job(con, seconds=140, contention=(60, 100))
    assert _pass(con, 55) == []

    (f,) = _pass(con, 70.5)
    ev = f["evidence"]
    assert ev["episode"] == "ongoing" and ev["judged_against"] == "before"
    assert f["baseline_source"] == "job_progress_before_episode"
    assert ev["progress_lost_fraction"] == pytest.approx(0.4, abs=0.05)
    assert ev["neighbours"][0]["comm"] == "stress-ng-cpu"
    assert re.search(r"has lost \d+ % of its progress .* for the last \d+ s, and it goes on, while stress-ng-cpu uses",
                     f["sentence"]), f["sentence"]
    first = ev["contended_s"]

    (g,) = _pass(con, 90.5)
    assert g["flag_id"] == f["flag_id"], "the same flag, updated"
    assert g["evidence"]["episode"] == "ongoing" and g["evidence"]["contended_s"] >= first + 15
    assert g["evidence"]["progress_lost_s"] == pytest.approx(0.4 * g["evidence"]["contended_s"], rel=0.15)

    (h,) = _pass(con, 102.5)      # the co-tenant left 2 s ago: not enough ticks after it to judge by yet
    assert h["flag_id"] == f["flag_id"] and h["evidence"]["episode"] == "ended"
    assert h["evidence"]["judged_against"] == "before"

    (k,) = _pass(con, 139.5)      # the job recovered: the before-and-after judgement keeps the flag
    assert k["flag_id"] == f["flag_id"]
    assert k["evidence"]["episode"] == "ended" and k["evidence"]["judged_against"] == "before_and_after"
    assert k["baseline_source"] == "job_progress_around_episode"
    assert re.search(r" lost \d+ % .* % around it -> .* during \d+ s while stress-ng-cpu used", k["sentence"]), k["sentence"]


def test_no_recovery_after_the_co_tenant_left_closes_the_flag(con):
    """The job stays as slow after the co-tenant left (its own slowdown all along): the flag opened while the
    co-tenant was there closes once the window after it shows no recovery."""
    _job(con, seconds=140, contention=(60, 100), own_phase=(100, 140), own_drop=0.4)
    assert len(_pass(con, 75.5)) == 1
    assert _pass(con, 139.5) == []
    (state,) = con.execute("SELECT state FROM flags WHERE component = 'co_tenant'").fetchone()
    assert state == "closed"


@pytest.mark.parametrize("filler", [None, "backup"])
def test_the_jobs_own_slower_phase_is_not_a_neighbour(con, filler):
    """The job slows down by itself from 60 s on and is still slow at the pass. Without anybody else nothing
    rises; with a command that soaks up the CPU the job left idle (a nice'd backup), that command rises, but
    the job's threads never wait for CPU (no pressure): no flag either way."""
    _job(con, seconds=120, own_phase=(60, 120), own_drop=0.4, filler=filler)
    assert _pass(con, 90.5) == []


@pytest.mark.parametrize("psi_contended, flagged", [(60.0, True), (3.0, False)])
def test_a_gpu_job_is_judged_by_its_gpu_utilization_and_cpu_pressure(con, psi_contended, flagged):
    """GPU utilization as the job's progress: a CPU neighbour that starves its input pipeline makes its
    threads wait for CPU (pressure rises); a drop with no pressure is the job's own."""
    _job(con, seconds=120, progress=90.0, source="gpu_util", contention=(60, None), psi_contended=psi_contended)
    got = _pass(con, 80.5)
    if not flagged:
        assert got == []
        return
    (f,) = got
    assert f["evidence"]["progress_source"] == "gpu_util" and f["evidence"]["episode"] == "ongoing"
    assert "GPU utilization" in f["sentence"]


def test_an_ended_slower_phase_with_a_filler_is_not_a_neighbour_either(con):
    """The job's own slower phase from 60 to 90 s with a command soaking up the idle CPU, judged after it
    ended: progress was lower during than before and after, but the job's threads never waited."""
    _job(con, seconds=140, own_phase=(60, 90), own_drop=0.4, filler="backup")
    assert _pass(con, 139.5) == []


def test_a_job_that_ended_inside_the_episode_is_judged_without_its_wind_down(con):
    """The co-tenant came at 60 s and stayed until the job ended at 100 s: flagged as such, and the job's
    last seconds (its exit) are not counted as progress lost."""
    _job(con, seconds=100, contention=(60, None), ended=True)
    (f,) = _pass(con, 140)
    ev = f["evidence"]
    assert ev["episode"] == "until_job_end" and ev["judged_against"] == "before"
    assert ev["progress_lost_fraction"] == pytest.approx(0.4, abs=0.05), "the wind-down is left out"
    assert "in its last" in f["sentence"]


def test_the_next_job_starting_as_this_one_exits_is_not_blamed_for_its_wind_down(con):
    """A command starts 6 s before the job ends (the scheduler's next job, say) and hardly slows it (5 %);
    the job's last 2 s are its exit. Counted, the exit would look like 35 % lost to that command."""
    _job(con, seconds=100, contention=(94, None), lost=0.05, ended=True)
    assert _pass(con, 140) == []


def test_a_disk_neighbour_is_flagged_while_there_by_its_io_and_named(con):
    """A co-tenant that takes little CPU but reads and writes 300 MB/s from 60 s on, still there at the pass:
    the job's progress falls and its tasks wait on I/O (PSI io). Flagged as a disk neighbour, named by its
    share of the added disk I/O; the steady journal writer is not blamed."""
    _job(con, seconds=120, contention=(60, None), neighbour="fio", neighbour_io_mb_per_s=300.0)
    (f,) = _pass(con, 80.5)
    ev = f["evidence"]
    assert ev["resource"] == "io" and ev["neighbour_unit"] == "MB/s" and ev["cause"] == "fio disk I/O"
    assert ev["episode"] == "ongoing" and ev["progress_lost_fraction"] == pytest.approx(0.4, abs=0.05)
    assert [n["comm"] for n in ev["neighbours"]] == ["fio"]
    assert ev["neighbours"][0]["contended"] == pytest.approx(300, rel=0.1)
    assert re.search(r"has lost \d+ % .* and it goes on, while fio reads and writes \d+ MB/s on the disks "
                     r"\(before it \d+ MB/s; added disk I/O by command: fio 100 %\); limit the co-tenant's I/O",
                     f["sentence"]), f["sentence"]


def test_a_disk_neighbour_without_io_pressure_is_not_blamed(con):
    """The same disk co-tenant, but the job's tasks never wait on I/O (no PSI io rise): its drop is its own."""
    _job(con, seconds=120, contention=(60, None), neighbour="fio", neighbour_io_mb_per_s=300.0,
         psi_contended=3.0)
    assert _pass(con, 80.5) == []


def test_the_jobs_own_io_phase_is_not_a_neighbour(con):
    """The job's own I/O phase from 60 s on (a checkpoint, say): its progress falls and I/O pressure rises,
    but nobody outside it moves more bytes: no flag."""
    _job(con, seconds=120, own_io_phase=(60, 120), own_drop=0.4)
    assert _pass(con, 90.5) == []


def test_a_network_neighbour_is_flagged_while_there_by_its_bytes_and_the_jobs_rtt(con):
    """A co-tenant that sends and receives 80 MB/s off the node from 60 s on, still there at the pass: the
    job's progress falls and its own connections' RTT rises (its packets queue behind the neighbour's).
    Flagged as a network neighbour, named by its share of the added traffic; the steady scraper is not."""
    _job(con, seconds=120, contention=(60, None), neighbour="rsync", neighbour_net_mb_per_s=80.0)
    (f,) = _pass(con, 80.5)
    ev = f["evidence"]
    assert ev["resource"] == "net" and ev["neighbour_unit"] == "MB/s" and ev["cause"] == "rsync network"
    assert ev["episode"] == "ongoing" and ev["progress_lost_fraction"] == pytest.approx(0.4, abs=0.05)
    assert [n["comm"] for n in ev["neighbours"]] == ["rsync"]
    assert ev["neighbours"][0]["contended"] == pytest.approx(80, rel=0.1)
    assert ev["job_tcp_srtt_ms"]["contended"] >= 4 * ev["job_tcp_srtt_ms"]["before"]
    assert re.search(r"has lost \d+ % .* and it goes on, while rsync sends and receives \d+ MB/s off the node "
                     r"\(before it \d+ MB/s; added network traffic by command: rsync 100 %\); the job's connections "
                     r"off the node: RTT [\d.]+ -> [\d.]+ ms, sending [\d.]+ -> [\d.]+ MB/s while they had data to "
                     r"send; limit the co-tenant's bandwidth", f["sentence"]), f["sentence"]


def test_a_network_neighbour_on_a_link_the_job_fills_is_flagged_by_the_jobs_busy_send_rate(con):
    """The job fills its link by itself, so its packets queue already (RTT 10 ms) and the neighbour raises
    that by a third only; what shows is the share the job gets while it has data to send (divided by 2.5)."""
    _job(con, seconds=120, contention=(60, None), neighbour="iperf3", neighbour_net_mb_per_s=30.0,
         job_fills_link=True)
    (f,) = _pass(con, 80.5)
    ev = f["evidence"]
    assert ev["resource"] == "net" and ev["neighbours"][0]["comm"] == "iperf3"
    assert ev["neighbours"][0]["share_of_added"] >= 0.9
    assert ev["job_tcp_srtt_ms"]["contended"] < 1.5 * ev["job_tcp_srtt_ms"]["before"], "RTT alone would miss it"
    busy = ev["job_tcp_busy_send_rate_mb_per_s"]
    assert busy["contended"] == pytest.approx(busy["before"] / 2.5, rel=0.15)


def test_a_network_neighbour_is_flagged_while_the_jobs_own_traffic_holds_up(con):
    """The job's RTT rises 40-fold behind the neighbour while its own traffic holds up (a tenth more, within
    the guard's quarter): the neighbour is still the cause. The guard against the job's own heavier traffic
    must not hide it."""
    _job(con, seconds=120, contention=(60, None), neighbour="rsync", neighbour_net_mb_per_s=80.0,
         neighbour_job_mb_factor=1.1)
    (f,) = _pass(con, 80.5)
    ev = f["evidence"]
    assert ev["resource"] == "net" and ev["network_slowed_by"] == ["rtt"]
    assert ev["job_tcp_mb_per_s"]["contended"] == pytest.approx(1.1 * ev["job_tcp_mb_per_s"]["before"], rel=0.05)


@pytest.mark.parametrize("rtt_ms, rtt_contended_ms", [(0.2, 0.25), (None, 8.0)],
                         ids=["connections-not-slowed", "no-connections-off-the-node"])
def test_a_network_neighbour_is_not_blamed_without_the_jobs_connections_slowing(con, rtt_ms, rtt_contended_ms):
    """The same network co-tenant, but the job's own connections do not slow (their RTT stays, their send
    rate while busy dips by a fifth only: another link), or the job has no connections off the node at all:
    its drop is its own, not the network's."""
    _job(con, seconds=120, contention=(60, None), neighbour="rsync", neighbour_net_mb_per_s=80.0,
         rtt_ms=rtt_ms, rtt_contended_ms=rtt_contended_ms)
    assert _pass(con, 80.5) == []


@pytest.mark.parametrize("filler_net_mb_per_s", [None, 80.0], ids=["alone", "with-outside-traffic"])
def test_the_jobs_own_network_phase_is_not_a_neighbour(con, filler_net_mb_per_s):
    """The job downloads its next dataset shard from 60 s on: its progress falls, its own traffic triples and
    its RTT rises (its own packets queue). Nobody outside it moves more bytes, or a command does at the same
    time (on another link): its connections carry more than before, so the slowdown is its own. No flag."""
    _job(con, seconds=120, own_net_phase=(60, 120), own_drop=0.4, filler_net_mb_per_s=filler_net_mb_per_s)
    assert _pass(con, 90.5) == []


@pytest.mark.parametrize("key, value", [("neighbour_io_mb_per_s", 0), ("neighbour_io_mb_per_s", -5.0),
                                        ("neighbour_cpu_percent", float("nan")), ("neighbour_net_mb_per_s", 0)])
def test_a_neighbour_margin_that_is_not_positive_is_refused(key, value):
    from gpuagent.collector.analysis import analyzer as A
    with pytest.raises(A.AnalyzerError, match=f"^\\[analyzer\\] {key} must be a positive number, got "):
        A.AnalyzerConfig.from_mapping({"analyzer": {key: value}})


@pytest.mark.parametrize("value", [1, 0.5, float("inf")])
def test_a_network_slowdown_that_is_no_slowdown_is_refused(value):
    from gpuagent.collector.analysis import analyzer as A
    with pytest.raises(A.AnalyzerError,
                       match=r"^\[analyzer\] neighbour_net_slowdown must be a number greater than 1, got "):
        A.AnalyzerConfig.from_mapping({"analyzer": {"neighbour_net_slowdown": value}})
