-- gpuagent collector schema: bounded retention, the disk guard and compaction (collector/store/maintenance.py).
-- (Integrator: migration 010; 009 is the lake branch's 009_exports, held here by a placeholder.)

-- One row per maintenance step that removed or rewrote rows: exactly what went, when and why.
CREATE TABLE retention_log (
    logged_at  TIMESTAMP NOT NULL,
    tbl        VARCHAR NOT NULL,     -- the table touched
    reason     VARCHAR NOT NULL,     -- retention, disk_guard, compaction
    ts_from    TIMESTAMP,            -- rows with time in [ts_from, ts_to) were affected (NULL: from the start)
    ts_to      TIMESTAMP,
    rows       BIGINT NOT NULL,      -- rows deleted (retention, disk_guard) or rewritten (compaction)
    bytes_used_before BIGINT,        -- disk guard: the measure it acted on (see docs/COLLECTOR.md)
    bytes_used_after  BIGINT,
    bytes_available_before BIGINT,   -- disk guard: volume free plus the file's free blocks
    bytes_available_after  BIGINT
);

-- Closed spans (storage.compact_span, from "hour") of samples already rewritten in series order, so
-- compaction does each once.
CREATE TABLE compacted_hours (
    tbl           VARCHAR NOT NULL,
    hour          TIMESTAMP NOT NULL,
    rows          BIGINT NOT NULL,
    compacted_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (tbl, hour)
);

-- The source's row count and a hash of the row at last_rowid when the watermark was set: appends keep that
-- row in place and move count and max(rowid) together, so a mismatch means rowids were renumbered (rows
-- deleted, then a checkpoint) and the rollup must not trust last_rowid (analyzer.renumbered_since).
ALTER TABLE rollup_watermarks ADD COLUMN last_count BIGINT;
ALTER TABLE rollup_watermarks ADD COLUMN last_key UBIGINT;
