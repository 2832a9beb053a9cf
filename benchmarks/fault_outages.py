#!/usr/bin/env python3
"""The link-down fault at full length: the agent's link to the collector down for --seconds (default 60).

make test runs the same test (tests/test_fault_network.py::test_link_down) with a 25 s outage: long enough
for the ack watchdog (10 s) to notice it and for several reconnects at the 2 s backoff cap to fail. This runs
that test, unchanged, with the outage it had before (GPUAGENT_TEST_LINK_DOWN_S), in its own pytest process,
and prints what the test printed as JSON. Every assertion of the test holds or this fails. Needs root (the
namespace testbed, scripts/netns_fleet.py).

    sudo .venv/bin/python benchmarks/fault_outages.py --seconds 60 --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/test_fault_network.py::test_link_down"


def parse(out: str) -> dict:
    """The figures the test prints on its NET-FAULT lines."""
    fig: dict = {}
    m = re.search(r"NET-FAULT net_link_down: detected after ([\d.]+) s, down ([\d.]+) s, (\d+) batches spooled", out)
    if m:
        fig.update(detected_after_s=float(m.group(1)), down_s=float(m.group(2)), batches_spooled=int(m.group(3)))
    m = re.search(r"NET-FAULT net_link_down_after: backlog delivered ([\d.]+) s after the fault ended; "
                  r"reconnects (\d+), duplicate acks (\d+)", out)
    if m:
        fig.update(backlog_delivered_after_s=float(m.group(1)), reconnects=int(m.group(2)),
                   duplicate_acks=int(m.group(3)))
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the link stays down")
    ap.add_argument("--json", action="store_true", help="print one JSON document at the end")
    args = ap.parse_args()
    if args.seconds < 15:
        print("fault_outages: --seconds must be at least 15 (the ack watchdog alone takes 10 s)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:randomly", "-p", "no:cacheprovider",
                           TEST], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GPUAGENT_TEST_LINK_DOWN_S": f"{args.seconds:g}"})
    out = {"test": TEST, "link_down_s": args.seconds, "passed": proc.returncode == 0,
           "wall_s": round(time.monotonic() - t0, 1), **parse(proc.stdout)}
    if proc.returncode != 0:
        out["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
    print(json.dumps(out, indent=None if args.json else 2))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
