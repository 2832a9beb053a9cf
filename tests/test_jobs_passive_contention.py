"""Passive noisy-neighbour detection (issues 15 and 26), end to end and real: a 2-process DDP job (gloo,
CPU; examples/train_ddp.py under torchrun) WITHOUT the tracker, the real agent (subprocess) and the real
collector (gRPC on loopback, DuckDB in tmp_path), and a real stress-ng co-tenant in the same OS.

Each run trains for JOB_S seconds; the co-tenant (when there is one) starts once the agent has seen the job
for QUIET_S seconds (past the analyzer's start-up allowance, with quiet ticks to compare). One analysis pass
runs while the job (and the co-tenant) still run, one after the job where the test lets it finish.

With the kernel's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled, on here) every session
is one scheduling group, and torchrun starts each rank in a session of its own: on a machine already shared
by many sessions a co-tenant session takes only one group's share, however many workers it starts. So the
co-tenant's session gets the weight of about nine sessions (autogroup nice -10, needs root), as a
co-tenant with a large CPU weight (a cgroup with a high cpu.weight) would have; it runs STRESS_S seconds."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tools import needs, python_module_or_skip

python_module_or_skip("torch")

from gpuagent.collector.views import client  # noqa: E402
from gpuagent.collector import service as server  # noqa: E402
from agent_helpers import ROOT, kill_tree, start_agent, stop, wait_running  # noqa: E402
from tests.conftest import wait_for  # noqa: E402

pytestmark = pytest.mark.slow
# The analyzer (41_noisy_neighbor_passive.sql) leaves out a job's first job_warmup_s (10 s), and compares an
# episode with windows just before and after it, each as long as the episode and >= 10 s, >= 5 ticks. So:
# 22 s of ticks before the co-tenant (10 s left out, 12 s of reference), a 10 s co-tenant (a flag must show
# >= 5 s contended), and the rest of a 50 s job after it (~15 s: start-up takes the job's first ~5 s).
JOB_S = 50.0
STRESS_S = 10
QUIET_S = 22.0
# The pass while a co-tenant runs comes DURING_TICKS ticks (0.5 s each) after the agent first named it: the
# analyzer needs >= 5 contended ticks (min_runs), and CPU pressure (PSI avg10, a 10 s average) must have risen.
DURING_TICKS = 12


def _progress_ticks(address: str) -> int:
    return client.query(address, "SELECT count(*) FROM samples WHERE metric = 'job_progress_percent'").rows[0][0]


def _progress_span_s(address: str) -> float:
    """Seconds between the first and the last tick that sampled the job's progress."""
    return client.query(address, "SELECT coalesce(epoch(max(ts) - min(ts)), 0) FROM samples "
                                 "WHERE metric = 'job_progress_percent'").rows[0][0]


def _co_tenant_ticks(address: str) -> int:
    """Ticks at which the agent named a stress-ng process among the job's neighbours."""
    return client.query(address, "SELECT count(DISTINCT ts) FROM samples WHERE metric = "
                                 "'job_neighbour_process_cpu_percent' AND labels LIKE '%comm=stress-ng%'").rows[0][0]


def _timeline(address: str) -> str:
    """Per tick: the job's progress, the CPU of stress-ng neighbours and CPU pressure, one line each. Printed
    by every test (pytest shows it when one fails), so a failure says which condition the analyzer missed."""
    rows = client.query(address, """
        SELECT epoch(ts - min(ts) OVER ()) AS t,
               max(value) FILTER (WHERE metric = 'job_progress_percent') AS progress,
               sum(value) FILTER (WHERE metric = 'job_neighbour_process_cpu_percent'
                                  AND labels LIKE '%comm=stress-ng%') AS stress_cpu,
               max(value) FILTER (WHERE metric = 'psi_cpu_some_avg10_percent' AND labels = '') AS psi_cpu,
               max(value) FILTER (WHERE metric = 'cpu_steal_percent' AND labels = '') AS steal
        FROM samples GROUP BY ts HAVING progress IS NOT NULL ORDER BY ts""").rows
    fmt = lambda v: "-" if v is None else f"{v:.0f}"   # noqa: E731
    return "t_s progress% stress_cpu% psi_cpu% steal%\n" + "\n".join(
        f"{t:.1f} {fmt(p)} {fmt(c)} {fmt(q)} {fmt(st)}" for t, p, c, q, st in rows)


