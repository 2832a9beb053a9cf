#!/usr/bin/env python3
"""net_pair against iperf3 (Debian) between the same two namespaces of the testbed (root needed).

Same path, same parallel streams, same write size (128 KiB, iperf3's default), same measured seconds
after the same warm-up (iperf3 --omit). Both figures are the receiver's: net_pair counts delivered
bytes at the receiving end, and iperf3's ``end.sum_received`` is the server's count. Directions:
  send = connecting node -> listening node (iperf3 client -> server),
  recv = listening node -> connecting node (iperf3 -R).
net_pair runs one process per stream, so the verdict's reference is iperf3 with the same concurrency
model: one client/server process pair per stream, side by side, summed (Debian's iperf3 3.12 runs all
-P streams in one thread; 3.16+ uses a thread per stream). A single-process ``-P streams`` iperf3 is
printed beside it: where the CPU, not the path, is the limit, it reads lower.
Runs are interleaved (iperf3 first in even rounds, net_pair first in odd ones) and medians compared;
target ratio 0.9-1.1. Done unthrottled (CPU-bound: veth throughput is memory copies, so on a shared
machine the spread is wide) and with a tbf node throttle (default 200 mbit) on the listening node,
which shapes both directions.

With ``--part collective`` (or ``all``): the collective probe across two namespaces (gloo on CPU, nnodes=2,
``--coll-nprocs`` ranks per node, one message size, busbw by the nccl-tests formula) against a plain
torch.distributed loop (benchmarks/allreduce_loop.py) with the same ranks, size, warm-up and iteration
counts across the same namespaces; rounds interleaved (probe first in even rounds), medians compared,
target ratio 0.9-1.1. Gloo binds eth0 in each namespace (GLOO_SOCKET_IFNAME). Prints JSON with --json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = (0.9, 1.1)
IPERF_PORT = 5299


def _netns_fleet():
    spec = importlib.util.spec_from_file_location("netns_fleet", ROOT / "scripts" / "netns_fleet.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["netns_fleet"] = mod
    spec.loader.exec_module(mod)
    return mod


def _iperf3(fleet, client: str, server: str, reverse: bool, processes: int, args) -> float:
    """iperf3's receiver figure in Gbit/s for one run: ``processes`` client/server pairs side by side,
    carrying args.streams streams between them (1 process: -P streams; else -P 1 each), summed."""
    ip = fleet.node(server).ip
    ports = [IPERF_PORT + i for i in range(processes)]
    per_proc = args.streams // processes
    servers = [fleet.popen(server, ["iperf3", "-s", "-1", "-B", ip, "-p", str(p)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    try:
        deadline = time.monotonic() + 10
        while fleet.exec(server, ["ss", "-ltnH", f"sport >= :{ports[0]} and sport <= :{ports[-1]}"]
                         ).stdout.count("LISTEN") < processes:
            if time.monotonic() > deadline or any(s.poll() is not None for s in servers):
                raise RuntimeError("the iperf3 servers did not start listening")
            time.sleep(0.05)
        clients = [fleet.popen(client, ["iperf3", "-c", ip, "-p", str(p), "-t", f"{args.duration + args.warmup:g}",
                                        "-O", f"{args.warmup:g}", "-P", str(per_proc), "-l", "128K", "-J"]
                               + (["-R"] if reverse else []), stdout=subprocess.PIPE, text=True)
                   for p in ports]
        total = 0.0
        for c in clients:
            out, _ = c.communicate(timeout=args.duration * 3 + 60)
            data = json.loads(out)
            if "error" in data:
                raise RuntimeError(f"iperf3: {data['error']}")
            total += data["end"]["sum_received"]["bits_per_second"] / 1e9
        return total
    finally:
        for srv in servers:
            try:
                srv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()


def _net_pair(fleet, client: str, server: str, args) -> dict:
    res = fleet.net_pair(client, server, duration=args.duration, warmup=args.warmup, streams=args.streams,
                         chunk_kib=128, rtt_count=args.rtt_count)
    if res["status"] != "ok":
        raise RuntimeError(f"net_pair {res['status']}: {res['reason']}")
    return res["metrics"]


REFS = {"iperf3": "streams", "iperf3_one_process": 1}   # reference -> client processes ("streams": one each)


def _compare(fleet, args, label: str) -> dict:
    runs = {name: {"send": [], "recv": []} for name in ("net_pair", *REFS)}
    rtt = []
    for r in range(args.rounds):
        steps = ["iperf3", "net_pair"] if r % 2 == 0 else ["net_pair", "iperf3"]
        for step in steps:
            if step == "iperf3":
                for ref, procs in REFS.items():
                    n = args.streams if procs == "streams" else procs
                    runs[ref]["send"].append(_iperf3(fleet, "n0", "n1", False, n, args))
                    runs[ref]["recv"].append(_iperf3(fleet, "n0", "n1", True, n, args))
            else:
                m = _net_pair(fleet, "n0", "n1", args)
                runs["net_pair"]["send"].append(m["send_gbits_per_s"])
                runs["net_pair"]["recv"].append(m["recv_gbits_per_s"])
                rtt.append(m["rtt_p50_us"])
        print(f"{label}: round {r + 1}/{args.rounds} done", file=sys.stderr)
    out: dict = {"rtt_p50_us_median": round(statistics.median(rtt), 1)}
    for d in ("send", "recv"):
        med = {name: statistics.median(v[d]) for name, v in runs.items()}
        ratio = med["net_pair"] / med["iperf3"]
        out[d] = {"net_pair_median_gbits_per_s": round(med["net_pair"], 4),
                  "iperf3_median_gbits_per_s": round(med["iperf3"], 4),
                  "ratio": round(ratio, 3), "within_target": TARGET[0] <= ratio <= TARGET[1],
                  "iperf3_one_process_median_gbits_per_s": round(med["iperf3_one_process"], 4),
                  "ratio_vs_one_process": round(med["net_pair"] / med["iperf3_one_process"], 3),
                  "runs": {name: [round(x, 4) for x in v[d]] for name, v in runs.items()}}
    return out


_port = [29600]


def _next_port() -> int:
    """A fresh rendezvous port per run, so one run's sockets in TIME_WAIT never meet the next."""
    _port[0] += 1
    return _port[0]


