-- noisy_neighbor_variance for jobs seen only passively (no tracker): components co_tenant and hypervisor.
-- Per agent tick and job (agent/job_discovery.py): the job's progress (GPU util, else the CPU share of its
-- own processes) and the CPU used by processes that are not the job's; CPU steal of the same tick.
-- Neighbours are compared with their own usual level during the job (the 25th percentile of its ticks,
-- so a node that is always shared is judged by what changed): a tick is contended by co-tenants when
-- they use >= $neighbour_cpu % of a core more than that, by the hypervisor when steal >= $corr_steal;
-- quiet when neither (neighbours less than half that far above their usual level).
-- The flag opens when both contended and quiet ticks number >= $min_runs and the job's mean progress in
-- the contended ticks is lower than in the quiet ones by the component's threshold (a fraction).
-- A job's own busy phases (loading, checkpoints) never count: its own processes are not neighbours.

CREATE OR REPLACE TEMP TABLE _pc_ticks AS
WITH raw AS (
    SELECT node_id, ts, metric, value,
           regexp_extract(labels, '(^|,)job_id=([^,]*)', 2) AS job_id,
           regexp_extract(labels, '(^|,)source=([^,]*)', 2) AS source
    FROM samples
    WHERE ts > $window_start AND ts <= $now
      AND metric IN ('job_progress_percent', 'job_neighbour_cpu_percent')
), host AS (
    SELECT node_id, ts,
           max(value) FILTER (WHERE metric = 'cpu_steal_percent') AS steal,
           max(value) FILTER (WHERE metric = 'psi_cpu_some_avg10_percent') AS psi_cpu,
           max(value) FILTER (WHERE metric = 'psi_io_some_avg10_percent') AS psi_io,
           max(value) FILTER (WHERE metric = 'psi_memory_some_avg10_percent') AS psi_mem
    FROM samples
    WHERE ts > $window_start AND ts <= $now AND labels = ''
      AND metric IN ('cpu_steal_percent', 'psi_cpu_some_avg10_percent', 'psi_io_some_avg10_percent',
                     'psi_memory_some_avg10_percent')
    GROUP BY ALL
), t AS (
    SELECT node_id, job_id, ts,
           max(value) FILTER (WHERE metric = 'job_progress_percent') AS progress,
           max(source) FILTER (WHERE metric = 'job_progress_percent') AS progress_source,
           max(value) FILTER (WHERE metric = 'job_neighbour_cpu_percent') AS neighbour_cpu
    FROM raw GROUP BY ALL
), b AS (
    SELECT t.*, h.steal, h.psi_cpu, h.psi_io, h.psi_mem,
           quantile_cont(coalesce(t.neighbour_cpu, 0), 0.25) OVER (PARTITION BY t.node_id, t.job_id) AS neighbour_usual,
           -- seconds this tick stands for: the gap to the job's previous tick (capped: a gap is not contention)
           least(coalesce(epoch(t.ts - lag(t.ts) OVER (PARTITION BY t.node_id, t.job_id ORDER BY t.ts)), 0), 10.0) AS dt_s
    FROM t LEFT JOIN host h ON h.node_id = t.node_id AND h.ts = t.ts
    WHERE t.progress IS NOT NULL AND t.job_id <> ''
)
SELECT *,
       coalesce(neighbour_cpu, 0) >= neighbour_usual + $neighbour_cpu AS co_tenant,
       coalesce(steal, 0) >= $corr_steal AS hypervisor,
       coalesce(neighbour_cpu, 0) < neighbour_usual + $neighbour_cpu / 2 AND coalesce(steal, 0) < $corr_steal AS quiet
FROM b;

-- The named neighbours: by how much more CPU each command used in contended ticks than in quiet ones,
-- so processes that are always there (and so not what changed) rank last.
CREATE OR REPLACE TEMP TABLE _pc_names AS
WITH n AS (
    SELECT k.node_id, k.job_id, k.co_tenant, k.quiet,
           regexp_extract(s.labels, '(^|,)comm=([^,]*)', 2) AS comm,
           regexp_extract(s.labels, '(^|,)pid=([^,]*)', 2) AS pid, s.value
    FROM samples s
    JOIN _pc_ticks k ON k.node_id = s.node_id AND k.ts = s.ts
                    AND k.job_id = regexp_extract(s.labels, '(^|,)job_id=([^,]*)', 2)
    WHERE s.ts > $window_start AND s.ts <= $now AND s.metric = 'job_neighbour_process_cpu_percent'
), counts AS (
    SELECT node_id, job_id, count(*) FILTER (WHERE co_tenant) AS hit_n, count(*) FILTER (WHERE quiet) AS quiet_n
    FROM _pc_ticks GROUP BY ALL
)
SELECT n.node_id, n.job_id, n.comm, list(DISTINCT n.pid) FILTER (WHERE n.co_tenant) AS pids,
       coalesce(sum(n.value) FILTER (WHERE n.co_tenant), 0) / nullif(any_value(c.hit_n), 0) AS cpu_contended,
       coalesce(sum(n.value) FILTER (WHERE n.quiet), 0) / nullif(any_value(c.quiet_n), 0) AS cpu_quiet
