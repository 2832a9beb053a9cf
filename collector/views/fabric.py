"""``gpuagent-collector fabric``: the pair-wise plan, the last round, the link matrix, the worst nodes and links.

Reads a DuckDB file (read-only) or a live collector through its Query RPC, like ``compare`` (the SQL is
plain DuckDB with literals only). The plan is the planner's tournament over the nodes registered and seen
within the window, scoped and capped as the collector config's [fabric] says (defaults without one); the
coordinator plans the nodes holding an Assignments stream at that moment, which this cannot see, so the
plan shown is the one those nodes would get.

A link's rate is the slower of its two directions (Gbit/s), as in 59_network_links.sql; "slow" is under
``slow_fraction`` x the median of the per-node medians of its pool.

The cheap layer (path probes: coverage per pool and the suspect paths of the last hour) is read by
fabric_paths.py and shown here by ``render_paths`` (JSON key ``paths``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from gpuagent.collector.fabric.coordinator import FabricConfig
from gpuagent.collector.views.compare import CompareError, _lit, has_table, open_source, parse_window
from gpuagent.collector.views.fabric_paths import build_paths, has_column as _has_column
from gpuagent.common import pair_planner as planner

ROUND_RE = re.compile(r"^(.+-r\d+)-\d+$")     # coordinator pair ids: {run tag}-r{round}-{n}

SQL_NEWEST = "SELECT epoch(max(started_at)) AS newest FROM link_results"
SQL_NEWEST_NODE = "SELECT epoch(max(last_seen)) AS newest FROM nodes"

SQL_NODES = """
SELECT node_id, hostname, coalesce(pool, '') AS pool, map_keys(labels) AS k, map_values(labels) AS v
FROM nodes WHERE last_seen >= to_timestamp({start})::TIMESTAMP ORDER BY node_id
"""

# The newest row carrying a round in its pair id names the last round; every row of that round follows.
SQL_LAST_ROUND_KEY = """
SELECT regexp_extract(pair_id, '^(.+-r[0-9]+)-[0-9]+$', 1) AS round_key
FROM link_results WHERE probe = 'net_pair' AND regexp_matches(pair_id, '^.+-r[0-9]+-[0-9]+$')
ORDER BY started_at DESC LIMIT 1
"""

SQL_ROUND_ROWS = """
SELECT * EXCLUDE (rn) FROM (
    SELECT pair_id, node_a, node_b, status, reason, send_gbits_per_s AS send, recv_gbits_per_s AS recv,
           rtt_p50_us, rtt_p99_us, epoch(started_at) AS started, reported_by,
           row_number() OVER (PARTITION BY coalesce(pair_id, node_a || '|' || node_b || started_at::VARCHAR)
                              ORDER BY (reported_by = node_a) DESC, (reported_by = 'collector'), reported_by) AS rn
    FROM link_results WHERE probe = 'net_pair' AND {where})
WHERE rn = 1 ORDER BY node_a, node_b
"""

# Without round numbers in the pair ids: the runs that overlap the newest run's start (a round's pairs
# run side by side and the next round starts after all of them ended).
SQL_OVERLAP = """started_at <= (SELECT max(started_at) FROM link_results WHERE probe = 'net_pair')
  AND ended_at >= (SELECT max(started_at) FROM link_results WHERE probe = 'net_pair')"""

# Per link: the median of its last ok runs in the window, per probe settings (one row per run).
SQL_LINKS = """
WITH runs AS (
    SELECT least(node_a, node_b) AS a, greatest(node_a, node_b) AS b, coalesce(params_key, '') AS params_key,
           started_at, least(send_gbits_per_s, recv_gbits_per_s) AS gbits, send_gbits_per_s AS send,
           recv_gbits_per_s AS recv, rtt_p50_us, rtt_p99_us
    FROM link_results
    WHERE probe = 'net_pair' AND status = 'ok' AND isfinite(send_gbits_per_s) AND isfinite(recv_gbits_per_s)
      AND started_at >= to_timestamp({start})::TIMESTAMP
    QUALIFY row_number() OVER (PARTITION BY coalesce(pair_id, node_a || '|' || node_b || started_at::VARCHAR)
                               ORDER BY (reported_by = node_a) DESC, reported_by) = 1
), recent AS (
    SELECT *, row_number() OVER (PARTITION BY a, b, params_key ORDER BY started_at DESC) AS rn FROM runs
)
SELECT r.a, r.b, r.params_key, coalesce(na.pool, '') AS pool_a, coalesce(nb.pool, '') AS pool_b,
       median(r.gbits) AS gbits, median(r.send) AS send, median(r.recv) AS recv,
       median(r.rtt_p50_us) AS rtt_p50_us, median(r.rtt_p99_us) AS rtt_p99_us, count(*) AS runs,
       epoch(max(r.started_at)) AS last_at