def _wait_all(procs: list, timeout: float) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError("a collective run did not finish in time") from None
        if p.returncode != 0:
            raise RuntimeError(f"a collective rank exited with {p.returncode}")
        outs.append(out)
    return outs


def _coll_env() -> dict:
    return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}


def _collective_probe(fleet, args) -> float:
    """busbw (GB/s) the collective probe reports, run as two nodes (n0 rank 0, n1 rank 1)."""
    port, master = _next_port(), fleet.node("n0").ip
    params = {"backend": "gloo", "nprocs": args.coll_nprocs, "nnodes": 2, "master_addr": master,
              "master_port": port, "min_bytes": args.coll_bytes, "max_bytes": args.coll_bytes,
              "iters": args.coll_iters, "warmup": args.coll_warmup, "latency_iters": 10}
    procs = []
    for rank, node in enumerate(("n0", "n1")):
        argv = [sys.executable, "-m", "gpuagent.probes", "collective", "--json"]
        for k, v in {**params, "node_rank": rank}.items():
            argv += ["--param", f"{k}={v}"]
        procs.append(fleet.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 env=_coll_env(), cwd=ROOT))
    outs = _wait_all(procs, 300)
    res = json.loads(outs[0])
    if res["status"] != "ok":
        raise RuntimeError(f"collective probe {res['status']}: {res['reason']}")
    assert res["env"]["world_size"] == 2 * args.coll_nprocs and res["env"]["nnodes"] == 2
    return res["metrics"]["busbw_gbps"]


