"""Insert Python rows into a DuckDB table in one statement, through Arrow.

DuckDB binds ``executemany`` parameters one value at a time, and for each value tries to import pandas
(which the collector does not install): 200 small rows cost about 0.15 s that way, and the analyzer's
lookup tables made up most of a small fleet's analysis pass. Through Arrow the same rows take a few ms.
Only the collector, its analysis and the synthetic rows use it; pyarrow is imported on first use.
"""

from __future__ import annotations

from typing import Any, Sequence


def insert_rows(con, target: str, rows: Sequence[Sequence[Any]]) -> int:
    """``INSERT INTO target`` (a table, optionally with its column list) the ``rows``, matched by position;
    returns how many. Column types are inferred by Arrow and cast by DuckDB to the table's."""
    if not rows:
        return 0
    import pyarrow as pa  # noqa: PLC0415 - the collector extra

    # A relation over the Arrow table, named for this one statement: no replacement scan (the collector turns
    # external access off, which disables those) and no register() (about 0.15 s a call).
    table = pa.table({f"c{i}": list(col) for i, col in enumerate(zip(*rows, strict=True))})
    con.from_arrow(table).query("_sql_rows", f"INSERT INTO {target} SELECT * FROM _sql_rows")
    return len(rows)
