"""`gpuagent run` on the real pynvml over the NVML emulator, for the namespace testbed.

Run as ``python tests/fabric_agent.py run --collector ... --state-dir ...`` (the agent CLI's arguments).
The agent is the real daemon and its NVML the real binding; the node (SYNTHETIC 8-GPU H100 values,
tests/data/nvml_8gpu_h100_sxm.json, without the fixture's processes so every node starts idle) is an
emulator node in ``<state-dir>-nvmlemu``. Why a wrapper and not just ``env=emu.env()``: the testbed
starts each agent with one command line, and a test switches a GPU job on a node by a file: while
the file named by $GPUAGENT_TEST_JOB_FILE exists, a real child process (``sleep``) is listed as a
process on GPU 0, as a training job holding that GPU would be; removing the file ends it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpuagent.sim.nvml_emulator import Emulator  # noqa: E402

H100_8GPU = Path(__file__).resolve().parent / "data" / "nvml_8gpu_h100_sxm.json"


def _state_dir(argv: list[str]) -> str:
    for k, a in enumerate(argv):
        if a == "--state-dir" and k + 1 < len(argv):
            return argv[k + 1]
        if a.startswith("--state-dir="):
            return a.split("=", 1)[1]
    sys.exit("fabric_agent.py: needs --state-dir (the emulated node lives beside it)")


def _start_node(state_dir: str) -> Emulator:
    node = Path(state_dir.rstrip("/") + "-nvmlemu")
    # An agent started again (after a test stopped it) gets a fresh node: the old one's process is gone.
    shutil.rmtree(node, ignore_errors=True)
    emu = Emulator.start(node, H100_8GPU, clock="real")
    for pid in {p["pid"] for g in emu.model["gpus"] for p in g.get("processes", ())}:
        emu.remove_process(pid)
    emu.activate()
    os.environ.update(emu.env_vars())         # probe subprocesses see the same node
    return emu


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the job's process goes when the agent does, however it ends."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _job_switch(emu: Emulator, path: str) -> None:
    """Hold a GPU job while ``path`` exists (checked every 0.2 s)."""
    child = None
    while True:
        exists = os.path.exists(path)
        if exists and child is None:
            child = subprocess.Popen(["sleep", "3600"], preexec_fn=_die_with_parent)
            emu.add_process(0, child.pid, 8 << 30, sm_util_percent=90)
        elif not exists and child is not None:
            emu.remove_process(child.pid)
            child.kill()
            child.wait()
            child = None
        time.sleep(0.2)


if __name__ == "__main__":
    node = _start_node(_state_dir(sys.argv[1:]))
    if os.environ.get("GPUAGENT_TEST_JOB_FILE"):
        threading.Thread(target=_job_switch, args=(node, os.environ["GPUAGENT_TEST_JOB_FILE"]), daemon=True).start()
    from gpuagent.agent.cli import main
    main()
