"""How far a probe run has got, for the progress bar of ``gpuagent probe run``.

A probe calls ``step(done, total, label)`` as it enters each part of its work ("2 of 3 parts done, now:
random read"). The runner names a file in GPUAGENT_PROBE_PROGRESS; each call appends one short line
to it, and the runner reads the last line while it waits. A file, not a pipe: collective's ranks are
spawned processes, which inherit the environment but not open descriptors. Without the variable (the
agent's scheduled runs, a probe run by hand) ``step`` does nothing, and it never raises.
"""

from __future__ import annotations

import os

ENV = "GPUAGENT_PROBE_PROGRESS"


def step(done: int, total: int, label: str) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    line = f"{int(done)} {int(total)} {' '.join(str(label).split())[:200]}\n".encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # appends of one short line do not interleave
    except OSError:
        return
    try:
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_last(path: str) -> tuple[int, int, str] | None:
    """The last complete line of a progress file as (done, total, label), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 1024))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = tail.split("\n")[:-1]  # what follows the last newline is not complete yet
    for line in reversed(lines):
        parts = line.split(" ", 2)
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            return int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else ""
    return None
