"""A real collector SIGKILLed in the middle of a lake export, then restarted: the lake holds every closed
hour of every table exactly once, with every row (a SYNTHETIC fleet the real collector stored)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import time

import duckdb
import pytest

from conftest import free_port
from gpuagent import local_run
from gpuagent.collector.lake import layout
from gpuagent.collector.lake.engines import DuckDbLake
from gpuagent.collector.lake.export import HOURLY, PAUSE_ENV
from gpuagent.collector.lake.layout import open_lake
from sim_helpers import fleet_db

pytestmark = pytest.mark.slow
GRACE_S = 1


@pytest.fixture()
def db(tmp_path_factory, tmp_path):
    path = tmp_path / "shard.duckdb"
    shutil.copy(fleet_db(tmp_path_factory).db, path)
    return path


def start(db, cfg, log, pause_s: float = 0.0) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, PAUSE_ENV: str(pause_s)}
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector.cli", "serve", "--db", str(db), "--listen",
                             f"127.0.0.1:{port}", "--config", str(cfg)],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    local_run.wait_port(port, proc, log, timeout=120)
    return proc, port


def wait_for(cond, timeout: float, what: str, proc=None, log=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the collector exited ({proc.returncode}) while waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def closed_hour_counts(db, now: dt.datetime) -> dict[tuple[str, dt.datetime], int]:
    """Rows per (table, hour) of every hour closed at ``now`` (what the exporter must have written)."""
    closed_before = (now - dt.timedelta(seconds=GRACE_S)).replace(minute=0, second=0, microsecond=0)
    con = duckdb.connect(str(db), read_only=True)
    try:
        out = {}
        for t in HOURLY:
            for h, n in con.execute(f"SELECT date_trunc('hour', {t.time_col}) h, count(*) FROM {t.name} "
                                    f"WHERE {t.time_col} < ? GROUP BY h", [closed_before]).fetchall():
                out[(t.name, h)] = n
        return out
    finally:
        con.close()


def test_sigkill_mid_export_then_restart_exports_every_closed_hour_exactly_once(db, tmp_path):
    lake_dir = tmp_path / "lake"
    cfg = tmp_path / "collector.toml"
    cfg.write_text(f'[lake]\nenabled = true\npath = "{lake_dir}"\nshard = "s1"\ninterval = "1s"\n'
                   f'grace = "{GRACE_S}s"\n')
    log = tmp_path / "collector.log"
    want_before = closed_hour_counts(db, dt.datetime.now(dt.UTC).replace(tzinfo=None))
    assert len({h for _, h in want_before}) >= 2, "the synthetic fleet should span at least two closed hours"

    # Each partition pauses after its files are written and before it is put in place: kill in that pause.
    proc, _ = start(db, cfg, log, pause_s=120)
    def tmp_files() -> list:
        where = lake_dir / layout.TMP / "s1"
        return list(where.rglob("*.parquet")) if where.exists() else []

    try:
        wait_for(lambda: tmp_files(), 120, "the first partition's files", proc, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    # Nothing readers can see: the written files sit under _tmp, no partition holds a _SUCCESS yet.
    assert tmp_files()
    assert not [p for p in lake_dir.rglob(layout.SUCCESS) if layout.TMP not in p.parts]

    # The database is the collector's while it runs, so the hours to wait for are those closed at the start
    # (an hour that closes during the test may or may not be exported yet when it stops).
    proc, _ = start(db, cfg, log)
    try:
        wait_for(lambda: all((lake_dir / layout.hour_partition(t, f"{h:%Y-%m-%d}", h.hour, "s1") / layout.SUCCESS)
                             .exists() for t, h in want_before), 240, "every closed hour in the lake", proc, log)
        time.sleep(2)   # the exports row follows the partition's rename: let the run record its last one
    finally:
        assert local_run.stop_process(proc, timeout=60) == 0, log.read_text()[-3000:]

    con = duckdb.connect(str(db), read_only=True)
    exports = con.execute("SELECT tbl, hour, rows FROM exports WHERE shard = 's1'").fetchall()
    con.close()
    recorded = {(t, h): n for t, h, n in exports}
    assert len(recorded) == len(exports)
    for key, n in want_before.items():
        assert recorded.get(key) == n, key     # every closed hour recorded once, with every row

    # The lake itself: each (table, hour) once, with the database's rows (a second copy would double them),
    # and no hour the exports table does not record.
    eng = DuckDbLake(open_lake(str(lake_dir)))
    try:
        for t in HOURLY:
            got = {r["h"]: r["n"] for r in eng.query(
                f"SELECT date_trunc('hour', {t.time_col}) AS h, count(*) AS n FROM {t.name} GROUP BY h")}
            for (tbl, h), n in want_before.items():
                if tbl == t.name:
                    assert got.get(h) == n, (tbl, h)
            assert set(got) <= {h for (tbl, h) in recorded if tbl == t.name}, t.name
    finally:
        eng.close()
    assert not list((lake_dir / layout.TMP).glob("s1/*")), "the restart cleans what the killed run left"
