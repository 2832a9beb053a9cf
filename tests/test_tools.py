"""The missing-tool path of the suite (tests/tools.py, conftest.py): without a tool its tests skip with the
tool's name and package, the run ends with one line per missing tool and the install command, and under
CI=true the same tests fail instead. Real pytest subprocesses on a real test file, with PATH stripped of the
system's folders so the tool is really absent for them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tools

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/test_packaging_units.py"     # every test there needs systemd-analyze (Debian package systemd)


def _pytest(ci: bool) -> subprocess.CompletedProcess:
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(Path.home()), "CI": "true" if ci else ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           TARGET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_missing_tool_skips_and_is_named_with_the_install_command():
    r = _pytest(ci=False)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "missing tool systemd-analyze (Debian package systemd):" in out, out
    assert f"skipped in {TARGET}" in out, out
    assert f"install every tool the suite uses with: {tools.INSTALL_COMMAND}" in out, out
    assert " passed" not in out.splitlines()[-1], out      # nothing ran without the tool


def test_missing_tool_fails_under_ci():
    r = _pytest(ci=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "CI=true, but missing tool systemd-analyze (Debian package systemd)" in r.stdout, r.stdout
    last = r.stdout.splitlines()[-1]
    assert " error" in last and " passed" not in last, r.stdout     # fails in setup: each test is an error


def test_every_tool_package_is_installed_by_the_install_script():
    listed = subprocess.run(["bash", str(ROOT / "scripts" / "install-test-deps.sh"), "--list"], capture_output=True,
                            text=True, check=True, timeout=30).stdout.split()
    assert set(tools.TOOLS.values()) <= set(listed), set(tools.TOOLS.values()) - set(listed)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/install-test-deps.sh" in ci      # CI installs with the same command a developer runs
