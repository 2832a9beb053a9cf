"""Node identity: hosts cloned with one /etc/machine-id, a second agent as the same node, restarts.

Real parts throughout: an in-process collector on 127.0.0.1 with a DuckDB file, the agent's own sender
and spool (in-process, for hosts this machine cannot be), and real agent processes (which on this machine
all present its real machine-id and hostname)."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import threading

import duckdb
import grpc
import pytest

from agent_helpers import ROOT, agent_env, read_status, start_agent, stop
from collector_helpers import NOW_NS, node_info
from conftest import wait_for

from gpuagent.agent.config import CollectorConfig
from gpuagent.agent.samplers.nodeinfo import machine_id as read_machine_id
from gpuagent.agent.pipeline.sender import Sender
from gpuagent.agent.pipeline.spool import Spool, decode_record
from gpuagent.collector.ingest import identity
from gpuagent.collector.service import ServerOptions, start_collector
from gpuagent.proto import pb, pb_grpc

N_BATCHES = 20
PER_BATCH = 50


def host_batch(seq: int, value0: float) -> pb.Batch:
    """A batch as an agent spools it (no node_id: the sender adds it); values unique per host."""
    b = pb.Batch(seq=seq, created_ns=NOW_NS)
    b.samples.series.add(id=1, metric="cpu_user_percent", gpu=-1)
    t0 = NOW_NS - 120 * 10**9 + seq * 10**9
    b.samples.ts_ns.extend(t0 + i * 1000 for i in range(PER_BATCH))
    b.samples.series_id.extend([1] * PER_BATCH)
    b.samples.value.extend(value0 + seq * 1000 + i for i in range(PER_BATCH))
    return b


def filled_spool(path, value0: float) -> Spool:
    spool = Spool(path)
    for seq in range(1, N_BATCHES + 1):
        spool.put(seq, host_batch(seq, value0).SerializeToString(), PER_BATCH, 0)
    return spool


def sender_for(address: str, spool: Spool, info: pb.NodeInfo) -> Sender:
    return Sender(CollectorConfig(address=address, backoff_initial_s=0.2, backoff_max_s=2.0), spool,
                  lambda: info, batch_interval_s=1.0)


def db_rows(handle, sql, params=None):
    """Read through the collector's own writer connection (the file is held by the collector)."""
    return handle.writer.call(lambda con: con.execute(sql, params or []).fetchall()).result(30)


def test_clones_sharing_a_machine_id_are_two_nodes_and_each_keeps_all_its_data(tmp_path, caplog):
    """Two hosts, one machine-id, different hostnames, both streaming seqs 1..20 at once (the agent's own
    sender and spool): two nodes, every acked sample stored under its own node, none taken for a resend of
    the other's; one warning sentence; both rows marked; the clone that fixes its id keeps its node."""
    caplog.set_level(logging.WARNING, logger="gpuagent.collector")
    shared = "5f0c1d2e3a4b5c6d7e8f90a1b2c3d4e5"
    with start_collector(tmp_path / "c.duckdb", analyze=False) as h:
        address = f"127.0.0.1:{h.port}"
        senders = {host: sender_for(address, filled_spool(tmp_path / host, value0),
                                    node_info(host, shared))
                   for host, value0 in (("clone-a", 0.0), ("clone-b", 1e7))}
        for s in senders.values():
            s.start()
        try:
            wait_for(lambda: all(s.spool.stats()["backlog_batches"] == 0 for s in senders.values()), timeout=60,
                     what="both spools delivered")
            for host, s in senders.items():
                snap = s.snapshot()
                assert snap["node_id"] == host
                assert snap["acked_batches"] == N_BATCHES and snap["duplicate_acks"] == 0, snap
                stored = db_rows(h, "SELECT count(*), count(DISTINCT value) FROM samples WHERE node_id = ?", [host])
                assert stored[0] == (N_BATCHES * PER_BATCH, N_BATCHES * PER_BATCH)
                assert db_rows(h, "SELECT list(seq ORDER BY seq) FROM ingest_log WHERE node_id = ?",
                               [host])[0][0] == list(range(1, N_BATCHES + 1))
            # each node holds only its own host's values
            assert db_rows(h, "SELECT count(*) FROM samples WHERE node_id = 'clone-a' AND value >= 1e7")[0][0] == 0
            assert db_rows(h, "SELECT count(*) FROM samples WHERE node_id = 'clone-b' AND value < 1e7")[0][0] == 0
        finally:
            for s in senders.values():
                s.stop()
        expected = (f"hosts clone-a and clone-b both present machine-id {shared} (a VM image cloned without a "
                    f"fresh /etc/machine-id?); their data is kept apart as nodes clone-a and clone-b, but give "
                    f"each host its own id: on the clone run `rm /etc/machine-id && systemd-machine-id-setup` "
                    f"and restart gpuagent (it keeps its node)")
        warnings = [r.getMessage() for r in caplog.records if "machine-id" in r.getMessage()]
        assert warnings == [expected]
        wait_for(lambda: db_rows(h, "SELECT node_id, machine_id_shared_with FROM nodes ORDER BY node_id")
                 == [("clone-a", "clone-b"), ("clone-b", "clone-a")], timeout=10, what="both nodes marked")
        # The fix we ask for: clone-b gets a fresh machine-id and keeps its node (and its seqs).
        with grpc.insecure_channel(address) as ch:
            resp = pb_grpc.CollectorStub(ch).Register(pb.RegisterRequest(node=node_info("clone-b", "fresh-id-b")))
        assert resp.node_id == "clone-b" and resp.last_committed_seq == N_BATCHES
        assert db_rows(h, "SELECT node_id, machine_id, machine_id_shared_with FROM nodes ORDER BY node_id") == [
            ("clone-a", shared, "clone-b"), ("clone-b", "fresh-id-b", None)]


