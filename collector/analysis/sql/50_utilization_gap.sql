-- utilization_gap: GPU time that is paid for but not used, over the window, from the 1-minute rollups.
-- Per GPU and minute: NVML utilization (samples_1m gpu_util_percent), GPM SM activity where the GPU has it
-- (gpu_sm_active_percent, whole-GPU series only), whether a job held the GPU (job_samples_1m) and, on
-- Kubernetes, whether the kubelet had allocated the whole GPU to a pod (gpu_pod_allocated, agent/schedulers/kubelet.py).
-- Four components: no_job, held_idle, input_bound and pod_idle (a pod holds the GPU with no process on it and
-- it is idle: such a GPU looked free before pods were known), each as lost GPU-hours and money at the pool's
-- price per GPU-hour.
-- The analyzer runs this file in pieces of nodes (steps.py by_node): each reads only its piece's rows
-- (hash(node_id) % $pieces = $piece), so memory follows the piece, not the fleet.
-- held_idle judges a minute by SM activity where it exists, else by utilization: a GPU whose utilization
-- counter says "busy" (a kernel was always running) while few of its SMs were busy is held-idle in effect.

-- Data-wait fraction per node and job from the step tracker (NULL when not measured).
CREATE OR REPLACE TEMP TABLE _ug_wait AS
SELECT node_id, job_id, avg(data_wait_fraction) AS data_wait
FROM job_steps
WHERE ts > $window_start AND ts <= $now AND data_wait_fraction IS NOT NULL AND data_wait_fraction >= 0
  AND hash(node_id) % $pieces = $piece
GROUP BY ALL;

-- Per GPU over the window, straight from the joined minutes: the GPU-minutes (4.8 M at 10,000 nodes x 8
-- GPUs x 1 h) are never a table of their own, and the jobs and pods are distinct lists, sorted after (an
-- ordered list over every minute row would have to hold all of them in memory; DuckDB cannot spill it).
CREATE OR REPLACE TEMP TABLE _ug AS
-- One aggregate gives each GPU-minute's utilization, SM activity, pod and job: the rows of samples_1m and
-- job_samples_1m side by side, grouped once (a pivot, not four scans joined: joins over every GPU-minute were
-- the memory of this step). Utilization and SM activity are the whole-GPU series (labels ''), not MIG ones;
-- a minute's job is the one with the most samples in it.
WITH gpu_rows AS (
    SELECT node_id, gpu, minute, metric, labels, sum, n, NULL::VARCHAR AS job_id
    FROM samples_1m
    WHERE gpu IS NOT NULL AND gpu >= 0
      AND ((metric IN ('gpu_util_percent', 'gpu_sm_active_percent') AND labels = '')
           OR (metric = 'gpu_pod_allocated' AND labels NOT LIKE '%gpu_instance=%'))
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
    UNION ALL
    SELECT node_id, gpu, minute, '(job)', '', NULL, n, job_id
    FROM job_samples_1m
    WHERE gpu IS NOT NULL AND gpu >= 0
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
),
gpu_minutes AS (
    SELECT node_id, gpu, minute,
           count(*) FILTER (WHERE metric = 'gpu_util_percent') > 0 AS has_util,
           sum(sum) FILTER (WHERE metric = 'gpu_util_percent')
             / nullif(sum(n) FILTER (WHERE metric = 'gpu_util_percent'), 0) AS util,
           sum(sum) FILTER (WHERE metric = 'gpu_sm_active_percent')
             / nullif(sum(n) FILTER (WHERE metric = 'gpu_sm_active_percent'), 0) AS sm_active,
           min(regexp_extract(labels, '(^|,)namespace=([^,]*)', 2) || '/' || regexp_extract(labels, '(^|,)pod=([^,]*)', 2))
             FILTER (WHERE metric = 'gpu_pod_allocated') AS pod,
           arg_max(job_id, n) FILTER (WHERE metric = '(job)') AS job_id
    FROM gpu_rows
    GROUP BY node_id, gpu, minute
),
host AS (
    SELECT node_id, minute,
           sum(sum) FILTER (WHERE metric = 'cpu_iowait_percent') / nullif(sum(n) FILTER (WHERE metric = 'cpu_iowait_percent'), 0) AS iowait,
           sum(sum) FILTER (WHERE metric IN ('cpu_user_percent', 'cpu_system_percent'))
             / nullif(max(n) FILTER (WHERE metric IN ('cpu_user_percent', 'cpu_system_percent')), 0) AS cpu_busy
    FROM samples_1m
    WHERE gpu IS NULL AND labels = ''
      AND metric IN ('cpu_iowait_percent', 'cpu_user_percent', 'cpu_system_percent')
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
    GROUP BY ALL
),
minutes AS (
    SELECT u.node_id, u.gpu, u.minute, u.util, u.sm_active, coalesce(u.sm_active, u.util) AS busy,
           u.job_id, u.job_id IS NOT NULL AS held, u.pod, u.job_id IS NULL AND u.pod IS NOT NULL AS pod_only,
           ho.iowait, ho.cpu_busy
    FROM gpu_minutes u
    LEFT JOIN host ho ON ho.node_id = u.node_id AND ho.minute = u.minute
    WHERE u.has_util
)
SELECT m.node_id, m.gpu,
       count(*) AS sampled_minutes,
       count(*) FILTER (WHERE NOT m.held AND NOT m.pod_only) AS no_job_minutes,
       count(*) FILTER (WHERE m.pod_only) AS pod_minutes,
       count(*) FILTER (WHERE m.pod_only AND m.busy < $idle_util) AS pod_idle_minutes,
       avg(m.util) FILTER (WHERE m.pod_only) AS pod_util,
       list_sort(list(DISTINCT m.pod) FILTER (WHERE m.pod IS NOT NULL)) AS pods,
       count(*) FILTER (WHERE m.held) AS held_minutes,
       count(*) FILTER (WHERE m.held AND m.busy < $idle_util) AS held_idle_minutes,
       count(*) FILTER (WHERE m.held AND m.sm_active < $idle_util AND m.util >= $idle_util) AS busy_but_idle_minutes,
       avg(m.util) FILTER (WHERE m.held) AS held_util,
       avg(m.sm_active) FILTER (WHERE m.held) AS held_sm_active,
       avg(m.util) FILTER (WHERE NOT m.held AND NOT m.pod_only) AS no_job_util,
       avg(m.iowait) FILTER (WHERE m.held) AS iowait,
       avg(m.cpu_busy) FILTER (WHERE m.held) AS cpu_busy,
       list_sort(list(DISTINCT m.job_id) FILTER (WHERE m.held)) AS jobs
