-- network_degraded: which node or link of the fabric is slow, from the links of 59_network_links.sql
-- (_nd_links: a link's rate is the median of its last $fabric_runs ok pair runs). Baselines, in order:
-- the same pool's median of per-node medians (each node's median over its links, so one bad node cannot
-- drag the reference down), then a declared value ([[baselines.declared]] component net_pair_gbits), then a
-- cited reference row of that component for the link's line rate (each end reports its NIC's rate; a link's
-- is the lower of the known ones; unknown: no row). A link is slow under $fabric_slow_fraction x that
-- baseline; a theoretical row is a ceiling no run reaches, so it gets the wider of that and
-- $theoretical_threshold % below it, as in 30_virtualization_overhead.sql. Only links with a baseline are judged.
--   node: more than half of a node's measured links are slow while most of those peers are fine with
--         their other peers -> the node (NIC, cable, switch port, host) is the common factor;
--   link: a slow link neither of whose ends is a degraded node -> that path alone.

-- Each link seen from both of its ends.
CREATE OR REPLACE TEMP TABLE _nd_ends AS
SELECT a AS node_id, b AS peer, scope, params_key, gbits, send, recv, rtt_p50_us, runs, link_mbits FROM _nd_links
UNION ALL
SELECT b, a, scope, params_key, gbits, send, recv, rtt_p50_us, runs, link_mbits FROM _nd_links;

CREATE OR REPLACE TEMP TABLE _nd_pool AS
WITH per_node AS (
    SELECT node_id, scope, params_key, median(gbits) AS node_gbits FROM _nd_ends GROUP BY ALL
),
fleet AS (
    SELECT scope, params_key, median(node_gbits) AS ref, count(*) AS nodes FROM per_node GROUP BY ALL
),
declared AS (
    SELECT f.scope, f.params_key, max(d.value) AS value
    FROM fleet f JOIN _declared_baselines d
      ON d.component = 'net_pair_gbits' AND (d.params_like IS NULL OR f.params_key LIKE d.params_like)
    GROUP BY ALL
)
SELECT f.scope, f.params_key, f.nodes, f.ref AS fleet_ref, d.value AS declared
FROM fleet f
LEFT JOIN declared d ON d.scope = f.scope AND d.params_key = f.params_key;

-- The reference row for each (settings, line rate): the most specific matching row, then the highest.
CREATE OR REPLACE TEMP TABLE _nd_ref AS
SELECT k.params_key, k.link_mbits, r.value, r.basis, r.source
FROM (SELECT DISTINCT params_key, link_mbits FROM _nd_links) k
JOIN _ref_baselines r ON r.component = 'net_pair_gbits'
 AND (r.params_like IS NULL OR k.params_key LIKE r.params_like)
 AND (r.link_mbits IS NULL OR r.link_mbits = k.link_mbits)
QUALIFY row_number() OVER (PARTITION BY k.params_key, k.link_mbits
                           ORDER BY (r.link_mbits IS NOT NULL)::INT + (r.params_like IS NOT NULL)::INT DESC,
                                    r.value DESC) = 1;

-- Each end of each link with its baseline: the pool's (median or declared) or its line rate's reference row.
CREATE OR REPLACE TEMP TABLE _nd_slow AS
WITH based AS (
    SELECT e.*, p.nodes AS pool_nodes,
           CASE WHEN p.nodes >= $min_fleet_nodes THEN p.fleet_ref ELSE coalesce(p.declared, r.value) END AS ref,
           CASE WHEN p.nodes >= $min_fleet_nodes THEN 'fleet_pool_median'
                WHEN p.declared IS NOT NULL THEN 'user_declared'
                WHEN r.value IS NOT NULL THEN 'reference_table' ELSE 'none' END AS ref_source,
           r.basis AS ref_basis, r.source AS ref_cited
    FROM _nd_ends e
    JOIN _nd_pool p ON p.scope = e.scope AND p.params_key = e.params_key
    LEFT JOIN _nd_ref r ON r.params_key = e.params_key AND r.link_mbits IS NOT DISTINCT FROM e.link_mbits
),
fraction AS (
    SELECT *, CASE WHEN ref_source = 'reference_table' AND ref_basis = 'theoretical'
                   THEN least($fabric_slow_fraction, 1 - $theoretical_threshold / 100.0)
                   ELSE $fabric_slow_fraction END AS slow_fraction
    FROM based
)
SELECT *, coalesce(gbits < slow_fraction * ref, false) AS slow FROM fraction;

-- For each slow link of a node: is the peer fine with its other peers?
CREATE OR REPLACE TEMP TABLE _nd_peers AS
SELECT x.node_id, x.peer, x.params_key, x.gbits,
       avg(o.slow::INTEGER) AS peer_other_slow, count(o.peer) AS peer_other_links
FROM _nd_slow x
LEFT JOIN _nd_slow o ON o.node_id = x.peer AND o.peer <> x.node_id AND o.params_key = x.params_key
                    AND o.ref IS NOT NULL
