"""Slurm attribution (agent/schedulers/slurm.py, issue 24): a Slurm job's processes are named as Slurm names them,
without reading their environment. The parsers get our own lines in scontrol's formats; the rest runs on a
real single-node Slurm cluster (tests/slurm_cluster.py: munged, slurmctld, slurmd) with real sbatch jobs,
the real agent and collector, and NVML answered by the emulator (SYNTHETIC GPUs)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from agent_helpers import free_port, start_agent, stop, wait_running
from conftest import wait_for
from gpuagent.agent.samplers.job_discovery import JobDiscovery
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.agent.schedulers.slurm import PENDING, SlurmAttribution, job_from_cgroup, parse_listpids, parse_show_job
from gpuagent.collector import cli as collector_cli
from gpuagent.collector import service as server
from gpuagent.collector.views import client
from slurm_cluster import SlurmCluster

# A job step that keeps nothing of Slurm's environment: attribution must come from Slurm, not from env.
NO_ENV_SLEEPER = (f"exec env -i PATH=/usr/bin:/bin {sys.executable} -c "
                  "\"import time; [time.sleep(0.2) for _ in range(600)]\"\n")


def test_listpids_lines_parse_and_the_header_is_skipped():
    text = ("PID      JOBID    STEPID   LOCALID GLOBALID\n"
            "4100     17       batch    0       0\n"
            "4101     17       batch    -       -\n"
            "4200     18       0        0       0\n"
            "garbage line\n")
    assert parse_listpids(text) == {4100: ("17", "batch"), 4101: ("17", "batch"), 4200: ("18", "0")}


def test_show_job_line_parses_user_partition_account_and_array():
    line = ("JobId=42 ArrayJobId=40 ArrayTaskId=2 JobName=pretrain UserId=alice(1000) GroupId=alice(1000) "
            "Account=llm Partition=h100 JobState=RUNNING")
    job = parse_show_job(line)
    assert (job.job_id, job.user, job.partition, job.account, job.name) == ("42", "alice", "h100", "llm", "pretrain")
    assert job.gpuagent_job_id == "slurm:40_2"       # the id the tracker derives from SLURM_ARRAY_* env
    plain = parse_show_job("JobId=7 JobName=x UserId=root(0) Account=(null) Partition=gpu")
    assert plain.gpuagent_job_id == "slurm:7" and plain.account == ""
    assert parse_show_job("slurm_load_jobs error: Invalid job id specified") is None


def test_cgroup_paths_of_slurms_cgroup_plugins():
    v1 = "12:pids:/slurm/uid_1000/job_311/step_batch/task_0\n11:cpu:/slurm/uid_1000/job_311/step_batch\n"
    v2 = "0::/system.slice/slurmstepd.scope/job_9001/step_0/user/task_0\n"
    assert job_from_cgroup(v1) == ("311", "batch")
    assert job_from_cgroup(v2) == ("9001", "0")
    assert job_from_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n") is None
    assert job_from_cgroup("0::/kubepods/besteffort/pod1234/job_5\n") is None     # not Slurm's


def test_a_failing_or_hanging_scontrol_never_reaches_the_tick(caplog):
    calls = []

    def broken(args):
        calls.append(args)
        raise subprocess.TimeoutExpired(["scontrol", *args], 5)

    att = SlurmAttribution(run=broken)
    with caplog.at_level(logging.WARNING, logger="gpuagent.slurm"):
        att.refresh()
        att.refresh()
    assert att.lookup(4100) is None and att.errors == 2
    assert len([r for r in caplog.records if "did not answer" in r.getMessage()]) == 1   # logged once
    # A job whose details are not back yet is pending, never a guess
    att2 = SlurmAttribution(run=lambda a: "PID JOBID STEPID\n4100 17 batch\n" if a[0] == "listpids" else "")
    att2.refresh()
    assert att2.lookup(4100) == PENDING


def test_a_process_slurmd_was_not_asked_about_yet_is_pending_not_named_by_its_pid():
    """A clean-clone run (2026-12-03) stored a sbatch job's GPU process as `pid:N` first: the agent's first
    tick came before its first listpids answered. A process that started after the published listing was
    asked for (or before any listing) is pending while listpids answers; one it did not list is nobody's."""
    listing = {"text": "PID JOBID STEPID\n", "fail": False}

    def run(args):
        if args[0] == "listpids":
            if listing["fail"]:
                raise RuntimeError("slurmd is down")
            return listing["text"]
        return "JobId=17 JobName=train UserId=ana(1000) Partition=gpu Account=ml\n"

    att = SlurmAttribution(run=run)
    before = time.time_ns() - 10**9
    assert att.lookup(4100, "", before) is None          # not started: nothing is being asked
    att.refresh()                                        # lists no job
    assert att.lookup(4100, "", before) is None          # it ran when slurmd was asked, and is not listed
    assert att.lookup(4200, "", time.time_ns()) == PENDING   # started after the listing was asked for
    listing["text"] = "PID JOBID STEPID\n4200 17 batch\n"
    att.refresh()
    job, step = att.lookup(4200, "", time.time_ns() - 10**8)
    assert (job.gpuagent_job_id, job.name, step) == ("slurm:17", "train", "batch")
    listing["fail"] = True
    att.refresh()                                        # listpids fails: no verdict can come, so none waits
    assert att.lookup(4300, "", time.time_ns()) is None
    assert att.lookup(4300, "", None) is None and att.lookup(4300, "", time.time_ns() + 10**10) is None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _idle_cluster(request):
    """Each test leaves the module's cluster with no job, so no test's jobs wait behind, or mix with, another's
    (a shuffled order once ran the array test after a job still completing: its second task never started)."""
    yield
    if "slurm" in request.fixturenames:
        request.getfixturevalue("slurm").cancel_all_and_wait()