FROM minutes m
GROUP BY m.node_id, m.gpu
HAVING count(*) >= $min_minutes;

CREATE OR REPLACE TEMP TABLE _ug_dw AS
SELECT j.node_id, j.gpu, avg(w.data_wait) AS data_wait
FROM (SELECT node_id, gpu, unnest(jobs) AS job_id FROM _ug) j
JOIN _ug_wait w ON w.node_id = j.node_id AND w.job_id = j.job_id
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _ug_scored AS
SELECT u.*, dw.data_wait, nc.pool, nc.price_per_gpu_hour,
       coalesce(u.held_minutes > 0 AND u.held_util < $input_util
                AND (dw.data_wait >= $data_wait
                     OR (dw.data_wait IS NULL AND (u.iowait >= $iowait OR u.cpu_busy >= $cpu_busy))),
                false) AS input_bound,
       u.held_minutes / 60.0 * coalesce(dw.data_wait, 1 - u.held_util / 100.0) AS input_bound_hours
FROM _ug u JOIN _node_class nc ON nc.node_id = u.node_id
LEFT JOIN _ug_dw dw ON dw.node_id = u.node_id AND dw.gpu = u.gpu;

INSERT INTO _evaluated
SELECT node_id, gpu, 'utilization_gap', comp FROM _ug_scored,
       (VALUES ('no_job'), ('held_idle'), ('input_bound'), ('pod_idle')) t(comp);

CREATE OR REPLACE TEMP TABLE _ug_cond AS
SELECT *, 'no_job' AS component, no_job_minutes / 60.0 AS lost_hours,
       'GPU ' || gpu::VARCHAR || ' had no job for ' || no_job_minutes::VARCHAR || ' of ' || sampled_minutes::VARCHAR
       || ' sampled minutes (mean util ' || printf('%.0f', coalesce(no_job_util, 0)) || ' %)' AS what,
       'schedule work onto it or release it from the pool' AS advice
