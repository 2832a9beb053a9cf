-- noisy_neighbor_variance for jobs seen only passively (no tracker): components co_tenant and hypervisor.
-- Per agent tick and job (agent/samplers/job_discovery.py): the job's progress (GPU util, else the CPU share of its
-- own processes), the CPU, the storage I/O and the TCP bytes off the node of each command outside the job
-- (workers summed per command name), the RTT and busy send rate of the job's own connections off the node,
-- and the node's CPU steal. Each command's CPU, disk I/O and network bytes, and steal, is one contention
-- series (resource cpu, io, net, steal), with its margin.
-- An episode is a run of ticks where a series stands above its usual level (its 25th percentile over the
-- job) by a clear margin: >= $neighbour_cpu % of a core (disk I/O: >= $neighbour_io MB/s, network:
-- >= $neighbour_net MB/s) and >= half its
-- usual level (steal: >= $corr_steal points); up to two quiet ticks inside a run do not split it. The job's
-- first $job_warmup_s are left out (start-up: imports, rendezvous, not progress), and so are the last
-- $job_winddown_s of a job that has ended (a job_end event, or no tick for 30 s): its wind-down looks like
-- lost progress.
-- An episode with >= $min_runs ticks after it (ended) is judged against the job's progress just before and
-- just after it (each window as long as the episode, >= 10 s, without that series' episode ticks), so a slow
-- drift of the rest of the node does not count: progress lower than the two together by the component's
-- threshold, and lower than each side by at least half that.
-- An episode with fewer ticks after it is still going on (or the job ended inside it): it is judged from its
-- start against the window before it alone, so it flags while the co-tenant is still there; progress must
-- be lower than before by the whole threshold. Once the after window is there, the before-and-after
-- judgement takes over: a recovery keeps the flag (more sure), none closes it.
-- Both need: >= $min_runs ticks in the episode and before it, the series' level over the reference by the
-- margin, and (co_tenant) pressure risen in the episode by $psi_rise points, CPU pressure (PSI cpu some)
-- for a CPU neighbour and I/O pressure (PSI io some) for a disk one: a neighbour that takes CPU or the disk
-- from the job makes the job's tasks wait; one that only fills CPU the job left idle (the job's own slower
-- phase) does not. A network neighbour needs the job's own connections off the node slowed $net_slowdown-fold
-- (medians, episode against before): their RTT up (one that fills a link the job uses makes the job's packets
-- queue behind its own) or their send rate while they had data to send down (where the job filled the link
-- itself, its queue was full already and it now gets a share), while they carried no more than a quarter
-- more bytes than before (the job's own heavier traffic raises its RTT too, with its bytes); a job with no
-- connections off the node cannot lose to one. The job's own busy, I/O or network phases never count: its
-- processes are not neighbours.
-- Neighbours are named by their share of the added CPU (or disk I/O, or network traffic) during the episode.

CREATE OR REPLACE TEMP TABLE _pc_ticks AS
WITH raw AS (
    SELECT node_id, ts, metric, value,
           regexp_extract(labels, '(^|,)job_id=([^,]*)', 2) AS job_id,
           regexp_extract(labels, '(^|,)source=([^,]*)', 2) AS source
    FROM samples
    WHERE ts > $window_start AND ts <= $now
      AND metric IN ('job_progress_percent', 'job_neighbour_cpu_percent', 'job_tcp_srtt_ms',
                     'job_tcp_busy_send_rate_bytes_per_s', 'job_tcp_bytes_per_s')
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
           max(value) FILTER (WHERE metric = 'job_neighbour_cpu_percent') AS neighbour_cpu,
           max(value) FILTER (WHERE metric = 'job_tcp_srtt_ms') AS rtt,
           max(value) FILTER (WHERE metric = 'job_tcp_busy_send_rate_bytes_per_s') / 1e6 AS busy_mb,
           max(value) FILTER (WHERE metric = 'job_tcp_bytes_per_s') / 1e6 AS job_mb
    FROM raw GROUP BY ALL
), ended AS (
    SELECT DISTINCT node_id, json_extract_string(attrs, '$.job_id') AS job_id
    FROM events WHERE kind = 'job_end' AND ts > $window_start AND ts <= $now
), b AS (
    SELECT t.*, h.steal, h.psi_cpu, h.psi_io, h.psi_mem,
           min(t.ts) OVER (PARTITION BY t.node_id, t.job_id) AS job_first,
           max(t.ts) OVER (PARTITION BY t.node_id, t.job_id) AS job_last,
           -- seconds this tick stands for: the gap to the job's previous tick (capped: a gap is not contention)
           least(coalesce(epoch(t.ts - lag(t.ts) OVER (PARTITION BY t.node_id, t.job_id ORDER BY t.ts)), 0), 10.0) AS dt_s
    FROM t LEFT JOIN host h ON h.node_id = t.node_id AND h.ts = t.ts
    WHERE t.progress IS NOT NULL AND t.job_id <> ''
), j AS (
    SELECT b.*, (e.job_id IS NOT NULL OR b.job_last < $now - INTERVAL 30 SECOND) AS job_ended
    FROM b LEFT JOIN ended e ON e.node_id = b.node_id AND e.job_id = b.job_id
)
SELECT * FROM j
WHERE ts >= job_first + to_microseconds(CAST($job_warmup_s * 1e6 AS BIGINT))
  AND NOT (job_ended AND ts > job_last - to_microseconds(CAST($job_winddown_s * 1e6 AS BIGINT)));

-- value: % of one core (cpu), MB/s read and written (io) or MB/s sent and received off the node (net)
CREATE OR REPLACE TEMP TABLE _pc_named AS
SELECT node_id, ts, regexp_extract(labels, '(^|,)job_id=([^,]*)', 2) AS job_id,
       CASE metric WHEN 'job_neighbour_process_cpu_percent' THEN 'cpu'
                   WHEN 'job_neighbour_process_io_bytes_per_s' THEN 'io' ELSE 'net' END AS resource,
       regexp_extract(labels, '(^|,)comm=([^,]*)', 2) AS comm,
       regexp_extract(labels, '(^|,)pid=([^,]*)', 2) AS pid,
       CASE metric WHEN 'job_neighbour_process_cpu_percent' THEN value ELSE value / 1e6 END AS value
FROM samples
WHERE ts > $window_start AND ts <= $now
  AND metric IN ('job_neighbour_process_cpu_percent', 'job_neighbour_process_io_bytes_per_s',
                 'job_neighbour_process_net_bytes_per_s');

-- One row per job tick and series: every named command's CPU, disk I/O and network bytes (0 in ticks where
-- it was not named) and steal. A command's disk series is keyed "<command> disk I/O", its network series
-- "<command> network". ``margin``: how far over its usual level the series must stand, in its own unit.
CREATE OR REPLACE TEMP TABLE _pc_series AS
WITH keys AS (SELECT DISTINCT node_id, job_id, resource, comm FROM _pc_named),
s AS (
    SELECT k.node_id, k.job_id, k.ts, k.progress, k.job_ended, k.psi_cpu, k.psi_io, k.rtt, k.busy_mb, k.job_mb, k.dt_s,
           'co_tenant' AS component, c.resource, c.comm AS comm,
           CASE c.resource WHEN 'io' THEN c.comm || ' disk I/O' WHEN 'net' THEN c.comm || ' network'
                           ELSE c.comm END AS key, coalesce(n.value, 0) AS v,
           CASE c.resource WHEN 'cpu' THEN $neighbour_cpu WHEN 'io' THEN $neighbour_io ELSE $neighbour_net END
             AS margin
    FROM _pc_ticks k
    JOIN keys c ON c.node_id = k.node_id AND c.job_id = k.job_id
    LEFT JOIN _pc_named n ON n.node_id = k.node_id AND n.job_id = k.job_id AND n.ts = k.ts
                         AND n.resource = c.resource AND n.comm = c.comm
    UNION ALL
    SELECT node_id, job_id, ts, progress, job_ended, psi_cpu, psi_io, rtt, busy_mb, job_mb, dt_s, 'hypervisor', 'steal',
           NULL, 'cpu steal', coalesce(steal, 0), $corr_steal
    FROM _pc_ticks
), u AS (
    SELECT *, quantile_cont(v, 0.25) OVER (PARTITION BY node_id, job_id, key) AS usual FROM s
), h AS (
    -- a command's series: the margin and half its usual level; steal: the margin alone
    SELECT *, v >= usual + CASE resource WHEN 'steal' THEN margin ELSE greatest(margin, usual / 2) END AS raw_hit
    FROM u
), g AS (
    -- up to two quiet ticks between contended ones do not end the episode
    SELECT *, raw_hit OR coalesce(bool_or(raw_hit) OVER (w ROWS BETWEEN 2 PRECEDING AND 1 PRECEDING)
                                  AND bool_or(raw_hit) OVER (w ROWS BETWEEN 1 FOLLOWING AND 2 FOLLOWING), false) AS hit
    FROM h WINDOW w AS (PARTITION BY node_id, job_id, key ORDER BY ts)
)
SELECT *, row_number() OVER (PARTITION BY node_id, job_id, key ORDER BY ts)
          - row_number() OVER (PARTITION BY node_id, job_id, key, hit ORDER BY ts) AS island
