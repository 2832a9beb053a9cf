-- gpuagent collector schema, version 21: resolution where it pays (issue 44, docs/RESOLUTION.md).
-- samples_summary: per-interval summaries of the series no rule reads sample by sample (count, sum, min, max
-- of the interval that starts at ts). A queue: each pass merges its rows into samples_1m exactly
-- (12_rollup_summaries.sql) and deletes them in the same transaction.
CREATE TABLE samples_summary (
    ts TIMESTAMP NOT NULL,
    node_id VARCHAR NOT NULL,
    gpu SMALLINT,
    metric VARCHAR NOT NULL,
    labels VARCHAR NOT NULL,
    interval_s DOUBLE NOT NULL,
    n INTEGER NOT NULL,
    sum DOUBLE,
    min DOUBLE,
    max DOUBLE
);
-- raw_requests: a raw window asked of a node (a flag opened there, or `gpuagent-collector raw-window`);
-- sent_at when an ack carried it, answered_at when its last part arrived, rows how many samples came,
-- held_since the oldest sample the agent still held (a window reaching before it came back partial).
CREATE TABLE raw_requests (
    request_id VARCHAR PRIMARY KEY,
    node_id VARCHAR NOT NULL,
    since TIMESTAMP NOT NULL,
    until TIMESTAMP NOT NULL,
    reason VARCHAR,
    requested_at TIMESTAMP NOT NULL,
    sent_at TIMESTAMP,
    answered_at TIMESTAMP,
    rows BIGINT NOT NULL DEFAULT 0,
    held_since TIMESTAMP
);
-- raw_windows: the 1 s samples those answers carried. Apart from `samples`, so they are never rolled up a
-- second time (samples_1m already holds their summaries).
CREATE TABLE raw_windows (
    request_id VARCHAR NOT NULL,
    ts TIMESTAMP NOT NULL,
    node_id VARCHAR NOT NULL,
    gpu SMALLINT,
    metric VARCHAR NOT NULL,
    labels VARCHAR NOT NULL,
    value DOUBLE
);
