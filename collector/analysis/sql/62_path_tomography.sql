-- network_degraded from the cheap layer (path probes, common/path_probe.py; docs/FABRIC.md "The cheap layer").
-- Each agent reports once per epoch a summary of every path it probed (probe_metrics of probe path_probe with
-- a `paths` metric) and a row in link_results (probe path_probe) for each path it confirmed as a suspect.
-- Tomography over the window $path_window_start .. $now:
--   a node's own view: its paths' median train rate, median rtt and datagram loss against its pool's
--   medians (pools of at least $min_fleet_nodes reporting nodes): slow under $fabric_slow_fraction of the
--   pool's train rate, late over $path_late_factor x the pool's rtt + $path_late_floor_us, lossy over
--   the larger of $path_loss_floor and five times the pool's loss;
--   node_paths: a node whose own view is bad and which at least $path_min_reporters peers with a healthy own
--     view named as a suspect: the node (NIC, cable, port, host) is what every path through it shares;
--   link_paths: a suspect path whose two ends both reported a healthy own view in the window and neither of
--     which is a bad node: that path alone (cable, port, route between them). Unless its reports lost
--     $path_loss_floor of their datagrams it needs $path_link_reports reports in the window.
--     A path is a link's alone only while neither end is named by $path_min_reporters or more other peers:
--     many peers naming one node is that node (found an epoch before its own newest summary may show it).
-- Probes through a node while it ran a bandwidth run (net_pair, a collective group) read that run's traffic,
-- not the fabric: a suspect probed then is left out, and so is a summary when the node has one from outside
-- such runs in the window.
-- The evidence says how many paths each judgement rests on.

-- Bandwidth runs in the window, one row per node (either end of a pair, every member of a group).
CREATE OR REPLACE TEMP TABLE _pt_runs AS
SELECT DISTINCT node_id, started_at, ended_at FROM (
    SELECT unnest([node_a, node_b]) AS node_id, started_at, ended_at FROM link_results
    WHERE probe <> 'path_probe' AND status <> 'skipped' AND ended_at > $path_window_start AND started_at <= $now
    UNION ALL
    SELECT unnest(string_split(members, ',')), started_at, ended_at FROM group_results
    WHERE status <> 'skipped' AND ended_at > $path_window_start AND started_at <= $now);

-- A summary spans its epoch: started_at to ended_at of its probe_results row (the latest end among that
-- node's path_probe rows of that start: a suspect never ends after the summary of its epoch).
CREATE OR REPLACE TEMP TABLE _pt_summary AS
WITH ends AS (
    SELECT node_id, started_at, max(ended_at) AS ended_at FROM probe_results
    WHERE probe = 'path_probe' AND started_at > $path_window_start AND started_at <= $now
    GROUP BY ALL
)
SELECT m.*, coalesce(e.ended_at, m.started_at) AS ended_at
FROM (
SELECT node_id, started_at,
       max(value) FILTER (WHERE metric = 'paths') AS paths,
       max(value) FILTER (WHERE metric = 'paths_suspect') AS paths_suspect,
       max(value) FILTER (WHERE metric = 'probes') AS probes,
       max(value) FILTER (WHERE metric = 'datagrams_sent') AS sent,
       max(value) FILTER (WHERE metric = 'datagrams_lost') AS lost,
       max(value) FILTER (WHERE metric = 'rtt_p50_us') AS rtt_us,
       max(value) FILTER (WHERE metric = 'train_gbits_per_s') AS train
FROM probe_metrics
WHERE probe = 'path_probe' AND started_at > $path_window_start AND started_at <= $now
GROUP BY node_id, started_at
HAVING max(value) FILTER (WHERE metric = 'paths') > 0) m
LEFT JOIN ends e ON e.node_id = m.node_id AND e.started_at = m.started_at;

-- A node's own view is its newest summary from outside its bandwidth runs, else its newest (a fault shows
-- in the next epoch, not once it fills half the window); its paths and probes are counted over the window
-- for the evidence.
CREATE OR REPLACE TEMP TABLE _pt_node AS
WITH marked AS (
    SELECT s.*, EXISTS (SELECT 1 FROM _pt_runs r WHERE r.node_id = s.node_id AND r.started_at <= s.ended_at
                                                    AND s.started_at <= r.ended_at) AS during_run
    FROM _pt_summary s
),
newest AS (
    SELECT * FROM marked
    QUALIFY row_number() OVER (PARTITION BY node_id ORDER BY during_run, started_at DESC) = 1
),
totals AS (
    SELECT node_id, count(*) AS epochs, sum(paths) AS paths, sum(paths_suspect) AS paths_suspect,
           sum(probes) AS probes FROM _pt_summary GROUP BY node_id
)
SELECT s.node_id, coalesce(c.pool, '') AS pool, c.hostname, t.epochs, t.paths, t.paths_suspect, t.probes,
       s.paths AS newest_paths, s.sent, s.lost, coalesce(s.lost / nullif(s.sent, 0), 0) AS loss, s.rtt_us,
       s.train, s.started_at AS last_at
