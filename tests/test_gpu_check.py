"""scripts/gpu-check.sh on this machine (no GPU, no CUDA): it must refuse, say why in one sentence, list what it
would run, and never reach for make, pip on PATH or the network; and its verdict (scripts/gpu_check.py
summary) must fail on skipped GPU tests, on zero tests and on implausible probe figures, yet pass on good ones.

The script runs as a real subprocess. Network use is watched three ways: shims first on PATH for make, pip
and friends that record any call, every proxy variable pointed at a local listener that counts connections,
and, where strace works, every connect() to an IPv4/IPv6 address of the whole process tree. The Pythons are
real: this venv's (CPU-only torch), a bare venv without pip or any package, and that bare venv with only
torch (and what torch needs) linked in. The probe results and junit inputs of the verdict tests are
SYNTHETIC (made here, labelled so); the junit report with skips comes from a real pytest run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

from conftest import clean_env
from gpuagent.probes.result import ProbeResult

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu-check.sh"
HELPER = REPO / "scripts" / "gpu_check.py"
WHEELS = REPO / "gpu-wheels"
SHIMMED = ("make", "pip", "pip3", "uv", "curl", "wget", "git", "apt-get", "conda")
# The check's dependencies as pyproject.toml bounds them (the refusal must name each).
DISTS = ("pytest", "pytest-timeout", "psutil", "nvidia-ml-py", "grpcio", "protobuf", "click")
PY_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _strace() -> list[str]:
    """strace's argv prefix for following connect() calls, [] where strace is missing or not allowed.
    --seccomp-bpf (strace >= 5.3) stops the tracee only on connect(), so torch's imports stay fast."""
    if shutil.which("strace") is None:
        return []
    for extra in (["--seccomp-bpf"], []):
        argv = ["strace", *extra, "-f", "-qq", "-e", "trace=connect", "-e", "signal=none"]
        r = subprocess.run([*argv, "-o", os.devnull, "true"], capture_output=True, timeout=30, check=False)
        if r.returncode == 0:
            return argv
    return []


STRACE = _strace()


@dataclass
class Run:
    rc: int
    out: str
    shim_calls: list[str]
    inet_connects: list[str]
    proxy_connections: int
    out_dir: Path

    @property
    def refusal(self) -> list[str]:
        return [line for line in self.out.splitlines() if line.startswith("REFUSED:")]

    @property
    def summary(self) -> dict:
        return json.loads((self.out_dir / "gpu-check-summary.json").read_text())


def run_check(tmp_path: Path, **env: str) -> Run:
    """gpu-check.sh as a subprocess with shims first on PATH, proxies pointed at a counting listener, and
    (where it works) strace recording connect() calls; output lands in tmp_path/out via $OUT."""
    shims = tmp_path / "shims"
    shims.mkdir()
    calls = tmp_path / "shim-calls.log"
    for name in SHIMMED:
        p = shims / name
        p.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 97\n')
        p.chmod(0o755)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    proxy = f"http://127.0.0.1:{listener.getsockname()[1]}"
    out_dir = tmp_path / "out"
    e = clean_env(**env)
    e.update({"PATH": f"{shims}:{os.environ['PATH']}", "OUT": str(out_dir), "GPU_CHECK_BUDGET_S": "60"})
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        e[var] = proxy
    e.update({"PIP_INDEX_URL": proxy + "/simple", "no_proxy": "", "NO_PROXY": ""})
    e.pop("GPU_CHECK_OUT", None)
    trace = tmp_path / "strace.txt"
    argv = ["bash", str(SCRIPT)]
    if STRACE:
        argv = [*STRACE, "-o", str(trace), *argv]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=e, cwd=tmp_path, check=False)
        connections = 0
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                break
            conn.close()
            connections += 1
    finally:
        listener.close()
    inet = [ln for ln in trace.read_text().splitlines() if "AF_INET" in ln] if STRACE else []
    shim_calls = calls.read_text().splitlines() if calls.exists() else []
    return Run(r.returncode, r.stdout + r.stderr, shim_calls, inet, connections, out_dir)


