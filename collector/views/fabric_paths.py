"""The cheap layer's section of ``gpuagent-collector fabric``: path-probe coverage per pool and the suspect paths.

Each agent reports once per epoch a *summary* (a probe_results row of probe ``path_probe`` whose params say
``"role": "summary"``, with probe_metrics paths, paths_suspect, datagrams_sent, datagrams_lost, rtt_p50_us,
train_gbits_per_s, ...) and one link_results row (probe ``path_probe``, node_a the prober) per path it
confirmed as a suspect (common/path_probe.py). This reads the hour up to the newest of those rows (the
newest, not the clock, so a copied database file reads the same as the live one) with the same plain,
literal-only SQL as the rest of the view, so it works on a DuckDB file and through the Query RPC alike.

Coverage per pool (the nodes table's ``pool``, the pinglists' default scope): the nodes that sent a summary,
the path probes they made (the sum of their summaries' ``paths``), the pairs among them, n x (n - 1) / 2,
and ``probes_per_pair_capped`` = min(1, path probes / pairs): path probes per pair in the hour, capped at 1.
A pinglist cycle measures each pair once, by one of its ends, so when the cycle is longer than the hour
every probe is a distinct pair and this is the share of the pairs measured; shorter, it reaches 1.
"""

from __future__ import annotations

from typing import Any

from gpuagent.collector.views.compare import _lit, has_table

PATH_WINDOW_S = 3600.0

NOT_REPORTED = ("cheap layer (path probes): not reported: no path_probe summary or suspect path is stored "
                "(the fabric is disabled on the collector or on the agents, or the agents are older than this "
                "collector and do not run path probes)")

_SUMMARY = "r.probe = 'path_probe' AND json_extract_string(r.params, '$.role') = 'summary'"

# The newest summary or suspect row: the end of the hour read (as text, so no time zone comes in between).
SQL_PATH_NEWEST = f"""
SELECT max(t)::VARCHAR AS newest, epoch(max(t)) AS newest_epoch FROM (
    SELECT max(r.started_at) AS t FROM probe_results r WHERE {_SUMMARY}
    UNION ALL
    SELECT max(started_at) FROM link_results WHERE probe = 'path_probe')
"""

# One row per pool: its summaries in the hour, each with its metrics (a skipped summary has none).
SQL_PATH_POOLS = f"""
WITH s AS (
    SELECT r.node_id, r.status, coalesce(n.pool, '') AS pool,
           max(m.value) FILTER (WHERE m.metric = 'paths') AS paths,
           max(m.value) FILTER (WHERE m.metric = 'paths_suspect') AS paths_suspect,
           max(m.value) FILTER (WHERE m.metric = 'datagrams_sent') AS sent,
           max(m.value) FILTER (WHERE m.metric = 'datagrams_lost') AS lost,
           max(m.value) FILTER (WHERE m.metric = 'rtt_p50_us') AS rtt_p50_us,
           max(m.value) FILTER (WHERE m.metric = 'train_gbits_per_s') AS train
    FROM probe_results r
    LEFT JOIN probe_metrics m ON m.node_id = r.node_id AND m.probe = r.probe AND m.started_at = r.started_at
         AND m.params_key IS NOT DISTINCT FROM r.params_key AND m.gpu IS NOT DISTINCT FROM r.gpu
    LEFT JOIN nodes n ON n.node_id = r.node_id
    WHERE {_SUMMARY} AND {{window}}
    GROUP BY r.node_id, r.status, r.started_at, r.params_key, r.gpu, n.pool
)
SELECT pool, count(DISTINCT node_id) AS nodes, count(*) FILTER (WHERE status = 'ok') AS summaries,
       count(*) FILTER (WHERE status <> 'ok') AS skipped_summaries, coalesce(sum(paths), 0) AS path_probes,
       coalesce(sum(paths_suspect), 0) AS paths_suspect, coalesce(sum(sent), 0) AS datagrams_sent,
       coalesce(sum(lost), 0) AS datagrams_lost, median(rtt_p50_us) AS rtt_p50_us_median,
       median(train) AS train_gbits_per_s_median
FROM s GROUP BY pool ORDER BY pool
"""

