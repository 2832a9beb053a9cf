"""Opt-in step tracker imported by training scripts (``gpuagent.jobs.track``). No heavy dependencies."""
