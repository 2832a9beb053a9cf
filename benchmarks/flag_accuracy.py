#!/usr/bin/env python3
"""Flag accuracy on a SYNTHETIC fleet: recall and false-positive rate of each flag kind.

A real collector (``gpuagent-collector serve`` subprocess on 127.0.0.1) receives one simulated hour from
``gpuagent-sim`` (real protocol, SYNTHETIC data) for a fleet of ``--nodes`` (default 200) nodes: a bare-metal
pool and a cloud pool of virtualized nodes, with conditions injected into some nodes and recorded as node labels
(``inject_*``, docs/FLAGS.md). Then one analysis pass runs on the live collector (the Analyze RPC) and every
open flag of severity warning/critical is scored against the labels, as docs/FLAGS.md says:

- virtualization_overhead per (node, component): positive when ``inject_virt_penalty_<component>`` > threshold;
- noisy_neighbor_variance per node: positive when ``inject_noise_cv`` >= 0.10;
- utilization_gap per (node, component): positive when ``inject_<idle|no_job|input_bound>_fraction`` >= 0.25;
  held_idle is also positive when ``inject_busy_idle_fraction`` >= 0.25: "busy but idle inside" GPUs whose
  utilization counter reads ~90 % while GPM SM activity is 1-5 % (the fleet sends gpu_sm_active_percent,
  ``--gpu-metrics util_gpm``). ``utilization_gap_busy_but_idle`` scores those alone: positives are the
  busy-but-idle nodes, negatives the nodes with neither idle injection, a hit is an open held_idle flag.

- network_degraded (``--fabric-sweeps``, default 2: full pair-wise net_pair sweeps of each pool, SYNTHETIC):
  component ``node`` per node: positive when ``inject_net_factor`` < 0.5 (every link of the node slow);
  component ``link`` per node: positive when the node is an end of an ``inject_net_links`` path, a hit when an
  open link flag names that pair (a link flag naming any other pair is a false positive on its nodes).

Targets: recall >= 0.95 and false-positive rate <= 0.02 for each kind. The planner's time for a 1,000-node
pair-wise plan (one scope, and scoped by this fleet's pools) is reported too.

hardware_fault (``--hardware-nodes``, default 1,000; ``--hardware-only`` for that part alone): a second
SYNTHETIC fleet of 8-GPU nodes with one injected hardware fault on ~45 % of them (``inject_hw_<component>``,
sim/fleet.py; rows from sim.synthetic_rows.hardware_rows written into a real collector database), hard
negatives on ~15 % (counter resets, planned reboots with link flaps, application XIDs of one job) and
sub-threshold noise elsewhere; one real analysis pass; recall and false-positive rate per component.

noisy_neighbor_variance/co_tenant while the episode goes on (``--passive-nodes``, default 200;
``--passive-only`` for that part alone; issue 26): SYNTHETIC ticks of one passively seen job per node
(sim.synthetic_rows.passive_job_rows, 1 s ticks, 10 minutes) written into a real collector database: ~40 %
with a co-tenant that arrives between minute 3 and 8 and is still there at the end (a quarter of them disk
neighbours: little CPU, 80-400 MB/s of disk I/O, I/O pressure; a sixth network neighbours: 30-300 MB/s off the
node, the job's own connections' RTT from 0.2 ms to 2-20 ms or, for half of them, on a link the job fills
itself, its busy send rate divided by 2.5 and its RTT up by a third only), ~10 % with a slower phase of the
job's own (half of them with a command soaking up the CPU it left idle), ~2.5 % with an I/O phase of its own,
~2.5 % with a network phase of its own (its RTT and its own traffic rise; half of them while a command moves
30-300 MB/s on another link), ~2.5 % with a slower phase of its
own while a command moves 30-300 MB/s on another link (the job's connections do not slow), the rest clean; a
third of the jobs without a network neighbour have no connections off the node (no RTT). Real
analysis passes every 60 s (the default interval). A positive is a node with the co-tenant; a hit an open
co_tenant flag on it at the last pass; any open co_tenant flag on another node at any pass is a false
positive. The time from the episode's start to the first pass that showed its flag is reported (median,
max, and the share within two passes).

Findings (95_findings.sql) are scored too: on each node with injected causes (each inject_* label is one
cause), the open findings that name the node, at most 1.5 per cause; every injected cause covered by a
finding of its kind; and a second pool, cloud-pcie, where every node carries the same H2D/D2H penalty, must
give one pool finding rather than one per node.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.analysis.components import KINDS
from gpuagent.collector.store.db import open_readonly
from gpuagent.collector.views.client import analyze as remote_analyze
from gpuagent.common import pair_planner as planner
from gpuagent.sim.run import SimConfig, run_sim
from gpuagent.sim import synthetic_rows as S
from gpuagent.sim.fleet import HW_COMPONENTS, VIRT_COMPONENTS, NodeSpec, validate

VO_THRESHOLD = {c.component: c.threshold for c in A.COMPONENTS if c.kind == "virtualization_overhead"}
GAP = {"held_idle": ("idle_fraction", "busy_idle_fraction"), "no_job": ("no_job_fraction",),
       "input_bound": ("input_bound_fraction",)}


def build_fleet(n: int, seed: int) -> list[NodeSpec]:
    """40 % bare metal, 60 % cloud VMs; conditions injected clear of the thresholds (0 or well above)."""
    rng = random.Random(seed)
    comps = [c for c in VIRT_COMPONENTS if c in VO_THRESHOLD]
    fleet = []
    for i in range(n):
        virtualized = i % 5 >= 2
        inject: dict[str, float] = {}
        r = rng.random()
        if virtualized and r < 0.35:
            for comp in rng.sample(comps, rng.choice((1, 2, 3))):
                inject[f"virt_penalty_{comp}"] = float(rng.choice((4, 6, 8)) if comp == "steal"
                                                       else rng.choice((15, 20, 30, 40)))
        if rng.random() < 0.12:
            inject["noise_cv"] = rng.choice((0.2, 0.3, 0.4))
        u = rng.random()
        if u < 0.1:
            inject["idle_fraction"] = rng.choice((0.4, 0.6))
        elif u < 0.2:
            inject["no_job_fraction"] = rng.choice((0.4, 0.6))
        elif u < 0.3:
            inject["input_bound_fraction"] = rng.choice((0.4, 0.5))
        pool = "cloud-a" if virtualized else "bare-metal"
        fleet.append(NodeSpec(index=i, hostname=f"acc-{i:04d}", pool=pool, virtualized=virtualized,
                              provider="cloud-a" if virtualized else "on-prem",
                              price_per_gpu_hour=3.5 if virtualized else 2.2, inject=inject))
    # Busy-but-idle GPUs from their own generator (the other injections stay as they were): ~10 % of the
    # nodes without another utilization injection.
    brng = random.Random(seed * 104729 + 3)
    for i, node in enumerate(fleet):
        if brng.random() < 0.1 and not any(k in node.inject for k in ("idle_fraction", "no_job_fraction",
                                                                        "input_bound_fraction")):
            fleet[i] = replace(node, inject={**node.inject, "busy_idle_fraction": brng.choice((0.4, 0.6))})
    # Fabric faults from their own generator, so the other injections stay as they were: ~2 % bad nodes, and
    # ~2 % of the nodes one end of a bad path to a healthy peer of the same pool (each node in one at most).
    # Fabric pairs are planned within racks of RACK nodes of a pool (label "rack", the [fabric] scope_key),
    # as a large fleet would scope its sweeps.
    per_pool: dict[str, int] = {}
    for i, node in enumerate(fleet):
        k = per_pool[node.pool] = per_pool.get(node.pool, -1) + 1
        fleet[i] = replace(node, extra_labels={**node.extra_labels, "rack": f"{node.pool}-r{k // RACK}"})
    frng = random.Random(seed * 7919 + 1)
    bad_nodes = {i for i in range(n) if frng.random() < 0.02}
    taken = set(bad_nodes)
    links: dict[int, str] = {}
    for i in range(n):
        if i in taken or frng.random() >= 0.01:
            continue
        rack = fleet[i].extra_labels["rack"]
        peers = [j for j in range(n) if j not in taken and j != i and fleet[j].extra_labels["rack"] == rack]
        if peers:
            j = frng.choice(peers)
            taken |= {i, j}
            links[i] = f"{fleet[j].hostname}:{frng.choice((0.2, 0.3, 0.35))}"
    for i in range(n):
        if i in bad_nodes or i in links:
            inject = dict(fleet[i].inject)
            labels = dict(fleet[i].extra_labels)
            if i in bad_nodes:
                inject["net_factor"] = frng.choice((0.2, 0.25, 0.3))
            if i in links:
                labels["inject_net_links"] = links[i]
            fleet[i] = replace(fleet[i], inject=inject, extra_labels=labels)
    # A pool-wide cause: every node of cloud-pcie has the same PCIe penalty in both directions.
    for j in range(POOL_NODES):
        fleet.append(NodeSpec(index=n + j, hostname=f"acc-pool-{j:03d}", pool=POOL, virtualized=True,
                              provider=POOL, price_per_gpu_hour=3.5, extra_labels={"rack": f"{POOL}-r0"},
                              inject={"virt_penalty_h2d": 20.0, "virt_penalty_d2h": 20.0}))
    return fleet


POOL, POOL_NODES = "cloud-pcie", 9
RACK = 50
CAUSE_KIND = {"virt_penalty": "virtualization_overhead", "noise_cv": "noisy_neighbor_variance",
              "net_factor": "network_degraded", "net_links": "network_degraded",
              "idle_fraction": "utilization_gap", "no_job_fraction": "utilization_gap",
              "input_bound_fraction": "utilization_gap", "busy_idle_fraction": "utilization_gap"}


def _cause_kind(key: str) -> str:
    return next(k for prefix, k in CAUSE_KIND.items() if key.startswith(prefix))


def score_findings(db: Path) -> dict:
    """Findings per injected cause on faulty nodes, causes without a finding, and the pool-wide injection."""
    con = open_readonly(db)
    try:
        nodes = con.execute("SELECT node_id, pool, labels FROM nodes WHERE synthetic").fetchall()
        found = con.execute("SELECT finding_id, scope, kind, node_id, pool, family FROM findings "
                            "WHERE state = 'open' AND severity IN ('warning', 'critical')").fetchall()
        # Which nodes each finding covers, through its flags.
        covers = con.execute("SELECT DISTINCT finding_id, node_id FROM flags WHERE state = 'open' "
                             "AND finding_id IS NOT NULL").fetchall()
    finally:
        con.close()
    by_node: dict[str, set[tuple[str, int]]] = {}
    for fid, node in covers:
        kind = next(f[2] for f in found if f[0] == fid) if any(f[0] == fid for f in found) else None
        if kind:
            by_node.setdefault(node, set()).add((kind, fid))
    causes = findings_on_faulty = 0
    missing = []
    for node_id, pool, labels in nodes:
        lab = dict(labels or {})
        if pool == POOL:
            continue
        # inject_net_links names a pair, not a number; network_degraded is scored per link in score()
        injected = [k[len("inject_"):] for k, v in lab.items()
                    if k.startswith("inject_") and k != "inject_net_links" and float(v) > 0]
        # A VO penalty at or under its threshold is not a cause the analyzer is asked to find.
        injected = [k for k in injected if not (k.startswith("virt_penalty_")
                    and float(lab[f"inject_{k}"]) <= VO_THRESHOLD.get(k[len("virt_penalty_"):], 0))]
        if not injected:
            continue
        causes += len(injected)
        mine = {fid for _kind, fid in by_node.get(node_id, set())
                if next(f[1] for f in found if f[0] == fid) == "node"}
        findings_on_faulty += len(mine)
        kinds = {kind for kind, _fid in by_node.get(node_id, set())}
        missing += [f"{node_id}:{k}" for k in injected if _cause_kind(k) not in kinds]
    pool_findings = [f for f in found if f[4] == POOL]
    return {"injected_causes_on_faulty_nodes": causes,
            "node_findings_on_faulty_nodes": findings_on_faulty,
            "findings_per_cause": round(findings_on_faulty / causes, 3) if causes else None,
            "causes_without_a_finding": len(missing), "causes_without_a_finding_first": missing[:10],
            "pool_wide_injection": {"pool": POOL, "nodes": POOL_NODES, "findings": len(pool_findings),
                                    "scopes": sorted({f[1] for f in pool_findings})},
            "open_findings": len(found),
            "meets_target": bool(causes and findings_on_faulty / causes <= 1.5 and not missing
                                 and len(pool_findings) == 1 and pool_findings[0][1] == "pool")}


def start_collector(db: Path, workdir: Path):
    port_file = workdir / "port"
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                             "--db", str(db), "--port-file", str(port_file), "--no-analyze", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the collector did not start: {proc.communicate()[1]}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def score(db: Path) -> dict:
    con = open_readonly(db)
    try:
        nodes = con.execute("SELECT node_id, virtualized, labels FROM nodes WHERE synthetic").fetchall()
        flagged = con.execute("""SELECT DISTINCT node_id, kind, component FROM flags
                                 WHERE state = 'open' AND severity IN ('warning', 'critical')""").fetchall()
        link_flags = con.execute("""SELECT node_id, json_extract_string(evidence, '$.pair[1]') FROM flags
                                    WHERE state = 'open' AND severity IN ('warning', 'critical')
                                      AND kind = 'network_degraded' AND component = 'link'""").fetchall()
        hosts = dict(con.execute("SELECT hostname, node_id FROM nodes WHERE synthetic").fetchall())
    finally:
        con.close()
    have = {(n, k, c) for n, k, c in flagged}
    have_kind = {(n, k) for n, k, _ in flagged}
    counts = {k: {"tp": 0, "fn": 0, "fp": 0, "tn": 0} for k in KINDS if k != "network_degraded"}
    counts.update({k: {"tp": 0, "fn": 0, "fp": 0, "tn": 0}
                   for k in ("network_degraded_node", "network_degraded_link", "utilization_gap_busy_but_idle")})
    # virtualization_overhead split by whether the node also had injected noise: a penalty near the threshold
    # on a node whose runs scatter by CV 0.2-0.4 is statistically hard to call from ~12 runs.
    split = {k: {"tp": 0, "fn": 0, "fp": 0, "tn": 0} for k in ("nodes_without_noise", "nodes_with_noise")}

    def count(kind, truth, predicted, noisy=False):
        key = ("tp" if predicted else "fn") if truth else ("fp" if predicted else "tn")
        counts[kind][key] += 1
        if kind == "virtualization_overhead":
            split["nodes_with_noise" if noisy else "nodes_without_noise"][key] += 1

    # network_degraded/link: the injected paths, as node-id pairs, and the pairs the open link flags name.
    bad_links: set[frozenset] = set()
    for node_id, _virt, labels in nodes:
        for item in filter(None, dict(labels or {}).get("inject_net_links", "").split(",")):
            bad_links.add(frozenset((node_id, hosts[item.rpartition(":")[0]])))
    flagged_links = {frozenset(p) for p in link_flags}
    on_bad_link = {n for pair in bad_links for n in pair}
    on_flagged_link = {n for pair in flagged_links for n in pair}
    link_hit = {n for pair in bad_links & flagged_links for n in pair}
    for node_id, _virt, labels in nodes:
        lab = dict(labels or {})
        count("network_degraded_node", float(lab.get("inject_net_factor", 1)) < 0.5,
              (node_id, "network_degraded", "node") in have)
        truth = node_id in on_bad_link
        count("network_degraded_link", truth, node_id in link_hit if truth else node_id in on_flagged_link)
        for comp, thr in VO_THRESHOLD.items():
            p = float(lab.get(f"inject_virt_penalty_{comp}", 0))
            if 0 < p <= thr:
                continue  # inside the threshold band: neither a positive nor a clean negative
            count("virtualization_overhead", p > thr, (node_id, "virtualization_overhead", comp) in have,
                  float(lab.get("inject_noise_cv", 0)) >= 0.10)
        cv = float(lab.get("inject_noise_cv", 0))
        count("noisy_neighbor_variance", cv >= 0.10, (node_id, "noisy_neighbor_variance") in have_kind)
        for comp, keys in GAP.items():
            f = max(float(lab.get(f"inject_{key}", 0)) for key in keys)
            count("utilization_gap", f >= 0.25, (node_id, "utilization_gap", comp) in have)
        bi, idle = float(lab.get("inject_busy_idle_fraction", 0)), float(lab.get("inject_idle_fraction", 0))
        if bi >= 0.25 or idle == 0:
            count("utilization_gap_busy_but_idle", bi >= 0.25, (node_id, "utilization_gap", "held_idle") in have)
    kinds = {}
    for kind, c in counts.items():
        pos, neg = c["tp"] + c["fn"], c["fp"] + c["tn"]
        kinds[kind] = {"recall": round(c["tp"] / pos, 4) if pos else None,
                       "false_positive_rate": round(c["fp"] / neg, 4) if neg else None,
                       "positives": pos, "negatives": neg, **c,
                       "meets_target": bool(pos and c["tp"] / pos >= 0.95 and (c["fp"] / neg if neg else 0) <= 0.02)}
    kinds["virtualization_overhead"]["split"] = {
        name: {"recall": round(c["tp"] / (c["tp"] + c["fn"]), 4) if c["tp"] + c["fn"] else None,
               "false_positive_rate": round(c["fp"] / (c["fp"] + c["tn"]), 4) if c["fp"] + c["tn"] else None, **c}
        for name, c in split.items()}
    kinds["network_degraded_link"]["links"] = {"injected": len(bad_links), "flagged": len(flagged_links),
                                               "found": len(bad_links & flagged_links)}
    return {"kinds": kinds, "nodes": len(nodes)}


def planner_time(fleet: list[NodeSpec], n: int = 1000) -> dict:
    """Seconds to plan a full pair-wise sweep of ``n`` nodes: one scope, and scoped by the fleet's pools."""
    nodes = [f"plan-{i:04d}" for i in range(n)]
    pools = {nodes[i]: {"pool": fleet[i % len(fleet)].pool} for i in range(n)}
    out = {"nodes": n}
    for name, labels, key in (("one_scope", nodes, None), ("by_pool", pools, "pool")):
        t0 = time.perf_counter()
        plan = planner.plan_pairs(labels, key) if key else planner.plan_pairs(labels)
        out[name] = {"seconds": round(time.perf_counter() - t0, 4), "rounds": len(plan.rounds),
                     "pairs": len(plan.pairs())}
    return out


