#!/usr/bin/env python3
"""Process-death faults at full repetition: the collector SIGKILLed N times under three agents, and one agent
SIGKILLed N times (default 20 each), with the exact accounting of tests/fault_helpers.py after every round.

make test runs the same two scenarios (tests/test_fault_process_death.py) for 5 rounds; this runs them as long
as you like. Needs root (each agent runs in its own UTS and mount namespace).

    sudo .venv/bin/python benchmarks/fault_rounds.py --rounds 20 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fault_helpers import Agent, can_unshare  # noqa: E402
from test_fault_process_death import agent_kill_rounds, collector_kill_rounds  # noqa: E402


def _cleanup(procs: list) -> None:
    for p in reversed(procs):
        try:
            p.kill() if isinstance(p, Agent) else p.stop()
        except Exception:  # noqa: BLE001 - cleanup goes on for the others
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print one JSON document at the end")
    args = ap.parse_args()
    why = can_unshare()
    if why:
        print(f"fault_rounds cannot run here: {why}", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("fault_rounds: --rounds must be at least 1", file=sys.stderr)
        return 2
    out: dict = {"rounds": args.rounds}
    for name, scenario in (("collector_sigkill", collector_kill_rounds), ("agent_sigkill", agent_kill_rounds)):
        procs: list = []
        t0 = time.monotonic()
        try:
            figs = scenario(Path(tempfile.mkdtemp(prefix=f"gpuagent-{name}-")), procs, args.rounds)
        finally:
            _cleanup(procs)
        figs = figs if isinstance(figs, list) else [figs]
        out[name] = {"wall_s": round(time.monotonic() - t0, 1),
                     # the agents' own counters after a clean stop (the collector scenario stops them cleanly)
                     "samples_produced": (sum(f["samples_produced"] for f in figs)
                                          if all("samples_produced" in f for f in figs) else None),
                     "samples_stored": sum(f["samples_stored"] for f in figs),
                     "samples_spooled": sum(f["samples_spooled"] for f in figs),
                     "samples_dropped": sum(f["samples_dropped"] for f in figs),
                     "duplicates": sum(f["duplicate_samples"] for f in figs),
                     "lost_batches": sum(f["lost_batches"] for f in figs)}
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
