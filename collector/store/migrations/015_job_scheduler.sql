-- gpuagent collector schema, version 15: a job as its scheduler names it (issue 24).
-- The agent's Slurm attribution (agent/schedulers/slurm.py) puts the job's user, partition and account in its job
-- samples' attrs (slurm_user, slurm_partition, slurm_account); they land here so `compare` and the report
-- can group jobs by partition and account. NULL for jobs no scheduler named.
ALTER TABLE jobs ADD COLUMN user_name VARCHAR;
ALTER TABLE jobs ADD COLUMN partition_name VARCHAR;
ALTER TABLE jobs ADD COLUMN account VARCHAR;
