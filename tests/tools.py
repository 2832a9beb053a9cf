"""The outside tools the suite uses, in one place: which Debian package brings each, and the marker that
skips a test without it (or fails it in CI, where every tool must be there).

Use ``@needs("fio")`` (a marker; several names allowed) on a test, a class or as ``pytestmark``, or
``need("fio")`` inside a test or fixture. Without the tool the test is skipped with the reason
``missing tool fio (Debian package fio)``; with ``CI=true`` it fails instead, so CI never passes by
skipping what it was meant to run. At the end of a run, conftest.py prints one line per missing tool with
the tests it skipped and the one command that installs them all (``scripts/install-test-deps.sh``, which
``.ci/run`` runs too).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# tool (a command on PATH) -> the Debian package that installs it. scripts/install-test-deps.sh installs
# every package named here, and the benchmarks' tools besides (tests/test_architecture.py checks it).
TOOLS: dict[str, str] = {
    "fio": "fio",
    "stress-ng": "stress-ng",
    "virt-what": "virt-what",
    "systemd-analyze": "systemd",
    "systemd-detect-virt": "systemd",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "chromium": "chromium",
    "openssl": "openssl",
    "ip": "iproute2",
    "tc": "iproute2",
    "java": "openjdk-17-jre-headless",
    "losetup": "mount",
    "mkfs.ext4": "e2fsprogs",
    "cc": "gcc",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "scontrol": "slurm-client",
    "sbatch": "slurm-client",
    "munged": "munge",
}

INSTALL_COMMAND = "sudo scripts/install-test-deps.sh"
REASON_PREFIX = "missing tool "


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def which(tool: str) -> str | None:
    """The tool's path, or None. The venv's bin folder counts too (duckdb, for one, is a pip package)."""
    return shutil.which(tool) or shutil.which(tool, path=str(Path(sys.executable).parent))


def missing(*tools: str) -> list[str]:
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        raise KeyError(f"tests/tools.py has no entry for {', '.join(unknown)}: add it with its Debian package")
    return [t for t in tools if which(t) is None]


def reason_for(tool: str) -> str:
    return f"{REASON_PREFIX}{tool} (Debian package {TOOLS[tool]})"


def need(*tools: str) -> None:
    """Inside a test or fixture: skip (fail under CI=true) unless every tool is on PATH."""
    gone = missing(*tools)
    if not gone:
        return
    if in_ci():
        pytest.fail(f"CI=true, but {reason_for(gone[0])}: .ci/run installs it with scripts/install-test-deps.sh",
                    pytrace=False)
    pytest.skip(reason_for(gone[0]))


def needs(*tools: str) -> pytest.MarkDecorator:
    """The marker form of :func:`need`; conftest.py checks it before the test runs."""
    missing(*tools)  # unknown names fail at import, not silently
    return pytest.mark.needs_tool(*tools)


def python_module_or_skip(name: str, reason: str | None = None) -> None:
    """At a test module's top: skip the module unless the Python package ``name`` is installed, WITHOUT
    importing it (``pytest.importorskip`` imports it: torch alone costs ~3.5 s of CPU in every process that
    collects the suite, and these modules only start it in subprocesses)."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec(name) is None:
        pytest.skip(reason or f"could not find module {name!r}", allow_module_level=True)
