"""Opt-in step tracker imported by training scripts (``gpuagent.jobs.track``). No heavy dependencies.

One line in a training loop::

    tracker = gpuagent.jobs.track(name="resnet50", samples_per_step=256)
    for batch in tracker.wrap_loader(loader):   # optional: splits data wait from compute
        ...
        tracker.step()

or ``gpuagent.jobs.wrap_optimizer(optimizer, name=...)``, or ``with tracker.step_context(): ...``.
Measurements go to the local agent as non-blocking Unix datagrams (see ``gpuagent.jobs.wire``);
without an agent nothing happens and nothing is raised.
"""

from gpuagent.jobs.tracker import Tracker, track, wrap_optimizer

__all__ = ["Tracker", "track", "wrap_optimizer"]