def expected_plan() -> list[str]:
    """What the plan must list, found independently of the script: every test in a file with a gpu/nvml
    mark, each probe, each comparison."""
    tests = []
    for f in sorted((REPO / "tests").glob("test_*.py")):
        text = f.read_text()
        if re.search(r"^(pytestmark = |@)pytest\.mark\.(gpu|nvml)\b", text, re.MULTILINE):
            tests += [f"tests/{f.name}::{name}" for name in re.findall(r"^def (test_\w+)", text, re.MULTILINE)]
    assert "tests/test_gpu_device.py::test_gpm_sm_activity_under_load" in tests
    return tests + ["probe   pcie", "probe   gpu_compute", "probe   collective", "compare pcie", "compare gpu_compute"]


def assert_refused_offline(run: Run) -> str:
    """The common contract of a refusal: exit 2, one sentence, the plan, a REFUSED summary, no network."""
    assert run.rc == 2, run.out
    assert len(run.refusal) == 1 and run.refusal[0].endswith("."), run.out
    assert "Traceback" not in run.out, run.out
    for item in expected_plan():
        assert item in run.out, (item, run.out)
    summary = run.summary
    assert summary["verdict"] == "REFUSED" and summary["reason"] == run.refusal[0]
    assert any("test_own_cuda_process_in_agent_process_list" in p for p in summary["plan"])
    assert run.shim_calls == [], f"called {run.shim_calls}"
    assert run.proxy_connections == 0, "something reached for the network through a proxy"
    assert run.inet_connects == [], run.inet_connects
    return run.refusal[0]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A real Python with nothing installed: no pip, no torch, no pytest."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def torch_only(tmp_path_factory) -> str:
    """A folder for PYTHONPATH holding links to torch and the distributions it requires, and nothing else:
    with the bare venv, a real Python that has (CPU) torch but none of the check's other dependencies."""
    folder = tmp_path_factory.mktemp("torch_only")
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        site = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            link = folder / top
            if not link.exists() and (site / top).exists():
                link.symlink_to(site / top)
        for req in dist.requires or ():
            if "extra ==" not in req:
                todo.append(re.split(r"[<>=!~; \[(]", req, maxsplit=1)[0])
    assert not {"pytest", "psutil", "grpcio"} & seen, seen
    return str(folder)


