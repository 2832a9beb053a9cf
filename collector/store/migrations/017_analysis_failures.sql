-- gpuagent collector schema, version 17: analysis steps that failed. A pass runs each step in its own
-- transaction; a step that fails is rolled back alone, the other kinds still run, and the failure is kept
-- here (and as an event and an analysis_incomplete flag) so /metrics and the report can say which step and
-- why. The next pass retries it.
CREATE TABLE analysis_failures (
    ts        TIMESTAMP NOT NULL,   -- the pass (analysis_runs.started_at)
    step      VARCHAR NOT NULL,     -- the SQL file, e.g. 50_utilization_gap.sql, or 'rollup'
    error     VARCHAR NOT NULL      -- the database's first line
);
ALTER TABLE analysis_runs ADD COLUMN failed_steps INTEGER DEFAULT 0;
