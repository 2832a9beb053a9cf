"""The agent's probe scheduler with real probe subprocesses: lock, gating, budget, timeout, shutdown."""

from __future__ import annotations

import os
import threading

import pytest

from gpuagent.agent.config import ProbesConfig
from gpuagent.agent.probing.scheduler import ProbeScheduler
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.probes import blockdev
from gpuagent.probes.lock import ProbeLock

from conftest import wait_for

FAST_HOST = {"repeats": 1, "syscall_iters": 10000, "clock_iters": 10000, "pipe_iters": 200, "fault_mib": 4,
             "memcpy_mib": 8}


def _cfg(tmp_path, **extra):
    table = {"lock_path": str(tmp_path / "probe.lock"), "initial_delay_s": 0, "jitter_fraction": 0,
             "host": {"params": FAST_HOST},
             "storage": {"params": {"path": str(tmp_path), "size_mib": 16, "rand_seconds": 0.3, "seq_seconds": 0.2}}}
    table.update(extra)
    return ProbesConfig.from_mapping(table)


def test_config_from_toml_table_and_bad_keys(tmp_path):
    c = _cfg(tmp_path, budget_fraction=0.05, collective={"interval_s": 7200, "enabled": False})
    assert c.budget_fraction == 0.05
    assert c.schedule("collective").interval_s == 7200 and not c.schedule("collective").enabled
    assert c.schedule("host").params == FAST_HOST and c.schedule("host").interval_s == 600
    with pytest.raises(ValueError, match="unknown key probes.budget"):
        ProbesConfig.from_mapping({"budget": 1})
    with pytest.raises(ValueError, match=r"\[probes.storage.params\]: unknown parameter 'size'"):
        ProbesConfig.from_mapping({"storage": {"params": {"size": 1}}})
    with pytest.raises(ValueError, match=r"^\[probes.storage.params\]: parameter queue_depth of probe storage must be "
                                         r"between 1 and 256, got 0$"):
        ProbesConfig.from_mapping({"storage": {"params": {"queue_depth": 0}}})
    with pytest.raises(ValueError, match="unknown key\\(s\\) every in \\[probes.host\\]"):
        ProbesConfig.from_mapping({"host": {"every": 5}})
    with pytest.raises(ValueError, match="budget_fraction is a fraction"):
        ProbesConfig.from_mapping({"budget_fraction": 2})


def test_held_lock_makes_the_scheduler_skip_then_run(tmp_path):
    sink = ListSink()
    s = ProbeScheduler(sink, _cfg(tmp_path))
    other = ProbeLock(str(tmp_path / "probe.lock"))
    assert other.acquire(what="manual")
    try:
        recs = s.run_once("host")
    finally:
        other.release()
    assert recs[0]["status"] == "skipped"
    assert recs[0]["reason"].startswith(f"lock: another probe run holds {tmp_path / 'probe.lock'} (pid={os.getpid()} probe=manual")
    recs = s.run_once("host")
    assert recs[0]["status"] == "ok"
    assert [r["status"] for r in sink.probe_results] == ["skipped", "ok"]


def test_two_schedulers_never_overlap(tmp_path):
    """A runs storage; B asks for host meanwhile: without waiting it skips, with lock_wait_s it waits."""
    lock_path = tmp_path / "probe.lock"
    # force: other work on this shared machine may keep the disk busy; the gate has its own test.
    a = ProbeScheduler(ListSink(), _cfg(tmp_path, storage={"force": True, "params": {
        "path": str(tmp_path), "size_mib": 16, "rand_seconds": 3.0}}))
    b_skip = ProbeScheduler(ListSink(), _cfg(tmp_path))
    b_wait = ProbeScheduler(ListSink(), _cfg(tmp_path, lock_wait_s=60.0))
    t = threading.Thread(target=a.run_once, args=("storage",))
    t.start()
    try:
        wait_for(lambda: "probe=storage" in ProbeLock(str(lock_path)).holder(), timeout=30, what="A holds the lock")
        skipped = b_skip.run_once("host")[0]
        assert skipped["status"] == "skipped" and "probe=storage" in skipped["reason"]
        waited = b_wait.run_once("host")[0]
    finally:
        t.join(60)
    a_rec = a.sink.probe_results[0]
    assert a_rec["status"] == "ok" and waited["status"] == "ok"
    assert waited["started_ns"] >= a_rec["ended_ns"]  # B's run began only after A's ended


def test_gpu_probes_skip_while_a_job_holds_gpus_unless_forced(tmp_path):
    sink = ListSink()
    s = ProbeScheduler(sink, _cfg(tmp_path), busy_gpus=lambda: [3, 1])
    rec = s.run_once("pcie")[0]
    assert rec["status"] == "skipped" and rec["reason"] == "gpus busy: a job holds GPU 1, 3"
    rec = s.run_once("host")[0]  # not a GPU probe: not gated
    assert rec["status"] == "ok"
    forced = s.run_once("gpu_compute", force=True)[0]
    # Forced past the gate, it really ran (here: no CUDA, so the probe itself says so).
    assert "gpus busy" not in forced["reason"] and forced["env"].get("forced") == 1


