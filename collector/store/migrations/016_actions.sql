-- gpuagent collector schema, version 16: actions, what the collector did (or in dry-run would have done) about a
-- finding: drain a Slurm node, resume it, or only alert (collector/actions/, docs/ACTIONS.md). One row per
-- decision or command; written by the actions thread after an analysis pass, never inside its transaction.
CREATE SEQUENCE action_id_seq;

CREATE TABLE actions (
    action_id     BIGINT PRIMARY KEY DEFAULT nextval('action_id_seq'),
    ts            TIMESTAMP NOT NULL,   -- when the action was decided (UTC)
    pass_ts       TIMESTAMP,            -- the analysis pass (analysis_runs.now) whose findings it followed
    node_id       VARCHAR,              -- the collector's node; NULL for a pool finding's alert
    slurm_node    VARCHAR,              -- the Slurm NodeName: the node's hostname, short form
    pool          VARCHAR,
    action        VARCHAR NOT NULL,     -- drain, resume, alert
    mode          VARCHAR NOT NULL,     -- dry-run, enforce
    finding_id    BIGINT,
    kind          VARCHAR,
    severity      VARCHAR,
    reason        VARCHAR,              -- the Reason given to Slurm (drain), or the finding's sentence (alert)
    command       VARCHAR,              -- the scontrol command run, or that would run in dry-run
    outcome       VARCHAR NOT NULL,     -- ok, dry-run, failed, recorded, skipped-breaker, skipped-manual, ...
    detail        VARCHAR,              -- why, in one sentence (the bound that was hit, scontrol's error, ...)
    slurm_state   VARCHAR,              -- the node's State= after the command (drain) or before it (resume)
    reason_time   VARCHAR,              -- the time Slurm stamped on the Reason gpuagent set (drain)
    duration_s    DOUBLE                -- seconds the scontrol calls of this action took
);