# One row per suspect pair (either end may have reported it): the newest report's readings, how many reports.
SQL_PATH_SUSPECTS = """
WITH r AS (
    SELECT least(node_a, node_b) AS a, greatest(node_a, node_b) AS b, reported_by, started_at,
           rtt_p50_us, rtt_p99_us, {loss} AS loss_ratio, {train} AS train_gbits_per_s
    FROM link_results
    WHERE probe = 'path_probe' AND status = 'ok' AND node_a IS NOT NULL AND node_b IS NOT NULL AND {window}
), counts AS (
    SELECT a, b, count(*) AS reports, list(DISTINCT reported_by ORDER BY reported_by) AS reporters FROM r GROUP BY a, b
), newest AS (
    SELECT * FROM r QUALIFY row_number() OVER (PARTITION BY a, b ORDER BY started_at DESC, reported_by) = 1
)
SELECT x.a, x.b, coalesce(na.hostname, x.a) AS hostname_a, coalesce(nb.hostname, x.b) AS hostname_b,
       coalesce(na.pool, '') AS pool, c.reports, c.reporters, x.train_gbits_per_s, x.rtt_p50_us, x.rtt_p99_us,
       x.loss_ratio, epoch(x.started_at) AS last_at
FROM newest x JOIN counts c ON c.a = x.a AND c.b = x.b
LEFT JOIN nodes na ON na.node_id = x.a LEFT JOIN nodes nb ON nb.node_id = x.b
ORDER BY x.a, x.b
"""

SQL_NEWEST_NODE = "SELECT epoch(max(last_seen)) AS newest FROM nodes"


def has_column(src, table: str, column: str) -> bool:
    rows = src.query("SELECT count(*) AS n FROM information_schema.columns WHERE table_schema = 'main' "
                     f"AND table_name = {_lit(table)} AND column_name = {_lit(column)}")
    return bool(rows and rows[0]["n"])


def _worst_key(s: dict[str, Any]) -> tuple:
    """Worst first: the lowest train rate against the pool's median (no train echo at all: 0), then the most
    loss, then the highest rtt."""
    share = s["share"] if s["share"] is not None else (0.0 if s["train_gbits_per_s"] is None else 1.0)
    return (share, -(s["loss_ratio"] or 0.0), -(s["rtt_p50_us"] or 0.0), s["a"], s["b"])


def build_paths(src) -> dict[str, Any]:
    """The cheap layer's section: {"reported": False, "sentence": ...} when nothing is stored, else the
    hour's coverage per pool and its suspect paths, worst first."""
    if not (has_table(src, "probe_results") and has_table(src, "link_results")):
        return {"reported": False, "sentence": NOT_REPORTED}
    top = src.query(SQL_PATH_NEWEST)[0]
    if top["newest"] is None:
        return {"reported": False, "sentence": NOT_REPORTED}
    end = _lit(top["newest"])
    window = (f"started_at > TIMESTAMP {end} - INTERVAL {int(PATH_WINDOW_S)} SECOND "
              f"AND started_at <= TIMESTAMP {end}")
    notes: list[str] = []

    pools = src.query(SQL_PATH_POOLS.format(window=window.replace("started_at", "r.started_at")))
    for p in pools:
        n = int(p["nodes"])
        p["pairs"] = n * (n - 1) // 2
        p["probes_per_pair_capped"] = min(1.0, p["path_probes"] / p["pairs"]) if p["pairs"] else None
        p["loss_ratio"] = p["datagrams_lost"] / p["datagrams_sent"] if p["datagrams_sent"] else None

    new_cols = all(has_column(src, "link_results", c) for c in ("loss_ratio", "train_gbits_per_s"))
    if not new_cols:      # a database from before schema 20: suspect rows without their loss and train rate
        notes.append("this database's link_results predates schema 20: the suspect paths show no loss or train rate")
    suspects = src.query(SQL_PATH_SUSPECTS.format(
        window=window, loss="loss_ratio" if new_cols else "NULL::DOUBLE",
        train="train_gbits_per_s" if new_cols else "NULL::DOUBLE"))
    pool_train = {p["pool"]: p["train_gbits_per_s_median"] for p in pools}
    for s in suspects:
        ref = pool_train.get(s["pool"])
        s["pool_train_gbits_per_s"] = ref
        s["share"] = s["train_gbits_per_s"] / ref if ref and s["train_gbits_per_s"] is not None else None
    suspects.sort(key=_worst_key)

    if not pools:
        notes.append("suspect paths are stored but no summary in the same hour: the agents report a summary each "
                     "epoch, so their summaries are missing (an agent older than this collector?)")
    node_newest = src.query(SQL_NEWEST_NODE)[0]["newest"] if has_table(src, "nodes") else None
    lag = float(node_newest) - float(top["newest_epoch"]) if node_newest is not None else 0.0
    if lag > PATH_WINDOW_S:
        notes.append(f"the newest path probe result is {lag / 3600:.1f} h older than the newest node contact: "
                     "the cheap layer has stopped reporting")
    return {"reported": True, "sentence": None, "window_s": PATH_WINDOW_S, "newest": top["newest_epoch"],
            "newest_at": top["newest"], "pools": pools, "suspects": suspects, "notes": notes}
