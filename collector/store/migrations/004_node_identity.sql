-- gpuagent collector schema, version 4: a node is (machine_id, hostname), no longer machine_id alone.
-- VM images cloned without a fresh /etc/machine-id give several hosts one machine id; they are stored as
-- separate nodes, and each such node names the hosts it was seen streaming beside with the same id
-- (see collector/identity.py). Existing nodes keep their node_id.
ALTER TABLE nodes ADD COLUMN machine_id_shared_with VARCHAR;  -- "host-b,host-c" while unfixed; NULL when none
