"""A real Prometheus (Debian's prometheus 2.42) scrapes real agent subprocesses (`gpuagent run` with the
real pynvml over the NVML emulator, gpuagent.sim.nvml_emulator; SYNTHETIC nodes from tests/data) every
second, for issue 22's must-shows:

- every expression of NVIDIA's dcgm-exporter Grafana dashboard (its 8 panels and its 2 template variables)
  returns data, for a MIG GPU too, under the names before 4.9.0 and (translated, below) under the 4.10 names;
  and so does each GPU panel of gpuagent's packaged dashboard on an agent of either generation alone;
- Prometheus records the 25 default metrics with the CSV's types (/api/v1/metadata);
- ``increase(DCGM_FI_DEV_XID_ERRORS[5m]) > 0`` fires after an injected XID (and why, with dcgm-exporter's
  err_code/err_msg labels, it needs the labels dropped first);
- a job starting and stopping splits no GPU series by default, and does with ``job_labels = "hpc_job"``;
- `promtool check metrics` on a scrape reports only the lints dcgm-exporter's own names cause.

Three agents, each on its own emulated node (as root: NVML answers the MIG calls): "defaults" (the
shipped [exporter] settings), "plain" (err labels off; the 1-GPU vGPU fixture, to keep the CPU down) and
"v410" (the 4.10 names, hpc_job labels)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from agent_helpers import ROOT, free_port
from conftest import wait_for
from exporter_helpers import EmulatedAgent, not_dcgm_lints, promtool_problems
from nvml_emulator_fixture import A10_VGPU, H100_8GPU, nvml_emulator  # noqa: F401  (the fixture)
from test_exporter_dcgm_compat import DEFAULT_CSV, MIG_GPU, csv_name
from tools import needs

pytestmark = [pytest.mark.slow, needs("prometheus", "promtool")]

# Every PromQL expression of NVIDIA's "NVIDIA DCGM Exporter Dashboard" (Grafana gnetId 12239):
# github.com/NVIDIA/dcgm-exporter, grafana/dcgm-exporter-dashboard.json, last changed in cffaeb8 "Fix
# Grafana dashboard (#183)" (read at d5e5f51). Panel title -> expression, with its $instance/$gpu variables.
DCGM_DASHBOARD = [
    ("GPU Temperature", 'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}'),
    ("GPU Avg. Temp", 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})'),
    ("GPU Power Usage", 'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}'),
    ("GPU Power Total", 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})'),
    ("GPU SM Clocks", 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000'),
    ("GPU Utilization", 'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}'),
    ("GPU Framebuffer Mem Used", 'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}'),
    ("Tensor Core Utilization", 'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}'),
]
# Its two template variables (Grafana's label_values(metric, label): the label's values on the metric's series).
DCGM_DASHBOARD_VARIABLES = [("instance", "DCGM_FI_DEV_GPU_TEMP"), ("gpu", "DCGM_FI_DEV_GPU_TEMP")]
# The same panels under the 4.10 names, translated here by gpuagent (NVIDIA's 4.10 dashboard was not at
# hand): 4.9.0's renames, and its units where the dashboard scaled (SM clock in Hz already).
DCGM_DASHBOARD_410 = [
    (title, expr.replace("DCGM_FI_DEV_SM_CLOCK{instance=~\"$instance\", gpu=~\"$gpu\"} * 1000000",
                         "DCGM_FI_DEV_SM_CLOCK_HERTZ{instance=~\"$instance\", gpu=~\"$gpu\"}")
     .replace("DCGM_FI_DEV_GPU_TEMP{", "DCGM_FI_DEV_GPU_TEMP_CELSIUS{")
     .replace("DCGM_FI_DEV_POWER_USAGE{", "DCGM_FI_DEV_BOARD_POWER_WATTS{")
     .replace("DCGM_FI_DEV_GPU_UTIL{", "DCGM_FI_DEV_GPU_UTIL_RATIO{")
     .replace("DCGM_FI_DEV_FB_USED{", "DCGM_FI_DEV_FB_USED_BYTES{")
     .replace("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{", "DCGM_FI_PROF_TENSOR_UTIL_RATIO{"))
    for title, expr in DCGM_DASHBOARD]
JOB_ID = "exporter-split-test"
# gpuagent's own dashboard (packaging/grafana): its panels on the agent's GPU series, written for both generations
PACKAGED = ROOT / "packaging" / "grafana" / "gpuagent.json"


def packaged_gpu_panels() -> list[tuple[str, str]]:
    doc = json.loads(PACKAGED.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", ())
            if "DCGM_FI_" in t["expr"]]


def only_job(expr: str, job: str) -> str:
    """The expression with every series selector of the agent's (DCGM_FI_*, gpuagent_gpu_*) limited to one
    scrape job, so each naming generation's half of an `a or b` is tried on its own agent."""
    return re.sub(r"\b((?:DCGM_FI|gpuagent_gpu)_[A-Za-z0-9_]+)(\{)?",
                  lambda m: f'{m[1]}{{job="{job}"' + (", " if m[2] else "}"), expr)