FROM _ug_scored WHERE no_job_minutes >= $gap_fraction * sampled_minutes AND no_job_minutes > 0
UNION ALL BY NAME
SELECT *, 'held_idle' AS component, held_idle_minutes / 60.0 AS lost_hours,
       'GPU ' || gpu::VARCHAR || ' was held by ' || array_to_string(jobs, ', ') || ' but under '
       || printf('%.0f', $idle_util) || ' % busy for ' || held_idle_minutes::VARCHAR || ' of '
       || held_minutes::VARCHAR || ' held minutes'
       || CASE WHEN held_sm_active IS NOT NULL
               THEN ' (SM activity ' || printf('%.0f', held_sm_active) || ' % by GPM, utilization counter '
                    || printf('%.0f', coalesce(held_util, 0)) || ' %'
                    || CASE WHEN busy_but_idle_minutes > 0
                            THEN '; busy but idle inside for ' || busy_but_idle_minutes::VARCHAR || ' min' ELSE '' END
                    || ')'
               ELSE '' END       -- without GPM the sentence is about the utilization counter alone
       AS what,
       'ask the job owner to release idle allocations or fix the stalled job' AS advice
FROM _ug_scored
WHERE NOT input_bound AND held_minutes > 0 AND held_idle_minutes >= $gap_fraction * held_minutes
UNION ALL BY NAME
SELECT *, 'input_bound' AS component, input_bound_hours AS lost_hours,
       'GPU ' || gpu::VARCHAR || ' running ' || array_to_string(jobs, ', ') || ' is input-bound: '
       || CASE WHEN data_wait IS NOT NULL THEN printf('%.0f', data_wait * 100) || ' % of step time waits for data'
               ELSE 'CPU iowait ' || printf('%.0f', coalesce(iowait, 0)) || ' %, CPU busy '
                    || printf('%.0f', coalesce(cpu_busy, 0)) || ' %' END
       || ', GPU util ' || printf('%.0f', held_util) || ' %' AS what,
       'add data-loader workers, prefetch or cache the dataset, or move it to faster storage' AS advice
FROM _ug_scored WHERE input_bound
UNION ALL BY NAME
SELECT *, 'pod_idle' AS component, pod_idle_minutes / 60.0 AS lost_hours,
       'GPU ' || gpu::VARCHAR || ' was allocated to pod ' || array_to_string(pods, ', ')
       || ' with no process on it, under ' || printf('%.0f', $idle_util) || ' % busy for '
       || pod_idle_minutes::VARCHAR || ' of ' || pod_minutes::VARCHAR || ' allocated minutes (mean util '
       || printf('%.0f', coalesce(pod_util, 0)) || ' %)' AS what,
       'delete or scale down the idle pod, or lower its GPU request, so the scheduler can place work on the GPU' AS advice
FROM _ug_scored WHERE pod_minutes > 0 AND pod_idle_minutes >= $gap_fraction * pod_minutes;

INSERT INTO _conditions
SELECT node_id, gpu, 'utilization_gap' AS kind, component,
       CASE WHEN lost_hours >= 0.5 * $window_hours THEN 'critical' ELSE 'warning' END AS severity,
       lost_hours AS value, 'gpu_hours' AS unit, NULL AS baseline, 'none' AS baseline_source,
       json_object(
           'lost_gpu_hours', round(lost_hours, 4),
           'cost', round(lost_hours * price_per_gpu_hour, 2),
           'price_per_gpu_hour', price_per_gpu_hour, 'pool', pool,
           'window_hours', $window_hours, 'sampled_minutes', sampled_minutes,
           'no_job_minutes', no_job_minutes, 'held_minutes', held_minutes, 'held_idle_minutes', held_idle_minutes,
           'pod_minutes', pod_minutes, 'pod_idle_minutes', pod_idle_minutes, 'pods', pods,
           'held_gpu_util_percent', held_util, 'held_sm_active_percent', held_sm_active,
           'busy_but_idle_minutes', busy_but_idle_minutes,
           'activity_source', CASE WHEN held_sm_active IS NOT NULL THEN 'gpm_sm_active' ELSE 'utilization_counter' END,
           'jobs', jobs, 'data_wait_fraction', data_wait,
           'cpu_iowait_percent', iowait, 'cpu_busy_percent', cpu_busy
       )::VARCHAR AS evidence,
       what || ': ' || printf('%.2f', lost_hours) || ' GPU-h lost'
       || CASE WHEN price_per_gpu_hour IS NOT NULL
               THEN ' (' || printf('%.2f', lost_hours * price_per_gpu_hour) || ' at ' || printf('%.2f', price_per_gpu_hour)
                    || '/GPU-h in pool ' || coalesce(pool, '?') || ')'
               ELSE ' (no price for pool ' || coalesce(pool, '?') || ')' END
       || ' in the last ' || _hours($window_hours) || ': ' || advice || '.' AS sentence
FROM _ug_cond;
