"""Active probes. Each runs as `python -m gpuagent.probes NAME --json` so torch/CUDA never load in the daemon."""
