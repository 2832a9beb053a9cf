"""A test killed with SIGKILL leaves no Slurm process behind (issue 24: "clean up even when killed").

A real single-node cluster (tests/slurm_cluster.py) runs a `sleep 300` batch job in a child process that
stands for a test; the child is SIGKILLed. The daemons die with it (PR_SET_PDEATHSIG); slurmstepd and the
job's processes, re-parented to init, are killed by the cluster's reaper (tests/slurm_reaper.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import wait_for
from slurm_cluster import SlurmCluster
from slurm_reaper import kill_marked

HERE = Path(__file__).resolve().parent


def marked(conf: Path) -> list[str]:
    """Processes whose environment carries this cluster's SLURM_CONF, as 'pid comm'."""
    mark = f"SLURM_CONF={conf}".encode()
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                if mark in Path(f"/proc/{n}/environ").read_bytes().split(b"\0"):
                    out.append(f"{n} {Path(f'/proc/{n}/comm').read_text().strip()}")
            except OSError:
                continue
    return out


def test_a_sigkilled_owner_leaves_no_slurmstepd_or_job_process(tmp_path):
    SlurmCluster(tmp_path)      # skips here, in the test, when Slurm or root is missing
    root = tmp_path / "cluster"
    root.mkdir()
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        from slurm_cluster import SlurmCluster
        from conftest import wait_for
        c = SlurmCluster(__import__("pathlib").Path({str(root)!r})).start()
        job = c.sbatch("exec sleep 300\\n")
        wait_for(lambda: c.job_state(job) == "RUNNING", timeout=30, interval=0.2, what="the job running")
        print("running", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    conf = root / "slurm.conf"
    try:
        assert owner.stdout.readline().strip() == "running"
        wait_for(lambda: any(p.endswith(" sleep") for p in marked(conf)), timeout=15, interval=0.2,
                 what="the job's sleep process")
        assert any(p.endswith(" slurmstepd") for p in marked(conf)), marked(conf)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        wait_for(lambda: not marked(conf), timeout=15, interval=0.2,
                 what=f"no process of the killed cluster left (left: {marked(conf)})")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        kill_marked(str(conf))    # whatever a failed assertion left
