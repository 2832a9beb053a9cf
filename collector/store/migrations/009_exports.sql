-- gpuagent collector schema, version 9: what the lake exporter has written (collector/lake/export.py).
-- One row per closed hour of one table exported under this collector's shard. A row exists only once the
-- partition is in place (renamed, or its _SUCCESS manifest written), so retention may delete raw rows of an
-- hour recorded here.
CREATE TABLE exports (
    tbl          VARCHAR NOT NULL,     -- samples, samples_1m, probe_results, probe_metrics, job_samples, ...
    hour         TIMESTAMP NOT NULL,   -- start of the UTC hour
    shard        VARCHAR NOT NULL,
    rows         BIGINT NOT NULL,
    bytes        BIGINT NOT NULL,      -- Parquet bytes written
    path         VARCHAR NOT NULL,     -- the partition directory, as given to the filesystem
    exported_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (tbl, hour, shard)
);
