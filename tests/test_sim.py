"""gpuagent-sim: its wire bytes decode with the generated classes, injections do what docs/FLAGS.md says,
scenario files and bad input give one sentence, and a small SYNTHETIC fleet lands in a real collector."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import grpc
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import clean_env, free_port, interrupt, spawned, wait_for

from gpuagent.common import retry
from gpuagent.proto import pb
from gpuagent.sim import fleet
from gpuagent.sim.data import NS, Cadence, NodeSim, SimTiming
from gpuagent.sim.fleet import NodeSpec, ScenarioError, load_scenario_file, scenario_fleet, validate
from gpuagent.sim.run import SimConfig, main as sim_main

END_NS = 1_790_000_000 * NS


def _timing(hours=1.0, **kw):
    return SimTiming(start_ns=END_NS - int(hours * 3600 * NS), end_ns=END_NS, **kw)


def test_encoded_batch_decodes_with_generated_classes():
    node = scenario_fleet("mixed", 10, seed=4)[6]
    timing = _timing(0.5)
    sim, twin = NodeSim(node, timing, seed=4), NodeSim(node, timing, seed=4)
    window = sim.windows()[1]
    enc = sim.encode("n-1", 7, window, END_NS)
    batch = pb.Batch.FromString(enc.data)
    assert (batch.node_id, batch.seq, batch.created_ns) == ("n-1", 7, END_NS)
    cols = batch.samples
    n_series = len(cols.series)
    ticks = np.arange(window[0], window[1], NS, dtype=np.int64)
    expected = twin.samples(ticks)
    assert n_series == len(sim.series) == 9 + 4 * node.gpu_count
    assert len(cols.ts_ns) == len(cols.series_id) == len(cols.value) == enc.n_samples == ticks.size * n_series
    assert np.array_equal(np.array(cols.ts_ns), np.repeat(ticks, n_series))
    assert np.array_equal(np.array(cols.series_id), np.tile(np.arange(n_series), ticks.size))
    assert np.array_equal(np.array(cols.value), expected.ravel())
    by_id = {s.id: s for s in cols.series}
    assert by_id[3].metric == "cpu_steal_percent" and by_id[3].gpu == -1
    assert by_id[8].labels["device"] == "nvme0n1"
    assert {s.metric for s in cols.series if s.gpu == 7} == {"gpu_util_percent", "gpu_memory_used_bytes",
                                                             "gpu_power_watts", "gpu_temperature_celsius"}
    assert len(batch.probe_results) == enc.n_probe_results and len(batch.job_samples) == enc.n_job_samples
    assert all(p.env["synthetic"] == "true" for p in batch.probe_results)


def test_register_request_is_labelled_synthetic_with_injections():
    fleet = scenario_fleet("mixed", 20, seed=2)
    assert [n.hostname for n in fleet[:2]] == ["sim-0001", "sim-0002"]
    assert {n.pool for n in fleet} == {"bare-metal", "cloud-a", "cloud-b"}
    for n in fleet:
        req = NodeSim(n, _timing(0.1), seed=2).register_request("test").node
        assert req.labels["synthetic"] == "true" and req.labels["pool"] == n.pool
        assert req.fingerprint.virtualized == n.virtualized
        assert len(req.gpus) == 8 and req.gpus[0].pcie_gen_max == 5
        for key, value in n.inject.items():
            assert float(req.labels[f"inject_{key}"]) == pytest.approx(value)
        if not n.virtualized:
            assert not any(k.startswith("virt_penalty_") for k in n.inject)
    cloud_a = [n for n in fleet if n.pool == "cloud-a"]
    assert cloud_a and all(n.penalty("h2d") >= 15 for n in cloud_a)
    assert scenario_fleet("mixed", 20, seed=2) == fleet            # seeded: reproducible


def test_injections_scale_probes_steps_and_utilization():
    base = dict(index=0, hostname="sim-0001", pool="cloud-x", virtualized=True)
    healthy = validate(NodeSpec(**base))
    slow = validate(NodeSpec(**base, inject={"virt_penalty_h2d": 20, "virt_penalty_host_syscall": 30,
                                             "virt_penalty_steal": 5}))
    timing = _timing(2.0, probe_interval_s=120)

    def probe_median(node, probe, metric):
        sim = NodeSim(node, timing, seed=1)
        runs = sim.probe_results(timing.start_ns, timing.end_ns)
        return statistics.median(r.metrics[metric] for r in runs if r.probe == probe)

    ratio = probe_median(slow, "pcie", "h2d_gbps") / probe_median(healthy, "pcie", "h2d_gbps")
    assert ratio == pytest.approx(0.80, abs=0.02)
    ratio = probe_median(slow, "host", "syscall_ns") / probe_median(healthy, "host", "syscall_ns")
    assert ratio == pytest.approx(1.30, abs=0.03)
    assert probe_median(slow, "host", "cpu_steal_percent") == pytest.approx(5.0, abs=0.3)

    bound = validate(NodeSpec(**base, inject={"input_bound_fraction": 0.4}))
    sim = NodeSim(bound, timing, seed=1)
    samples, steps = sim.job_rows(timing.start_ns, timing.end_ns)
    assert steps and all(s.data_wait_fraction == pytest.approx(0.4) for s in steps)
    assert statistics.mean(s.gpu_util_percent for s in samples) == pytest.approx(92 * 0.6, abs=3)

    idle = validate(NodeSpec(**base, inject={"idle_fraction": 0.5, "no_job_fraction": 0.25}))
    sim = NodeSim(idle, timing, seed=1)
    ticks = np.arange(timing.start_ns, timing.end_ns, 10 * NS, dtype=np.int64)
    util = sim.samples(ticks)[:, 9]                       # GPU 0 utilization
    assert np.mean(util < 5) == pytest.approx(0.75, abs=0.02)
    held = {s.ts_ns for s in sim.job_rows(timing.start_ns, timing.end_ns)[0]}
    assert len(held) / (2 * 3600 / 30) == pytest.approx(0.75, abs=0.02)    # no job for a quarter of the time

    noisy = validate(NodeSpec(**base, inject={"noise_cv": 0.3}))
    runs = NodeSim(noisy, timing, seed=1).probe_results(timing.start_ns, timing.end_ns)
    vals = [r.metrics["busbw_gbps"] for r in runs if r.probe == "collective"]
    assert statistics.stdev(vals) / statistics.mean(vals) > 0.15


SCENARIO = """
[defaults]
gpu_model = "a100-sxm"
gpu_count = 4