def test_platform_gate_uses_gpu_count(tmp_path):
    s = ProbeScheduler(ListSink(), _cfg(tmp_path), gpu_count=lambda: 1)
    rec = s.run_once("collective")[0]
    assert rec["status"] == "skipped" and rec["reason"] == "platform: collective needs multi-gpu and this node has 1 GPU(s)"


def test_storage_waits_for_a_quiet_disk(tmp_path):
    seen = []
    busy = ProbeScheduler(ListSink(), _cfg(tmp_path), disk_activity=lambda dev: seen.append(dev) or (85.0, 3000.0))
    rec = busy.run_once("storage")[0]
    dev = blockdev.device_for_path(str(tmp_path))
    if not dev:
        pytest.skip("tmp_path is on no block device here")
    assert seen == [dev]
    assert rec["status"] == "skipped"
    assert rec["reason"] == f"disk busy: {dev} was 85 % busy at 3000 IOPS (limits 20 %, 200 IOPS)"
    quiet = ProbeScheduler(ListSink(), _cfg(tmp_path), disk_activity=lambda dev: (0.5, 3.0))
    assert quiet.run_once("storage")[0]["status"] == "ok"
    # The default source: two real /proc/diskstats readings of that device, with real fsynced writes to it
    # going on in between, so the reading must show I/O on it.
    stop, synced = threading.Event(), []

    def write_and_sync():
        with open(tmp_path / "io.bin", "wb") as f:
            while not stop.is_set():
                f.write(os.urandom(256 << 10))
                f.flush()
                os.fsync(f.fileno())
                synced.append(1)

    writer = threading.Thread(target=write_and_sync)
    writer.start()
    try:
        wait_for(lambda: synced, timeout=30, what="the first fsynced write")
        real = ProbeScheduler(ListSink(), _cfg(tmp_path, disk_quiet_window_s=0.5))
        busy_pct, iops = real.diskstats_activity(dev)
    finally:
        stop.set()
        writer.join(timeout=30)
    assert 0 < busy_pct <= 100 and iops > 0, (busy_pct, iops, len(synced))


def test_budget_skips_once_probe_time_exceeds_the_share(tmp_path):
    # 0.005 % of 1800 s = 0.09 s of probe time; one host run (a Python subprocess) takes longer than that.
    sink = ListSink()
    s = ProbeScheduler(sink, _cfg(tmp_path, budget_fraction=0.00005, budget_window_s=1800))
    statuses = []
    for _ in range(4):
        statuses.append(s.run_once("host")[0]["status"])
        if statuses[-1] == "skipped":
            break
    assert statuses == ["ok", "skipped"], statuses
    assert sink.probe_results[-1]["reason"].startswith("budget: ")
    assert "limit 0.1 s (0.005 %)" in sink.probe_results[-1]["reason"]
    assert s.budget_used_s() == pytest.approx(s.last_run_s("host"))


def test_timeout_is_recorded_and_the_scheduler_goes_on(tmp_path):
    sink = ListSink()
    cfg = _cfg(tmp_path, storage={"timeout_s": 1.5, "force": True, "params": {"path": str(tmp_path), "size_mib": 4096,
                                                             "rand_seconds": 60, "min_free_percent": 0}},
               pcie={"enabled": False}, gpu_compute={"enabled": False}, collective={"enabled": False})
    s = ProbeScheduler(sink, cfg)
    s.start()
    try:
        wait_for(lambda: {r["probe"] for r in sink.probe_results} >= {"host", "storage"}, timeout=60,
                 what="both probes recorded")
    finally:
        s.stop()
    by = {r["probe"]: r for r in sink.probe_results}
    assert by["storage"]["status"] == "timeout" and by["storage"]["reason"] == "killed after its 1.5 s timeout"
    assert by["host"]["status"] == "ok"
    assert os.listdir(tmp_path) == ["probe.lock"]


def test_stop_kills_an_inflight_probe(tmp_path):
    sink = ListSink()
    cfg = _cfg(tmp_path, storage={"force": True, "params": {"path": str(tmp_path), "size_mib": 4096, "rand_seconds": 60,
                                             "min_free_percent": 0}},
               host={"enabled": False}, pcie={"enabled": False}, gpu_compute={"enabled": False},
               collective={"enabled": False})
    s = ProbeScheduler(sink, cfg)
    s.start()
    wait_for(lambda: "probe=storage" in ProbeLock(str(tmp_path / "probe.lock")).holder(), timeout=30,
             what="storage running")
    s.stop(timeout=20)
    assert sink.probe_results[0]["status"] == "failed"
    assert sink.probe_results[0]["reason"] == "cancelled: the agent is stopping"
    assert os.listdir(tmp_path) == ["probe.lock"]


