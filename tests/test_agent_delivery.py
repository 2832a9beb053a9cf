"""The real agent (subprocess) streaming to the real collector (subprocess, DuckDB file) over loopback:
delivery, a 30 s collector outage, agent SIGKILL, corrupt and malformed spool files, bad credentials."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tools import need

from agent_helpers import free_port, read_status, stop, wait_running
from agent_helpers import start_agent as _start_agent
from conftest import mounted_tmpfs, wait_for

from gpuagent import local_run
from gpuagent.agent.pipeline.spool import decode_record, encode_record
from gpuagent.proto import pb

TICK_METRIC = "mem_used_bytes"     # a host metric the host sampler emits once per tick, no labels


def start_agent(*args, **kw):
    """The agent, sending every sample raw: these tests account for each tick's TICK_METRIC sample and check
    stored values; summaries travel in the same batches through the same spool (tests/test_resolution.py)."""
    kw.setdefault("GPUAGENT_SUMMARY_INTERVAL", "0")
    return _start_agent(*args, **kw)


class Collector:
    """`gpuagent-collector serve` on a fixed loopback port and DuckDB file; can be stopped and restarted."""

    def __init__(self, tmp_path: Path, port: int | None = None, token: str | None = None):
        self.tmp = tmp_path
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.db = tmp_path / "collector.duckdb"
        self.token = token
        self.proc = None

    def start(self):
        env = {"GPUAGENT_COLLECTOR_TOKEN": self.token} if self.token else None
        self.proc = local_run.start_collector(self.db, self.port, self.tmp / "collector.log", extra_env=env)
        local_run.wait_port(self.port, self.proc, self.tmp / "collector.log")
        return self

    def stop(self):
        if self.proc is not None:
            local_run.stop_process(self.proc, timeout=30)
            self.proc = None

    def sql(self, q: str):
        return local_run.query(self.address, q)[1]


@pytest.fixture
def collector(tmp_path):
    c = Collector(tmp_path)
    yield c
    c.stop()


def _delivered_upto(state: Path, seq: int) -> bool:
    """Every batch up to ``seq`` acked: the spool holds nothing at or below it (a running agent cuts a
    new batch every batch interval, so the backlog itself is rarely zero)."""
    st = read_status(state) or {}
    sp, link = st.get("spool", {}), st.get("collector", {})
    return (link.get("connected") is True and link.get("highest_committed_seq", 0) >= seq
            and (sp.get("backlog_batches", -1) == 0 or sp.get("oldest_seq", 0) > seq))


def test_agent_streams_real_samples_to_collector(tmp_path, collector):
    collector.start()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, collector.address, state, interval=0.5, batch_interval=1.0)
    try:
        wait_running(state, agent)
        n = wait_for(lambda: (collector.sql(f"SELECT count(DISTINCT ts) FROM samples WHERE metric = '{TICK_METRIC}'")
                              [0][0] >= 3) and True, timeout=60, what="three ticks stored")
        assert n
        st = wait_for(lambda: (s := read_status(state)) and s["collector"]["last_ack_seq"] > 0 and s, timeout=30,
                      what="an ack in the status file")
        assert st["collector"]["connected"] is True and st["node"]["node_id"]
        node = collector.sql("SELECT node_id, hostname, virt_type FROM nodes")
        assert node[0][0] == st["node"]["node_id"]
        cpu = collector.sql("SELECT count(*), min(value), max(value) FROM samples "
                            "WHERE metric = 'cpu_user_percent' AND labels = ''")[0]
        assert cpu[0] >= 1 and 0.0 <= cpu[1] <= cpu[2] <= 100.0
        kinds = {r[0] for r in collector.sql("SELECT DISTINCT kind FROM events")}
        assert "agent_start" in kinds
    finally:
        stop(agent)


@pytest.mark.slow
def test_collector_outage_30s_no_gap_no_duplicate(tmp_path, collector):
    collector.start()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, collector.address, state, interval=1.0, batch_interval=1.0)
    try:
        wait_running(state, agent)
        wait_for(lambda: collector.sql(f"SELECT count(*) FROM samples WHERE metric = '{TICK_METRIC}'")[0][0] >= 3,
                 timeout=60, what="samples before the outage")
        collector.stop()
        down_ns = time.time_ns()
        t_down = time.monotonic()
        # Collector down for 30 s: the agent keeps sampling into the spool.
        wait_for(lambda: time.monotonic() - t_down >= 30.0, timeout=40, interval=0.5, what="30 s of outage")
        st = read_status(state)
        assert st["collector"]["connected"] is False
        assert st["spool"]["backlog_batches"] >= 25, st["spool"]
        last_spooled = st["spool"]["newest_seq"]
        collector.start()
        up_ns = time.time_ns()
        wait_for(lambda: _delivered_upto(state, last_spooled), timeout=90, what="spool drained after the restart")
        wait_for(lambda: collector.sql(f"SELECT count(*) FROM samples WHERE metric = '{TICK_METRIC}' "
                                       f"AND epoch_ns(ts) > {up_ns + 2_000_000_000}")[0][0] >= 1,
                 timeout=30, what="samples after the restart")
        rows = collector.sql(f"SELECT epoch_ns(ts) FROM samples WHERE metric = '{TICK_METRIC}' AND labels = '' "
                             f"ORDER BY ts")
        ts = [r[0] for r in rows]
        assert len(ts) == len(set(ts)), "duplicate samples stored"
        window = [t for t in ts if down_ns - 2_000_000_000 <= t <= up_ns + 2_000_000_000]
        skipped = read_status(state)["counters"]["skipped_ticks"]
        # every tick the agent made in the outage is there (a tick it skipped, on an overloaded host, is
        # no sample to lose: the exact accounting below covers both)
        assert len(window) >= 30 - skipped, f"only {len(window)} samples in the 30 s outage window"
        dup_batches = collector.sql("SELECT count(*) - count(DISTINCT seq) FROM ingest_log")[0][0]
        assert dup_batches == 0
        assert read_status(state)["spool"]["dropped_batches"] == 0
    finally:
        stop(agent)
    # Exact accounting, independent of scheduling: each tick sampled TICK_METRIC once, so the ticks the
    # agent counted = samples stored + samples still in its spool (the batch cut at shutdown).
    final = read_status(state)
    spooled = 0
    for f in (state / "spool").glob("*.batch"):
        batch = pb.Batch.FromString(decode_record(f.read_bytes())[3])
        ids = {s.id for s in batch.samples.series if s.metric == TICK_METRIC and not s.labels}
        spooled += sum(1 for sid in batch.samples.series_id if sid in ids)
    stored = collector.sql(f"SELECT count(*) FROM samples WHERE metric = '{TICK_METRIC}' AND labels = ''")[0][0]
    assert final["state"] == "stopped"
    assert stored + spooled == final["counters"]["ticks"], (stored, spooled, final["counters"])


def test_agent_sigkill_spooled_batches_delivered_after_restart(tmp_path):
    port = free_port()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, f"127.0.0.1:{port}", state, interval=0.3, batch_interval=0.5)
    try:
        wait_running(state, agent)
        wait_for(lambda: read_status(state)["spool"]["backlog_batches"] >= 4, timeout=30, what="4 spooled batches")
    finally:
        stop(agent, signal.SIGKILL)
    killed_at = time.time_ns()
    spooled = sorted(int(p.name.split(".")[0]) for p in (state / "spool").glob("*.batch"))
    assert len(spooled) >= 4
    c = Collector(tmp_path, port=port).start()
    agent2 = start_agent(tmp_path, c.address, state, interval=0.3, batch_interval=0.5, log_name="agent2.log")
    try:
        wait_for(lambda: read_status(state)["pid"] == agent2.pid and _delivered_upto(state, max(spooled)),
                 timeout=60, what="the spool of the killed agent delivered")
        wait_for(lambda: c.sql(f"SELECT count(*) FROM ingest_log WHERE seq > {max(spooled)}")[0][0] >= 1,
                 timeout=30, what="a batch of the restarted agent stored")
        stored = {r[0] for r in c.sql("SELECT seq FROM ingest_log")}
        assert set(spooled) <= stored, f"lost batches {sorted(set(spooled) - stored)}"
        new = stored - set(spooled)
        assert min(new) > max(spooled), "a sequence number was reused after SIGKILL"
        before = c.sql(f"SELECT count(*) FROM samples WHERE epoch_ns(ts) < {killed_at}")[0][0]
        assert before > 0
    finally:
        stop(agent2)
        c.stop()


def _make_spool(tmp_path, state, n=4):
    """Run an agent with no collector until it has spooled ``n`` batches, then stop it."""
    agent = start_agent(tmp_path, f"127.0.0.1:{free_port()}", state, interval=0.3, batch_interval=0.5,
                        log_name="agent-offline.log")
    try:
        wait_running(state, agent)
        wait_for(lambda: read_status(state)["spool"]["backlog_batches"] >= n, timeout=30, what=f"{n} spooled")
    finally:
        assert stop(agent) == 0
    return sorted((state / "spool").glob("*.batch"))


def test_corrupt_spool_file_set_aside_counted_and_reported(tmp_path, collector):
    state = tmp_path / "state"
    files = _make_spool(tmp_path, state)
    flipped, truncated = files[0], files[1]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x55
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:10])
    good = [int(p.name.split(".")[0]) for p in files[2:]]
    collector.start()
    agent = start_agent(tmp_path, collector.address, state, interval=0.5, batch_interval=0.5)
    try:
        wait_for(lambda: _delivered_upto(state, max(good)), timeout=60, what="the good spooled batches delivered")
        st = read_status(state)
        assert agent.poll() is None
        assert st["spool"]["corrupt_files"] == 2
        assert len(list((state / "spool" / "corrupt").iterdir())) == 2
        stored = {r[0] for r in collector.sql("SELECT seq FROM ingest_log")}
        assert set(good) <= stored
        wait_for(lambda: collector.sql("SELECT count(*) FROM events WHERE kind = 'spool_corrupt'")[0][0] == 2,
                 timeout=30, what="two spool_corrupt events stored")
    finally:
        stop(agent)


def test_malformed_batch_rejected_not_retried_forever(tmp_path, collector):
    """The collector answers INVALID_ARGUMENT for a batch whose series ids do not resolve; the agent
    moves it to spool/rejected/, counts it and delivers the others."""
    state = tmp_path / "state"
    spool = state / "spool"
    spool.mkdir(parents=True)
    (state / "seq").write_text("10\n")
    bad = pb.Batch(seq=5, created_ns=time.time_ns())
    bad.samples.series.add(id=0, metric="load1", gpu=-1)
    bad.samples.ts_ns.extend([time.time_ns()])
    bad.samples.series_id.extend([7])          # no series 7 in this batch's dictionary
    bad.samples.value.extend([1.0])
    good = pb.Batch(seq=6, created_ns=time.time_ns())
    good.events.add(ts_ns=time.time_ns(), kind="synthetic_test_event", message="hand-made test batch")
    for b in (bad, good):
        payload = b.SerializeToString()
        (spool / f"{b.seq:020d}.batch").write_bytes(encode_record(b.seq, payload, len(b.samples.ts_ns), 1))
    collector.start()
    agent = start_agent(tmp_path, collector.address, state, interval=0.5, batch_interval=0.5)
    try:
        wait_for(lambda: _delivered_upto(state, 6) and read_status(state)["spool"]["rejected_batches"] == 1,
                 timeout=60, what="bad batch rejected, others delivered")
        assert (spool / "rejected" / f"{5:020d}.batch").exists()
        stored = {r[0] for r in collector.sql("SELECT seq FROM ingest_log")}
        assert 6 in stored and 5 not in stored and all(s > 10 for s in stored - {6})
        assert collector.sql("SELECT count(*) FROM events WHERE kind = 'synthetic_test_event'")[0][0] == 1
    finally:
        stop(agent)


def test_sigusr2_writes_every_threads_stack_to_the_log_and_the_agent_runs_on(tmp_path, collector):
    """What a hung agent gives (and tests/agent_helpers.stop asks for before SIGKILL)."""
    collector.start()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, collector.address, state, interval=0.5)
    try:
        wait_running(state, agent)
        agent.send_signal(signal.SIGUSR2)
        log = tmp_path / "agent.log"
        # the dump holds the main thread's frame in the daemon's loop, where it waits between ticks
        wait_for(lambda: re.search(r'daemon\.py", line \d+ in run', log.read_text()), timeout=10,
                 what="a stack dump with the main loop's frame in agent.log")
        ticks = read_status(state)["counters"]["ticks"]
        wait_for(lambda: read_status(state)["counters"]["ticks"] > ticks, timeout=10, what="ticks after SIGUSR2")
        assert agent.poll() is None
    finally:
        assert stop(agent) == 0


def test_wrong_token_is_a_clear_status_line(tmp_path):
    c = Collector(tmp_path, token="right-token").start()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, c.address, state, interval=0.5, GPUAGENT_TOKEN="wrong-token")
    try:
        st = wait_for(lambda: (s := read_status(state)) and "UNAUTHENTICATED" in s["collector"]["last_error"] and s,
                      timeout=30, what="UNAUTHENTICATED in status")
        assert "collector.token" in st["collector"]["last_error"]
        assert "UNAUTHENTICATED" in (tmp_path / "agent.log").read_text()
    finally:
        stop(agent)
        c.stop()


def test_size_capped_spool_drops_oldest_with_exact_accounting(tmp_path):
    """Collector down, spool capped at 64 KiB: the agent drops the oldest batches and counts exactly
    what it lost; after the collector comes back, stored + dropped = everything the agent sampled."""
    port = free_port()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, f"127.0.0.1:{port}", state, interval=0.2, batch_interval=0.2,
                        GPUAGENT_SPOOL_MAX_BYTES="64KiB")
    try:
        wait_running(state, agent)
        wait_for(lambda: read_status(state)["spool"]["dropped_batches"] >= 5, timeout=60, what="oldest batches dropped")
    finally:
        assert stop(agent) == 0
    st = read_status(state)
    sp, total = st["spool"], st["counters"]["samples"]
    assert sp["backlog_bytes"] <= 64 * 1024
    assert sp["backlog_samples"] + sp["dropped_samples"] == total
    last_seq = sp["newest_seq"]
    assert sp["oldest_seq"] == sp["dropped_batches"] + 1          # exactly the oldest ones went
    c = Collector(tmp_path, port=port).start()
    agent2 = start_agent(tmp_path, c.address, state, interval=0.5, batch_interval=0.5, log_name="agent2.log",
                         GPUAGENT_SPOOL_MAX_BYTES="64KiB")
    try:
        wait_for(lambda: _delivered_upto(state, last_seq), timeout=60, what="the kept batches delivered")
        n_batches, n_samples = c.sql(f"SELECT count(*), sum(n_samples) FROM ingest_log WHERE seq <= {last_seq}")[0]
        assert n_batches + sp["dropped_batches"] == last_seq
        assert n_samples + sp["dropped_samples"] == total
        assert c.sql("SELECT count(*) FROM events WHERE kind = 'spool_dropped'")[0][0] >= 1
    finally:
        stop(agent2)
        c.stop()


def test_state_dir_reset_renumbers_instead_of_losing_batches(tmp_path):
    """The collector knows seqs up to N for this machine, the agent's state dir is wiped and it spools
    batches 1..k offline: on Register it moves past N and renumbers, so none is taken for a resend."""
    import shutil
    c = Collector(tmp_path).start()
    state = tmp_path / "state"
    agent = start_agent(tmp_path, c.address, state, interval=0.2, batch_interval=0.2)
    try:
        wait_for(lambda: c.sql("SELECT count(*) FROM ingest_log")[0][0] >= 8, timeout=60, what="8 batches stored")
    finally:
        stop(agent)
    c.stop()
    shutil.rmtree(state)
    offline_from = time.time_ns()
    agent = start_agent(tmp_path, c.address, state, interval=0.2, batch_interval=0.2, log_name="agent2.log")
    try:
        wait_for(lambda: (read_status(state) or {}).get("spool", {}).get("backlog_batches", 0) >= 3, timeout=30,
                 what="batches spooled after the reset")
        offline_to = time.time_ns()
        c.start()
        high = c.sql("SELECT max(seq) FROM ingest_log")[0][0]
        wait_for(lambda: _delivered_upto(state, high + 3), timeout=60, what="renumbered batches delivered")
        # The renumbered batches need not go out oldest first (a shuffled run, 2026-12-02: the reset agent's
        # first batch was stored as seq 24, after 9..23), so wait for the offline window's samples themselves.
        q = f"SELECT count(*) FROM samples WHERE epoch_ns(ts) BETWEEN {offline_from} AND {offline_to}"
        wait_for(lambda: c.sql(q)[0][0] > 0, timeout=60, interval=0.2,
                 what="the samples spooled after the state reset (lost if they never come)")
        assert "spooled batches renumbered" in (tmp_path / "agent2.log").read_text()
    finally:
        stop(agent)
        c.stop()


def test_agent_over_tls_with_token(tmp_path):
    """collector.tls_ca + token: the agent verifies the collector's (self-signed) certificate and sends
    its bearer token; samples arrive."""
    import subprocess
    need("openssl")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(tmp_path / "key.pem"),
                    "-out", str(tmp_path / "cert.pem")], check=True, capture_output=True, timeout=60)
    from gpuagent.collector.views import client
    from gpuagent.collector.service import start_collector
    state = tmp_path / "state"
    with start_collector(tmp_path / "c.duckdb", token="tls-token", tls_cert=str(tmp_path / "cert.pem"),
                         tls_key=str(tmp_path / "key.pem")) as h:
        target = f"127.0.0.1:{h.port}"
        agent = start_agent(tmp_path, target, state, interval=0.3, batch_interval=0.3,
                            GPUAGENT_TLS_CA=str(tmp_path / "cert.pem"), GPUAGENT_TOKEN="tls-token")
        try:
            wait_for(lambda: client.query(target, f"SELECT count(*) FROM samples WHERE metric = '{TICK_METRIC}'",
                                          token="tls-token", tls_ca=str(tmp_path / "cert.pem")).rows[0][0] >= 2,
                     timeout=60, what="samples over TLS")
            assert read_status(state)["collector"]["connected"] is True
        finally:
            stop(agent)


@pytest.fixture
def small_fs(tmp_path):
    """A real 1.5 MiB tmpfs for the state dir (needs root / CAP_SYS_ADMIN; skipped without)."""
    yield from mounted_tmpfs(tmp_path, "smallfs", "1536k")


def test_full_disk_drops_oldest_keeps_running_and_counts_exactly(tmp_path, small_fs):
    """State dir on a 1.5 MiB file system, collector down, spool bound far above it: the spool keeps
    1 MiB free by dropping its oldest batches, the agent keeps sampling and writing its status, and
    after the collector returns stored + dropped = sampled."""
    port = free_port()
    state = small_fs / "state"
    agent = start_agent(tmp_path, f"127.0.0.1:{port}", state, interval=0.1, batch_interval=0.1)
    try:
        wait_running(state, agent)
        wait_for(lambda: (read_status(state) or {}).get("spool", {}).get("dropped_batches", 0) >= 5, timeout=90,
                 what="oldest batches dropped for disk space")
        assert agent.poll() is None
        assert "disk nearly full" in (tmp_path / "agent.log").read_text()
        st = wait_running(state, agent)          # the status file is still being rewritten
        assert st["spool"]["write_errors"] == 0
    finally:
        assert stop(agent) == 0
    st = read_status(state)
    sp, total = st["spool"], st["counters"]["samples"]
    assert sp["backlog_samples"] + sp["dropped_samples"] == total
    last_seq = sp["newest_seq"]
    c = Collector(tmp_path, port=port).start()
    agent2 = start_agent(tmp_path, c.address, state, interval=0.5, batch_interval=0.5, log_name="agent2.log")
    try:
        wait_for(lambda: _delivered_upto(state, last_seq), timeout=60, what="the kept batches delivered")
        n_batches, n_samples = c.sql(f"SELECT count(*), sum(n_samples) FROM ingest_log WHERE seq <= {last_seq}")[0]
        assert n_batches + sp["dropped_batches"] == last_seq
        assert n_samples + sp["dropped_samples"] == total
    finally:
        stop(agent2)
        c.stop()