[[pools]]
name = "bare-metal"
nodes = 2
virtualized = false
price_per_gpu_hour = 1.5

[[pools]]
name = "cloud-z"
nodes = 2
virtualized = true
price_per_gpu_hour = 3.0
inject = { virt_penalty_h2d = 25 }

[[nodes]]
hostname = "sim-0004"
inject = { noise_cv = 0.3, idle_fraction = 0.5 }
"""


def test_scenario_file(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(SCENARIO)
    fleet = load_scenario_file(str(path))
    assert [(n.hostname, n.pool, n.gpu_count, n.gpu_model) for n in fleet] == [
        ("sim-0001", "bare-metal", 4, "a100-sxm"), ("sim-0002", "bare-metal", 4, "a100-sxm"),
        ("sim-0003", "cloud-z", 4, "a100-sxm"), ("sim-0004", "cloud-z", 4, "a100-sxm")]
    assert dict(fleet[2].inject) == {"virt_penalty_h2d": 25}
    assert dict(fleet[3].inject) == {"virt_penalty_h2d": 25, "noise_cv": 0.3, "idle_fraction": 0.5}
    assert fleet[3].labels()["inject_noise_cv"] == "0.3" and fleet[0].labels()["price_per_gpu_hour"] == "1.5"

    res = CliRunner().invoke(sim_main, ["--scenario-file", str(path), "--dry-run"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("SYNTHETIC fleet: 4 nodes") and len(lines) == 5
    assert all(line.startswith("SYNTHETIC ") for line in lines)
    assert "virt_penalty_h2d=25" in lines[3]


@pytest.mark.parametrize("text, message", [
    ('[[pools]]\nname = "bm"\nnodes = 1\nvirtualized = false\ninject = { virt_penalty_h2d = 20 }\n',
     "sim-0001: virt_penalty_h2d needs a virtualized node"),
    ('[[pools]]\nname = "c"\nnodes = 1\nvirtualized = true\ninject = { penalty_h2d = 20 }\n',
     "unknown injection 'penalty_h2d'"),
    ('[[pools]]\nname = "c"\nnodes = 1\nvirtualized = true\ninject = { idle_fraction = 0.7, no_job_fraction = 0.5 }\n',
     "idle_fraction + no_job_fraction must not exceed 1"),
    ('[[pools]]\nname = "c"\nnodes = 1\n', "pool 'c' needs virtualized = true or false"),
    ('[[pools]]\nname = "c"\nnodes = 1\nvirtualized = true\ncolour = "red"\n', "unknown key(s) colour"),
    ('[[pools]\nname=', "is not valid TOML"),
    ('[[pools]]\nname = "bare-metal"\nnodes = 1\n[[nodes]]\nhostname = "sim-0009"\n',
     "[[nodes]] override names no node"),
])
def test_bad_scenario_gets_one_sentence(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=None) as err:
        load_scenario_file(str(path))
    assert message in str(err.value)
    res = CliRunner().invoke(sim_main, ["--scenario-file", str(path), "--dry-run"])
    assert res.exit_code == 1 and message in res.output and "Traceback" not in res.output


def test_run_sim_validates_a_hand_built_fleet():
    from gpuagent.sim.run import run_sim

    bad = [NodeSpec(0, "sim-0001", "bm", virtualized=False, inject={"virt_penalty_h2d": 20})]
    with pytest.raises(ScenarioError, match="needs a virtualized node"):
        run_sim(SimConfig(collector="127.0.0.1:1"), bad)
    assert validate(NodeSpec(0, "sim-0001", "c", virtualized=True)).virt_type == "kvm"


def test_bad_options_get_one_sentence():
    for args, message in ((["--scenario", "chaos"], "unknown scenario 'chaos'"),
                          (["--job-sample-interval-s", "90"], "must be in (0, 60]"),
                          (["--nodes", "0"], "--nodes must be at least 1"),
                          (["--duration", "5", "--speed", "10"], "--duration always runs in real time")):
        res = CliRunner().invoke(sim_main, [*args, "--dry-run"])
        assert res.exit_code == 1 and message in res.output, res.output


def test_unreachable_collector_is_one_sentence(tmp_path):
    from conftest import free_port
    port = free_port()   # nothing listens there
    res = subprocess.run([sys.executable, "-m", "gpuagent.sim.run", "--nodes", "2", "--sim-hours", "0.05",
                          "--collector", f"127.0.0.1:{port}", "--connect-timeout", "2"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert f"Error: cannot reach the collector at 127.0.0.1:{port} within 2 s" in res.stderr
    assert "Traceback" not in res.stderr
    assert res.stdout.startswith("SYNTHETIC fleet: 2 nodes")


def test_config_defaults_match_cli():
    """The library's defaults are the CLI's defaults (one place to read them)."""
    res = CliRunner().invoke(sim_main, ["--dry-run", "--nodes", "3"])
    assert res.exit_code == 0
    cfg = SimConfig()
    assert cfg.interval_s == 1.0 and cfg.batch_s == 300.0 and cfg.scenario == "mixed"
    assert "SYNTHETIC fleet: 3 nodes" in res.output and "backfilling 1 h at 1 s" in res.output
    assert fleet.HEALTHY_CV == pytest.approx(0.02)


def test_config_timing_is_the_cadence_over_the_span():
    """SimConfig carries the cadence fields once (from Cadence); SimTiming.over copies every one of them."""
    cfg = SimConfig(interval_s=5.0, batch_s=60.0, probe_interval_s=240.0, job_sample_interval_s=15.0,
                    step_window_s=30.0, gpu_metrics="util", nodes=3)
    t = SimTiming.over(cfg, 10 * NS, 20 * NS)
    assert (t.start_ns, t.end_ns) == (10 * NS, 20 * NS)
    assert (t.interval_s, t.batch_s, t.probe_interval_s, t.job_sample_interval_s, t.step_window_s,
            t.gpu_metrics) == (5.0, 60.0, 240.0, 15.0, 30.0, "util")
    assert SimTiming.over(Cadence(), 0, NS) == SimTiming(start_ns=0, end_ns=NS)


def test_rpc_paths_match_the_proto():
    """The hand-written paths in gpuagent.common.retry are the generated service's."""
    service = pb.DESCRIPTOR.services_by_name["Collector"]
    assert retry.STREAM_METHOD == f"/{service.full_name}/{service.methods_by_name['Stream'].name}"
    assert retry.REGISTER_METHOD == f"/{service.full_name}/{service.methods_by_name['Register'].name}"