def test_new_node_with_high_first_seq_keeps_no_per_seq_state(tmp_path):
    """A renamed host keeps its agent's seq file, so its new node starts far above 1: the dedupe state
    is one run from that first seq (nothing piles up in memory), also after a collector restart."""
    db = tmp_path / "c.duckdb"
    from collector_helpers import sample_batch
    with start_collector(db, analyze=False) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        nid = stub.Register(pb.RegisterRequest(node=node_info("renamed-host", "m-9"))).node_id
        acks = list(stub.Stream(iter([sample_batch(nid, s) for s in range(5000, 5010)])))
        assert [(a.seq, a.duplicate) for a in acks] == [(s, False) for s in range(5000, 5010)]
        st = h.writer.call(lambda con: h.writer.node_seqs(nid)).result(10)
        assert (st.runs(), st.highest) == ([(5000, 5009)], 5009)
    with start_collector(db, analyze=False) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        assert stub.Register(pb.RegisterRequest(node=node_info("renamed-host", "m-9"))).last_committed_seq == 5009
        acks = list(stub.Stream(iter([sample_batch(nid, s) for s in (5003, 5010, 5012)])))
        assert [(a.seq, a.duplicate) for a in acks] == [(5003, True), (5010, False), (5012, False)]
        st = h.writer.call(lambda con: h.writer.node_seqs(nid)).result(10)
        assert st.runs() == [(5000, 5010), (5012, 5012)]
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*), count(DISTINCT seq) FROM ingest_log").fetchone() == (12, 12)


# ------------------------------------------------------------------------------------------ real agents

def _refusal_re(node_id: str, hostname: str, machine_id: str, pid: int) -> str:
    short = machine_id if len(machine_id) <= 12 else machine_id[:12] + "…"
    return (re.escape(f"node {node_id} (hostname {hostname}, machine-id {short}) is already streaming from "
                      f"another agent (agent pid {pid} at 127.0.0.1, connected since ")
            + r"\d\d:\d\d:\d\d UTC, last batch \d+ s ago\), "
            + re.escape("so this agent is refused rather than mixed into the same sequence numbers: stop the "
                        "other agent, or if this is a different host give it its own machine-id "
                        "(`rm /etc/machine-id && systemd-machine-id-setup`) and hostname, then restart gpuagent"))


def _stored_samples(h, node_id: str) -> int:
    return db_rows(h, "SELECT count(*) FROM samples WHERE node_id = ?", [node_id])[0][0]


def _spooled(state) -> dict[int, int]:
    """seq -> n_samples of the batches left in a stopped agent's spool."""
    out = {}
    for p in (state / "spool").glob("*.batch"):
        seq, n_samples, _, _ = decode_record(p.read_bytes())
        out[seq] = n_samples
    return out


