-- utilization_gap: GPU time that is paid for but not used, over the window, from the 1-minute rollups.
-- Per GPU and minute: NVML utilization (samples_1m gpu_util_percent), GPM SM activity where the GPU has it
-- (gpu_sm_active_percent, whole-GPU series only), whether a job held the GPU (job_samples_1m) and, on
-- Kubernetes, whether the kubelet had allocated the whole GPU to a pod (gpu_pod_allocated, agent/kubelet.py).
-- Four components: no_job, held_idle, input_bound and pod_idle (a pod holds the GPU with no process on it and
-- it is idle: such a GPU looked free before pods were known), each as lost GPU-hours and money at the pool's
-- price per GPU-hour.
-- The analyzer runs this file in pieces of nodes (steps.py by_node): each reads only its piece's rows
-- (hash(node_id) % $pieces = $piece), so memory follows the piece, not the fleet.
-- held_idle judges a minute by SM activity where it exists, else by utilization: a GPU whose utilization
-- counter says "busy" (a kernel was always running) while few of its SMs were busy is held-idle in effect.

CREATE OR REPLACE TEMP TABLE _ug_minutes AS
WITH util AS (
    SELECT node_id, gpu, minute, sum / nullif(n, 0) AS util
    FROM samples_1m
    WHERE metric = 'gpu_util_percent' AND gpu IS NOT NULL AND gpu >= 0
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
),
sm AS (
    SELECT node_id, gpu, minute, sum / nullif(n, 0) AS sm_active
    FROM samples_1m
    WHERE metric = 'gpu_sm_active_percent' AND labels = '' AND gpu IS NOT NULL AND gpu >= 0
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
),
held AS (
    SELECT node_id, gpu, minute, arg_max(job_id, n) AS job_id
    FROM job_samples_1m
    WHERE gpu IS NOT NULL AND gpu >= 0
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
    GROUP BY ALL
),
pods AS (
    SELECT node_id, gpu, minute,
           min(regexp_extract(labels, '(^|,)namespace=([^,]*)', 2) || '/' || regexp_extract(labels, '(^|,)pod=([^,]*)', 2)) AS pod
    FROM samples_1m
    WHERE metric = 'gpu_pod_allocated' AND gpu IS NOT NULL AND gpu >= 0 AND labels NOT LIKE '%gpu_instance=%'
      AND minute >= date_trunc('minute', $window_start) AND minute <= $now
      AND hash(node_id) % $pieces = $piece
    GROUP BY ALL
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
)
SELECT u.node_id, u.gpu, u.minute, u.util, s.sm_active, coalesce(s.sm_active, u.util) AS busy,
       h.job_id, h.job_id IS NOT NULL AS held, p.pod, h.job_id IS NULL AND p.pod IS NOT NULL AS pod_only,
       ho.iowait, ho.cpu_busy
FROM util u
LEFT JOIN sm s ON s.node_id = u.node_id AND s.gpu = u.gpu AND s.minute = u.minute
LEFT JOIN held h ON h.node_id = u.node_id AND h.gpu = u.gpu AND h.minute = u.minute
LEFT JOIN pods p ON p.node_id = u.node_id AND p.gpu = u.gpu AND p.minute = u.minute
LEFT JOIN host ho ON ho.node_id = u.node_id AND ho.minute = u.minute;

-- Data-wait fraction per node and job from the step tracker (NULL when not measured).
CREATE OR REPLACE TEMP TABLE _ug_wait AS
SELECT node_id, job_id, avg(data_wait_fraction) AS data_wait
FROM job_steps
WHERE ts > $window_start AND ts <= $now AND data_wait_fraction IS NOT NULL AND data_wait_fraction >= 0
  AND hash(node_id) % $pieces = $piece
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _ug AS
SELECT m.node_id, m.gpu,
       count(*) AS sampled_minutes,
       count(*) FILTER (WHERE NOT m.held AND NOT m.pod_only) AS no_job_minutes,
       count(*) FILTER (WHERE m.pod_only) AS pod_minutes,
       count(*) FILTER (WHERE m.pod_only AND m.busy < $idle_util) AS pod_idle_minutes,
       avg(m.util) FILTER (WHERE m.pod_only) AS pod_util,
       count(*) FILTER (WHERE m.held) AS held_minutes,
       count(*) FILTER (WHERE m.held AND m.busy < $idle_util) AS held_idle_minutes,
       count(*) FILTER (WHERE m.held AND m.sm_active < $idle_util AND m.util >= $idle_util) AS busy_but_idle_minutes,
       avg(m.util) FILTER (WHERE m.held) AS held_util,
       avg(m.sm_active) FILTER (WHERE m.held) AS held_sm_active,
       avg(m.util) FILTER (WHERE NOT m.held AND NOT m.pod_only) AS no_job_util,
       avg(m.iowait) FILTER (WHERE m.held) AS iowait,
       avg(m.cpu_busy) FILTER (WHERE m.held) AS cpu_busy
FROM _ug_minutes m
GROUP BY m.node_id, m.gpu
HAVING count(*) >= $min_minutes;

-- The jobs and pods of each GPU, from its distinct (GPU, job) pairs: an ordered list(DISTINCT ...) over every
-- minute row would hold all of them in memory at once (DuckDB cannot spill ordered aggregates).
CREATE OR REPLACE TEMP TABLE _ug_names AS
SELECT node_id, gpu,
       list(name ORDER BY name) FILTER (WHERE what = 'job') AS jobs,
       list(name ORDER BY name) FILTER (WHERE what = 'pod') AS pods
FROM (SELECT DISTINCT node_id, gpu, 'job' AS what, job_id AS name FROM _ug_minutes WHERE held
      UNION ALL
      SELECT DISTINCT node_id, gpu, 'pod', pod FROM _ug_minutes WHERE pod IS NOT NULL)
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _ug_dw AS
SELECT j.node_id, j.gpu, avg(w.data_wait) AS data_wait
FROM (SELECT DISTINCT node_id, gpu, job_id FROM _ug_minutes WHERE held) j
JOIN _ug_wait w ON w.node_id = j.node_id AND w.job_id = j.job_id
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _ug_scored AS
SELECT u.*, nm.jobs, nm.pods, dw.data_wait, nc.pool, nc.price_per_gpu_hour,
       coalesce(u.held_minutes > 0 AND u.held_util < $input_util
                AND (dw.data_wait >= $data_wait
                     OR (dw.data_wait IS NULL AND (u.iowait >= $iowait OR u.cpu_busy >= $cpu_busy))),
                false) AS input_bound,
       u.held_minutes / 60.0 * coalesce(dw.data_wait, 1 - u.held_util / 100.0) AS input_bound_hours
FROM _ug u JOIN _node_class nc ON nc.node_id = u.node_id
LEFT JOIN _ug_names nm ON nm.node_id = u.node_id AND nm.gpu = u.gpu
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
