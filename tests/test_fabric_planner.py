"""The fabric planner's promises, checked as properties over many fleet sizes: every pair exactly once,
no node twice in a round, N-1 rounds, caps, scopes, rings, determinism."""

from __future__ import annotations

import collections
import itertools

import pytest

from gpuagent.common import pair_planner as P

SIZES = list(range(2, 21)) + [31, 32, 49, 50]


def _nodes(n: int, prefix: str = "node") -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def _assert_rounds_are_matchings(rounds):
    for rnd in rounds:
        ends = [x for pair in rnd for x in pair]
        assert len(ends) == len(set(ends)), f"a node appears twice in round {rnd}"
        assert all(a != b for a, b in rnd)


@pytest.mark.parametrize("n", SIZES)
def test_tournament_covers_every_pair_once_in_n_minus_1_rounds(n):
    nodes = _nodes(n)
    rounds = P.tournament(nodes, seed=7)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n) == P.rounds_for(n)
    _assert_rounds_are_matchings(rounds)
    met = [frozenset(p) for rnd in rounds for p in rnd]
    assert len(met) == len(set(met)), "some pair is planned twice"
    assert set(met) == {frozenset(p) for p in itertools.combinations(nodes, 2)}
    # Every round is as full as it can be: n/2 pairs, one node sitting out when n is odd.
    assert all(len(rnd) == n // 2 for rnd in rounds)
    # Roles alternate: nobody only connects or only listens.
    connects = collections.Counter(a for rnd in rounds for a, _ in rnd)
    listens = collections.Counter(b for rnd in rounds for _, b in rnd)
    assert max(abs(connects[x] - listens[x]) for x in nodes) <= (1 if n % 2 == 0 else 2)


def test_tournament_is_deterministic_for_a_seed_and_ignores_input_order():
    nodes = _nodes(12)
    first = P.tournament(nodes, seed=3)
    assert P.tournament(list(reversed(nodes)), seed=3) == first
    assert P.tournament(nodes, seed=4) != first


def test_tiny_and_bad_inputs():
    assert P.tournament([]) == [] and P.tournament(["a"]) == []
    assert P.rounds_for(1) == 0
    with pytest.raises(P.PlanError, match="listed twice"):
        P.tournament(["a", "b", "a"])
    with pytest.raises(P.PlanError, match="non-empty strings"):
        P.tournament(["a", ""])
    with pytest.raises(P.PlanError, match="not one string"):
        P.tournament("abc")
    with pytest.raises(P.PlanError, match="at least 2 nodes"):
        P.group_rounds(["a", "b"], k=1)


@pytest.mark.parametrize("n,cap", [(10, 2), (11, 2), (50, 7), (49, 1), (20, 100)])
def test_cap_splits_rounds_and_keeps_them_matchings(n, cap):
    plan = P.plan_pairs(_nodes(n), max_pairs_per_round=cap)
    assert all(1 <= len(rnd) <= cap for rnd in plan.rounds)
    _assert_rounds_are_matchings(plan.rounds)
    met = [frozenset(p) for p in plan.pairs()]
    assert len(met) == len(set(met)) == n * (n - 1) // 2
    assert len(plan.rounds) == P.rounds_for(n, cap)
    with pytest.raises(P.PlanError, match="must be positive"):
        P.cap_rounds(plan.rounds, -1)


def test_scopes_plan_each_pool_separately_and_rounds_run_side_by_side():
    labels = {n: {"pool": "a"} for n in _nodes(6, "a")}
    labels |= {n: {"pool": "b"} for n in _nodes(9, "b")}
    labels |= {"loner": {"zone": "x"}}
    plan = P.plan_pairs(labels, scope_key="pool", seed=1)
    assert set(plan.per_scope) == {"a", "b"} and plan.unscoped == ["loner"]
    assert len(plan.rounds) == 9                      # the larger pool's 9 rounds (odd: N rounds)
    _assert_rounds_are_matchings(plan.rounds)
    pool = {n: v.get("pool") for n, v in labels.items()}
    assert all(pool[a] == pool[b] for a, b in plan.pairs()), "a pair crosses pools"
    met = {frozenset(p) for p in plan.pairs()}
    want = {frozenset(p) for p in itertools.combinations(_nodes(6, "a"), 2)} | \
           {frozenset(p) for p in itertools.combinations(_nodes(9, "b"), 2)}
    assert met == want and len(plan.pairs()) == len(want)
    # Scoping by another label.
    by_zone = P.plan_pairs(labels, scope_key="zone")
    assert list(by_zone.per_scope) == ["x"] and by_zone.rounds == [] and len(by_zone.unscoped) == 15
    # With a cap over the merged rounds, pools still never mix and no node appears twice.
    capped = P.plan_pairs(labels, scope_key="pool", max_pairs_per_round=4, seed=1)
    assert all(len(r) <= 4 for r in capped.rounds)
    _assert_rounds_are_matchings(capped.rounds)
    assert {frozenset(p) for p in capped.pairs()} == want


@pytest.mark.parametrize("n,k", [(12, 4), (13, 4), (9, 4), (5, 2), (3, 8)])
def test_group_rounds_are_disjoint_rings_within_a_pool(n, k):
    nodes = _nodes(n)
    rounds = P.group_rounds(nodes, k, n_rounds=4, seed=2)
    assert len(rounds) == 4
    for rnd in rounds:
        members = [x for g in rnd.groups for x in g] + rnd.idle
        assert sorted(members) == nodes, "every node is in exactly one ring or idle"
        assert all(2 <= len(g) <= k for g in rnd.groups)
        assert len(rnd.idle) == (1 if n % k == 1 else 0)
        assert sum(len(g) == k for g in rnd.groups) == n // k
    assert P.group_rounds(nodes, k, 4, seed=2) == rounds
    if n > k + 1:
        assert len({tuple(map(tuple, r.groups)) for r in rounds}) > 1, "rounds reshuffle the rings"


def test_plan_groups_never_mixes_pools():
    labels = {n: {"pool": "a"} for n in _nodes(8, "a")} | {n: {"pool": "b"} for n in _nodes(6, "b")}
    rounds = P.plan_groups(labels, k=4, n_rounds=3)
    for rnd in rounds:
        assert sorted(x for g in rnd.groups for x in g) == sorted(labels)
        assert all(len({labels[x]["pool"] for x in g}) == 1 for g in rnd.groups)
        assert sorted(map(len, rnd.groups)) == [2, 4, 4, 4]


def test_a_thousand_nodes_plan_completely():
    nodes = _nodes(1000)
    plan = P.plan_pairs(nodes, max_pairs_per_round=128)
    assert len(plan.rounds) == P.rounds_for(1000, 128) == 999 * 4
    assert len(plan.pairs()) == 1000 * 999 // 2
    assert len({frozenset(p) for p in plan.pairs()}) == 1000 * 999 // 2