FROM recent r LEFT JOIN nodes na ON na.node_id = r.a LEFT JOIN nodes nb ON nb.node_id = r.b
WHERE r.rn <= {runs}
GROUP BY ALL
"""

SQL_FLAGS = """
SELECT node_id, component, severity, sentence, evidence FROM flags
WHERE kind = 'network_degraded' AND state = 'open'
"""


# The newest run of each collective group (rank 0's row) and each rdma_pair link in the window.
SQL_GROUPS = """
SELECT members, group_size, status, backend, world_size, busbw_gbytes_per_s, algbw_gbytes_per_s,
       small_msg_latency_us, largest_bytes, epoch(started_at) AS started, reason
FROM group_results_latest WHERE started_at >= to_timestamp({start})::TIMESTAMP
ORDER BY busbw_gbytes_per_s NULLS LAST, members"""
SQL_RDMA = """
SELECT node_a, node_b, status, write_gbits_per_s, lat_typical_us, epoch(started_at) AS started, reason
FROM link_matrix_latest
WHERE probe = 'rdma_pair' AND started_at >= to_timestamp({start})::TIMESTAMP
ORDER BY write_gbits_per_s NULLS LAST, node_a, node_b"""


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


@dataclass
class FabricView:
    window_s: float
    plan: dict[str, Any]
    last_round: dict[str, Any]
    links: list[dict[str, Any]]            # every link, worst (lowest share of its pool median) first
    nodes: list[dict[str, Any]]            # every node with links, worst first
    flags: list[dict[str, Any]]
    slow_fraction: float
    synthetic: bool = False
    notes: list[str] = field(default_factory=list)
    groups: list[dict[str, Any]] = field(default_factory=list)   # newest run per collective group, slowest first
    rdma: list[dict[str, Any]] = field(default_factory=list)     # newest rdma_pair run per link, slowest first
    paths: dict[str, Any] = field(default_factory=dict)          # the cheap layer (fabric_paths.build_paths)


def build_view(src, window: str = "24h", config: FabricConfig | None = None, runs: int = 3,
               slow_fraction: float = 0.5) -> FabricView:
    """Everything the command shows, from one source (DbSource or RpcSource)."""
    config = config or FabricConfig()
    seconds = parse_window(window)
    notes: list[str] = []
    if not has_table(src, "link_results"):
        raise CompareError("this database has no link_results table: its collector predates fabric probes")
    newest = src.query(SQL_NEWEST)[0]["newest"] or src.query(SQL_NEWEST_NODE)[0]["newest"]
    if newest is None:
        raise CompareError("no nodes and no fabric results are stored yet")
    start = float(newest) - seconds

    node_rows = src.query(SQL_NODES.format(start=f"{start:.6f}"))
    labels = {r["node_id"]: dict(zip(r["k"] or [], r["v"] or [])) for r in node_rows}
    hostnames = {r["node_id"]: r["hostname"] for r in node_rows}
    synthetic = any(lab.get("synthetic") == "true" for lab in labels.values())
    try:
        p = planner.plan_pairs(labels, config.scope_key, config.max_pairs_per_round or None, seed=config.seed)
        plan = {"nodes": len(labels), "scope_key": config.scope_key, "scopes": {k: len(v) for k, v in
                                                                               planner.scopes(labels, config.scope_key)[0].items()},
                "unscoped": p.unscoped, "max_pairs_per_round": config.max_pairs_per_round or None,
                "rounds": [[list(pair) for pair in rnd] for rnd in p.rounds], "pairs": len(p.pairs())}
    except planner.PlanError as exc:
        plan = {"nodes": len(labels), "error": str(exc), "rounds": [], "pairs": 0}

    key_rows = src.query(SQL_LAST_ROUND_KEY)
    if key_rows and key_rows[0]["round_key"]:
        key = key_rows[0]["round_key"]
        rows = src.query(SQL_ROUND_ROWS.format(where=f"starts_with(pair_id, {_lit(key + '-')})"))
        last_round = {"round": key, "how": "pair ids", "pairs": rows}
    else:
        rows = src.query(SQL_ROUND_ROWS.format(where=SQL_OVERLAP))
        last_round = {"round": None, "how": "runs overlapping the newest run", "pairs": rows}

    links = src.query(SQL_LINKS.format(start=f"{start:.6f}", runs=int(runs)))
    # Pool reference: the median of per-node medians, per scope and settings (one bad node cannot drag it).
    ends: dict[tuple, list[float]] = {}
    for ln in links:
        ln["scope"] = ln["pool_a"] if ln["pool_a"] == ln["pool_b"] else f"{ln['pool_a']} x {ln['pool_b']}"
        for n in (ln["a"], ln["b"]):
            ends.setdefault((n, ln["scope"], ln["params_key"]), []).append(ln["gbits"])
    per_node = {k: _median(v) for k, v in ends.items()}
    pool_vals: dict[tuple, list[float]] = {}
    for (n, scope, pk), med in per_node.items():
        pool_vals.setdefault((scope, pk), []).append(med)
    pool_ref = {k: _median(v) for k, v in pool_vals.items()}
    for ln in links:
        ref = pool_ref.get((ln["scope"], ln["params_key"]))
        ln["pool_median_gbits"] = ref
        ln["share"] = ln["gbits"] / ref if ref else None
        ln["slow"] = bool(ref and ln["gbits"] < slow_fraction * ref)
    links.sort(key=lambda ln: (ln["share"] if ln["share"] is not None else 1e9, ln["a"], ln["b"]))

    nodes: dict[str, dict] = {}
    for ln in links:
        for n in (ln["a"], ln["b"]):
            d = nodes.setdefault(n, {"node_id": n, "hostname": hostnames.get(n, n), "links": 0, "slow_links": 0,
                                     "shares": [], "rates": []})
            d["links"] += 1
            d["slow_links"] += ln["slow"]
            d["rates"].append(ln["gbits"])
            if ln["share"] is not None:
                d["shares"].append(ln["share"])
    node_list = []
    for d in nodes.values():
        d["median_gbits"] = _median(d.pop("rates"))
        d["median_share"] = _median(d.pop("shares"))
        node_list.append(d)
    node_list.sort(key=lambda d: (d["median_share"] if d["median_share"] is not None else 1e9, d["node_id"]))

    flags = src.query(SQL_FLAGS) if has_table(src, "flags") else []
    for f in flags:
        try:
            f["evidence"] = json.loads(f["evidence"]) if isinstance(f["evidence"], str) else f["evidence"]
        except ValueError:
            pass
    if not links:
        notes.append("no ok net_pair runs in the window")
    groups = src.query(SQL_GROUPS.format(start=f"{start:.6f}")) if has_table(src, "group_results") else []
    rdma = src.query(SQL_RDMA.format(start=f"{start:.6f}")) if _has_column(src, "link_results", "write_gbits_per_s") \
        else []        # a database from before schema 14 has no rdma_pair columns (and no rdma rows)
    return FabricView(seconds, plan, last_round, links, node_list, flags, slow_fraction, synthetic, notes,
                      groups, rdma, build_paths(src))


def _f(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


_SEPARATORS = "-._:"
GRID_LABEL_MAX = 12


def grid_labels(nodes: list[str]) -> tuple[list[str], str]:
    """Matrix labels that tell the nodes apart: their names without the part all of them share at the front
    and back, cut at a separator (gpu-017.cluster.local and gpu-018.cluster.local: "017", "018"); the node's
    position (#1, #2, ...) with a legend line when that still leaves a label too long or two alike. The
    matrix used to show each name's last 10 characters, which for real host names is their domain."""
    if len(nodes) < 2:
        labels = list(nodes)
    else:
        pre = os.path.commonprefix(nodes)
        pre = pre[:max(pre.rfind(c) for c in _SEPARATORS) + 1]
        suf = os.path.commonprefix([n[::-1] for n in nodes])[::-1]
        cut = [suf.find(c) for c in _SEPARATORS if c in suf]
        suf = suf[min(cut):] if cut else ""
        labels = [n[len(pre):len(n) - len(suf)] or n for n in nodes]
    if all(0 < len(x) <= GRID_LABEL_MAX for x in labels) and len(set(labels)) == len(labels):
        return labels, ""
    keys = [f"#{i + 1}" for i in range(len(nodes))]
    return keys, "; ".join(f"{k} {n}" for k, n in zip(keys, nodes))


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return out


PATH_SUSPECTS_SHOWN = 20


def render_paths(paths: dict[str, Any]) -> list[str]:
    """The cheap layer's lines: coverage per pool, then the suspect paths (the 20 worst)."""
    if not paths.get("reported"):
        return [paths.get("sentence") or "cheap layer (path probes): not reported"]
    out = [f"cheap layer (path probes), the {paths['window_s'] / 60:g} minutes up to its newest result "
           f"({str(paths['newest_at'])[:19]} UTC):"]
    if paths["pools"]:
        out += ["  " + line for line in _table(
            ["pool", "nodes", "summaries", "path probes", "pairs", "probes/pair (cap 1)", "suspect", "datagrams",
             "lost", "loss %", "rtt p50 us", "train Gbit/s"],
            [[p["pool"] or "(no pool)", str(p["nodes"]), str(p["summaries"])
              + (f" +{p['skipped_summaries']} skipped" if p["skipped_summaries"] else ""),
              f"{p['path_probes']:.0f}", str(p["pairs"]), _f(p["probes_per_pair_capped"]),
              f"{p['paths_suspect']:.0f}", f"{p['datagrams_sent']:.0f}", f"{p['datagrams_lost']:.0f}",
              _f(100 * p["loss_ratio"], 3) if p["loss_ratio"] is not None else "-", _f(p["rtt_p50_us_median"], 0),
              _f(p["train_gbits_per_s_median"])] for p in paths["pools"]])]
        out.append("  probes/pair: path probes in the hour / pairs among the pool's nodes that sent a summary, "
                   "capped at 1 (the share of the pairs measured when a pinglist cycle is longer than the hour); "
                   "rtt p50 and train: medians over the pool's summaries")
    sus = paths["suspects"]
    shown = sus[:PATH_SUSPECTS_SHOWN]
    more = f", the {len(shown)} worst shown (--format json has all)" if len(sus) > len(shown) else ""
    out.append(f"suspect paths in the hour: {len(sus)}" + (f" pairs, worst first{more}:" if sus else " none"))
    if sus:
        out += ["  " + line for line in _table(
            ["pair", "reports", "train Gbit/s", "% pool", "rtt p50 us", "rtt p99 us", "loss %"],
            [[f"{s['hostname_a']} - {s['hostname_b']}", str(s["reports"]), _f(s["train_gbits_per_s"]),
              _f(100 * s["share"], 0) if s["share"] is not None else "-", _f(s["rtt_p50_us"], 0),
              _f(s["rtt_p99_us"], 0), _f(100 * s["loss_ratio"], 2) if s["loss_ratio"] is not None else "-"]
             for s in shown])]
    out += [f"  note: {n}" for n in paths["notes"]]
    return out


def render_text(v: FabricView, top: int = 10, max_rounds: int = 10, matrix_max: int = 16) -> str:
    out: list[str] = []
    if v.synthetic:
        out.append("NOTE: includes SYNTHETIC nodes from gpuagent-sim")
    p = v.plan
    if p.get("error"):
        out.append(f"plan: cannot plan the {p['nodes']} registered nodes: {p['error']}")
    else:
        scopes = ", ".join(f"{k or '(all)'} {n}" for k, n in sorted(p["scopes"].items()))
        cap = f", at most {p['max_pairs_per_round']} pairs per round" if p["max_pairs_per_round"] else ""
        out.append(f"plan: {p['nodes']} nodes seen in the last {v.window_s / 3600:g} h, scoped by "
                   f"{p['scope_key'] or '(nothing)'} ({scopes or 'none'}){cap}: {len(p['rounds'])} rounds, "
                   f"{p['pairs']} pairs per full sweep")
        if p["unscoped"]:
            out.append(f"  not planned (no {p['scope_key']} label): {', '.join(p['unscoped'])}")
        for i, rnd in enumerate(p["rounds"][:max_rounds]):
            out.append(f"  round {i + 1}: " + " ".join(f"{a}>{b}" for a, b in rnd))
        if len(p["rounds"]) > max_rounds:
            out.append(f"  ... {len(p['rounds']) - max_rounds} more rounds (--rounds N shows more)")
    out.append("")
    lr = v.last_round
    if not lr["pairs"]:
        out.append("last round: no fabric runs stored")
    else:
        name = f"round {lr['round']}" if lr["round"] else "the newest runs (" + lr["how"] + ")"
        out.append(f"last round: {name}, {len(lr['pairs'])} pairs")
        out += ["  " + line for line in _table(
            ["a>b", "status", "send Gbit/s", "recv Gbit/s", "rtt p50 us", "reason"],
            [[f"{r['node_a']}>{r['node_b']}", r["status"], _f(r["send"]), _f(r["recv"]), _f(r["rtt_p50_us"], 0),
              (r["reason"] or "")[:80]] for r in lr["pairs"]])]
    out.append("")
    nodes = sorted({n for ln in v.links for n in (ln["a"], ln["b"])})
    if v.links and len(nodes) <= matrix_max:
        rate = {(ln["a"], ln["b"]): ln["gbits"] for ln in v.links}
        slow = {(ln["a"], ln["b"]) for ln in v.links if ln["slow"]}
        out.append("link matrix: Gbit/s of the slower direction (median of the recent runs; * slow)")
        short, legend = grid_labels(nodes)
        if legend:
            out.append("  " + legend)
        rows = []
        for i, a in enumerate(nodes):
            row = [short[i]]
            for b in nodes:
                key = (min(a, b), max(a, b))
                r = rate.get(key)
                row.append("." if a == b else "-" if r is None else f"{r:.2f}{'*' if key in slow else ''}")
            rows.append(row)
        out += ["  " + line for line in _table([""] + short, rows)]
        out.append("")
    if v.links:
        shown = sorted(v.links, key=lambda ln: (ln["a"], ln["b"])) if len(v.links) <= top * 3 else v.links[:top]
        what = "links" if len(v.links) <= top * 3 else f"the {top} worst of {len(v.links)} links"
        out.append(f"link table ({what}):")
        out += ["  " + line for line in _table(
            ["a", "b", "send Gbit/s", "recv Gbit/s", "rtt p50 us", "rtt p99 us", "runs", "% pool", "slow"],
            [[ln["a"], ln["b"], _f(ln["send"]), _f(ln["recv"]), _f(ln["rtt_p50_us"], 0), _f(ln["rtt_p99_us"], 0),
              str(ln["runs"]), _f(100 * ln["share"], 0) if ln["share"] is not None else "-",
              "yes" if ln["slow"] else ""] for ln in shown])]
        out.append("")
        out.append(f"worst nodes (median link rate against the pool median; slow: under {v.slow_fraction:g} x):")
        out += ["  " + line for line in _table(
            ["node", "links", "slow", "median Gbit/s", "% pool"],
            [[d["node_id"], str(d["links"]), str(d["slow_links"]), _f(d["median_gbits"]),
              _f(100 * d["median_share"], 0) if d["median_share"] is not None else "-"] for d in v.nodes[:top]])]
        out.append("")
        worst = [ln for ln in v.links if ln["slow"]][:top]
        out.append(f"worst links (slow: {sum(ln['slow'] for ln in v.links)} of {len(v.links)}):"
                   + ("" if worst else " none"))
        for ln in worst:
            out.append(f"  {ln['a']} - {ln['b']}: {_f(ln['gbits'])} Gbit/s, {_f(100 * ln['share'], 0)} % of the "
                       f"pool median {_f(ln['pool_median_gbits'])}")
    out.append("")
    if v.groups:
        out.append(f"collective groups (newest run of each, {len(v.groups)}; busbw by the nccl-tests formula):")
        out += ["  " + line for line in _table(
            ["members", "status", "backend", "ranks", "busbw GB/s", "algbw GB/s", "small msg us", "reason"],
            [[g["members"] if len(g["members"]) <= 60 else g["members"][:57] + "...", g["status"],
              g["backend"] or "-", str(g["world_size"] or "-"), _f(g["busbw_gbytes_per_s"], 3),
              _f(g["algbw_gbytes_per_s"], 3), _f(g["small_msg_latency_us"], 0), (g["reason"] or "")[:80]]
             for g in v.groups[:top]])]
        out.append("")
    if v.rdma:
        out.append(f"rdma_pair links (newest run of each, {len(v.rdma)}):")
        out += ["  " + line for line in _table(
            ["a>b", "status", "write Gbit/s", "lat us", "reason"],
            [[f"{r['node_a']}>{r['node_b']}", r["status"], _f(r["write_gbits_per_s"]), _f(r["lat_typical_us"]),
              (r["reason"] or "")[:100]] for r in v.rdma[:top]])]
        out.append("")
    out += render_paths(v.paths)
    out.append("")
    out.append(f"open network_degraded flags: {len(v.flags)}" + ("" if v.flags else " (the analyzer opens them)"))
    for f in sorted(v.flags, key=lambda f: (f["component"], f["node_id"]))[:top]:
        out.append(f"  [{f['severity']}] {f['component']} {f['node_id']}: {f['sentence']}")
    if len(v.flags) > top:
        out.append(f"  ... {len(v.flags) - top} more (--top N shows more)")
    out += [f"note: {n}" for n in v.notes]
    return "\n".join(out).rstrip() + "\n"


def run_fabric(db: str | None, target: str | None, *, window: str = "24h", fmt: str = "text",
               token: str | None = None, tls_ca: str | None = None, client_cert: str | None = None,
               client_key: str | None = None, config: FabricConfig | None = None,
               runs: int = 3, slow_fraction: float = 0.5, top: int = 10, max_rounds: int = 10) -> str:
    src = open_source(db, target, token, tls_ca, client_cert, client_key)
    try:
        view = build_view(src, window, config, runs, slow_fraction)
    finally:
        src.close()
    if fmt == "json":
        return json.dumps(asdict(view), default=str)
    return render_text(view, top, max_rounds)
