-- noisy_neighbor_variance: the spread of repeated measurements of the same thing on one node over the window.
-- Series: ok runs of one probe metric with one params_key (per GPU for per-GPU probes), or one job rank's
-- step-time windows. Spread: CV = stddev / mean and a tail ratio (p99/p50 for lower-is-better, p50/p1 for
-- higher-is-better, so >= 1 always means a bad tail). Flag when CV >= the component's absolute threshold AND
-- CV >= $noise_k x the median CV of the class (needs >= $min_fleet_nodes other nodes); without enough peers
-- the relative test cannot be made, so corroboration (steal or PSI) is required instead.
-- _nn_points, _nn_series and _nn_fleet_local also run on Spark and DuckDB over the lake (collector/lake/fleet.py):
-- keep them in the SQL both accept.

CREATE OR REPLACE TEMP TABLE _nn_points AS
SELECT m.node_id, CASE WHEN c.per_gpu THEN m.gpu END AS gpu, c.component,
       nc.class_label || ' | ' || m.params_key AS peer_key, m.params_key AS series, m.value
FROM _ok_metrics m
JOIN _components c ON c.kind = 'noisy_neighbor_variance' AND c.probe = m.probe AND c.metric = m.metric
JOIN _node_class nc ON nc.node_id = m.node_id
UNION ALL
SELECT s.node_id, NULL AS gpu, 'step_time' AS component,
       'job ' || s.job_id AS peer_key, 'job=' || s.job_id || ',rank=' || CAST(coalesce(s.rank, -1) AS STRING) AS series,
       s.step_time_p50_s AS value
FROM job_steps s
WHERE s.ts > $window_start AND s.ts <= $now AND s.step_time_p50_s > 0 AND coalesce(s.steps, 1) > 0;

CREATE OR REPLACE TEMP TABLE _nn_series AS
SELECT p.node_id, p.gpu, p.component, p.peer_key, p.series,
       count(*) AS runs, avg(p.value) AS mean,
       stddev_samp(p.value) / nullif(abs(avg(p.value)), 0) AS cv,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY p.value) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY p.value) AS p99,
       percentile_cont(0.01) WITHIN GROUP (ORDER BY p.value) AS p1
FROM _nn_points p
GROUP BY ALL
HAVING count(*) >= $min_runs;

