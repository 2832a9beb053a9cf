-- network_links: the pair runs of link_results as one row per run (_nd_runs) and per link (_nd_links), read
-- by 60_network_degraded.sql and 61_link_variance.sql. A run's rate is the slower of its two directions
-- (least(send, recv), Gbit/s); a link's rate is the median of its last $fabric_runs ok runs in the probe
-- window (per probe settings, params_key); its line rate is the lower of the NIC rates its ends report.
-- The analyzer runs this file in pieces of links (steps.py by_node: a link goes with its lower node id,
-- hash(least(node_a, node_b)) % $pieces = $piece), and each piece appends to the two tables: a link's runs
-- are all in one piece, so the tables come out as from one pass over all, and memory follows the piece (in one
-- statement, 30,000 nodes' 2.9 M runs ran out of the 512 MB default in the per-link window and medians).

CREATE OR REPLACE TEMP TABLE _nd_runs_piece AS
SELECT least(node_a, node_b) AS a, greatest(node_a, node_b) AS b, coalesce(params_key, '') AS params_key,
       started_at, least(send_gbits_per_s, recv_gbits_per_s) AS gbits, send_gbits_per_s AS send,
       recv_gbits_per_s AS recv, rtt_p50_us, rtt_p99_us,
       min(nic_speed_mbits) OVER (PARTITION BY coalesce(pair_id, node_a || '|' || node_b || started_at::VARCHAR))
           AS link_mbits
FROM link_results
WHERE probe = 'net_pair' AND status = 'ok' AND send_gbits_per_s IS NOT NULL AND recv_gbits_per_s IS NOT NULL
  AND isfinite(send_gbits_per_s) AND isfinite(recv_gbits_per_s)
  AND started_at > $probe_window_start AND started_at <= $now
  AND hash(least(node_a, node_b)) % $pieces = $piece
-- both ends report each run: keep one row per run
QUALIFY row_number() OVER (PARTITION BY coalesce(pair_id, node_a || '|' || node_b || started_at::VARCHAR)
                           ORDER BY (reported_by = node_a) DESC, reported_by) = 1;

CREATE TEMP TABLE IF NOT EXISTS _nd_runs AS FROM _nd_runs_piece LIMIT 0;
INSERT INTO _nd_runs FROM _nd_runs_piece;

CREATE OR REPLACE TEMP TABLE _nd_links_piece AS
WITH recent AS (
    SELECT *, row_number() OVER (PARTITION BY a, b, params_key ORDER BY started_at DESC) AS rn FROM _nd_runs_piece
)
SELECT r.a, r.b, r.params_key,
       CASE WHEN coalesce(ca.pool, '') = coalesce(cb.pool, '') THEN coalesce(ca.pool, '')
            ELSE coalesce(ca.pool, '') || ' x ' || coalesce(cb.pool, '') END AS scope,
       median(r.gbits) AS gbits, median(r.send) AS send, median(r.recv) AS recv,
       median(r.rtt_p50_us) AS rtt_p50_us, median(r.rtt_p99_us) AS rtt_p99_us, count(*) AS runs,
       max(r.started_at) AS last_at, min(r.link_mbits) AS link_mbits
FROM recent r
LEFT JOIN _node_class ca ON ca.node_id = r.a
LEFT JOIN _node_class cb ON cb.node_id = r.b
WHERE r.rn <= $fabric_runs
GROUP BY ALL;

CREATE TEMP TABLE IF NOT EXISTS _nd_links AS FROM _nd_links_piece LIMIT 0;
INSERT INTO _nd_links FROM _nd_links_piece;
