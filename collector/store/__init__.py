"""Store: opening the DuckDB file, the single writer thread, the node registry, table declarations, migrations."""
