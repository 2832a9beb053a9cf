"""What the pool comparison measures and the SQL that reads it (collector/views/compare.py runs it).

The headline metric of each probe, the flag kinds counted per pool, and one query per part of the
comparison. The SQL is written in what DuckDB and Spark SQL both accept (only literals, no bind parameters,
for the RPC path); ``{start}``, ``{end}`` and ``{no_pool}`` are filled in by compare.py, and a source's
dialect spells a timestamp literal (collector/views/dialect.py). The report (report_data.py) reads the
same headline metrics and leaves fabric group runs out the same way.
"""

# (probe, metric, better) — the headline metric of each probe (docs/METRICS.md).
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("collective", "busbw_gbps", "higher"),
    ("pcie", "h2d_gbps", "higher"),
    ("pcie", "d2h_gbps", "higher"),
    ("gpu_compute", "bf16_tflops", "higher"),
    ("gpu_compute", "launch_latency_us", "lower"),
    ("storage", "seq_read_gbps", "higher"),
    ("storage", "rand_read_iops", "higher"),
    ("host", "syscall_ns", "lower"),
    ("host", "clock_gettime_ns", "lower"),
    ("host", "cpu_steal_percent", "lower"),
)
# A fabric group's collective (group_results) crosses nodes: it is no node's own collective figure, so the
# per-node and per-pool probe views leave it out, as the analyzer does (20_node_class.sql).
NOT_FABRIC_GROUP = "(m.probe <> 'collective' OR coalesce(m.params_key, '') NOT LIKE '%group_id=%')"
# Metrics already in percent of something (CPU time): compared in percentage points, not relative %.
POINT_METRICS = frozenset({"cpu_steal_percent"})
FLAG_KINDS = ("virtualization_overhead", "noisy_neighbor_variance", "utilization_gap")
NO_POOL = "(no pool)"


SQL_POOLS = """
SELECT coalesce(pool, '{no_pool}') AS pool,
       count(*) AS nodes,
       count(*) FILTER (WHERE virtualized) AS virtualized_nodes,
       count(*) FILTER (WHERE synthetic) AS synthetic_nodes,
       sum(coalesce(gpu_count, 0)) AS gpus,
       median(price_per_gpu_hour) AS price_per_gpu_hour
FROM nodes
GROUP BY 1
ORDER BY 1
"""

SQL_POOL_MODELS = """
SELECT DISTINCT coalesce(pool, '{no_pool}') AS pool, gpu_model FROM nodes WHERE gpu_model IS NOT NULL
"""

SQL_PROBES = """
SELECT coalesce(n.pool, '{no_pool}') AS pool, m.probe, m.metric,
       count(*) AS runs,
       count(DISTINCT m.node_id) AS nodes,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY m.value) AS median,
       percentile_cont(0.1) WITHIN GROUP (ORDER BY m.value) AS p10,
       percentile_cont(0.9) WITHIN GROUP (ORDER BY m.value) AS p90
FROM probe_metrics m
JOIN nodes n ON n.node_id = m.node_id
WHERE m.started_at >= {start} AND m.started_at < {end}
  AND m.probe || '.' || m.metric IN ({pairs}) AND {not_group}
  AND m.value BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308
GROUP BY ALL
"""

# GPU-minutes per pool: from the analyzer's 1-minute rollups when they exist, else from raw samples.
SQL_UTIL_ROLLUP = """
WITH per_minute AS (
    SELECT node_id, gpu, minute, sum(sum) / sum(n) AS util
    FROM samples_1m
    WHERE metric = 'gpu_util_percent' AND gpu IS NOT NULL AND minute >= {start} AND minute < {end}
    GROUP BY ALL
)
{util_tail}
"""

SQL_UTIL_RAW = """
WITH per_minute AS (
    SELECT node_id, gpu, date_trunc('minute', ts) AS minute, avg(value) AS util
    FROM samples
    WHERE metric = 'gpu_util_percent' AND gpu IS NOT NULL AND ts >= {start} AND ts < {end}
    GROUP BY ALL
)
{util_tail}
"""