# ------------------------------------------------------------------------------------ hardware_fault

HW_NOW = dt.datetime(2026, 1, 1, 12, 0)


def build_hw_fleet(n: int, seed: int) -> list[NodeSpec]:
    """SYNTHETIC 8-GPU nodes: ~45 % with one injected hardware fault (each class in both its forms, in turn),
    ~15 % with a condition that must raise nothing (a counter reset, a planned reboot's link flap, an
    application XID of one job), the rest healthy with sub-threshold background noise."""
    rng = random.Random(seed)
    fleet = []
    for i in range(n):
        r = rng.random()
        inject: dict[str, float] = {}
        if r < 0.45:
            inject[f"hw_{HW_COMPONENTS[i % len(HW_COMPONENTS)]}"] = 1 + (i // len(HW_COMPONENTS)) % 2
        elif r < 0.60:
            inject[("hw_reset", "hw_reboot", "hw_app_xid")[i % 3]] = 1
        fleet.append(NodeSpec(index=i, hostname=f"hw-{i:04d}", pool=("hw-a", "hw-b")[i % 2], virtualized=False,
                              inject=inject))
    return fleet


class _SampleBatches:
    """Sample rows into the database in batches of ~400,000 (Arrow), counting them."""

    def __init__(self, con) -> None:
        self.con, self.rows, self.total = con, [], 0

    def add(self, rows: list[tuple]) -> None:
        self.rows += rows
        if len(self.rows) > 400_000:
            self.flush()

    def flush(self) -> None:
        S.add_samples(self.con, self.rows)
        self.total += len(self.rows)
        self.rows = []


def hardware_accuracy(n: int, seed: int, db: Path) -> dict:
    """Inject hardware faults into a SYNTHETIC fleet of n nodes (sim.synthetic_rows, the contract's metric and
    event names, written into a real collector database), run one real analysis pass, and score the
    hardware_fault flags per component: a positive is a node injected with that class, a hit an open flag of
    that component on it; any flag of a component on a node not injected with it is a false positive."""
    import duckdb  # noqa: PLC0415 - collector extra

    from gpuagent.collector.store import schema  # noqa: PLC0415

    fleet = [validate(node) for node in build_hw_fleet(n, seed)]
    rng = random.Random(seed + 1)
    start = HW_NOW - dt.timedelta(minutes=55)
    con = duckdb.connect(str(db))
    t0 = time.perf_counter()
    expected: dict[str, tuple[str, str, int]] = {}
    try:
        schema.migrate(con)
        batch = _SampleBatches(con)
        for node in fleet:
            S.add_node(con, node.hostname, virtualized=False, pool=node.pool, labels=node.labels(), now=start)
            fault, variant = S.hardware_injection(node.inject)
            gpu = rng.randrange(node.gpu_count)
            rows, events = S.hardware_rows(node.hostname, start=start, gpus=node.gpu_count, fault=fault,
                                           variant=variant, fault_gpu=gpu, rng=random.Random(f"{seed}-{node.index}"),
                                           at=rng.randrange(2, 12), magnitude=rng.uniform(0.5, 3.0))
            if fault in HW_COMPONENTS and variant != "app":
                expected[node.hostname] = (fault, variant, gpu)
            batch.add(rows)
            S.add_events(con, events)
        batch.flush()
        rows_total = batch.total
    finally:
        con.close()
    write_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    res = A.analyze_db(db, now=HW_NOW)
    pass_s = time.perf_counter() - t1
    con = open_readonly(db)
    try:
        flags = con.execute("SELECT node_id, gpu, component, severity FROM flags WHERE kind = 'hardware_fault' "
                            "AND state = 'open' AND severity IN ('warning', 'critical')").fetchall()
        findings = con.execute("SELECT count(*) FROM findings WHERE kind = 'hardware_fault' AND state = 'open'"
                               ).fetchone()[0]
    finally:
        con.close()
    flagged: dict[tuple[str, str], list[tuple]] = {}
    for node, gpu, comp, sev in flags:
        flagged.setdefault((node, comp), []).append((gpu, sev))
    per: dict[str, dict] = {}
    for comp in HW_COMPONENTS:
        tp = fn = fp = tn = right_gpu = 0
        for node in fleet:
            pos = expected.get(node.hostname, ("",))[0] == comp
            hit = (node.hostname, comp) in flagged
            if pos and hit:
                tp += 1
                gpu = expected[node.hostname][2]
                right_gpu += any(g in (gpu, None) for g, _ in flagged[(node.hostname, comp)])
            elif pos:
                fn += 1
            elif hit:
                fp += 1
            else:
                tn += 1
        per[comp] = {"recall": round(tp / (tp + fn), 4) if tp + fn else None,
                     "false_positive_rate": round(fp / (fp + tn), 4) if fp + tn else None,
                     "tp": tp, "fn": fn, "fp": fp, "tn": tn, "flag_on_the_injected_gpu": right_gpu}
    return {"nodes": n, "gpus_per_node": 8, "faulty_nodes": len(expected),
            "hard_negative_nodes": sum(1 for x in fleet if any(k in x.inject for k in ("hw_reset", "hw_reboot",
                                                                                         "hw_app_xid"))),
            "components": per, "open_hardware_findings": findings, "sample_rows": rows_total,
            "write_s": round(write_s, 1), "analysis_pass_s": round(pass_s, 1),
            "hardware_fault_step_s": round(res.step_s.get("70_hardware_fault.sql", 0.0), 2),
            "targets_met": all(c["recall"] is not None and c["recall"] >= 0.95 and c["false_positive_rate"] <= 0.02
                               for c in per.values()),
            "data": "SYNTHETIC hardware telemetry (sim.synthetic_rows.hardware_rows) in a real collector database; "
                    "real analyzer pass"}


# ------------------------------------------------------------------------ passive co_tenant, ongoing

def passive_accuracy(n: int, seed: int, db: Path) -> dict:
    """Ongoing passive noisy-neighbour episodes on a SYNTHETIC fleet (see the module doc), scored per pass."""
    import duckdb  # noqa: PLC0415 - collector extra

    from gpuagent.collector.store import schema  # noqa: PLC0415

    rng = random.Random(seed + 26)
    start, seconds = HW_NOW - dt.timedelta(minutes=10), 600
    con = duckdb.connect(str(db))
    onset: dict[str, float] = {}
    kinds: dict[str, str] = {}
    try:
        schema.migrate(con)
        batch = _SampleBatches(con)
        for i in range(n):
            node = f"passive-{i:04d}"
            S.add_node(con, node, virtualized=False, gpu_count=0, pool="passive", now=start,
                       labels={"inject_passive": "1"})
            r = rng.random()
            kw: dict = {}
            if r < 0.40:
                t0 = rng.uniform(180, 480)
                onset[node] = t0
                kw = dict(contention=(t0, None), lost=rng.choice((0.3, 0.45, 0.6)),
                          neighbour=rng.choice(("stress-ng-cpu", "stress-ng-cache", "ffmpeg", "java")),
                          neighbour_cpu=rng.uniform(80, 200), psi_contended=rng.uniform(30, 80))
                kinds[node] = "co_tenant"
                if r < 0.10:        # a quarter of them take the disk, not the CPU
                    kw.update(neighbour=rng.choice(("fio", "rsync", "tar")),
                              neighbour_io_mb_per_s=rng.uniform(80, 400))
                    kinds[node] = "co_tenant_disk"
                elif r < 0.1667:    # a sixth take the network: the job's packets queue behind theirs
                    kw.update(neighbour=rng.choice(("rclone", "aws", "iperf3", "nccl-tests")),
                              neighbour_net_mb_per_s=rng.uniform(30, 300), rtt_contended_ms=rng.uniform(2, 20),
                              job_fills_link=rng.random() < 0.5)
                    kinds[node] = "co_tenant_net"
            elif r < 0.55:
                t0 = rng.uniform(180, 480)
                phase = (t0, t0 + rng.uniform(60, 200))
                if r < 0.50:
                    kw = dict(own_phase=phase, own_drop=rng.uniform(0.3, 0.7),
                              filler="backup" if rng.random() < 0.5 else None)
                    kinds[node] = "own_phase_with_filler" if kw["filler"] else "own_phase"
                elif r < 0.525:     # its own I/O phase (a checkpoint): I/O pressure rises, nobody else's I/O
                    kw = dict(own_io_phase=phase, own_drop=rng.uniform(0.3, 0.7))
                    kinds[node] = "own_io_phase"
                else:               # its own network phase (a shard download): its RTT rises, nobody else's bytes
                    kw = dict(own_net_phase=phase, own_drop=rng.uniform(0.3, 0.7), rtt_contended_ms=rng.uniform(2, 20),
                              filler_net_mb_per_s=rng.uniform(30, 300) if rng.random() < 0.5 else None)
                    kinds[node] = "own_net_phase"
            elif r < 0.575:         # its own slower phase while a command uses another link: no slowdown of its own
                t0 = rng.uniform(180, 480)
                kw = dict(contention=(t0, t0 + rng.uniform(60, 200)), lost=rng.uniform(0.3, 0.7),
                          neighbour=rng.choice(("rclone", "aws")), neighbour_net_mb_per_s=rng.uniform(30, 300),
                          rtt_contended_ms=0.21)
                kinds[node] = "net_traffic_elsewhere"
            else:
                kinds[node] = "clean"
            if kinds[node] not in ("co_tenant_net", "own_net_phase", "net_traffic_elsewhere") and rng.random() < 1 / 3:
                kw["rtt_ms"] = None     # a job with no connections off the node
            source = "gpu_util" if rng.random() < 0.3 else "cpu_share"
            rows, _ = S.passive_job_rows(node, "job-" + node, start=start, seconds=seconds, source=source,
                                         progress=90.0 if source == "gpu_util" else rng.uniform(100, 190),
                                         rng=random.Random(f"{seed}-p{i}"), **kw)
            batch.add(rows)
        batch.flush()
        rows_total = batch.total
    finally:
        con.close()
    first_seen: dict[str, float] = {}
    false_pos: set[str] = set()
    pass_s = []
    for k in range(3, 11):                      # passes at minutes 3..10 of the job
        at = start + dt.timedelta(seconds=60 * k)
        t1 = time.perf_counter()
        A.analyze_db(db, now=at)
        pass_s.append(time.perf_counter() - t1)
        con = open_readonly(db)
        try:
            open_nodes = {r[0] for r in con.execute(
                "SELECT node_id FROM flags WHERE state = 'open' AND kind = 'noisy_neighbor_variance' "
                "AND component = 'co_tenant'").fetchall()}
        finally:
            con.close()
        for node in open_nodes:
            if node in onset and onset[node] < 60 * k:
                first_seen.setdefault(node, 60 * k - onset[node])
            else:
                false_pos.add(node)
    tp = sum(1 for node in onset if node in open_nodes)     # open at the last pass
    negatives = [node for node in kinds if node not in onset]
    fp = sum(1 for node in negatives if node in false_pos)
    delays = sorted(first_seen.values())
    by_kind = {kind: {"nodes": sum(1 for v in kinds.values() if v == kind),
                      "false_positives": sum(1 for node, v in kinds.items() if v == kind and node in false_pos)}
               for kind in ("own_phase", "own_phase_with_filler", "own_io_phase", "own_net_phase",
                            "net_traffic_elsewhere", "clean")}
    disk = [node for node, v in kinds.items() if v == "co_tenant_disk"]
    disk_tp = sum(1 for node in disk if node in open_nodes)
    net = [node for node, v in kinds.items() if v == "co_tenant_net"]
    net_tp = sum(1 for node in net if node in open_nodes)
    return {"nodes": n, "with_co_tenant": len(onset), "recall": round(tp / len(onset), 4) if onset else None,
            "with_disk_co_tenant": len(disk), "recall_disk": round(disk_tp / len(disk), 4) if disk else None,
            "with_network_co_tenant": len(net), "recall_network": round(net_tp / len(net), 4) if net else None,
            "false_positive_rate": round(fp / len(negatives), 4) if negatives else None,
            "tp": tp, "fn": len(onset) - tp, "fp": fp, "tn": len(negatives) - fp, "negatives": by_kind,
            "episode_start_to_flag_s": {"median": round(statistics.median(delays), 1) if delays else None,
                                        "max": round(delays[-1], 1) if delays else None,
                                        "within_two_passes": round(sum(d <= 120 for d in delays) / len(delays), 4)
                                        if delays else None},
            "analysis_interval_s": 60, "passes": len(pass_s),
            "pass_s_median": round(statistics.median(pass_s), 2), "sample_rows": rows_total,
            "targets_met": bool(onset) and tp / len(onset) >= 0.95 and fp / max(1, len(negatives)) <= 0.02,
            "data": "SYNTHETIC passive job ticks (sim.synthetic_rows.passive_job_rows) in a real collector "
                    "database; real analyzer passes every 60 s of simulated time"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sim-hours", type=float, default=1.0)
    ap.add_argument("--interval-s", type=float, default=10.0, help="simulated sample interval")
    ap.add_argument("--summary-interval-s", type=float, default=60.0,
                    help="the agents' resolution (docs/RESOLUTION.md): 60, their default, or 0 for every sample raw")
    ap.add_argument("--probe-interval-s", type=float, default=300.0)
    ap.add_argument("--procs", type=int, default=1, help="simulator processes")
    ap.add_argument("--fabric-sweeps", type=int, default=2, help="SYNTHETIC pair-wise sweeps per pool (0: none)")
    ap.add_argument("--db", help="keep the database here (default: a temporary file)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hardware-nodes", type=int, default=1000,
                    help="nodes of the SYNTHETIC hardware-fault fleet (0: skip that part)")
    ap.add_argument("--hardware-only", action="store_true", help="score only the hardware_fault flags")
    ap.add_argument("--passive-nodes", type=int, default=200,
                    help="nodes of the SYNTHETIC passive-job fleet with ongoing co-tenants (0: skip that part)")
    ap.add_argument("--passive-only", action="store_true", help="score only the ongoing passive co_tenant flags")
    ap.add_argument("--score-db", metavar="FILE",
                    help="no simulation: one analysis pass on a database an earlier run kept (--db), as the "
                         "collector's analyze_db runs it (its memory limit), over all of its samples, then score it")
    ap.add_argument("--analyze-timeout-s", type=float, default=3600.0,
                    help="how long the Analyze call may take (a 30,000-node pass ran past the client's 300 s)")
    args = ap.parse_args(argv)
    if args.score_db:
        out = score_kept_db(Path(args.score_db))
        print(json.dumps(out, indent=2) if args.json else json.dumps(out["kinds"], indent=1))
        return 0

    tmp = tempfile.TemporaryDirectory(prefix="gpuagent-accuracy-")
    work = Path(tmp.name)
    passive = (passive_accuracy(args.passive_nodes, args.seed, work / "passive.duckdb")
               if args.passive_nodes else None)
    if args.passive_only:
        tmp.cleanup()
        out = {"benchmark": "flag_accuracy", "seed": args.seed, "noisy_neighbor_passive_ongoing": passive}
        print(json.dumps(out, indent=2) if args.json else _passive_text(passive))
        return 0
    hw = hardware_accuracy(args.hardware_nodes, args.seed, work / "hardware.duckdb") if args.hardware_nodes else None
    if args.hardware_only:
        tmp.cleanup()
        out = {"benchmark": "flag_accuracy", "seed": args.seed, "hardware_fault": hw}
        if args.json:
            print(json.dumps(out, indent=2))
        else:
            _print_hw(hw)
        return 0
    db = Path(args.db) if args.db else work / "accuracy.duckdb"
    fleet = build_fleet(args.nodes, args.seed)
    proc, target = start_collector(db, work)
    try:
        t0 = time.perf_counter()
        summary = run_sim(SimConfig(collector=target, sim_hours=args.sim_hours, interval_s=args.interval_s,
                                    probe_interval_s=args.probe_interval_s, gpu_metrics="util_gpm", seed=args.seed,
                                    procs=args.procs, prefix="acc", fabric_sweeps=args.fabric_sweeps, fabric_scope="rack",
                                    summary_interval_s=args.summary_interval_s), fleet)
        sim_s = time.perf_counter() - t0
        if summary.errors:
            raise SystemExit(f"the simulator reported errors: {summary.errors[:3]}")
        t1 = time.perf_counter()
        # The simulated hour ends when the simulator started (its rows are stamped up to then), and ingest of a
        # large fleet takes many minutes of real time: the window reaches back over both, so the pass sees the
        # whole simulated hour (a 10,000-node hour took 19 min to ingest; a 1 h window missed its first 20 min).
        res = remote_analyze(target, window_s=args.sim_hours * 3600.0 + sim_s + 60.0, max_flags=1,
                             timeout_s=args.analyze_timeout_s)
        analyze_s = time.perf_counter() - t1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    out = score(db)
    out["findings"] = score_findings(db)
    out["planner"] = planner_time(fleet)
    out.update({
        "benchmark": "flag_accuracy",
        "data": "SYNTHETIC fleet from gpuagent-sim over the real protocol to a real collector; real analyzer",
        "seed": args.seed, "sim_hours": args.sim_hours, "sample_interval_s": args.interval_s,
        "summary_interval_s": args.summary_interval_s, "probe_interval_s": args.probe_interval_s,
        "injected_nodes": sum(1 for n in fleet if n.inject or n.extra_labels), "fabric_sweeps": args.fabric_sweeps,
        "sim": {"samples": summary.samples, "probe_results": summary.probe_results,
                "batches_acked": summary.batches_acked, "wall_s": round(sim_s, 1)},
        "analysis_pass": res.run, "analyze_rpc_s": round(analyze_s, 2),
        "hardware_fault": hw,
        "noisy_neighbor_passive_ongoing": passive,
    })
    tmp.cleanup()
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for kind, k in out["kinds"].items():
            print(f"{kind}: recall {k['recall']}, false-positive rate {k['false_positive_rate']} "
                  f"(tp {k['tp']} fn {k['fn']} fp {k['fp']} tn {k['tn']})")
        f = out["findings"]
        print(f"findings: {f['node_findings_on_faulty_nodes']} on faulty nodes for {f['injected_causes_on_faulty_nodes']} "
              f"injected causes ({f['findings_per_cause']} per cause), {f['causes_without_a_finding']} causes "
              f"without a finding; pool-wide injection on {POOL}: {f['pool_wide_injection']['findings']} finding(s) "
              f"{f['pool_wide_injection']['scopes']}; {f['open_findings']} open findings in all")
        if hw:
            _print_hw(hw)
        if passive:
            print(_passive_text(passive))
        pl = out["planner"]
        print(f"planner, {pl['nodes']} nodes: {pl['one_scope']['seconds']} s in one scope "
              f"({pl['one_scope']['rounds']} rounds), {pl['by_pool']['seconds']} s by pool")
    return 0


def score_kept_db(db: Path) -> dict:
    """One pass on a kept database and its scores: the window covers every sample it holds (ending at the
    newest), as the benchmark's own pass would; the pass's time, the process's peak RSS and DuckDB's accounted
    memory at the end are reported with it."""
    import resource  # noqa: PLC0415

    with open_readonly(str(db)) as con:
        first, last = con.execute("SELECT min(ts), max(ts) FROM samples").fetchone()
        counts = con.execute("SELECT (SELECT count(*) FROM nodes), (SELECT count(*) FROM samples), "
                             "(SELECT count(*) FROM probe_results)").fetchone()
    window_s = (last - first).total_seconds() + 60.0
    config = A.with_window(A.AnalyzerConfig(), window_s)
    t = time.perf_counter()
    res = A.analyze_db(db, config, now=last + dt.timedelta(seconds=1))
    pass_s = time.perf_counter() - t
    out = score(db)
    out["findings"] = score_findings(db)
    out.update({"benchmark": "flag_accuracy", "mode": "score_kept_db", "db": str(db),
                "data": "SYNTHETIC fleet kept from an earlier run (gpuagent-sim over the real protocol); real analyzer",
                "nodes": counts[0], "sample_rows": counts[1], "probe_results": counts[2],
                "window_s": round(window_s, 1), "analysis_pass": res.as_dict(), "pass_wall_s": round(pass_s, 1),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    return out


def _passive_text(p: dict | None) -> str:
    if not p:
        return "noisy_neighbor_variance/co_tenant, ongoing: skipped"
    d = p["episode_start_to_flag_s"]
    return (f"noisy_neighbor_variance/co_tenant, ongoing, on {p['nodes']} SYNTHETIC nodes: recall {p['recall']}, "
            f"false-positive rate {p['false_positive_rate']} (tp {p['tp']} fn {p['fn']} fp {p['fp']} tn {p['tn']}); "
            f"episode start to flag: median {d['median']} s, max {d['max']} s, "
            f"{d['within_two_passes']} within two passes")


def _print_hw(hw: dict | None) -> None:
    if not hw:
        return
    print(f"hardware_fault on {hw['nodes']} SYNTHETIC nodes ({hw['faulty_nodes']} faulty, "
          f"{hw['hard_negative_nodes']} hard negatives), analysis pass {hw['analysis_pass_s']} s:")
    for comp, k in hw["components"].items():
        print(f"  {comp}: recall {k['recall']}, false-positive rate {k['false_positive_rate']} "
              f"(tp {k['tp']} fn {k['fn']} fp {k['fp']} tn {k['tn']})")


if __name__ == "__main__":
    sys.exit(main())
