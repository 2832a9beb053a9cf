-- Incremental 1-minute rollup of samples.
-- Reads only the raw rows appended since the last pass (rowid in ($lo, $hi]; DuckDB skips the row groups
-- outside the range, so the time follows the new rows, not the table, though its profiler counts them all), aggregates them per minute and series, and merges them into
-- samples_1m: n, sum, min and max are mergeable, so a minute that was partly rolled up before (or a late
-- batch for an old minute) comes out exactly as a full GROUP BY over the raw rows would.
-- $dmin/$dmax bound the minutes touched so the merge reads only those rollup row groups.

CREATE OR REPLACE TEMP TABLE _delta_samples AS
SELECT date_trunc('minute', ts) AS minute, node_id, gpu, metric, labels,
       count(value) AS n, sum(value) AS sum, min(value) AS min, max(value) AS max
FROM samples
WHERE rowid > $lo AND rowid <= $hi
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _merged_samples AS
SELECT d.minute, d.node_id, d.gpu, d.metric, d.labels,
       d.n + coalesce(o.n, 0) AS n,
       CASE WHEN o.sum IS NULL THEN d.sum WHEN d.sum IS NULL THEN o.sum ELSE d.sum + o.sum END AS sum,
       least(d.min, o.min) AS min,
       greatest(d.max, o.max) AS max
FROM _delta_samples d
LEFT JOIN (SELECT * FROM samples_1m WHERE minute BETWEEN $dmin AND $dmax) o
  ON o.minute = d.minute AND o.node_id = d.node_id AND o.gpu IS NOT DISTINCT FROM d.gpu
 AND o.metric = d.metric AND o.labels = d.labels;

DELETE FROM samples_1m o USING _delta_samples d
WHERE o.minute BETWEEN $dmin AND $dmax
  AND o.minute = d.minute AND o.node_id = d.node_id AND o.gpu IS NOT DISTINCT FROM d.gpu
  AND o.metric = d.metric AND o.labels = d.labels;

INSERT INTO samples_1m (minute, node_id, gpu, metric, labels, n, sum, avg, min, max)
SELECT minute, node_id, gpu, metric, labels, n, sum, sum / nullif(n, 0), min, max
FROM _merged_samples;
