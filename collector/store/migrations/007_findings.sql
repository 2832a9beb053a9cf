-- gpuagent collector schema, version 7: findings, one per cause, over the flags that show it.
-- The analyzer's findings step (collector/analysis/sql/95_findings.sql) groups open flags by node and kind,
-- or by pool, kind and component family when most of a pool shares the flag. A finding is open while one
-- of its flags is open; flags.finding_id names the finding a flag was last grouped into.
CREATE SEQUENCE finding_id_seq;

CREATE TABLE findings (
    finding_id    BIGINT PRIMARY KEY DEFAULT nextval('finding_id_seq'),
    finding_key   VARCHAR NOT NULL,   -- node|<kind>|<node_id> or pool|<kind>|<pool>|<family>: same cause, same key
    scope         VARCHAR NOT NULL,   -- node, pool
    kind          VARCHAR NOT NULL,   -- a flag kind
    node_id       VARCHAR,            -- scope node
    pool          VARCHAR,            -- the node's pool, or the pool of a pool finding
    family        VARCHAR,            -- scope pool: the component family (pcie, storage, ...) it is about
    severity      VARCHAR NOT NULL,   -- the worst severity of its open flags
    state         VARCHAR NOT NULL,   -- open, closed
    first_seen    TIMESTAMP NOT NULL,
    last_seen     TIMESTAMP NOT NULL,
    closed_at     TIMESTAMP,
    flags         INTEGER NOT NULL,   -- open flags grouped into it at last_seen
    nodes         INTEGER NOT NULL,   -- nodes among them
    pool_nodes    INTEGER,            -- scope pool: nodes of the pool evaluated for this kind and family
    components    VARCHAR,            -- comma-separated components of its flags
    gpus          VARCHAR,            -- comma-separated GPU indexes of its per-GPU flags
    sentence      VARCHAR NOT NULL    -- one sentence a person can act on
);

ALTER TABLE flags ADD COLUMN finding_id BIGINT;

CREATE VIEW v_open_findings AS
SELECT finding_id, scope, kind, node_id, pool, family, severity, first_seen, last_seen, flags, nodes, pool_nodes,
       components, gpus, sentence
FROM findings WHERE state = 'open'
ORDER BY CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, nodes DESC, flags DESC,
         kind, pool, node_id;

CREATE OR REPLACE VIEW v_open_flags AS
SELECT flag_id, node_id, gpu, kind, component, severity, first_seen, last_seen, value, unit,
       baseline, baseline_source, sentence, evidence, finding_id
FROM flags WHERE state = 'open'
ORDER BY CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, kind, node_id, gpu, component;
