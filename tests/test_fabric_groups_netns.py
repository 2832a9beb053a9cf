"""Collective groups on the namespace testbed (scripts/netns_fleet.py): 4 real agent daemons (the real pynvml
over the NVML emulator), each in its own network namespace, and a collector in a fifth that runs a pair sweep and then a round
with one ring of all 4 nodes. Every member runs the real collective probe (torch.distributed, gloo) across
the veth links, rendezvous at rank 0's namespace address."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from fabric_helpers import ROOT, load_netns_fleet, netns_fleet  # noqa: F401 - netns_fleet is a fixture

from tools import python_module_or_skip
python_module_or_skip("torch")
pytestmark = pytest.mark.slow

AGENTS = ("n0", "n1", "n2", "n3")
COLLECTOR = "n4"


@pytest.fixture
def bed(netns_fleet, tmp_path):
    """The fleet (torn down by netns_fleet, which skips where it cannot be built) with the processes on it."""
    nf = load_netns_fleet()
    fleet = netns_fleet(len(AGENTS) + 1)
    # The pair sweep before the group round would otherwise move as much as two cores can push through the
    # veths (tens of CPU-seconds that prove nothing here); shaped, a pair run moves a few MB, and the ring's
    # all-reduce (a few MB per rank) takes a second or two more.
    for name in AGENTS:
        fleet.throttle_node(name, "40mbit")
    procs = nf.FabricProcesses(fleet, tmp_path, AGENTS, COLLECTOR, token="groups-" + os.urandom(8).hex(),
                               collector_toml=nf.fabric_collector_toml(interval_s=1, group_size=4),
                               agent_cmd=[sys.executable, str(ROOT / "tests" / "fabric_agent.py")], cwd=str(ROOT))
    try:
        procs.start()
        yield fleet, procs
    finally:
        procs.stop()


def _sql(procs, query):
    out = procs.cli("sql", "--target", procs.addr, "--format", "json", query)
    assert out.returncode == 0, out.stderr[-500:]
    return json.loads(out.stdout)


def test_a_ring_of_four_namespaced_nodes_runs_a_gloo_all_reduce_across_the_veths(bed):
    fleet, procs = bed
    # Rounds start once two nodes are attached: wait for a group round that had all four in its ring.
    end = time.monotonic() + 240
    done = []
    while not any(line.count(",") == 3 for line in done):
        assert time.monotonic() < end, procs.col_log.read_text()[-3000:]
        assert procs.collector.poll() is None, procs.col_log.read_text()[-2000:]
        for name, p in procs.agents.items():
            assert p.poll() is None, (procs.workdir / f"{name}.log").read_text()[-1500:]
        done = [line.split(" done: ", 1)[1] for line in procs.col_log.read_text().splitlines()
                if "fabric group round" in line and " done: " in line]      # "a,b,c,d=ok ..." per line
        if any(line.count(",") == 3 and "=ok" not in line for line in done):
            # A ring of four that did not run: say why (the collector logs each outcome's status).
            raise AssertionError(done)
        time.sleep(1.0)
    ring = next(line for line in done if line.count(",") == 3)
    members = ring.split("=")[0].split(",")
    assert ring.endswith("=ok") and len(set(members)) == 4
    # The rows reach the collector with the agents' next batches (1 s interval).
    end = time.monotonic() + 30
    while True:
        rows = _sql(procs, "SELECT g.members, g.node_rank, g.reported_by, g.world_size, g.backend, g.status, "
                           "g.busbw_gbytes_per_s, json_extract_string(r.env, '$.master') AS master, "
                           "json_extract_string(r.env, '$.nic') AS nic "
                           "FROM group_results g JOIN probe_results r ON r.node_id = g.reported_by "
                           "AND r.probe = 'collective' AND r.started_at = g.started_at "
                           f"WHERE g.members = '{','.join(members)}' ORDER BY g.node_rank")
        if len(rows) == 4 or time.monotonic() > end:
            break
        time.sleep(1.0)
    assert [r["node_rank"] for r in rows] == [0, 1, 2, 3]
    assert [r["reported_by"] for r in rows] == members
    ids = {r["node_id"]: r["hostname"] for r in _sql(procs, "SELECT node_id, hostname FROM nodes")}
    host_to_ip = {n.hostname: n.ip for n in fleet.nodes.values()}
    rank0_ip = host_to_ip[ids[members[0]]]
    for r in rows:
        assert (r["status"], r["world_size"], r["backend"], r["nic"]) == ("ok", 4, "gloo", "eth0")
        assert r["busbw_gbytes_per_s"] == rows[0]["busbw_gbytes_per_s"] > 0
        # Every member met at rank 0's namespace address, on a port of the configured range.
        host, port = r["master"].rsplit(":", 1)
        assert host == rank0_ip and 42000 <= int(port) <= 42100
