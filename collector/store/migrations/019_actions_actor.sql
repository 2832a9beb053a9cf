-- gpuagent collector schema, version 19: who acted, and under which rule (issue 24). ``actor`` is the collector
-- that decided (its host and the OS user its scontrol runs as, the user Slurm records for the update);
-- ``rule`` the [actions] policy entry that mapped the finding ("hardware_fault.critical = drain", or "default
-- alert" when no entry names its kind). NULL on rows written before version 19.
ALTER TABLE actions ADD COLUMN actor VARCHAR;
ALTER TABLE actions ADD COLUMN rule VARCHAR;
