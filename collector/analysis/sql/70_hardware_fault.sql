-- hardware_fault: the hardware faults that cost fleets the most GPU-hours, one component per fault class
-- (xid, ecc, row_remap, retired_pages, nvlink, pcie_link, clocks, ib_port, eth_link). The rules, thresholds,
-- severities, actions and their cited sources are common/hardware_faults.toml, which the node's
-- `gpuagent health` applies too; the analyzer loads them as _hw_rules (counter/state rules) and _hw_xids (the
-- XID catalog and the fault events). Rule kinds:
--   any_increment / rate / share: the rise of a counter over the window, summed over consecutive samples;
--       a sample lower than the one before it is a reset (driver reload, reboot) and adds nothing, so a
--       reset never fires. rate = rise per hour of the covered time (at least $hw_min_cover_s);
--       share = seconds of a duration counter per second of covered time;
--   state: the latest value satisfies op/value (a pending remap, a port not ACTIVE, an NVLink down), and
--       also_metric's latest (same GPU and labels) also_op/also_value where the rule has one;
--   total: as state, on the sum of the latest values over every label of the metric (all retired pages);
--   below_max: the latest value under its maximum's latest value, while the load metric is >= load_min.
-- A flag clears when its condition does: a pending remap gone after the reset, a counter that did not rise
-- for a window, a port back to ACTIVE. Rules marked reboot_explains ignore what happens within $hw_grace_s
-- of an agent_start event (the node restarted: a planned reboot flaps its links once); a state rule only
-- within $hw_settle_s of it (a link still down once links have trained is a fault).
-- XIDs: NVML and kmsg report the same XID; reports of one (node, gpu, xid) within $hw_dedup_s of the
-- previous one count once. Application XIDs (the catalog's RESTART_APP rows) are the job's unless the same XID
-- hit the same GPU >= $hw_app_count times (bursts more than $hw_app_burst_s apart) within $hw_app_window_s.
-- An XID or event whose decoded attribute selects a variant (XID 154's recovery action, an NVLink5 XID's
-- decoded severity, an SXid's Fatal tag) takes the variant's severity and action; severity 'ignore' (the
-- catalog's IGNORE bucket) raises nothing.
-- Corroboration: a network_degraded/link condition whose end shows IB port errors or link flaps says which
-- end; a fault on a GPU a job uses says what it cost that job (step time, or passive progress, before/after).

-- sel: the value of the one label the metric's rules narrow by (counter, cause, reason), '' when none.
CREATE OR REPLACE TEMP TABLE _hw_samples AS
WITH m AS (
    SELECT metric, max(label_key) AS label_key FROM (
        SELECT metric, label_key FROM _hw_rules UNION ALL SELECT max_metric, '' FROM _hw_rules WHERE max_metric <> ''
        UNION ALL SELECT also_metric, '' FROM _hw_rules WHERE also_metric <> '')
    GROUP BY metric
)
SELECT s.node_id, coalesce(s.gpu, -1) AS gpu, s.metric, s.labels, s.ts, s.value,
       CASE WHEN m.label_key = '' THEN ''
            ELSE coalesce(split_part(list_filter(string_split(s.labels, ','),
                                                 x -> starts_with(x, m.label_key || '='))[1], '=', 2), '') END AS sel
FROM samples s
JOIN m ON m.metric = s.metric
WHERE s.ts > $window_start AND s.ts <= $now AND s.value IS NOT NULL AND isfinite(s.value);

-- An agent_start is a reboot when the node booted within $hw_grace_s before it (attr boot_ns, wall-clock ns);
-- an agent restarted on a node up for longer (an upgrade, a crash) explains no link flap. Agents older than
-- the boot_ns attr: every agent_start counts as a reboot.
CREATE OR REPLACE TEMP TABLE _hw_boots AS
SELECT node_id, ts FROM events
WHERE kind = $hw_boot_kind AND ts > $window_start - to_microseconds(CAST($hw_grace_s * 1e6 AS BIGINT))
  AND ts <= $now
  AND (json_extract_string(attrs, '$.boot_ns') IS NULL
       OR epoch_ns(ts) - TRY_CAST(json_extract_string(attrs, '$.boot_ns') AS BIGINT) <= $hw_grace_s * 1e9);

-- Each rule on each series it matches (a rule narrows by at most one label: label_key = label_value).
CREATE OR REPLACE TEMP TABLE _hw_series AS
WITH d AS (
    SELECT r.name, r.kind, r.reboot_explains, s.node_id, s.gpu, s.metric, s.labels, s.ts, s.value,
           s.value - lag(s.value) OVER (PARTITION BY r.name, s.node_id, s.gpu, s.labels ORDER BY s.ts) AS delta
    FROM _hw_samples s
    JOIN _hw_rules r ON r.metric = s.metric AND (r.label_value = '' OR r.label_value = s.sel)
), boots AS (
    SELECT node_id, list(ts) AS boot_ts FROM _hw_boots GROUP BY node_id
), m AS (
    SELECT d.*, d.reboot_explains AND b.boot_ts IS NOT NULL
                AND len(list_filter(b.boot_ts, x -> abs(epoch(d.ts - x))
                                    <= CASE WHEN d.kind = 'state' THEN $hw_settle_s ELSE $hw_grace_s END)) > 0
                AS near_boot
    FROM d LEFT JOIN boots b ON b.node_id = d.node_id
)
SELECT name, node_id, gpu, metric, labels,
       coalesce(sum(greatest(delta, 0)) FILTER (WHERE NOT near_boot), 0) AS increase,
       count(*) FILTER (WHERE delta < 0) AS resets,
       min(ts) FILTER (WHERE delta > 0 AND NOT near_boot) AS first_rise,
       arg_max(value, ts) AS latest, max(ts) AS last_ts, arg_max(near_boot, ts) AS latest_near_boot,
       greatest(epoch(max(ts) - min(ts)), $hw_min_cover_s) AS cover_s, count(*) AS samples
FROM m
GROUP BY ALL;

-- The latest value of each max metric and also metric, to pair with below_max and state rules.
CREATE OR REPLACE TEMP TABLE _hw_latest AS
SELECT node_id, gpu, metric, labels, arg_max(value, ts) AS value
FROM _hw_samples
WHERE metric IN (SELECT max_metric FROM _hw_rules UNION ALL SELECT also_metric FROM _hw_rules)
GROUP BY ALL;

-- The load (gpu_util_percent, its last 10 minutes) of only the series under their maximum: a fleet's
-- utilization samples are not read unless a link is downtrained. The agent summarises the load
-- (docs/RESOLUTION.md), so its latest value is its newest minute's mean in samples_1m, dated at the minute's
-- start; a raw sample of the load (an agent that sends every sample raw) in that minute or later wins.
CREATE OR REPLACE TEMP TABLE _hw_load AS
WITH cand AS (
    SELECT DISTINCT s.node_id, s.gpu, r.load_metric
    FROM _hw_series s
    JOIN _hw_rules r ON r.name = s.name
    JOIN _hw_latest mx ON mx.node_id = s.node_id AND mx.gpu = s.gpu AND mx.metric = r.max_metric
                      AND mx.labels = s.labels
    WHERE r.kind = 'below_max' AND r.load_metric <> '' AND s.latest < mx.value
), x AS (
    SELECT node_id, gpu, metric, ts, value FROM samples
    WHERE labels = '' AND ts > $now - INTERVAL 10 MINUTE AND ts <= $now AND isfinite(value)
      AND metric IN (SELECT load_metric FROM cand)
    UNION ALL
    SELECT node_id, gpu, metric, minute, avg FROM samples_1m
    WHERE labels = '' AND minute > $now - INTERVAL 11 MINUTE AND minute <= $now AND isfinite(avg)
      AND metric IN (SELECT load_metric FROM cand)
)
SELECT c.node_id, c.gpu, c.load_metric AS metric, arg_max(x.value, x.ts) AS value
FROM cand c
JOIN x ON x.node_id = c.node_id AND x.gpu = c.gpu AND x.metric = c.load_metric
GROUP BY ALL;

-- One row per fault instance (a rule on a series, or an XID / fault event on a GPU).
CREATE OR REPLACE TEMP TABLE _hw_faults AS
WITH judged AS (
    SELECT r.*, s.node_id, s.gpu, s.labels, s.increase, s.resets, s.first_rise, s.latest, s.last_ts,
           s.latest_near_boot, s.cover_s, s.samples,
           mx.value AS max_value, ld.value AS load_value, al.value AS also_latest,
           s.increase / s.cover_s * 3600.0 AS per_hour, s.increase / s.cover_s AS share,
           sum(s.latest) OVER (PARTITION BY s.name, s.node_id, s.gpu) AS total_latest,
           row_number() OVER (PARTITION BY s.name, s.node_id, s.gpu ORDER BY s.labels) AS label_rank
    FROM _hw_series s
    JOIN _hw_rules r ON r.name = s.name
    LEFT JOIN _hw_latest mx ON mx.node_id = s.node_id AND mx.gpu = s.gpu AND mx.metric = r.max_metric
                           AND mx.labels = s.labels
    LEFT JOIN _hw_latest al ON al.node_id = s.node_id AND al.gpu = s.gpu AND al.metric = r.also_metric
                           AND al.labels = s.labels
    LEFT JOIN _hw_load ld ON ld.node_id = s.node_id AND ld.gpu = s.gpu AND ld.metric = r.load_metric
), totalled AS (
    -- a total rule judges the sum over its metric's labels once per GPU: its latest is that sum
    SELECT * REPLACE (CASE WHEN kind = 'total' THEN total_latest ELSE latest END AS latest,
                      CASE WHEN kind = 'total' THEN '' ELSE labels END AS labels)
    FROM judged WHERE kind <> 'total' OR label_rank = 1
), fired AS (
    SELECT *,
           CASE kind
             WHEN 'any_increment' THEN increase >= 1
             WHEN 'rate' THEN increase > 0 AND per_hour >= threshold_per_hour
             WHEN 'share' THEN share >= threshold_share
             WHEN 'state' THEN NOT (reboot_explains AND latest_near_boot) AND _holds(op, latest, value)
                               AND (also_metric = '' OR coalesce(_holds(also_op, also_latest, also_value), false))
             WHEN 'total' THEN _holds(op, latest, value)
             WHEN 'below_max' THEN max_value > 0 AND latest > 0 AND latest < max_value
                                   AND (load_metric = '' OR load_value >= load_min)
           END AS fires
    FROM totalled
), named AS (
    SELECT *,
           CASE WHEN metric LIKE 'ib\_%' ESCAPE '\'
                  THEN regexp_extract(labels, '(^|,)device=([^,]*)', 2) || ' port '
                       || regexp_extract(labels, '(^|,)port=([^,]*)', 2)
                WHEN metric LIKE 'net\_%' ESCAPE '\' THEN regexp_extract(labels, '(^|,)device=([^,]*)', 2)
                WHEN metric LIKE 'gpu\_nvlink%' ESCAPE '\'
                  THEN 'GPU ' || gpu::VARCHAR || ' NVLink ' || regexp_extract(labels, '(^|,)link=([^,]*)', 2)
                ELSE 'GPU ' || gpu::VARCHAR END AS subject
    FROM fired WHERE fires
)
SELECT node_id, CASE WHEN metric LIKE 'gpu\_%' ESCAPE '\' AND gpu >= 0 THEN gpu END AS gpu, component,
       severity, name AS rule, subject,
       sentence || CASE kind
           WHEN 'any_increment' THEN ' (+' || _num(increase) || ' in ' || _fmt(cover_s / 60) || ' min)'
           WHEN 'rate' THEN ' (' || _fmt(per_hour) || '/h, threshold ' || _fmt(threshold_per_hour) || '/h)'
           WHEN 'share' THEN ' (' || printf('%.0f', 100 * share) || ' % of ' || _fmt(cover_s / 60) || ' min)'
           WHEN 'state' THEN ' (value ' || _num(latest)
                             || CASE WHEN also_metric <> '' THEN ', ' || _num(also_latest) ELSE '' END || ')'
           WHEN 'total' THEN ' (value ' || _num(latest) || ')'
           ELSE ' (' || _num(latest) || ' of ' || _num(max_value) || ')' END AS what,
       action, source,
       CASE kind WHEN 'rate' THEN per_hour WHEN 'share' THEN share WHEN 'any_increment' THEN increase
                 ELSE latest END AS value,
       CASE kind WHEN 'rate' THEN 'per_hour' WHEN 'share' THEN 'fraction' WHEN 'any_increment' THEN 'count'
                 ELSE 'value' END AS unit,
       CASE kind WHEN 'rate' THEN threshold_per_hour WHEN 'share' THEN threshold_share
                 WHEN 'below_max' THEN max_value ELSE value END AS baseline,
       coalesce(first_rise, last_ts) AS t0,
       json_object('rule', name, 'kind', kind, 'metric', metric, 'labels', labels, 'latest', latest,
                   'increase', increase, 'resets_ignored', resets, 'covered_s', round(cover_s, 1),
                   'samples', samples, 'per_hour', round(per_hour, 3), 'share', round(share, 4),
                   'max', max_value, 'load', load_value, 'also', also_latest, 'source', source) AS evidence
FROM named;

-- XIDs and the other fault events in the window, deduplicated across NVML and kmsg.
CREATE OR REPLACE TEMP TABLE _hw_events AS
WITH e AS (
    SELECT node_id, CASE WHEN gpu >= 0 THEN gpu END AS gpu, kind, ts, message,
           CASE WHEN kind = 'xid' THEN coalesce(try_cast(value AS INTEGER),
                                                try_cast(json_extract_string(attrs, '$.xid') AS INTEGER)) END AS xid,
           coalesce(json_extract_string(attrs, '$.source'), 'nvml') AS src,
           json_extract_string(attrs, '$.pci_bus_id') AS pci_bus_id,
           coalesce(json_extract_string(attrs, '$.device'), '') AS device,
           json_extract_string(attrs, '$.job_id') AS attr_job, json_extract_string(attrs, '$.pid') AS attr_pid,
           attrs
    FROM events
    WHERE kind IN (SELECT kind FROM _hw_xids) AND ts > least($lookback_start, $hw_app_start) AND ts <= $now
), v AS (
    -- the variant the event's decoded attributes select ('=' for the plain row)
    SELECT e.* EXCLUDE (attrs),
           coalesce((SELECT min(x.attr_key || '=' || x.attr_value) FROM _hw_xids x
                     WHERE x.attr_key <> '' AND x.kind = e.kind AND (e.kind <> 'xid' OR x.xid = e.xid)
                       AND json_extract_string(e.attrs, '$.' || x.attr_key) = x.attr_value), '=') AS variant
    FROM e
), j AS (
    -- the job on that GPU at that time: an attribute, else the discovered job sampled on the GPU nearest it
    SELECT e.*, coalesce(e.attr_job, (
               SELECT arg_min(js.job_id, abs(epoch(js.ts - e.ts))) FROM job_samples js
               WHERE js.node_id = e.node_id AND js.gpu = e.gpu
                 AND js.ts BETWEEN e.ts - INTERVAL 2 MINUTE AND e.ts + INTERVAL 2 MINUTE),
               'pid ' || e.attr_pid) AS job_id
    FROM v e
)
SELECT *, coalesce(epoch(ts - lag(ts) OVER (PARTITION BY node_id, gpu, kind, xid, variant, place ORDER BY ts)),
                   1e18) > $hw_dedup_s AS counted,
       coalesce(epoch(ts - lag(ts) OVER (PARTITION BY node_id, gpu, kind, xid, variant, place ORDER BY ts)),
                1e18) > $hw_app_burst_s AND ts > $hw_app_start AS burst
FROM (SELECT *, CASE WHEN gpu IS NULL THEN coalesce(nullif(device, ''), pci_bus_id, '') ELSE '' END AS place FROM j)
WHERE kind <> 'xid' OR xid IS NOT NULL;

INSERT INTO _hw_faults
WITH g AS (
    SELECT e.node_id, e.gpu, e.kind, e.xid, e.variant, e.place, any_value(e.pci_bus_id) AS pci_bus_id,
           any_value(e.device) AS device,
           count(*) FILTER (WHERE e.counted AND e.ts > $window_start) AS reports,
           count(*) FILTER (WHERE e.ts > $window_start) AS raw_reports,
           count(*) FILTER (WHERE e.burst) AS bursts,
           list(DISTINCT e.src) FILTER (WHERE e.ts > $window_start) AS sources,
           list(DISTINCT e.job_id) FILTER (WHERE e.job_id IS NOT NULL) AS jobs,
           min(e.ts) FILTER (WHERE e.ts > $window_start) AS t0, max(e.ts) AS last_ts,
           arg_max(e.message, e.ts) AS message
    FROM _hw_events e
    GROUP BY ALL
    HAVING count(*) FILTER (WHERE e.ts > $window_start) > 0
)
SELECT g.node_id, g.gpu, x.component, x.severity,
       CASE WHEN g.kind = 'xid' THEN 'xid_' || g.xid::VARCHAR ELSE g.kind END,
       coalesce('GPU ' || g.gpu::VARCHAR, nullif(g.device, ''), g.pci_bus_id, 'host'),
       CASE WHEN g.kind = 'xid' THEN 'XID ' || g.xid::VARCHAR || ' (' || coalesce(x.description, 'not in the XID catalog table') || ')'
            WHEN x.attr_key <> '' THEN coalesce(b.description, g.kind) || ' (' || x.description || ')'
            ELSE coalesce(x.description, g.kind) END
       || CASE WHEN coalesce(x.application, false)
               THEN ' ' || g.bursts::VARCHAR || ' times on this GPU within ' || printf('%.0f', $hw_app_window_s / 3600)
                    || ' h, so it may be the GPU''s, not the job''s'
               WHEN g.reports > 1 THEN ' x' || g.reports::VARCHAR ELSE '' END
       || CASE WHEN g.kind = 'xid' AND x.kind IS NULL THEN ' (not in our copy of NVIDIA''s XID catalog)' ELSE '' END,
       CASE WHEN coalesce(x.application, false) THEN x.repeat_action ELSE coalesce(x.action, $hw_xid_default_action) END,
       coalesce(x.source, $hw_xid_source),
       g.reports, 'count', NULL, g.t0,
       json_object('kind', g.kind, 'xid', g.xid, 'reports', g.reports, 'raw_reports', g.raw_reports,
                   'sources', g.sources, 'jobs', g.jobs, 'bursts', g.bursts, 'pci_bus_id', g.pci_bus_id,
                   'device', nullif(g.device, ''), 'last_message', g.message,
                   'application', coalesce(x.application, false), 'listed', g.kind <> 'xid' OR x.kind IS NOT NULL,
                   'variant', CASE WHEN g.variant <> '=' THEN g.variant END,
                   'resolution_bucket_immediate_action', nullif(x.immediate, ''),
                   'resolution_bucket_investigatory_action', nullif(x.investigatory, ''),
                   'source', coalesce(x.source, $hw_xid_source))
FROM g
LEFT JOIN _hw_xids x ON x.kind = g.kind AND (g.kind <> 'xid' OR x.xid = g.xid)
                    AND x.attr_key || '=' || x.attr_value = g.variant
LEFT JOIN _hw_xids b ON b.kind = g.kind AND g.kind <> 'xid' AND b.attr_key = ''
-- an unlisted XID takes the catalog's default bucket; an application XID is the job's unless it repeats;
-- the catalog's IGNORE bucket raises nothing
WHERE coalesce(x.severity, '') <> 'ignore'
  AND (NOT coalesce(x.application, false) OR g.bursts >= $hw_app_count);

-- Fill in the default severity of unlisted XIDs.
UPDATE _hw_faults SET severity = $hw_xid_default_severity, component = 'xid' WHERE severity IS NULL;

-- What a fault cost the job on that GPU: its step time (tracker) or its passive progress, before and after.
CREATE OR REPLACE TEMP TABLE _hw_cost AS
WITH jobs AS (
    SELECT f.node_id, f.gpu, f.rule, f.t0, arg_max(js.job_id, js.ts) AS job_id
    FROM _hw_faults f
    JOIN job_samples js ON js.node_id = f.node_id AND js.gpu = f.gpu AND js.ts > $window_start AND js.ts <= $now
    WHERE f.gpu IS NOT NULL
    GROUP BY ALL
), steps AS (
    SELECT j.node_id, j.gpu, j.rule, j.job_id,
           median(st.step_time_p50_s) FILTER (WHERE st.ts < j.t0) AS step_before,
           median(st.step_time_p50_s) FILTER (WHERE st.ts >= j.t0) AS step_after
    FROM jobs j JOIN job_steps st ON st.node_id = j.node_id AND st.job_id = j.job_id
                                  AND st.ts > $window_start AND st.ts <= $now
    GROUP BY ALL
), progress AS (
    SELECT j.node_id, j.gpu, j.rule, j.job_id,
           avg(s.value) FILTER (WHERE s.ts < j.t0) AS progress_before,
           avg(s.value) FILTER (WHERE s.ts >= j.t0) AS progress_after
    FROM jobs j JOIN samples s ON s.node_id = j.node_id AND s.metric = 'job_progress_percent'
                               AND regexp_extract(s.labels, '(^|,)job_id=([^,]*)', 2) = j.job_id
                               AND s.ts > $window_start AND s.ts <= $now
    GROUP BY ALL
)
SELECT j.node_id, j.gpu, j.rule, j.job_id, st.step_before, st.step_after, p.progress_before, p.progress_after,
       CASE WHEN st.step_before > 0 AND st.step_after IS NOT NULL
              THEN '; it cost job ' || j.job_id || ': step time ' || _fmt(st.step_before) || ' s before, '
                   || _fmt(st.step_after) || ' s after (' || printf('%+.0f', 100 * (st.step_after / st.step_before - 1))
                   || ' %)'
            WHEN p.progress_before > 0 AND p.progress_after IS NOT NULL
              THEN '; it cost job ' || j.job_id || ': progress ' || printf('%.0f', p.progress_before) || ' % before, '
                   || printf('%.0f', p.progress_after) || ' % after'
            WHEN st.step_before IS NULL AND st.step_after IS NOT NULL
              THEN '; job ' || j.job_id || ' uses this GPU (no step times before the fault)'
            ELSE '; job ' || j.job_id || ' uses this GPU' END AS cost
FROM jobs j
LEFT JOIN steps st ON st.node_id = j.node_id AND st.gpu = j.gpu AND st.rule = j.rule
LEFT JOIN progress p ON p.node_id = j.node_id AND p.gpu = j.gpu AND p.rule = j.rule;

-- One condition per (node, gpu, component): its worst fault speaks, the others are counted and listed.
CREATE OR REPLACE TEMP TABLE _hw AS
WITH ranked AS (
    SELECT f.*, c.job_id, c.step_before, c.step_after, c.progress_before, c.progress_after, coalesce(c.cost, '') AS cost,
           row_number() OVER (PARTITION BY f.node_id, f.gpu, f.component
                              ORDER BY CASE f.severity WHEN 'critical' THEN 0 ELSE 1 END, f.t0, f.rule) AS rn,
           count(*) OVER (PARTITION BY f.node_id, f.gpu, f.component) AS n
    FROM _hw_faults f
    LEFT JOIN _hw_cost c ON c.node_id = f.node_id AND c.gpu IS NOT DISTINCT FROM f.gpu AND c.rule = f.rule
)
SELECT r.node_id, r.gpu, r.component, any_value(r.severity) FILTER (WHERE r.rn = 1) AS severity,
       any_value(r.value) FILTER (WHERE r.rn = 1) AS value, any_value(r.unit) FILTER (WHERE r.rn = 1) AS unit,
       any_value(r.baseline) FILTER (WHERE r.rn = 1) AS baseline,
       any_value(r.source) FILTER (WHERE r.rn = 1) AS source,
       any_value(coalesce(n.hostname, r.node_id) || ' ' || r.subject || ': ' || r.what || ': ' || r.action
                 || r.cost || '.') FILTER (WHERE r.rn = 1)
       || CASE WHEN max(r.n) > 1 THEN ' Also: ' || string_agg(r.subject || ': ' || r.what, '; ' ORDER BY r.rn)
                                        FILTER (WHERE r.rn > 1) || '.' ELSE '' END AS sentence,
       json_object('faults', list(json_object('rule', r.rule, 'severity', r.severity, 'subject', r.subject,
                                              'what', r.what, 'action', r.action, 'source', r.source,
                                              'first_seen', r.t0, 'detail', r.evidence::JSON) ORDER BY r.rn),
                   'action', any_value(r.action) FILTER (WHERE r.rn = 1),
                   'job', any_value(r.job_id) FILTER (WHERE r.rn = 1),
                   'step_time_before_s', any_value(r.step_before) FILTER (WHERE r.rn = 1),
                   'step_time_after_s', any_value(r.step_after) FILTER (WHERE r.rn = 1),
                   'progress_before_percent', any_value(r.progress_before) FILTER (WHERE r.rn = 1),
                   'progress_after_percent', any_value(r.progress_after) FILTER (WHERE r.rn = 1))::VARCHAR AS evidence
FROM ranked r
LEFT JOIN nodes n ON n.node_id = r.node_id
GROUP BY r.node_id, r.gpu, r.component;

-- Every (node, gpu, component) the window had data for was looked at: a flag whose fault is gone closes.
-- A GPU with hardware samples is evaluated for XIDs too.
INSERT INTO _evaluated
SELECT DISTINCT node_id, g, 'hardware_fault', component FROM (
    SELECT s.node_id, CASE WHEN s.metric LIKE 'gpu\_%' ESCAPE '\' AND s.gpu >= 0 THEN s.gpu END AS g, c.component
    FROM (SELECT DISTINCT node_id, gpu, metric FROM _hw_samples) s
    JOIN (SELECT DISTINCT metric, component FROM _hw_rules) c ON c.metric = s.metric
    UNION ALL
    SELECT DISTINCT node_id, gpu, 'xid' FROM _hw_samples WHERE metric LIKE 'gpu\_%' ESCAPE '\' AND gpu >= 0);

INSERT INTO _conditions
SELECT node_id, gpu, 'hardware_fault', component, severity, value, unit, baseline, source, evidence, sentence
FROM _hw;

-- Corroboration: a slow fabric link whose end shows IB port errors or link flaps in the window says which end.
CREATE OR REPLACE TEMP TABLE _hw_port_noise AS
SELECT s.node_id,
       string_agg(DISTINCT regexp_extract(s.labels, '(^|,)device=([^,]*)', 2)
                  -- an Ethernet device has no port label: "eth0 carrier changes", not "eth0 port  carrier ..."
                  || coalesce(' port ' || nullif(regexp_extract(s.labels, '(^|,)port=([^,]*)', 2), ''), '')
                  || ' ' || r.sentence
                  || ' +' || _fmt(s.increase), '; ') AS what,
       sum(s.increase) AS increase
FROM _hw_series s JOIN _hw_rules r ON r.name = s.name
WHERE s.increase > 0 AND r.name IN ('ib_symbol_error', 'ib_link_downed', 'ib_link_error_recovery',
                                    'ib_local_link_integrity', 'eth_carrier_changes')
GROUP BY s.node_id;

CREATE OR REPLACE TEMP TABLE _hw_link_corr AS
WITH l AS (
    SELECT node_id, json_extract_string(evidence, '$.pair[0]') AS a, json_extract_string(evidence, '$.pair[1]') AS b
    FROM _conditions WHERE kind = 'network_degraded' AND component = 'link'
)
SELECT l.node_id, l.a, l.b, pa.what AS what_a, pb.what AS what_b
FROM l
LEFT JOIN _hw_port_noise pa ON pa.node_id = l.a
LEFT JOIN _hw_port_noise pb ON pb.node_id = l.b
WHERE pa.node_id IS NOT NULL OR pb.node_id IS NOT NULL;

UPDATE _conditions AS c
SET evidence = json_merge_patch(c.evidence, json_object('endpoint_port_errors',
                   json_object(k.a, k.what_a, k.b, k.what_b)))::VARCHAR,
    sentence = c.sentence || ' Port errors at '
               || CASE WHEN k.what_a IS NOT NULL AND k.what_b IS NOT NULL
                         THEN 'both ends: ' || k.a || ' (' || k.what_a || ') and ' || k.b || ' (' || k.what_b || ')'
                       WHEN k.what_a IS NOT NULL THEN 'the ' || k.a || ' end (' || k.what_a || ')'
                       ELSE 'the ' || k.b || ' end (' || k.what_b || ')' END
               || ': start with that end''s cable and transceiver.'
FROM _hw_link_corr k
WHERE c.kind = 'network_degraded' AND c.component = 'link' AND c.node_id = k.node_id;
