"""Runs the real `gpuagent` command line with the fake NVML backend (tests/fake_nvml.py, the one allowed
fake) in place of pynvml, for tests that need an agent subprocess with GPUs. The fake clock follows
real time (a thread advances it) so counters and rates move; the values are SYNTHETIC.

    python tests/fake_nvml_agent.py run --collector ... --state-dir ...
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pynvml  # noqa: E402  (the real binding first: the fake takes its constants from it)

from fake_nvml import H100_8GPU, FakeNvmlBackend  # noqa: E402


def _follow_real_time(fake: FakeNvmlBackend, period_s: float = 0.1) -> None:
    last = time.monotonic()
    while True:
        time.sleep(period_s)
        now = time.monotonic()
        fake.advance(now - last)
        last = now


def main() -> None:
    fake = FakeNvmlBackend(H100_8GPU)
    sys.modules["pynvml"] = fake          # common/nvml.py does `import pynvml` when no backend is given
    threading.Thread(target=_follow_real_time, args=(fake,), daemon=True, name="fake-nvml-clock").start()
    from gpuagent.agent.cli import main as cli_main
    cli_main(prog_name="gpuagent")


if __name__ == "__main__":
    assert pynvml is not None
    main()