def test_refuses_cpu_only_torch(tmp_path):
    """This venv has every dependency but a CPU-only torch: refused at once, nothing installed."""
    run = run_check(tmp_path, PYTHON=sys.executable, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    sentence = assert_refused_offline(run)
    assert "CPU-only build" in sentence and "a CUDA build of torch" in sentence
    assert not any(d + ">=" in sentence for d in DISTS), sentence   # they are all there
    assert "installing" not in run.out


def test_refuses_python_without_modules(tmp_path, bare_python):
    run = run_check(tmp_path, PYTHON=bare_python, GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"))
    sentence = assert_refused_offline(run)
    assert "torch (not installed)" in sentence
    for dist in DISTS:
        assert f"{dist}>=" in sentence, (dist, sentence)
    assert "scripts/gpu-wheels.sh" in sentence and "carry gpu-wheels" in sentence
    assert "pytest" in run.summary["reason"]


def test_wheels_for_other_pythons_say_which(tmp_path, bare_python):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "MANIFEST.txt").write_text("3.99 SYNTHETIC-0-py3-none-any.whl\n")   # SYNTHETIC manifest
    run = run_check(tmp_path, PYTHON=bare_python, GPU_CHECK_WHEELS=str(wheels))
    sentence = assert_refused_offline(run)
    assert f"has wheels for Python 3.99 but not {PY_VERSION}" in sentence, sentence
    assert "installing" not in run.out


@pytest.mark.skipif(PY_VERSION not in ((WHEELS / "MANIFEST.txt").read_text() if (WHEELS / "MANIFEST.txt").exists()
                                       else ""),
                    reason=f"gpu-wheels/ has no wheels for Python {PY_VERSION}: run scripts/gpu-wheels.sh")
def test_installs_missing_modules_from_wheels_offline(tmp_path, bare_python, torch_only):
    """torch present, the rest missing, no pip: installed from gpu-wheels/ (pip run from its wheel,
    --no-index), then refused only for the CPU-only torch."""
    run = run_check(tmp_path, PYTHON=bare_python, PYTHONPATH=torch_only, GPU_CHECK_WHEELS=str(WHEELS))
    sentence = assert_refused_offline(run)
    assert f"from {WHEELS}/" in run.out and "== installing pytest>=" in run.out, run.out
    assert "CPU-only build" in sentence
    assert not any(d + ">=" in sentence for d in DISTS), sentence   # all installed, all importable
    for dist in ("pytest", "grpcio", "nvidia-ml-py"):
        assert re.search(rf"^  \S+: {dist} \d", run.out, re.MULTILINE), (dist, run.out)


# ------------------------------------------------------------------ the verdict, on SYNTHETIC inputs
def _summary(out: Path, *args: str) -> tuple[int, str, dict]:
    r = subprocess.run([sys.executable, str(HELPER), "summary", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=60, env=clean_env(), cwd=REPO, check=False)
    return r.returncode, r.stdout + r.stderr, json.loads((out / "gpu-check-summary.json").read_text())


def _probe_files(out: Path, d2h_gbps: float = 52.0, bf16_tflops: float = 700.0) -> None:
    """SYNTHETIC probe results in the shape the probes print (built with the real ProbeResult)."""
    link = {"device": "NVIDIA H200 (SYNTHETIC)", "link_gen": 5, "link_width": 16, "theoretical_gbps": 63.015}
    pcie = ProbeResult("pcie", "ok", "", {}, {}, 1, 2, {"backend": "cuda"}, per_gpu=[
        {"gpu": 0, "status": "ok", "reason": "", "env": link,
         "metrics": {"h2d_gbps": 55.0, "d2h_gbps": d2h_gbps, "bidir_gbps": 100.0}}])
    compute = ProbeResult("gpu_compute", "ok", "", {}, {}, 1, 2, {"backend": "cuda"}, per_gpu=[
        {"gpu": 0, "status": "ok", "reason": "", "env": {"device": "NVIDIA H200 (SYNTHETIC)"},
         "metrics": {"bf16_tflops": bf16_tflops, "fp32_tflops": 50.0, "sync_latency_us": 9.0}}])
    coll = ProbeResult("collective", "skipped", "only one GPU here; NCCL needs >= 2 GPUs (SYNTHETIC)", {})
    for r in (pcie, compute, coll):
        (out / f"probe-{r.probe}.json").write_text(r.to_json())


@pytest.fixture(scope="module")
def junit_with_skip(tmp_path_factory) -> str:
    """A real pytest junit report: one test that records a figure and passes, one that skips."""
    d = tmp_path_factory.mktemp("junit")
    (d / "test_synthetic_gpu.py").write_text(
        "import pytest\n\n"
        "def test_synthetic_passes(record_property):\n"
        "    record_property('gpu0_synthetic_percent', '97.0')\n\n"
        "def test_synthetic_skips():\n"
        "    pytest.skip('needs CUDA (SYNTHETIC)')\n")
    xml = d / "pytest-gpu.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    "-o", "junit_family=xunit1", f"--junitxml={xml}", "-c", os.devnull, str(d)],
                   capture_output=True, text=True, timeout=60, cwd=d, env=clean_env(), check=False)
    return xml.read_text()


def test_verdict_fails_on_a_skip_while_cuda_is_available(tmp_path, junit_with_skip):
    (tmp_path / "pytest-gpu.xml").write_text(junit_with_skip)
    _probe_files(tmp_path)
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "1", "--gpu-count", "1")
    assert rc == 1 and doc["verdict"] == "FAIL", out
    checks = {c["check"]: c for c in doc["checks"]}
    skipped = checks["test_synthetic_gpu.py::test_synthetic_skips"]
    assert skipped["status"] == "FAIL" and "skipped while CUDA is available: needs CUDA (SYNTHETIC)" in skipped["figure"]
    assert checks["test_synthetic_gpu.py::test_synthetic_passes"] == {
        "check": "test_synthetic_gpu.py::test_synthetic_passes", "status": "PASS",
        "figure": "gpu0_synthetic_percent 97.0"}
    assert doc["tests"]["skipped"] == 1 and doc["tests"]["passed"] == 1
    # a skip while only nvidia-smi works fails too, and says so
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "0", "--smi-gpus", "1", "--gpu-count", "1")
    assert rc == 1 and "skipped while nvidia-smi lists GPUs: needs CUDA (SYNTHETIC)" in out
    # without any GPU a skip is still no pass: nothing was checked
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "0", "--smi-gpus", "0", "--gpu-count", "1")
    assert rc == 1 and "neither CUDA nor nvidia-smi works here, so nothing was checked" in out


