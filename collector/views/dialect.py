"""The two things fleet queries spell differently on DuckDB and on Spark SQL.

Everything else in the shared queries (compare.py, the analyzer's baseline SQL) is written in what both
engines accept; these are the exceptions: a timestamp's epoch seconds and a timestamp literal.
"""

from __future__ import annotations

import datetime as dt


class Dialect:
    def __init__(self, name: str):
        self.name = name

    def epoch(self, expr: str) -> str:
        """Epoch seconds (a double) of a TIMESTAMP expression (UTC)."""
        if self.name == "spark":
            return f"(unix_micros(CAST({expr} AS TIMESTAMP)) / 1e6)"
        return f"epoch({expr})"

    def ts(self, seconds: float) -> str:
        """A TIMESTAMP (UTC, no time zone) literal for epoch ``seconds``, to the microsecond."""
        if self.name == "spark":
            return f"CAST(timestamp_micros({int(round(seconds * 1e6))}) AS TIMESTAMP_NTZ)"
        return f"to_timestamp({seconds:.6f})::TIMESTAMP"

    def ts_literal(self, t: dt.datetime) -> str:
        """The same for a naive UTC datetime (the collector's TIMESTAMP values)."""
        return self.ts(t.replace(tzinfo=dt.timezone.utc).timestamp())


DUCKDB = Dialect("duckdb")
SPARK = Dialect("spark")
