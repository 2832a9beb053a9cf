-- gpuagent collector schema, version 1.
-- All timestamps are UTC (TIMESTAMP without time zone). gpu is NULL for host-level rows.
-- Migrations are applied in order by gpuagent.collector.store.schema; never edit a released one,
-- add NNN_next.sql instead.

CREATE TABLE nodes (
    node_id              VARCHAR PRIMARY KEY,
    machine_id           VARCHAR NOT NULL,
    hostname             VARCHAR NOT NULL,
    agent_version        VARCHAR,
    pool                 VARCHAR,          -- from labels.pool
    provider             VARCHAR,          -- from labels.provider
    region               VARCHAR,          -- from labels.region
    price_per_gpu_hour   DOUBLE,           -- from labels.price_per_gpu_hour
    synthetic            BOOLEAN DEFAULT false,  -- true for gpuagent-sim nodes (labels.synthetic=true)
    labels               MAP(VARCHAR, VARCHAR),
    cpu_model            VARCHAR,
    cpu_cores_logical    INTEGER,
    cpu_cores_physical   INTEGER,
    memory_total_bytes   UBIGINT,
    kernel               VARCHAR,
    os                   VARCHAR,
    driver_version       VARCHAR,
    cuda_version         VARCHAR,
    gpu_count            INTEGER,
    gpu_model            VARCHAR,          -- name of GPU 0, NULL without GPUs
    numa_nodes           INTEGER,
    virtualized          BOOLEAN,
    virt_type            VARCHAR,          -- systemd-detect-virt vocabulary: kvm, microsoft, none, ...
    in_container         BOOLEAN,
    container_runtime    VARCHAR,
    clocksource          VARCHAR,
    fingerprint          VARCHAR,          -- JSON of the full Fingerprint message
    first_seen           TIMESTAMP NOT NULL,
    last_seen            TIMESTAMP NOT NULL
);

CREATE TABLE gpus (
    node_id              VARCHAR NOT NULL,
    gpu                  SMALLINT NOT NULL,
    uuid                 VARCHAR,
    name                 VARCHAR,
    pci_bus_id           VARCHAR,
    pcie_gen_max         SMALLINT,
    pcie_gen_current     SMALLINT,
    pcie_width_max       SMALLINT,
    pcie_width_current   SMALLINT,
    memory_total_bytes   UBIGINT,
    mig_mode             VARCHAR,
    virtualization_mode  VARCHAR,
    numa_node            SMALLINT,
    PRIMARY KEY (node_id, gpu)
);

-- Telemetry in long form: one row per (time, series) value.
CREATE TABLE samples (
    ts        TIMESTAMP NOT NULL,
    node_id   VARCHAR NOT NULL,
    gpu       SMALLINT,
    metric    VARCHAR NOT NULL,
    labels    VARCHAR NOT NULL DEFAULT '',  -- "k=v,k2=v2" sorted by key, '' when none
    value     DOUBLE
);

-- One row per probe run, including skipped/failed/timeout runs.
CREATE TABLE probe_results (
    node_id     VARCHAR NOT NULL,
    probe       VARCHAR NOT NULL,
    gpu         SMALLINT,
    status      VARCHAR NOT NULL,   -- ok, skipped, failed, timeout
    reason      VARCHAR,
    params      VARCHAR,            -- JSON object
    params_key  VARCHAR,            -- canonical "k=v,..." sorted by key: same key = comparable runs
    env         VARCHAR,            -- JSON object
    started_at  TIMESTAMP NOT NULL,
    ended_at    TIMESTAMP NOT NULL,
    duration_s  DOUBLE
);

-- The metrics of each probe run, long form (joins probe_results on node_id, probe, gpu, started_at).
CREATE TABLE probe_metrics (
    node_id     VARCHAR NOT NULL,
    probe       VARCHAR NOT NULL,
    gpu         SMALLINT,
    params_key  VARCHAR,
    started_at  TIMESTAMP NOT NULL,
    metric      VARCHAR NOT NULL,
    value       DOUBLE
);

-- One row per job per node (upserted as samples arrive; ended_at set on the job_end event).
CREATE TABLE jobs (
    node_id               VARCHAR NOT NULL,
    job_id                VARCHAR NOT NULL,
    job_name              VARCHAR,
    source                VARCHAR,
    first_seen            TIMESTAMP NOT NULL,
    last_seen             TIMESTAMP NOT NULL,
    ended_at              TIMESTAMP,
    duration_s            DOUBLE,
    avg_gpu_util_percent  DOUBLE,
    world_size            INTEGER,
    PRIMARY KEY (node_id, job_id)
);

-- Passive per-process job samples (one row per process per tick).
CREATE TABLE job_samples (
    ts                  TIMESTAMP NOT NULL,
    node_id             VARCHAR NOT NULL,
    job_id              VARCHAR NOT NULL,
    pid                 INTEGER,
    rank                INTEGER,
    local_rank          INTEGER,
    gpu                 SMALLINT,
    gpu_util_percent    DOUBLE,
    gpu_memory_bytes    DOUBLE,
    cpu_percent         DOUBLE,
    rss_bytes           DOUBLE,
    read_bytes_per_s    DOUBLE,
    write_bytes_per_s   DOUBLE
);