class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(self, path: str, **params) -> dict:
        with self.opener.open(f"{self.base}{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def ready(self) -> bool:
        try:
            with self.opener.open(f"{self.base}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


@pytest.fixture
def setup(tmp_path, nvml_emulator):
    def node(fixture):
        return nvml_emulator(fixture, clock="real", privileged=True, activate=False)
    agents = {
        "defaults": EmulatedAgent(tmp_path, node(H100_8GPU), interval=0.5, exporter="[jobs]\nend_grace_s = 1.0",
                                  name="defaults"),
        "plain": EmulatedAgent(tmp_path, node(A10_VGPU), interval=0.5, name="plain", exporter="xid_labels = false"),
        "v410": EmulatedAgent(tmp_path, node(H100_8GPU), interval=0.5, name="v410",
                              exporter='dcgm_names = "4.10"\njob_labels = "hpc_job"\n[jobs]\nend_grace_s = 1.0'),
    }
    jobs = "".join(f"  - job_name: {name}\n    static_configs:\n      - targets: ['127.0.0.1:{a.port}']\n"
                   for name, a in agents.items())
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
                   f"scrape_configs:\n{jobs}")
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    prom_proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                  f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    # A process for the job that starts and stops (its job id from the environment, as job discovery reads it)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env={"GPUAGENT_JOB_ID": JOB_ID, "PATH": "/usr/bin:/bin"})
    prom = Prom(port)
    try:
        wait_for(lambda: prom.ready() if prom_proc.poll() is None else pytest.fail(
            (tmp_path / "prometheus.log").read_text()[-2000:]), timeout=60, interval=0.2, what="prometheus ready")
        yield prom, agents, child
    finally:
        child.kill()
        child.wait(10)
        prom_proc.terminate()
        try:
            prom_proc.wait(20)
        except subprocess.TimeoutExpired:
            prom_proc.kill()
            prom_proc.wait()
        log.close()
        for a in agents.values():
            assert a.stop() == 0, a.log_tail()


def _filled(expr: str, job: str, gpu: str) -> str:
    return expr.replace('instance=~"$instance"', f'job="{job}"').replace('"$gpu"', f'"{gpu}"')


def test_dcgm_dashboard_types_xid_jobs_and_promtool_against_a_real_prometheus(setup):
    prom, agents, child = setup
    a, v410 = agents["defaults"], agents["v410"]
    for agent in (a, v410):      # work in both MIG instances of GPU 5, so GPM has per-instance values
        agent.emu.add_process(MIG_GPU, 50001, 2 ** 31, 1, sm_util_percent=40)
        agent.emu.add_process(MIG_GPU, 50002, 2 ** 30, 2, sm_util_percent=10)
    wait_for(lambda: prom.query(f'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{job="defaults", gpu="{MIG_GPU}"}}') and
             prom.query(f'DCGM_FI_PROF_TENSOR_UTIL_RATIO{{job="v410", gpu="{MIG_GPU}"}}') and
             prom.query('up{job="plain"} == 1'),
             timeout=60, interval=0.5, what="the MIG GPU's per-instance profiling series scraped")

    # 1. NVIDIA's dashboard: every expression returns data, over all GPUs and for the MIG GPU alone.
    for job, panels in (("defaults", DCGM_DASHBOARD), ("v410", DCGM_DASHBOARD_410)):
        for title, expr in panels:
            for gpu in (".*", str(MIG_GPU)):
                got = prom.query(_filled(expr, job, gpu))
                assert got, (job, title, gpu, _filled(expr, job, gpu))
    for job, temp in (("defaults", "DCGM_FI_DEV_GPU_TEMP"), ("v410", "DCGM_FI_DEV_GPU_TEMP_CELSIUS")):
        for label, metric in DCGM_DASHBOARD_VARIABLES:
            values = prom.get(f"/api/v1/label/{label}/values", **{"match[]": f'{temp}{{job="{job}"}}'})
            assert values and (label != "gpu" or set(values) == {str(i) for i in range(8)}), (job, metric, values)
    # gpuagent's packaged dashboard: each GPU panel returns data from an agent of either generation alone
    panels = packaged_gpu_panels()
    assert len(panels) >= 6
    for job in ("defaults", "v410"):
        for title, expr in panels:
            if "gpuagent_gpu_job_info" not in expr:       # the job panel: below, while a job runs
                assert prom.query(only_job(expr, job)), (job, title, only_job(expr, job))
    # hpc_job labels (v410): the MIG GPU has a job in each instance, so two power series; the sum counts it once
    assert len(prom.query(f'DCGM_FI_DEV_BOARD_POWER_WATTS{{job="v410", gpu="{MIG_GPU}"}}')) == 2
    power_panel = next(expr for title, expr in panels if title == "GPU power")
    diff = prom.query(f'({only_job(power_panel, "v410")}) - on (instance) sum by (instance) '
                      '(max by (instance, gpu) (DCGM_FI_DEV_BOARD_POWER_WATTS{job="v410"}))')
    assert len(diff) == 1 and abs(float(diff[0]["value"][1])) < 1e-6, diff
    mig_fb = prom.query(f'DCGM_FI_DEV_FB_USED{{job="defaults", gpu="{MIG_GPU}"}}')
    assert sorted((r["metric"]["GPU_I_ID"], r["metric"]["GPU_I_PROFILE"]) for r in mig_fb) == [
        ("1", "3g.40gb"), ("2", "3g.40gb")]

    # 2. The types Prometheus recorded from the scrape: the CSV's, under both generations' names.
    meta = prom.get("/api/v1/metadata")
    for old, kind, _new in DEFAULT_CSV:
        for gen in ("pre-4.8.3", "4.10"):
            name = csv_name(old, gen)
            assert {m["type"] for m in meta.get(name, [])} == {kind}, (name, meta.get(name))

    # 3. promtool on a scrape of each generation: only the lints of dcgm-exporter's own names.
    for agent in (a, v410):
        text = agent.scrape()
        problems = promtool_problems(text)
        assert problems and not_dcgm_lints(problems) == [], not_dcgm_lints(problems)
        assert not any(p.startswith("gpuagent_") for p in problems)

    # 4. XID 13 on GPU 1: every GPU had its series at 0 before it (GPUs 3 and 6 carry the fixture's XIDs).
    assert len(prom.query('DCGM_FI_DEV_XID_ERRORS{job="defaults"} == 0')) == 6
    assert prom.query('count(DCGM_FI_DEV_XID_ERRORS{job="plain"} == 0)')[0]["value"][1] == "1"
    for agent in agents.values():
        agent.emu.inject_xid(1 if agent is not agents["plain"] else 0, 13)
    # err labels off: the expression as written fires
    fired = wait_for(lambda: prom.query('increase(DCGM_FI_DEV_XID_ERRORS{job="plain"}[5m]) > 0'), timeout=30,
                     interval=0.5, what="increase(DCGM_FI_DEV_XID_ERRORS[5m]) > 0 on the agent without err labels")
    assert [r["metric"]["gpu"] for r in fired] == ["0"]
    # dcgm-exporter's err_code/err_msg labels (the default) make the XID a new series: drop them first
    tolerant = ('increase((max without (err_code, err_msg) ({name}{{job="{job}"}}))[5m:1s]) > 0')
    for job, name in (("defaults", "DCGM_FI_DEV_XID_ERRORS"), ("v410", "DCGM_FI_DEV_XID_ERROR")):
        got = wait_for(lambda name=name, job=job: prom.query(tolerant.format(name=name, job=job)), timeout=30,
                       interval=0.5, what=f"the XID increase on {job}")
        assert [r["metric"]["gpu"] for r in got] == ["1"]
    wait_for(lambda: len(prom.query('DCGM_FI_DEV_XID_ERRORS{job="defaults", err_code="13"}')) == 1, timeout=30,
             interval=0.5, what="the XID 13 series scraped twice")
    assert prom.query('increase(DCGM_FI_DEV_XID_ERRORS{job="defaults"}[5m]) > 0') == [], \
        "with err_code/err_msg the raw expression cannot see the step (docs/EXPORTER.md)"
    assert len(prom.query('DCGM_FI_DEV_XID_ERRORS{job="defaults"} == 0')) == 5

    # 5. A job starts on GPU 2 and stops: by default no GPU series splits; with hpc_job labels they do.
    # The window starts once the XID series at 0 (split off above by its err_code) has no sample in it.
    for job, name in (("defaults", "DCGM_FI_DEV_XID_ERRORS"), ("v410", "DCGM_FI_DEV_XID_ERROR")):
        wait_for(lambda name=name, job=job: {r["metric"]["err_code"] for r in prom.query(
                 f'{name}{{job="{job}", gpu="1"}}[3s]')} == {"13"},
                 timeout=30, interval=0.5, what=f"only the XID 13 series in the last 3 s on {job}")
    w0 = time.time()
    for agent in (a, v410):
        agent.emu.add_process(2, child.pid, 2 ** 30, sm_util_percent=50)
    join = ('sum by (job_id) (gpuagent_gpu_job_info{job="defaults"} * on (instance, gpu) group_left () '
            'DCGM_FI_DEV_POWER_USAGE{job="defaults"})')
    got = wait_for(lambda: [r for r in prom.query(join) if r["metric"]["job_id"] == JOB_ID], timeout=30,
                   interval=0.5, what="the job joined to its GPU's power through gpuagent_gpu_job_info")
    power2 = prom.query('DCGM_FI_DEV_POWER_USAGE{job="defaults", gpu="2"}')[0]["value"][1]
    assert got[0]["value"][1] == power2
    wait_for(lambda: prom.query(f'DCGM_FI_DEV_BOARD_POWER_WATTS{{job="v410", hpc_job="{JOB_ID}"}}'), timeout=30,
             interval=0.5, what="the hpc_job series on the v410 agent")
    for title, expr in packaged_gpu_panels():
        if "gpuagent_gpu_job_info" in expr:
            for job in ("defaults", "v410"):
                got = wait_for(lambda expr=expr, job=job: [r for r in prom.query(only_job(expr, job))
                                                           if r["metric"].get("job_id") == JOB_ID],
                               timeout=30, interval=0.5, what=f"the packaged panel {title!r} on {job}")
                assert len(got) == 1, (job, title, got)
    for agent in (a, v410):
        agent.emu.remove_process(child.pid)
    wait_for(lambda: not prom.query(f'gpuagent_gpu_job_info{{job="defaults", job_id="{JOB_ID}"}}') and
             not prom.query(f'DCGM_FI_DEV_BOARD_POWER_WATTS{{job="v410", hpc_job="{JOB_ID}"}}'),
             timeout=30, interval=0.5, what="the job gone from both agents")
    window = f"{int(time.time() - w0) + 1}s"
    per_series = 'count by (__name__, gpu, GPU_I_ID) (last_over_time({{__name__=~"DCGM_FI_.+", job="{job}"}}[{w}]))'
    counts = prom.query(per_series.format(job="defaults", w=window))
    assert len(counts) >= 8 * 25 and {r["value"][1] for r in counts} == {"1"}, \
        [r["metric"] for r in counts if r["value"][1] != "1"]
    # hpc_job labels: GPU 2's series split when the job came and went (GPU 5's GPU-level series are one per
    # job of its two MIG instances all along; its per-instance series one per instance)
    split = [r["metric"] for r in prom.query(per_series.format(job="v410", w=window)) if r["value"][1] != "1"]
    assert {m["__name__"] for m in split if m["gpu"] == "2"} >= {"DCGM_FI_DEV_BOARD_POWER_WATTS",
                                                                  "DCGM_FI_DEV_XID_ERROR"}, split
    assert {m["gpu"] for m in split} <= {"2", str(MIG_GPU)} and not any("GPU_I_ID" in m for m in split), split
