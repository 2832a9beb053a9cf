-- gpuagent collector schema, version 13: collective group runs between nodes (issue 12).
-- One row per member per group run: every member of a coordinator-scheduled collective group (a ring of
-- [fabric] group_size nodes, or a pair when it is 2) reports the probe's result with the whole group in
-- rank order, so a run has up to group_size rows (node_rank and reported_by tell them apart). The figures
-- are the group's: the probe's timing is the mean over ranks (nccl-tests' default), the same at every
-- member. A group the collector could not start (a member busy or silent) or saw no end of has one row,
-- reported_by 'collector', node_rank NULL, status 'skipped' (or 'timeout') and the reason.
CREATE TABLE group_results (
    group_id              VARCHAR,
    members               VARCHAR NOT NULL,   -- node ids in rank order, comma-separated; rank 0 hosted the rendezvous
    group_size            INTEGER NOT NULL,   -- nodes in the group
    node_rank             INTEGER,            -- the reporting member's place in members; NULL on the collector's rows
    probe                 VARCHAR NOT NULL,   -- collective
    params_key            VARCHAR,            -- the coordinator's settings, canonical "k=v,..."; same key = comparable
    backend               VARCHAR,            -- nccl or gloo
    world_size            INTEGER,            -- ranks over all nodes
    busbw_gbytes_per_s    DOUBLE,             -- all-reduce bus bandwidth at the largest size, 10^9 B/s
    algbw_gbytes_per_s    DOUBLE,
    small_msg_latency_us  DOUBLE,
    largest_bytes         BIGINT,             -- the message size busbw and algbw were measured at
    started_at            TIMESTAMP NOT NULL,
    ended_at              TIMESTAMP NOT NULL,
    status                VARCHAR NOT NULL,   -- ok, skipped, failed, timeout
    reason                VARCHAR,
    reported_by           VARCHAR NOT NULL    -- the node id of the member that wrote it, or 'collector'
);

-- The newest run of each group (the same members in the same rank order) per probe and settings; one row,
-- rank 0's when it reported. A run's members start it at slightly different times: runs are ordered by
-- their earliest row.
CREATE VIEW group_results_latest AS
SELECT * EXCLUDE (run_started, rn) FROM (
    SELECT *, row_number() OVER (
        PARTITION BY members, probe, params_key
        ORDER BY run_started DESC, node_rank ASC NULLS LAST) AS rn
    FROM (SELECT *, min(started_at) OVER (PARTITION BY group_id) AS run_started FROM group_results))
WHERE rn = 1;
