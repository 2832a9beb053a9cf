"""Kubernetes attribution: which pod, namespace and container hold each GPU, asked of the node's kubelet.

The kubelet's pod-resources API (gRPC v1, ``proto/podresources.proto``) lists per pod and container the
devices that device plugins allocated to it. It is served on a Unix socket on the node
(``/var/lib/kubelet/pod-resources/kubelet.sock``) and needs no Kubernetes API access or RBAC. NVIDIA's
device plugin names a whole GPU by its UUID (``GPU-…``) and a MIG device by its MIG UUID (``MIG-…``);
time-sliced replicas of one GPU carry ``::<n>`` after the UUID, which is cut off here, so each replica's
pod counts as a holder of that GPU.

This is the only way to tell a GPU held by an idle pod from a free one: such a pod has no process on the
GPU, so NVML's process list and job discovery never see it.

``GetAllocatableResources`` says which devices the kubelet can hand out at all: a GPU that its device plugin
withdrew (unhealthy) is neither free nor held, and ``gpu_kubelet_allocatable`` = 0 says so.

A tick never waits on the kubelet. A background thread calls ``List`` and ``GetAllocatableResources`` every
``refresh_s`` (each call with ``timeout_s``) and publishes a new map; the samplers read the published one.
When the socket is absent, refuses, or hangs, the last map stays for ``3 * refresh_s`` and is then dropped
(no pod is named rather than a stale one), and :meth:`PodResources.state` says why.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

from gpuagent.common.background import BackgroundThread

log = logging.getLogger("gpuagent.kubelet")

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
STALE_REFRESHES = 3            # a map not refreshed for this many periods is dropped


@dataclass(frozen=True, order=True)
class PodRef:
    """One container holding one device, as the kubelet names it."""

    namespace: str
    pod: str
    container: str
    resource: str = ""         # the extended resource, e.g. nvidia.com/gpu, nvidia.com/mig-1g.10gb

    def labels(self) -> dict[str, str]:
        """dcgm-exporter's names for the same attribution (its pod-resources mapping): pod, namespace, container."""
        return {"pod": self.pod, "namespace": self.namespace, "container": self.container}


def device_key(device_id: str) -> str:
    """The GPU or MIG UUID a device plugin's device id stands for ("GPU-x::3", a time-sliced replica, -> "GPU-x")."""
    return device_id.split("::", 1)[0].strip()


def parse_list(resp: Any) -> dict[str, tuple[PodRef, ...]]:
    """A ListPodResourcesResponse -> device key -> the containers holding it (sorted, each once)."""
    out: dict[str, set[PodRef]] = {}
    for pod in resp.pod_resources:
        for c in pod.containers:
            for dev in c.devices:
                for did in dev.device_ids:
                    key = device_key(did)
                    if key:
                        out.setdefault(key, set()).add(PodRef(pod.namespace, pod.name, c.name, dev.resource_name))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def parse_allocatable(resp: Any) -> frozenset[str]:
    """An AllocatableResourcesResponse -> the device keys the kubelet can hand out (healthy, per the plugins)."""
    return frozenset(k for dev in resp.devices for did in dev.device_ids if (k := device_key(did)))


def socket_present(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class PodResources:
    """The published device -> pods map, refreshed from the kubelet in a background thread."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, refresh_s: float = 10.0, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._map: dict[str, tuple[PodRef, ...]] = {}
        self._allocatable: frozenset[str] | None = None   # None: not known (never answered, or too old)
        self._ok_at: float | None = None       # monotonic time of the last successful List
        self._error = ""
        self._refreshes = 0                    # List calls answered or failed so far
        self._cond = threading.Condition()
        self._worker = BackgroundThread("gpuagent-kubelet", self._loop)
        self._stop = self._worker.stopping
        self._channel = None
        self._stub = None

    def start(self) -> PodResources:
        self._worker.start()
        return self

    def stop(self) -> None:
        self._worker.stop(self.timeout_s + 5)
        if self._channel is not None:
            self._channel.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.refresh_s)

    def _connect(self):
        import grpc

        from gpuagent.proto import podresources_pb2_grpc

        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket_path}")
            self._stub = podresources_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    def refresh(self) -> None:
        """One List call; publishes its map, or records why there is none."""
        import grpc

        from gpuagent.proto import podresources_pb2

        try:
            if not os.path.exists(self.socket_path):
                raise FileNotFoundError(f"no kubelet pod-resources socket at {self.socket_path}")
            stub = self._connect()
            resp = stub.List(podresources_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
            alloc = stub.GetAllocatableResources(podresources_pb2.AllocatableResourcesRequest(),
                                                 timeout=self.timeout_s)
            new, allocatable, error = parse_list(resp), parse_allocatable(alloc), ""
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            what = (f"no answer within {self.timeout_s:g} s" if code == grpc.StatusCode.DEADLINE_EXCEEDED
                    else f"{getattr(code, 'name', code)}: {exc.details() if hasattr(exc, 'details') else exc}")
            new, allocatable, error = None, None, f"the kubelet's pod-resources API failed ({what})"
            self._drop_channel()
        except OSError as exc:
            new, allocatable, error = None, None, str(exc)
            self._drop_channel()
        with self._cond:
            now = time.monotonic()
            if new is not None:
                self._map, self._allocatable, self._ok_at = new, allocatable, now
            elif self._ok_at is None or now - self._ok_at > STALE_REFRESHES * self.refresh_s:
                self._map, self._allocatable = {}, None
            if error and error != self._error:
                log.warning("%s; GPUs are not attributed to pods until it answers", error)
            elif not error and self._error:
                log.info("the kubelet's pod-resources API answers again")
            self._error = error
            self._refreshes += 1
            self._cond.notify_all()

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def wait_refreshed(self, n: int = 1, timeout: float = 10.0) -> bool:
        """Wait until ``n`` more List calls have finished (tests; the agent never waits)."""
        with self._cond:
            target = self._refreshes + n
            return self._cond.wait_for(lambda: self._refreshes >= target, timeout)

    def holders(self, uuid: str) -> tuple[PodRef, ...]:
        """The containers holding the GPU or MIG device with this UUID (empty: none, or not known)."""
        return self._map.get(uuid, ()) if uuid else ()

    def allocatable(self, uuid: str) -> bool | None:
        """Whether the kubelet can hand out this GPU or MIG device (its device plugin lists it healthy);
        None when not known. A GPU the plugin withdrew is neither free nor held: the scheduler cannot use it."""
        alloc = self._allocatable
        return None if alloc is None or not uuid else uuid in alloc

    def state(self) -> dict[str, Any]:
        """For `gpuagent status`: the socket, whether the last call answered, and how many devices are held."""
        with self._cond:
            age = None if self._ok_at is None else round(time.monotonic() - self._ok_at, 1)
            return {"socket": self.socket_path, "error": self._error or None, "last_answer_age_s": age,
                    "devices_held": len(self._map),
                    "devices_allocatable": None if self._allocatable is None else len(self._allocatable)}