FROM newest s
JOIN totals t ON t.node_id = s.node_id
LEFT JOIN _node_class c ON c.node_id = s.node_id;

CREATE OR REPLACE TEMP TABLE _pt_pool AS
SELECT pool, count(*) AS nodes, median(train) AS train, median(rtt_us) AS rtt_us, median(loss) AS loss,
       sum(paths) AS paths
FROM _pt_node GROUP BY pool;

CREATE OR REPLACE TEMP TABLE _pt_own AS
SELECT n.*, p.nodes AS pool_nodes, p.train AS pool_train, p.rtt_us AS pool_rtt_us, p.loss AS pool_loss,
       coalesce(n.train < $fabric_slow_fraction * p.train, false) AS slow,
       coalesce(n.rtt_us > $path_late_factor * p.rtt_us + $path_late_floor_us, false) AS late,
       n.loss > greatest($path_loss_floor, 5 * p.loss) AS lossy
FROM _pt_node n JOIN _pt_pool p ON p.pool = n.pool
WHERE p.nodes >= $min_fleet_nodes;

-- The window's suspect reports, without those probed while either end ran a bandwidth run (a second
-- either side: the ends' clocks and the run's start differ a little).
CREATE OR REPLACE TEMP TABLE _pt_reports AS
SELECT l.* FROM link_results l
WHERE l.probe = 'path_probe' AND l.status = 'ok' AND l.started_at > $path_window_start AND l.started_at <= $now
  AND NOT EXISTS (SELECT 1 FROM _pt_runs r WHERE r.node_id IN (l.node_a, l.node_b)
                    AND r.started_at - INTERVAL 1 SECOND <= l.ended_at AND l.started_at <= r.ended_at + INTERVAL 1 SECOND);

-- Suspect paths, one row per unordered pair: the reports of either end about the other.
CREATE OR REPLACE TEMP TABLE _pt_suspects AS
SELECT least(node_a, node_b) AS a, greatest(node_a, node_b) AS b, count(*) AS reports,
       list(DISTINCT reported_by ORDER BY reported_by) AS reporters,
       median(train_gbits_per_s) AS train, median(rtt_p50_us) AS rtt_us, max(loss_ratio) AS loss,
       max(started_at) AS last_at
FROM _pt_reports
GROUP BY ALL;

-- Who named each node: the distinct reporters of suspects with it at the other end, and how many of them
-- have a healthy own view.
CREATE OR REPLACE TEMP TABLE _pt_named AS
WITH ends AS (
    SELECT node_b AS node_id, node_a AS reporter FROM _pt_reports WHERE reported_by = node_a
)
SELECT e.node_id, count(DISTINCT e.reporter) AS named_by,
       count(DISTINCT e.reporter) FILTER (WHERE NOT (o.slow OR o.late OR o.lossy)) AS named_by_healthy
FROM ends e LEFT JOIN _pt_own o ON o.node_id = e.reporter
GROUP BY e.node_id;

CREATE OR REPLACE TEMP TABLE _pt_bad_nodes AS
SELECT o.*, coalesce(m.named_by, 0) AS named_by, coalesce(m.named_by_healthy, 0) AS named_by_healthy
FROM _pt_own o LEFT JOIN _pt_named m ON m.node_id = o.node_id
WHERE (o.slow OR o.late OR o.lossy) AND coalesce(m.named_by_healthy, 0) >= $path_min_reporters;

INSERT INTO _evaluated
SELECT node_id, NULL, 'network_degraded', 'node_paths' FROM _pt_own
UNION ALL
SELECT node_id, NULL, 'network_degraded', 'link_paths' FROM _pt_own;

INSERT INTO _conditions
SELECT b.node_id, NULL, 'network_degraded', 'node_paths',
       CASE WHEN b.train < 0.25 * b.pool_train OR b.loss >= 0.1 THEN 'critical' ELSE 'warning' END,
       CASE WHEN b.slow THEN b.train WHEN b.lossy THEN b.loss ELSE b.rtt_us END,
       CASE WHEN b.slow THEN 'gbits_per_s' WHEN b.lossy THEN 'ratio' ELSE 'us' END,
       CASE WHEN b.slow THEN b.pool_train WHEN b.lossy THEN b.pool_loss ELSE b.pool_rtt_us END,
       'fleet_pool_median',
       json_object('layer', 'path_probe', 'paths', b.paths, 'probes', b.probes, 'epochs', b.epochs,
                   'train_gbits_per_s', round(b.train, 3), 'pool_train_gbits_per_s', round(b.pool_train, 3),
                   'rtt_p50_us', round(b.rtt_us, 1), 'pool_rtt_p50_us', round(b.pool_rtt_us, 1),
                   'loss_ratio', round(b.loss, 4), 'pool_loss_ratio', round(b.pool_loss, 4),
                   'datagrams_sent', b.sent, 'datagrams_lost', b.lost,
                   'slow', b.slow, 'late', b.late, 'lossy', b.lossy, 'named_by', b.named_by,
                   'named_by_healthy_peers', b.named_by_healthy, 'pool', b.pool, 'pool_nodes', b.pool_nodes)::VARCHAR,
       'Node ' || coalesce(b.hostname, b.node_id) || '''s ' || printf('%d', b.paths::BIGINT)
       || ' probed paths are '
       || array_to_string(list_filter([CASE WHEN b.slow THEN 'slow (trains at ' || _fmt(b.train) || ' Gbit/s, '
                                            || printf('%.0f', 100 * b.train / b.pool_train) || ' % of pool '
                                            || coalesce(nullif(b.pool, ''), '(no pool)') || '''s median)' END,
                                       CASE WHEN b.lossy THEN 'lossy (' || printf('%.1f', 100 * b.loss)
                                            || ' % of datagrams lost)' END,
                                       CASE WHEN b.late THEN 'late (rtt p50 ' || printf('%.0f', b.rtt_us)
                                            || ' us against ' || printf('%.0f', b.pool_rtt_us) || ' us)' END],
                                      x -> x IS NOT NULL), ', ')
       || ', and ' || b.named_by_healthy::VARCHAR || ' peers that are fine with their other paths named it: '
       || 'drain node ' || coalesce(b.hostname, b.node_id) || ' and check its NIC, cable, switch port and link speed.'
