"""Path probes, the agent's end of the cheap fabric layer (agent/probing/paths.py over common/path_probe.py).

Real UDP on 127.0.0.1: echo responders, a prober and its thread, kernel arrival timestamps. Run with -s to
see the PATH-PROBE line (loopback rtt and train rate).
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from conftest import worker_ports
from fabric_helpers import Results as Sink
from gpuagent.agent.config import ConfigError, load_config
from gpuagent.agent.probing.fabric import FabricClient
from gpuagent.agent.probing.paths import PathError, PathProber, PathResponder
from gpuagent.common import path_probe as pp
from gpuagent.proto import pb

FAST = pp.PathSettings(pings=3, train_packets=16, timeout_s=0.5, confirm=2)   # generous: a loaded CI box
DEAD = pp.PathSettings(pings=2, train_packets=16, timeout_s=0.05, confirm=2)    # a dead path waits out each timeout


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _dead_port() -> int:
    """A UDP port on loopback with nothing listening (bound once, then closed)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def parts():
    made = []

    def responder(**kw):
        r = PathResponder("127.0.0.1", **kw).start()
        made.append(r)
        return r

    def prober(sink, me="me", **kw):
        p = PathProber(lambda: me, sink, address="127.0.0.1", **kw)
        made.append(p)
        return p

    yield responder, prober
    for x in made:
        x.stop()
    for x in made:
        assert not x.running


def test_two_responders_give_ok_verdicts_with_rtt_and_train_rate(parts):
    responder, prober = parts
    a, b = responder(), responder()
    sink = Sink()
    p = prober(sink, nic_env=lambda r: r.env.update(nic="lo"), responder=a).start()
    t0 = time.time_ns()
    p.set_pinglist(5, [("node-a", "127.0.0.1", a.port), ("node-b", "127.0.0.1", b.port)], FAST, t0 + 800_000_000)
    assert _wait(lambda: sink.summaries(), 5.0)
    assert len(sink.rows) == 1           # no suspect: only the summary
    rec = sink.rows[0]
    m = rec["metrics"]
    assert rec["probe"] == pp.PROBE and rec["status"] == "ok", rec
    assert rec["params"] == {"epoch": "5", "role": "summary", "link_params": FAST_KEY}
    assert rec["env"] == {"nic": "lo", "scheduler": "fabric"}
    assert t0 <= rec["started_ns"] < rec["ended_ns"] <= t0 + 800_000_000
    assert rec["ended_ns"] - rec["started_ns"] >= 700_000_000    # reported at the epoch's end, not before
    assert m["paths"] == 2 and m["paths_suspect"] == 0 and m["probes"] == 2
    assert m["datagrams_sent"] == 2 * FAST.datagrams() and m["datagrams_lost"] == 0 and m["loss_ratio"] == 0
    assert 0 < m["rtt_p50_us"] <= m["rtt_p99_us"] < 100_000
    assert m["train_gbits_per_s"] > 0.01
    # each responder echoed exactly one probe; the arrival times were the kernel's
    assert a.echoed == b.echoed == FAST.datagrams() and a.dropped == b.dropped == 0
    st = p.status()
    assert st["kernel_timestamps"] == 2 * FAST.datagrams() and "user_timestamps" not in st
    assert (st["epoch"], st["peers"], st["paths_probed"], st["datagrams_lost"]) == (None, 0, 2, 0)
    assert st["responder_port"] == a.port and st["last_summary"]["epoch"] == 5
    print(f"\nPATH-PROBE loopback: rtt p50 {m['rtt_p50_us']:.0f} us, p99 {m['rtt_p99_us']:.0f} us, "
          f"train {m['train_gbits_per_s']:.2f} Gbit/s ({FAST.train_packets} x {FAST.train_bytes} B)")


def _key(s):
    return ",".join(f"{k}={v}" for k, v in sorted(s.as_params().items()))


FAST_KEY = _key(FAST)


