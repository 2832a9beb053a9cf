"""The Parquet lake on a SYNTHETIC fleet the real collector stored: export layout, idempotence, the exports
table, object-store (manifest) mode, and DuckDB over the lake answering what the collector's own file does."""

from __future__ import annotations

import datetime as dt
import shutil

import duckdb
import pyarrow.parquet as pq
import pytest

from gpuagent.collector.analysis.analyzer import AnalyzerConfig, analyze_db
from gpuagent.collector.lake import layout
from gpuagent.collector.lake.engines import DuckDbLake
from gpuagent.collector.lake.export import HOURLY, export_db
from gpuagent.collector.lake.fleet import compute_baselines
from gpuagent.collector.lake.layout import LakeError, open_lake
from gpuagent.collector.views.compare import DbSource, compare_pools
from sim_helpers import fleet_db


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return fleet_db(tmp_path_factory)


@pytest.fixture()
def db(fx, tmp_path):
    path = tmp_path / "shard.duckdb"
    shutil.copy(fx.db, path)
    return path


def assert_same(got, want, path="") -> None:
    """Equal, except floats to 1e-9 relative: sums over the same rows in another order differ in the last bits."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _far_future(db_path) -> dt.datetime:
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        newest = con.execute("SELECT max(ts) FROM samples").fetchone()[0]
    finally:
        con.close()
    return newest + dt.timedelta(hours=2)


def _hour_counts(db_path, table, time_col) -> dict[dt.datetime, int]:
    con = duckdb.connect(str(db_path), read_only=True)
    try:
        return dict(con.execute(f"SELECT date_trunc('hour', {time_col}) h, count(*) FROM {table} GROUP BY h")
                    .fetchall())
    finally:
        con.close()


def test_export_writes_sorted_zstd_partitions_once_and_records_them(db, tmp_path):
    lake_dir = tmp_path / "lake"
    now = _far_future(db)
    res = export_db(str(db), str(lake_dir), "s1", grace_s=0, now=now)
    assert res.partitions > 0 and res.rows > 0 and res.snapshots == 3

    con = duckdb.connect(str(db), read_only=True)
    exports = con.execute("SELECT tbl, hour, shard, rows, bytes, path FROM exports").fetchall()
    con.close()
    assert len(exports) == res.partitions
    for t in HOURLY:
        counts = _hour_counts(db, t.name, t.time_col)
        got = {h: rows for tbl, h, _, rows, _, _ in exports if tbl == t.name}
        assert got == counts, t.name          # every hour with rows, each exactly once, every row
    samples_hours = sorted(h for tbl, h, *_ in exports if tbl == "samples")
    part = lake_dir / f"samples/date={samples_hours[0]:%Y-%m-%d}/hour={samples_hours[0]:%H}/shard=s1"
    names = sorted(p.name for p in part.iterdir())
    assert names[0] == "_SUCCESS" and len(names) == 2 and names[1].startswith("part-")
    meta = pq.ParquetFile(part / names[1]).metadata
    assert meta.row_group(0).column(0).compression == "ZSTD"
    t = pq.read_table(part / names[1]).to_pylist()
    keys = [(r["node_id"], r["metric"], r["gpu"] if r["gpu"] is not None else 1 << 20, r["labels"], r["ts"])
            for r in t]
    assert keys == sorted(keys)
    assert sum(b for *_, b, _ in exports) == sum(
        (lake_dir / p[len(str(lake_dir)) + 1:]).joinpath(n).stat().st_size
        for *_, p in exports for n in layout.read_manifest(open_lake(str(lake_dir)), p[len(str(lake_dir)) + 1:]))
    assert not any((lake_dir / layout.TMP).glob("s1/*"))

    # A second run has nothing left to do; --again replaces every hour with new files and the same rows.
    assert export_db(str(db), str(lake_dir), "s1", grace_s=0, now=now).partitions == 0
    again = export_db(str(db), str(lake_dir), "s1", grace_s=0, now=now, again=True)
    assert (again.partitions, again.rows) == (res.partitions, res.rows)
    assert not (part / names[1]).exists() and len(list(part.iterdir())) == 2
    eng = DuckDbLake(open_lake(str(lake_dir)))
    try:
        lake_n = eng.query("SELECT count(*) AS n FROM samples")[0]["n"]
    finally:
        eng.close()
    assert lake_n == sum(_hour_counts(db, "samples", "ts").values())


def test_open_hours_wait_for_the_grace_and_rollups_for_the_analysis_pass(db, tmp_path):
    con = duckdb.connect(str(db), read_only=True)
    newest = con.execute("SELECT max(ts) FROM samples").fetchone()[0]
    con.close()
    last_hour = newest.replace(minute=0, second=0, microsecond=0)
    res = export_db(str(db), str(tmp_path / "lake"), "s1", grace_s=600, now=last_hour + dt.timedelta(minutes=5))
    con = duckdb.connect(str(db), read_only=True)
    hours = {h for (h,) in con.execute("SELECT DISTINCT hour FROM exports WHERE tbl = 'samples'").fetchall()}
    con.close()
    assert res.partitions and max(hours) < last_hour - dt.timedelta(hours=0) and last_hour not in hours


def test_manifest_mode_readers_take_only_the_files_named(db, tmp_path, monkeypatch):
    """Object stores cannot rename a folder: files go in place and _SUCCESS is written last. Forced here on a
    local folder; a stray part file (an interrupted run's) is never read, and the next export removes it."""
    monkeypatch.setattr(layout.Lake, "renames_atomically", property(lambda self: False))
    lake_dir = tmp_path / "lake"
    now = _far_future(db)
    export_db(str(db), str(lake_dir), "s1", grace_s=0, now=now)
    part = next((lake_dir / "samples").glob("date=*/hour=*/shard=s1"))
    stray = part / "part-interrupted-0.parquet"
    shutil.copy(next(part.glob("part-*.parquet")), stray)
    eng = DuckDbLake(open_lake(str(lake_dir)))
    try:
        assert eng.query("SELECT count(*) AS n FROM samples")[0]["n"] == sum(_hour_counts(db, "samples", "ts").values())
    finally:
        eng.close()
    export_db(str(db), str(lake_dir), "s1", grace_s=0, now=now, again=True)
    assert not stray.exists()


def test_duckdb_over_the_lake_gives_the_collectors_numbers(db, tmp_path):
    lake_dir = tmp_path / "lake"
    now = _far_future(db)
    export_db(str(db), str(lake_dir), "s1", grace_s=0, now=now)
    src = DbSource(str(db))
    try:
        want = compare_pools(src, 86400.0)
    finally:
        src.close()
    eng = DuckDbLake(open_lake(str(lake_dir)))
    try:
        got = compare_pools(eng, 86400.0)
        baselines = compute_baselines(eng, now=now)
    finally:
        eng.close()
    assert_same(got.to_dict(), want.to_dict())
    # The analyzer's own baseline step on the file, at the same time, gives the same rows.
    analyze_db(str(db), AnalyzerConfig(), now=now)
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT class_label, component, params_key, baseline, nodes, runs FROM fleet_baselines "
                       "ORDER BY ALL").fetchall()
    con.close()
    assert rows
    assert_same([[r[k] for k in ("class_label", "component", "params_key", "baseline", "nodes", "runs")]
                 for r in baselines], [list(r) for r in rows])


def test_bad_lake_paths_are_one_sentence(tmp_path):
    with pytest.raises(LakeError, match="does not exist"):
        open_lake(str(tmp_path / "nope"))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(LakeError, match="is a file"):
        open_lake(str(f))
    with pytest.raises(LakeError, match="shard name"):
        layout.check_shard("../etc")


def test_lake_baselines_as_of_a_bad_time_is_one_sentence(tmp_path):
    from click.testing import CliRunner

    from gpuagent.collector.cli import main
    r = CliRunner().invoke(main, ["lake", "baselines", "--lake", str(tmp_path), "--engine", "duckdb",
                                  "--as-of", "yesterday"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == ("Error: Invalid value for --as-of: 'yesterday' is not an ISO 8601 "
                                                 "time such as 2026-12-01T15:00:00")
