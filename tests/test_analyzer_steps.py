"""The analysis step list against the SQL files it names, and what a pass leaves behind (synthetic rows)."""

from __future__ import annotations

import datetime as dt
import re
from importlib import resources

import duckdb
import pytest

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.analysis import steps as St
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
_TEMP = re.compile(r"CREATE\s+(?:OR\s+REPLACE\s+)?TEMP\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.IGNORECASE)


def _sql(step: St.Step) -> str:
    return resources.files("gpuagent.collector.analysis").joinpath("sql", step.sql_file).read_text()


def test_every_sql_file_is_one_step_and_lists_its_temp_tables():
    shipped = sorted(e.name for e in resources.files("gpuagent.collector.analysis").joinpath("sql").iterdir()
                     if e.name.endswith(".sql"))
    assert sorted(s.sql_file for s in St.STEPS) == shipped
    assert len({s.name for s in St.STEPS}) == len(St.STEPS)
    for step in St.STEPS:
        assert set(step.temp_tables) == set(_TEMP.findall(_sql(step))), step.name
    # One flags step, after every conditions step: every kind's conditions must be in before flags open and
    # close; only the findings step (which reads the flags) comes after it, and it is last.
    produced = [s.produces for s in St.STEPS]
    assert produced.count(St.FLAGS) == 1
    flags_at = produced.index(St.FLAGS)
    assert St.CONDITIONS not in produced[flags_at + 1:]
    assert produced[flags_at + 1:] == [St.FINDINGS] and St.STEPS[-1].produces == St.FINDINGS


def test_counted_columns_are_named_in_the_sql():
    for step in St.STEPS:
        for name in step.counts:
            assert re.search(rf"RETURNING\s+1\s+AS\s+{name}\s*;", _sql(step)), (step.name, name)


@pytest.mark.parametrize("kwargs, message", [
    ({"produces": "rollups"}, "produces must be one of"),
    ({"produces": St.ROLLUP}, "source table goes with rollup steps"),
    ({"produces": St.CONDITIONS, "source": "samples"}, "source table goes with rollup steps"),
    ({"produces": St.CONDITIONS}, "flag kind goes with conditions steps"),
    ({"produces": St.CONTEXT, "kind": "utilization_gap"}, "flag kind goes with conditions steps"),
])
def test_a_malformed_step_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        St.Step("x", "x.sql", **kwargs)


def test_pass_counts_match_the_flags_table_and_leave_no_temp_tables(tmp_path):
    con = duckdb.connect(str(tmp_path / "c.duckdb"))
    try:
        schema.migrate(con)
        runs = [NOW - dt.timedelta(minutes=5 * i + 1) for i in range(6)]
        for i in range(4):
            S.add_node(con, f"synthetic-bm{i}", virtualized=False)
            S.add_probe_runs(con, f"synthetic-bm{i}", "pcie", {"h2d_gbps": [53.6] * 6}, runs, gpu=0)
        S.add_node(con, "synthetic-vm", virtualized=True)
        S.add_probe_runs(con, "synthetic-vm", "pcie", {"h2d_gbps": [40.0] * 6}, runs, gpu=0)
        an = A.Analyzer()
        first = an.run_pass(con, NOW)
        second = an.run_pass(con, NOW + dt.timedelta(minutes=1))
        open_rows = con.execute("SELECT count(*) FROM flags WHERE state = 'open'").fetchone()[0]
        assert (first.opened, first.updated, first.closed) == (open_rows, 0, 0) and open_rows >= 1
        assert (second.opened, second.updated, second.closed) == (0, open_rows, 0)
        logged = con.execute("SELECT opened, updated, closed FROM analysis_runs ORDER BY started_at").fetchall()
        assert logged == [(open_rows, 0, 0), (0, open_rows, 0)]
        assert set(first.step_s) == {s.sql_file for s in St.pass_steps()}        # baselines were stale
        assert set(second.step_s) == {s.sql_file for s in St.pass_steps() if s.produces != St.BASELINE}
        left = {r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()}
        assert left and not left & {t for s in St.STEPS for t in s.temp_tables}
    finally:
        con.close()
