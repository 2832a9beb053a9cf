-- gpuagent collector schema, version 11: model FLOPs utilization (MFU) in job_steps.
-- Filled only for trackers that declared their model FLOPs (flops_per_step, or flops_per_token with tokens):
-- model_flops_per_s = steps_per_s x flops_per_step (or tokens_per_s x flops_per_token);
-- peak_flops_per_s  = the rank's GPU dense BF16 peak (gpuagent.common.gpu_peaks), NULL for a model not in the table;
-- mfu               = model_flops_per_s / peak_flops_per_s, a fraction (0.4 = 40 %).
ALTER TABLE job_steps ADD COLUMN model_flops_per_s DOUBLE;
ALTER TABLE job_steps ADD COLUMN peak_flops_per_s DOUBLE;
ALTER TABLE job_steps ADD COLUMN mfu DOUBLE;