def test_a_dead_peer_is_confirmed_as_a_loss_suspect_in_link_results_shape(parts):
    responder, prober = parts
    good = responder()
    sink = Sink()
    p = prober(sink, me="n-me")
    dead = _dead_port()
    v = p.judge("n-dead", "127.0.0.1", dead, DEAD)
    assert v.loss_ratio == 1.0 and v.probes == 1 + DEAD.confirm and "loss" in v.suspect.split(",")
    assert v.rtt_p50_us is None and v.train_gbits is None
    # the same through the thread: one suspect result (node_a/node_b/pair_id) and the summary after it
    p.start()
    p.set_pinglist(9, [("n-good", "127.0.0.1", good.port), ("n-dead", "127.0.0.1", dead)], DEAD,
                   time.time_ns() + 1_200_000_000)
    assert _wait(lambda: sink.summaries(), 5.0)
    assert [r["params"]["role"] for r in sink.rows] == ["suspect", "summary"]
    sus, summ = sink.rows
    assert sus["params"] == {"epoch": "9", "role": "suspect", "node_a": "n-me", "node_b": "n-dead",
                             "pair_id": "path-9-n-me-n-dead", "link_params": _key(DEAD)}
    assert sus["status"] == "ok" and "loss" in sus["env"]["suspect"].split(",")
    assert sus["metrics"]["loss_ratio"] == 1.0 and sus["metrics"]["probes"] == 1 + DEAD.confirm
    assert summ["metrics"]["paths"] == 2 and summ["metrics"]["paths_suspect"] == 1
    assert summ["metrics"]["datagrams_lost"] == (1 + DEAD.confirm) * DEAD.datagrams()
    assert sus["started_ns"] < sus["ended_ns"] and summ["started_ns"] <= sus["started_ns"]
    assert p.status()["suspects"] == 2      # the direct judge and the thread's


class BlackoutEcho:
    """A UDP echo that, once armed, drops every datagram for ``blackout_s`` from the first one it gets, then
    echoes again: a peer (or a sender) stalled for a moment, as a burst of CPU load stalls one."""

    def __init__(self, blackout_s: float):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.blackout_s, self.armed, self.until = blackout_s, False, 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def arm(self):
        self.armed = True

    def _loop(self):
        while not self.stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65535)
            except socket.timeout:
                continue
            now = time.monotonic()
            if self.armed:
                self.armed, self.until = False, now + self.blackout_s
            if now >= self.until:
                self.sock.sendto(data, addr)

    def close(self):
        self.stop.set()
        self.thread.join(2)
        self.sock.close()


def test_confirmations_spread_in_time_clear_a_stall_that_back_to_back_ones_confirm(parts):
    """A stall of 0.2 s that starts with a path's first probe: confirmations right after it (the old rule) fall
    in the stall too and make a false loss suspect; the prober's thread spaces them ``gap_s`` apart (here
    the epoch's quarter over three readings, 0.27 s) between its other paths, and they clear the path."""
    responder, prober = parts
    good = [responder() for _ in range(3)]
    stall = BlackoutEcho(0.2)
    try:
        sink = Sink()
        p = prober(sink)
        stall.arm()
        v = p.judge("n-stall", "127.0.0.1", stall.port, DEAD)          # back to back
        assert "loss" in v.suspect.split(",") and v.probes == 1 + DEAD.confirm, v
        time.sleep(0.3)
        stall.arm()
        p.start()
        epoch_s = 3.2
        gap_s = DEAD.gap_s(epoch_s)
        assert gap_s == pytest.approx(epoch_s / 12) and gap_s > stall.blackout_s
        peers = [("n-stall", "127.0.0.1", stall.port)] + [(f"n{i}", "127.0.0.1", r.port) for i, r in enumerate(good)]
        t0 = time.time_ns()
        p.set_pinglist(3, peers, DEAD, t0 + int(epoch_s * 1e9))
        assert _wait(lambda: sink.summaries(), epoch_s + 3)
        (summ,) = sink.summaries()
        m = summ["metrics"]
        assert [r["params"]["role"] for r in sink.rows] == ["summary"], sink.rows
        assert m["paths"] == 4 and m["paths_suspect"] == 0
        # the stalled path's first reading was odd, and confirmed; on a loaded machine a healthy path can read
        # odd too (a 50 ms timeout) and is confirmed and cleared the same way: whole confirmations only
        extra = m["probes"] - 4
        assert extra >= DEAD.confirm and extra % DEAD.confirm == 0, m
        assert m["datagrams_lost"] >= DEAD.datagrams(), m   # the stalled path's first reading lost them all
        assert summ["ended_ns"] <= t0 + int(epoch_s * 1e9) + 50_000_000
    finally:
        stall.close()


