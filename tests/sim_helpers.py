"""A small SYNTHETIC fleet stored by the real collector (subprocess, DuckDB file, loopback gRPC), shared by
the compare and report tests. Built once per test session (a cache in this module)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conftest import free_port
from gpuagent import local_run
from gpuagent.collector.views.compare import run_compare
from gpuagent.collector.views.report import write_report
from gpuagent.sim.run import SimConfig, SimSummary, run_sim
from gpuagent.sim.fleet import NodeSpec, validate

TOKEN = "sim-test-token"

# 3 healthy bare-metal nodes (the baseline), 3 cloud-a nodes with slower PCIe copies (one also noisy),
# 2 cloud-b nodes: one idle half of the time, one input-bound.
FLEET_SPEC = [
    ("bare-metal", False, 2.2, {}),
    ("bare-metal", False, 2.2, {}),
    ("bare-metal", False, 2.2, {}),
    ("cloud-a", True, 3.9, {"virt_penalty_h2d": 20, "virt_penalty_d2h": 20}),
    ("cloud-a", True, 3.9, {"virt_penalty_h2d": 20, "virt_penalty_d2h": 20}),
    ("cloud-a", True, 3.9, {"virt_penalty_h2d": 20, "virt_penalty_d2h": 20, "noise_cv": 0.3}),
    ("cloud-b", True, 2.9, {"idle_fraction": 0.5}),
    ("cloud-b", True, 2.9, {"input_bound_fraction": 0.45}),
]
GPUS = 4
# With fabric=True (the shared fleet database): cloud-a's links run at 0.6 x the 25 Gbit/s of the others,
# and the path between sim-0001 and sim-0002 (bare metal) at 0.3 x.
FABRIC_SWEEPS, FABRIC_GBITS, CLOUD_A_NET, BAD_LINK = 3, 25.0, 0.6, ("sim-0001", "sim-0002", 0.3)


def fleet(fabric: bool = False) -> list[NodeSpec]:
    out = []
    for i, (pool, virt, price, inject) in enumerate(FLEET_SPEC):
        host, labels = f"sim-{i + 1:04d}", {}
        if fabric and pool == "cloud-a":
            inject = {**inject, "net_factor": CLOUD_A_NET}
        if fabric and host == BAD_LINK[0]:
            labels = {"inject_net_links": f"{BAD_LINK[1]}:{BAD_LINK[2]}"}
        out.append(validate(NodeSpec(i, host, pool, virt, gpu_count=GPUS, price_per_gpu_hour=price,
                                     provider=pool, inject=inject, extra_labels=labels)))
    return out


@dataclass
class FleetDb:
    db: Path
    summary: SimSummary
    fleet: list[NodeSpec]
    compare_via_target_json: str
    report_via_target: Path


_CACHE: dict[str, FleetDb] = {}


def fleet_db(tmp_path_factory) -> FleetDb:
    if "fleet" in _CACHE:
        return _CACHE["fleet"]
    tmp = tmp_path_factory.mktemp("simfleet")
    db = tmp / "fleet.duckdb"
    port = free_port()
    proc = local_run.start_collector(db, port, tmp / "collector.log",
                                     extra_env={"GPUAGENT_COLLECTOR_TOKEN": TOKEN})
    try:
        local_run.wait_port(port, proc, tmp / "collector.log")
        cfg = SimConfig(collector=f"127.0.0.1:{port}", token=TOKEN, sim_hours=2.0, interval_s=10.0,
                        batch_s=600.0, seed=7, streams=8, fabric_sweeps=FABRIC_SWEEPS, fabric_gbits=FABRIC_GBITS)
        summary = run_sim(cfg, fleet(fabric=True))
        assert summary.nodes_ok == len(FLEET_SPEC), summary.errors
        via_target = run_compare(None, f"127.0.0.1:{port}", window="24h", fmt="json", token=TOKEN)
        report_via_target = tmp / "report-via-target.html"
        write_report(str(report_via_target), target=f"127.0.0.1:{port}", token=TOKEN)
    finally:
        local_run.stop_process(proc, timeout=30)
    from gpuagent.collector.analysis.analyzer import analyze_db  # noqa: PLC0415

    analyze_db(str(db))
    _CACHE["fleet"] = FleetDb(db, summary, fleet(fabric=True), via_target, report_via_target)
    return _CACHE["fleet"]
