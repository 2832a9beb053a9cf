-- Each node's hardware class: GPU model, PCIe generation and width (of GPU 0), GPU count.
-- Probe comparisons add the probe's params_key on top of this. The label is what sentences print.
-- _pool_prices comes from the collector config ([pricing]); a node's own price label wins.
-- This first statement is also run by Spark and DuckDB over the lake (collector/lake/fleet.py): keep it in
-- the SQL both accept.

CREATE OR REPLACE TEMP TABLE _node_class AS
SELECT n.node_id, n.hostname, n.pool, n.virtualized, n.virt_type,
       n.gpu_model, g.pcie_gen_max AS pcie_gen, g.pcie_width_max AS pcie_width,
       coalesce(n.gpu_count, 0) AS gpu_count,
       coalesce(n.price_per_gpu_hour, p.price_per_gpu_hour) AS price_per_gpu_hour,
       CASE WHEN n.gpu_model IS NULL OR coalesce(n.gpu_count, 0) = 0 THEN 'no GPU'
            ELSE n.gpu_model
                 || coalesce(' PCIe Gen' || CAST(g.pcie_gen_max AS STRING) || ' x' || CAST(g.pcie_width_max AS STRING), '')
                 || ' ×' || CAST(n.gpu_count AS STRING)
       END AS class_label,
       n.fingerprint
FROM nodes n
LEFT JOIN gpus g ON g.node_id = n.node_id AND g.gpu = 0
LEFT JOIN _pool_prices p ON p.pool = n.pool;

-- The ok probe runs in the probe window (probes run far less often than samples), one row per metric value.
-- Also run over the lake for the fleet's noise medians: no isfinite() (NaN and +-inf fall outside the BETWEEN).
CREATE OR REPLACE TEMP TABLE _ok_metrics AS
SELECT m.node_id, m.probe, m.gpu, coalesce(m.params_key, '') AS params_key, m.started_at, m.metric, m.value
FROM probe_metrics m
JOIN probe_results r
  ON r.node_id = m.node_id AND r.probe = m.probe AND r.gpu IS NOT DISTINCT FROM m.gpu
 AND r.started_at = m.started_at
WHERE r.status = 'ok' AND m.value BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308
  AND m.started_at > $probe_window_start AND m.started_at <= $now
  AND r.started_at > $probe_window_start AND r.started_at <= $now
  -- a fabric group's collective crosses nodes (group_results holds it): not this node's own figure
  AND (m.probe <> 'collective' OR coalesce(m.params_key, '') NOT LIKE '%group_id=%');

-- Host pressure per node over the probe window, from the 1-minute rollups: the evidence for noisy neighbors.
CREATE OR REPLACE TEMP TABLE _pressure AS
SELECT node_id,
       sum(sum) FILTER (WHERE metric = 'cpu_steal_percent') / nullif(sum(n) FILTER (WHERE metric = 'cpu_steal_percent'), 0) AS steal_avg,
       max(max) FILTER (WHERE metric = 'cpu_steal_percent') AS steal_max,
       max(avg) FILTER (WHERE metric = 'cpu_steal_percent') AS steal_max_1m,
       sum(sum) FILTER (WHERE metric = 'psi_cpu_some_avg10_percent') / nullif(sum(n) FILTER (WHERE metric = 'psi_cpu_some_avg10_percent'), 0) AS psi_cpu_avg,
       max(max) FILTER (WHERE metric = 'psi_cpu_some_avg10_percent') AS psi_cpu_max,
       sum(sum) FILTER (WHERE metric = 'psi_io_some_avg10_percent') / nullif(sum(n) FILTER (WHERE metric = 'psi_io_some_avg10_percent'), 0) AS psi_io_avg,
       max(max) FILTER (WHERE metric = 'psi_io_some_avg10_percent') AS psi_io_max,
       sum(sum) FILTER (WHERE metric = 'psi_memory_some_avg10_percent') / nullif(sum(n) FILTER (WHERE metric = 'psi_memory_some_avg10_percent'), 0) AS psi_mem_avg,
       max(max) FILTER (WHERE metric = 'psi_memory_some_avg10_percent') AS psi_mem_max,
       max(max) FILTER (WHERE metric = 'disk_read_latency_ms') AS disk_read_latency_ms_max,
       max(max) FILTER (WHERE metric = 'disk_write_latency_ms') AS disk_write_latency_ms_max
FROM samples_1m
WHERE minute >= date_trunc('minute', $probe_window_start) AND minute <= $now
  AND gpu IS NULL
  AND metric IN ('cpu_steal_percent', 'psi_cpu_some_avg10_percent', 'psi_io_some_avg10_percent',
                 'psi_memory_some_avg10_percent', 'disk_read_latency_ms', 'disk_write_latency_ms')
  AND (labels = '' OR metric LIKE 'disk_%')
GROUP BY node_id;
