"""The collector's server options: one frozen dataclass, read by start-up, the gRPC server and the servicer.

A module of its own so the servicer (servicer.py) takes its options without importing the server that
serves it (server.py), which imports the servicer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    max_message_bytes: int = 64 * 1024 * 1024
    max_inflight_samples: int = 2_000_000     # bound on samples validated but not yet committed (memory)
    memory_limit: str = "512MB"               # DuckDB's buffer manager limit (spills beyond it)
    query_max_rows: int = 10_000
    query_timeout_s: float = 60.0
    query_max_bytes: int = 16 * 1024 * 1024      # result size bound of one Query, measured in Arrow before JSON
    stop_grace_s: float = 2.0
    stream_takeover_idle_s: float = 60.0      # a node's stream silent this long (or 3 batch intervals) gives way
