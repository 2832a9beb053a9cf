"""Kubernetes pod attribution (issue 25): the real agent (subprocess) on an emulated node (SYNTHETIC GPUs under
the real pynvml) asks a pod-resources v1 gRPC server on a Unix socket, started here from our own
proto/podresources.proto, which pod, namespace and container hold each GPU; the real collector (gRPC on
loopback, a DuckDB file) stores what the agent sends, and the agent's own /metrics shows it.

The server is a stand-in for the kubelet (SYNTHETIC pods): it answers List from a table the test changes,
and can hang to show that a kubelet that does not answer never delays a tick."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest

from agent_helpers import read_status, start_agent, stop, wait_running
from conftest import free_port, wait_for
from gpuagent.agent.schedulers.kubelet import PodRef, device_key, parse_list
from gpuagent.collector import service as server
from gpuagent.collector.views import client
from gpuagent.proto import podresources_pb2 as prpb
from gpuagent.proto import podresources_pb2_grpc as prgrpc
from nvml_emulator_fixture import H100_8GPU

HEALTHY = H100_8GPU.with_name("nvml_8gpu_h100_healthy.json")
MIG_UUID = "MIG-5e1c2a10-7b3d-4f21-9c6e-synthetic0101"


class FakeKubelet(prgrpc.PodResourcesListerServicer):
    """SYNTHETIC kubelet: List answers ``pods`` [(namespace, pod, container, resource, [device ids])]."""

    def __init__(self):
        self.pods: list[tuple[str, str, str, str, list[str]]] = []
        self.allocatable: list[str] = []          # device ids GetAllocatableResources lists
        self.hang_s = 0.0
        self.calls = 0
        self.released = threading.Event()      # set at teardown: a hanging List returns at once
        self._lock = threading.Lock()

    def List(self, request, context):  # noqa: N802 - the API's name
        with self._lock:
            self.calls += 1
            pods, hang = list(self.pods), self.hang_s
        if hang:
            self.released.wait(hang)
        resp = prpb.ListPodResourcesResponse()
        for ns, name, container, resource, ids in pods:
            pod = resp.pod_resources.add(name=name, namespace=ns)
            pod.containers.add(name=container).devices.add(resource_name=resource, device_ids=ids)
        return resp

    def GetAllocatableResources(self, request, context):  # noqa: N802
        resp = prpb.AllocatableResourcesResponse()
        resp.devices.add(resource_name="nvidia.com/gpu", device_ids=list(self.allocatable))
        return resp


@pytest.fixture
def kubelet(tmp_path):
    sock = tmp_path / "kubelet.sock"
    fake = FakeKubelet()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    prgrpc.add_PodResourcesListerServicer_to_server(fake, srv)
    assert srv.add_insecure_port(f"unix:{sock}")
    srv.start()
    yield fake, sock
    fake.released.set()
    srv.stop(0)


def test_device_ids_of_time_sliced_replicas_and_mig_devices_map_to_their_uuid():
    resp = prpb.ListPodResourcesResponse()
    a = resp.pod_resources.add(name="a", namespace="ns")
    a.containers.add(name="c").devices.add(resource_name="nvidia.com/gpu", device_ids=["GPU-1::0", "GPU-1::1"])
    b = resp.pod_resources.add(name="b", namespace="ns")
    b.containers.add(name="c").devices.add(resource_name="nvidia.com/mig-1g.10gb", device_ids=["MIG-9"])
    b.containers.add(name="sidecar")                       # a container without devices holds nothing
    got = parse_list(prpb.ListPodResourcesResponse.FromString(resp.SerializeToString()))
    assert got == {"GPU-1": (PodRef("ns", "a", "c", "nvidia.com/gpu"),),
                   "MIG-9": (PodRef("ns", "b", "c", "nvidia.com/mig-1g.10gb"),)}
    assert device_key(" GPU-2::13 ") == "GPU-2"


def _start(tmp_path, emu, sock, extra: str = ""):
    """A collector and an agent on the emulated node asking the kubelet socket ``sock`` every second."""
    col = server.start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False)
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[probes]\nenabled = false\n{extra}'
                   f'[jobs]\nkubernetes = "on"\nkubernetes_socket = "{sock}"\nkubernetes_refresh_s = 1.0\n')
    state = tmp_path / "state"
    # Every sample raw: the test times a pod's series to the tick (at the default they reach samples_1m each
    # minute, which is what 50_utilization_gap reads; docs/RESOLUTION.md).
    agent = start_agent(tmp_path, col.address, state, interval=0.5, batch_interval=0.5,
                        GPUAGENT_CONFIG=str(cfg), GPUAGENT_SUMMARY_INTERVAL="0", **emu.env_vars())
    return col, state, agent


def _pod_series(address: str) -> set[tuple[int, str]]:
    return {(r[0], r[1]) for r in client.query(
        address, "SELECT DISTINCT gpu, labels FROM samples WHERE metric = 'gpu_pod_allocated'").rows}


@pytest.mark.slow
def test_pods_are_named_on_their_gpus_only_gone_within_a_refresh_and_a_hanging_kubelet_delays_no_tick(
        nvml_emulator, kubelet, tmp_path):
    fake, sock = kubelet
    emu = nvml_emulator(HEALTHY, clock="real")
    gpu0 = emu.model["gpus"][0]["uuid"]
    emu.set_mig(1, True, [{"profile": "1g.10gb", "gpu_instance_id": 1, "uuid": MIG_UUID},
                          {"profile": "1g.10gb", "gpu_instance_id": 2}])
    # A training pod on GPU 0 with a process on it; a notebook pod holding one MIG slice of GPU 1, idle.
    fake.pods = [("ml", "train-0", "trainer", "nvidia.com/gpu", [gpu0]),
                 ("research", "notebook-1", "jupyter", "nvidia.com/mig-1g.10gb", [MIG_UUID])]
    # The device plugin offers every GPU but GPU 7 (withdrawn, say unhealthy), and GPU 1's first MIG device.
    fake.allocatable = [g["uuid"] for g in emu.model["gpus"][:7] if g["index"] != 1] + [MIG_UUID]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    emu.add_process(0, worker.pid, 2 << 30, sm_util_percent=80)
    port = free_port()
    col, state, agent = _start(tmp_path, emu, sock, f'[exporter]\nlisten = "127.0.0.1:{port}"\njob_labels = "pod"\n')
    try:
        wait_running(state, agent)
        want = {(0, "container=trainer,namespace=ml,pod=train-0"),
                (1, "container=jupyter,gpu_instance=1,namespace=research,pod=notebook-1")}
        wait_for(lambda: _pod_series(col.address) == want, timeout=30, interval=0.5,
                 what="gpu_pod_allocated for exactly the two held GPUs")
        alloc = wait_for(lambda: (lambda r: r if len(r) == 8 else None)(client.query(
            col.address, "SELECT gpu, arg_max(value, ts) FROM samples WHERE metric = 'gpu_kubelet_allocatable' "
                         "GROUP BY gpu ORDER BY gpu").rows), timeout=30, interval=0.5, what="allocatable per GPU")
        assert alloc == [[g, 0.0 if g == 7 else 1.0] for g in range(8)], alloc
        rows = wait_for(lambda: client.query(
            col.address, f"SELECT DISTINCT job_id, gpu FROM job_samples WHERE pid = {worker.pid}").rows,
            timeout=30, interval=0.5, what="the pod's process in job_samples")
        assert rows == [["k8s:ml/train-0", 0]], rows
        jobs = client.query(col.address, "SELECT job_id, job_name, source, pod_name, pod_namespace, container_name "
                                         "FROM jobs WHERE pod_name IS NOT NULL").rows
        assert jobs == [["k8s:ml/train-0", "train-0", "kubernetes", "train-0", "ml", "trainer"]], jobs
        started = [json.loads(r[0]) for r in client.query(
            col.address, "SELECT attrs FROM events WHERE kind = 'job_start'").rows]
        assert [(a["job_id"], a.get("pod"), a.get("namespace"), a.get("container")) for a in started
                if a["job_id"].startswith("k8s:")] == [("k8s:ml/train-0", "train-0", "ml", "trainer")], started

        # dcgm-exporter's Kubernetes labels on exactly the held GPUs' series, per MIG instance for the slice.
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        util = [ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_UTIL{")]
        held = sorted(ln.split('gpu="')[1].split('"')[0] for ln in util if 'pod="' in ln)
        assert held == ["0"], util
        assert any('pod="train-0"' in ln and 'namespace="ml"' in ln and 'container="trainer"' in ln for ln in util)
        fb = [ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_FB_USED{") and 'gpu="1"' in ln]
        assert [('GPU_I_ID="1"' in ln, 'pod="notebook-1"' in ln) for ln in fb if 'GPU_I_ID="' in ln] == \
            [(True, True), (False, False)], fb
        assert 'gpuagent_gpu_pod_info{' in text

        shown = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--state-dir", str(state)],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        pods_table = shown.stdout[shown.stdout.index("Pods      kubelet"):]
        assert "ml" in pods_table and "train-0" in pods_table and "1 GI 1" in pods_table, shown.stdout
        # The Jobs table and --json name the job's namespace, pod and container (issue 45, point 3).
        lines = shown.stdout.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith("Jobs ("))
        header, row = lines[at + 1].split(), next(ln for ln in lines[at:] if "k8s:ml/train-0" in ln).split()
        assert header[:5] == ["job", "name", "namespace", "pod", "container"], shown.stdout
        assert row[:5] == ["k8s:ml/train-0", "train-0", "ml", "train-0", "trainer"], shown.stdout
        as_json = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--state-dir", str(state),
                                  "--json"], capture_output=True, text=True, timeout=60)
        rows = [j for j in json.loads(as_json.stdout)["jobs"] if j["job_id"] == "k8s:ml/train-0"]
        assert worker.pid in [j["pid"] for j in rows], rows     # with the fixture's own process on GPU 0
        for job in rows:
            assert (job["namespace"], job["pod"], job["container"]) == ("ml", "train-0", "trainer"), job
            assert "user" not in job and "partition" not in job

        # The notebook pod ends: gone from the agent's status at the first tick after the next List.
        fake.pods = fake.pods[:1]
        seen = fake.calls
        wait_for(lambda: fake.calls > seen, timeout=10, what="the next List call")
        gone = wait_for(lambda: (read_status(state) or {}).get("gpus", [{}, {}])[1].get("pods") == [],
                        timeout=3, interval=0.1, what="the ended pod gone from GPU 1 within a refresh")
        assert gone

        # A kubelet that hangs: ticks stay on time; the status says why; the map is dropped after 3 refreshes.
        before = read_status(state)["counters"]
        fake.hang_s = 20.0
        t0 = time.monotonic()
        st = wait_for(lambda: (lambda s: s if s and "no answer" in ((s.get("kubelet") or {}).get("error") or "")
                               else None)(read_status(state)), timeout=15, interval=0.2,
                      what="the status naming the kubelet that does not answer")
        wait_for(lambda: (read_status(state) or {}).get("gpus", [{}])[0].get("pods") == [], timeout=15,
                 interval=0.2, what="the stale map dropped")
        # Eight more ticks while the kubelet hangs: 4 s at 0.5 s a tick. Had a tick waited on List, each would
        # have taken at least the 2 s timeout (16 s); 10 s leaves room for a loaded machine's late ticks.
        wait_for(lambda: read_status(state)["counters"]["ticks"] >= before["ticks"] + 8, timeout=30, interval=0.1,
                 what="eight ticks while the kubelet hangs")
        elapsed = time.monotonic() - t0
        ticks = read_status(state)["counters"]["ticks"] - before["ticks"]
        assert elapsed < 10.0, (ticks, elapsed)
        assert fake.hang_s and fake.calls > seen + 1      # List really was being called, and hanging
        print("kubelet status while hanging:", st["kubelet"], "ticks", ticks, "in", round(elapsed, 1), "s")
    finally:
        fake.hang_s = 0.0
        stop(agent)
        col.stop()
        worker.kill()
        worker.wait()


def test_an_absent_socket_leaves_the_agent_running_and_says_why(nvml_emulator, tmp_path):
    """kubernetes = "on" without a kubelet: nothing is attributed, the status names the missing socket."""
    emu = nvml_emulator(HEALTHY, clock="real")
    col, state, agent = _start(tmp_path, emu, tmp_path / "absent.sock")
    try:
        wait_running(state, agent)
        st = wait_for(lambda: (lambda s: s if s and (s.get("kubelet") or {}).get("error") else None)(read_status(state)),
                      timeout=15, interval=0.2, what="the kubelet error in the status")
        assert "no kubelet pod-resources socket at" in st["kubelet"]["error"]
        assert all(g.get("pods") == [] for g in st["gpus"]), st["gpus"]
        assert agent.poll() is None
    finally:
        stop(agent)
        col.stop()
