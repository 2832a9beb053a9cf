-- gpuagent collector schema, version 5: when a job really started.
-- started_at: the earliest start time of the job's processes on the node (the agent reads it from
-- /proc/<pid>/stat), where first_seen is only the first sample, up to one /proc scan interval later.
-- NULL for jobs ended before this version and for jobs whose agent does not send it.
-- From this version ended_at is the last time the agent saw one of the job's processes alive (the job
-- ended before the agent's next tick), and duration_s = ended_at - started_at.
ALTER TABLE jobs ADD COLUMN started_at TIMESTAMP;