def _job_pids(slurm: SlurmCluster, job_id: str, python_only: bool = True) -> list[int]:
    pids = [pid for pid, (j, _s) in parse_listpids(slurm.run("scontrol", "listpids", job_id, check=False)).items()
            if j == job_id]
    if python_only:
        pids = [p for p in pids if _cmd(p).startswith(sys.executable)]
    return pids


def _one_job_pid(slurm: SlurmCluster, job_id: str, what: str) -> int:
    """The job's one python process. Waits for exactly one: under load a listpids can catch the step
    mid-fork, a second python that is gone a moment later."""
    [pid] = wait_for(lambda: ps if len(ps := _job_pids(slurm, job_id)) == 1 else None, timeout=20, what=what)
    return pid


def _cmd(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_a_batch_job_without_its_environment_is_named_by_slurm(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    job_id = slurm.sbatch(NO_ENV_SLEEPER, "-J", "pretrain-7b")
    pid = _one_job_pid(slurm, job_id, "the job's python process")
    assert b"SLURM_JOB_ID" not in open(f"/proc/{pid}/environ", "rb").read()      # nothing to read there

    att = SlurmAttribution(refresh_s=0.2).start()
    jd = JobDiscovery(scan_interval_s=0.1, end_grace_s=1.0)
    jd.slurm = att
    try:
        assert att.wait_refreshed(2)
        sink = ListSink()
        # The first ticks may see the job before its details are back (pending): then it is not sampled
        # under any other name.
        wait_for(lambda: (jd.sample(time.time_ns(), sink), any(r.get("pid") == pid for r in sink.job_samples))[1],
                 timeout=10, interval=0.2, what="the job's process sampled")
        mine = [r for r in sink.job_samples if r["pid"] == pid]
        assert {r["job_id"] for r in mine} == {f"slurm:{job_id}"}
        r = mine[0]
        assert (r["job_name"], r["source"]) == ("pretrain-7b", "slurm")
        assert r["attrs"]["slurm_user"] == "root" and r["attrs"]["slurm_partition"] == slurm.partition
        assert r["attrs"]["slurm_step"] == "batch" and r["attrs"]["slurm_job_id"] == job_id
        start = [e for e in sink.events if e.kind == "job_start" and e.attrs["job_id"] == f"slurm:{job_id}"]
        assert start and start[0].attrs["slurm_partition"] == slurm.partition
    finally:
        jd.close()
        slurm.run("scancel", job_id, check=False)


@pytest.mark.slow
def test_array_tasks_get_the_trackers_ids(slurm, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    array_id = slurm.sbatch(NO_ENV_SLEEPER, "--array=1-2", "-J", "sweep", "-c", "1")
    att = SlurmAttribution(refresh_s=0.2).start()
    try:
        def named():
            att.refresh()
            return {att.lookup(p)[0].gpuagent_job_id for p in att.pids()
                    if isinstance(att.lookup(p), tuple) and _cmd(p).startswith(sys.executable)}
        wait_for(lambda: named() == {f"slurm:{array_id}_1", f"slurm:{array_id}_2"}, timeout=30, interval=0.3,
                 what="both array tasks named")
    finally:
        att.stop()
        slurm.run("scancel", array_id, check=False)


@pytest.mark.slow
def test_the_agent_names_a_slurm_job_on_an_emulated_gpu(slurm, nvml_emulator, tmp_path):
    """Must-show 1: an sbatch job's process on an emulated GPU, attributed by the real agent with Slurm's job
    id, user and partition; job_samples in the collector and `gpuagent status` show it."""
    emu = nvml_emulator()
    job_id = slurm.sbatch(NO_ENV_SLEEPER, "-J", "finetune", "-A", "research")
    pid = _one_job_pid(slurm, job_id, "the job's python process")
    emu.add_process(2, pid, 10 << 30)          # the job holds GPU 2 (SYNTHETIC)

    col = server.start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False)
    state = tmp_path / "state"
    cfg = tmp_path / "agent.toml"
    port = free_port()
    cfg.write_text(f"[jobs]\nslurm = \"on\"\nslurm_refresh_s = 0.5\n[exporter]\nlisten = \"127.0.0.1:{port}\"\n"
                   "job_labels = \"hpc_job\"\n")
    agent = start_agent(tmp_path, col.address, state, interval=0.5, batch_interval=0.5, GPUAGENT_CONFIG=str(cfg),
                        SLURM_CONF=str(slurm.conf), **emu.env_vars())
    try:
        wait_running(state, agent)
        q = (f"SELECT s.job_id, j.job_name, s.gpu, j.source, j.user_name, j.partition_name FROM job_samples s "
             f"JOIN jobs j USING (node_id, job_id) WHERE s.pid = {pid} ORDER BY s.ts DESC LIMIT 1")
        row = wait_for(lambda: client.query(col.address, q).rows, timeout=30, interval=0.5,
                       what="the job's samples in the collector")[0]
        assert tuple(row) == (f"slurm:{job_id}", "finetune", 2, "slurm", "root", slurm.partition)
        def status_shows():
            out = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--state-dir", str(state)],
                                 capture_output=True, text=True, timeout=30).stdout
            return out if f"slurm:{job_id}" in out else None
        out = wait_for(status_shows, timeout=10, interval=0.5, what="gpuagent status showing the Slurm job")
        line = next(ln for ln in out.splitlines() if f"slurm:{job_id}" in ln)
        assert line.split()[:2] == [f"slurm:{job_id}", "finetune"], out
        # who and where, as squeue shows them (issue 45, point 3), in the text and in --json
        lines = out.splitlines()
        header = lines[next(i for i, ln in enumerate(lines) if ln.startswith("Jobs (")) + 1]
        assert header.split()[:5] == ["job", "name", "user", "partition", "account"], out
        assert line.split()[2:5] == ["root", slurm.partition, "research"], out
        print(f"gpuagent status, the Jobs table:\n{header}\n{line}")
        shown = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--state-dir", str(state),
                                "--json"], capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        [job] = [j for j in json.loads(shown.stdout)["jobs"] if j["job_id"] == f"slurm:{job_id}"]
        assert (job["job_name"], job["user"], job["partition"], job["account"]) == (
            "finetune", "root", slurm.partition, "research"), job
        assert "pod" not in job and "namespace" not in job
        print("gpuagent status --json, the job:", json.dumps(job, sort_keys=True))
        # /metrics names the job as Slurm does: dcgm-exporter's hpc_job label on the held GPU's series, and
        # the job-info series that joins GPUs with jobs.
        def scraped():
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            return text if f'hpc_job="slurm:{job_id}"' in text else None
        text = wait_for(scraped, timeout=15, interval=0.5, what="/metrics with the Slurm job's hpc_job label")
        util = [ln for ln in text.splitlines()
                if ln.startswith("DCGM_FI_DEV_GPU_UTIL{") and f'hpc_job="slurm:{job_id}"' in ln]
        assert [ln.split('gpu="')[1].split('"')[0] for ln in util] == ["2"], util
        info = [ln for ln in text.splitlines() if ln.startswith("gpuagent_gpu_job_info{")]
        assert any('gpu="2"' in ln and f'job_id="slurm:{job_id}"' in ln and 'job_name="finetune"' in ln
                   for ln in info), info
        # compare --by partition on the live collector: the job's partition, its GPU held for > 0 h
        def by_partition():
            r = CliRunner().invoke(collector_cli.main, ["compare", "--by", "partition", "--target", col.address,
                                                        "--format", "json"])
            assert r.exit_code == 0, r.output
            rows = {x["group"]: x for x in json.loads(r.output)["rows"]}
            return rows if rows.get(slurm.partition, {}).get("gpu_hours", 0) > 0 else None
        rows = wait_for(by_partition, timeout=10, interval=0.5, what="the partition's GPU-hours")
        assert rows[slurm.partition]["jobs"] == 1 and rows[slurm.partition]["nodes"] == 1
        html = tmp_path / "report.html"
        r = CliRunner().invoke(collector_cli.main, ["report", "--target", col.address, "--out", str(html)])
        assert r.exit_code == 0, r.output
        assert f"<td>{slurm.partition}</td><td data-sort" in html.read_text().split("id='jobs-by-partition'")[1]

        # A tracked job whose environment names no job (env -i): its step windows carry Slurm's id too, so
        # job_steps joins job_samples; neither falls back to the process's pid.
        tracked_id = slurm.sbatch(
            f"exec env -i PATH=/usr/bin:/bin GPUAGENT_JOBS_SOCKET={tmp_path / 'jobs.sock'} {sys.executable} -c "
            "\"import time; from gpuagent.jobs.tracker import Tracker; t = Tracker(cuda=False)\n"
            "for _ in range(2400): time.sleep(0.05); t.step()\"\n", "-J", "tracked-no-env")
        tpid = _one_job_pid(slurm, tracked_id, "the tracked job's process")
        assert b"SLURM_JOB_ID" not in open(f"/proc/{tpid}/environ", "rb").read()
        emu.add_process(3, tpid, 4 << 30)       # on GPU 3 (SYNTHETIC): on a GPU node, jobs are GPU jobs
        q = (f"SELECT DISTINCT job_id FROM job_steps WHERE pid = {tpid} UNION ALL SELECT DISTINCT 'samples ' || "
             f"job_id FROM job_samples WHERE pid = {tpid}")
        def both_named():
            got = sorted(r[0] for r in client.query(col.address, q).rows)
            return got if len(got) >= 2 else None
        got = wait_for(both_named, timeout=40, interval=0.5, what="the tracked job's steps and samples")
        assert got == [f"samples slurm:{tracked_id}", f"slurm:{tracked_id}"], got
    finally:
        stop(agent)
        col.stop()
        slurm.run("scancel", job_id, check=False)


