-- gpuagent collector schema: fabric link results (issue 12). Version 8.
-- One row per end per pair run: each end of a net_pair run reports the same metrics with both node ids
-- (node_a connected, node_b listened), so a link has up to two rows per run (reported_by tells them
-- apart). A pair the collector could not start (an end busy or silent) or saw no end of has one row, reported_by
-- 'collector', status 'skipped' (or 'timeout') and the reason.
CREATE TABLE link_results (
    pair_id           VARCHAR,
    node_a            VARCHAR NOT NULL,   -- the connecting end; send = a -> b
    node_b            VARCHAR NOT NULL,   -- the listening end
    probe             VARCHAR NOT NULL,
    params_key        VARCHAR,            -- the run's settings, canonical "k=v,..."; same key = comparable
    send_gbits_per_s  DOUBLE,
    recv_gbits_per_s  DOUBLE,
    rtt_p50_us        DOUBLE,
    rtt_p99_us        DOUBLE,
    started_at        TIMESTAMP NOT NULL,
    ended_at          TIMESTAMP NOT NULL,
    status            VARCHAR NOT NULL,   -- ok, skipped, failed, timeout
    reason            VARCHAR,
    reported_by       VARCHAR NOT NULL    -- the node id of the end that wrote it, or 'collector'
);

-- The newest run of each link (unordered pair) per probe and settings; one row, the connecting end's
-- when both ends reported it.
CREATE VIEW link_matrix_latest AS
SELECT * EXCLUDE (rn) FROM (
    SELECT *, row_number() OVER (
        PARTITION BY least(node_a, node_b), greatest(node_a, node_b), probe, params_key
        ORDER BY started_at DESC, (reported_by = node_a) DESC, (reported_by = 'collector')) AS rn
    FROM link_results)
WHERE rn = 1;
