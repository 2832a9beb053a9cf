"""The node daemon: samplers, NVML access, job discovery, batcher, spool, sender, status, CLI.

Nothing in this package may import torch: the resident daemon stays light (docs/ARCHITECTURE.md, "Principles").
"""
