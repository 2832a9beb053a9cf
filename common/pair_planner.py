"""The fabric pair planner: which nodes measure each other, round by round. Pure functions, no I/O.

It lives in common because two packages plan alike: the collector's fabric coordinator and the simulator
(``gpuagent-sim --fabric-sweeps``), which must not import the collector. Standard library only.

Pair rounds come from a round-robin tournament (the circle method): with N nodes (a bye added when N
is odd) one node stays put while the others rotate one place per round, and pairing the i-th position
with the (N-1-i)-th gives N-1 rounds (N for odd N, one bye per round) in which every unordered pair
meets exactly once and no node is in two pairs of a round. A cap on pairs per round splits a round
into several, which keeps the second property. A pair is ``(a, b)``: ``a`` connects, ``b`` listens;
the roles alternate (Berger tables) so every node listens about as often as it connects.

Group rounds partition the nodes into rings of ``k`` for a cross-node all-reduce, reshuffled each round
so a node meets different ring neighbours over time.

Scoping plans each pool (or any label's value) separately: pairs and groups never cross a scope.
Scopes hold disjoint nodes, so their rounds run side by side; the cap applies to the merged round.
Everything is deterministic for a seed (the node order is shuffled with ``random.Random`` seeded by
the seed and the scope, which does not depend on PYTHONHASHSEED) and independent of the input order.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

Pair = tuple[str, str]          # (connecting end, listening end)
Round = list[Pair]


class PlanError(ValueError):
    """Input the planner cannot plan; the message is one sentence."""


def _checked(nodes: Iterable[str]) -> list[str]:
    if isinstance(nodes, str):
        raise PlanError("nodes must be a collection of node ids, not one string")
    out = list(nodes)
    if any(not isinstance(n, str) or not n for n in out):
        raise PlanError("node ids must be non-empty strings")
    out.sort()
    for i in range(1, len(out)):
        if out[i] == out[i - 1]:
            raise PlanError(f"node {out[i]!r} is listed twice")
    return out


def _shuffled(nodes: Sequence[str], seed: int | str, scope: str = "") -> list[str]:
    order = list(nodes)
    random.Random(f"{seed}/{scope}").shuffle(order)
    return order


def tournament(nodes: Iterable[str], seed: int | str = 0, scope: str = "") -> list[Round]:
    """Every unordered pair of ``nodes`` exactly once, in N-1 rounds (N even) or N rounds (N odd),
    each node at most once per round."""
    order = _shuffled(_checked(nodes), seed, scope)
    if len(order) < 2:
        return []
    players: list[str | None] = list(order)
    if len(players) % 2:
        players.append(None)                     # the bye
    n = len(players)
    half = n // 2
    fixed, rest = players[0], players[1:]
    rounds: list[Round] = []
    has_bye = n != len(order)
    for r in range(n - 1):
        shift = r % (n - 1)
        line = [fixed] + rest[n - 1 - shift:] + rest[:n - 1 - shift]
        a, b = line[:half], line[:half - 1:-1]
        # Alternate roles: the fixed player swaps every round, the others by position (odd ones swap).
        a[1::2], b[1::2] = b[1::2], a[1::2]
        if r & 1:
            a[0], b[0] = b[0], a[0]
        pairs: Round = list(zip(a, b))
        if has_bye:
            del pairs[a.index(None) if None in a else b.index(None)]
        rounds.append(pairs)
    return rounds


def cap_rounds(rounds: Iterable[Round], max_pairs: int | None) -> list[Round]:
    """Split each round into rounds of at most ``max_pairs`` pairs (None or 0: no cap)."""
    if max_pairs is not None and max_pairs < 0:
        raise PlanError(f"the cap on pairs per round must be positive, got {max_pairs}")
    out: list[Round] = []
    for rnd in rounds:
        if not max_pairs or len(rnd) <= max_pairs:
            out.append(list(rnd))
        else:
            out.extend(rnd[i:i + max_pairs] for i in range(0, len(rnd), max_pairs))
    return out


def rounds_for(n: int, max_pairs: int | None = None) -> int:
    """How many rounds a full pair-wise sweep of ``n`` nodes takes (with a cap on pairs per round)."""
    if n < 2:
        return 0
    base = n - 1 if n % 2 == 0 else n
    per_round = n // 2
    if max_pairs and max_pairs < per_round:
        return base * math.ceil(per_round / max_pairs)
    return base


def scopes(labels: Mapping[str, Mapping[str, str]], key: str | None = "pool") -> tuple[dict[str, list[str]], list[str]]:
    """({scope value: sorted nodes}, nodes without the label) from {node: {label: value}}.
    ``key`` None puts every node in one scope named ""."""
    out: dict[str, list[str]] = {}
    missing: list[str] = []
    for node in _checked(labels):
        value = "" if key is None else (labels[node] or {}).get(key)
        if value is None or (key is not None and value == ""):
            missing.append(node)
        else:
            out.setdefault(str(value), []).append(node)
    return out, missing


def _merge(per_scope: Mapping[str, list[list]]) -> list[list]:
    names = sorted(per_scope)
    longest = max((len(r) for r in per_scope.values()), default=0)
    return [list(itertools.chain.from_iterable(per_scope[name][i] for name in names if i < len(per_scope[name])))
            for i in range(longest)]


@dataclass
class PairPlan:
    """Rounds of pairs over every scope (``rounds``: merged and capped), and the per-scope tournaments."""
    rounds: list[Round]
    per_scope: dict[str, list[Round]]
    scope_key: str | None
    unscoped: list[str] = field(default_factory=list)   # nodes without the scope label: not planned
    seed: int | str = 0
    max_pairs_per_round: int | None = None

    def pairs(self) -> list[Pair]:
        return [p for rnd in self.rounds for p in rnd]


def plan_pairs(labels: Mapping[str, Mapping[str, str]] | Iterable[str], scope_key: str | None = "pool",
               max_pairs_per_round: int | None = None, seed: int | str = 0) -> PairPlan:
    """A full pair-wise sweep. ``labels`` maps node -> labels (e.g. {"pool": "a"}); a plain list of
    nodes is one scope. Raises PlanError for bad input."""
    if not isinstance(labels, Mapping):
        labels, scope_key = {n: {} for n in _checked(labels)}, None
    groups, missing = scopes(labels, scope_key)
    per_scope = {name: tournament(nodes, seed, name) for name, nodes in groups.items()}
    rounds = cap_rounds(_merge(per_scope), max_pairs_per_round)
    return PairPlan(rounds, per_scope, scope_key, missing, seed, max_pairs_per_round)


@dataclass
class GroupRound:
    """Disjoint rings: each group is a ring in list order; ``idle`` sat this round out."""
    groups: list[list[str]]
    idle: list[str] = field(default_factory=list)


def group_rounds(nodes: Iterable[str], k: int, n_rounds: int = 1, seed: int | str = 0,
                 scope: str = "") -> list[GroupRound]:
    """``n_rounds`` partitions of ``nodes`` into rings of ``k``: the remainder forms a smaller ring when it
    has at least two nodes, else it sits the round out (a different node each round, by the shuffle)."""
    if k < 2:
        raise PlanError(f"a ring needs at least 2 nodes, got k={k}")
    if n_rounds < 0:
        raise PlanError(f"the number of group rounds must not be negative, got {n_rounds}")
    base = _checked(nodes)
    out = []
    for r in range(n_rounds):
        order = _shuffled(base, seed, f"{scope}/group{r}")
        groups = [order[i:i + k] for i in range(0, len(order), k)]
        idle = groups.pop() if groups and len(groups[-1]) < 2 else []
        out.append(GroupRound(groups, idle))
    return out


def plan_groups(labels: Mapping[str, Mapping[str, str]] | Iterable[str], k: int, scope_key: str | None = "pool",
                n_rounds: int = 1, seed: int | str = 0) -> list[GroupRound]:
    """Group rounds within each scope, merged: round i holds every scope's i-th partition."""
    if not isinstance(labels, Mapping):
        labels, scope_key = {n: {} for n in _checked(labels)}, None
    groups, _missing = scopes(labels, scope_key)
    per_scope = {name: group_rounds(nodes, k, n_rounds, seed, name) for name, nodes in groups.items()}
    merged = []
    for i in range(n_rounds):
        rounds = [per_scope[name][i] for name in sorted(per_scope)]
        merged.append(GroupRound([g for r in rounds for g in r.groups], [n for r in rounds for n in r.idle]))
    return merged