def test_a_datagram_without_magic_is_dropped_and_the_responder_keeps_echoing(parts):
    responder, _ = parts
    r = responder()
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.settimeout(0.3)
    try:
        c.sendto(b"hello, not a probe", ("127.0.0.1", r.port))
        with pytest.raises(socket.timeout):
            c.recvfrom(2048)
        assert _wait(lambda: r.dropped == 1) and r.echoed == 0
        probe = pp.MAGIC + b"\x01" + bytes(40)
        c.sendto(probe, ("127.0.0.1", r.port))
        data, addr = c.recvfrom(2048)
        assert data == probe and addr == ("127.0.0.1", r.port)
        assert _wait(lambda: r.echoed == 1) and r.dropped == 1 and r.running
    finally:
        c.close()


def test_responder_port_is_the_configured_one_else_in_the_range_else_free(parts):
    responder, _ = parts
    lo, hi = worker_ports(4, 20)
    in_range = responder(port_range=(lo, hi))
    assert lo <= in_range.port <= hi
    second = responder(port_range=(lo, hi))          # the first is taken: the next free one
    assert lo <= second.port <= hi and second.port != in_range.port
    fixed = responder(port=hi, port_range=(lo, hi))
    assert fixed.port == hi
    with pytest.raises(PathError, match=f"cannot bind UDP 127.0.0.1:{hi}"):
        PathResponder("127.0.0.1", port=hi)
    assert responder().port > 0


def test_bad_path_settings_give_one_sentence():
    for params, word in [({"pings": "many"}, "pings"), ({"timeout_s": "0"}, "timeout_s"),
                         ({"train_packets": "1"}, "train_packets"), ({"pings": "inf"}, "pings")]:
        got = pp.PathSettings.from_params(params)
        assert isinstance(got, str) and word in got and got.count(". ") == 0 and "\n" not in got, got
    assert pp.PathSettings.from_params({"pings": "5", "timeout_s": "0.2"}) == pp.PathSettings(pings=5, timeout_s=0.2)


def _reading(train=1.0, rtt=50.0, lost=0):
    return pp.ProbeReading(rtts_us=[rtt, rtt], sent=10, lost=lost, train_gbits=train)


def test_verdict_needs_a_confirmation_to_name_a_suspect():
    s = pp.PathSettings()
    slow = [_reading(train=0.1), _reading(train=0.2), _reading(train=0.15)]
    assert pp.reading_is_odd(slow[0], 50.0, 1.0, s)
    assert pp.verdict("p", slow, 50.0, 1.0, s).suspect == "slow"
    # a single odd reading, not confirmed, is not a suspect
    assert pp.verdict("p", slow[:1], 50.0, 1.0, s).suspect == ""
    assert pp.verdict("p", [_reading(lost=10, train=None)], None, None, s).suspect == ""
    # confirmations that say it was a busy moment clear it: the best train is not slow
    assert pp.verdict("p", [slow[0], _reading(train=0.9)], 50.0, 1.0, s).suspect == ""
    # late and lost
    late = [_reading(rtt=900.0), _reading(rtt=800.0)]
    assert pp.verdict("p", late, 50.0, 1.0, s).suspect == "late"
    lossy = [_reading(lost=1), _reading(lost=2)]
    assert pp.verdict("p", lossy, 50.0, 1.0, s).suspect == "loss"
    assert pp.verdict("p", [_reading(lost=1), _reading()], 50.0, 1.0, s).suspect == ""


