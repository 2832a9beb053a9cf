"""How fast gpuagent-sim produces SYNTHETIC load, and whether it or the collector is the bottleneck.

1. Generation alone: NodeSim builds and encodes one node-hour at 1 s (8 GPUs, full metric set) several
   times; the median seconds per node-hour give the sim's samples/s on one core.
2. End to end: a real collector (subprocess, DuckDB file in a temp dir) and run_sim in this process over
   loopback. Reported: wall time, acked samples/s, the sim's own CPU seconds, and the ratio of the sim's
   generation rate to the end-to-end rate (>1: the collector is the bottleneck, not the sim).

Figures are indicative on a shared machine. Usage: python benchmarks/sim_throughput.py [--nodes 50]
[--sim-hours 0.25] [--json].
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

from gpuagent import local_run
from gpuagent.sim.run import SimConfig, run_sim
from gpuagent.sim.data import NS, NodeSim, SimTiming
from gpuagent.sim.fleet import scenario_fleet


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def generation(nodes: int, gpus: int, gpu_metrics: str) -> dict:
    end = (time.time_ns() // NS) * NS
    timing = SimTiming(start_ns=end - 3600 * NS, end_ns=end, gpu_metrics=gpu_metrics)
    per_node, samples = [], 0
    for node in scenario_fleet("mixed", nodes, seed=1, gpu_count=gpus):
        t0 = time.perf_counter()
        sim = NodeSim(node, timing, seed=1)
        n = sum(sim.encode("bench", i + 1, w, end).n_samples for i, w in enumerate(sim.windows()))
        per_node.append(time.perf_counter() - t0)
        samples = n
    med = statistics.median(per_node)
    return {"node_hours": nodes, "median_s_per_node_hour": round(med, 4),
            "samples_per_node_hour": samples, "samples_per_s": round(samples / med),
            "extrapolated_s_for_1000_nodes_x_1h": round(1000 * med, 1)}


def end_to_end(nodes: int, sim_hours: float, gpus: int, gpu_metrics: str, procs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="simbench-") as tmp:
        port = local_run.free_port()
        log = Path(tmp) / "collector.log"
        proc = local_run.start_collector(Path(tmp) / "bench.duckdb", port, log)
        try:
            local_run.wait_port(port, proc, log)
            cfg = SimConfig(collector=f"127.0.0.1:{port}", nodes=nodes, sim_hours=sim_hours, gpus=gpus,
                            gpu_metrics=gpu_metrics, procs=procs)
            cpu0 = _cpu_s()
            s = run_sim(cfg)
            cpu = _cpu_s() - cpu0
        finally:
            local_run.stop_process(proc, timeout=60)
    return {"nodes": nodes, "gpus_per_node": gpus, "sim_hours": sim_hours, "nodes_ok": s.nodes_ok,
            "samples": s.samples, "batches": s.batches_acked, "wall_s": round(s.wall_s, 2),
            "samples_per_s": round(s.samples_per_s), "sim_cpu_s": round(cpu, 2) if procs == 1 else None,
            "sim_cpu_share_of_wall": round(cpu / s.wall_s, 3) if procs == 1 and s.wall_s else None,
            "errors": s.errors[:3]}


@click.command()
@click.option("--nodes", type=int, default=50, show_default=True, help="end-to-end fleet size")
@click.option("--sim-hours", type=float, default=0.25, show_default=True)
@click.option("--gpus", type=int, default=8, show_default=True)
@click.option("--gpu-metrics", type=click.Choice(["full", "util"]), default="full", show_default=True)
@click.option("--procs", type=int, default=1, show_default=True)
@click.option("--gen-nodes", type=int, default=10, show_default=True, help="node-hours for the generation part")
@click.option("--skip-e2e", is_flag=True, help="measure generation only")
@click.option("--json", "as_json", is_flag=True)
def main(nodes, sim_hours, gpus, gpu_metrics, procs, gen_nodes, skip_e2e, as_json):
    out = {"benchmark": "sim_throughput", "synthetic": True,
           "generation": generation(gen_nodes, gpus, gpu_metrics)}
    if not skip_e2e:
        e2e = end_to_end(nodes, sim_hours, gpus, gpu_metrics, procs)
        out["end_to_end"] = e2e
        if e2e["samples_per_s"]:
            out["generation_to_end_to_end_ratio"] = round(out["generation"]["samples_per_s"] / e2e["samples_per_s"], 1)
    if as_json:
        print(json.dumps(out, indent=2))
        return
    g = out["generation"]
    print(f"SYNTHETIC load generation: {g['median_s_per_node_hour']} s per node-hour (median of {gen_nodes}), "
          f"{g['samples_per_s']:,} samples/s on one core; 1000 nodes x 1 h ~ {g['extrapolated_s_for_1000_nodes_x_1h']} s")
    if "end_to_end" in out:
        e = out["end_to_end"]
        print(f"end to end: {e['nodes_ok']}/{e['nodes']} nodes, {e['samples']:,} samples in {e['wall_s']} s "
              f"({e['samples_per_s']:,}/s acked); sim CPU {e['sim_cpu_s']} s; generation/end-to-end = "
              f"{out.get('generation_to_end_to_end_ratio')}x")


if __name__ == "__main__":
    sys.exit(main())
