"""net_pair over loopback: real sockets, real stream processes, both ends in one process or one in a
subprocess. The secret gate, deadlines and broken peers each end in a result with one sentence, never a
hang, and no stream process outlives its run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from gpuagent.probes import net_pair as NP

QUICK = NP.PairSettings(streams=2, duration_s=0.3, warmup_s=0.4, rtt_count=100)   # warmup: a loaded host starts senders late


def _stream_processes() -> dict[int, int]:
    """Live (not zombie) net_pair stream processes on this machine: pid -> parent pid."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if b"net_pair_stream.py" in cmd and state != "Z":
            out[int(pid)] = int(ppid)
    return out


def _serve_in_thread(listener: NP.NetPairListener) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(listener.serve()), daemon=True)
    t.start()
    return t, out


def test_pair_measures_both_ways_and_both_ends_agree():
    secret = NP.new_secret()
    lst = NP.NetPairListener(secret, "127.0.0.1", (0, 0), accept_timeout_s=10)
    assert lst.error is None and lst.port > 0
    t, out = _serve_in_thread(lst)
    res = NP.connect("127.0.0.1", lst.port, secret, QUICK)
    t.join(10)
    assert res.status == "ok", res.reason
    m = res.metrics
    assert set(m) == {"send_gbits_per_s", "recv_gbits_per_s", "rtt_p50_us", "rtt_p99_us", "rtt_min_us"}
    assert m["send_gbits_per_s"] > 0.01 and m["recv_gbits_per_s"] > 0.01
    assert 0 < m["rtt_min_us"] <= m["rtt_p50_us"] <= m["rtt_p99_us"]
    (lres,) = out
    assert lres.status == "ok" and lres.metrics == m
    assert lres.env["role"] == "listen" and res.env["role"] == "connect" and lres.env["refused_connections"] == 0
    for r in (res, lres):
        assert secret not in r.to_json() and "secret" not in r.params
        assert r.params["streams"] == 2 and r.params["duration_s"] == 0.3


def test_wrong_secret_and_strangers_are_refused_while_the_peer_still_gets_in():
    secret = NP.new_secret()
    lst = NP.NetPairListener(secret, "127.0.0.1", (0, 0), accept_timeout_s=10)
    t, out = _serve_in_thread(lst)
    bad = NP.connect("127.0.0.1", lst.port, "not-" + secret, QUICK)
    assert bad.status == "failed" and bad.reason == f"the listener at 127.0.0.1:{lst.port} refused this end's secret"
    with socket.create_connection(("127.0.0.1", lst.port), timeout=5) as s:   # not this protocol at all
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(1) == NP.REFUSED
        try:
            assert s.recv(16) == b"", "the listener closes a refused connection"
        except ConnectionResetError:
            pass          # closed with our unread bytes still queued: a reset, also a close
    good = NP.connect("127.0.0.1", lst.port, secret, QUICK)
    t.join(10)
    assert good.status == "ok", good.reason
    assert out[0].status == "ok" and out[0].env["refused_connections"] == 2
    # One-time: the listener is gone after its run.
    late = NP.connect("127.0.0.1", lst.port, secret, QUICK, connect_timeout_s=0.3)
    assert late.status == "skipped" and "no listener answered" in late.reason