def _open_flags(address: str) -> list[dict]:
    client.analyze(address, window_s=600)
    rows = client.query(address, "SELECT flag_id, component, evidence, sentence FROM flags WHERE "
                        "kind = 'noisy_neighbor_variance' AND state = 'open'").rows
    return [{"flag_id": r[0], "component": r[1], "evidence": json.loads(r[2]), "sentence": r[3]} for r in rows]


@dataclass
class Run:
    during: list[dict]       # open passive noisy flags from a pass while the job ran (co-tenant there, if any)
    after: list[dict] | None  # ... from a pass after the job ended (None: the job was stopped after `during`)
    comms: list[str]         # command names of the stress-ng processes that ran
    steps: int               # steps the job took (every rank takes as many); 0 when it was stopped
    progress: tuple[tuple[float, float], ...] = ()   # (s since the job's first tick, progress %) per tick
    steal_max_percent: float = 0.0   # the most CPU steal the agent sampled while the job ran (this is a VM)


def _run_job(tmp: Path, *job_args: str, stress: list[str] | None = None, stress_s: float | None = STRESS_S,
             during_span_s: float = 0.0, finish: bool = True, job_s: float = JOB_S, nice: int = -10) -> Run:
    """Run one untracked job; with ``stress`` a stress-ng co-tenant (those arguments) starts after the job's
    first QUIET_S seconds of ticks and runs ``stress_s`` seconds (None: until the job is stopped). One pass
    runs while the job does: DURING_TICKS ticks after the co-tenant came, else once the job's ticks span
    ``during_span_s``. With ``finish`` the job trains its ``job_s`` and a second pass runs after it ended.
    ``nice``: the co-tenant session's autogroup nice; -10 gives it the weight of about nine sessions (see the
    module's docstring), 0 the weight of one."""
    col = server.start_collector(tmp / "collector.duckdb", "127.0.0.1:0", analyze=False)
    cfg = tmp / "agent.toml"
    cfg.write_text("[jobs]\nscan_interval_s = 0.5\nend_grace_s = 2\n")
    state = tmp / "state"
    agent = start_agent(tmp, col.address, state, interval=0.5, batch_interval=0.5, GPUAGENT_CONFIG=str(cfg))
    job = stressor = None
    comms: list[str] = []
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                            "GPUAGENT_JOB_ID", "MASTER_ADDR", "MASTER_PORT")}
        env["OMP_NUM_THREADS"] = "1"
        log = open(tmp / "job.log", "wb")
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", "2", str(ROOT / "examples" / "train_ddp.py"), "--no-tracker",
                                "--duration-s", str(job_s), *job_args],
                               env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        # The job starts with the agent (its torch start-up takes longer): the agent finds a running job at
        # its next scan, and the analyzer counts the job from its first tick.
        wait_running(state, agent)
        if stress:
            # Quiet ticks first: the analyzer skips the job's start-up, then needs ticks before the co-tenant.
            wait_for(lambda: _progress_span_s(col.address) >= QUIET_S, timeout=job_s, interval=0.5,
                     what="the job's first quiet ticks")
            timeout = [] if stress_s is None else ["--timeout", f"{stress_s}s"]
            stressor = subprocess.Popen(["stress-ng", *stress, *timeout], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
            if nice:
                _session_weight(stressor.pid, nice)
            wait_for(lambda: _co_tenant_ticks(col.address) >= DURING_TICKS, timeout=job_s, interval=0.5,
                     what=f"{DURING_TICKS} ticks that saw the co-tenant")
            for pid in _children(stressor.pid) + [stressor.pid]:
                try:
                    comms.append(Path(f"/proc/{pid}/comm").read_text().strip())
                except OSError:
                    pass
        else:
            wait_for(lambda: _progress_span_s(col.address) >= during_span_s, timeout=job_s, interval=0.5,
                     what=f"{during_span_s} s of the job's ticks")
        assert job.poll() is None, "the job was still running at the first pass: " + (tmp / "job.log").read_text()[-2000:]
        during = _open_flags(col.address)
        if not finish:
            print(_timeline(col.address))
            return Run(during, None, comms, 0)
        assert job.wait(timeout=job_s + 60) == 0, (tmp / "job.log").read_text()[-2000:]
        # The last batches reach the collector, with the agent's job_end event (after its end_grace_s): a pass
        # before that event cannot know the job ended and would still call an episode at the end "ongoing".
        wait_for(lambda: client.query(col.address, "SELECT count(*) FROM events WHERE kind = 'job_end'").rows[0][0],
                 timeout=20, interval=0.5, what="the agent's job_end event in the collector")
        after = _open_flags(col.address)
        print(_timeline(col.address))
        assert _progress_ticks(col.address) >= 20, "the agent sampled the job's progress"
        # Both ranks write to the one log, so their result lines can run together: decode each after its tag.
        text, dec = (tmp / "job.log").read_text(), json.JSONDecoder()
        results = [dec.raw_decode(text, m.end())[0] for m in re.finditer(r"GPUAGENT_TRAIN_RESULT ", text)]
        assert len(results) == 2, text[-2000:]
        ticks = client.query(col.address, "SELECT epoch(ts - min(ts) OVER ()), value FROM samples "
                                          "WHERE metric = 'job_progress_percent' ORDER BY ts").rows
        steal = client.query(col.address, "SELECT coalesce(max(value), 0) FROM samples "
                                          "WHERE metric = 'cpu_steal_percent'").rows[0][0]
        return Run(during, after, comms, min(r["steps"] for r in results), tuple(tuple(t) for t in ticks), steal)
    finally:
        for p in (job, stressor):
            if p is not None:
                kill_tree(p)
        stop(agent)
        col.stop()


def _session_weight(pid: int, nice: int) -> None:
    """Give pid's session (its autogroup) the CPU weight of that nice level (-10: about nine sessions)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except FileNotFoundError:
        pass   # no autogroup scheduling: the co-tenant's workers compete with the ranks one by one
    except PermissionError:
        pytest.skip("raising the co-tenant's CPU weight (autogroup nice -10) needs root or CAP_SYS_NICE")


def _children(pid: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                stat = Path(f"/proc/{n}/stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
                out.append(int(n))
    return out


def _nothing_blamed_on_a_neighbour(run: Run) -> None:
    """The job's own phases open no flag. The one cause a test on a VM cannot control is the hypervisor: this
    KVM guest's host once stole up to 37 % of the CPU during a slower phase (2026-12-02), and the analyzer
    then flagged that steal (`hypervisor`, a different cause from a co-tenant: the job's own phase is not told
    from steal that overlaps it, docs/FLAGS.md). Such a flag is allowed only where the agent really sampled
    that steal; a co_tenant flag, or any flag without that steal, fails the test."""
    flags = run.during + (run.after or [])
    for f in flags:
        ev = f["evidence"]
        assert f["component"] == "hypervisor" and ev["cause"] == "cpu steal", f
        # an episode is ticks with steal >= its usual level + 1 point (corroboration_steal_percent), all sampled
        assert 1.0 <= ev["cpu_steal_percent"]["max"] <= run.steal_max_percent + 1e-6, (f, run.steal_max_percent)
        print(f"flag {f['flag_id']}: the hypervisor really stole up to {run.steal_max_percent:.0f} % "
              f"(avg {ev['cause_level_contended']:.1f} % in the episode, {ev['cause_level_around']:.1f} % around)")


def _co_tenant_flag(flags: list[dict], comms: list[str], min_lost: float = 0.2) -> dict:
    """The one co_tenant flag, naming a stress-ng process that ran, with the job's CPU share as progress."""
    assert comms and all(c.startswith("stress-ng") for c in comms), comms
    (flag,) = [f for f in flags if f["component"] == "co_tenant"]
    named = {n["comm"] for n in flag["evidence"]["neighbours"]}
    assert named & set(comms), f"stress-ng named in {named}"
    assert flag["evidence"]["progress_source"] == "cpu_share"
    assert flag["evidence"]["progress_lost_fraction"] >= min_lost
    assert "stress-ng" in flag["sentence"] and "lost" in flag["sentence"]
    return flag


@needs("stress-ng")
def test_cpu_co_tenant_flags_while_there_and_is_confirmed_after_it_left(tmp_path):
    """A CPU-bound co-tenant for STRESS_S seconds in the job's middle: the pass while it runs opens the flag
    (judged against the ticks before it, "ongoing"); the pass after the job, with the job's recovery after
    the co-tenant left, keeps that same flag, now judged before and after (as before issue 26)."""
    run = _run_job(tmp_path, stress=["--cpu", "2"])
    print(json.dumps({"during": run.during, "after": run.after}, indent=1))
    now = _co_tenant_flag(run.during, run.comms)
    assert now["evidence"]["episode"] == "ongoing" and now["evidence"]["judged_against"] == "before"
    assert "and it goes on" in now["sentence"]
    then = _co_tenant_flag(run.after, run.comms)
    assert then["flag_id"] == now["flag_id"], "the same flag, updated"
    assert then["evidence"]["episode"] == "ended" and then["evidence"]["judged_against"] == "before_and_after"
    assert then["evidence"]["contended_s"] >= 5


# Co-tenants that stay until the job ends (issue 45, point 1), one per way of competing: CPU only (dense
# arithmetic out of cache), the caches (stress-ng --cache thrashes them) and memory bandwidth (--stream, STREAM's
# copy/scale/add/triad over arrays larger than the caches). Each job trains UNTIL_END_JOB_S: QUIET_S of
# reference ticks, then the co-tenant until the end (past the DURING_TICKS of the first pass).
# The CPU one is the weak case, the one the old 0.20 threshold missed (the job lost 17-19 % in a 150 s
# run, 2026-12-07). With no extra weight its two workers took 75-90 % of a core in all and the job lost
# 0.12-0.15 here, and under 0.10 in one CI run (no flag): too near the 0.10 threshold for a test. So its
# session gets autogroup nice -3 (the weight of about two sessions): 85-100 % of a core, and the job loses
# 0.23-0.25 (2026-12-07): still a weak co-tenant, near the old 0.20 threshold.
# (args, worker comm, the co-tenant session's autogroup nice, least lost fraction)
UNTIL_END_JOB_S = 38.0
CO_TENANTS_UNTIL_THE_END = {"cpu": (["--cpu", "2"], "stress-ng-cpu", -3, 0.1),
                            "cache": (["--cache", "2"], "stress-ng-cache", -10, 0.2),
                            "memory_bandwidth": (["--stream", "2"], "stress-ng-strea", -10, 0.2)}


@needs("stress-ng")
@pytest.mark.parametrize("competes_for", list(CO_TENANTS_UNTIL_THE_END))
def test_a_co_tenant_that_stays_until_the_job_ends_is_flagged_while_there_and_after(tmp_path, competes_for):
    """The pass while the co-tenant runs opens the flag ("ongoing", judged against the ticks before it); the
    pass after the job keeps that flag, now "until_job_end" (still only the window before it to compare with:
    there is no after). Both name the co-tenant's workers in the evidence."""
    args, worker_comm, nice, min_lost = CO_TENANTS_UNTIL_THE_END[competes_for]
    run = _run_job(tmp_path, stress=args, stress_s=None, job_s=UNTIL_END_JOB_S, nice=nice)
    print(json.dumps({"during": run.during, "after": run.after}, indent=1))
    now = _co_tenant_flag(run.during, run.comms, min_lost)
    assert now["evidence"]["episode"] == "ongoing" and now["evidence"]["judged_against"] == "before"
    then = _co_tenant_flag(run.after, run.comms, min_lost)
    assert then["flag_id"] == now["flag_id"], "the same flag, updated"
    assert then["evidence"]["episode"] == "until_job_end" and then["evidence"]["judged_against"] == "before"
    assert then["evidence"]["contended_s"] >= now["evidence"]["contended_s"]
    assert "in its last" in then["sentence"]
    for flag in (now, then):
        assert any(n["comm"] == worker_comm for n in flag["evidence"]["neighbours"]), flag["evidence"]["neighbours"]


def test_same_job_with_a_slower_phase_and_heavy_io_phases_of_its_own_opens_nothing(tmp_path):
    """No co-tenant. The job has both kinds of phase of its own: from 20 to 35 s into training every step also
    sleeps 20 ms (an evaluation, a slow epoch), so its CPU share falls with nobody to blame; and every 100
    steps its loader reads 128 MB (a shard), so its I/O rises and its progress dips. One pass in the slower
    phase, one after the job. (One run for both: each job here is 50 s of a machine that must be quiet.)"""
    data = tmp_path / "shard.bin"
    with open(data, "wb") as f:
        for _ in range(128):
            f.write(os.urandom(1 << 20))
    run = _run_job(tmp_path, "--slow-phase", "20:35", "--read-file", str(data), "--read-mb", "128",
                   "--read-every", "100", during_span_s=32)
    # The slower phase is real: past the start-up and before the wind-down, some 5 s of the job's ticks
    # average well under its median progress.
    judged = [v for t, v in run.progress if 10 <= t <= run.progress[-1][0] - 5]
    slowest = min(statistics.mean(judged[i:i + 10]) for i in range(len(judged) - 10))
    print(f"median progress {statistics.median(judged):.0f} %, slowest 5 s {slowest:.0f} %; "
          f"the job took {run.steps} steps, one I/O phase of 128 MB every 100")
    assert slowest <= 0.7 * statistics.median(judged)
    assert run.steps >= 300, f"{run.steps} steps: fewer than 3 I/O phases (one per 100 steps) in the job"
    _nothing_blamed_on_a_neighbour(run)
