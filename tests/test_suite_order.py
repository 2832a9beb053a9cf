"""The suite's own ordering rule (tests/conftest.py IN_FILE_ORDER): in a shuffled run, a file whose tests build
on each other's state keeps its file order, and the other files' tests are still shuffled."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import IN_FILE_ORDER

ROOT = Path(__file__).resolve().parents[1]


def _collected(seed: int, *files: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          f"--randomly-seed={seed}", *files], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_declared_files_keep_their_order_under_a_shuffle_and_others_do_not():
    assert "test_fabric_e2e.py" in IN_FILE_ORDER
    in_file = re.findall(r"^def (test_\w+)", (ROOT / "tests" / "test_fabric_e2e.py").read_text(), re.M)
    shuffled_file = "tests/test_fabric_cli.py"
    defined = re.findall(r"^def (test_\w+)", (ROOT / shuffled_file).read_text(), re.M)
    moved = 0
    for seed in (3098114251, 1, 2):    # 3098114251 put the stopped-agent test before the sweep before the fix
        ids = _collected(seed, "tests/test_fabric_e2e.py", shuffled_file)
        assert [i.split("::")[1] for i in ids if i.startswith("tests/test_fabric_e2e.py")] == in_file, (seed, ids)
        moved += [i.split("::")[1] for i in ids if i.startswith(shuffled_file)] != defined
    assert moved, "pytest-randomly shuffled nothing: the test cannot tell kept order from no shuffle"