# Double literals (60e0, not 60.0): Spark reads 60.0 as a DECIMAL and would round the quotients.
UTIL_TAIL = """
SELECT coalesce(n.pool, '{no_pool}') AS pool,
       count(*) / 60e0 AS gpu_hours,
       avg(p.util) AS effective_util_percent,
       sum(p.util) / 100e0 / 60e0 AS effective_gpu_hours,
       avg(CASE WHEN p.util < 10 THEN 1e0 ELSE 0e0 END) * 100 AS idle_minutes_percent,
       sum(n.price_per_gpu_hour / 60e0) AS cost,
       count(*) FILTER (WHERE n.price_per_gpu_hour IS NULL) AS unpriced_gpu_minutes
FROM per_minute p
JOIN nodes n ON n.node_id = p.node_id
GROUP BY 1
"""

# One row per net_pair run (both ends report it: the connecting end's row is kept), both ends in one pool.
# Written in what DuckDB and Spark SQL both accept: no QUALIFY, no isfinite (NaN and inf fall outside
# BETWEEN the largest finite doubles on both engines), percentile_cont ... WITHIN GROUP.
SQL_LINKS = """
SELECT pool,
       count(*) AS runs,
       count(DISTINCT link) AS links,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY gbits) AS link_gbits_median,
       percentile_cont(0.1) WITHIN GROUP (ORDER BY gbits) AS link_gbits_p10,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY rtt_p50_us) AS link_rtt_p50_us
FROM (
    SELECT coalesce(na.pool, '{no_pool}') AS pool,
           least(l.node_a, l.node_b) || '|' || greatest(l.node_a, l.node_b) AS link,
           least(l.send_gbits_per_s, l.recv_gbits_per_s) AS gbits,
           CASE WHEN l.rtt_p50_us BETWEEN 0 AND 1.7976931348623157e308 THEN l.rtt_p50_us END AS rtt_p50_us,
           row_number() OVER (
               PARTITION BY coalesce(l.pair_id, l.node_a || '|' || l.node_b || '|' || CAST(l.started_at AS STRING))
               ORDER BY CASE WHEN l.reported_by = l.node_a THEN 0 ELSE 1 END, l.reported_by) AS rn
    FROM link_results l
    JOIN nodes na ON na.node_id = l.node_a
    JOIN nodes nb ON nb.node_id = l.node_b
    WHERE l.probe = 'net_pair' AND l.status = 'ok'
      AND l.started_at >= {start} AND l.started_at < {end}
      AND coalesce(na.pool, '{no_pool}') = coalesce(nb.pool, '{no_pool}')
      AND l.send_gbits_per_s BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308
      AND l.recv_gbits_per_s BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308
) AS runs
WHERE rn = 1
GROUP BY pool
"""

SQL_FLAGS = """
SELECT coalesce(n.pool, '{no_pool}') AS pool, f.kind,
       count(DISTINCT f.node_id) AS nodes_flagged,
       count(*) AS open_flags
FROM flags f
JOIN nodes n ON n.node_id = f.node_id
WHERE f.state = 'open'
GROUP BY ALL
"""

SQL_FLAGS_ANY = """
SELECT coalesce(n.pool, '{no_pool}') AS pool, count(DISTINCT f.node_id) AS nodes_flagged
FROM flags f
JOIN nodes n ON n.node_id = f.node_id
WHERE f.state = 'open'
GROUP BY ALL
"""

SQL_JOBS = """
SELECT coalesce(n.pool, '{no_pool}') AS pool, s.job_name,
       count(DISTINCT s.node_id || ':' || CAST(s.rank AS STRING)) AS ranks,
       count(*) AS windows,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY s.tokens_per_s) AS tokens_per_s_per_gpu,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY s.samples_per_s) AS samples_per_s_per_gpu,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY s.step_time_p50_s) AS step_time_p50_s
FROM job_steps s
JOIN nodes n ON n.node_id = s.node_id
WHERE s.ts >= {start} AND s.ts < {end} AND s.job_name IS NOT NULL AND s.job_name <> ''
GROUP BY ALL
ORDER BY s.job_name, pool
"""
