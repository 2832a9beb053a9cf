-- gpuagent collector schema, version 20: the cheap fabric layer's suspect paths in link_results (issue 43).
-- An agent reports once per epoch a summary of every path it probed (probe_results/probe_metrics, probe
-- path_probe, params role = summary) and one row per suspect path (here, probe path_probe: node_a probed
-- node_b). loss_ratio: the share of the path's datagrams that got no echo; train_gbits_per_s: the rate a
-- back-to-back train of datagrams and their echoes reached (common/path_probe.py), the slower direction's.
-- NULL on net_pair and rdma_pair rows and on rows written before version 20.
ALTER TABLE link_results ADD COLUMN loss_ratio DOUBLE;
ALTER TABLE link_results ADD COLUMN train_gbits_per_s DOUBLE;
