"""The namespace testbed: real namespaces, veths, a bridge and tc shaping, measured with net_pair.
Needs root and ip netns (skips otherwise); every fleet is gone after each test, even a SIGKILLed owner's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import wait_for
from fabric_helpers import ROOT, load_netns_fleet, netns_fleet, run_net_pair  # noqa: F401

SCRIPT = str(ROOT / "scripts" / "netns_fleet.py")
QUICK = {"duration": 0.8, "warmup": 0.2, "rtt_count": 200, "streams": 4}


def _leftovers(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [n for n in names if n.startswith(prefix)]
    found += [line.split(":")[1].strip() for line in links.splitlines() if line.split(":")[1].strip().startswith(prefix)]
    if os.path.exists(f"/run/gpuagent-netns/{prefix}.json"):
        found.append("state file")
    return found


def _rates(res: dict) -> tuple[float, float]:
    assert res["status"] == "ok", res["reason"]
    return res["metrics"]["send_gbits_per_s"], res["metrics"]["recv_gbits_per_s"]


def test_nodes_have_own_identity_talk_tcp_and_leave_nothing(netns_fleet):
    fleet = netns_fleet(4)
    assert [n.ip for n in fleet.nodes.values()] == [f"10.203.0.{i}" for i in range(1, 5)]
    seen = {}
    for name in fleet.nodes:
        out = fleet.exec(name, ["sh", "-c", "hostname; cat /etc/machine-id"], check=True).stdout.split()
        seen[name] = out
        assert out[0] == fleet.node(name).hostname
    assert len({v[1] for v in seen.values()}) == 4, "each node has its own machine-id"
    # The bridge carries no address: nothing routes from the host into the testbed.
    addrs = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", f"{fleet.prefix}br"],
                           capture_output=True, text=True).stdout
    assert addrs.strip() == ""
    res = run_net_pair(fleet, "n0", "n3", duration=0.3, warmup=0.1, rtt_count=100, streams=2)
    send, recv = _rates(res)
    assert send > 0.05 and recv > 0.05
    assert res["listener"]["status"] == "ok" and res["listener"]["env"]["peer"] == "10.203.0.1"
    assert res["listener"]["metrics"] == res["metrics"]
    fleet.down()
    assert _leftovers(fleet.prefix) == []


def test_node_throttle_cuts_that_node_and_pair_throttle_only_that_pair(netns_fleet):
    nf = load_netns_fleet()
    fleet = netns_fleet(4)
    base = min(_rates(run_net_pair(fleet, "n0", "n1", **QUICK)))
    # The shaped rate is a sixteenth of what the veths carried unshaped. The upper bound is tbf's own: at
    # most the rate plus its burst, whatever the load. The lower bound (half of it) needs the sender on a
    # CPU for most of the window: a 0.8 s window on 2 loaded cores once saw 36 % (CI), so shaped rates are
    # measured over 2.5 s, where a few hundred ms off-CPU cannot halve the mean.
    slow = base / 16
    shaped = {**QUICK, "duration": 2.5}
    fleet.throttle_node("n1", f"{int(slow * 1000)}mbit")
    for rate in _rates(run_net_pair(fleet, "n0", "n1", **shaped)):
        assert 0.5 * slow < rate < 1.15 * slow, (rate, slow, base)
    fleet.unthrottle("n1")

    # A pair throttle between n2 and n3 slows that path only; n2 still talks to n0 at full speed.
    fleet.throttle_pair("n2", "n3", f"{int(slow * 1000)}mbit")
    for rate in _rates(run_net_pair(fleet, "n2", "n3", **shaped)):
        assert 0.5 * slow < rate < 1.15 * slow, (rate, slow, base)
    for rate in _rates(run_net_pair(fleet, "n2", "n0", **QUICK)):
        assert rate > 4 * slow, (rate, slow, base)
    # One kind of throttle per node, refused in one sentence.
    try:
        fleet.throttle_node("n2", "100mbit")
        raise AssertionError("a node throttle over pair throttles was accepted")
    except nf.FleetError as exc:
        assert "unthrottle it before" in str(exc)


def _owner_script(reaper: bool) -> str:
    return ("import sys, time; sys.path.insert(0, %r); import netns_fleet as nf; "
            "f = nf.Fleet.up(2, reaper=%r); print(f.prefix, flush=True); time.sleep(120)"
            % (str(ROOT / "scripts"), reaper))


def test_sigkilled_owner_is_cleaned_up_by_the_reaper(netns_fleet):
    del netns_fleet   # only for its skip; this fleet belongs to the subprocess
    owner = subprocess.Popen([sys.executable, "-c", _owner_script(True)], stdout=subprocess.PIPE, text=True)
    try:
        prefix = owner.stdout.readline().strip()
        assert prefix == f"gpa{owner.pid}-" and len(_leftovers(prefix)) >= 5
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    wait_for(lambda: _leftovers(prefix) == [], timeout=10, what=f"the reaper to remove {prefix}*")


def test_reap_removes_a_dead_owners_fleet_and_keeps_a_live_one(netns_fleet):
    live = netns_fleet(2)
    owner = subprocess.Popen([sys.executable, "-c", _owner_script(False)], stdout=subprocess.PIPE, text=True)
    prefix = owner.stdout.readline().strip()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _leftovers(prefix), "without a reaper the dead owner's fleet stays until reaped"
    out = subprocess.run([sys.executable, SCRIPT, "reap"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert prefix in json.loads(out.stdout)["reaped"] and live.prefix not in json.loads(out.stdout)["reaped"]
    assert _leftovers(prefix) == [] and _leftovers(live.prefix) != []


def test_cli_up_holds_until_sigterm_then_cleans_up(netns_fleet):
    del netns_fleet
    proc = subprocess.Popen([sys.executable, SCRIPT, "up", "2"], stdout=subprocess.PIPE, text=True)
    try:
        desc = json.loads(proc.stdout.readline())
        assert [n["name"] for n in desc["nodes"]] == ["n0", "n1"]
        out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True)
        assert "throttle-pair" in out.stdout
        bad = subprocess.run([sys.executable, SCRIPT, "throttle-node", "--owner", str(proc.pid), "n0", "fast"],
                             capture_output=True, text=True)
        assert bad.returncode == 1 and "is not a tc rate" in bad.stderr
        ok = subprocess.run([sys.executable, SCRIPT, "exec", "--owner", str(proc.pid), "n1", "--", "hostname"],
                            capture_output=True, text=True)
        assert ok.returncode == 0 and ok.stdout.strip() == f"{desc['prefix']}n1"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert _leftovers(desc["prefix"]) == []


@pytest.mark.timeout(300)
def test_demo_runs_collector_and_agents_prints_rounds_and_cleans_up_at_sigterm(netns_fleet, tmp_path):
    del netns_fleet   # only for its skip; the demo owns its fleet
    bad = subprocess.run([sys.executable, SCRIPT, "demo", "--agents", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.strip() == "netns_fleet: a demo has 2 to 249 agents, not 1"
    proc = subprocess.Popen([sys.executable, SCRIPT, "demo", "--agents", "2", "--interval-s", "1", "--dir",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        lines.append(proc.stdout.readline())
        assert lines[0].startswith("fabric demo: collector in n2"), lines
        prefix = f"gpa{proc.pid}-"
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert sorted(n for n in namespaces if n.startswith(prefix)) == [f"{prefix}n{i}" for i in range(3)]
        while not any(line.startswith("fabric round") for line in lines):   # one pair, planned every second
            line = proc.stdout.readline()
            assert line, f"the demo ended early: {''.join(lines)[-1500:]}"
            lines.append(line)
        assert f"{prefix}n0>{prefix}n1=ok" in lines[-1] or f"{prefix}n1>{prefix}n0=ok" in lines[-1], lines[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert rest.strip().endswith(f"fabric demo stopped; namespaces removed; files kept in {tmp_path}")
    assert _leftovers(prefix) == []
    assert (tmp_path / "collector.duckdb").exists() and (tmp_path / "token").stat().st_mode & 0o077 == 0
