"""One sentence from an exception: what every user-facing error message in gpuagent is built from."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first non-empty line of ``str(exc)``, or the exception's class name when it says nothing.

    DuckDB, gRPC and OS errors carry multi-line texts (hints, stack context); users get one sentence.
    """
    for line in str(exc).strip().splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__
