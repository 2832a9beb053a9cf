"""gpuagent: a node agent and a collector for GPU training fleets.

The import namespace maps the repository's top-level folders (see DESIGN.md section 3):
``gpuagent.agent`` (agent/), ``gpuagent.collector`` (collector/), ``gpuagent.probes`` (probes/),
``gpuagent.proto`` (proto/) and ``gpuagent.jobs`` (jobs/, the in-training-process tracker).
"""

__version__ = "0.1.0"
