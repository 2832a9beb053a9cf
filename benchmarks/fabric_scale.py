#!/usr/bin/env python3
"""Fabric at fleet scale (issue 43): how long a bad node and a bad link take to be flagged by the cheap layer.

For each fleet size and seed, a SYNTHETIC fleet (pools of ``--pool-size`` nodes) registers with a real collector
in this process (collector/service.start_collector, gRPC on loopback, a real DuckDB file, the default 512 MB
memory limit, no scheduled analysis), and epoch by epoch its path-probe results (sim/paths.py: the collector's
pinglist planner, the agent's suspect rule, drawn readings) arrive over the real Stream RPC. After each epoch's
results are stored, one real analysis pass runs on the collector's writer with ``now`` = that epoch's end plus
``--report-delay-s``, passes 60 s apart as the collector schedules them. One node goes bad (its NIC at a
tenth of the rate) and one link goes bad (slow in even seeds, lossy in odd ones) at random times after the
references have formed; a fault takes effect from the first epoch that starts after it (readings within the
epoch it starts in are not affected, so the times below are pessimistic by up to one epoch).

Reported per fleet size: time from each fault to its first flag (median and max over seeds), node and link
recall, the false-positive rate (healthy nodes with a node_paths or a wrong link_paths flag at any pass,
over healthy nodes), the probe cost per node (datagrams/s and bytes/s each way, echoes included), the
pinglist cycle, and the analysis pass and path step times. JSON with ``--json``. SYNTHETIC throughout.

    .venv/bin/python benchmarks/fabric_scale.py --nodes 1000,10000 --seeds 5 --json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.service import start_collector
from gpuagent.common import path_planner
from gpuagent.common.retry import STREAM_METHOD
from gpuagent.proto import pb, pb_grpc
from gpuagent.sim.paths import PathFleetSim

NS = 1_000_000_000


async def _register(address: str, hosts: list[tuple[str, str]]) -> dict[str, str]:
    """{hostname: node id} for (hostname, pool) pairs, through the Register RPC."""
    out: dict[str, str] = {}
    sem = asyncio.Semaphore(64)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.CollectorStub(ch)

        async def one(i: int, host: str, pool: str):
            info = pb.NodeInfo(hostname=host, machine_id=f"{i:032x}", agent_version="fabric-scale (SYNTHETIC)",
                               labels={"pool": pool, "synthetic": "true"}, os="gpuagent fabric_scale (SYNTHETIC)",
                               fabric_address=f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", path_port=42099)
            async with sem:
                resp = await stub.Register(pb.RegisterRequest(node=info), timeout=120)
            out[host] = resp.node_id

        await asyncio.gather(*(one(i, h, p) for i, (h, p) in enumerate(hosts)))
    return out


async def _send(address: str, batches: list[bytes]) -> None:
    """Each encoded batch on its own Stream call (an agent's next batch), 64 at a time, until acked."""
    sem = asyncio.Semaphore(64)
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stream = ch.stream_stream(STREAM_METHOD, request_serializer=None, response_deserializer=pb.Ack.FromString)

        async def one(data: bytes):
            async def req():
                yield data
            async with sem:
                async for _ack in stream(req(), timeout=120):
                    pass

        await asyncio.gather(*(one(b) for b in batches))


def _open_path_flags(con) -> list[tuple]:
    return con.execute("SELECT node_id, component, evidence FROM flags WHERE state = 'open' AND kind = "
                       "'network_degraded' AND component IN ('node_paths', 'link_paths')").fetchall()


def run_one(n: int, seed: int, pool_size: int, report_delay_s: float, workdir: Path) -> dict:
    rng = random.Random(seed)
    hosts = [(f"synpath-{i:05d}", f"pool-{i // pool_size:03d}") for i in range(n)]
    db = workdir / f"fabric_scale_{n}_{seed}.duckdb"
    handle = start_collector(db, "127.0.0.1:0", analyze=False)
    try:
        ids = asyncio.run(_register(handle.address, hosts))
        labels = {ids[h]: {"pool": p} for h, p in hosts}
        plan = path_planner.PathPlanSettings(seed=seed)
        sim = PathFleetSim(labels, plan=plan, seed=seed)
        cycle = max(path_planner.cycle_epochs(len(m), plan)
                    for m in path_planner.scopes(labels, "pool").values())
        onset_epochs = (6, 12)
        epochs = onset_epochs[1] + cycle + 6
        epoch_ns = int(plan.epoch_s * NS)
        t0 = (time.time_ns() // epoch_ns - epochs - 1) * epoch_ns
        # the faults: a bad node, and a bad link between two other nodes of one pool
        pool_of = {ids[h]: p for h, p in hosts}
        by_pool: dict[str, list[str]] = {}
        for node, pool in pool_of.items():
            by_pool.setdefault(pool, []).append(node)
        bad_node = rng.choice(sorted(pool_of))
        link_pool = rng.choice(sorted(by_pool))
        a, b = rng.sample(sorted(x for x in by_pool[link_pool] if x != bad_node), 2)
        how = "slow" if seed % 2 == 0 else "lossy"
        node_onset = t0 + int(rng.uniform(*onset_epochs) * epoch_ns)
        link_onset = t0 + int(rng.uniform(*onset_epochs) * epoch_ns)
        sim.bad_nodes[bad_node] = node_onset
        sim.bad_links[frozenset((a, b))] = (link_onset, how)
        seqs = {node: 0 for node in labels}
        cfg = A.AnalyzerConfig()
        analyzer = A.Analyzer(cfg)
        found: dict[str, float] = {}
        false_nodes: set[str] = set()
        pass_s, step_s, ingest_s, gen_s = [], [], [], []
        after_both = 0
        for e in range(epochs):
            start = t0 + e * epoch_ns
            w0 = time.monotonic()
            results = sim.epoch(e, start)
            batches = []
            for node, res in results.items():
                seqs[node] += 1
                batches.append(pb.Batch(node_id=node, seq=seqs[node], created_ns=start + epoch_ns,
                                        probe_results=res).SerializeToString())
            w1 = time.monotonic()
            asyncio.run(_send(handle.address, batches))
            w2 = time.monotonic()
            gen_s.append(w1 - w0)
            ingest_s.append(w2 - w1)
            now_ns = start + epoch_ns + int(report_delay_s * NS)
            now = dt.datetime.fromtimestamp(now_ns / NS, dt.timezone.utc).replace(tzinfo=None)
            res = handle.writer.call(lambda con, _now=now: analyzer.run_pass(con, _now)).result()
            pass_s.append(res.total_s)
            step_s.append(res.step_s.get("62_path_tomography.sql", float("nan")))
            flags = handle.writer.call(_open_path_flags).result()
            for node, comp, ev in flags:
                if comp == "node_paths":
                    if node == bad_node:
                        found.setdefault("node", (now_ns - node_onset) / NS)
                    else:
                        false_nodes.add(node)
                else:
                    pair = set(json.loads(ev).get("pair", []))
                    if pair == {a, b}:
                        found.setdefault("link", (now_ns - link_onset) / NS)
                    elif bad_node not in pair:
                        false_nodes.update(pair)
                    else:
                        false_nodes.update(pair - {bad_node})
            if len(found) == 2:
                after_both += 1
                if after_both > 3:
                    break
        stats = dict(sim.stats)
        span_s = (e + 1) * plan.epoch_s
        return {"nodes": n, "seed": seed, "link_fault": how, "cycle_epochs": cycle, "epochs_run": e + 1,
                "node_s": found.get("node"), "link_s": found.get("link"),
                "false_positive_nodes": len(false_nodes), "healthy_nodes": n - 1,
                "pass_s_median": statistics.median(pass_s), "pass_s_max": max(pass_s),
                "path_step_s_median": statistics.median(step_s),
                "ingest_s_median": statistics.median(ingest_s), "generate_s_median": statistics.median(gen_s),
                "datagrams_per_s_per_node": stats["datagrams_sent"] / n / span_s,
                "bytes_per_s_per_node": stats["bytes_sent"] / n / span_s,
                "probes_per_s_per_node": stats["probes"] / n / span_s,
                "suspect_rows": stats["suspects"], "db_bytes": db.stat().st_size}
    finally:
        handle.stop()


def summarise(runs: list[dict]) -> dict:
    node = [r["node_s"] for r in runs if r["node_s"] is not None]
    link = [r["link_s"] for r in runs if r["link_s"] is not None]
    med = lambda xs: statistics.median(xs) if xs else None   # noqa: E731
    fp = sum(r["false_positive_nodes"] for r in runs)
    healthy = sum(r["healthy_nodes"] for r in runs)
    bps = med([r["bytes_per_s_per_node"] for r in runs])
    return {
        "nodes": runs[0]["nodes"], "seeds": len(runs), "cycle_s": runs[0]["cycle_epochs"] * 60,
        "node_detect_s_median": med(node), "node_detect_s_max": max(node) if node else None,
        "link_detect_s_median": med(link), "link_detect_s_max": max(link) if link else None,
        "node_recall": len(node) / len(runs), "link_recall": len(link) / len(runs),
        "false_positive_rate": fp / healthy if healthy else 0.0,
        "probes_per_s_per_node": med([r["probes_per_s_per_node"] for r in runs]),
        # each datagram comes back as its echo: the figures are per direction
        "datagrams_per_s_per_node": med([r["datagrams_per_s_per_node"] for r in runs]),
        "bytes_per_s_per_node": bps,
        "share_of_25gbe": bps * 8 / 25e9 if bps else None,
        "pass_s_median": med([r["pass_s_median"] for r in runs]),
        "pass_s_max": max(r["pass_s_max"] for r in runs),
        "path_step_s_median": med([r["path_step_s_median"] for r in runs]),
        "ingest_s_per_epoch_median": med([r["ingest_s_median"] for r in runs]),
        "synthetic": True,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="1000,10000", help="fleet sizes, comma separated")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--pool-size", type=int, default=1000)
    ap.add_argument("--report-delay-s", type=float, default=15.0,
                    help="from an epoch's end to the pass that reads it (batch delay plus pass phase)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dir", help="keep the databases here")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.nodes.split(",") if x.strip()]
    out = {"benchmark": "fabric_scale", "synthetic": True, "sizes": [], "runs": []}
    with tempfile.TemporaryDirectory(prefix="fabric_scale.") as tmp:
        work = Path(args.dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            runs = []
            for seed in range(args.seeds):
                r = run_one(n, seed, args.pool_size, args.report_delay_s, work)
                runs.append(r)
                print(f"SYNTHETIC n={n} seed={seed}: node {r['node_s']} s, link ({r['link_fault']}) {r['link_s']} s, "
                      f"false-positive nodes {r['false_positive_nodes']}, pass {r['pass_s_median']:.2f} s",
                      file=sys.stderr, flush=True)
            out["runs"].extend(runs)
            out["sizes"].append(summarise(runs))
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