FROM g;

CREATE OR REPLACE TEMP TABLE _pc_episodes AS
WITH e AS (
    SELECT node_id, job_id, component, resource, comm, key, margin, island, min(ts) AS t0, max(ts) AS t1,
           count(*) AS n,
           sum(dt_s) AS hit_s, avg(progress) AS p_hit, avg(v) AS v_hit, any_value(job_ended) AS job_ended,
           max(psi_cpu) AS psi_cpu_hit_max, max(psi_io) AS psi_io_hit_max, median(rtt) AS rtt_hit,
           median(busy_mb) AS busy_hit, median(job_mb) AS job_mb_hit
    FROM _pc_series WHERE hit GROUP BY ALL
    HAVING count(*) >= $min_runs
), r AS (
    SELECT e.*, greatest(e.t1 - e.t0, INTERVAL 10 SECOND) AS span FROM e
)
SELECT r.*,
       count(s.ts) FILTER (WHERE s.ts < r.t0) AS n_before,
       count(s.ts) FILTER (WHERE s.ts > r.t1) AS n_after,
       avg(s.progress) FILTER (WHERE s.ts < r.t0) AS p_before,
       avg(s.progress) FILTER (WHERE s.ts > r.t1) AS p_after,
       avg(s.progress) AS p_ref, avg(s.v) AS v_ref,
       avg(s.v) FILTER (WHERE s.ts < r.t0) AS v_before,
       avg(s.psi_cpu) FILTER (WHERE s.ts < r.t0) AS psi_cpu_before,
       avg(s.psi_io) FILTER (WHERE s.ts < r.t0) AS psi_io_before,
       median(s.rtt) FILTER (WHERE s.ts < r.t0) AS rtt_before,
       median(s.busy_mb) FILTER (WHERE s.ts < r.t0) AS busy_before,
       median(s.job_mb) FILTER (WHERE s.ts < r.t0) AS job_mb_before
