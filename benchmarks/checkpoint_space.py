#!/usr/bin/env python3
"""What DuckDB writes for a commit and for a checkpoint, against the Arrow bytes of the rows: the basis of
the collector's room check before each commit (collector/store/space.py, ``SpaceCheck``). Linux only.

A SYNTHETIC fleet (``gpuagent-sim``, fixed seeds) backfills ``--hours``, each in ``--slices`` parts, one
part at a time into a real collector (in-process, real gRPC on loopback, a fresh DuckDB file). After each
part the writer thread checkpoints, and the bytes that checkpoint wrote are read from the process's
``wchar`` (/proc/self/io; every file write of the process in that time, so an upper bound). Reported per
part: the Arrow bytes committed since the previous checkpoint (``SpaceCheck.pending``), the WAL's size,
and the checkpoint's writes; and the largest ratios and excesses over the run.

    python benchmarks/checkpoint_space.py --gpus 8 --batch-s 600 --hours 6 --json   # large commits
    python benchmarks/checkpoint_space.py --gpus 4 --batch-s 60 --hours 3 --json    # small commits
    python benchmarks/checkpoint_space.py --gpus 4 --batch-s 60 --hours 2 --slices 12 --json  # small checkpoints
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from gpuagent.collector.service import start_collector
from gpuagent.sim.run import SimConfig, run_sim

MIB = 2**20
END_NS = 1_790_000_000 * 10**9 // (3600 * 10**9) * (3600 * 10**9)


def _wchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("wchar:")).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--batch-s", type=float, default=600.0)
    ap.add_argument("--hours", type=int, default=6)
    ap.add_argument("--slices", type=int, default=1, help="parts per hour, a checkpoint after each")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-space-") as tmp:
        db = os.path.join(tmp, "c.duckdb")
        handle = start_collector(db, analyze=False)
        space = handle.writer.space
        rows = []
        try:
            for part in range(args.hours * args.slices):
                span_ns = 3600 * 10**9 // args.slices
                run_sim(SimConfig(collector=handle.address, nodes=args.nodes, gpus=args.gpus,
                                  sim_hours=1.0 / args.slices, interval_s=1.0, batch_s=args.batch_s, seed=part,
                                  streams=args.nodes, prefix="ck", end_ns=END_NS + (part + 1) * span_ns))

                def checkpoint(con):
                    pending, wal = space.pending, os.path.getsize(db + ".wal") if os.path.exists(db + ".wal") else 0
                    before = _wchar()
                    con.execute("CHECKPOINT")
                    return pending, wal, _wchar() - before

                pending, wal, wrote = handle.writer.call(checkpoint).result()
                rows.append({"part": part, "pending_arrow_mib": round(pending / MIB, 2), "wal_mib": round(wal / MIB, 2),
                             "checkpoint_wrote_mib": round(wrote / MIB, 2)})
        finally:
            handle.stop()
    with_pending = [r for r in rows if r["pending_arrow_mib"] > 0]
    out = {"synthetic": True, "nodes": args.nodes, "gpus": args.gpus, "batch_s": args.batch_s, "hours": rows,
           "max_wal_over_arrow": max((r["wal_mib"] / r["pending_arrow_mib"] for r in with_pending), default=None),
           "max_checkpoint_over_arrow": max((r["checkpoint_wrote_mib"] / r["pending_arrow_mib"]
                                             for r in with_pending), default=None),
           "max_checkpoint_mib": max(r["checkpoint_wrote_mib"] for r in rows),
           # what the checkpoint wrote beyond 2.5 times the pending Arrow bytes (the fixed part)
           "max_checkpoint_minus_2_5_arrow_mib": max(round(r["checkpoint_wrote_mib"] - 2.5 * r["pending_arrow_mib"], 2)
                                                     for r in rows)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            print(r)
        print({k: v for k, v in out.items() if k.startswith("max")})


if __name__ == "__main__":
    main()
