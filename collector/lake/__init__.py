"""The Parquet lake: export (export.py), layout (layout.py), fleet-wide queries (engines.py, fleet.py)."""