def _pinglist(epoch, members, addresses, params=None, end_s=30.0):
    return pb.Assignment(kind="pinglist", probe=pp.PROBE, members=members, peer_addresses=addresses, epoch=epoch,
                         deadline_ns=time.time_ns() + int(end_s * 1e9), params=params or FAST.as_params())


def test_a_pinglist_assignment_reaches_the_prober_through_the_fabric_client(parts):
    responder, prober = parts
    r = responder()
    sink = Sink()
    p = prober(sink, me="n0")
    ch = grpc.insecure_channel("127.0.0.1:1")      # never used: the client's stream thread is not started
    client = FabricClient(ch, lambda: "n0", "127.0.0.1", sink)
    client.paths = p
    try:
        client._handle("n0", _pinglist(7, ["n1", "n2", "n3"], [f"127.0.0.1:{r.port}", "127.0.0.1:0", "nonsense"]))
        st = p.status()
        assert (st["epoch"], st["peers"], st["pinglists"], st["bad_peer_addresses"]) == (7, 1, 1, 2)
        # bad settings: one sentence, counted, and the last pinglist stays
        bad = _pinglist(8, ["n1"], [f"127.0.0.1:{r.port}"], params={"pings": "0"})
        assert "pings must be 1-100" in p.take_pinglist(bad)
        client._handle("n0", bad)
        client._handle("n0", _pinglist(8, ["n1", "n2"], [f"127.0.0.1:{r.port}"]))    # addresses missing
        st = p.status()
        assert (st["epoch"], st["peers"], st["bad_pinglists"]) == (7, 1, 3)
        assert client.fabric_status().paths["epoch"] == 7 and client.counts == {}
        # the thread probes the pinglist that came through the client, and stops with it
        client._handle("n0", _pinglist(10, ["n1"], [f"127.0.0.1:{r.port}"], end_s=0.5))
        p.start()
        assert _wait(lambda: [s for s in sink.summaries() if s["params"]["epoch"] == "10"], 5.0)
        # epoch 7 was replaced before it was probed: a skipped summary saying so
        e7 = [s for s in sink.summaries() if s["params"]["epoch"] == "7"]
        assert len(e7) == 1 and e7[0]["status"] == "skipped" and "replaced" in e7[0]["reason"]
        assert r.echoed == FAST.datagrams()
    finally:
        client.stop()
        ch.close()
    assert not p.running


def test_an_empty_pinglist_gives_a_skipped_summary(parts):
    _, prober = parts
    sink = Sink()
    p = prober(sink).start()
    p.set_pinglist(3, [], FAST, time.time_ns() + 200_000_000)
    assert _wait(lambda: sink.summaries(), 3.0)
    (rec,) = sink.rows
    assert rec["status"] == "skipped" and "names no peer" in rec["reason"] and rec["params"]["epoch"] == "3"


def test_fabric_config_keys_for_path_probes(tmp_path):
    p = tmp_path / "agent.toml"
    p.write_text('[fabric]\nenabled = true\naddress = "127.0.0.1"\n')
    cfg = load_config(str(p), env={})
    assert cfg.fabric.paths is True and cfg.fabric.path_port == 0
    p.write_text('[fabric]\nenabled = true\naddress = "127.0.0.1"\npaths = false\npath_port = 42999\n')
    cfg = load_config(str(p), env={})
    assert cfg.fabric.paths is False and cfg.fabric.path_port == 42999
    for text, words in [('paths = "maybe"', "fabric.paths"), ("path_port = 70000", "fabric.path_port"),
                        ("path_port = 1.5", "whole UDP port")]:
        p.write_text(f'[fabric]\nenabled = true\naddress = "127.0.0.1"\n{text}\n')
        with pytest.raises(ConfigError, match=words) as exc:
            load_config(str(p), env={})
        assert "\n" not in str(exc.value)


