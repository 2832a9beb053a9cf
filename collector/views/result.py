"""A query's result as the Query RPC carries it: the server builds it (sqlguard), the client reads it back."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    column_types: list[str]
    rows: list[list]   # JSON-ready values
    truncated: bool

    def rows_json(self) -> str:
        return json.dumps(self.rows, separators=(",", ":"))