FROM r
LEFT JOIN _pc_series s ON s.node_id = r.node_id AND s.job_id = r.job_id AND s.key = r.key AND NOT s.hit
     AND ((s.ts >= r.t0 - r.span AND s.ts < r.t0) OR (s.ts > r.t1 AND s.ts <= r.t1 + r.span))
GROUP BY ALL;

CREATE OR REPLACE TEMP TABLE _pc AS
WITH q0 AS (
    -- An open-ended episode has only the window before it to be compared with.
    SELECT e.* REPLACE (CASE WHEN e.n_after < $min_runs THEN e.p_before ELSE e.p_ref END AS p_ref,
                        CASE WHEN e.n_after < $min_runs THEN e.v_before ELSE e.v_ref END AS v_ref),
           c.threshold, c.critical, e.n_after < $min_runs AS open_ended,
           (SELECT max(k.progress_source) FROM _pc_ticks k WHERE k.node_id = e.node_id AND k.job_id = e.job_id)
             AS source_of_progress,
           n.cpu_cores_logical AS cpus
    FROM _pc_episodes e
    JOIN _components c ON c.kind = 'noisy_neighbor_variance' AND c.component = e.component
    LEFT JOIN nodes n ON n.node_id = e.node_id
), q AS (
    SELECT *, 1 - p_hit / nullif(p_ref, 0) AS lost,
           1 - p_hit / nullif(p_before, 0) AS lost_before, 1 - p_hit / nullif(p_after, 0) AS lost_after
    FROM q0
), ok AS (
    SELECT * FROM q
    WHERE n_before >= $min_runs
      AND v_hit - v_ref >= CASE resource WHEN 'steal' THEN margin ELSE greatest(margin, v_ref / 2) END
      AND lost >= threshold
      AND (open_ended OR (lost_before >= threshold / 2 AND coalesce(lost_after, 1) >= threshold / 2))
      -- A neighbour that takes CPU from the job makes the job's threads wait: CPU pressure rises (PSI, where
      -- the node has it). One that only soaks up CPU the job left idle (its own slower phase) raises none.
      -- A disk neighbour that slows the job's I/O makes its tasks wait on I/O: I/O pressure rises.
      AND (resource <> 'cpu' OR psi_cpu_hit_max IS NULL OR psi_cpu_before IS NULL
           OR psi_cpu_hit_max >= psi_cpu_before + $psi_rise)
      AND (resource <> 'io' OR psi_io_hit_max IS NULL OR psi_io_before IS NULL
           OR psi_io_hit_max >= psi_io_before + $psi_rise)
      -- A network neighbour that takes a link from the job slows the job's connections off the node: their
      -- packets queue (RTT up), or they get a share of a link they filled (busy send rate down), and they do
      -- not carry more than before (the job's own heavier traffic raises its RTT as well). Without such
      -- connections (all unknown) the job cannot lose to one.
      AND (resource <> 'net'
           OR ((rtt_hit >= rtt_before * $net_slowdown OR busy_hit * $net_slowdown <= busy_before)
               AND coalesce(job_mb_hit, 0) <= coalesce(job_mb_before, 0) * 1.25))
      -- Steal can take from a job measured by its CPU share at most the CPU it stole: on N CPUs, s points of
      -- steal are s * N % of one core. The rise in steal must account for at least half of the CPU share the
      -- job lost, or the drop is the job's own (an I/O phase, say) that a little steal happened to overlap.
      AND NOT (component = 'hypervisor' AND source_of_progress = 'cpu_share' AND cpus IS NOT NULL
               AND (v_hit - v_ref) * cpus < 0.5 * (p_ref - p_hit))
    -- the episode still going on is the news; else the worst
    QUALIFY row_number() OVER (PARTITION BY node_id, component
                               ORDER BY open_ended DESC, lost DESC, v_hit - v_ref DESC, key) = 1
), win AS (   -- every tick of the episode and of its reference windows, for the totals and the names
    SELECT ok.node_id, ok.job_id, ok.component, ok.resource, k.ts, k.ts BETWEEN ok.t0 AND ok.t1 AS during,
           k.neighbour_cpu, k.steal, k.psi_cpu, k.psi_io, k.psi_mem, k.progress_source
    FROM ok JOIN _pc_ticks k ON k.node_id = ok.node_id AND k.job_id = ok.job_id
     AND k.ts >= ok.t0 - ok.span AND k.ts <= ok.t1 + ok.span
), tot AS (
    SELECT node_id, job_id, component, max(progress_source) AS progress_source,
           avg(neighbour_cpu) FILTER (WHERE during) AS n_hit, avg(neighbour_cpu) FILTER (WHERE NOT during) AS n_ref,
           avg(steal) FILTER (WHERE during) AS steal_avg, max(steal) FILTER (WHERE during) AS steal_max,
           max(psi_cpu) FILTER (WHERE during) AS psi_cpu_max, max(psi_io) FILTER (WHERE during) AS psi_io_max,
           max(psi_mem) FILTER (WHERE during) AS psi_mem_max,
           count(*) FILTER (WHERE during) AS n_during, count(*) FILTER (WHERE NOT during) AS n_around
    FROM win GROUP BY ALL
), per_comm AS (   -- the commands' use of the episode's resource (CPU for steal)
    SELECT w.node_id, w.job_id, w.component, n.comm,
           list(DISTINCT n.pid) FILTER (WHERE w.during) AS pids,
           coalesce(sum(n.value) FILTER (WHERE w.during), 0) AS s_hit,
           coalesce(sum(n.value) FILTER (WHERE NOT w.during), 0) AS s_ref
    FROM win w JOIN _pc_named n ON n.node_id = w.node_id AND n.job_id = w.job_id AND n.ts = w.ts
                               AND n.resource = CASE WHEN w.resource IN ('io', 'net') THEN w.resource ELSE 'cpu' END
    GROUP BY ALL
), rises AS (
    SELECT p.*, p.s_hit / t.n_during - p.s_ref / nullif(t.n_around, 0) AS rise,
           p.s_hit / t.n_during AS level_hit, coalesce(p.s_ref / nullif(t.n_around, 0), 0) AS level_ref
    FROM per_comm p JOIN tot t USING (node_id, job_id, component)
), shares AS (
    SELECT *, rise / sum(rise) FILTER (WHERE rise > 0) OVER (PARTITION BY node_id, job_id, component) AS share
    FROM rises
)
SELECT ok.*, tot.* EXCLUDE (node_id, job_id, component),
       CASE WHEN NOT ok.open_ended THEN 'ended' WHEN ok.job_ended THEN 'until_job_end'
            WHEN ok.n_after = 0 THEN 'ongoing' ELSE 'ended' END AS episode,
       (SELECT list({'comm': s.comm, 'pids': s.pids, 'contended': round(s.level_hit, 1),
                     'around': round(s.level_ref, 1), 'share_of_added': round(s.share, 3)}
                    ORDER BY s.rise DESC, s.comm)[1:3]
        FROM shares s WHERE s.node_id = ok.node_id AND s.job_id = ok.job_id AND s.component = ok.component
          AND s.rise > 0) AS neighbours