def test_the_daemon_binds_the_responder_before_register_and_the_fabric_client_starts_the_prober(tmp_path):
    from gpuagent.agent.daemon import Agent, build_node_info
    from gpuagent.agent.probing.fabric import start_fabric_client

    lo, hi = worker_ports(4, 20)
    p = tmp_path / "agent.toml"
    p.write_text(f'[probes]\nenabled = false\n[fabric]\nenabled = true\naddress = "127.0.0.1"\n'
                 f'port_lo = {lo}\nport_hi = {hi}\n')
    cfg = load_config(str(p), env={}, state_dir=str(tmp_path / "state"), collector="127.0.0.1:9")
    agent = Agent(cfg, samplers=[], node_info=build_node_info(cfg, []))
    client = None
    try:
        r = agent.path_responder
        # what Register will carry: the port the responder holds, from this node's range
        assert r is not None and agent.node_info.path_port == r.port and lo <= r.port <= hi
        r.start()
        client = start_fabric_client(agent)
        assert isinstance(client.paths, PathProber) and client.paths.running and client.paths.responder is r
        assert client.fabric_status().paths["responder_port"] == r.port
    finally:
        if client is not None:
            client.stop()
        agent.shutdown()
    assert not client.paths.running and not r.running

    p.write_text('[probes]\nenabled = false\n[fabric]\nenabled = true\naddress = "127.0.0.1"\npaths = false\n')
    cfg = load_config(str(p), env={}, state_dir=str(tmp_path / "state2"), collector="127.0.0.1:9")
    agent = Agent(cfg, samplers=[], node_info=build_node_info(cfg, []))
    try:
        assert agent.path_responder is None and agent.node_info.path_port == 0
    finally:
        agent.shutdown()


def test_status_shows_the_path_probe_counters_and_reads_back(parts):
    import json

    from gpuagent.agent import snapshot as st
    from gpuagent.agent.surface.status import _render_fabric
    from gpuagent.common.typed_json import load_typed

    responder, prober = parts
    r = responder()
    p = prober(Sink(), responder=r)
    p.set_pinglist(4, [("n1", "127.0.0.1", r.port)], FAST, time.time_ns() + 10**9)
    p.judge("n1", "127.0.0.1", r.port, FAST)
    assert _wait(lambda: r.echoed == FAST.datagrams())   # the responder counts just after its last echo
    p.last_summary = {"epoch": 3, "status": "ok", "reason": "", "paths": 1.0, "rtt_p50_us": 21.0,
                      "train_gbits_per_s": 0.8, "loss_ratio": 0.0}
    fab = st.FabricStatus(address="127.0.0.1", stream_open=True, stream_error="", last_message_ns=1, counts={},
                          recent=[], paths=p.status())
    assert load_typed(st.FabricStatus, json.loads(json.dumps(st._dump(fab))), "fabric") == fab
    text = "\n".join(_render_fabric(fab, time.time_ns()))
    assert f"path probes: epoch 4, 1 peers; 1 paths probed, 0 suspects, datagrams {FAST.datagrams()} sent / 0 lost; " \
           f"responder port {r.port} ({FAST.datagrams()} echoed, 0 dropped)" in text
    assert "last epoch 3: ok  1 paths  rtt p50 21 us  train 0.80 Gbit/s  loss 0.0000" in text
    off = st.FabricStatus(address="a", stream_open=False, stream_error="", last_message_ns=0, counts={}, recent=[])
    assert "path probes" not in "\n".join(_render_fabric(off, time.time_ns()))
    assert load_typed(st.FabricStatus, json.loads(json.dumps(st._dump(off))), "fabric").paths is None
