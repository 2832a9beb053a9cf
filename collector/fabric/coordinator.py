"""The fabric coordinator: plans pair rounds over the connected nodes and hands out assignments.

It runs on the collector's event loop. Agents that declared a fabric address at Register and hold an
``Assignments`` stream are the candidates; a round of the planner's tournament (planner.plan_pairs) is
run at a time. For each pair both ends get an ``offer`` and must answer within ``answer_timeout_s``;
only when both accepted does the connecting end get ``go`` (with the listener's port). A busy or silent
end turns the pair into a ``skipped`` outcome with the reason, the other end gets ``cancel``, and the pair
stays in the plan for a later sweep. A pair that went ahead ends when both ends report ``finished`` or
at its deadline, whichever is first, so neither side nor the round can hang.

With ``group_size`` >= 2, each sweep is followed by one round of collective groups (planner.plan_groups:
disjoint rings of that many nodes within a scope). Every member gets an ``offer`` with the group in rank
order; rank 0 answers with the port it will host the torch.distributed rendezvous on, and once all have
accepted every member gets ``go`` with rank 0's address and that port and runs the ``collective`` probe
with ``nnodes`` = the group's size. One busy or silent member skips the whole group, as with a pair.

With ``rdma_pairs``, each sweep is also followed by the same tournament of pairs running ``rdma_pair``
(perftest's ib_write_bw / ib_write_lat) through the same offer/go path: the listening end is rank 0 and
answers with a port for perftest's TCP exchange (which also uses the next port). A node without an RDMA
device or perftest refuses with the reason, so such a pair is ``skipped`` with it.

The measurements themselves travel in the agents' batches (probes ``net_pair`` and ``rdma_pair``, params
``node_a``/``node_b``; probe ``collective``, params ``group_id``/``members``); the coordinator keeps only
outcomes, and hands each one to ``record`` when given.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from gpuagent.collector.fabric.pinglists import PathLayer
from gpuagent.common import pair_planner as planner
from gpuagent.common import path_planner, path_probe
from gpuagent.common.errors import first_line
from gpuagent.common.parse import settings_key
from gpuagent.proto import pb

log = logging.getLogger("gpuagent.collector.fabric")

DEFAULT_PARAMS = {"streams": "4", "duration_s": "2.0", "warmup_s": "0.3", "rtt_count": "200"}
# The collective probe's settings for group rounds (its own defaults otherwise: all GPUs with NCCL, two
# gloo ranks on a CPU node); the agents check them, since the collector does not import the probes.
DEFAULT_COLLECTIVE_PARAMS = {"backend": "auto"}
# Set by the coordinator for each member; a [fabric.collective_params] table may not set them.
GROUP_KEYS = ("nnodes", "node_rank", "master_addr", "master_port")
# The same for [fabric.rdma_params] (rdma_pair's settings).
RDMA_KEYS = ("role", "peer", "tcp_port")
RECENT_OUTCOMES = 10_000
COUNTER_POLL_S = 60.0      # how often targeted rounds read the nodes the passive counters flag
COUNTER_READ_TIMEOUT_S = 30.0


@dataclass
class FabricConfig:
    """[fabric] of the collector config."""
    enabled: bool = False
    interval_s: float = 300.0          # pause between rounds
    scope_key: str | None = "pool"     # pairs never cross this label's values; None: one scope
    max_pairs_per_round: int = 0       # 0: no cap
    port_lo: int = 0                   # the listener's port range (0, 0: any free port)
    port_hi: int = 0
    answer_timeout_s: float = 5.0      # how long an end has to accept or refuse an offer
    run_timeout_s: float = 30.0        # from go to the end of the run
    params: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_PARAMS))
    seed: int = 0
    group_size: int = 0                # >= 2: a round of collective groups of this size after each sweep
    group_run_timeout_s: float = 300.0   # from go to the end of a group's collective run
    collective_params: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_COLLECTIVE_PARAMS))
    rdma_pairs: bool = False           # also sweep every pair with rdma_pair (perftest) after each net_pair sweep
    rdma_params: dict[str, str] = field(default_factory=dict)
    # the cheap layer (collector/fabric/pinglists.py): pinglists every epoch to nodes with a path-probe port
    paths: bool = True
    path_epoch_s: float = 60.0
    path_cover_s: float = 600.0        # aim: every pair of a scope measured within this
    path_max_probes_per_s: float = 2.0   # per node; a scope too big for it takes longer
    path_params: dict[str, str] = field(default_factory=dict)   # common/path_probe.PathSettings
    sweep: str = "full"                # "targeted": suspects first, then a rolling share of the pairs
    targeted_interval_s: float = 10.0
    rolling_runs_per_hour: float = 4.0   # targeted: net_pair runs per node an hour beside the suspects

    def path_settings(self) -> path_probe.PathSettings:
        got = path_probe.PathSettings.from_params(self.path_params)
        return got if isinstance(got, path_probe.PathSettings) else path_probe.PathSettings()

    @classmethod
    def from_mapping(cls, table) -> "FabricConfig":
        """From the collector config's [fabric] table; a bad key or value raises ValueError (one sentence).
        ``scope_key = ""`` puts all nodes in one scope; ``[fabric.params]`` overrides net_pair settings."""
        table = dict(table or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"unknown key fabric.{unknown[0]} (known: {', '.join(sorted(known))})")
        kw = {}
        for key, value in table.items():
            default = getattr(cls, key, None) if key != "params" else None
            if key == "params":
                if not isinstance(value, dict):
                    raise ValueError("[fabric.params] must be a table of net_pair settings")
                kw[key] = {**DEFAULT_PARAMS, **{str(k): str(v) for k, v in value.items()}}
            elif key == "path_params":
                if not isinstance(value, dict):
                    raise ValueError("[fabric.path_params] must be a table of path probe settings")
                kw[key] = {str(k): str(v) for k, v in value.items()}
            elif key == "sweep":
                if value not in ("full", "targeted"):
                    raise ValueError(f"fabric.sweep must be \"full\" or \"targeted\", not {value!r}")
                kw[key] = value
            elif key in ("collective_params", "rdma_params"):
                if not isinstance(value, dict):
                    raise ValueError(f"[fabric.{key}] must be a table of {key.split('_')[0]} probe settings")
                base = DEFAULT_COLLECTIVE_PARAMS if key == "collective_params" else {}
                kw[key] = {**base,
                           **{str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}}
            elif key in ("enabled", "rdma_pairs", "paths"):
                if not isinstance(value, bool):
                    raise ValueError(f"fabric.{key} must be true or false, not {value!r}")
                kw[key] = value
            elif key == "scope_key":
                if not isinstance(value, str):
                    raise ValueError(f"fabric.scope_key must be a label name (or \"\" for one scope), not {value!r}")
                kw[key] = value or None
            elif isinstance(default, (int, float)):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"fabric.{key} must be a number, not {value!r}")
                kw[key] = type(default)(value)
        cfg = cls(**kw)
        why = cfg.problem()
        if why:
            raise ValueError(why)
        return cfg

    def problem(self) -> str:
        if not (self.interval_s >= 0 and self.answer_timeout_s > 0 and self.run_timeout_s > 0):
            return "fabric interval_s must not be negative, answer_timeout_s and run_timeout_s must be positive"
        if self.max_pairs_per_round < 0:
            return f"fabric max_pairs_per_round must not be negative, got {self.max_pairs_per_round}"
        if self.group_size < 0 or self.group_size == 1:
            return f"fabric group_size must be 0 (no group rounds) or at least 2, got {self.group_size}"
        if not self.group_run_timeout_s > 0:
            return "fabric group_run_timeout_s must be positive"
        for table, keys in (("collective_params", GROUP_KEYS), ("rdma_params", RDMA_KEYS)):
            reserved = sorted(set(getattr(self, table)) & set(keys))
            if reserved:
                return (f"fabric.{table} may not set {reserved[0]}: the coordinator sets "
                        f"{', '.join(keys)} for each end")
        why = path_planner.PathPlanSettings(self.path_epoch_s, self.path_cover_s, self.path_max_probes_per_s).problem()
        if why:
            return why
        got = path_probe.PathSettings.from_params(self.path_params)
        if isinstance(got, str):
            return f"[fabric.path_params]: {got}"
        unknown = sorted(set(self.path_params) - set(path_probe.PathSettings().as_params()))
        if unknown:
            return f"unknown key fabric.path_params.{unknown[0]}"
        if not (self.targeted_interval_s >= 1 and self.rolling_runs_per_hour >= 0):
            return "fabric targeted_interval_s must be at least 1 and rolling_runs_per_hour not negative"
        lo, hi = self.port_lo, self.port_hi
        if not (0 <= lo <= hi <= 65535) or (lo == 0) != (hi == 0):
            return f"fabric port range must be 1 <= lo <= hi <= 65535 (or both 0), got {lo}-{hi}"
        return ""


@dataclass
class Outcome:
    """What became of one planned pair (node_a connects, node_b listens) or group (node_a is rank 0, node_b
    the last rank; ``members`` holds them all)."""
    pair_id: str
    node_a: str
    node_b: str
    status: str                 # "ok", "failed", "timeout" from the connecting end; "skipped" here
    reason: str
    started_ns: int
    ended_ns: int
    round_no: int
    params: dict[str, str] = field(default_factory=dict)   # the probe settings the pair was offered
    probe: str = "net_pair"
    members: list[str] = field(default_factory=list)        # collective, rdma_pair: the group in rank order


class _Pair:
    def __init__(self, pair_id: str, a: str, b: str):
        self.pair_id, self.a, self.b = pair_id, a, b
        self.answers: dict[str, pb.AssignmentAnswer] = {}
        self.answered = asyncio.Event()
        self.finished = asyncio.Event()
        self.finishes: dict[str, pb.AssignmentAnswer] = {}


class _Group:
    """One group in flight (a collective ring, or an rdma_pair as [listener, connector]): answers and finish
    reports by member."""

    def __init__(self, group_id: str, members: list[str], probe: str, params: dict[str, str]):
        self.pair_id, self.members, self.probe, self.params = group_id, members, probe, params
        self.answers: dict[str, pb.AssignmentAnswer] = {}
        self.answered = asyncio.Event()
        self.finished = asyncio.Event()     # every member reported the end of its run, or one failed
        self.finishes: dict[str, pb.AssignmentAnswer] = {}


class Coordinator:
    def __init__(self, config: FabricConfig, record: Callable[[Outcome], None] | None = None,
                 counter_suspects: Callable[[], concurrent.futures.Future] | None = None):
        """``record`` stores each outcome; ``counter_suspects`` starts a read of the nodes the passive
        counters flag (open hardware_fault eth_link/ib_port flags) and returns its future, which targeted
        rounds await every COUNTER_POLL_S."""
        why = config.problem()
        if why:
            raise ValueError(why)
        self.config = config
        self._record = record
        self._counter_suspects = counter_suspects
        self._counters_due = 0.0
        self.nodes: dict[str, tuple[str, dict[str, str]]] = {}   # node id -> (fabric address, labels)
        self._streams: dict[str, asyncio.Queue] = {}
        self._pairs: dict[str, _Pair] = {}
        self._groups: dict[str, _Group] = {}
        self._ids = itertools.count(1)
        self._run_tag = f"{time.time_ns():x}"
        # The newest outcomes, for a look from a debugger or a test; bounded, since a 1,000-node pool has
        # half a million pairs per sweep and the collector runs for months (the rows are in the database).
        self.outcomes: collections.deque[Outcome] = collections.deque(maxlen=RECENT_OUTCOMES)
        self.rounds_done = 0
        self.group_rounds_done = 0
        self.rdma_rounds_done = 0
        self.last_plan: planner.PairPlan | None = None
        self.last_groups: planner.GroupRound | None = None
        self._task: asyncio.Task | None = None
        self.paths = PathLayer(self)

    # -- what the servicer calls
    def register(self, node_id: str, address: str, labels: dict[str, str], path_port: int = 0) -> None:
        if address:
            self.nodes[node_id] = (address, dict(labels))
        else:
            self.nodes.pop(node_id, None)
        self.paths.register(node_id, path_port if address else 0)

    def attach(self, node_id: str) -> asyncio.Queue:
        """A new Assignments stream for ``node_id``; it replaces an older one."""
        old = self._streams.get(node_id)
        if old is not None:
            old.put_nowait(None)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[node_id] = q
        return q

    def detach(self, node_id: str, queue: asyncio.Queue) -> None:
        if self._streams.get(node_id) is queue:
            del self._streams[node_id]

    def answer(self, ans: pb.AssignmentAnswer) -> bool:
        """An agent's answer or finish report; False when the pair is not (or no longer) running."""
        group = self._groups.get(ans.pair_id)
        if group is not None:
            return self._group_answer(group, ans)
        pair = self._pairs.get(ans.pair_id)
        if pair is None or ans.node_id not in (pair.a, pair.b):
            return False
        if ans.finished:
            # The round waits for both ends, so the next round does not find an end still winding down.
            pair.finishes[ans.node_id] = ans
            if len(pair.finishes) == 2:
                pair.finished.set()
            return True
        pair.answers[ans.node_id] = ans
        if len(pair.answers) == 2 or not ans.accepted:
            pair.answered.set()
        return True

    # -- planning
    def ready_nodes(self) -> dict[str, dict[str, str]]:
        """Nodes with a fabric address and a live Assignments stream: node -> labels."""
        return {n: labels for n, (_addr, labels) in self.nodes.items() if n in self._streams}

    def plan(self) -> planner.PairPlan:
        c = self.config
        plan = planner.plan_pairs(self.ready_nodes(), c.scope_key, c.max_pairs_per_round or None,
                                  seed=f"{c.seed}/{self.rounds_done}")
        self.last_plan = plan
        return plan

    async def sweep(self) -> list[Outcome]:
        """One full pair-wise sweep over the nodes ready now: every round of one plan, in order."""
        out: list[Outcome] = []
        for rnd in self.plan().rounds:
            out.extend(await self.run_round(rnd))
        return out

    async def run_round(self, pairs: list[tuple[str, str]]) -> list[Outcome]:
        round_no = self.rounds_done
        log.info("fabric round %d started: %s", round_no, " ".join(f"{a}>{b}" for a, b in pairs))
        outcomes = await asyncio.gather(*(self._run_pair(a, b, round_no) for a, b in pairs))
        self.rounds_done += 1
        log.info("fabric round %d done: %s", round_no,
                 " ".join(f"{o.node_a}>{o.node_b}={o.status}" for o in outcomes))
        return list(outcomes)

    async def run_forever(self) -> None:
        while True:
            try:
                if self.config.sweep == "targeted":
                    await self._poll_counter_suspects()
                    pairs = self.paths.targeted_round() if len(self.ready_nodes()) >= 2 else []
                    if pairs:
                        await self.run_round(pairs)
                    await asyncio.sleep(self.config.targeted_interval_s)
                    continue
                if len(self.ready_nodes()) >= 2:
                    await self.sweep()
                if self.config.rdma_pairs and len(self.ready_nodes()) >= 2:
                    await self.rdma_sweep()
                if self.config.group_size >= 2 and len(self.ready_nodes()) >= 2:
                    await self.group_round()
            except planner.PlanError as exc:
                log.error("fabric: cannot plan: %s", exc)
            await asyncio.sleep(max(1.0, self.config.interval_s))

    async def _poll_counter_suspects(self) -> None:
        """Hand the nodes the passive counters flag to the targeted rounds, every COUNTER_POLL_S."""
        if self._counter_suspects is None or time.monotonic() < self._counters_due:
            return
        self._counters_due = time.monotonic() + COUNTER_POLL_S
        try:
            # bounded: a writer stuck in a long call must not hold up the rounds
            nodes = await asyncio.wait_for(asyncio.wrap_future(self._counter_suspects()), COUNTER_READ_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed read must not stop the rounds; the next poll retries
            log.warning("fabric: cannot read the counter-flagged nodes: %s", first_line(exc))
            return
        self.paths.note_counters(nodes)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run_forever())
        if self.config.paths:
            self.paths.start()

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
        self.paths.stop()

    # -- one pair
    def _send(self, node_id: str, msg: pb.Assignment) -> bool:
        q = self._streams.get(node_id)
        if q is None:
            return False
        q.put_nowait(msg)
        return True

    def _refusals(self, ends, answers: dict[str, pb.AssignmentAnswer], silent: list[str]) -> str:
        """Why a pair or group cannot start (its silent ends, then its busy ones, in one sentence), or ""."""
        busy = [(n, answers[n].reason or "busy") for n in ends if n in answers and not answers[n].accepted]
        return "; ".join([f"node {n} did not answer within {self.config.answer_timeout_s:g} s" for n in silent]
                         + [f"node {n} is busy: {r}" for n, r in busy])

    def _done(self, pair: _Pair, status: str, reason: str, started: int, round_no: int) -> Outcome:
        self._pairs.pop(pair.pair_id, None)
        return self._keep(Outcome(pair.pair_id, pair.a, pair.b, status, reason, started, time.time_ns(), round_no,
                                  dict(self.config.params)))

    def _keep(self, o: Outcome) -> Outcome:
        self.outcomes.append(o)
        self.paths.note_run(o)
        if self._record:
            try:
                self._record(o)
            except Exception as exc:  # noqa: BLE001 - a failed record must not stop the round
                log.error("fabric: recording the outcome of %s failed: %s", o.pair_id, exc)
        return o

    async def _run_pair(self, a: str, b: str, round_no: int) -> Outcome:
        c = self.config
        pair = _Pair(f"{self._run_tag}-r{round_no}-{next(self._ids)}", a, b)   # the round is read back by `fabric`
        self._pairs[pair.pair_id] = pair
        started = time.time_ns()
        secret = secrets.token_hex(16)
        answer_deadline = started + int(c.answer_timeout_s * 1e9)
        addr_b = self.nodes.get(b, ("", {}))[0]
        common = dict(kind="offer", pair_id=pair.pair_id, port_lo=c.port_lo, port_hi=c.port_hi, secret=secret,
                      probe="net_pair", params=c.params, node_a=a, node_b=b)
        silent = [n for n, role, peer, addr in ((b, "listen", a, ""), (a, "connect", b, addr_b))
                  if not self._send(n, pb.Assignment(role=role, peer_node_id=peer, peer_address=addr,
                                                     deadline_ns=answer_deadline, **common))]
        if not silent:
            try:
                await asyncio.wait_for(pair.answered.wait(), c.answer_timeout_s)
            except asyncio.TimeoutError:
                silent = [n for n in (a, b) if n not in pair.answers]
        why = self._refusals((a, b), pair.answers, silent)
        if why:
            for n in (a, b):
                self._send(n, pb.Assignment(kind="cancel", pair_id=pair.pair_id, reason=why, node_a=a, node_b=b))
            return self._done(pair, "skipped", why, started, round_no)
        port = pair.answers[b].port
        run_deadline = time.time_ns() + int(c.run_timeout_s * 1e9)
        if not self._send(a, pb.Assignment(kind="go", pair_id=pair.pair_id, role="connect", peer_node_id=b,
                                           peer_address=addr_b, port=port, secret=secret, probe="net_pair",
                                           params=c.params, deadline_ns=run_deadline, node_a=a, node_b=b)):
            self._send(b, pb.Assignment(kind="cancel", pair_id=pair.pair_id, reason=f"node {a} went away",
                                        node_a=a, node_b=b))
            return self._done(pair, "skipped", f"node {a} went away before the run started", started, round_no)
        try:
            await asyncio.wait_for(pair.finished.wait(), c.run_timeout_s)
        except asyncio.TimeoutError:
            if a in pair.finishes:      # the listener is late to say so, but the run itself ended
                fin = pair.finishes[a]
                return self._done(pair, fin.status or "ok", fin.reason, started, round_no)
            for n in (a, b):
                self._send(n, pb.Assignment(kind="cancel", pair_id=pair.pair_id, node_a=a, node_b=b,
                                            reason=f"the run passed its {c.run_timeout_s:g} s deadline"))
            return self._done(pair, "timeout", f"node {a} did not report the end of the run within "
                              f"{c.run_timeout_s:g} s", started, round_no)
        fin = pair.finishes[a]
        return self._done(pair, fin.status or "ok", fin.reason, started, round_no)

    # -- collective groups
    async def group_round(self) -> list[Outcome]:
        """One round of collective groups over the nodes ready now: disjoint rings of ``group_size`` within
        each scope (a remainder of one node sits out), all run side by side."""
        c = self.config
        rnd = planner.plan_groups(self.ready_nodes(), c.group_size, c.scope_key, 1,
                                  seed=f"{c.seed}/g{self.group_rounds_done}")[0]
        self.last_groups = rnd
        round_no = self.group_rounds_done
        log.info("fabric group round %d started: %s", round_no, " ".join(",".join(g) for g in rnd.groups))
        outcomes = await asyncio.gather(*(self._run_group(g, round_no, "collective", c.collective_params)
                                          for g in rnd.groups))
        self.group_rounds_done += 1
        log.info("fabric group round %d done: %s", round_no,
                 " ".join(f"{','.join(o.members)}={o.status}" for o in outcomes))
        return list(outcomes)

    async def rdma_sweep(self) -> list[Outcome]:
        """A full pair-wise sweep with rdma_pair: the net_pair tournament's rounds, each pair run as a group
        of two with the listening end (node_b) at rank 0."""
        c = self.config
        plan = planner.plan_pairs(self.ready_nodes(), c.scope_key, c.max_pairs_per_round or None,
                                  seed=f"{c.seed}/rdma{self.rdma_rounds_done}")
        out: list[Outcome] = []
        for pairs in plan.rounds:
            round_no = self.rdma_rounds_done
            outcomes = await asyncio.gather(*(self._run_group([b, a], round_no, "rdma_pair", c.rdma_params)
                                              for a, b in pairs))
            self.rdma_rounds_done += 1
            log.info("fabric rdma round %d done: %s", round_no,
                     " ".join(f"{o.node_a}>{o.node_b}={o.status}" for o in outcomes))
            out.extend(outcomes)
        return out

    def _group_answer(self, group: _Group, ans: pb.AssignmentAnswer) -> bool:
        if ans.node_id not in group.members:
            return False
        if ans.finished:
            # A member whose run ended badly ends the group: the others would only wait out their
            # rendezvous or transfer timeouts for it.
            group.finishes[ans.node_id] = ans
            if len(group.finishes) == len(group.members) or ans.status != "ok":
                group.finished.set()
            return True
        group.answers[ans.node_id] = ans
        if len(group.answers) == len(group.members) or not ans.accepted:
            group.answered.set()
        return True

    def _group_done(self, group: _Group, status: str, reason: str, started: int, round_no: int) -> Outcome:
        self._groups.pop(group.pair_id, None)
        m = group.members
        a, b = (m[1], m[0]) if group.probe == "rdma_pair" else (m[0], m[-1])    # rdma: [listener, connector]
        return self._keep(Outcome(group.pair_id, a, b, status, reason, started, time.time_ns(), round_no,
                                  dict(group.params), group.probe, list(m)))

    def _cancel_group(self, group: _Group, reason: str) -> None:
        for n in group.members:
            self._send(n, pb.Assignment(kind="cancel", pair_id=group.pair_id, probe=group.probe, reason=reason,
                                        members=group.members))

    async def _run_group(self, members: list[str], round_no: int, probe: str, params: dict[str, str]) -> Outcome:
        """Offer the group to every member; when all accepted, send go with rank 0's rendezvous address and
        port; wait for every member's finish report or the deadline."""
        c = self.config
        tag = "g" if probe == "collective" else "d"
        group = _Group(f"{self._run_tag}-{tag}{round_no}-{next(self._ids)}", list(members), probe, dict(params))
        self._groups[group.pair_id] = group
        started = time.time_ns()
        answer_deadline = started + int(c.answer_timeout_s * 1e9)
        master = members[0]
        silent = [n for rank, n in enumerate(members)
                  if not self._send(n, pb.Assignment(
                      kind="offer", pair_id=group.pair_id, role="listen" if rank == 0 else "connect",
                      probe=probe, params=params, members=members, node_rank=rank,
                      port_lo=c.port_lo, port_hi=c.port_hi, deadline_ns=answer_deadline))]
        if not silent:
            try:
                await asyncio.wait_for(group.answered.wait(), c.answer_timeout_s)
            except asyncio.TimeoutError:
                silent = [n for n in members if n not in group.answers]
        why = self._refusals(members, group.answers, silent)
        if why:
            self._cancel_group(group, why)
            return self._group_done(group, "skipped", why, started, round_no)
        port = group.answers[master].port
        addr = self.nodes.get(master, ("", {}))[0]
        run_deadline = time.time_ns() + int(c.group_run_timeout_s * 1e9)
        gone = [n for rank, n in enumerate(members)
                if not self._send(n, pb.Assignment(
                    kind="go", pair_id=group.pair_id, role="listen" if rank == 0 else "connect",
                    peer_node_id=master, peer_address=addr, port=port, probe=probe,
                    params=params, members=members, node_rank=rank, deadline_ns=run_deadline))]
        if gone:
            why = f"node {gone[0]} went away before the run started"
            self._cancel_group(group, why)
            return self._group_done(group, "skipped", why, started, round_no)
        try:
            await asyncio.wait_for(group.finished.wait(), c.group_run_timeout_s)
        except asyncio.TimeoutError:
            late = [n for n in members if n not in group.finishes]
            self._cancel_group(group, f"the run passed its {c.group_run_timeout_s:g} s deadline")
            return self._group_done(group, "timeout", f"node {late[0]} did not report the end of the run "
                                    f"within {c.group_run_timeout_s:g} s", started, round_no)
        bad = [(n, f) for n, f in group.finishes.items() if f.status != "ok"]
        if bad:
            n, f = bad[0]
            running = [m for m in members if m not in group.finishes]
            if running:
                self._cancel_group(group, f"node {n} ended its part: {f.status}: {f.reason}")
            return self._group_done(group, f.status, f"node {n}: {f.reason}", started, round_no)
        return self._group_done(group, "ok", "", started, round_no)


