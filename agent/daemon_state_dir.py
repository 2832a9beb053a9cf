"""The daemon's hold on its state dir: one agent per state dir, and one sentence when it cannot be used.

Apart from the Agent (daemon.py) because it is the first thing start-up does and fails on, before any
sampler or thread exists. Re-exported by gpuagent.agent.daemon.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class StartupError(Exception):
    """The daemon cannot start; one sentence (e.g. the state dir is not writable)."""


def _state_dir_problem(state_dir: Path, exc: OSError) -> str:
    """One sentence for a state dir the agent cannot write."""
    if exc.errno == errno.EROFS:
        return f"state dir {state_dir} is on a read-only file system (pass --state-dir or GPUAGENT_STATE_DIR)."
    if exc.errno in (errno.ENOTDIR, errno.EEXIST) and not state_dir.is_dir():
        return f"state dir {state_dir} is not a directory (pass --state-dir or GPUAGENT_STATE_DIR)."
    if isinstance(exc, PermissionError):
        if os.geteuid() != 0:
            return (f"state dir {state_dir} is not writable by this user (run as root, or pass --state-dir or "
                    "GPUAGENT_STATE_DIR).")
        return f"state dir {state_dir} is not writable, even for root (pass --state-dir or GPUAGENT_STATE_DIR)."
    return f"state dir {state_dir} cannot be used: {exc.strerror or exc}."


LOCK_FILE = "agent.lock"


def lock_state_dir(state_dir: Path) -> int:
    """Hold ``<state_dir>/agent.lock`` (flock) for the agent's life; returns the open fd.

    Two agents on one state dir would hand out the same seq numbers from one seq file, and the collector
    would then drop the second batch of each pair as a resend: the second agent must not start."""
    path = state_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StartupError(_state_dir_problem(state_dir, exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(f"another gpuagent (pid {holder}) already runs with state dir {state_dir}; stop it "
                           "first or give this one another --state-dir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
