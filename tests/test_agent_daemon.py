"""The daemon as a real subprocess: sd_notify READY/WATCHDOG, status file, `gpuagent status`, SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agent_helpers import free_port, read_status, start_agent, stop, wait_running
from conftest import wait_for
from tools import need

from gpuagent.common.sdnotify import Notifier


def test_notifier_path_and_abstract_socket(tmp_path):
    for addr in (str(tmp_path / "notify.sock"), "@gpuagent-test-%d" % time.time_ns()):
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        srv.bind(addr if not addr.startswith("@") else "\0" + addr[1:])
        srv.settimeout(5)
        n = Notifier(env={"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "4000000"})
        assert n.enabled and n.watchdog_interval_s == 2.0
        assert n.ready("hello")
        assert srv.recv(1024) == b"READY=1\nSTATUS=hello"
        assert n.watchdog() and srv.recv(1024) == b"WATCHDOG=1"
        n.close()
        srv.close()
    off = Notifier(env={})
    assert not off.enabled and not off.ready() and off.watchdog_interval_s == 0


def test_daemon_notifies_ready_and_watchdog_and_exits_on_sigterm_within_5s(tmp_path):
    """Collector unreachable: the agent still samples, spools, notifies systemd, and stops fast."""
    sock_path = str(tmp_path / "notify.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(sock_path)
    srv.settimeout(0.5)
    state = tmp_path / "state"
    proc = start_agent(tmp_path, f"127.0.0.1:{free_port()}", state, interval=0.2, batch_interval=0.5,
                       NOTIFY_SOCKET=sock_path, WATCHDOG_USEC="1000000")
    try:
        got: list[bytes] = []

        def seen(what):
            try:
                got.append(srv.recv(4096))
            except socket.timeout:
                pass
            return any(what in m for m in got)
        wait_for(lambda: seen(b"READY=1"), timeout=30, what="READY=1")
        wait_for(lambda: sum(m == b"WATCHDOG=1" for m in got) >= 2 or seen(b"\0"), timeout=10,
                 what="two WATCHDOG=1 pings")
        st = wait_running(state, proc)
        assert st["torch_loaded"] is False
        assert st["collector"]["connected"] is False
        wait_for(lambda: (read_status(state) or {}).get("spool", {}).get("backlog_batches", 0) >= 2,
                 timeout=20, what="batches spooled while the collector is down")
        t0 = time.monotonic()
        rc = stop(proc, signal.SIGTERM, timeout=10)
        took = time.monotonic() - t0
        assert rc == 0, (tmp_path / "agent.log").read_text()
        assert took < 5.0, f"SIGTERM took {took:.2f}s"
        final = read_status(state)
        assert final["state"] == "stopped"
        assert any(m.startswith(b"STOPPING=1") for m in got) or wait_for(lambda: seen(b"STOPPING=1"), timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.close()


def _status_cli(*args):
    return subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", *args],
                          capture_output=True, text=True, timeout=60)


def test_status_cli_live_dead_and_missing(tmp_path):
    missing = _status_cli("--state-dir", str(tmp_path / "nothing"))
    assert missing.returncode == 1
    assert "gpuagent is not running: no status file" in missing.stderr
    assert "Traceback" not in missing.stderr

    state = tmp_path / "state"
    proc = start_agent(tmp_path, f"127.0.0.1:{free_port()}", state, interval=0.5)
    try:
        wait_running(state, proc)
        live = _status_cli("--state-dir", str(state))
        assert live.returncode == 0, live.stderr
        assert "collector" in live.stdout and "NOT connected" in live.stdout and "virt" in live.stdout
        js = _status_cli("--state-dir", str(state), "--json")
        import json
        data = json.loads(js.stdout)
        assert data["pid"] == proc.pid and data["spool"]["dropped_batches"] == 0
    finally:
        stop(proc, signal.SIGKILL)
    dead = _status_cli("--state-dir", str(state))
    assert dead.returncode == 1
    assert f"pid {proc.pid}" in dead.stderr and "is gone" in dead.stderr


def test_status_stale_is_reported(tmp_path):
    import json
    import os
    state = tmp_path / "state"
    state.mkdir()
    # A live pid (this test process) but an update from a minute ago: a hung daemon.
    (state / "status.json").write_text(json.dumps({"pid": os.getpid(), "interval_s": 1.0,
                                                  "updated_ns": time.time_ns() - 60_000_000_000}))
    res = _status_cli("--state-dir", str(state))
    import re
    m = re.search(r"is stale: .* last updated (\d+) s ago", res.stderr)
    assert res.returncode == 1 and m and int(m.group(1)) >= 60, res.stderr
    # A file that is not the agent's status (wrong --state-dir, or hand-edited): one sentence, no traceback.
    for junk in ("[]", '{"pid": 1}', '"text"'):
        (state / "status.json").write_text(junk)
        res = _status_cli("--state-dir", str(state))
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert res.stderr.strip().splitlines() == [
            f"Error: {state / 'status.json'} is not a gpuagent status file (no pid and updated_ns); is --state-dir right?"]


def test_status_virt_and_container_agree_with_system_tools(tmp_path):
    """`gpuagent status` names the hypervisor and the container runtime that systemd-detect-virt
    reports on this machine (a KVM guest running the suite in Docker here); virt-what lists both."""
    import json
    need("systemd-detect-virt")

    def detect(flag):
        r = subprocess.run(["systemd-detect-virt", flag], capture_output=True, text=True, timeout=30)
        return r.stdout.strip() or "none"
    vm, container = detect("--vm"), detect("--container")
    state = tmp_path / "state"
    proc = start_agent(tmp_path, f"127.0.0.1:{free_port()}", state, interval=0.5)
    try:
        wait_running(state, proc)
        text = _status_cli("--state-dir", str(state)).stdout
        data = json.loads(_status_cli("--state-dir", str(state), "--json").stdout)
    finally:
        stop(proc)
    fp = data["fingerprint"]
    assert fp["virt_type"] == vm
    assert (fp.get("container_runtime") or "none") == container
    virt_line = next(line for line in text.splitlines() if line.startswith("virt "))
    assert virt_line.split()[1] == vm and f"container: {container if container != 'none' else 'none'}" in virt_line
    need("virt-what")
    what = subprocess.run(["virt-what"], capture_output=True, text=True, timeout=30).stdout.split()
    if vm != "none":
        assert vm in what
    if container != "none":
        assert container in what


def test_second_agent_on_the_same_state_dir_refuses_and_the_first_keeps_going(tmp_path):
    """Two agents on one state dir would allocate the same seqs (the collector then drops one batch of each
    pair as a resend): the second exits at once with one sentence naming the first; the first is untouched."""
    state = tmp_path / "state"
    collector = f"127.0.0.1:{free_port()}"
    first = start_agent(tmp_path, collector, state, interval=0.2, batch_interval=0.5)
    try:
        wait_running(state, first)
        second = start_agent(tmp_path, collector, state, interval=0.2, log_name="second.log")
        assert second.wait(timeout=60) == 1
        lines = (tmp_path / "second.log").read_text().strip().splitlines()
        assert lines[-1] == (f"Error: another gpuagent (pid {first.pid}) already runs with state dir {state}; "
                             "stop it first or give this one another --state-dir.")
        assert "Traceback" not in "\n".join(lines)
        ticks = read_status(state)["counters"]["ticks"]
        wait_for(lambda: (read_status(state) or {}).get("counters", {}).get("ticks", 0) > ticks + 2,
                 timeout=30, what="the first agent still ticking")
        assert read_status(state)["pid"] == first.pid
    finally:
        assert stop(first) == 0
    # Once the first has stopped, the state dir is free again.
    again = start_agent(tmp_path, collector, state, interval=0.2, log_name="again.log")
    try:
        wait_running(state, again)
    finally:
        assert stop(again) == 0


def test_state_dir_that_is_a_file_or_read_only_is_one_sentence(tmp_path):
    (tmp_path / "afile").write_text("")
    for state, words in ((tmp_path / "afile", "is not a directory"),
                         (Path("/proc/gpuagent-state"), "cannot be used"),      # /proc: no new entries, even for root
                         (Path("/sys/fs/gpuagent-state"), "not writable")):
        proc = start_agent(tmp_path, f"127.0.0.1:{free_port()}", state, log_name="bad.log")
        assert proc.wait(timeout=60) == 1
        out = (tmp_path / "bad.log").read_text().strip().splitlines()
        assert out[-1].startswith(f"Error: state dir {state} ") and words in out[-1], out
        assert "Traceback" not in "\n".join(out)
        (tmp_path / "bad.log").unlink()