def test_backoff_is_jittered_doubling_and_capped():
    import random

    b = retry.Backoff(0.2, 1.0, random.Random(5))
    delays, waits = [], []
    for _ in range(6):
        delays.append(b.delay)
        waits.append(b.next_wait())
    assert delays == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert all(d / 2 <= w <= d for d, w in zip(delays, waits)), (delays, waits)
    assert len({round(w / d, 6) for d, w in zip(delays, waits)}) > 1         # jittered, not a fixed share
    b.reset()
    assert b.delay == 0.2 and 0.1 <= b.next_wait() <= 0.2
    assert grpc.StatusCode.UNAVAILABLE in retry.RETRYABLE
    assert retry.REFUSED.isdisjoint(retry.RETRYABLE)


@pytest.fixture
def live_collector(tmp_path):
    """`gpuagent-collector serve` (subprocess) on a loopback port with a token and a DuckDB file."""
    from gpuagent import local_run

    port = free_port()
    proc = local_run.start_collector(tmp_path / "c.duckdb", port, tmp_path / "collector.log",
                                     extra_env={"GPUAGENT_COLLECTOR_TOKEN": "t0ken"})
    try:
        local_run.wait_port(port, proc, tmp_path / "collector.log")
        yield f"127.0.0.1:{port}", tmp_path / "c.duckdb"
    finally:
        local_run.stop_process(proc, timeout=30)


