"""Shared test fixtures. Tests use real parts (loopback gRPC, DuckDB files, subprocesses);
the only fake is the NVML backend (see common/nvml.py's seam)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

import tools
from nvml_emulator_fixture import nvml_emulator  # noqa: F401

# Spark's JVM (test_lake_spark.py, test_lake_scale.py) lives for one test file. The JIT's optimizing tier
# (C2) costs more CPU than it saves in so short a life: test_lake_spark.py took 128 CPU-seconds with it and
# 75 without, same results (measured on the 2-core machine). The `java` launcher reads JDK_JAVA_OPTIONS.
_JVM_SHORT_LIVED = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:CICompilerCount=1"
if _JVM_SHORT_LIVED not in os.environ.get("JDK_JAVA_OPTIONS", ""):
    os.environ["JDK_JAVA_OPTIONS"] = f"{os.environ.get('JDK_JAVA_OPTIONS', '')} {_JVM_SHORT_LIVED}".strip()


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or the deadline passes (never bare sleeps)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last value: {last!r})")


def worker_ports(slot: int, size: int = 100) -> tuple[int, int]:
    """A port range (lo, hi) that no other test running at the same time uses: a block per pytest-xdist
    worker (tests in one worker run one after another), ``slot`` picking one of its 10 sub-ranges. Below the
    kernel's ephemeral range (32768-60999 here), so no connect() or bind(0) elsewhere lands in it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker[2:].isdigit() else 0
    if not 0 <= slot < 10 or not 0 < size <= 100 or n >= 12:
        raise ValueError(f"worker_ports: slot {slot}, size {size}, worker {worker} out of range")
    lo = 20000 + 1000 * n + 100 * slot
    return lo, lo + size - 1


# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every
# CLI it spawns: the Ctrl-C tests would send SIGINT to processes that cannot see it. A handler here (not
# SIG_IGN) makes each child start with the default, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_next_port = 0


def free_port() -> int:
    """A loopback port free now that no other test running at the same time will pick: from this worker's
    own block (worker_ports slots 6-9), below the ephemeral range. A port from bind(0) is free only until
    someone else's bind(0) draws it: a collector stopped and restarted on it could meet a stranger's
    collector there, and an agent would deliver to the stranger (a CI failure seen so)."""
    global _next_port
    lo, _ = worker_ports(6)
    for _ in range(400):
        port = lo + _next_port % 400
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"free_port: all 400 ports from {lo} are in use")

def mounted_tmpfs(parent, name: str, size: str) -> Iterator:
    """A real tmpfs of ``size`` (mount(8) spelling: "64m", "1536k") at parent/name for a fixture to yield;
    unmounted even when the test fails, skipped where mounting needs a root this process lacks."""
    mnt = parent / name
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)



@pytest.fixture
def waiter():
    return wait_for


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without GPUAGENT_* (a developer's own settings must not reach a CLI
    under test), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAGENT_")}
    env.update(extra)
    return env


