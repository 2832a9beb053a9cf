"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd (Debian's packages) with a
generated slurm.conf, state and sockets in a temporary folder, ports from this xdist worker's own range.

ProctrackType=proctrack/linuxproc and TaskPlugin=task/none: no cgroups needed, so `scontrol listpids`
is how a job's processes are found (agent/schedulers/slurm.py's fallback). Needs root (slurmd runs jobs as their
user). Every daemon runs in the foreground with PR_SET_PDEATHSIG, so a killed test takes them along; stop()
also cancels the jobs and kills whatever is left that carries this cluster's SLURM_CONF, and when the test is
killed a reaper of its own session (tests/slurm_reaper.py) does that for slurmstepd and the jobs, which
outlive their slurmd.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import wait_for, worker_ports
from slurm_reaper import kill_marked, start_time
from tools import need

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


class SlurmCluster:
    def __init__(self, root: Path, partition: str = "gpu", extra_conf: tuple[str, ...] = ()) -> None:
        """``extra_conf``: more slurm.conf lines (HealthCheckProgram, Prolog, ...), written after the others."""
        need("slurmctld", "slurmd", "scontrol", "sbatch", "munged")
        if os.geteuid() != 0:
            import pytest  # noqa: PLC0415
            pytest.skip("a Slurm cluster's slurmd needs root")
        self.root = root
        self.partition = partition
        self.extra_conf = tuple(extra_conf)
        self.node = socket.gethostname().split(".")[0]
        self.nodes = [self.node]
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.reaper: subprocess.Popen | None = None
        lo, _ = worker_ports(5, 10)
        self.ctld_port, self.slurmd_port = lo, lo + 1

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        sock = r / "munge" / "munge.sock"
        self.conf.write_text("\n".join([
            "ClusterName=gpuagenttest",
            f"SlurmctldHost={self._ctld_host()}",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={sock}", "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "ReturnToService=2",
            "MpiDefault=none", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "MessageTimeout=5", "SlurmdTimeout=30", "DefMemPerCPU=100",
            *self._node_lines(),
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=10 State=UP",
            *self.extra_conf, ""]))
        self._start_reaper()
        self._spawn(["munged", "-F", f"--socket={sock}", f"--key-file={key}", f"--pid-file={r / 'munge' / 'pid'}",
                     f"--log-file={r / 'munge' / 'log'}", f"--seed-file={r / 'munge' / 'seed'}", "--force"])
        wait_for(sock.exists, timeout=10, what="munged's socket")
        self._start_daemons()
        return self

    def _start_reaper(self) -> None:
        Path(str(self.conf) + ".stopped").unlink(missing_ok=True)         # a cluster started again in this root
        env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}   # it must not kill itself
        self.reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("slurm_reaper.py")), str(os.getpid()),
             str(start_time(os.getpid())), str(self.conf)],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)

    def _ctld_host(self) -> str:
        return f"{self.node}(127.0.0.1)"

    def _node_lines(self) -> list[str]:
        return [f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN"]

    def _start_daemons(self) -> None:
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)])
        self._spawn(["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])
        self.wait_idle([self.node])

    def wait_idle(self, nodes: list[str], timeout: float = 60.0) -> None:
        """Wait until every node is idle. A slurmd that could not register at once is pinged again by slurmctld
        only every SlurmdTimeout / 3 (10 s), so a loaded machine can take a few of those; a timeout says what
        each node's state was, which daemon had exited, and the end of each daemon's log."""
        states: dict[str, str] = {}

        def idle() -> bool:
            states.update({n: self.node_state(n) for n in nodes})
            return all(s == "idle" for s in states.values())

        try:
            wait_for(idle, timeout=timeout, interval=0.2, what="the Slurm nodes idle")
        except AssertionError as e:
            raise AssertionError(f"{e}; node states {states}; {self.daemon_report()}") from None

    def daemon_report(self) -> str:
        """Which daemons have exited (and how), and the last lines of each daemon's log: for a failed start."""
        exited = [f"{' '.join(p.args[-4:]) if isinstance(p.args, list) else p.args} exited {p.returncode}"
                  for p in self.procs if p.poll() is not None]
        tails = []
        for log in sorted((self.root / "log").glob("slurm*")):
            lines = log.read_text(errors="replace").strip().splitlines()[-6:]
            tails.append(f"{log.name}: " + " | ".join(lines))
        return f"exited: {exited or 'none'}; " + "; ".join(tails)

    def _wrap(self, cmd: list[str], where: str | None = None) -> list[str]:
        """The argv that runs ``cmd`` where it must run (here: this host, as it is)."""
        return cmd

    def _spawn(self, cmd: list[str], where: str | None = None, log_name: str | None = None) -> None:
        log = open(self.root / "log" / f"{log_name or cmd[0]}.out", "ab")
        self.procs.append(subprocess.Popen(self._wrap(cmd, where), env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           preexec_fn=_die_with_parent))

    def run(self, *args: str, check: bool = True) -> str:
        p = subprocess.run(self._wrap(list(args)), env=self.env, capture_output=True, text=True, timeout=30,
                           cwd=self.root)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def node_state(self, node: str | None = None) -> str:
        out = self.run("sinfo", "-h", "-n", node or self.node, "-o", "%T", check=False).strip()
        return out.splitlines()[0].rstrip("*") if out else ""

    def sbatch(self, script: str, *opts: str) -> str:
        """Submit a batch script; returns the job id."""
        path = self.root / f"job{len(list(self.root.glob('job*.sh')))}.sh"
        path.write_text("#!/bin/bash\n" + script)
        out = self.run("sbatch", "--parsable", "-p", self.partition, "-o", str(self.root / "log" / "job-%j.out"),
                       *opts, str(path))
        return out.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        out = self.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).strip()
        return out or "GONE"

    def cancel_all_and_wait(self, timeout: float = 30.0) -> None:
        """Cancel every job and wait until squeue lists none: a job still completing holds its CPUs (the node
        has os.cpu_count() of them), so the next test's jobs would wait behind it, in whatever order tests run."""
        self.run("scancel", "--full", "-p", self.partition, check=False)
        listed = lambda: self.run("squeue", "-h", "-o", "%i %T", check=False).strip()  # noqa: E731
        try:
            wait_for(lambda: not listed(), timeout=timeout, interval=0.1, what="squeue to list no job after scancel")
        except AssertionError as e:
            raise AssertionError(f"{e}; still listed: {listed()}") from None

    def stop(self) -> None:
        self.run("scancel", "--full", "-p", self.partition, check=False)
        time.sleep(0.2)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        # slurmstepd and job processes outlive slurmd: they carry this cluster's SLURM_CONF
        kill_marked(str(self.conf), spare=(os.getpid(),))
        Path(str(self.conf) + ".stopped").touch()
        if self.reaper is not None:
            try:
                self.reaper.wait(timeout=10)      # it leaves within a poll of seeing the marker
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
            self.reaper = None


def _cgroup_mounts() -> str:
    """Shell that mounts what slurmd's cgroup plugin checks for at start-up, in a namespace's fresh /sys
    (`ip netns exec` mounts one without cgroups; its mount table is the namespace's own, the host's is
    untouched): cgroup2 on a cgroup v2 host, else a tmpfs with the v1 name=systemd hierarchy."""
    mounts = Path("/proc/mounts").read_text().split("\n")
    if any(m.split()[1:3] == ["/sys/fs/cgroup", "cgroup2"] for m in mounts if len(m.split()) > 2):
        return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    return ("mount -t tmpfs cgroup_root /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
            "mount -t cgroup -o none,name=systemd systemd /sys/fs/cgroup/systemd")


_CGROUP_MOUNTS = _cgroup_mounts()


class NetnsSlurmCluster(SlurmCluster):
    """Several real slurmd nodes on one host, each in its own network namespace with its own hostname (the
    namespace testbed, scripts/netns_fleet.py). Debian's slurmd is built without multiple-slurmd: a second
    slurmd on one host kills the first ("killing old slurmd"), so each node needs its own network namespace.

    Nodes ``<prefix>n0``..``n<k-1>`` run slurmd (10.203.0.1..k); slurmctld runs in the last namespace. The
    host has no route into the namespaces, so ``run`` (scontrol, sinfo, sbatch) runs in the controller's
    namespace, and ``scontrol_wrapper`` is a program that does the same for code under test. munged stays
    on the host: its socket is a file, which every namespace sees.
    """

    def __init__(self, root: Path, fleet, partition: str = "gpu", extra_conf: tuple[str, ...] = ()) -> None:
        super().__init__(root, partition, extra_conf)
        self.fleet = fleet
        names = sorted(fleet.nodes, key=lambda n: fleet.nodes[n].index)
        self.ctl = names[-1]
        self.slurmd_at = {fleet.nodes[n].hostname: n for n in names[:-1]}
        self.nodes = list(self.slurmd_at)
        self.node = self.nodes[0]
        self.scontrol_wrapper = root / "scontrol-in-controller-netns"

    def _ctld_host(self) -> str:
        ctl = self.fleet.nodes[self.ctl]
        return f"{ctl.hostname}({ctl.ip})"

    def _node_lines(self) -> list[str]:
        return [f"NodeName={h} NodeAddr={self.fleet.nodes[n].ip} CPUs=1 RealMemory=100 State=UNKNOWN"
                for h, n in self.slurmd_at.items()]

    def _wrap(self, cmd: list[str], where: str | None = None) -> list[str]:
        return self.fleet.command(where or self.ctl, cmd)

    def _start_daemons(self) -> None:
        text = self.conf.read_text()
        for key, path in (("SlurmdSpoolDir", self.root / "spool" / "%n"), ("SlurmdPidFile", self.root / "%n.pid"),
                          ("SlurmdLogFile", self.root / "log" / "slurmd-%n.log")):
            text = "\n".join(f"{key}={path}" if line.startswith(f"{key}=") else line for line in text.splitlines())
        self.conf.write_text(text + "\n")
        for h in self.nodes:
            (self.root / "spool" / h).mkdir(parents=True, exist_ok=True)
        self.scontrol_wrapper.write_text(f"#!/bin/sh\n{shlex.join(self.fleet.command(self.ctl, ['scontrol']))} \"$@\"\n")
        self.scontrol_wrapper.chmod(0o755)
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)])
        for h, n in self.slurmd_at.items():
            self._spawn(["sh", "-c", f'{_CGROUP_MOUNTS} && exec "$@"', "sh", "slurmd", "-D", "-N", h, "-f",
                         str(self.conf)], where=n, log_name=f"slurmd-{h}")
        self.wait_idle(self.nodes)
