-- Findings: the open flags grouped into one row per cause, so that a pager fires once per cause.
-- - pool: when more than $pool_fraction of a pool's nodes evaluated for a kind and component family (and at
--   least $pool_min_nodes of them) have an open flag of it, those flags are one finding about the pool;
-- - node: every other open flag joins the one finding of its node and kind (a noisy node's H2D, D2H and
--   compute variance on all its GPUs is one noisy-neighbor finding that lists them);
-- - hardware_fault: one finding per node fault, (node, GPU or host, component), never pooled: a pool where
--   most nodes have a bad GPU still has one bad GPU per node to drain and reset.
-- A finding keeps its row while its key has open flags; it closes with its last flag. Runs after
-- 90_apply_flags.sql, in the same pass and transaction.

-- Open flags with the node's pool and the component's family (the probe it comes from; utilization_gap
-- components are their own family).
CREATE OR REPLACE TEMP TABLE _fd_flags AS
SELECT f.flag_id, f.node_id, f.gpu, f.kind, f.component, f.severity, f.sentence, f.value, f.baseline,
       f.baseline_source, try_cast(json_extract(f.evidence, '$.overhead') AS DOUBLE) AS overhead,
       n.pool, coalesce(c.probe, f.component) AS family, coalesce(c.label, f.component) AS label,
       c.advice, CASE f.severity WHEN 'critical' THEN 2 WHEN 'warning' THEN 1 ELSE 0 END AS rank
FROM flags f
LEFT JOIN nodes n ON n.node_id = f.node_id
LEFT JOIN _components c ON c.kind = f.kind AND c.component = f.component
WHERE f.state = 'open';

-- The pool's nodes that were looked at for a kind and family this pass, or still carry an open flag of it.
CREATE OR REPLACE TEMP TABLE _fd_pool_nodes AS
SELECT n.pool, x.kind, x.family, count(DISTINCT x.node_id) AS pool_nodes
FROM (SELECT e.node_id, e.kind, coalesce(c.probe, e.component) AS family
      FROM _evaluated e LEFT JOIN _components c ON c.kind = e.kind AND c.component = e.component
      UNION
      SELECT node_id, kind, family FROM _fd_flags) x
JOIN nodes n ON n.node_id = x.node_id
WHERE n.pool IS NOT NULL AND n.pool <> ''
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _fd_pools AS
SELECT f.pool, f.kind, f.family, count(DISTINCT f.node_id) AS nodes, any_value(p.pool_nodes) AS pool_nodes
FROM _fd_flags f
JOIN _fd_pool_nodes p ON p.pool = f.pool AND p.kind = f.kind AND p.family = f.family
WHERE f.severity IN ('warning', 'critical') AND f.kind <> 'hardware_fault'
GROUP BY ALL
HAVING count(DISTINCT f.node_id) >= $pool_min_nodes
   AND count(DISTINCT f.node_id) > $pool_fraction * any_value(p.pool_nodes);

-- Each open flag's finding key.
CREATE OR REPLACE TEMP TABLE _fd_members AS
SELECT f.*, p.pool IS NOT NULL AS pooled, p.pool_nodes,
       CASE WHEN f.kind = 'hardware_fault'   -- one finding per node fault: a node's GPU (or host) and component
              THEN 'node|hardware_fault|' || f.node_id || '|' || f.component || '|' || coalesce(f.gpu::VARCHAR, 'host')
            WHEN p.pool IS NOT NULL THEN 'pool|' || f.kind || '|' || f.pool || '|' || f.family
            ELSE 'node|' || f.kind || '|' || f.node_id END AS finding_key
FROM _fd_flags f
LEFT JOIN _fd_pools p ON p.pool = f.pool AND p.kind = f.kind AND p.family = f.family
                     AND f.severity IN ('warning', 'critical');

