"""MFU from the tracker (issue 15): a script declares its model FLOPs, the agent reports model FLOPs
utilization against the GPU's dense BF16 peak in job_steps and `gpuagent status`.

The end-to-end test runs the real agent CLI (`python -m gpuagent.agent.cli run`) on the real pynvml over
the NVML emulator (an 8 x "NVIDIA H100 80GB HBM3" node, SYNTHETIC values, clock following real time), the real collector (gRPC on loopback, DuckDB in
tmp_path) and real tracker processes, and checks every reported figure by arithmetic against the
declared FLOPs, the measured step/token rate and the H100 SXM datasheet peak (989.4 TFLOPS).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent_helpers import ROOT, agent_env, read_status, stop
from conftest import wait_for
from gpuagent.sim.nvml_emulator import Emulator
from nvml_emulator_fixture import H100_8GPU, built_or_skip
from gpuagent.collector import service as server
from gpuagent.collector.views import client
from gpuagent.common.gpu_peaks import dense_bf16_peak
from gpuagent.jobs import Tracker, wire

H100_PEAK = 989.4e12
FLOPS_PER_STEP = 3.0e12          # declared by the "step" job: 3 TFLOP per step on its rank
FLOPS_PER_TOKEN = 6 * 125e6      # declared by the "token" job: 6 x parameters of a 125M model
TOKENS_PER_STEP = 8192

LOOP = """
import sys, time
from gpuagent.jobs import track
kind, path = sys.argv[1], sys.argv[2]
opts = {"step": dict(flops_per_step=%r), "token": dict(tokens_per_step=%d, flops_per_token=%r),
        "none": {}}[kind]
t = track(name="mfu-" + kind, samples_per_step=8, socket_path=path, **opts)
while True:
    time.sleep(0.02)
    t.step()
