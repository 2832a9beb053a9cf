"""The node daemon, one folder per stage (docs/ARCHITECTURE.md, "The agent's stages").

agent.config and agent.snapshot are the floor every stage stands on; then schedulers, samplers, the
pipeline and probing, the surface; agent.daemon and agent.cli sit on top and wire them together.
Nothing in this package may import torch: the resident daemon stays light (docs/ARCHITECTURE.md, "Principles").
"""