WHERE x.slow
GROUP BY ALL;

-- Per node, its judged links (those with a baseline). A pool median or declared value is one baseline for
-- all of them; reference rows follow each link's line rate, so the node's is its slow links' median.
CREATE OR REPLACE TEMP TABLE _nd_node AS
SELECT s.node_id, s.scope, s.params_key, coalesce(median(s.ref) FILTER (WHERE s.slow), median(s.ref)) AS ref,
       any_value(s.ref_source) AS ref_source, max(s.slow_fraction) AS slow_fraction,
       list(DISTINCT s.ref_cited) FILTER (WHERE s.ref_cited IS NOT NULL AND s.slow) AS ref_cited,
       any_value(s.pool_nodes) AS pool_nodes, count(*) AS links, count(*) FILTER (WHERE s.slow) AS slow_links,
       median(s.gbits) AS node_gbits, median(s.gbits) FILTER (WHERE s.slow) AS slow_gbits,
       median(s.gbits) FILTER (WHERE NOT s.slow) AS ok_gbits, sum(s.runs) AS runs
FROM _nd_slow s
WHERE s.ref IS NOT NULL
GROUP BY s.node_id, s.scope, s.params_key;

CREATE OR REPLACE TEMP TABLE _nd_bad_nodes AS
SELECT n.*, count(p.peer) FILTER (WHERE p.peer_other_links > 0 AND p.peer_other_slow < 0.5) AS peers_fine,
       count(p.peer) AS peers_slow
FROM _nd_node n
LEFT JOIN _nd_peers p ON p.node_id = n.node_id AND p.params_key = n.params_key
WHERE n.ref IS NOT NULL AND n.links >= $fabric_min_links AND n.slow_links * 2 > n.links
GROUP BY ALL
HAVING count(p.peer) FILTER (WHERE p.peer_other_links > 0 AND p.peer_other_slow < 0.5) * 2 > count(p.peer);

-- Each bad node's pairs for the evidence, built for those nodes only: an ordered list per node of the whole
-- fleet held every link of every node in memory at once (DuckDB cannot spill ordered aggregates).
CREATE OR REPLACE TEMP TABLE _nd_bad_pairs AS
SELECT s.node_id, s.scope, s.params_key,
       list({'peer': s.peer, 'gbits': round(s.gbits, 3), 'send': round(s.send, 3), 'recv': round(s.recv, 3),
             'rtt_p50_us': round(s.rtt_p50_us, 1), 'runs': s.runs, 'slow': s.slow, 'link_mbits': s.link_mbits}
            ORDER BY s.gbits, s.peer) AS pairs
FROM _nd_slow s
SEMI JOIN _nd_bad_nodes b ON b.node_id = s.node_id AND b.scope IS NOT DISTINCT FROM s.scope
                          AND b.params_key IS NOT DISTINCT FROM s.params_key
WHERE s.ref IS NOT NULL
GROUP BY s.node_id, s.scope, s.params_key;

-- Failed and skipped pair runs of each node in the window: counters for the evidence.
CREATE OR REPLACE TEMP TABLE _nd_counts AS
SELECT node_id, count(*) FILTER (WHERE status = 'failed') AS failed_runs,
       count(*) FILTER (WHERE status = 'timeout') AS timeout_runs,
       count(*) FILTER (WHERE status = 'skipped') AS skipped_runs
FROM (SELECT DISTINCT coalesce(pair_id, started_at::VARCHAR) AS run, status, unnest([node_a, node_b]) AS node_id
      FROM link_results
      WHERE probe = 'net_pair' AND status <> 'ok' AND started_at > $probe_window_start AND started_at <= $now)
GROUP BY node_id;

INSERT INTO _evaluated
SELECT DISTINCT node_id, NULL, 'network_degraded', 'node' FROM _nd_node WHERE ref IS NOT NULL
UNION ALL
SELECT DISTINCT a, NULL, 'network_degraded', 'link' FROM _nd_links;