def _collective_plain(fleet, args) -> float:
    """busbw (GB/s) of the plain torch.distributed loop with the same ranks across the same namespaces."""
    port, master = _next_port(), fleet.node("n0").ip
    world = 2 * args.coll_nprocs
    env = {**_coll_env(), "MASTER_ADDR": master, "MASTER_PORT": str(port)}
    procs = []
    for node_rank, node in enumerate(("n0", "n1")):
        for local in range(args.coll_nprocs):
            procs.append(fleet.popen(node, [sys.executable, str(ROOT / "benchmarks" / "allreduce_loop.py"),
                                            "--rank", str(node_rank * args.coll_nprocs + local), "--world", str(world),
                                            "--nbytes", str(args.coll_bytes), "--iters", str(args.coll_iters),
                                            "--warmup", str(args.coll_warmup)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT))
    outs = _wait_all(procs, 300)
    return json.loads(outs[0])["busbw_gbps"]


def _compare_collective(fleet, args) -> dict:
    runs = {"probe": [], "plain": []}
    for r in range(args.coll_rounds):
        order = ("probe", "plain") if r % 2 == 0 else ("plain", "probe")
        for which in order:
            runs[which].append((_collective_probe if which == "probe" else _collective_plain)(fleet, args))
        print(f"collective: round {r + 1}/{args.coll_rounds} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["probe"] / med["plain"]
    world = 2 * args.coll_nprocs
    return {"settings": {"nodes": 2, "ranks_per_node": args.coll_nprocs, "world": world, "bytes": args.coll_bytes,
                         "iters": args.coll_iters, "warmup": args.coll_warmup, "rounds": args.coll_rounds,
                         "busbw_factor": round(2 * (world - 1) / world, 4)},
            "probe_busbw_median_gbps": round(med["probe"], 4), "plain_busbw_median_gbps": round(med["plain"], 4),
            "ratio": round(ratio, 3), "within_target": TARGET[0] <= ratio <= TARGET[1],
            "runs": {k: [round(x, 4) for x in v] for k, v in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9,
                    help="interleaved rounds (unshaped runs on a shared 2-core VM spread by +-10 %%; nine keep "
                         "the median steady)")
    ap.add_argument("--duration", type=float, default=3.0, help="measured seconds per direction")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds left out first (iperf3 --omit)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rtt-count", type=int, default=1000)
    ap.add_argument("--throttle", default="200mbit", help="tbf rate for the throttled part ('' to skip)")
    ap.add_argument("--part", choices=("net_pair", "collective", "all"), default="all")
    ap.add_argument("--coll-rounds", type=int, default=5)
    ap.add_argument("--coll-nprocs", type=int, default=1, help="collective ranks per namespace")
    ap.add_argument("--coll-bytes", type=int, default=16 << 20, help="all-reduce message size")
    ap.add_argument("--coll-iters", type=int, default=20)
    ap.add_argument("--coll-warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    nf = _netns_fleet()
    why = nf.unavailable_reason()
    if not why and args.part != "collective" and not shutil.which("iperf3"):
        why = "iperf3 is not installed (apt-get install iperf3)"
    if why:
        print(json.dumps({"skipped": why}))
        return 1
    t0 = time.monotonic()
    result: dict = {"target_ratio": list(TARGET)}
    with nf.Fleet.up(2) as fleet:
        if args.part in ("collective", "all"):
            result["collective_gloo_cross_node"] = _compare_collective(fleet, args)
        if args.part in ("net_pair", "all"):
            result.update({"settings": {"rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
                                        "streams": args.streams, "write_bytes": 128 * 1024},
                           "iperf3_version": subprocess.run(["iperf3", "--version"], capture_output=True,
                                                            text=True).stdout.split("\n")[0].strip(),
                           "unthrottled": _compare(fleet, args, "unthrottled")})
            if args.throttle:
                fleet.throttle_node("n1", args.throttle)
                result[f"throttled_{args.throttle}"] = _compare(fleet, args, f"throttled {args.throttle}")
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
