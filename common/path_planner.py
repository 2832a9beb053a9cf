"""Pinglists for the cheap fabric layer: which peers each node probes in each epoch. Pure functions.

It lives in common because the collector's coordinator and the simulator (sim/paths.py) plan alike.

Within a scope (a pool, or any label's value) of n nodes the plan is circulant, as Pingmesh's pinglists
are generated centrally but spread evenly: the nodes are put in a shuffled ring, and in one epoch node i
probes the nodes ``d`` places further round the ring for ``k`` consecutive offsets ``d``. The offsets
1 .. n-1 cover every pair twice, once from each end (two probes, so a lossy path that one probe's few dozen
datagrams can miss is seen twice a cycle), so a *cycle* of ceil((n-1) / k) epochs measures every pair of the
scope, and in every epoch each node sends exactly k planned probes and answers exactly k (plus at most
``rechecks_per_node`` rechecks, below): no node is a hot spot. Each cycle shuffles the ring anew (seeded by the seed,
the scope and the cycle number), so a node's peers, and the epoch in which a given pair is measured, change
from cycle to cycle.

A suspect path (reporter -> peer) is probed once more in the next epoch from its other end, the peer (at
most ``rechecks_per_node`` such extra probes per node an epoch): a lossless suspect needs a second report
before it is a link's (collector/analysis/sql/62_path_tomography.sql), and the other end's probe is the
independent one (another sender's CPU), within a minute instead of the next cycle.

``k`` follows from the target: to cover the scope within ``cover_s`` at epochs of ``epoch_s``, k =
ceil((n-1) x epoch_s / cover_s), capped at ``max_probes_per_s`` x epoch_s. A 64-node pool covered in
ten minutes needs 7 probes a minute per node; a 1,000-node pool 100 (1.7 a second); a scope too big for
the cap takes longer, and ``cycle_s`` says how long.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping

from gpuagent.common.pair_planner import PlanError, _checked


@dataclass(frozen=True)
class PathPlanSettings:
    epoch_s: float = 60.0
    cover_s: float = 600.0
    max_probes_per_s: float = 2.0
    seed: int | str = 0
    rechecks_per_node: int = 4      # extra probes a node makes in an epoch, of the paths that named it

    def problem(self) -> str:
        if not (self.epoch_s >= 1 and self.cover_s >= self.epoch_s and self.max_probes_per_s > 0):
            return ("fabric.paths needs epoch_s >= 1, cover_s >= epoch_s and max_probes_per_s > 0, got "
                    f"{self.epoch_s:g}, {self.cover_s:g} and {self.max_probes_per_s:g}")
        return ""


def offsets_per_epoch(n: int, s: PathPlanSettings) -> int:
    """k: how many peers each node of an n-node scope probes per epoch."""
    others = n - 1
    if others <= 0:
        return 0
    want = math.ceil(others * s.epoch_s / s.cover_s)
    cap = max(1, int(s.max_probes_per_s * s.epoch_s))
    return max(1, min(others, want, cap))


def cycle_epochs(n: int, s: PathPlanSettings) -> int:
    """Epochs one cycle takes: every pair of an n-node scope measured once."""
    k = offsets_per_epoch(n, s)
    return math.ceil((n - 1) / k) if k else 0


def cycle_s(n: int, s: PathPlanSettings) -> float:
    return cycle_epochs(n, s) * s.epoch_s


def scopes(nodes: Mapping[str, Mapping[str, str]], scope_key: str | None) -> dict[str, list[str]]:
    """{scope value: sorted node ids}; one scope "" when scope_key is None."""
    out: dict[str, list[str]] = defaultdict(list)
    for node in _checked(nodes):
        out[str(nodes[node].get(scope_key, "")) if scope_key else ""].append(node)
    return dict(out)


def ring(members: list[str], scope: str, cycle: int, seed: int | str) -> list[str]:
    order = sorted(members)
    random.Random(f"{seed}/{scope}/{cycle}").shuffle(order)
    return order


def scope_pinglists(members: list[str], scope: str, epoch: int, s: PathPlanSettings) -> dict[str, list[str]]:
    """{node: peers to probe in this epoch} for one scope's members."""
    n = len(members)
    k = offsets_per_epoch(n, s)
    if k == 0:
        return {m: [] for m in members}
    per_cycle = math.ceil((n - 1) / k)
    cycle, e = divmod(epoch, per_cycle)
    order = ring(members, scope, cycle, s.seed)
    offs = range(1 + e * k, min(n - 1, (e + 1) * k) + 1)
    return {order[i]: [order[(i + d) % n] for d in offs] for i in range(n)}


def pinglists(nodes: Mapping[str, Mapping[str, str]], scope_key: str | None, epoch: int,
              s: PathPlanSettings) -> dict[str, list[str]]:
    """{node: peers} for every node, scope by scope; pairs never cross a scope."""
    why = s.problem()
    if why:
        raise PlanError(why)
    if epoch < 0:
        raise PlanError(f"epoch must not be negative, got {epoch}")
    out: dict[str, list[str]] = {}
    for scope, members in scopes(nodes, scope_key).items():
        out.update(scope_pinglists(members, scope, epoch, s))
    return out


def coverage(n: int, epochs: int, s: PathPlanSettings) -> float:
    """Share of an n-node scope's pairs measured (from at least one end) by ``epochs`` consecutive epochs of
    one cycle (node churn aside)."""
    if n < 2:
        return 0.0
    return min(1.0, 2 * epochs * offsets_per_epoch(n, s) / (n - 1))


def with_rechecks(lists: dict[str, list[str]], suspects: Iterable[tuple[str, str]], per_node: int) -> int:
    """Add to ``lists`` (in place) each suspect path's probe from its other end: (reporter, peer) makes the
    peer probe the reporter, unless it does already, either is not in this epoch's plan, or the peer has
    ``per_node`` such probes already. Returns how many were added."""
    extra: Counter[str] = Counter()
    added = 0
    for reporter, peer in suspects:
        mine = lists.get(peer)
        if mine is None or reporter not in lists or reporter == peer or reporter in mine or extra[peer] >= per_node:
            continue
        mine.append(reporter)
        extra[peer] += 1
        added += 1
    return added