@pytest.mark.slow
def test_second_agent_as_the_same_node_is_refused_and_nothing_is_lost(tmp_path, caplog):
    """Two real agents on this machine (same machine-id and hostname, own state dirs): the second is
    refused with ALREADY_EXISTS and one sentence naming the first, keeps spooling, backs off, and takes
    over once the first stops; every sample either agent took is stored once or still spooled."""
    caplog.set_level(logging.INFO, logger="gpuagent.collector")
    with start_collector(tmp_path / "c.duckdb", analyze=False) as h:
        address = f"127.0.0.1:{h.port}"
        sa, sb = tmp_path / "a", tmp_path / "b"
        a = start_agent(tmp_path, address, sa, interval=0.3, batch_interval=0.5, log_name="a.log")
        b = None
        try:
            wait_for(lambda: (read_status(sa) or {}).get("collector", {}).get("acked_batches", 0) >= 2, timeout=60,
                     what="agent A streaming")
            node_id = read_status(sa)["node"]["node_id"]
            machine, host = read_status(sa)["node"]["machine_id"], read_status(sa)["node"]["hostname"]
            b = start_agent(tmp_path, address, sb, interval=0.3, batch_interval=0.5, log_name="b.log")
            pattern = _refusal_re(node_id, host, machine, a.pid)
            st = wait_for(lambda: (s := read_status(sb)) and "ALREADY_EXISTS" in s["collector"]["last_error"] and s,
                          timeout=60, what="agent B refused")
            assert re.fullmatch(re.escape(f"collector {address} refused this agent (ALREADY_EXISTS): ") + pattern,
                                st["collector"]["last_error"]), st["collector"]["last_error"]
            # B keeps its samples spooled and retries at a growing interval, not in a loop.
            # (from the third refusal on the backoff is >= 2 s, jittered to at least half of it)
            sb_st = wait_for(lambda: (s := read_status(sb))["collector"]["consecutive_failures"] >= 3 and
                             s["collector"]["next_retry_ns"] - s["collector"]["last_error_ns"] >= 0.9e9 and s,
                             timeout=60, what="three refused attempts, then a backed-off retry")
            assert sb_st["collector"]["acked_batches"] == 0 and sb_st["spool"]["dropped_batches"] == 0
            assert sb_st["spool"]["backlog_batches"] >= 4
            log_b = (tmp_path / "b.log").read_text()
            lines = [ln for ln in log_b.splitlines() if "ALREADY_EXISTS" in ln]
            assert len(lines) == 1 and re.search(pattern + "; spooling and retrying with backoff$", lines[0]), lines
            refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a second agent")]
            assert len(refusals) == 1 and re.search(pattern + "$", refusals[0]), refusals
            # A was never disturbed: connected throughout, nothing dropped.
            sa_st = read_status(sa)
            assert sa_st["collector"]["connected"] is True and sa_st["collector"]["reconnects"] == 1
        finally:
            a_rc = stop(a)
        assert a_rc == 0
        a_final = read_status(sa)
        try:
            assert b is not None
            # With A gone, B is let in on its next attempt: it renumbers past A's seqs and delivers.
            wait_for(lambda: (s := read_status(sb)) and s["collector"]["connected"] and
                     s["collector"]["acked_batches"] >= sb_st["spool"]["backlog_batches"], timeout=60,
                     what="agent B taking over after A stopped")
            assert "connected to collector" in (tmp_path / "b.log").read_text()
        finally:
            assert stop(b) == 0
        b_final = read_status(sb)
        assert a_final["spool"]["dropped_samples"] == b_final["spool"]["dropped_samples"] == 0
        # B moved its seqs above what A had stored (N): A's batches are <= N, B's above.
        m = re.search(r"collector already holds seqs up to (\d+) for this machine", (tmp_path / "b.log").read_text())
        assert m, "agent B did not renumber past agent A's seqs"
        n = int(m.group(1))
        log = dict(db_rows(h, "SELECT seq, n_samples FROM ingest_log WHERE node_id = ?", [node_id]))
        assert sum(log.values()) == _stored_samples(h, node_id)
        for name, final, state, mine in (("A", a_final, sa, lambda q: q <= n), ("B", b_final, sb, lambda q: q > n)):
            left = _spooled(state)
            # taken = stored or still spooled (a batch stored just as the agent stopped is both: counted once)
            stored_too = sum(k for q, k in left.items() if mine(q) and q in log)
            assert sum(k for q, k in log.items() if mine(q)) == \
                final["counters"]["samples"] - sum(left.values()) + stored_too, name