@contextlib.contextmanager
def spawned(argv: list[str], **popen_kw) -> Iterator[subprocess.Popen]:
    """A CLI subprocess (text stdout/stderr piped, environment from :func:`clean_env` unless given) that is
    killed and reaped when the block exits, also when an assertion inside it failed."""
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
          "env": clean_env(PYTHONFAULTHANDLER="1"), **popen_kw}
    proc = subprocess.Popen(argv, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def interrupt(proc: subprocess.Popen, timeout: float = 60.0) -> tuple[str, str]:
    """Ctrl-C: SIGINT to ``proc``, then its (stdout, stderr) once it has exited.

    A process still there after ``timeout`` gets SIGABRT: with PYTHONFAULTHANDLER (set by :func:`spawned`)
    Python prints every thread's stack, and the failure shows where it hung (CI saw two such hangs once)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        raise AssertionError(f"still running {timeout:g} s after SIGINT; its threads at SIGABRT:\n"
                             f"{(err or '')[-6000:]}") from None


# Child processes for job discovery: BUSY burns CPU, IDLE sleeps; both for at most two minutes.
BUSY = "import time\nend = time.time() + 120\nwhile time.time() < end: sum(range(10000))\n"
IDLE = "import time\ntime.sleep(120)\n"
_JOB_ENV = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GPUAGENT_JOB_ID")


def spawn_python(code: str, **env: str) -> subprocess.Popen:
    """``python -c code`` with exactly the job env given (the test runner's own job env removed)."""
    e = {k: v for k, v in os.environ.items() if k not in _JOB_ENV}
    e.update(env)
    return subprocess.Popen([sys.executable, "-c", code], env=e)


@pytest.fixture
def procs():
    """A list to put started processes in; each is killed and reaped after the test."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        p.kill()
        p.wait(timeout=10)


def _cuda_available() -> bool:
    # No NVIDIA driver, no CUDA: answered without importing torch (~3.5 s of CPU in every collecting process).
    if not os.path.exists("/proc/driver/nvidia") and not os.path.exists("/dev/nvidia0"):
        return False
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# The tests that need the machine to themselves (scripts/test.sh runs them after the parallel part, one at a
# time): they judge CPU shares of processes, or contention from "other" processes, which the parallel part's
# own workers would be. This is the one place the grouping is declared; a file name means all its tests.
ALONE = {
    "test_jobs_passive_contention.py",   # a stress-ng co-tenant must be the only outside contention
    # no tick may be skipped while four threads hammer /metrics: a claim about this machine's spare CPU
    "tests/test_agent_exporter.py::test_scrapes_do_not_disturb_the_tick_loop",
}


# Each file runs on one worker (--dist loadfile: its module fixtures are built once). The files here share one
# work unit instead, so they run one after the other on one worker: both lake files keep their Spark session
# for the process, and one JVM start (~20-30 s of two cores) serves both, instead of two JVMs at once.
SHARED_WORKER = {"test_lake_scale.py": "spark", "test_lake_spark.py": "spark"}
# Units handed out before all others. The Spark unit is the longest (~100 s on a quiet core, more under load);
# in xdist's order (most tests first) it started late and was the run's tail: 224 + 30 s, still running when
# the other workers had finished (2026-12-02).
START_FIRST = ("spark",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's file scheduler, with SHARED_WORKER's files in one unit. (Not xdist_group marks: pytest 9.2 no
    longer lets xdist 3.8 rename the test ids it groups them by.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # noqa: PLC0415

    class SharedFileScheduling(LoadFileScheduling):
        _started = False

        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return SHARED_WORKER.get(scope.rsplit("/", 1)[-1], scope)

        def _assign_work_unit(self, node):
            if not self._started:      # the queue is complete by the first hand-out
                self._started = True
                for scope in reversed(START_FIRST):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return SharedFileScheduling(config, log)


# Files whose tests build on each other's state and so run in file order even in a shuffled run (pytest-randomly
# shuffles inside a module; its hook runs before this file's, which puts these back). The files still take a
# shuffled place among the others. test_fabric_e2e.py: one 4-node fleet serves the module; the full sweep comes
# before the throttles, and the test that stops an agent comes last (a shuffled run, 2026-12-03, put another
# test first and the sweep saw 0 of 3 rounds). test_fabric_paths_netns.py: one fleet serves the module; the
# healthy test's epochs come before the throttles, and each throttle test waits its suspects out of the window.
IN_FILE_ORDER = {"test_fabric_e2e.py", "test_fabric_paths_netns.py"}


def _keep_file_order(items) -> None:
    slots = [i for i, item in enumerate(items) if item.path.name in IN_FILE_ORDER]
    ordered = sorted((items[i] for i in slots), key=lambda it: (str(it.path), it.reportinfo()[1] or 0))
    for i, item in zip(slots, ordered):
        items[i] = item


def pytest_collection_modifyitems(config, items):
    _keep_file_order(items)
    for item in items:
        if item.path.name in ALONE or item.nodeid in ALONE:
            item.add_marker(pytest.mark.alone)
    # The order the files are handed out in is xdist's (files with the most tests first). Starting the longest
    # files first instead was slower: 697 s against 607 s for the parallel part (2026-12-02, same tree), as
    # the heavy files together loaded the machine more, and their agents' and collectors' timed work (ticks,
    # scrapes, passes) grew with the wall time: 1,285 against 1,136 CPU-seconds.
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu-check.sh on a GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


_NVML_REASON: list[str] = []


def _nvml_reason() -> str:
    """'' when a real NVML with at least one GPU answers, else why not (asked once per session)."""
    if not _NVML_REASON:
        from gpuagent.common.nvml import Nvml  # noqa: PLC0415

        nv = Nvml()
        _NVML_REASON.append("" if nv.available else nv.reason)
        nv.shutdown()
    return _NVML_REASON[0]


def _left_running() -> list[str]:
    """Training jobs (this repo's examples/) and stress-ng processes still running: what an earlier test
    started and failed to stop. torchrun's ranks, each in a session of its own, once outlived a killed
    launcher and took the CPU under the next passive-contention test (a flag missed, in a shuffled run)."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a.startswith(examples) for a in argv) or os.path.basename(argv[0]).startswith("stress-ng"):
            found.append(f"{pid} {' '.join(argv).strip()}")
    return found


def pytest_runtest_setup(item):
    # A test that needs the machine to itself cannot start while another test's job or co-tenant still runs.
    if "alone" in item.keywords:
        left = _left_running()
        assert not left, "processes an earlier test left running (it must stop them): " + "; ".join(left)
    for mark in item.iter_markers("needs_tool"):
        tools.need(*mark.args)
    if "nvml" in item.keywords:
        reason = _nvml_reason()
        if reason:
            pytest.skip(f"needs an NVIDIA driver: {reason}")


# ---------------------------------------------------------------------------------------------- CPU per test
# GPUAGENT_TEST_CPU_LOG=FILE appends one JSON line per test: its worker, start and wall time, and the CPU seconds of
# this worker and of the children it reaped meanwhile (subprocesses, their subprocesses once reaped). Tests of one
# worker run one at a time, so the difference is that test's own CPU: what to cut when the suite is CPU-bound.
# The start times and workers draw the schedule: which worker was the parallel part's tail, and on what.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    path = os.environ.get("GPUAGENT_TEST_CPU_LOG")
    if not path:
        yield
        return
    import json
    import resource

    def cpu() -> float:
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
    c0, t0, start = cpu(), time.monotonic(), time.time()
    yield
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 2),
                            "cpu_s": round(cpu() - c0, 2), "start": round(start, 2),
                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "-")}) + "\n")


# ---------------------------------------------------------------------------------------------- missing tools
def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """One line per missing outside tool: which tests it skipped, and the one command that installs them all."""
    by_tool: dict[str, list[str]] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = rep.longrepr
        text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        text = text.removeprefix("Skipped: ")
        if text.startswith(tools.REASON_PREFIX):
            tool = text[len(tools.REASON_PREFIX):].split(" ", 1)[0]
            by_tool.setdefault(tool, []).append(rep.nodeid)
    if not by_tool:
        return
    terminalreporter.section("missing tools")
    for tool, ids in sorted(by_tool.items()):
        files = sorted({i.split("::", 1)[0] for i in ids})
        terminalreporter.write_line(f"missing tool {tool} (Debian package {tools.TOOLS[tool]}): {len(ids)} tests "
                                    f"skipped in {', '.join(files)}")
    terminalreporter.write_line(f"install every tool the suite uses with: {tools.INSTALL_COMMAND}")
