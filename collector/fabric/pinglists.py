"""The collector's half of the cheap fabric layer: pinglists every epoch, and bandwidth runs where it matters.

Every ``path_epoch_s`` (aligned to the wall clock, so the epoch number is the same for every node and
survives a collector restart) each node that declared a fabric address and a path-probe port
(``NodeInfo.path_port``) and holds an ``Assignments`` stream gets a ``pinglist``: the peers it probes in
this epoch (common/path_planner.py: circulant per scope, every pair of the scope from each end once per
cycle, each node sending and answering the same number of planned probes), their echo responders, the probe settings and the
epoch's end. The agent reports a summary and its suspect paths in its batches (common/path_probe.py); the
servicer hands each suspect to :meth:`PathLayer.note_batch`, and the next epoch's pinglists add each suspect
path's probe from its other end (path_planner.with_rechecks), for the second report a link needs.

With ``[fabric] sweep = "targeted"`` the coordinator no longer sweeps every pair with net_pair: each round
(every ``targeted_interval_s``) runs the suspect paths first (the newest first, each node in at most one
pair), then each node the passive counters newly flag (an open hardware_fault flag on its Ethernet link or IB
port: errors, carrier changes, a port down or a link below its speed) with a healthy peer of its scope, then
a rolling share of the tournament, about ``rolling_runs_per_hour`` runs per node an hour, so
every pair still gets a bandwidth run in time; the agents' probe budget still refuses what does not fit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import time

from gpuagent.common import path_planner, path_probe
from gpuagent.common import pair_planner as planner
from gpuagent.proto import pb

log = logging.getLogger("gpuagent.collector.fabric")

MAX_SUSPECTS = 10_000      # pending suspect pairs kept for targeted runs (the newest win)
NS = 1_000_000_000


def _hostport(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


class PathLayer:
    def __init__(self, coordinator) -> None:
        self.co = coordinator
        c = coordinator.config
        self.plan = path_planner.PathPlanSettings(c.path_epoch_s, c.path_cover_s, c.path_max_probes_per_s, c.seed)
        self.settings = c.path_settings()
        self.params = {**self.settings.as_params(), "epoch_s": f"{c.path_epoch_s:g}"}
        self.ports: dict[str, int] = {}
        self.suspects: collections.OrderedDict[frozenset, tuple[str, str]] = collections.OrderedDict()
        self.rechecks: dict[tuple[str, str], None] = {}    # suspect paths (reporter, peer) since the last epoch
        self.rechecks_sent = 0
        self.epochs_sent = 0
        self.last_epoch: int | None = None
        self.last_counts: dict[str, int] = {}      # scope -> nodes in the last pinglist epoch
        self.runs: dict[str, collections.deque] = {}   # node -> its last bandwidth runs (start ns, end ns)
        self.dropped_overlap = 0
        self.counter_flagged: set[str] = set()         # nodes whose NIC/IB counters have an open flag now
        self.counter_pending: dict[str, None] = {}     # ... newly flagged, not yet given a bandwidth run
        self._rolling: list[planner.Pair] = []
        self._rolling_plan = 0
        self._counter_plans = 0
        self._task: asyncio.Task | None = None

    # -- nodes
    def register(self, node_id: str, path_port: int) -> None:
        if path_port:
            self.ports[node_id] = path_port
        else:
            self.ports.pop(node_id, None)

    def nodes(self) -> dict[str, dict[str, str]]:
        """Ready nodes (fabric address, Assignments stream) with a path-probe port: node -> labels."""
        return {n: labels for n, labels in self.co.ready_nodes().items() if n in self.ports}

    # -- pinglists
    def send_epoch(self, epoch: int | None = None) -> int:
        """Send every path node its pinglist for ``epoch`` (default: the current one); the nodes reached."""
        c = self.co.config
        if epoch is None:
            epoch = int(time.time() // c.path_epoch_s)
        nodes = self.nodes()
        if not nodes:
            return 0
        lists = path_planner.pinglists(nodes, c.scope_key, epoch, self.plan)
        self.rechecks_sent += path_planner.with_rechecks(lists, self.rechecks, self.plan.rechecks_per_node)
        self.rechecks = {}
        end_ns = int((epoch + 1) * c.path_epoch_s * NS)
        sent = 0
        for node, peers in lists.items():
            addrs = [_hostport(self.co.nodes[p][0], self.ports[p]) for p in peers]
            sent += self.co._send(node, pb.Assignment(kind="pinglist", probe=path_probe.PROBE, members=peers,
                                                      peer_addresses=addrs, epoch=epoch, params=self.params,
                                                      deadline_ns=end_ns))
        self.epochs_sent += 1
        self.last_epoch = epoch
        self.last_counts = {s: len(m) for s, m in path_planner.scopes(nodes, c.scope_key).items()}
        return sent

    async def run_forever(self) -> None:
        period = self.co.config.path_epoch_s
        while True:
            try:
                self.send_epoch()
            except planner.PlanError as exc:
                log.error("fabric: cannot plan pinglists: %s", exc)
            await asyncio.sleep(period - time.time() % period + 0.05)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run_forever())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    # -- suspects, for targeted bandwidth runs
    def note_run(self, outcome) -> None:
        """A pair or group run that went ahead: the path probes through its nodes while it ran read its
        traffic, not the fabric."""
        if outcome.status == "skipped":
            return
        for n in outcome.members or (outcome.node_a, outcome.node_b):
            self.runs.setdefault(n, collections.deque(maxlen=8)).append((outcome.started_ns, outcome.ended_ns))

    def _overlaps_run(self, nodes, t0: int, t1: int) -> bool:
        return any(s - NS <= t1 and t0 <= e + NS for n in nodes for s, e in self.runs.get(n, ()))

    def note_batch(self, batch: pb.Batch) -> int:
        """Keep the suspect paths a batch reports (for the next epoch's rechecks and, in targeted mode, the
        next bandwidth runs); how many. A suspect whose probes overlapped a bandwidth run on either end is
        dropped: else each targeted run would make the next round's suspects."""
        n = 0
        for r in batch.probe_results:
            if r.probe != path_probe.PROBE or r.params.get("role") != "suspect":
                continue
            a, b = r.params.get("node_a", ""), r.params.get("node_b", "")
            if a and b and self._overlaps_run((a, b), r.started_ns, r.ended_ns):
                self.dropped_overlap += 1
                continue
            if a and b and a != b:
                if len(self.rechecks) < MAX_SUSPECTS:
                    self.rechecks[(a, b)] = None
                if self.co.config.sweep != "targeted":
                    n += 1
                    continue
                key = frozenset((a, b))
                self.suspects.pop(key, None)
                self.suspects[key] = (a, b)
                n += 1
        while len(self.suspects) > MAX_SUSPECTS:
            self.suspects.popitem(last=False)
        return n

    def note_counters(self, nodes) -> int:
        """The nodes the passive counters flag now; each newly flagged one waits for a bandwidth run (once a
        flag episode: a node whose flag closed and opens again gets another). Returns how many are new."""
        now = set(nodes)
        new = now - self.counter_flagged
        for n in sorted(new):
            self.counter_pending[n] = None
        for n in list(self.counter_pending):
            if n not in now:
                del self.counter_pending[n]
        self.counter_flagged = now
        return len(new)

    def _counter_peer(self, node: str, ready: dict[str, dict[str, str]], used: set[str]) -> str | None:
        """A peer for a counter-flagged node: a ready node of its scope, not flagged itself, not busy this
        round; a different one each time (seeded)."""
        key = self.co.config.scope_key
        scope = ready[node].get(key, "") if key else ""
        peers = sorted(p for p, labels in ready.items() if p != node and p not in used and p not in self.counter_flagged
                       and (not key or labels.get(key, "") == scope))
        if not peers:
            return None
        self._counter_plans += 1
        return random.Random(f"{self.co.config.seed}/{node}/{self._counter_plans}").choice(peers)

    def targeted_round(self) -> list[planner.Pair]:
        """One round: suspect pairs first (newest first, each node once), then the newly counter-flagged
        nodes with a peer each, then the tournament's next pairs."""
        c = self.co.config
        ready = self.co.ready_nodes()
        used: set[str] = set()
        out: list[planner.Pair] = []
        for key, (a, b) in reversed(list(self.suspects.items())):
            if a in ready and b in ready and not ({a, b} & used):
                out.append((a, b))
                used.update((a, b))
                del self.suspects[key]
        for n in list(self.counter_pending):
            peer = self._counter_peer(n, ready, used) if n in ready and n not in used else None
            if peer is not None:
                out.append((n, peer))
                used.update((n, peer))
                del self.counter_pending[n]
        want = math.ceil(len(ready) * c.rolling_runs_per_hour * c.targeted_interval_s / 3600 / 2)
        taken = 0
        for _ in range(2):     # at most one re-plan per round
            while self._rolling and taken < want:
                a, b = self._rolling.pop(0)
                if a in ready and b in ready and not ({a, b} & used):
                    out.append((a, b))
                    used.update((a, b))
                    taken += 1
            if taken >= want or len(ready) < 2:
                break
            plan = planner.plan_pairs(ready, c.scope_key, None, seed=f"{c.seed}/roll{self._rolling_plan}")
            self._rolling_plan += 1
            self._rolling = [p for rnd in plan.rounds for p in rnd]
        return out