def test_verdict_fails_when_no_test_ran(tmp_path):
    _probe_files(tmp_path)
    (tmp_path / "pytest-gpu.xml").write_text(   # SYNTHETIC: the report of a run that collected nothing
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0" '
        'skipped="0" tests="0" time="0.1"></testsuite></testsuites>')
    rc, out, doc = _summary(tmp_path, "--test-rc", "5", "--cuda-available", "1", "--gpu-count", "1")
    assert rc == 1 and "zero tests ran (pytest exit 5)" in out, out
    (tmp_path / "pytest-gpu.xml").unlink()   # pytest killed by the time limit before it wrote a report
    rc, out, doc = _summary(tmp_path, "--test-rc", "124", "--cuda-available", "1", "--gpu-count", "1")
    assert rc == 1 and "no test report" in out and "timed out" in out, out
    assert doc["verdict"] == "FAIL" and doc["facts"]["pytest_exit"] == 124


def test_verdict_passes_plausible_figures_and_fails_impossible_ones(tmp_path, junit_with_skip):
    passing = re.sub(r"<testcase [^>]*test_synthetic_skips.*?</testcase>", "", junit_with_skip, flags=re.DOTALL)
    assert "test_synthetic_skips" not in passing
    (tmp_path / "pytest-gpu.xml").write_text(passing)
    _probe_files(tmp_path)
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "1", "--gpu-count", "1")
    assert rc == 0 and doc["verdict"] == "PASS", out
    figures = {c["check"]: c["figure"] for c in doc["checks"]}
    assert "52.00 GB/s = 82.5 % of 63.02 GB/s (gen5 x16" in figures["pcie gpu0 D2H vs link"]
    assert "700.0 TFLOP/s = 70.7 % of H200 SXM's dense 989.4" in figures["gpu_compute gpu0 bf16 vs peak"]
    assert "skipped as it must on 1 GPU" in figures["probe collective"]
    # more than the link can carry, or more than the datasheet peak: the reference or the arithmetic is wrong
    _probe_files(tmp_path, d2h_gbps=70.0, bf16_tflops=1200.0)
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "1", "--gpu-count", "1")
    status = {c["check"]: c["status"] for c in doc["checks"]}
    assert rc == 1 and status["pcie gpu0 D2H vs link"] == "FAIL" and status["gpu_compute gpu0 bf16 vs peak"] == "FAIL"
    assert status["pcie gpu0 H2D vs link"] == "PASS"
    # a collective skipped on a machine with 2 GPUs is a failure, not the one-GPU exemption
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "1", "--gpu-count", "2")
    assert {c["check"]: c["status"] for c in doc["checks"]}["probe collective"] == "FAIL"
    # and one that ran on gloo while CUDA is available measured the host, not the GPUs
    gloo = ProbeResult("collective", "ok", "", {}, {"busbw_gbps": 1.0, "algbw_gbps": 0.5}, 1, 2,
                       {"backend": "gloo", "world_size": 2})   # SYNTHETIC
    (tmp_path / "probe-collective.json").write_text(gloo.to_json())
    rc, out, doc = _summary(tmp_path, "--test-rc", "0", "--cuda-available", "1", "--gpu-count", "2")
    assert {c["check"]: c["status"] for c in doc["checks"]}["probe collective"] == "FAIL"
