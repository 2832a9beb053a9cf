"""Disk neighbours of a passively seen job (issue 26): job discovery names the commands outside the job that
move storage bytes (/proc/<pid>/io), never the job's own I/O. Real processes on this machine: a job that
writes and fsyncs a file of its own, and a real fio writing with O_DIRECT beside it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from gpuagent.agent.samplers.job_discovery import NEIGHBOUR_IO_NAMED_MIN, JobDiscovery
from gpuagent.agent.samplers.sampling import ListSink, now_ns
from tests.conftest import spawn_python

JOB = "torchelastic:io-neighbour-test"


def _kill_tree(pid: int) -> None:
    """fio and the worker it forked."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for p in [pid, *map(int, kids)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass

OWN_IO = """
import os, sys, time
path = sys.argv[1] if len(sys.argv) > 1 else {path!r}
end = time.time() + 60
with open(path, "wb") as f:
    while time.time() < end:
        f.seek(0)
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
"""


@pytest.mark.skipif(shutil.which("fio") is None, reason="needs fio (scripts/install-test-deps.sh)")
def test_a_disk_neighbour_is_named_by_its_bytes_and_the_jobs_own_io_is_not(tmp_path, procs):
    job = spawn_python(OWN_IO.format(path=str(tmp_path / "own.bin")), TORCHELASTIC_RUN_ID="io-neighbour-test",
                       RANK="0")
    procs.append(job)
    # fio is started through a shell that exits at once, so it is nobody's child here: a child of this test
    # process would be the agent's own (discovery runs in it) and never a neighbour.
    fio_pid = int(subprocess.check_output(
        ["sh", "-c", f"fio --name=neighbour --filename={tmp_path / 'fio.bin'} --size=16M --rw=write --bs=1M "
                     "--direct=1 --time_based --runtime=30 --output=/dev/null >/dev/null 2>&1 & echo $!"],
        text=True).strip())
    try:
        jd = JobDiscovery(scan_interval_s=0, end_grace_s=30)
        sink = ListSink()
        deadline = time.monotonic() + 20
        named: list = []
        while time.monotonic() < deadline and len(named) < 3:
            jd.sample(now_ns(), sink)
            time.sleep(0.5)
            named = [s for s in sink.samples if s.metric == "job_neighbour_process_io_bytes_per_s"
                     and dict(s.labels).get("job_id") == JOB and dict(s.labels).get("comm") == "fio"]
        assert os.path.exists(f"/proc/{fio_pid}"), "fio ran through the test"
    finally:
        _kill_tree(fio_pid)
    assert job.poll() is None
    assert len(named) >= 3, [(s.metric, s.labels) for s in sink.samples if "io_bytes" in s.metric]
    assert all(s.value >= NEIGHBOUR_IO_NAMED_MIN for s in named)
    io_rows = [s for s in sink.samples if s.metric == "job_neighbour_process_io_bytes_per_s"]
    assert not [s for s in io_rows if dict(s.labels).get("pid") == str(job.pid)], "the job's own I/O is its own"
    # the job did write: its own bytes are in its job samples, not among its neighbours
    own = [r for r in sink.job_samples if r["pid"] == job.pid]
    assert own and max(r["write_bytes_per_s"] for r in own) >= NEIGHBOUR_IO_NAMED_MIN, own[-1:]
