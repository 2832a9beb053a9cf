#!/usr/bin/env python3
"""The agent's cost with the cheap fabric layer (path probes) on and off, in one run (issue 43).

A real collector runs in this process with [fabric] on and pinglists every ``--epoch-s`` (no net_pair
sweeps). Seven peers run in this process too, each the agent's own parts: a FabricClient holding a real
Assignments stream, a PathResponder and a PathProber, on 127.0.0.1. The measured node is the real daemon
(``gpuagent run``, probes off, the NVML emulator under the real pynvml as in benchmarks/agent_overhead.py)
with ``[fabric] enabled`` on 127.0.0.1 and ``paths`` on or off. With 8 nodes in one scope and the epoch
equal to the cover time, every node probes all 7 others once an epoch and answers 7: at the default
``--epoch-s 4`` that is 1.75 probes a second each way, the rate of a node in a 1,000-node pool at the
shipped defaults (docs/FABRIC.md: 100 probes a minute).

Windows alternate on, off, on, off (``--rounds`` each), a fresh agent each, ``--warmup`` then
``--duration`` seconds, /proc read once a second: CPU as % of one core over the window, peak RSS
(VmHWM) and median RSS. Reported: the median of each and their difference, and the probes the
agent sent and answered (from its status file). The peers' and the collector's CPU run on the same cores,
so the machine is loaded alike in both kinds of window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_overhead import Watch, emulated_node  # noqa: E402

from gpuagent import local_run  # noqa: E402
from gpuagent.agent.probing.fabric import FabricClient  # noqa: E402
from gpuagent.agent.probing.paths import PathProber, PathResponder  # noqa: E402
from gpuagent.collector.fabric.coordinator import FabricConfig  # noqa: E402
from gpuagent.collector.service import start_collector  # noqa: E402
from gpuagent.proto import pb, pb_grpc  # noqa: E402


class Sink:
    def __init__(self):
        self.n = 0

    def probe_result(self, _rec):
        self.n += 1


def start_peers(address: str, n: int) -> list:
    parts = []
    for i in range(n):
        resp = PathResponder("127.0.0.1").start()
        ch = grpc.insecure_channel(address)
        info = pb.NodeInfo(hostname=f"pathpeer-{i}", machine_id=f"{0xfeed0000 + i:032x}",
                           agent_version="path_overhead peer", labels={"pool": "bench"},
                           fabric_address="127.0.0.1", path_port=resp.port)
        node_id = pb_grpc.CollectorStub(ch).Register(pb.RegisterRequest(node=info), timeout=30).node_id
        sink = Sink()
        client = FabricClient(ch, lambda nid=node_id: nid, "127.0.0.1", sink)
        client.paths = PathProber(lambda nid=node_id: nid, sink, address="127.0.0.1", responder=resp).start()
        client.start()
        parts.append((resp, client, ch))
    return parts


def window(address: str, tmp: Path, args, name: str, paths: bool) -> dict:
    cfg = tmp / f"agent-{name}.toml"
    cfg.write_text("[probes]\nenabled = false\n[labels]\npool = \"bench\"\n"
                   f"[fabric]\nenabled = true\naddress = \"127.0.0.1\"\npaths = {'true' if paths else 'false'}\n")
    agent = local_run.start_agent(address, tmp / f"state-{name}", tmp / f"agent-{name}.log", interval=1.0,
                                  batch_interval=5.0, extra_args=("--config", str(cfg)),
                                  extra_env={"GPUAGENT_JOBS_SOCKET": str(tmp / f"jobs-{name}.sock"), **args.env})
    try:
        time.sleep(args.warmup)
        w = Watch(agent.pid)
        w.start()
        t_end = time.monotonic() + args.duration
        nxt = time.monotonic()
        while time.monotonic() < t_end:
            w.tick()
            nxt += 1.0
            time.sleep(max(0.0, nxt - time.monotonic()))
        w.end()
        status = json.loads((tmp / f"state-{name}" / "status.json").read_text())
    finally:
        local_run.stop_process(agent)
    r = w.result("agent")
    fab = (status.get("fabric") or {})
    p = fab.get("paths") or {}
    return {"paths": paths, "cpu_percent": r["agent_cpu_percent"], "rss_bytes": r["agent_rss_bytes"],
            "rss_steady_bytes": r["agent_rss_steady_bytes"], "path_status": p}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=12.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epoch-s", type=float, default=4.0)
    ap.add_argument("--peers", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="path_overhead.") as d:
        tmp = Path(d)
        args.env = emulated_node(tmp)
        fab = FabricConfig(enabled=True, path_epoch_s=args.epoch_s, path_cover_s=args.epoch_s,
                           path_max_probes_per_s=10.0)
        handle = start_collector(tmp / "c.duckdb", "127.0.0.1:0", analyze=False, fabric=fab, fabric_rounds=False)

        async def paths_on():
            handle.fabric.paths.start()
        handle.grpc.run_on_loop(paths_on())
        peers = start_peers(handle.address, args.peers)
        windows = []
        try:
            for r in range(args.rounds):
                for on in (True, False):
                    windows.append(window(handle.address, tmp, args, f"{'on' if on else 'off'}{r}", on))
                    print(f"window paths={'on' if on else 'off'}: cpu {windows[-1]['cpu_percent']:.3f} %, "
                          f"rss {windows[-1]['rss_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        finally:
            for resp, client, ch in peers:
                client.stop()
                if client.paths:
                    client.paths.stop()
                resp.close()
                ch.close()
            handle.stop()

    def med(on, key):
        return statistics.median(w[key] for w in windows if w["paths"] == on)
    out = {"benchmark": "path_overhead", "epoch_s": args.epoch_s, "peers": args.peers,
           "probes_per_s_each_way": args.peers / args.epoch_s, "duration_s": args.duration, "rounds": args.rounds,
           "cpu_percent_on": med(True, "cpu_percent"), "cpu_percent_off": med(False, "cpu_percent"),
           "rss_bytes_on": med(True, "rss_bytes"), "rss_bytes_off": med(False, "rss_bytes"),
           "rss_steady_bytes_on": med(True, "rss_steady_bytes"), "rss_steady_bytes_off": med(False, "rss_steady_bytes"),
           "load_avg_end": os.getloadavg(), "windows": windows}
    out["cpu_percent_added"] = round(out["cpu_percent_on"] - out["cpu_percent_off"], 3)
    out["rss_bytes_added"] = out["rss_bytes_on"] - out["rss_bytes_off"]
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda a: print(f"thread {a.thread.name}: {a.exc_value}", file=sys.stderr)
    sys.exit(main())
