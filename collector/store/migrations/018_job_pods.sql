-- gpuagent collector schema, version 18: a job as Kubernetes names it (issue 25).
-- The agent's pod attribution (agent/schedulers/kubelet.py: the kubelet's pod-resources API) puts the pod, namespace and
-- container that hold the job's GPU in its job samples' attrs (pod, namespace, container); they land here so
-- a job can be found by its pod. NULL for jobs no kubelet named.
ALTER TABLE jobs ADD COLUMN pod_name VARCHAR;
ALTER TABLE jobs ADD COLUMN pod_namespace VARCHAR;
ALTER TABLE jobs ADD COLUMN container_name VARCHAR;