INSERT INTO _conditions
SELECT b.node_id, NULL, 'network_degraded', 'node',
       CASE WHEN b.slow_gbits < 0.25 * b.ref THEN 'critical' ELSE 'warning' END,
       b.node_gbits, 'gbits_per_s', b.ref, b.ref_source,
       json_object('pairs', bp.pairs, 'links', b.links, 'slow_links', b.slow_links,
                   'node_median_gbits', round(b.node_gbits, 3), 'slow_median_gbits', round(b.slow_gbits, 3),
                   'pool', b.scope, 'pool_median_gbits', round(b.ref, 3), 'pool_nodes', b.pool_nodes,
                   'slow_fraction', b.slow_fraction, 'peers_fine_with_others', b.peers_fine,
                   'reference', CASE WHEN b.ref_source = 'reference_table' THEN b.ref_cited END,
                   'params_key', b.params_key, 'runs', b.runs,
                   'failed_runs', coalesce(c.failed_runs, 0), 'timeout_runs', coalesce(c.timeout_runs, 0),
                   'skipped_runs', coalesce(c.skipped_runs, 0))::VARCHAR,
       'Node ' || coalesce(nc.hostname, b.node_id) || ' reaches ' || b.slow_links::VARCHAR || ' of its '
       || b.links::VARCHAR || ' measured peers at only ' || _fmt(b.slow_gbits) || ' Gbit/s (median; '
       || printf('%.0f', 100 * b.slow_gbits / b.ref) || ' % of the '
       || CASE b.ref_source WHEN 'fleet_pool_median' THEN 'median ' || _fmt(b.ref) || ' Gbit/s of pool '
                                 || coalesce(nullif(b.scope, ''), '(no pool)')
               WHEN 'reference_table' THEN 'cited reference ' || _fmt(b.ref) || ' Gbit/s for its line rate'
               ELSE b.ref_source || ' baseline ' || _fmt(b.ref) || ' Gbit/s' END
       || ') while ' || b.peers_fine::VARCHAR || ' of those peers are fine with the others: drain node '
       || coalesce(nc.hostname, b.node_id) || ' and check its NIC, cable, switch port and link speed.'
FROM _nd_bad_nodes b
LEFT JOIN _nd_bad_pairs bp ON bp.node_id = b.node_id AND bp.scope IS NOT DISTINCT FROM b.scope
                          AND bp.params_key IS NOT DISTINCT FROM b.params_key
LEFT JOIN _node_class nc ON nc.node_id = b.node_id
LEFT JOIN _nd_counts c ON c.node_id = b.node_id
QUALIFY row_number() OVER (PARTITION BY b.node_id ORDER BY b.slow_gbits / b.ref, b.scope, b.params_key) = 1;

INSERT INTO _conditions
SELECT l.a, NULL, 'network_degraded', 'link',
       CASE WHEN l.gbits < 0.25 * s.ref THEN 'critical' ELSE 'warning' END,
       l.gbits, 'gbits_per_s', s.ref, s.ref_source,
       json_object('pair', [l.a, l.b], 'hostnames', [ca.hostname, cb.hostname], 'gbits', round(l.gbits, 3),
                   'send_gbits', round(l.send, 3), 'recv_gbits', round(l.recv, 3),
                   'rtt_p50_us', round(l.rtt_p50_us, 1), 'rtt_p99_us', round(l.rtt_p99_us, 1), 'runs', l.runs,
                   'pool', l.scope, 'pool_median_gbits', round(s.ref, 3), 'slow_fraction', s.slow_fraction,
                   'link_mbits', l.link_mbits,
                   'reference', CASE WHEN s.ref_source = 'reference_table'
                                     THEN json_object('basis', s.ref_basis, 'source', s.ref_cited) END,
                   'a_median_gbits', round(na.node_gbits, 3), 'a_slow_links', na.slow_links, 'a_links', na.links,
                   'b_median_gbits', round(nb.node_gbits, 3), 'b_slow_links', nb.slow_links, 'b_links', nb.links,
                   'params_key', l.params_key,
                   'other_slow_links', count(*) OVER (PARTITION BY l.a) - 1)::VARCHAR,
       'The link between ' || coalesce(ca.hostname, l.a) || ' and ' || coalesce(cb.hostname, l.b) || ' runs at '
       || _fmt(l.gbits) || ' Gbit/s (' || printf('%.0f', 100 * l.gbits / s.ref) || ' % of the '
       || CASE s.ref_source WHEN 'fleet_pool_median' THEN 'median ' || _fmt(s.ref) || ' Gbit/s of pool '
                                 || coalesce(nullif(l.scope, ''), '(no pool)')
               WHEN 'reference_table' THEN s.ref_basis || ' reference ' || _fmt(s.ref) || ' Gbit/s'
                                 || coalesce(' for a ' || printf('%g', l.link_mbits / 1000.0) || ' GbE link', '')
               ELSE s.ref_source || ' baseline ' || _fmt(s.ref) || ' Gbit/s' END
       || ') while both nodes are fine with their other peers: check the cable, switch ports and route between '
       || coalesce(ca.hostname, l.a) || ' and ' || coalesce(cb.hostname, l.b) || '.'
FROM _nd_links l
JOIN _nd_slow s ON s.node_id = l.a AND s.peer = l.b AND s.params_key = l.params_key AND s.slow
JOIN _nd_node na ON na.node_id = l.a AND na.params_key = l.params_key
JOIN _nd_node nb ON nb.node_id = l.b AND nb.params_key = l.params_key
LEFT JOIN _node_class ca ON ca.node_id = l.a
LEFT JOIN _node_class cb ON cb.node_id = l.b
WHERE NOT EXISTS (SELECT 1 FROM _nd_bad_nodes x WHERE x.node_id IN (l.a, l.b))
-- the flags table keys a flag by node: the lower node id carries its worst slow link, the others are counted
QUALIFY row_number() OVER (PARTITION BY l.a ORDER BY l.gbits / s.ref, l.b, l.params_key) = 1;