""" % (FLOPS_PER_STEP, TOKENS_PER_STEP, FLOPS_PER_TOKEN)


def test_peak_table_reads_nvml_names():
    assert dense_bf16_peak("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.4)
    assert dense_bf16_peak("NVIDIA H100 PCIe") == ("H100 PCIe", 756.5)
    assert dense_bf16_peak("NVIDIA H200") == ("H200 SXM", 989.4)
    assert dense_bf16_peak("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    assert dense_bf16_peak("NVIDIA L40S") == ("L40S", 362.05)
    assert dense_bf16_peak("NVIDIA B200") == ("B200", 2250.0)
    # not in the table: no peak, so no MFU (never a guess)
    assert dense_bf16_peak("NVIDIA H100 NVL") is None
    assert dense_bf16_peak("NVIDIA H200 NVL") is None
    assert dense_bf16_peak("NVIDIA A10") is None
    assert dense_bf16_peak("") is None


def test_hello_carries_declared_flops_and_old_hello_decodes_without():
    kind, msg = wire.decode(wire.encode_hello(7, 0, 0, 2, 1, "j", "n", "env", 1.5e12, 0.0))
    assert kind == "hello" and msg["flops_per_step"] == 1.5e12 and msg["flops_per_token"] == 0.0
    old = wire.encode_hello(7, 0, 0, 2, 1, "j", "n", "env")[:-wire.HELLO_FLOPS.size]
    kind, msg = wire.decode(old)
    assert kind == "hello" and msg["job_id"] == "j" and msg["flops_per_step"] == 0.0
    nan = wire.encode_hello(7, 0, 0, 2, 1, "j", "n", "env", float("nan"), -3.0)
    assert wire.decode(nan)[1]["flops_per_step"] == 0.0 and wire.decode(nan)[1]["flops_per_token"] == 0.0


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "lots"])
def test_tracker_refuses_a_bad_declaration_in_one_sentence(tmp_path, bad):
    with pytest.raises(ValueError) as e:
        Tracker("x", socket_path=str(tmp_path / "none.sock"), flops_per_step=bad)
    assert str(e.value).startswith("flops_per_step must be") and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mfu")
    col = server.start_collector(tmp / "c.duckdb", "127.0.0.1:0", analyze=False)
    cfg = tmp / "agent.toml"
    cfg.write_text("[probes]\nenabled = false\n[jobs]\nstep_window_s = 1\n")
    built_or_skip()
    emu = Emulator.start(tmp / "nvmlemu", H100_8GPU, clock="real")   # module-scoped: not the function fixture
    env = emu.env(base=agent_env(tmp, GPUAGENT_CONFIG=str(cfg)))
    state = tmp / "state"
    log = open(tmp / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "run",
                              "--collector", col.address, "--state-dir", str(state),
                              "--interval", "0.5", "--batch-interval", "0.5"],
                             stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    jobs = {kind: subprocess.Popen([sys.executable, "-c", LOOP, kind, env["GPUAGENT_JOBS_SOCKET"]],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   env=dict(env, GPUAGENT_JOB_ID=f"mfu-{kind}"))
            for kind in ("step", "token", "none")}
    seen: list[dict] = []
    try:
        def q(sql: str):
            return client.query(col.address, sql).rows

        def ready():
            if agent.poll() is not None:
                pytest.fail(f"agent exited: {(tmp / 'agent.log').read_text()[-2000:]}")
            st = read_status(state)
            if st and st.get("pid") == agent.pid:
                seen.append(st)
            rows = q("SELECT job_id, count(*) FROM job_steps WHERE steps >= 10 GROUP BY job_id")
            return len(rows) == 3 and all(n >= 3 for _, n in rows) and any(
                any(t.get("mfu") for t in s.get("job_throughput", [])) for s in seen)

        wait_for(ready, timeout=90, interval=0.25, what="three tracked jobs' step windows and a status with MFU")
        yield {"q": q, "seen": seen, "state": state, "env": env}
    finally:
        for p in jobs.values():
            p.kill()
            p.wait(10)
        stop(agent, timeout=30)
        col.stop()
        log.close()


def test_job_steps_mfu_by_arithmetic(run):
    rows = run["q"]("SELECT job_id, steps_per_s, tokens_per_s, model_flops_per_s, peak_flops_per_s, mfu "
                    "FROM job_steps WHERE steps >= 10 ORDER BY job_id, ts")
    by_job: dict[str, list] = {}
    for r in rows:
        by_job.setdefault(r[0], []).append(r)
    assert set(by_job) == {"mfu-step", "mfu-token", "mfu-none"}
    for _, steps_per_s, _, flops, peak, mfu in by_job["mfu-step"]:
        assert flops == pytest.approx(steps_per_s * FLOPS_PER_STEP, rel=1e-9)
        assert peak == H100_PEAK
        assert mfu == pytest.approx(steps_per_s * FLOPS_PER_STEP / H100_PEAK, rel=1e-9)
        # ~40-50 steps/s on an idle machine, fewer under load: between 0.05 % and 20 % of the peak
        assert 0.0005 < mfu < 0.2
    for _, steps_per_s, tokens_per_s, flops, peak, mfu in by_job["mfu-token"]:
        assert tokens_per_s == pytest.approx(steps_per_s * TOKENS_PER_STEP, rel=1e-6)
        assert flops == pytest.approx(tokens_per_s * FLOPS_PER_TOKEN, rel=1e-9)
        assert peak == H100_PEAK and mfu == pytest.approx(flops / H100_PEAK, rel=1e-9)
    for row in by_job["mfu-none"]:
        assert list(row[3:]) == [None, None, None], "a job that declared no FLOPs has no MFU"
    print(f"mfu-step: {len(by_job['mfu-step'])} windows, MFU "
          f"{min(r[5] for r in by_job['mfu-step']):.4%}..{max(r[5] for r in by_job['mfu-step']):.4%}")


def test_status_shows_mfu(run):
    from gpuagent.agent.snapshot import StatusSnapshot
    from gpuagent.agent.surface.status import render

    st = next(s for s in reversed(run["seen"]) if any(t.get("mfu") for t in s["job_throughput"]))
    tp = {t["job_id"]: t for t in st["job_throughput"]}
    step = tp["mfu-step"]
    assert step["model_flops_per_s"] == pytest.approx(step["steps_per_s"] * FLOPS_PER_STEP, rel=1e-9)
    assert step["mfu"] == pytest.approx(step["steps_per_s"] * FLOPS_PER_STEP / H100_PEAK, rel=1e-9)
    if "mfu-none" in tp:
        # the status file leaves out what is None
        assert "mfu" not in tp["mfu-none"] and "model_flops_per_s" not in tp["mfu-none"]
    text = render(StatusSnapshot.from_json(st))
    assert "MFU" in text and f"{step['mfu'] * 100:.1f}%" in text
    # `gpuagent status --json` reads the same file
    out = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--json", "--state-dir",
                          str(run["state"])], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env=run["env"])
    assert out.returncode == 0, out.stderr
    live = {t["job_id"]: t for t in json.loads(out.stdout)["job_throughput"]}["mfu-step"]
    assert live["mfu"] == pytest.approx(live["steps_per_s"] * FLOPS_PER_STEP / H100_PEAK, rel=1e-9)