def record_outcome(writer, o: Outcome) -> None:
    """Store a pair or group the collector could not run (skipped) or saw no end of (timeout) as a link or
    group row; the agents store the runs themselves."""
    if o.status not in ("skipped", "timeout"):
        return
    params_key = settings_key(o.params)
    if o.probe == "collective":
        sql = ("INSERT INTO group_results (group_id, members, group_size, probe, params_key, started_at, ended_at, "
               "status, reason, reported_by) VALUES (?, ?, ?, ?, ?, make_timestamp(?), make_timestamp(?), ?, ?, "
               "'collector')")
        row = [o.pair_id, ",".join(o.members), len(o.members), o.probe, params_key, o.started_ns // 1000,
               o.ended_ns // 1000, o.status, o.reason]
    else:
        sql = ("INSERT INTO link_results (pair_id, node_a, node_b, probe, params_key, started_at, ended_at, "
               "status, reason, reported_by) VALUES (?, ?, ?, ?, ?, make_timestamp(?), make_timestamp(?), "
               "?, ?, 'collector')")
        row = [o.pair_id, o.node_a, o.node_b, o.probe, params_key, o.started_ns // 1000, o.ended_ns // 1000,
               o.status, o.reason]

    def insert(con):
        con.execute(sql, row)

    fut = writer.call(insert)
    fut.add_done_callback(lambda f: f.exception() and log.error(
        "fabric: storing the %s outcome of %s failed: %s", o.status, o.pair_id, f.exception()))


# The passive counters' components of hardware_fault (collector/analysis/sql/70_hardware_fault.sql): a NIC or IB
# port with errors, carrier changes, a port down or a link below its speed.
COUNTER_COMPONENTS = ("eth_link", "ib_port")


def counter_flagged_nodes(con) -> list[str]:
    """The nodes with an open hardware_fault flag on their Ethernet link or IB port (run on the writer)."""
    return [r[0] for r in con.execute(
        "SELECT DISTINCT node_id FROM flags WHERE state = 'open' AND kind = 'hardware_fault' AND component IN "
        f"({', '.join('?' for _ in COUNTER_COMPONENTS)}) ORDER BY node_id", list(COUNTER_COMPONENTS)).fetchall()]