def _sql(address, q):
    from gpuagent.collector.views.client import query
    return query(address, q, token="t0ken").rows


def _run_sim_cli(address, *args, token="t0ken"):
    return subprocess.run([sys.executable, "-m", "gpuagent.sim.run", "--collector", address, "--token", token,
                           *args], capture_output=True, text=True, timeout=120, env=clean_env())


def test_small_fleet_lands_in_a_real_collector(live_collector):
    address, db = live_collector
    args = ("--nodes", "5", "--sim-hours", "0.25", "--interval-s", "5", "--probe-interval-s", "120", "--seed", "3")
    res = _run_sim_cli(address, *args, "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr.startswith("SYNTHETIC fleet: 5 nodes")
    summary = json.loads(res.stdout)
    assert summary["synthetic"] is True and summary["nodes_ok"] == 5 and summary["duplicates"] == 0
    assert summary["batches_acked"] == 5 * 3                                   # 15 min in 300 s batches

    nodes = _sql(address, "SELECT hostname, synthetic, pool, labels['inject_virt_penalty_h2d'], "
                          "labels['synthetic'], virtualized FROM nodes ORDER BY hostname")
    fleet = scenario_fleet("mixed", 5, seed=3)
    assert [r[0] for r in nodes] == [n.hostname for n in fleet]
    for row, n in zip(nodes, fleet):
        assert row[1] is True and row[2] == n.pool and row[4] == "true" and row[5] == n.virtualized
        pen = n.inject.get("virt_penalty_h2d")
        assert row[3] == (None if pen is None else f"{pen:g}")
    counts = _sql(address, "SELECT (SELECT count(*) FROM samples), (SELECT count(*) FROM probe_results), "
                           "(SELECT count(*) FROM job_samples), (SELECT count(*) FROM job_steps), "
                           "(SELECT count(*) FROM ingest_log)")[0]
    assert counts == [summary["samples"], summary["probe_results"], summary["job_samples"], summary["job_steps"],
                      summary["batches_acked"]]
    assert summary["samples"] == 5 * 180 * (9 + 8 * 4)                        # 180 ticks x 41 series

    # A second run (split over two processes) is the same machines: same node ids, seqs continue.
    res = _run_sim_cli(address, *args, "--procs", "2")
    assert res.returncode == 0, res.stderr
    assert "SYNTHETIC data acknowledged by the collector: 5/5 nodes, 15 batches (0 duplicates)" in res.stdout
    assert _sql(address, "SELECT count(*), max(seq) FROM ingest_log")[0] == [30, 6]
    assert _sql(address, "SELECT count(*) FROM nodes")[0][0] == 5

    # The file is held by the running collector: compare --db says so in one sentence.
    from gpuagent.collector.cli import main as collector_main
    out = CliRunner().invoke(collector_main, ["compare", "--db", str(db)])
    assert out.exit_code == 1 and "held by a running collector" in out.output


def test_wrong_token_is_one_sentence(live_collector):
    address, _ = live_collector
    res = _run_sim_cli(address, "--nodes", "2", "--sim-hours", "0.05", token="wrong")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"Error: the collector at {address} refused the credentials" in res.stderr

    from gpuagent.collector.cli import main as collector_main
    for cmd in (["compare"], ["report", "--out", "unused.html"]):
        out = CliRunner().invoke(collector_main, [*cmd, "--target", address, "--token", "wrong"])
        assert out.exit_code == 1 and f"the collector at {address} refused the credentials" in out.output, out.output


def test_live_and_paced_modes(live_collector):
    """--duration sends each batch once its window has passed; --speed paces a backfill."""
    import time

    from gpuagent.sim.run import run_sim

    address, _ = live_collector
    before_ns = time.time_ns()
    live = run_sim(SimConfig(collector=address, token="t0ken", nodes=2, scenario="healthy", duration_s=3.0,
                             batch_s=1.0, interval_s=0.5, gpus=1, probe_interval_s=120))
    assert live.nodes_ok == 2 and live.batches_acked == 2 * 3
    assert live.wall_s >= 2.5                                           # three 1 s windows, sent as they close
    lo, hi = _sql(address, "SELECT epoch_ns(min(ts)), epoch_ns(max(ts)) FROM samples")[0]
    assert before_ns - 2 * NS <= lo and hi <= time.time_ns()            # stamped "now", never in the future

    paced = run_sim(SimConfig(collector=address, token="t0ken", nodes=1, scenario="healthy", sim_hours=0.01,
                              speed=18.0, batch_s=9.0, gpus=1, prefix="paced"))
    assert paced.nodes_ok == 1 and paced.batches_acked == 4
    assert paced.wall_s >= 1.8                                          # 36 simulated s at 18x


def test_ctrl_c_mid_backfill_is_one_sentence_and_keeps_what_was_acknowledged(live_collector):
    address, _ = live_collector
    with spawned([sys.executable, "-m", "gpuagent.sim.run", "--collector", address, "--token", "t0ken",
                  "--nodes", "20", "--sim-hours", "24", "--speed", "20000"]) as proc:
        wait_for(lambda: _sql(address, "SELECT count(*) FROM ingest_log")[0][0] > 0 or proc.poll() is not None,
                 timeout=60, interval=0.2, what="the first acknowledged batches")
        assert proc.poll() is None, proc.communicate()
        out, err = interrupt(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("SYNTHETIC run interrupted: the batches the collector acknowledged "
                                            "stay stored; the rest were not sent.")
    stored = _sql(address, "SELECT count(*), count(DISTINCT (node_id, seq)) FROM ingest_log")[0]
    assert stored[0] > 0 and stored[0] == stored[1]


def test_busy_idle_injection_reads_busy_on_the_counter_and_idle_on_gpm():
    """SYNTHETIC: with busy_idle_fraction 0.5 and --gpu-metrics util_gpm, half the hour the GPUs read ~90 %
    utilization with 1-5 % SM activity; the other half SM activity is 70-90 % of utilization."""
    node = validate(NodeSpec(index=0, hostname="sim-bi", pool="p", virtualized=False, inject={"busy_idle_fraction": 0.5}))
    sim = NodeSim(node, _timing(1.0, gpu_metrics="util_gpm"), seed=3)
    ticks = np.arange(END_NS - 3600 * NS, END_NS, 10 * NS, dtype=np.int64)
    vals = sim.samples(ticks)
    col = {(m, g): k for k, (m, g, _) in enumerate(sim.series)}
    util, sm = vals[:, col[("gpu_util_percent", 0)]], vals[:, col[("gpu_sm_active_percent", 0)]]
    busy_idle = sm <= 5.0
    assert 0.45 <= busy_idle.mean() <= 0.55
    assert util[busy_idle].min() > 70.0 and sm[busy_idle].min() >= 1.0
    # 70-90 % of the utilization before the simulator rounds utilization to NVML's whole percent (and SM
    # activity to its own precision): bound by the rounded value +-0.5, plus 0.01 for SM activity's rounding.
    u, a = util[~busy_idle], sm[~busy_idle]
    assert (a >= 0.7 * (u - 0.5) - 0.01).all() and (a <= 0.9 * (u + 0.5) + 0.01).all()
    with pytest.raises(ScenarioError, match="busy_idle_fraction must not exceed 1"):
        validate(NodeSpec(index=1, hostname="sim-x", pool="p", virtualized=False,
                          inject={"busy_idle_fraction": 0.6, "idle_fraction": 0.5}))