def test_restart_after_sigkill_is_not_refused(tmp_path):
    """A killed agent restarted at once on the same state dir is the same node coming back, not a second
    agent: it connects on its first attempt and delivers what the killed one had spooled."""
    with start_collector(tmp_path / "c.duckdb", analyze=False) as h:
        address = f"127.0.0.1:{h.port}"
        state = tmp_path / "state"
        a = start_agent(tmp_path, address, state, interval=0.2, batch_interval=0.3)
        try:
            wait_for(lambda: (read_status(state) or {}).get("collector", {}).get("acked_batches", 0) >= 3,
                     timeout=60, what="agent streaming")
        finally:
            stop(a, signal.SIGKILL)
        node_id = read_status(state)["node"]["node_id"]
        spooled = sorted(int(p.name.split(".")[0]) for p in (state / "spool").glob("*.batch"))
        a2 = start_agent(tmp_path, address, state, interval=0.2, batch_interval=0.3, log_name="agent2.log")
        try:
            st = wait_for(lambda: (s := read_status(state)) and s["pid"] == a2.pid and
                          s["collector"]["acked_batches"] >= 2 and s, timeout=60, what="restarted agent streaming")
            assert "ALREADY_EXISTS" not in (tmp_path / "agent2.log").read_text()
            assert st["collector"]["last_error"] == ""
            stored = {r[0] for r in db_rows(h, "SELECT seq FROM ingest_log WHERE node_id = ?", [node_id])}
            assert set(spooled) <= stored
        finally:
            assert stop(a2) == 0


class HalfDeadProxy:
    """A TCP forwarder on 127.0.0.1 that, when the agent side closes, keeps the collector side open and
    silent: what the collector sees of a host that died without its TCP connection being reset."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.held += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass        # one side went away: the other is deliberately left open

    def close(self):
        self._stop = True
        for s in [self.listener, *self.held]:
            s.close()


@pytest.mark.slow
def test_dead_peers_stale_stream_gives_way_to_the_restarted_agent(tmp_path, caplog):
    """The agent is killed but its connection stays open on the collector's side (a dead peer, through
    HalfDeadProxy): the agent restarted on the same state dir takes over once the old stream has been
    silent past the bound, and every batch the killed agent had spooled is stored once or still spooled."""
    caplog.set_level(logging.INFO, logger="gpuagent.collector")
    options = ServerOptions(stream_takeover_idle_s=3.0)
    with start_collector(tmp_path / "c.duckdb", analyze=False, options=options) as h:
        proxy = HalfDeadProxy(h.port)
        state = tmp_path / "state"
        a = start_agent(tmp_path, f"127.0.0.1:{proxy.port}", state, interval=0.2, batch_interval=0.3)
        a2 = None
        try:
            wait_for(lambda: (read_status(state) or {}).get("collector", {}).get("acked_batches", 0) >= 3,
                     timeout=60, what="agent streaming")
            node_id = read_status(state)["node"]["node_id"]
            stop(a, signal.SIGKILL)
            spooled_at_kill = set(_spooled(state))
            a2 = start_agent(tmp_path, f"127.0.0.1:{h.port}", state, interval=0.2, batch_interval=0.3,
                             log_name="agent2.log")
            st = wait_for(lambda: (s := read_status(state)) and s["pid"] == a2.pid and
                          s["collector"]["acked_batches"] >= 2 and s, timeout=60, what="the restart streaming")
            took_over = [r.getMessage() for r in caplog.records if "takes over" in r.getMessage()]
            m = re.search(rf"node {re.escape(node_id)}: agent pid {a2.pid} at 127\.0\.0\.1 takes over from "
                          rf"agent pid {a.pid} at 127\.0\.0\.1 \(stream idle (\d+) s\)$", took_over[0])
            assert len(took_over) == 1 and m and int(m.group(1)) >= 3, took_over
            assert st["collector"]["connected"] is True
        finally:
            stop(a, signal.SIGKILL)
            if a2 is not None:
                assert stop(a2) == 0
            proxy.close()
        st = read_status(state)
        stored = [r[0] for r in db_rows(h, "SELECT seq FROM ingest_log WHERE node_id = ?", [node_id])]
        assert len(stored) == len(set(stored))
        assert spooled_at_kill <= set(stored) | set(_spooled(state)), "a batch the killed agent spooled was lost"
        assert st["spool"]["dropped_batches"] == 0


def _agent_in_uts(tmp_path, address: str, state, hostname: str, log_name: str) -> subprocess.Popen:
    """A real agent in its own UTS namespace, so it has its own hostname but this machine's machine-id."""
    cmd = ["unshare", "--uts", "sh", "-c", f'hostname "$0" && exec "$@"', hostname, sys.executable, "-m",
           "gpuagent.agent.cli", "run", "--collector", address, "--state-dir", str(state), "--interval", "0.3",
           "--batch-interval", "0.5"]
    return subprocess.Popen(cmd, stdout=open(tmp_path / log_name, "ab"), stderr=subprocess.STDOUT,
                            env=agent_env(tmp_path), cwd=ROOT)