FROM n JOIN counts c ON c.node_id = n.node_id AND c.job_id = n.job_id
GROUP BY n.node_id, n.job_id, n.comm
HAVING count(*) FILTER (WHERE n.co_tenant) > 0;

CREATE OR REPLACE TEMP TABLE _pc AS
WITH per AS (
    SELECT k.node_id, k.job_id, c.component, c.threshold, c.critical,
           max(k.progress_source) AS progress_source,
           count(*) FILTER (WHERE k.quiet) AS quiet_ticks,
           avg(k.progress) FILTER (WHERE k.quiet) AS quiet_progress,
           count(*) FILTER (WHERE CASE c.component WHEN 'co_tenant' THEN k.co_tenant ELSE k.hypervisor END) AS hit_ticks,
           avg(k.progress) FILTER (WHERE CASE c.component WHEN 'co_tenant' THEN k.co_tenant ELSE k.hypervisor END) AS hit_progress,
           sum(k.dt_s) FILTER (WHERE CASE c.component WHEN 'co_tenant' THEN k.co_tenant ELSE k.hypervisor END) AS hit_s,
           avg(k.neighbour_cpu) FILTER (WHERE k.co_tenant) AS neighbour_cpu_avg,
           avg(k.neighbour_cpu) FILTER (WHERE k.quiet) AS neighbour_cpu_quiet,
           max(k.steal) FILTER (WHERE k.hypervisor) AS steal_max,
           avg(k.steal) FILTER (WHERE k.hypervisor) AS steal_avg,
           max(k.psi_cpu) AS psi_cpu_max, max(k.psi_io) AS psi_io_max, max(k.psi_mem) AS psi_mem_max
    FROM _pc_ticks k
    JOIN _components c ON c.kind = 'noisy_neighbor_variance' AND c.component IN ('co_tenant', 'hypervisor')
    GROUP BY ALL
)
SELECT p.*, 1 - p.hit_progress / nullif(p.quiet_progress, 0) AS lost,
       (SELECT list({'comm': n.comm, 'pids': n.pids, 'avg_cpu_percent': round(n.cpu_contended, 1),
                     'avg_cpu_percent_quiet': round(coalesce(n.cpu_quiet, 0), 1)}
                    ORDER BY n.cpu_contended - coalesce(n.cpu_quiet, 0) DESC)[1:3]
        FROM _pc_names n WHERE n.node_id = p.node_id AND n.job_id = p.job_id) AS neighbours
FROM per p;

INSERT INTO _evaluated SELECT DISTINCT node_id, NULL, 'noisy_neighbor_variance', component FROM _pc;

INSERT INTO _conditions
SELECT node_id, NULL AS gpu, 'noisy_neighbor_variance' AS kind, component,
       CASE WHEN lost >= critical THEN 'critical' ELSE 'warning' END AS severity,
       lost AS value, 'fraction' AS unit, quiet_progress AS baseline, 'job_quiet_ticks' AS baseline_source,
       json_object(
           'job_id', job_id, 'progress_source', progress_source,
           'progress_quiet', round(quiet_progress, 1), 'progress_contended', round(hit_progress, 1),
           'progress_lost_fraction', round(lost, 3), 'contended_ticks', hit_ticks, 'contended_s', round(hit_s, 1),
           'quiet_ticks', quiet_ticks, 'neighbour_cpu_percent_avg', round(neighbour_cpu_avg, 1),
           'neighbour_cpu_percent_quiet', round(neighbour_cpu_quiet, 1),
           'neighbour_cpu_limit_percent', $neighbour_cpu, 'neighbours', neighbours,
           'cpu_steal_percent', json_object('avg', steal_avg, 'max', steal_max),
           'psi_some_avg10_percent_max', json_object('cpu', psi_cpu_max, 'io', psi_io_max, 'memory', psi_mem_max)
       )::VARCHAR AS evidence,
       'job ' || job_id || ' lost ' || printf('%.0f', lost * 100) || ' % of its progress ('
       || CASE progress_source WHEN 'gpu_util' THEN 'GPU utilization ' ELSE 'CPU share of its processes ' END
       || _fmt(quiet_progress) || ' % -> ' || _fmt(hit_progress) || ' %) during ' || printf('%.0f', hit_s) || ' s while '
       || CASE component
              WHEN 'co_tenant' THEN 'processes outside the job used ' || printf('%.0f', neighbour_cpu_avg)
                   || ' % of a core (usually ' || printf('%.0f', coalesce(neighbour_cpu_quiet, 0)) || ' %; most added: ' || coalesce(array_to_string(list_transform(neighbours,
                        x -> x.comm || ' ' || printf('%.0f', x.avg_cpu_percent) || ' %'), ', '), 'unnamed')
                   || '); isolate the co-tenant (cgroup CPU limits, pinning) or move it off this node.'
              ELSE 'the hypervisor stole up to ' || printf('%.0f', steal_max)
                   || ' % of the CPU; ask for dedicated vCPUs or move the job.' END
       AS sentence
FROM _pc
WHERE hit_ticks >= $min_runs AND quiet_ticks >= $min_runs AND lost >= threshold;