def test_deadlines_give_skipped_with_a_reason_and_never_hang():
    t0 = time.monotonic()
    lst = NP.NetPairListener("s3cret", "127.0.0.1", (0, 0), accept_timeout_s=0.5)
    res = lst.serve()
    assert res.status == "skipped" and res.reason == "no peer connected with the pair's secret within 0.5 s"
    port = lst.port   # closed now
    res = NP.connect("127.0.0.1", port, "s3cret", QUICK, connect_timeout_s=0.5)
    assert res.status == "skipped" and res.reason == f"no listener answered at 127.0.0.1:{port} within 0.5 s"
    # A connection that never says anything holds the listener no longer than its handshake timeout.
    lst = NP.NetPairListener("s3cret", "127.0.0.1", (0, 0), accept_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", lst.port)):
        res = lst.serve()
    assert res.status == "skipped" and "1 connection(s) refused" in res.reason
    assert time.monotonic() - t0 < 6


def test_bad_input_is_one_sentence_and_nothing_runs():
    res = NP.connect("127.0.0.1", 9, "s", NP.PairSettings(streams=0))
    assert res.status == "failed" and res.reason == "streams must be between 1 and 64, got 0"
    res = NP.connect("127.0.0.1", 0, "s", QUICK)
    assert res.status == "failed" and res.reason == "port must be between 1 and 65535, got 0"
    assert NP.connect("127.0.0.1", 9, "", QUICK).reason == "the pair secret must be 1 to 256 bytes"
    lst = NP.NetPairListener("", "127.0.0.1")
    assert lst.serve().reason == "the pair secret must be 1 to 256 bytes"
    assert NP.NetPairListener("s", "127.0.0.1", (5, 0)).error.reason.startswith("port range 5-0 is not a range")
    # The listener checks what the peer asks for, too.
    lst = NP.NetPairListener("s", "127.0.0.1", accept_timeout_s=5)
    t, out = _serve_in_thread(lst)
    ctrl = NP._dial("127.0.0.1", lst.port, NP.KIND_CONTROL, b"s", time.monotonic() + 5, 5, retry_refused=True)
    NP.send_msg(ctrl, {"op": "settings", "streams": 1000})
    assert NP.recv_msg(ctrl) == {"op": "error", "reason": "streams must be between 1 and 64, got 1000"}
    ctrl.close()
    t.join(5)
    assert out[0].status == "failed" and out[0].reason.startswith("the peer asked for unusable settings")


def test_a_busy_port_range_and_the_range_itself():
    first = NP.NetPairListener("s", "127.0.0.1", (0, 0))
    port = first.port
    try:
        busy = NP.NetPairListener("s", "127.0.0.1", (port, port))
        assert busy.error is not None and busy.error.reason.startswith(f"no free port in {port}-{port}")
    finally:
        first.close()
    lo = port
    picked = NP.NetPairListener("s", "127.0.0.1", (lo, lo + 20))
    assert lo <= picked.port <= lo + 20 or picked.error is not None
    picked.close()


def test_a_peer_killed_mid_run_fails_the_other_end_within_its_timeouts():
    secret = NP.new_secret()
    lst = NP.NetPairListener(secret, "127.0.0.1", accept_timeout_s=10, io_timeout_s=3)
    t, out = _serve_in_thread(lst)
    env = {**os.environ, NP.SECRET_ENV: secret}
    peer = subprocess.Popen([sys.executable, "-m", "gpuagent.probes.net_pair", "connect", "127.0.0.1", str(lst.port),
                             "--duration", "30", "--rtt-count", "10"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Its 30 s send phase runs 4 senders in the peer and 4 receivers here: wait until all 8 are up.
    deadline, ours = time.monotonic() + 20, set()
    while len(ours) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
        ours = {pid for pid, ppid in _stream_processes().items() if ppid in (peer.pid, os.getpid())}
    assert len(ours) == 8, f"{len(ours)} stream processes, not 8, in the send phase"
    time.sleep(0.5)          # data flowing
    peer.send_signal(signal.SIGKILL)
    peer.wait()
    t.join(15)
    assert not t.is_alive(), "the listener hung after its peer died"
    assert out[0].status == "failed" and "stream broke" in out[0].reason
    # The dead peer's senders notice their parent is gone; the listener's receivers ended with the run.
    deadline = time.monotonic() + 5
    while ours & set(_stream_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not ours & set(_stream_processes())


def test_cli_needs_a_secret_and_prints_json():
    env = {k: v for k, v in os.environ.items() if k != NP.SECRET_ENV}
    out = subprocess.run([sys.executable, "-m", "gpuagent.probes.net_pair", "connect", "127.0.0.1", "9"],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 2 and "give the pair's secret" in out.stderr
    out = subprocess.run([sys.executable, "-m", "gpuagent.probes.net_pair", "listen", "--bind", "127.0.0.1",
                          "--accept-timeout", "0.2", "--secret", "x"], capture_output=True, text=True, timeout=30)
    first, last = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert first["listening"]["port"] > 0 and last["status"] == "skipped" and last["probe"] == "net_pair"


def test_a_peer_that_gives_up_before_go_leaves_no_stream_processes_here():
    """The listener's senders wait for 'go'; a peer that leaves first must not strand them."""
    settings = NP.PairSettings(streams=2, duration_s=0.3, warmup_s=0.1, rtt_count=10)
    lst = NP.NetPairListener("s3cret", "127.0.0.1", io_timeout_s=2.0, accept_timeout_s=5)
    t, out = _serve_in_thread(lst)
    ctrl = NP._dial("127.0.0.1", lst.port, NP.KIND_CONTROL, b"s3cret", time.monotonic() + 5, 2.0, True)
    NP.send_msg(ctrl, {"op": "settings", **NP.asdict(settings)})
    NP.expect(ctrl, "ready")
    NP.send_msg(ctrl, {"op": "recv"})
    socks = NP._open_streams("127.0.0.1", lst.port, NP.KIND_RECV, b"s3cret", 2, 2.0)
    deadline = time.monotonic() + 10
    while len([p for p, pp in _stream_processes().items() if pp == os.getpid()]) < 2:
        assert time.monotonic() < deadline, "the listener never started its 2 senders"
        time.sleep(0.05)
    ctrl.close()          # gone before 'go'
    for s in socks:
        s.close()
    t.join(10)
    assert out[0].status == "failed" and out[0].reason == "the peer closed the connection"
    assert not [p for p, pp in _stream_processes().items() if pp == os.getpid()]


def test_a_dead_stream_process_fails_both_ends_at_once_with_its_reason():
    settings = NP.PairSettings(streams=2, duration_s=8, warmup_s=0.1, rtt_count=10, chunk_kib=64)
    lst = NP.NetPairListener("s3cret", "127.0.0.1", io_timeout_s=5.0, accept_timeout_s=5)
    t, out = _serve_in_thread(lst)
    res: list = []
    c = threading.Thread(target=lambda: res.append(NP.connect("127.0.0.1", lst.port, "s3cret", settings,
                                                              io_timeout_s=5.0)), daemon=True)
    c.start()
    deadline, senders = time.monotonic() + 15, []
    while len(senders) < 2:
        assert time.monotonic() < deadline, "the connecting end never started its 2 senders"
        time.sleep(0.1)
        senders = [p for p, pp in _stream_processes().items()
                   if pp == os.getpid() and b" send " in open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ")]
    time.sleep(0.5)
    os.kill(senders[0], signal.SIGKILL)     # as the OOM killer would
    t0 = time.monotonic()
    t.join(15)
    c.join(15)
    assert time.monotonic() - t0 < 4.0, "an end waited out its I/O timeout instead of failing at once"
    assert out[0].status == "failed"
    assert out[0].reason == "a receiving stream broke: the peer closed a data stream before the end"
    assert res[0].status == "failed"
    assert not [p for p, pp in _stream_processes().items() if pp == os.getpid()]