-- Step-time aggregates from the opt-in tracker (gpuagent.jobs), one row per job rank per window.
CREATE TABLE job_steps (
    ts                  TIMESTAMP NOT NULL,
    node_id             VARCHAR NOT NULL,
    job_id              VARCHAR NOT NULL,
    job_name            VARCHAR,
    rank                INTEGER,
    pid                 INTEGER,
    window_s            DOUBLE,
    steps               INTEGER,
    step_time_p50_s     DOUBLE,
    step_time_p95_s     DOUBLE,
    step_time_max_s     DOUBLE,
    step_time_mean_s    DOUBLE,
    steps_per_s         DOUBLE,
    samples_per_s       DOUBLE,
    tokens_per_s        DOUBLE,
    data_wait_fraction  DOUBLE      -- NULL when not measured
);

CREATE TABLE events (
    ts        TIMESTAMP NOT NULL,
    node_id   VARCHAR NOT NULL,
    gpu       SMALLINT,
    kind      VARCHAR NOT NULL,
    message   VARCHAR,
    value     DOUBLE,
    attrs     VARCHAR              -- JSON object
);

-- Written by the analyzer only. One row per condition; an ongoing condition updates its open row.
CREATE SEQUENCE flag_id_seq;
CREATE TABLE flags (
    flag_id          BIGINT PRIMARY KEY DEFAULT nextval('flag_id_seq'),
    node_id          VARCHAR NOT NULL,
    gpu              SMALLINT,
    kind             VARCHAR NOT NULL,   -- virtualization_overhead, noisy_neighbor_variance, utilization_gap
    component        VARCHAR,            -- e.g. collective_busbw, h2d, storage_seq_read, no_job
    severity         VARCHAR NOT NULL,   -- info, warning, critical
    state            VARCHAR NOT NULL,   -- open, closed
    first_seen       TIMESTAMP NOT NULL,
    last_seen        TIMESTAMP NOT NULL,
    closed_at        TIMESTAMP,
    value            DOUBLE,             -- the measured value
    baseline         DOUBLE,             -- what it was compared against (NULL: no baseline)
    baseline_source  VARCHAR,            -- fleet_bare_metal, reference_table, user_declared, fleet_class_median (noise), none
    unit             VARCHAR,
    evidence         VARCHAR,            -- JSON: probe runs / sample windows behind it
    sentence         VARCHAR NOT NULL    -- one sentence a person can act on
);

-- Dedupe log: one row per stored batch. A resent (node_id, seq) is acked and ignored.
CREATE TABLE ingest_log (
    node_id       VARCHAR NOT NULL,
    seq           UBIGINT NOT NULL,
    committed_at  TIMESTAMP NOT NULL,
    n_samples     INTEGER,
    n_probe_results INTEGER,
    n_job_samples INTEGER,
    n_job_steps   INTEGER,
    n_events      INTEGER,
    PRIMARY KEY (node_id, seq)
);

-- Views for the common questions (read-only conveniences over the tables above).

-- Each GPU with its node's pool, provider and virtualization verdict.
CREATE VIEW v_node_gpus AS
SELECT n.node_id, n.hostname, n.pool, n.provider, n.region, n.synthetic, n.virtualized, n.virt_type,
       n.in_container, n.price_per_gpu_hour, n.gpu_count, g.gpu, g.uuid, g.name AS gpu_name, g.pci_bus_id,
       g.pcie_gen_max, g.pcie_gen_current, g.pcie_width_max, g.pcie_width_current, g.memory_total_bytes,
       g.mig_mode, g.virtualization_mode, g.numa_node, n.last_seen
FROM nodes n JOIN gpus g USING (node_id);

-- Every probe metric with its run's status and the node facts used to compare like with like.
CREATE VIEW v_probe_metrics AS
SELECT m.node_id, n.pool, n.virtualized, n.virt_type, n.gpu_model, n.gpu_count, m.probe, m.gpu, m.params_key,
       m.started_at, r.status, r.duration_s, m.metric, m.value
FROM probe_metrics m
JOIN probe_results r USING (node_id, probe, params_key, started_at)
LEFT JOIN nodes n USING (node_id)
WHERE m.gpu IS NOT DISTINCT FROM r.gpu;

-- Latest value of every series (metric, gpu, labels) of every node.
CREATE VIEW v_latest_samples AS
SELECT node_id, gpu, metric, labels, max(ts) AS ts, arg_max(value, ts) AS value
FROM samples GROUP BY node_id, gpu, metric, labels;

-- Ingest volume per node and minute, from the dedupe log.
CREATE VIEW v_ingest_per_minute AS
SELECT node_id, date_trunc('minute', committed_at) AS minute, count(*) AS batches, sum(n_samples) AS samples,
       max(seq) AS highest_seq
FROM ingest_log GROUP BY node_id, minute;

-- Jobs with their node's pool; running = no job_end seen yet.
CREATE VIEW v_jobs AS
SELECT j.*, n.pool, n.hostname, j.ended_at IS NULL AS running
FROM jobs j LEFT JOIN nodes n USING (node_id);