FROM _pt_bad_nodes b;

INSERT INTO _conditions
SELECT s.a, NULL, 'network_degraded', 'link_paths',
       CASE WHEN s.train < 0.25 * p.train OR s.loss >= 0.1 THEN 'critical' ELSE 'warning' END,
       coalesce(s.train, s.loss), CASE WHEN s.train IS NOT NULL THEN 'gbits_per_s' ELSE 'ratio' END,
       CASE WHEN s.train IS NOT NULL THEN p.train ELSE p.loss END, 'fleet_pool_median',
       json_object('layer', 'path_probe', 'pair', [s.a, s.b], 'hostnames', [oa.hostname, ob.hostname],
                   'reports', s.reports, 'reporters', s.reporters, 'train_gbits_per_s', round(s.train, 3),
                   'pool_train_gbits_per_s', round(p.train, 3), 'rtt_p50_us', round(s.rtt_us, 1),
                   'pool_rtt_p50_us', round(p.rtt_us, 1), 'loss_ratio', round(s.loss, 4),
                   'a_paths', oa.paths, 'a_paths_suspect', oa.paths_suspect,
                   'b_paths', ob.paths, 'b_paths_suspect', ob.paths_suspect, 'pool', oa.pool,
                   'other_suspect_links', count(*) OVER (PARTITION BY s.a) - 1)::VARCHAR,
       'The path between ' || coalesce(oa.hostname, s.a) || ' and ' || coalesce(ob.hostname, s.b) || ' was '
       || 'confirmed bad in ' || s.reports::VARCHAR || ' report(s) ('
       || coalesce('trains at ' || _fmt(s.train) || ' Gbit/s against the pool''s ' || _fmt(p.train), '')
       || CASE WHEN s.loss > 0 THEN ', ' || printf('%.1f', 100 * s.loss) || ' % lost' ELSE '' END
       || coalesce(', rtt p50 ' || printf('%.0f', s.rtt_us) || ' us', '') || ') while both nodes are fine on their other '
       || printf('%d', (oa.paths + ob.paths)::BIGINT) || ' paths: check the cable, switch ports and route between '
       || coalesce(oa.hostname, s.a) || ' and ' || coalesce(ob.hostname, s.b) || '.'
FROM _pt_suspects s
JOIN _pt_own oa ON oa.node_id = s.a
JOIN _pt_own ob ON ob.node_id = s.b
JOIN _pt_pool p ON p.pool = oa.pool
LEFT JOIN _pt_named na ON na.node_id = s.a
LEFT JOIN _pt_named nb ON nb.node_id = s.b
WHERE NOT (oa.slow OR oa.late OR oa.lossy OR ob.slow OR ob.late OR ob.lossy)
  -- loss is a link's own; a slow or late train can be a busy CPU through all four readings of one probe,
  -- so a path whose reports lost under $path_loss_floor of their datagrams needs $path_link_reports reports
  -- (the other end's, or a later probe). Not any loss: a datagram lost by chance beside a busy-CPU reading
  -- (1e-5 of 140 datagrams, across 100,000 paths a minute) made a false link flag in the simulator, and a
  -- loss suspect loses three at least (>= 2 % of a probe and its confirmations at the defaults)
  AND (s.loss >= $path_loss_floor OR s.reports >= $path_link_reports)
  AND NOT EXISTS (SELECT 1 FROM _pt_bad_nodes x WHERE x.node_id IN (s.a, s.b))
  -- other peers naming either end (the pair's own report about it aside)
  AND coalesce(na.named_by, 0) - list_contains(s.reporters, s.b)::INT < $path_min_reporters
  AND coalesce(nb.named_by, 0) - list_contains(s.reporters, s.a)::INT < $path_min_reporters
-- the flags table keys a flag by node: the lower node id carries its worst suspect path, the others are counted
QUALIFY row_number() OVER (PARTITION BY s.a ORDER BY coalesce(s.train / p.train, 1) , -s.loss, s.b) = 1;
