-- gpuagent collector schema, version 22: v_latest_samples covers summarised series too (docs/RESOLUTION.md).
-- A series the agent summarises reaches samples only in a raw window, so its last value here is its newest
-- rolled-up minute's mean (dated at the minute), from the last hour of samples_1m; a raw sample wins when newer.
CREATE OR REPLACE VIEW v_latest_samples AS
SELECT node_id, gpu, metric, labels, max(ts) AS ts, arg_max(value, ts) AS value
FROM (
    SELECT node_id, gpu, metric, labels, ts, value FROM samples
    UNION ALL
    SELECT node_id, gpu, metric, labels, minute AS ts, avg AS value FROM samples_1m
    WHERE minute > (SELECT max(minute) FROM samples_1m) - INTERVAL 1 HOUR
)
GROUP BY node_id, gpu, metric, labels;
