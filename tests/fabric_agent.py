"""`gpuagent run` with the fake NVML backend (the one allowed fake), for the namespace testbed.

Run as ``python tests/fabric_agent.py run --collector ... --state-dir ...`` (the agent CLI's arguments).
The agent is the real daemon; only NVML answers from tests/fake_nvml.py (SYNTHETIC 8-GPU H100 values).
While the file named by $GPUAGENT_TEST_JOB_FILE exists, a real child process (``sleep``) is listed as a
process on GPU 0, as a training job holding that GPU would be; removing the file ends it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_nvml import H100_8GPU, FakeNvmlBackend  # noqa: E402

import gpuagent.agent.gpu_sampler as gpu_sampler  # noqa: E402

BACKEND = FakeNvmlBackend(H100_8GPU)
for _gpu in BACKEND.gpus:      # the fixture's recorded processes would make every node busy: start idle
    _gpu["processes"] = []
_Nvml = gpu_sampler.Nvml
gpu_sampler.Nvml = lambda *a, **kw: _Nvml(backend=BACKEND)


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the fake job's process goes when the agent does, however it ends."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _job_switch(path: str) -> None:
    """Hold a fake GPU job while ``path`` exists (checked every 0.2 s)."""
    child = None
    while True:
        exists = os.path.exists(path)
        if exists and child is None:
            child = subprocess.Popen(["sleep", "3600"], preexec_fn=_die_with_parent)
            BACKEND.add_process(0, child.pid, used_memory_bytes=8 << 30, sm_util_percent=90)
        elif not exists and child is not None:
            BACKEND.remove_process(child.pid)
            child.kill()
            child.wait()
            child = None
        time.sleep(0.2)


if __name__ == "__main__":
    if os.environ.get("GPUAGENT_TEST_JOB_FILE"):
        threading.Thread(target=_job_switch, args=(os.environ["GPUAGENT_TEST_JOB_FILE"],), daemon=True).start()
    from gpuagent.agent.cli import main
    main()