def test_agent_daemon_runs_the_scheduler_and_reports_results(tmp_path):
    """The real agent (subprocess) with a [probes] table: the host probe's result reaches its status."""
    from agent_helpers import free_port, read_status, start_agent, stop, wait_running

    cfg = tmp_path / "agent.toml"
    cfg.write_text(
        "[probes]\ninitial_delay_s = 0\njitter_fraction = 0\n"
        "[probes.host]\ninterval_s = 3600\n[probes.host.params]\nrepeats = 1\npipe_iters = 200\n"
        "[probes.storage]\nenabled = false\n[probes.pcie]\nenabled = false\n"
        "[probes.gpu_compute]\nenabled = false\n[probes.collective]\nenabled = false\n")
    state = tmp_path / "state"
    proc = start_agent(tmp_path, f"127.0.0.1:{free_port()}", state, GPUAGENT_CONFIG=str(cfg))
    try:
        wait_running(state, proc)
        st = wait_for(lambda: (read_status(state) or {}).get("probes", {}).get("host"), timeout=60,
                      what="host probe result in the agent status")
    finally:
        stop(proc)
    assert st["status"] == "ok"
    assert (state / "probe.lock").exists()


def test_disk_activity_comes_from_the_host_samplers_latest_values(tmp_path):
    from gpuagent.agent.pipeline.batcher import Batcher, SeqAllocator
    from gpuagent.agent.probing.scheduler import disk_activity_from

    b = Batcher(SeqAllocator(tmp_path))
    act = disk_activity_from(b, max_age_s=30)
    assert act("vda") is None  # nothing sampled yet: the scheduler falls back to /proc/diskstats
    b.add("disk_busy_percent", 42.0, labels={"device": "vda"})
    b.add("disk_read_iops", 300.0, labels={"device": "vda"})
    b.add("disk_write_iops", 20.0, labels={"device": "vda"})
    assert act("vda") == (42.0, 320.0)
    assert act("nvme0n1") is None
    old = disk_activity_from(b, max_age_s=0)
    assert wait_for(lambda: old("vda") is None, timeout=5, what="values to age out")


def test_probe_results_reach_the_collectors_duckdb(tmp_path):
    """Agent (subprocess) -> collector (subprocess, DuckDB file): ok, forced and platform-skipped runs are
    stored in probe_results with their reason, and the metrics in probe_metrics."""
    from agent_helpers import free_port, start_agent, stop, wait_running
    from gpuagent import local_run

    port = free_port()
    col = local_run.start_collector(tmp_path / "c.duckdb", port, tmp_path / "collector.log")
    try:
        local_run.wait_port(port, col, tmp_path / "collector.log")
        cfg = tmp_path / "agent.toml"
        cfg.write_text(
            "[probes]\ninitial_delay_s = 0\njitter_fraction = 0\n"
            "[probes.host]\n[probes.host.params]\nrepeats = 1\npipe_iters = 200\n"
            f"[probes.storage]\nforce = true\n[probes.storage.params]\npath = \"{tmp_path}\"\n"
            "size_mib = 16\nrand_seconds = 0.3\nseq_seconds = 0.2\n"
            "[probes.pcie]\nenabled = false\n[probes.gpu_compute]\nenabled = false\n")
        state = tmp_path / "state"
        agent = start_agent(tmp_path, f"127.0.0.1:{port}", state, batch_interval=0.5, GPUAGENT_CONFIG=str(cfg))
        try:
            wait_running(state, agent)

            def rows():
                r = local_run.query(f"127.0.0.1:{port}", "SELECT probe, status, reason, gpu FROM probe_results "
                                                         "ORDER BY probe")[1]
                return r if len(r) >= 3 else None
            got = wait_for(rows, timeout=90, what="three probe results in DuckDB")
        finally:
            stop(agent)
        metrics = {m for (m,) in local_run.query(
            f"127.0.0.1:{port}", "SELECT DISTINCT metric FROM probe_metrics WHERE probe IN ('host', 'storage')")[1]}
    finally:
        local_run.stop_process(col, timeout=30)
    by = {r[0]: r for r in got}
    assert by["host"][1] == "ok" and by["storage"][1] == "ok"
    # this machine has no GPU: the multi-GPU probe is recorded as skipped without starting a subprocess
    assert by["collective"][1] == "skipped" and by["collective"][2].startswith("platform: collective needs multi-gpu")
    assert {"syscall_ns", "clock_gettime_ns", "seq_read_gbps", "rand_read_iops", "o_direct"} <= metrics
