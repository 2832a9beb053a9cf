"""Replace a file whole: readers see the old bytes or the new ones, never a torn mix.

The agent's sequence file, spool records and status file are written this way.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

def atomic_write(path: Path, data: bytes, fsync: bool = True, mode: int = 0o644) -> None:
    """Write to a temp file in the same folder, then rename over ``path``.

    With ``fsync`` the file and the folder are synced, so after a crash ``path`` holds either the old
    or the new content, never a torn mix.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
