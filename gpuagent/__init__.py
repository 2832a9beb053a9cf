"""gpuagent: a node agent and a collector for GPU training fleets.

The import namespace maps the repository's top-level folders (docs/ARCHITECTURE.md, "Packages"):
``gpuagent.common`` (common/), ``gpuagent.agent`` (agent/), ``gpuagent.probes`` (probes/),
``gpuagent.jobs`` (jobs/, the in-training-process tracker), ``gpuagent.proto`` (proto/),
``gpuagent.collector`` (collector/) and ``gpuagent.sim`` (sim/, the synthetic fleet). This folder itself
holds only ``local_run`` (``make run``), which starts a collector and an agent as subprocesses.
"""

from pkgutil import extend_path

# A source checkout run without installing (scripts/gpu-check.sh on a GPU box: no pip, no network) puts a
# folder of links named gpuagent/ on PYTHONPATH; the checkout's own gpuagent/ (this file only) comes first
# on sys.path when Python runs from the repository root, so the subpackages are looked up in every
# gpuagent/ folder on sys.path. An installed package has one such folder and is unaffected.
__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