-- Median CV of each class (all its nodes' series); peers = nodes other than the one judged.
CREATE OR REPLACE TEMP TABLE _nn_fleet_local AS
SELECT component, peer_key, median(cv) AS fleet_cv, count(DISTINCT node_id) AS nodes
FROM _nn_series GROUP BY ALL;

-- A shard of a larger fleet sees only its own nodes of a class: _nn_fleet_lake holds the whole fleet's medians
-- (`lake baselines`, loaded by the lake loader; empty otherwise). They win; a key they lack uses this node set.
CREATE OR REPLACE TEMP TABLE _nn_fleet AS
SELECT component, peer_key, fleet_cv, nodes FROM _nn_fleet_lake
UNION ALL
SELECT l.component, l.peer_key, l.fleet_cv, l.nodes FROM _nn_fleet_local l
WHERE NOT EXISTS (SELECT 1 FROM _nn_fleet_lake k WHERE k.component = l.component AND k.peer_key = l.peer_key);

CREATE OR REPLACE TEMP TABLE _nn AS
SELECT s.*, c.label, c.unit_label, c.better, c.threshold,
       CASE WHEN c.better = 'higher' THEN s.p50 / nullif(s.p1, 0) ELSE s.p99 / nullif(s.p50, 0) END AS tail_ratio,
       f.fleet_cv, f.nodes - 1 AS peers, (f.nodes - 1) >= $min_fleet_nodes AS peers_ok,
       nc.class_label, pr.*
         EXCLUDE (node_id),
       coalesce(pr.steal_max_1m, 0) >= $corr_steal OR coalesce(pr.psi_cpu_max, 0) >= $corr_psi
         OR coalesce(pr.psi_io_max, 0) >= $corr_psi OR coalesce(pr.psi_mem_max, 0) >= $corr_psi AS corroborated
FROM _nn_series s
JOIN _components c ON c.kind = 'noisy_neighbor_variance' AND c.component = s.component
JOIN _nn_fleet f ON f.component = s.component AND f.peer_key = s.peer_key
JOIN _node_class nc ON nc.node_id = s.node_id
LEFT JOIN _pressure pr ON pr.node_id = s.node_id;

INSERT INTO _evaluated SELECT DISTINCT node_id, gpu, 'noisy_neighbor_variance', component FROM _nn;

INSERT INTO _conditions
SELECT node_id, gpu, 'noisy_neighbor_variance' AS kind, component,
       CASE WHEN cv >= 2 * threshold THEN 'critical' ELSE 'warning' END AS severity,
       cv AS value, 'cv' AS unit,
       CASE WHEN peers_ok THEN fleet_cv END AS baseline,
       CASE WHEN peers_ok THEN 'fleet_class_median' ELSE 'none' END AS baseline_source,
       json_object(
           'series', series, 'runs', runs, 'mean', mean, 'cv', round(cv, 4), 'p50', p50, 'p99', p99, 'p1', p1,
           'tail_ratio', round(tail_ratio, 3), 'cv_threshold', threshold,
           'fleet_median_cv', fleet_cv, 'peers', peers, 'k', $noise_k, 'class', class_label,
           'corroborated', corroborated,
           'cpu_steal_percent', json_object('avg', steal_avg, 'max', steal_max, 'max_1m_avg', steal_max_1m),
           'psi_cpu_some_avg10_percent', json_object('avg', psi_cpu_avg, 'max', psi_cpu_max),
           'psi_io_some_avg10_percent', json_object('avg', psi_io_avg, 'max', psi_io_max),
           'psi_memory_some_avg10_percent', json_object('avg', psi_mem_avg, 'max', psi_mem_max),
           'disk_read_latency_ms_max', disk_read_latency_ms_max,
           'disk_write_latency_ms_max', disk_write_latency_ms_max
       )::VARCHAR AS evidence,
       coalesce('GPU ' || gpu::VARCHAR || ' ', '') || label || ' varies with CV ' || printf('%.0f', cv * 100) || ' %'
       || ' (' || CASE WHEN better = 'higher' THEN 'p50/p1 ' ELSE 'p99/p50 ' END || printf('%.2f', tail_ratio) || '×)'
       || ' over ' || runs::VARCHAR || CASE WHEN component = 'step_time' THEN ' step windows in the last '
                                          ELSE ' runs in the last ' END
       || _hours(CASE WHEN component = 'step_time' THEN $window_hours ELSE $probe_window_hours END) || ', '
       || CASE WHEN peers_ok
               THEN printf('%.1f', cv / nullif(fleet_cv, 0)) || '× the median CV ' || printf('%.0f', fleet_cv * 100)
                    || ' % of ' || class_label || ' (' || peers::VARCHAR || ' other nodes)'
               ELSE 'above the ' || printf('%.0f', threshold * 100) || ' % limit (too few peers to compare: '
                    || peers::VARCHAR || ')' END
       || '; CPU steal ' || printf('%.1f', coalesce(steal_avg, 0)) || ' % (worst minute '
       || printf('%.1f', coalesce(steal_max_1m, 0)) || ' %), PSI some max cpu '
       || printf('%.0f', coalesce(psi_cpu_max, 0)) || ' % io ' || printf('%.0f', coalesce(psi_io_max, 0))
       || ' % memory ' || printf('%.0f', coalesce(psi_mem_max, 0)) || ' %: '
       || CASE WHEN coalesce(steal_max_1m, 0) >= $corr_steal
                    AND coalesce(steal_max_1m, 0) * 10 >= greatest(coalesce(psi_cpu_max, 0), coalesce(psi_io_max, 0), coalesce(psi_mem_max, 0))
                 THEN 'the hypervisor is giving this VM''s CPU time to other guests; ask for dedicated vCPUs or move the workload.'
               WHEN greatest(coalesce(psi_cpu_max, 0), coalesce(psi_io_max, 0), coalesce(psi_mem_max, 0)) >= $corr_psi
                 THEN 'something else on this host contends for '
                      || CASE WHEN coalesce(psi_cpu_max, 0) >= greatest(coalesce(psi_io_max, 0), coalesce(psi_mem_max, 0)) THEN 'CPU'
                              WHEN coalesce(psi_io_max, 0) >= coalesce(psi_mem_max, 0) THEN 'I/O' ELSE 'memory' END
                      || '; find and isolate the co-tenant (cgroup limits, CPU pinning) or drain the node for jitter-sensitive jobs.'
               ELSE 'no host pressure recorded, so look at shared network or storage paths outside this node.' END
       AS sentence
FROM _nn
WHERE cv >= threshold
  AND ((peers_ok AND cv >= $noise_k * fleet_cv) OR (NOT peers_ok AND corroborated))
QUALIFY row_number() OVER (PARTITION BY node_id, gpu, component ORDER BY cv DESC) = 1;
