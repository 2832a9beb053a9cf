"""Which block device and filesystem hold a path, and that device's /proc/diskstats counters.

Used by the storage probe (to label its result) and by the agent's probe scheduler (to run the storage
probe only while the target disk is quiet). Pure /proc and /sys reads: cheap and torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskCounters:
    device: str
    reads: int
    writes: int
    io_ticks_ms: int   # time the device had I/O in flight ("busy"), field 13 of diskstats


def device_for_path(path: str, sys_root: str = "/sys") -> str:
    """Kernel name of the block device holding ``path`` ("vda", "nvme0n1p2", "dm-0"), or "" (tmpfs, overlay)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    try:
        with open(f"{sys_root}/dev/block/{major}:{minor}/uevent") as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return ""


def fs_type_for_path(path: str, mounts: str = "/proc/mounts") -> str:
    """Filesystem type of the mount holding ``path`` (longest mount-point prefix), or ""."""
    real = os.path.realpath(path)
    best, best_type = "", ""
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, best_type = mnt, parts[2]
    except OSError:
        pass
    return best_type


def read_diskstats(device: str, path: str = "/proc/diskstats") -> DiskCounters | None:
    try:
        with open(path) as f:
            for line in f:
                p = line.split()
                if len(p) >= 13 and p[2] == device:
                    return DiskCounters(device, int(p[3]), int(p[7]), int(p[12]))
    except OSError:
        pass
    return None


def busy_between(a: DiskCounters, b: DiskCounters, elapsed_s: float) -> tuple[float, float]:
    """(busy percent, IOPS) of one device between two readings ``elapsed_s`` apart."""
    if elapsed_s <= 0:
        return 0.0, 0.0
    busy = min(100.0, 100.0 * (b.io_ticks_ms - a.io_ticks_ms) / (elapsed_s * 1000.0))
    iops = ((b.reads - a.reads) + (b.writes - a.writes)) / elapsed_s
    return max(0.0, busy), max(0.0, iops)
