"""Stage 1, measuring: what the node, its GPUs, its host and its jobs are doing now.

Each sampler reads one source (NVML, /proc and /sys, the kernel's TCP table, a training job's step
socket) and writes samples to a ``SampleSink``. Samplers import only agent.config, agent.snapshot,
agent.schedulers and the shared floors below the agent; never the pipeline, probing or the surface.
"""