def test_compare_by_partition_refuses_a_lake_in_one_sentence(tmp_path):
    r = CliRunner().invoke(collector_cli.main, ["compare", "--by", "partition", "--lake", str(tmp_path)])
    assert r.exit_code != 0
    assert r.output.strip().splitlines() == [
        "Error: --by partition reads one collector (--db or --target); --lake goes with --by pool"]


def test_a_job_on_two_nodes_counts_once_by_account_and_by_partition(tmp_path):
    """Slurm's job id joins a job across nodes: one jobs row per node, one job in its account and partition,
    the GPU-hours of both nodes. SYNTHETIC rows in a real collector database, read by `compare --by`."""
    import datetime as dt

    import duckdb

    from gpuagent.collector.store import schema
    from gpuagent.sim import synthetic_rows as S

    db = tmp_path / "c.duckdb"
    con = duckdb.connect(str(db))
    schema.migrate(con)
    end = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None, microsecond=0)
    start = end - dt.timedelta(hours=1)
    for node, job, account, partition in (("synthetic-a", "slurm:77", "llm", "h100"),
                                          ("synthetic-b", "slurm:77", "llm", "h100"),
                                          ("synthetic-c", "slurm:78", "vision", "h100")):
        S.add_node(con, node, virtualized=False, gpu_count=2)
        con.execute("INSERT INTO jobs (node_id, job_id, job_name, source, first_seen, last_seen, account, "
                    "partition_name) VALUES (?, ?, 'synthetic', 'slurm', ?, ?, ?, ?)",
                    [node, job, start, end, account, partition])
        S.add_job_samples(con, [(start + dt.timedelta(minutes=m), node, job, g, 50.0 + 25 * g)
                                for m in range(61) for g in (0, 1)])
    con.close()

    def rows(by):
        r = CliRunner().invoke(collector_cli.main, ["compare", "--by", by, "--db", str(db), "--format", "json"])
        assert r.exit_code == 0, r.output
        return {x["group"]: x for x in json.loads(r.output)["rows"]}

    acc = rows("account")
    assert set(acc) == {"llm", "vision"}
    assert (acc["llm"]["jobs"], acc["llm"]["nodes"]) == (1, 2)
    assert acc["llm"]["gpu_hours"] == pytest.approx(4.0)        # 2 nodes x 2 GPUs x 1 h
    assert (acc["vision"]["jobs"], acc["vision"]["nodes"], acc["vision"]["gpu_hours"]) == (1, 1, pytest.approx(2.0))
    assert acc["llm"]["mean_gpu_util_percent"] == pytest.approx(62.5)
    part = rows("partition")
    assert list(part) == ["h100"] and (part["h100"]["jobs"], part["h100"]["nodes"]) == (2, 3)
    assert part["h100"]["gpu_hours"] == pytest.approx(6.0)