CREATE OR REPLACE TEMP TABLE _fd AS
WITH agg AS (
    SELECT finding_key, any_value(pooled) AS pooled, any_value(kind) AS kind,
           CASE WHEN any_value(pooled) THEN NULL ELSE any_value(node_id) END AS node_id,
           any_value(pool) AS pool, CASE WHEN any_value(pooled) THEN any_value(family) END AS family,
           max(rank) AS rank, count(*) AS flags, count(DISTINCT node_id) AS nodes, any_value(pool_nodes) AS pool_nodes,
           string_agg(DISTINCT component, ',' ORDER BY component) AS components,
           string_agg(DISTINCT label, '/' ORDER BY label) AS labels,
           string_agg(DISTINCT gpu::VARCHAR, ',' ORDER BY gpu::VARCHAR) AS gpus,
           count(DISTINCT gpu) AS n_gpus,
           median(overhead) AS overhead, median(value) AS value,
           any_value(baseline_source) AS baseline_source,
           -- The worst flag's words; equal flags (four GPUs each idle 30 of 60 minutes) go to the lowest GPU,
           -- then node and component, so every collector and every run picks the same one.
           first(sentence ORDER BY rank DESC, coalesce(abs(value), 0) DESC, gpu NULLS FIRST, node_id, component)
               AS worst_sentence,
           first(advice ORDER BY rank DESC, coalesce(abs(value), 0) DESC, gpu NULLS FIRST, node_id, component)
               AS advice
    FROM _fd_members GROUP BY finding_key
)
SELECT *, CASE rank WHEN 2 THEN 'critical' WHEN 1 THEN 'warning' ELSE 'info' END AS severity,
       CASE kind WHEN 'noisy_neighbor_variance'
                   THEN 'noisy neighbor' || CASE WHEN worst_sentence LIKE '%hypervisor%' THEN ' (hypervisor)'
                                                 WHEN worst_sentence LIKE '%co-tenant%' THEN ' (co-tenant)' ELSE '' END
                 WHEN 'virtualization_overhead' THEN 'virtualization overhead'
                 ELSE replace(kind, '_', ' ') END AS title,
       CASE family WHEN 'pcie' THEN 'PCIe ' WHEN 'gpu_compute' THEN 'GPU ' WHEN 'collective' THEN ''
                   WHEN 'storage' THEN '' WHEN 'host' THEN 'host ' ELSE '' END AS family_label
FROM agg;

CREATE OR REPLACE TEMP TABLE _fd_scored AS
SELECT *,
       CASE WHEN pooled THEN
              pool || ': ' || family_label || labels || ' '
              || CASE WHEN kind = 'virtualization_overhead' AND overhead IS NOT NULL
                        THEN CASE WHEN components = 'steal' THEN '+' || _fmt(overhead) || ' points'
                                  ELSE printf('%+.0f', -overhead) || ' %' END
                             || ' against ' || CASE baseline_source WHEN 'fleet_bare_metal' THEN 'bare metal'
                                                    WHEN 'reference_table' THEN 'the reference table'
                                                    ELSE 'the declared baseline' END
                      WHEN kind = 'noisy_neighbor_variance'
                        THEN 'varies with median CV ' || printf('%.0f', value * 100) || ' %'
                      ELSE '(' || title || ')' END
              || ' on ' || nodes::VARCHAR || ' of ' || pool_nodes::VARCHAR || ' nodes ('
              || flags::VARCHAR || ' flags, worst ' || severity || ')'
              || CASE WHEN coalesce(advice, '') <> '' THEN ': ' || advice || ' for the whole pool.'
                      ELSE ': a pool-wide cause, not one node.' END
            WHEN kind = 'hardware_fault' THEN
              'hardware fault (' || severity || ', ' || components || ') on ' || node_id
              || coalesce(' (' || nullif(pool, '') || ')', '') || ': ' || worst_sentence
            ELSE
              title || ' on ' || node_id || coalesce(' (' || nullif(pool, '') || ')', '') || ': ' || labels
              || CASE WHEN n_gpus > 0 THEN ' on GPU' || CASE WHEN n_gpus > 1 THEN 's ' ELSE ' ' END || gpus ELSE '' END
              || ' (' || flags::VARCHAR || ' flag' || CASE WHEN flags > 1 THEN 's' ELSE '' END
              || ', worst ' || severity || '); worst: ' || worst_sentence
       END AS sentence
FROM _fd;

UPDATE findings AS d
SET last_seen = $now, severity = s.severity, flags = s.flags, nodes = s.nodes, pool_nodes = s.pool_nodes,
    components = s.components, gpus = s.gpus, pool = s.pool, sentence = s.sentence
FROM _fd_scored s
WHERE d.state = 'open' AND d.finding_key = s.finding_key
RETURNING 1 AS findings_updated;

INSERT INTO findings (finding_key, scope, kind, node_id, pool, family, severity, state, first_seen, last_seen,
                      flags, nodes, pool_nodes, components, gpus, sentence)
SELECT finding_key, CASE WHEN pooled THEN 'pool' ELSE 'node' END, kind, node_id, pool, family, severity, 'open',
       $now, $now, flags, nodes, pool_nodes, components, gpus, sentence
FROM _fd_scored s
WHERE NOT EXISTS (SELECT 1 FROM findings d WHERE d.state = 'open' AND d.finding_key = s.finding_key)
RETURNING 1 AS findings_opened;

UPDATE findings AS d
SET state = 'closed', closed_at = $now
WHERE d.state = 'open' AND NOT EXISTS (SELECT 1 FROM _fd_scored s WHERE s.finding_key = d.finding_key)
RETURNING 1 AS findings_closed;

UPDATE flags AS f
SET finding_id = d.finding_id
FROM _fd_members m, findings d
WHERE f.flag_id = m.flag_id AND d.state = 'open' AND d.finding_key = m.finding_key
  AND f.finding_id IS DISTINCT FROM d.finding_id;
