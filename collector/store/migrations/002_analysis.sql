-- gpuagent collector schema, version 2: what the analyzer maintains.
-- 1-minute rollups of samples and job_samples, kept incrementally (see collector/analyzer.py): analysis over
-- a large fleet reads these, never the raw tables beyond the rows appended since the last pass.

-- One row per (minute, series). avg = sum / n. gpu NULL for host-level series, as in samples.
CREATE TABLE samples_1m (
    minute    TIMESTAMP NOT NULL,
    node_id   VARCHAR NOT NULL,
    gpu       SMALLINT,
    metric    VARCHAR NOT NULL,
    labels    VARCHAR NOT NULL,
    n         BIGINT NOT NULL,
    sum       DOUBLE,
    avg       DOUBLE,
    min       DOUBLE,
    max       DOUBLE
);

-- One row per (minute, node, gpu, job): which job held which GPU, and how busy it was.
CREATE TABLE job_samples_1m (
    minute                 TIMESTAMP NOT NULL,
    node_id                VARCHAR NOT NULL,
    gpu                    SMALLINT,
    job_id                 VARCHAR NOT NULL,
    n                      BIGINT NOT NULL,
    gpu_util_sum           DOUBLE,
    gpu_util_avg           DOUBLE,
    cpu_percent_sum        DOUBLE,
    cpu_percent_avg        DOUBLE,
    read_bytes_per_s_sum   DOUBLE,
    read_bytes_per_s_avg   DOUBLE
);

-- How far each rollup has read its source: rows with rowid <= last_rowid are rolled up.
-- The source tables are append-only between passes (one writer); a shrink is detected and rebuilt.
CREATE TABLE rollup_watermarks (
    source      VARCHAR PRIMARY KEY,   -- 'samples', 'job_samples'
    last_rowid  BIGINT NOT NULL,
    updated_at  TIMESTAMP NOT NULL
);

-- One row per analysis pass (what ran, how long, what changed).
CREATE TABLE analysis_runs (
    started_at        TIMESTAMP NOT NULL,
    ended_at          TIMESTAMP NOT NULL,
    window_s          DOUBLE,
    rollup_rows_in    BIGINT,       -- raw rows read by the incremental rollups
    rollup_s          DOUBLE,
    flags_s           DOUBLE,
    conditions        INTEGER,      -- conditions found this pass
    opened            INTEGER,
    updated           INTEGER,
    closed            INTEGER
);

CREATE VIEW v_open_flags AS
SELECT flag_id, node_id, gpu, kind, component, severity, first_seen, last_seen, value, unit,
       baseline, baseline_source, sentence, evidence
FROM flags WHERE state = 'open'
ORDER BY CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, kind, node_id, gpu, component;
