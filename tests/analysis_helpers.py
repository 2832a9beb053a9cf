"""Shared by the analyzer tests: a migrated DuckDB file and one analysis pass at a fixed time."""

from __future__ import annotations

import datetime as dt

import duckdb
import pytest

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema

NOW = dt.datetime(2026, 1, 1, 12, 0)


@pytest.fixture(name="con")
def migrated_db(tmp_path):
    """A real collector database file at the latest schema."""
    c = duckdb.connect(str(tmp_path / "collector.duckdb"))
    schema.migrate(c)
    yield c
    c.close()


def run(con, now=NOW, config=None):
    """One analysis pass in its own transaction, as the collector runs it."""
    an = A.Analyzer(config)
    return an.run_pass(con, now)
