"""SYNTHETIC fabric results for ``gpuagent-sim --fabric-sweeps N``: net_pair runs between simulated nodes.

The pairs come from the planner the collector uses (``gpuagent.common.pair_planner``: a round-robin tournament
per value of ``scope_key``, a node label, as the coordinator plans them with [fabric] scope_key; default the
pool), ``sweeps`` full sweeps spread over the simulated span, rounds ``round_s`` apart. Each run is
reported by both of its ends as a ``net_pair`` probe result with ``node_a``/``node_b``/``pair_id``/``link_params``
params, exactly what agents send; the collector turns them into link_results rows.

A link's rate is ``gbits`` x the lowest of: its ends' ``inject["net_factor"]`` (a bad node: NIC, cable,
port), and the link's own factor (a bad path between two nodes, ``NodeSpec.extra_labels["inject_net_links"]``
= "peer-host:factor,..."), times 1 + N(0, ``cv``) per direction and run. Both ends draw the same numbers
(the generator is seeded by the pair id), so their two reports agree as real ones do.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Mapping, Sequence

from gpuagent.common import pair_planner as planner
from gpuagent.common.parse import settings_key
from gpuagent.proto import pb
from gpuagent.sim.fleet import NodeSpec, ScenarioError

NS = 1_000_000_000
LINK_LABEL = "inject_net_links"
LINK_PARAMS = {"streams": "4", "duration_s": "2.0", "warmup_s": "0.3", "rtt_count": "200"}


def link_factors(fleet: Sequence[NodeSpec]) -> dict[frozenset, float]:
    """{frozenset({host_a, host_b}): factor} from the nodes' ``inject_net_links`` labels."""
    hosts = {n.hostname for n in fleet}
    out: dict[frozenset, float] = {}
    for n in fleet:
        text = str(n.extra_labels.get(LINK_LABEL, "")).strip()
        for item in filter(None, (s.strip() for s in text.split(","))):
            peer, _, value = item.rpartition(":")
            try:
                factor = float(value)
            except ValueError:
                factor = -1.0
            if peer not in hosts or peer == n.hostname or not 0 < factor <= 1:
                raise ScenarioError(f"node {n.hostname}: {LINK_LABEL} entry {item!r} must be "
                                    "'<another node's hostname>:<factor in (0, 1]>'")
            out[frozenset((n.hostname, peer))] = factor
    return out


@dataclass(frozen=True)
class FabricSim:
    """Which simulated node measures which, when, and at what rate."""
    sweeps: int = 3
    gbits: float = 25.0          # a healthy link's rate, each way (SYNTHETIC)
    rtt_us: float = 45.0
    cv: float = 0.03
    round_s: float = 4.0         # spacing of rounds (the coordinator's run plus answers)
    seed: int = 0
    scope_key: str = "pool"

    def schedule(self, fleet: Sequence[NodeSpec], start_ns: int, end_ns: int) -> dict[str, list[tuple]]:
        """{hostname: [(start_ns, pair_id, host_a, host_b), ...]} for every run each node takes part in."""
        labels = {n.hostname: n.labels() for n in fleet}
        span = end_ns - start_ns
        out: dict[str, list[tuple]] = {n.hostname: [] for n in fleet}
        for s in range(self.sweeps):
            plan = planner.plan_pairs(labels, self.scope_key, seed=f"{self.seed}/{s}")
            t0 = start_ns + s * span // self.sweeps
            step = min(int(self.round_s * NS), (span // self.sweeps) // max(1, len(plan.rounds)))
            for r, rnd in enumerate(plan.rounds):
                t = t0 + r * step
                for i, (a, b) in enumerate(rnd):
                    pid = f"sim{self.seed}-s{s}-r{r}-{i}"
                    out[a].append((t, pid, a, b))
                    out[b].append((t, pid, a, b))
        return out

    def run_result(self, pid: str, a: NodeSpec, b: NodeSpec, node_ids: Mapping[str, str],
                   links: Mapping[frozenset, float], t: int) -> pb.ProbeResult:
        rng = random.Random(zlib.crc32(f"{self.seed}/{pid}".encode()))
        factor = min(float(a.inject.get("net_factor", 1.0)), float(b.inject.get("net_factor", 1.0)),
                     links.get(frozenset((a.hostname, b.hostname)), 1.0))
        rate = self.gbits * factor
        rtt = self.rtt_us / max(factor, 0.2) ** 0.5   # a congested path queues: slower and later
        metrics = {"send_gbits_per_s": max(0.01, rate * (1 + rng.gauss(0, self.cv))),
                   "recv_gbits_per_s": max(0.01, rate * (1 + rng.gauss(0, self.cv))),
                   "rtt_p50_us": rtt * (1 + abs(rng.gauss(0, self.cv))),
                   "rtt_min_us": rtt * 0.8}
        metrics["rtt_p99_us"] = metrics["rtt_p50_us"] * 2.2
        link_params = settings_key(LINK_PARAMS)
        params = {**LINK_PARAMS, "node_a": node_ids[a.hostname], "node_b": node_ids[b.hostname],
                  "pair_id": pid, "link_params": link_params}
        dur = float(LINK_PARAMS["warmup_s"]) + 2 * float(LINK_PARAMS["duration_s"])
        return pb.ProbeResult(probe="net_pair", status="ok", params=params, metrics=metrics, started_ns=t,
                              ended_ns=t + int(dur * NS), gpu=-1,
                              env={"synthetic": "true", "generator": "gpuagent-sim"})


class NodeFabric:
    """One node's share of the schedule, cut into batch windows."""

    def __init__(self, sim: FabricSim, me: str, runs: list[tuple], by_host: Mapping[str, NodeSpec],
                 node_ids: Mapping[str, str], links: Mapping[frozenset, float]):
        self.sim, self.me, self.runs = sim, me, sorted(runs)
        self.by_host, self.node_ids, self.links = by_host, node_ids, links

    def results(self, t0: int, t1: int) -> list[pb.ProbeResult]:
        import bisect
        lo = bisect.bisect_left(self.runs, (t0,))
        hi = bisect.bisect_left(self.runs, (t1,))
        out = []
        for t, pid, a, b in self.runs[lo:hi]:
            res = self.sim.run_result(pid, self.by_host[a], self.by_host[b], self.node_ids, self.links, t)
            res.env["role"] = "connect" if a == self.me else "listen"
            out.append(res)
        return out
