-- Bare-metal fleet baselines for virtualization_overhead: per hardware class, component and params_key, the
-- median over bare-metal nodes (nodes.virtualized = false) of each node's median over the lookback.
-- This reads up to baseline_lookback (24 h) of probe runs, so the analyzer runs it only when the stored
-- baselines are older than baseline_refresh (15 min); the table is kept so that anyone can see the baselines.
-- The INSERT's query also runs on Spark and DuckDB over the lake for a sharded fleet (collector/lake/fleet.py),
-- so it stays in the SQL both accept: no isfinite() (NaN and +-inf fall outside the BETWEEN).

DELETE FROM fleet_baselines;

INSERT INTO fleet_baselines
WITH per_node AS (
    SELECT nc.class_label, c.component, coalesce(m.params_key, '') AS params_key, m.node_id, median(m.value) AS v,
           count(*) AS runs
    FROM probe_metrics m
    JOIN probe_results r
      ON r.node_id = m.node_id AND r.probe = m.probe AND r.gpu IS NOT DISTINCT FROM m.gpu
     AND r.started_at = m.started_at
    JOIN _components c ON c.kind = 'virtualization_overhead' AND c.probe = m.probe AND c.metric = m.metric
    JOIN _node_class nc ON nc.node_id = m.node_id AND nc.virtualized = false
    WHERE r.status = 'ok' AND m.value BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308
      AND m.started_at > $lookback_start AND m.started_at <= $now
      AND r.started_at > $lookback_start AND r.started_at <= $now
      AND (m.probe <> 'collective' OR coalesce(m.params_key, '') NOT LIKE '%group_id=%')   -- fabric groups
    GROUP BY ALL
)
SELECT class_label, component, params_key, median(v) AS baseline, count(*) AS nodes, sum(runs) AS runs,
       $now AS computed_at
FROM per_node GROUP BY ALL;
