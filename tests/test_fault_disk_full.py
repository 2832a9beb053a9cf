"""Disk full on the collector mid-commit: its DuckDB file lives on a small tmpfs that a filler file fills
while two real agents stream. The agents get UNAVAILABLE and keep their spool; once space is freed
everything arrives exactly once."""

from __future__ import annotations

import errno
import os

import pytest

from conftest import mounted_tmpfs, wait_for
from fault_helpers import Agent, Collector, account, can_unshare, started_procs  # noqa: F401 - the procs fixture

pytestmark = pytest.mark.skipif(bool(can_unshare()), reason=can_unshare() or "ok")


@pytest.fixture
def small_fs(tmp_path):
    """A real 32 MiB tmpfs (root only), unmounted even when the test fails."""
    yield from mounted_tmpfs(tmp_path, "smallfs", "32m")



def _fill(path) -> int:
    """Write until the file system says ENOSPC; returns the bytes written."""
    n = 0
    chunk = b"\0" * (64 << 10)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
                n += len(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return n


@pytest.mark.slow
def test_collector_disk_full_agents_keep_spool_then_exactly_once(tmp_path, small_fs, procs):
    c = Collector(tmp_path, db=small_fs / "collector.duckdb").start()
    procs.append(c)
    agents = [Agent(tmp_path, f"fault-d{i}", interval=0.1, batch_interval=0.2) for i in range(2)]
    for a in agents:
        procs.append(a.start(c.address))
    for a in agents:
        a.wait_running()
        wait_for(lambda: a.acked() > 0, timeout=60, what=f"first ack of {a.name}")
    account("disk_full_before", agents, c)

    filler = small_fs / "filler"
    try:
        _fill(filler)
    except OSError:
        pass
    st = os.statvfs(small_fs)
    assert st.f_bavail * st.f_frsize < 64 << 10, "the file system is not full"
    # Every agent is refused and keeps what it cut in its spool.
    for a in agents:
        wait_for(lambda: "unavailable" in (a.status().get("collector", {}).get("last_error") or "").lower(), timeout=60,
                 what=f"{a.name} told UNAVAILABLE")
        wait_for(lambda: a.status().get("spool", {}).get("backlog_batches", 0) >= 5, timeout=60,
                 what=f"{a.name} keeping a backlog")
    assert c.proc.poll() is None, f"the collector died on a full disk: {c.tail()}"
    err = agents[0].status()["collector"]["last_error"]
    print("agent error while the disk was full:", err)
    full = account("disk_full_while_full", agents, c)
    assert all(f["batches_spooled"] >= 5 for f in full)

    filler.unlink()
    highs = {a.name: a.seq_high() for a in agents}
    for a in agents:
        wait_for(lambda: a.acked() > highs[a.name], timeout=90, what=f"{a.name} backlog delivered after freeing")
    produced = {}
    for a in agents:
        final = a.stop()
        produced[a.name] = final["counters"]["samples"]
    figs = account("disk_full_after", agents, c, produced=produced)
    assert all(f["samples_dropped"] == 0 for f in figs)
    assert c.stop() == 0, c.tail()
    assert "Traceback" not in c.tail(100_000)
