-- gpuagent collector schema, version 3: the bare-metal fleet baselines the analyzer keeps
-- (see collector/analysis/25_fleet_baselines.sql), so that the 24 h lookback is read every
-- baseline_refresh, not every pass, and anyone can see what flags were compared against.
CREATE TABLE fleet_baselines (
    class_label   VARCHAR NOT NULL,   -- GPU model, PCIe gen and width, GPU count
    component     VARCHAR NOT NULL,
    params_key    VARCHAR NOT NULL,
    baseline      DOUBLE,             -- median of per-node medians over the lookback
    nodes         BIGINT,             -- bare-metal nodes behind it
    runs          BIGINT,
    computed_at   TIMESTAMP NOT NULL  -- the analysis time it was computed for
);
