-- The agents' per-interval summaries (samples_summary; docs/RESOLUTION.md), merged into samples_1m by the merge
-- statements of 10_rollup_samples.sql, which run after this one (steps.py: merge_like): n, sum, min and max are
-- mergeable, and every interval lies inside one minute (it divides a minute and starts on a multiple of
-- itself). The rows in (lo, hi] are what the queue holds at this chunk; collector/analysis/rollups.py deletes
-- them once every chunk is merged, in the pass's rollup transaction, so a summary is merged exactly once.

CREATE OR REPLACE TEMP TABLE _delta_samples AS
SELECT date_trunc('minute', ts) AS minute, node_id, gpu, metric, labels,
       sum(n) AS n, sum(sum) AS sum, min(min) AS min, max(max) AS max
FROM samples_summary
WHERE rowid > $lo AND rowid <= $hi
GROUP BY ALL;
