"""Shared test fixtures. Tests use real parts (loopback gRPC, DuckDB files, subprocesses);
the only fake is the NVML backend (see common/nvml.py's seam)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest


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
    kw = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": clean_env(), **popen_kw}
    proc = subprocess.Popen(argv, **kw)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def interrupt(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[str, str]:
    """Ctrl-C: SIGINT to ``proc``, then its (stdout, stderr) once it has exited."""
    proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=timeout)


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
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config, items):
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


def pytest_runtest_setup(item):
    if "nvml" in item.keywords:
        reason = _nvml_reason()
        if reason:
            pytest.skip(f"needs an NVIDIA driver: {reason}")
