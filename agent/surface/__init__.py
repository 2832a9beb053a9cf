"""Stage 4, facing people and other tools: ``gpuagent status``, ``/metrics``, ``gpuagent health``,
the probe CLI and the Slurm prolog/epilog hooks. The surface reads what the daemon publishes
(agent.snapshot) and never imports the daemon or the pipeline.
"""
