-- virtualization_overhead: a virtualized node's probe result against the baseline of its hardware class.
-- Baseline, first that exists: median over bare-metal nodes of the class (>= $min_baseline_nodes nodes,
-- per-node medians over the lookback), else the reference table, else a user-declared value, else none
-- (a ``no_baseline`` info flag that says so, never a guess: a virtualization_overhead flag always carries the
-- overhead and margin it rests on). A judgement needs $vo_min_runs runs (the node's own, or for a per-GPU
-- component all its GPUs' runs pooled): fewer runs have no spread to take a margin from, and raise nothing.
-- Each node is judged from its own runs against the stored fleet_baselines, so the analyzer runs this file in
-- pieces of nodes (steps.py by_node; the medians of 30,000 nodes' probe runs in one statement took 253 s at
-- 512 MB). The rows it reads are picked from _ok_metrics once, before the pieces, with each row's piece, and
-- each piece takes its own.

-- Once, before the pieces: the ok runs of virtualization_overhead components on virtualized nodes, with their
-- piece. A small part of _ok_metrics (549,000 of 14.2 M rows at 10,000 nodes), so the pieces' scans of it are
-- cheap; each piece scanning (and hashing) the whole of _ok_metrics had grown with the square of the fleet.
CREATE OR REPLACE TEMP TABLE _vo_runs AS
SELECT hash(m.node_id) % $pieces AS piece, m.node_id, m.gpu, c.component, c.per_gpu, m.params_key, m.started_at,
       m.value
FROM _ok_metrics m
JOIN _components c ON c.kind = 'virtualization_overhead' AND c.probe = m.probe AND c.metric = m.metric
JOIN _node_class nc ON nc.node_id = m.node_id AND nc.virtualized;

-- each piece of nodes:

-- The window's value per virtualized node (per GPU for per-GPU components): median of ok runs.
CREATE OR REPLACE TEMP TABLE _vo_values AS
SELECT m.node_id, CASE WHEN m.per_gpu THEN m.gpu END AS gpu, m.component, m.params_key,
       median(m.value) AS value, count(*) AS runs, min(m.started_at) AS first_run, max(m.started_at) AS last_run,
       coalesce(stddev_samp(m.value), 0) AS sd
FROM _vo_runs m
WHERE m.piece = $piece
GROUP BY ALL;

-- Per-GPU components also get a node-level view: all the node's GPUs' runs pooled. A penalty that hits every
-- GPU (a VM's PCIe path) is then seen with 8x the runs, even when each GPU's own runs are too scattered.
CREATE OR REPLACE TEMP TABLE _vo_pooled AS
SELECT m.node_id, m.component, m.params_key, median(m.value) AS value, count(*) AS runs,
       coalesce(stddev_samp(m.value), 0) AS sd
FROM _vo_runs m
WHERE m.piece = $piece AND m.per_gpu
GROUP BY ALL;

-- Bare-metal baselines per class, component and params_key: fleet_baselines, refreshed by
-- 25_fleet_baselines.sql at most every baseline_refresh (the lookback is long; the window is not).
CREATE OR REPLACE TEMP TABLE _vo_fleet AS
SELECT class_label, component, params_key, baseline, nodes FROM fleet_baselines;

-- The most specific matching reference row and declared value for each value row.
CREATE OR REPLACE TEMP TABLE _vo_ref AS
SELECT v.node_id, v.gpu, v.component, v.params_key, r.value, r.basis, r.source, r.unit
FROM _vo_values v
JOIN _node_class nc ON nc.node_id = v.node_id
JOIN _ref_baselines r ON r.component = v.component
 AND (r.gpu_model_like IS NULL OR nc.gpu_model ILIKE r.gpu_model_like)
 AND (r.pcie_gen IS NULL OR nc.pcie_gen = r.pcie_gen)
 AND (r.pcie_width IS NULL OR nc.pcie_width = r.pcie_width)
 AND (r.params_like IS NULL OR v.params_key LIKE r.params_like)
QUALIFY row_number() OVER (PARTITION BY v.node_id, v.gpu, v.component, v.params_key
                           ORDER BY (r.gpu_model_like IS NOT NULL)::INT + (r.pcie_gen IS NOT NULL)::INT
                                    + (r.params_like IS NOT NULL)::INT DESC, r.value DESC) = 1;

CREATE OR REPLACE TEMP TABLE _vo_declared AS
SELECT v.node_id, v.gpu, v.component, v.params_key, d.value, d.note
FROM _vo_values v
JOIN _node_class nc ON nc.node_id = v.node_id
JOIN _declared_baselines d ON d.component = v.component
 AND (d.gpu_model_like IS NULL OR nc.gpu_model ILIKE d.gpu_model_like)
 AND (d.params_like IS NULL OR v.params_key LIKE d.params_like)
QUALIFY row_number() OVER (PARTITION BY v.node_id, v.gpu, v.component, v.params_key
                           ORDER BY (d.gpu_model_like IS NOT NULL)::INT + (d.params_like IS NOT NULL)::INT DESC) = 1;

CREATE OR REPLACE TEMP TABLE _vo AS
SELECT v.*, nc.class_label, nc.virt_type, nc.fingerprint,
       c.better, c.label, c.unit_label, c.unit, c.advice, c.critical,
       f.nodes AS fleet_nodes, f.baseline AS fleet_baseline,
       CASE WHEN f.nodes >= $min_baseline_nodes THEN 'fleet_bare_metal'
            WHEN r.value IS NOT NULL THEN 'reference_table'
            WHEN d.value IS NOT NULL THEN 'user_declared'
            ELSE 'none' END AS baseline_source,
       CASE WHEN f.nodes >= $min_baseline_nodes THEN f.baseline
            WHEN r.value IS NOT NULL THEN r.value
            WHEN d.value IS NOT NULL THEN d.value END AS baseline,
       CASE WHEN f.nodes >= $min_baseline_nodes THEN c.threshold
            WHEN r.value IS NOT NULL AND r.basis = 'theoretical' THEN greatest(c.threshold, $theoretical_threshold)
            ELSE c.threshold END AS threshold,
       r.basis AS ref_basis, r.source AS ref_source, d.note AS declared_note,
       p.value AS pooled_value, p.runs AS pooled_runs, p.sd AS pooled_sd
FROM _vo_values v
JOIN _node_class nc ON nc.node_id = v.node_id
JOIN _components c ON c.kind = 'virtualization_overhead' AND c.component = v.component
LEFT JOIN _vo_fleet f ON f.class_label = nc.class_label AND f.component = v.component AND f.params_key = v.params_key
LEFT JOIN _vo_ref r ON r.node_id = v.node_id AND r.gpu IS NOT DISTINCT FROM v.gpu AND r.component = v.component AND r.params_key = v.params_key
LEFT JOIN _vo_declared d ON d.node_id = v.node_id AND d.gpu IS NOT DISTINCT FROM v.gpu AND d.component = v.component AND d.params_key = v.params_key
-- Only per-GPU rows take the pooled view. The test is inside the key, not beside it: a condition on the left
-- table alone in a LEFT JOIN's ON made DuckDB loop over every pair of rows (1 s a piece at 10,000 nodes).
LEFT JOIN _vo_pooled p ON p.node_id = CASE WHEN v.gpu IS NOT NULL THEN v.node_id END
 AND p.component = v.component AND p.params_key = v.params_key;

-- Overhead: % below (higher-is-better), % above (lower-is-better), or points above (steal).
-- margin: $vo_z standard errors of the median (1.2533 sd / sqrt(runs)) in the same unit, so that a node whose
-- own runs scatter widely (a noisy neighbor) is not called slow on the luck of a few runs.
CREATE OR REPLACE TEMP TABLE _vo_scored AS
SELECT *,
       CASE better WHEN 'higher' THEN (baseline - value) / nullif(baseline, 0) * 100
                   WHEN 'lower' THEN (value - baseline) / nullif(baseline, 0) * 100
                   ELSE value - baseline END AS overhead,
       $vo_z * 1.2533 * sd / sqrt(runs)
         * CASE WHEN better = 'points' THEN 1 ELSE 100 / nullif(abs(baseline), 0) END AS margin,
       CASE better WHEN 'higher' THEN (baseline - pooled_value) / nullif(baseline, 0) * 100
                   WHEN 'lower' THEN (pooled_value - baseline) / nullif(baseline, 0) * 100 END AS pooled_overhead,
       $vo_z * 1.2533 * pooled_sd / sqrt(pooled_runs) * 100 / nullif(abs(baseline), 0) AS pooled_margin
FROM _vo;

-- Every evaluated (node, gpu, component): a flag that no longer holds closes.
-- Both kinds are evaluated together: a no_baseline flag closes once a baseline exists, and the other way round.
INSERT INTO _evaluated SELECT DISTINCT node_id, gpu, 'virtualization_overhead', component FROM _vo_scored;
INSERT INTO _evaluated SELECT DISTINCT node_id, gpu, 'no_baseline', component FROM _vo_scored;

-- One condition per (node, gpu, component): the worst params_key. The overhead and its margin are the figure.
INSERT INTO _conditions
SELECT node_id, gpu, 'virtualization_overhead' AS kind, component,
       CASE WHEN overhead >= greatest(critical, threshold) THEN 'critical' ELSE 'warning' END AS severity,
       value, unit, baseline, baseline_source,
       json_object(
           'overhead', round(overhead, 2),
           'overhead_unit', CASE WHEN better = 'points' THEN 'percentage_points' ELSE 'percent' END,
           'threshold', threshold, 'margin', round(margin, 2), 'better', better, 'runs_sd', sd,
           'node_pooled', CASE WHEN pooled_runs IS NOT NULL THEN json_object('overhead', round(pooled_overhead, 2),
                               'margin', round(pooled_margin, 2), 'runs', pooled_runs) END,
           'params_key', params_key, 'runs', runs, 'first_run', first_run, 'last_run', last_run,
           'class', class_label, 'baseline_nodes', coalesce(fleet_nodes, 0),
           'reference', CASE WHEN baseline_source = 'reference_table'
                             THEN json_object('basis', ref_basis, 'source', ref_source) END,
           'declared_note', CASE WHEN baseline_source = 'user_declared' THEN declared_note END,
           'virt_type', virt_type,
           'fingerprint', try_cast(fingerprint AS JSON)
       )::VARCHAR AS evidence,
       coalesce('GPU ' || gpu::VARCHAR || ' ', '') || label || ' ' || _fmt(value) || ' ' || unit_label || ' is '
       || CASE WHEN better = 'points' THEN _fmt(overhead) || ' points above'
               WHEN better = 'higher' THEN printf('%.0f', overhead) || ' % below'
               ELSE printf('%.0f', overhead) || ' % above' END
       || ' the '
       || CASE baseline_source
            WHEN 'fleet_bare_metal' THEN 'bare-metal median ' || _fmt(baseline) || ' ' || unit_label
                                         || ' for ' || class_label || ' (' || fleet_nodes::VARCHAR || ' nodes)'
            WHEN 'reference_table' THEN ref_basis || ' reference ' || _fmt(baseline) || ' ' || unit_label
                                        || ' for ' || class_label || ' (' || ref_source || ')'
            ELSE 'declared baseline ' || _fmt(baseline) || ' ' || unit_label || ' for ' || class_label
          END
       || ' on this VM' || coalesce(' (' || nullif(nullif(virt_type, ''), 'none') || ')', '') || ' over '
       || CASE WHEN runs >= $vo_min_runs AND overhead - margin > threshold THEN runs::VARCHAR || ' runs'
               ELSE pooled_runs::VARCHAR || ' runs of all its GPUs' END
       || ': ' || advice || '.' AS sentence
FROM _vo_scored
WHERE baseline_source <> 'none' AND overhead IS NOT NULL AND margin IS NOT NULL
  AND ((runs >= $vo_min_runs AND overhead - margin > threshold)
       OR (pooled_runs >= $vo_min_runs AND overhead > threshold AND pooled_overhead - pooled_margin > threshold))
QUALIFY row_number() OVER (PARTITION BY node_id, gpu, component ORDER BY overhead DESC) = 1;

-- No baseline: not a verdict on the VM but a gap in what it can be compared with, so a kind of its own (info).
-- Its figure is what was measured and how many bare-metal nodes of the class there were.
INSERT INTO _conditions
SELECT node_id, gpu, 'no_baseline' AS kind, component, 'info' AS severity, value, unit, NULL AS baseline,
       'none' AS baseline_source,
       json_object('for_kind', 'virtualization_overhead', 'params_key', params_key, 'runs', runs,
                   'first_run', first_run, 'last_run', last_run, 'class', class_label,
                   'baseline_nodes', coalesce(fleet_nodes, 0), 'min_baseline_nodes', $min_baseline_nodes,
                   'virt_type', virt_type, 'fingerprint', try_cast(fingerprint AS JSON))::VARCHAR AS evidence,
       coalesce('GPU ' || gpu::VARCHAR || ' ', '') || label || ' ' || _fmt(value) || ' ' || unit_label
       || ' on this VM' || coalesce(' (' || nullif(nullif(virt_type, ''), 'none') || ')', '') || ' has no baseline for ' || class_label
       || ' (' || coalesce(fleet_nodes, 0)::VARCHAR || ' bare-metal nodes, no reference row, nothing declared)'
       || ', so its virtualization overhead is not judged: add bare-metal nodes of this class or declare a value'
       || ' under [baselines] in the collector config.' AS sentence
FROM _vo_scored
WHERE baseline_source = 'none'
QUALIFY row_number() OVER (PARTITION BY node_id, gpu, component ORDER BY runs DESC, params_key) = 1;
