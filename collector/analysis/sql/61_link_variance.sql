-- noisy_neighbor_variance, component link: the spread of one fabric link's runs over the probe window (from
-- _nd_runs of 59_network_links.sql: one row per run, rate = the slower direction). CV = stddev / mean of
-- the link's ok runs (same settings); flag when CV >= the component threshold AND CV >= $noise_k x the median
-- link CV of its pool (needs $min_fleet_nodes other links there). A steady slow link is network_degraded's;
-- this is the link that is fine at times and not at others: shared, congested or lossy. The evidence carries
-- both ends' TCP retransmits and NIC drops over the window (samples_1m; host sampler), which say whether
-- the swings come with packet loss. The flags table keys a flag by node: the lower node id carries it.

CREATE OR REPLACE TEMP TABLE _lv_links AS
SELECT r.a, r.b, r.params_key,
       CASE WHEN coalesce(ca.pool, '') = coalesce(cb.pool, '') THEN coalesce(ca.pool, '')
            ELSE coalesce(ca.pool, '') || ' x ' || coalesce(cb.pool, '') END AS scope,
       count(*) AS runs, avg(r.gbits) AS mean, stddev_samp(r.gbits) / nullif(avg(r.gbits), 0) AS cv,
       min(r.gbits) AS min_gbits, quantile_cont(r.gbits, 0.5) AS p50_gbits, max(r.gbits) AS max_gbits,
       quantile_cont(r.rtt_p99_us, 0.5) AS rtt_p99_p50_us, max(r.rtt_p99_us) AS rtt_p99_max_us
FROM _nd_runs r
LEFT JOIN _node_class ca ON ca.node_id = r.a
LEFT JOIN _node_class cb ON cb.node_id = r.b
GROUP BY ALL
HAVING count(*) >= $min_runs;

CREATE OR REPLACE TEMP TABLE _lv_pool AS
SELECT scope, params_key, median(cv) AS pool_cv, count(*) AS links FROM _lv_links GROUP BY ALL;

-- Retransmits and drops of each node over the window (node-wide TCP, summed over its NICs).
CREATE OR REPLACE TEMP TABLE _lv_net AS
SELECT node_id,
       max(max) FILTER (WHERE metric = 'net_tcp_retrans_percent') AS retrans_pct_max,
       sum(sum) FILTER (WHERE metric = 'net_tcp_retrans_percent') / nullif(sum(n) FILTER (WHERE metric = 'net_tcp_retrans_percent'), 0) AS retrans_pct_avg,
       max(max) FILTER (WHERE metric = 'net_tcp_retrans_segs_per_s') AS retrans_segs_per_s_max,
       max(max) FILTER (WHERE metric IN ('net_rx_drops_per_s', 'net_tx_drops_per_s')) AS drops_per_s_max,
       max(max) FILTER (WHERE metric IN ('net_rx_errors_per_s', 'net_tx_errors_per_s')) AS errors_per_s_max
FROM samples_1m
WHERE minute > $probe_window_start AND minute <= $now
  AND metric IN ('net_tcp_retrans_percent', 'net_tcp_retrans_segs_per_s', 'net_rx_drops_per_s',
                 'net_tx_drops_per_s', 'net_rx_errors_per_s', 'net_tx_errors_per_s')
GROUP BY node_id;

CREATE OR REPLACE TEMP TABLE _lv AS
SELECT l.*, p.pool_cv, p.links - 1 AS peers, (p.links - 1) >= $min_fleet_nodes AS peers_ok,
       c.threshold, c.critical,
       na.retrans_pct_max AS a_retrans_pct_max, na.retrans_pct_avg AS a_retrans_pct_avg,
       na.drops_per_s_max AS a_drops_per_s_max, na.errors_per_s_max AS a_errors_per_s_max,
       nb.retrans_pct_max AS b_retrans_pct_max, nb.retrans_pct_avg AS b_retrans_pct_avg,
       nb.drops_per_s_max AS b_drops_per_s_max, nb.errors_per_s_max AS b_errors_per_s_max,
       greatest(coalesce(na.retrans_pct_max, 0), coalesce(nb.retrans_pct_max, 0)) >= 1.0
         OR greatest(coalesce(na.drops_per_s_max, 0), coalesce(nb.drops_per_s_max, 0)) > 0 AS lossy,
       ha.hostname AS host_a, hb.hostname AS host_b
