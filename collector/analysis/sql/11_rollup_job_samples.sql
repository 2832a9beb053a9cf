-- Incremental 1-minute rollup of job_samples: which job held which GPU in each minute, and how busy it was.
-- Same scheme as 10_rollup_samples.sql (rowid window, mergeable sums and counts).

CREATE OR REPLACE TEMP TABLE _delta_jobs AS
SELECT date_trunc('minute', ts) AS minute, node_id, gpu, job_id,
       count(*) AS n,
       sum(gpu_util_percent) AS gpu_util_sum,
       sum(cpu_percent) AS cpu_percent_sum,
       sum(read_bytes_per_s) AS read_bytes_per_s_sum
FROM job_samples
WHERE rowid > $lo AND rowid <= $hi
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _merged_jobs AS
SELECT d.minute, d.node_id, d.gpu, d.job_id,
       d.n + coalesce(o.n, 0) AS n,
       coalesce(d.gpu_util_sum, 0) + coalesce(o.gpu_util_sum, 0) AS gpu_util_sum,
       coalesce(d.cpu_percent_sum, 0) + coalesce(o.cpu_percent_sum, 0) AS cpu_percent_sum,
       coalesce(d.read_bytes_per_s_sum, 0) + coalesce(o.read_bytes_per_s_sum, 0) AS read_bytes_per_s_sum
FROM _delta_jobs d
LEFT JOIN (SELECT * FROM job_samples_1m WHERE minute BETWEEN $dmin AND $dmax) o
  ON o.minute = d.minute AND o.node_id = d.node_id AND o.gpu IS NOT DISTINCT FROM d.gpu AND o.job_id = d.job_id;

DELETE FROM job_samples_1m o USING _delta_jobs d
WHERE o.minute BETWEEN $dmin AND $dmax
  AND o.minute = d.minute AND o.node_id = d.node_id AND o.gpu IS NOT DISTINCT FROM d.gpu AND o.job_id = d.job_id;

INSERT INTO job_samples_1m
SELECT minute, node_id, gpu, job_id, n,
       gpu_util_sum, gpu_util_sum / n, cpu_percent_sum, cpu_percent_sum / n,
       read_bytes_per_s_sum, read_bytes_per_s_sum / n
FROM _merged_jobs;