FROM ok JOIN tot USING (node_id, job_id, component);

-- Every node with a passively seen job was judged for both components (a flag closes when clear).
INSERT INTO _evaluated SELECT DISTINCT node_id, NULL, 'noisy_neighbor_variance', c.component
FROM _pc_ticks CROSS JOIN (VALUES ('co_tenant'), ('hypervisor')) c(component);

INSERT INTO _conditions
SELECT node_id, NULL AS gpu, 'noisy_neighbor_variance' AS kind, component,
       CASE WHEN lost >= critical THEN 'critical' ELSE 'warning' END AS severity,
       lost AS value, 'fraction' AS unit, p_ref AS baseline,
       CASE WHEN open_ended THEN 'job_progress_before_episode' ELSE 'job_progress_around_episode' END AS baseline_source,
       json_object(
           'job_id', job_id, 'cause', key, 'resource', resource,
           'neighbour_unit', CASE WHEN resource IN ('io', 'net') THEN 'MB/s' ELSE 'percent_of_a_core' END,
           'progress_source', progress_source,
           'episode', episode, 'judged_against', CASE WHEN open_ended THEN 'before' ELSE 'before_and_after' END,
           'episode_start', t0, 'episode_last_tick', t1, 'progress_lost_s', round(lost * hit_s, 1),
           'progress_before', round(p_before, 1), 'progress_after', round(p_after, 1),
           'progress_contended', round(p_hit, 1), 'progress_lost_fraction', round(lost, 3),
           'contended_ticks', n, 'contended_s', round(hit_s, 1), 'reference_ticks_before', n_before,
           'reference_ticks_after', n_after, 'cpu_pressure_some_max_contended', psi_cpu_hit_max,
           'cpu_pressure_some_before', round(psi_cpu_before, 1),
           'cause_level_contended', round(v_hit, 1), 'cause_level_around', round(v_ref, 1),
           'neighbour_cpu_percent_contended', round(n_hit, 1), 'neighbour_cpu_percent_around', round(n_ref, 1),
           'neighbour_cpu_margin_percent', $neighbour_cpu, 'neighbours', neighbours,
           'cpu_steal_percent', json_object('avg', steal_avg, 'max', steal_max),
           'psi_some_avg10_percent_max', json_object('cpu', psi_cpu_max, 'io', psi_io_max, 'memory', psi_mem_max),
           'job_tcp_srtt_ms', json_object('before', round(rtt_before, 3), 'contended', round(rtt_hit, 3)),
           'job_tcp_busy_send_rate_mb_per_s', json_object('before', round(busy_before, 3), 'contended', round(busy_hit, 3)),
           'job_tcp_mb_per_s', json_object('before', round(job_mb_before, 3), 'contended', round(job_mb_hit, 3)),
           'network_slowed_by', CASE WHEN resource = 'net' THEN list_filter(
               [CASE WHEN rtt_hit >= rtt_before * $net_slowdown THEN 'rtt' END,
                CASE WHEN busy_hit * $net_slowdown <= busy_before THEN 'busy_send_rate' END], x -> x IS NOT NULL) END,
           'neighbour_margin', CASE WHEN resource <> 'steal' THEN margin END,
           'neighbour_net_slowdown', CASE WHEN resource = 'net' THEN $net_slowdown END,
           'job_tcp_bytes_rise_allowed', CASE WHEN resource = 'net' THEN 1.25 END
       )::VARCHAR AS evidence,
       'job ' || job_id || CASE WHEN episode = 'ongoing' THEN ' has lost ' ELSE ' lost ' END
       || printf('%.0f', lost * 100) || ' % of its progress ('
       || CASE progress_source WHEN 'gpu_util' THEN 'GPU utilization ' ELSE 'CPU share of its processes ' END
       || _fmt(p_ref) || CASE WHEN open_ended THEN ' % before it -> ' ELSE ' % around it -> ' END
       || _fmt(p_hit) || ' %) '
       || CASE episode WHEN 'ongoing' THEN 'for the last ' || printf('%.0f', hit_s) || ' s, and it goes on, while '
                       WHEN 'until_job_end' THEN 'in its last ' || printf('%.0f', hit_s) || ' s while '
                       ELSE 'during ' || printf('%.0f', hit_s) || ' s while ' END
       || CASE component
              -- one sentence for both resources, in a core's percent (CPU) or MB/s (disk I/O)
              WHEN 'co_tenant' THEN comm
                   || CASE WHEN resource = 'io' AND episode = 'ongoing' THEN ' reads and writes '
                           WHEN resource = 'io' THEN ' read and wrote '
                           WHEN resource = 'net' AND episode = 'ongoing' THEN ' sends and receives '
                           WHEN resource = 'net' THEN ' sent and received '
                           WHEN episode = 'ongoing' THEN ' uses ' ELSE ' used ' END
                   || printf('%.0f', v_hit) || CASE resource WHEN 'io' THEN ' MB/s on the disks ('
                                                             WHEN 'net' THEN ' MB/s off the node ('
                                                             ELSE ' % of a core (' END
                   || CASE WHEN open_ended THEN 'before' ELSE 'around' END || ' it ' || printf('%.0f', v_ref)
                   || CASE resource WHEN 'io' THEN ' MB/s; added disk I/O by command: '
                                    WHEN 'net' THEN ' MB/s; added network traffic by command: '
                                    ELSE ' %; added CPU by command: ' END
                   || coalesce(array_to_string(list_transform(neighbours,
                        x -> x.comm || ' ' || printf('%.0f', x.share_of_added * 100) || ' %'), ', '), 'unnamed')
                   || CASE resource
                        WHEN 'io' THEN '); limit the co-tenant''s I/O (cgroup io.max), give it a disk of its own or move it off this node.'
                        WHEN 'net' THEN '); the job''s connections off the node: RTT '
                             || coalesce(printf('%.3g', rtt_before) || ' -> ' || printf('%.3g', rtt_hit) || ' ms', 'unknown')
                             || ', sending ' || coalesce(printf('%.3g', busy_before) || ' -> ' || printf('%.3g', busy_hit)
                                                         || ' MB/s while they had data to send', 'unknown')
                             || '; limit the co-tenant''s bandwidth (tc), give it a NIC of its own or move it off this node.'
                        ELSE '); isolate the co-tenant (cgroup CPU limits, pinning) or move it off this node.' END
              ELSE 'the hypervisor stole up to ' || printf('%.0f', steal_max)
                   || ' % of the CPU; ask for dedicated vCPUs or move the job.' END
       AS sentence
FROM _pc;