FROM _lv_links l
JOIN _lv_pool p ON p.scope = l.scope AND p.params_key = l.params_key
JOIN _components c ON c.kind = 'noisy_neighbor_variance' AND c.component = 'link'
LEFT JOIN _lv_net na ON na.node_id = l.a
LEFT JOIN _lv_net nb ON nb.node_id = l.b
LEFT JOIN _node_class ha ON ha.node_id = l.a
LEFT JOIN _node_class hb ON hb.node_id = l.b;

INSERT INTO _evaluated SELECT DISTINCT a, NULL, 'noisy_neighbor_variance', 'link' FROM _lv;

INSERT INTO _conditions
SELECT a, NULL, 'noisy_neighbor_variance', 'link',
       CASE WHEN cv >= critical THEN 'critical' ELSE 'warning' END,
       cv, 'cv', pool_cv, 'fleet_pool_median',   -- every text part below is non-NULL: a sentence is required
       json_object('pair', [a, b], 'hostnames', [host_a, host_b], 'runs', runs, 'cv', round(cv, 4),
                   'mean_gbits', round(mean, 3), 'min_gbits', round(min_gbits, 3), 'p50_gbits', round(p50_gbits, 3),
                   'max_gbits', round(max_gbits, 3), 'rtt_p99_median_us', round(rtt_p99_p50_us, 1),
                   'rtt_p99_max_us', round(rtt_p99_max_us, 1), 'pool', scope, 'pool_median_link_cv', round(pool_cv, 4),
                   'pool_links', peers + 1, 'k', $noise_k, 'cv_threshold', threshold, 'params_key', params_key,
                   'tcp_retrans_percent_max', [a_retrans_pct_max, b_retrans_pct_max],
                   'tcp_retrans_percent_avg', [round(a_retrans_pct_avg, 3), round(b_retrans_pct_avg, 3)],
                   'nic_drops_per_s_max', [a_drops_per_s_max, b_drops_per_s_max],
                   'nic_errors_per_s_max', [a_errors_per_s_max, b_errors_per_s_max],
                   'other_noisy_links', count(*) OVER (PARTITION BY a) - 1)::VARCHAR,
       'The link between ' || coalesce(host_a, a) || ' and ' || coalesce(host_b, b) || ' swings from '
       || _fmt(min_gbits) || ' to ' || _fmt(max_gbits) || ' Gbit/s over ' || runs::VARCHAR || ' runs (CV '
       || printf('%.0f', cv * 100) || ' %, ' || CASE WHEN pool_cv > 0 THEN printf('%.1f', cv / pool_cv) || '× ' ELSE 'against ' END
       || 'the median link CV '
       || printf('%.0f', pool_cv * 100) || ' % of pool ' || coalesce(nullif(scope, ''), '(no pool)') || ')'
       || CASE WHEN lossy
               THEN ' with TCP retransmits up to ' || printf('%.1f', greatest(coalesce(a_retrans_pct_max, 0), coalesce(b_retrans_pct_max, 0)))
                    || ' % and NIC drops up to ' || printf('%.0f', greatest(coalesce(a_drops_per_s_max, 0), coalesce(b_drops_per_s_max, 0)))
                    || '/s: the path loses packets under load; check the switch ports'' error and discard counters, '
                    || 'the cables and the buffers on the route between them.'
               ELSE ' without retransmits or drops recorded at either end: the path is shared; look for other '
                    || 'traffic on its switch ports or an oversubscribed uplink between them.' END
FROM _lv
WHERE cv >= threshold AND peers_ok AND cv >= $noise_k * pool_cv
QUALIFY row_number() OVER (PARTITION BY a ORDER BY cv DESC, b, params_key) = 1;
