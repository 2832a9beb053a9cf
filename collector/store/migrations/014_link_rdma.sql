-- gpuagent collector schema, version 14: rdma_pair's figures in link_results (issue 12).
-- The coordinator also schedules rdma_pair ([fabric] rdma_pairs): perftest's ib_write_bw average
-- (write_gbits_per_s, Gbit/s, node_a writes to node_b) and ib_write_lat's typical latency (lat_typical_us,
-- perftest's median of one write, microseconds). NULL on every other probe's rows, and on rdma_pair rows
-- that did not run (no RDMA device or no perftest: status skipped, with that reason).
ALTER TABLE link_results ADD COLUMN write_gbits_per_s DOUBLE;
ALTER TABLE link_results ADD COLUMN lat_typical_us DOUBLE;
