"""Kills what a test's Slurm cluster leaves behind when the test process is SIGKILLed.

The daemons die with their parent (PR_SET_PDEATHSIG), but slurmstepd and the job processes it started do not:
they are re-parented to init and run on (a `sleep 300` job outlived a killed test by its whole length). Every
one of them carries the cluster's SLURM_CONF in its environment, so that is how they are found. The cluster
starts this as a session of its own (``python slurm_reaper.py OWNER_PID OWNER_START CONF``) with SLURM_CONF
removed from its own environment; it polls until the owner is gone, kills every marked process, and leaves.
A cluster stopped normally writes ``<conf>.stopped`` and the reaper leaves without killing anything.
Standard library only: it must start fast and import nothing of the test suite.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5


def start_time(pid: int) -> int | None:
    """The process's start (clock ticks since boot, /proc/PID/stat field 22), or None once it is gone or a
    zombie (killed, its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def kill_marked(conf: str, spare: tuple[int, ...] = ()) -> list[int]:
    """SIGKILL every process whose environment has SLURM_CONF=conf; returns their pids."""
    mark = f"SLURM_CONF={conf}".encode()
    killed = []
    for n in os.listdir("/proc"):
        if not n.isdigit() or int(n) in spare:
            continue
        try:
            env = Path(f"/proc/{n}/environ").read_bytes()
        except OSError:
            continue
        if mark in env.split(b"\0"):
            try:
                os.kill(int(n), signal.SIGKILL)
                killed.append(int(n))
            except OSError:
                pass
    return killed


def main(argv: list[str]) -> int:
    owner, owner_start, conf = int(argv[0]), int(argv[1]), argv[2]
    stopped = Path(conf + ".stopped")
    while start_time(owner) == owner_start:
        if stopped.exists():
            return 0
        time.sleep(POLL_S)
    if not stopped.exists():
        # Twice: a slurmstepd killed in the middle of starting a task may fork one more.
        kill_marked(conf, spare=(os.getpid(),))
        time.sleep(POLL_S)
        kill_marked(conf, spare=(os.getpid(),))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
