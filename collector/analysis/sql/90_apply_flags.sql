-- Turn this pass's conditions into flag rows: an ongoing condition updates its open flag, a new one opens a
-- flag, and an open flag closes when its (node, gpu, kind, component) was evaluated and is clear, or when
-- nothing about it was seen for a whole window (the longer of the sample and probe windows) and the step
-- of its kind ran this pass (_skipped_kinds: the kinds whose step failed; their flags stay as they were).
-- Each statement returns one row per flag it changed, in a column named for the change: the analyzer
-- reports the counts by those names.

UPDATE flags AS f
SET last_seen = $now, severity = c.severity, value = c.value, unit = c.unit, baseline = c.baseline,
    baseline_source = c.baseline_source, evidence = c.evidence, sentence = c.sentence
FROM _conditions c
WHERE f.state = 'open' AND f.node_id = c.node_id AND f.gpu IS NOT DISTINCT FROM c.gpu
  AND f.kind = c.kind AND f.component = c.component
RETURNING 1 AS updated;

INSERT INTO flags (node_id, gpu, kind, component, severity, state, first_seen, last_seen,
                   value, baseline, baseline_source, unit, evidence, sentence)
SELECT c.node_id, c.gpu, c.kind, c.component, c.severity, 'open', $now, $now,
       c.value, c.baseline, c.baseline_source, c.unit, c.evidence, c.sentence
FROM _conditions c
WHERE NOT EXISTS (SELECT 1 FROM flags f
                  WHERE f.state = 'open' AND f.node_id = c.node_id AND f.gpu IS NOT DISTINCT FROM c.gpu
                    AND f.kind = c.kind AND f.component = c.component)
RETURNING 1 AS opened;

UPDATE flags AS f
SET state = 'closed', closed_at = $now
WHERE f.state = 'open'
  AND NOT EXISTS (SELECT 1 FROM _conditions c
                  WHERE f.node_id = c.node_id AND f.gpu IS NOT DISTINCT FROM c.gpu
                    AND f.kind = c.kind AND f.component = c.component)
  AND (EXISTS (SELECT 1 FROM _evaluated e
               WHERE f.node_id = e.node_id AND f.gpu IS NOT DISTINCT FROM e.gpu
                 AND f.kind = e.kind AND f.component = e.component)
       OR (f.last_seen <= least($window_start, $probe_window_start)
           AND f.kind NOT IN (SELECT kind FROM _skipped_kinds)))
RETURNING 1 AS closed;