def test_two_real_agents_one_machine_id_two_hostnames(tmp_path, caplog):
    """Real agent processes in their own UTS namespaces (hostnames clone-x, clone-y) on this machine, so
    with one real machine-id: two nodes, each one's stored samples equal what it took minus what it
    still has spooled, and the collector's warning names both hostnames and the machine-id."""
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here (needs root): {probe.stderr.decode().strip()}")
    caplog.set_level(logging.WARNING, logger="gpuagent.collector")
    mid = read_machine_id()
    with start_collector(tmp_path / "c.duckdb", analyze=False) as h:
        address = f"127.0.0.1:{h.port}"
        states = {host: tmp_path / host for host in ("clone-x", "clone-y")}
        procs = {host: _agent_in_uts(tmp_path, address, states[host], host, f"{host}.log") for host in states}
        try:
            for host, state in states.items():
                wait_for(lambda s=state: (read_status(s) or {}).get("collector", {}).get("acked_batches", 0) >= 3,
                         timeout=60, what=f"{host} streaming")
                assert read_status(state)["node"] == {**read_status(state)["node"], "hostname": host,
                                                      "node_id": host, "machine_id": mid}
        finally:
            rcs = [stop(p) for p in procs.values()]
        assert rcs == [0, 0]
        for host, state in states.items():
            st = read_status(state)
            taken = st["counters"]["samples"] - st["spool"]["backlog_samples"]
            assert st["spool"]["dropped_samples"] == 0
            assert _stored_samples(h, host) == taken > 0, host
        assert db_rows(h, "SELECT count(*) FROM nodes WHERE machine_id = ?", [mid])[0][0] == 2
        expected = identity.shared_machine_id_sentence(mid, ("clone-x", "clone-x"), ("clone-y", "clone-y"))
        assert [r.getMessage() for r in caplog.records if "machine-id" in r.getMessage()] == [expected]
        assert expected.startswith(f"hosts clone-x and clone-y both present machine-id {mid} ")


def test_a_batch_missing_below_the_collectors_highest_seq_is_still_delivered(tmp_path):
    """The collector holds seqs 1..20 of a node except 7 (its store failed while later batches committed).
    Register reports 20 as the highest stored seq; the agent must not take that as "everything up to 20 is
    stored" and drop 7 from its spool: it sends its whole spool and the collector's exact per-seq dedupe
    acks the 19 it already has as duplicates and stores 7."""
    with start_collector(tmp_path / "c.duckdb", analyze=False) as h:
        address = f"127.0.0.1:{h.port}"
        info = node_info("gap-host", "m-gap")
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.CollectorStub(ch)
            nid = stub.Register(pb.RegisterRequest(node=info)).node_id
            sent = []
            for seq in range(1, N_BATCHES + 1):
                if seq != 7:
                    b = host_batch(seq, 0.0)
                    b.node_id = nid
                    sent.append(b)
            assert [a.seq for a in stub.Stream(iter(sent))] == [b.seq for b in sent]
            assert stub.Register(pb.RegisterRequest(node=info)).last_committed_seq == N_BATCHES
        s = sender_for(address, filled_spool(tmp_path / "spool", 0.0), info)
        s.start()
        try:
            wait_for(lambda: s.spool.stats()["backlog_batches"] == 0, timeout=60, what="the spool delivered")
            snap = s.snapshot()
        finally:
            s.stop()
        assert snap["acked_batches"] == N_BATCHES and snap["duplicate_acks"] == N_BATCHES - 1, snap
        assert db_rows(h, "SELECT list(seq ORDER BY seq) FROM ingest_log WHERE node_id = ?",
                       [nid])[0][0] == list(range(1, N_BATCHES + 1))
        assert db_rows(h, "SELECT count(*), count(DISTINCT value) FROM samples WHERE node_id = ?",
                       [nid])[0] == (N_BATCHES * PER_BATCH, N_BATCHES * PER_BATCH)
