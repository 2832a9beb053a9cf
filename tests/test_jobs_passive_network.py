"""A network neighbour while it is still there (issue 26), end to end and real: a 2-node DDP job (gloo, CPU,
examples/train_ddp.py, no tracker; each rank started with torch.distributed's env:// variables, as a launcher
sets them, without torchrun's two extra processes) with rank 0 in network namespace n0 and rank 1 in n1, n0's
link shaped by tbf to 100 Mbit/s (scripts/netns_fleet.py), so the job's gradient all-reduces fill it. The real
agent and the real collector run in n0 (the agent reads n0's TCP connections; the collector listens on n0's
loopback). After the job's quiet start a real iperf3 from n0 to n1 shares the link until the job is stopped; one
analysis pass runs while both still run.

What the agent saw in this set-up (2026-12-05, an exploring run; each run of the test prints its own timeline
and sentence): the job alone moved about 23 MB/s (both directions) and sent 12.7 MB/s while it had data to
send, RTT about 11 ms (its own queue in the tbf); with iperf3 (about 7 MB/s) it sent about 5 MB/s while busy
(2.5 times less), RTT about 16 ms (1.4 times), and its CPU share fell from about 35 % to about 15 %. So the
flag rests on the busy send rate here, not on RTT."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from fabric_helpers import netns_fleet  # noqa: F401 - the fixture
from tools import python_module_or_skip

python_module_or_skip("torch")

from agent_helpers import ROOT, kill_tree  # noqa: E402
from gpuagent.collector.analysis.components import COMPONENTS  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

pytestmark = pytest.mark.slow
PORT_COLLECTOR, PORT_MASTER, PORT_IPERF = 47101, 47102, 47103
CO_TENANT = next(c for c in COMPONENTS if c.component == "co_tenant")
QUIET_S = 18.0     # the job's ticks before the neighbour: 10 s of start-up left out, then >= 5 s to compare with
CONTENDED_TICKS = 8    # ticks that named iperf3 before the pass (>= min_runs 5, plus the first reads' lag)

COLLECTOR_TOML = """
[analyzer]
# the shaped link moves 12.5 MB/s: the default margin (10 MB/s over the usual level) is for real NICs
neighbour_net_mb_per_s = 3
# This test runs beside others (the suite's parallel part): their processes are the job's CPU and disk
# neighbours too, and one flag a node is kept, the worst. Margins no command can reach on 2 cores leave the
# network judgement alone here; CPU and disk neighbours have their own tests, alone on the machine.
neighbour_cpu_percent = 1000
neighbour_io_mb_per_s = 100000
"""

AGENT_TOML = """
[probes]
enabled = false
[jobs]
scan_interval_s = 1
end_grace_s = 2
net_interval_s = 1
"""


def _sql(fleet, query: str) -> list[list]:
    r = fleet.exec("n0", [sys.executable, "-m", "gpuagent.collector.cli", "sql", "--target",
                          f"127.0.0.1:{PORT_COLLECTOR}", "--format", "json", query], cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    return [list(row.values()) if isinstance(row, dict) else row for row in json.loads(r.stdout)]


def _decoded(evidence) -> dict:
    return evidence if isinstance(evidence, dict) else json.loads(evidence)


def _count(fleet, query: str) -> int:
    """The query's one number; 0 while the collector does not answer yet (it starts with the job)."""
    r = fleet.exec("n0", [sys.executable, "-m", "gpuagent.collector.cli", "sql", "--target",
                          f"127.0.0.1:{PORT_COLLECTOR}", "--format", "json", query], cwd=ROOT, timeout=60)
    if r.returncode != 0 and "no collector answers" in r.stderr:
        return 0
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    return int(next(iter(rows[0].values()))) if rows else 0


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="needs iperf3 (scripts/install-test-deps.sh)")
def test_a_network_neighbour_is_flagged_while_it_fills_the_jobs_link(netns_fleet, tmp_path):  # noqa: F811
    fleet = netns_fleet(2)
    fleet.throttle_node("n0", "100mbit")
    n0, n1 = fleet.node("n0").ip, fleet.node("n1").ip
    (tmp_path / "collector.toml").write_text(COLLECTOR_TOML)
    (tmp_path / "agent.toml").write_text(AGENT_TOML)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPUAGENT_") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                                          "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []

    def start(node: str, argv: list[str], log: str, **extra: str) -> subprocess.Popen:
        p = fleet.popen(node, argv, env=dict(env, **extra), cwd=ROOT, stdout=open(tmp_path / log, "wb"),
                        stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        start("n0", [sys.executable, "-m", "gpuagent.collector.cli", "serve", "--listen",
                     f"127.0.0.1:{PORT_COLLECTOR}", "--db", str(tmp_path / "c.duckdb"), "--no-analyze",
                     "--config", str(tmp_path / "collector.toml")], "collector.log")
        start("n0", [sys.executable, "-m", "gpuagent.agent.cli", "run", "--collector", f"127.0.0.1:{PORT_COLLECTOR}",
                     "--state-dir", str(tmp_path / "state"), "--interval", "1", "--batch-interval", "1"],
              "agent.log", GPUAGENT_CONFIG=str(tmp_path / "agent.toml"),
              GPUAGENT_JOBS_SOCKET=str(tmp_path / "jobs.sock"), MALLOC_ARENA_MAX="2")
        start("n1", ["iperf3", "-s", "-p", str(PORT_IPERF)], "iperf3-server.log")
        for node, rank in (("n0", 0), ("n1", 1)):
            # one job id for both ranks: the agent sees both nodes' processes (one PID namespace here), and
            # they are one job, as one job across two machines is
            start(node, [sys.executable, str(ROOT / "examples" / "train_ddp.py"), "--no-tracker",
                         "--duration-s", "300"], f"rank{rank}.log", GLOO_SOCKET_IFNAME="eth0",
                  MASTER_ADDR=n0, MASTER_PORT=str(PORT_MASTER), RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2",
                  GPUAGENT_JOB_ID="netjob")
        progress_span = ("SELECT coalesce(epoch(max(ts) - min(ts)), 0) FROM samples "
                         "WHERE metric = 'job_progress_percent'")
        wait_for(lambda: _count(fleet, progress_span) >= QUIET_S, timeout=120, interval=1.0,
                 what="the job's quiet ticks in the collector")
        # not a child of the agent: the agent's own children are never neighbours
        start("n0", ["iperf3", "-c", n1, "-p", str(PORT_IPERF), "-t", "120"], "iperf3-client.log")
        named = ("SELECT count(DISTINCT ts) FROM samples WHERE metric = 'job_neighbour_process_net_bytes_per_s' "
                 "AND labels LIKE '%comm=iperf3%'")
        wait_for(lambda: _count(fleet, named) >= CONTENDED_TICKS, timeout=90, interval=1.0,
                 what=f"{CONTENDED_TICKS} ticks that named iperf3")
        assert all(p.poll() is None for p in procs), "everything still runs at the pass"
        r = fleet.exec("n0", [sys.executable, "-m", "gpuagent.collector.cli", "analyze", "--target",
                              f"127.0.0.1:{PORT_COLLECTOR}", "--window", "10m"], cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        flags = _sql(fleet, "SELECT component, evidence, sentence FROM flags WHERE state = 'open' "
                            "AND kind = 'noisy_neighbor_variance'")
        # the job's own rank (and any connection whose owner was lost) is never among its network neighbours
        own_named = _count(fleet, "SELECT count(*) FROM samples WHERE metric = 'job_neighbour_process_net_bytes_per_s'"
                                  " AND labels LIKE '%job_id=netjob%' AND (labels LIKE '%comm=python%'"
                                  " OR labels LIKE '%comm=?,%')")
        timeline = _sql(fleet, """
            SELECT round(epoch(ts - min(ts) OVER ()), 1),
                   round(max(value) FILTER (WHERE metric = 'job_progress_percent'), 1),
                   round(max(value) FILTER (WHERE metric = 'job_tcp_srtt_ms'), 2),
                   round(max(value) FILTER (WHERE metric = 'job_tcp_busy_send_rate_bytes_per_s') / 1e6, 2),
                   round(sum(value) FILTER (WHERE metric = 'job_neighbour_process_net_bytes_per_s'
                                            AND labels LIKE '%comm=iperf3%') / 1e6, 2)
            FROM samples GROUP BY ts HAVING max(value) FILTER (WHERE metric = 'job_progress_percent') IS NOT NULL
            ORDER BY 1""")
        print("t_s progress% rtt_ms busy_send_MB/s iperf3_MB/s")
        for row in timeline:
            print(*row)
    finally:
        for p in procs:
            kill_tree(p)
    co_tenant = [f for f in flags if f[0] == "co_tenant"]
    assert len(co_tenant) == 1, flags
    _component, evidence, sentence = co_tenant[0]
    ev = _decoded(evidence)
    print(sentence)
    assert ev["resource"] == "net" and ev["cause"] == "iperf3 network", ev
    assert ev["episode"] == "ongoing" and ev["judged_against"] == "before"
    assert ev["neighbours"][0]["comm"] == "iperf3"
    # at least the co_tenant threshold: under the suite's load the job is partly CPU-bound, and the shared
    # 100 Mbit/s link took 0.18 of its progress in one CI run (2026-12-07), more on a quiet machine
    assert ev["progress_lost_fraction"] >= CO_TENANT.threshold, ev
    busy, rtt = ev["job_tcp_busy_send_rate_mb_per_s"], ev["job_tcp_srtt_ms"]
    assert busy["contended"] * 1.5 <= busy["before"] or rtt["contended"] >= 1.5 * rtt["before"], ev
    assert ev["network_slowed_by"], ev
    own = ev["job_tcp_mb_per_s"]
    assert own["contended"] < own["before"], "the job moved less while iperf3 shared its link"
    assert "iperf3 sends and receives" in sentence and "while they had data to send" in sentence
    assert own_named == 0, "the job's own rank was named among its network neighbours"
    assert not [n for n in ev["neighbours"] if n["comm"].startswith("python")], ev["neighbours"]
