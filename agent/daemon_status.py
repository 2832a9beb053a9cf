"""The Agent's status: what each tick saw, as one StatusSnapshot for status.json and the /metrics endpoint.

A mixin of :class:`gpuagent.agent.daemon.Agent`, apart from the tick and its wiring because it only reads
what they keep (the batcher's latest values, the samplers, the sender's link, the spool) and turns it into
the snapshot's types (agent/snapshot.py), with the node's health judgement (agent/surface/health.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from gpuagent import __version__
from gpuagent.agent.snapshot import (GPU_METRICS, HOST_DEVICE_METRICS, HOST_METRICS, GpuStatus, HostStatus,
                                     JobStatus, JobThroughput, KubeletStatus, NodeStatus, ProbeStatus,
                                     RecentEvent, SpoolStatus, StatusSnapshot, TickCounters,
                                     gpu_instances_status, gpu_pods_status, job_gpu_instance, job_scheduler_fields,
                                     write_status)
from gpuagent.agent.surface.health import health_status

log = logging.getLogger("gpuagent.daemon")

_JOB_SAMPLE_KEYS = ("job_id", "job_name", "source", "pid", "rank", "gpu", "gpu_util_percent", "cpu_percent",
                    "rss_bytes")
_STEP_KEYS = ("steps_per_s", "samples_per_s", "tokens_per_s", "step_time_p50_s", "data_wait_fraction",
              "model_flops_per_s", "mfu")


class AgentStatus:
    """The status half of the Agent: ``status_snapshot`` builds this tick's snapshot, ``write_status``
    publishes it. Uses the Agent's cfg, batcher, samplers, node_info, sender, spool, extras, job_steps,
    unavailable, counters and ``_sampler_errors``."""

    def _fingerprint_dict(self, fp) -> dict:
        """The fingerprint as JSON, converted once per fingerprint message (it is fixed at start-up, and
        converting it every tick cost more than the rest of the snapshot)."""
        from google.protobuf.json_format import MessageToDict
        cached = getattr(self, "_fp_cache", None)
        if cached is None or cached[0] is not fp:
            cached = self._fp_cache = (fp, MessageToDict(fp, preserving_proto_field_name=True,
                                                         always_print_fields_with_no_presence=True))
        return cached[1]

    def _kubelet_status(self) -> KubeletStatus | None:
        pods = next((s.pods for s in self.samplers if getattr(s, "name", "") == "gpu"
                     and getattr(s, "pods", None) is not None), None)
        return None if pods is None else KubeletStatus(**pods.state())

    def status_snapshot(self, state: str = "running") -> StatusSnapshot:
        """What this tick saw, for the status file (and anything else that reports it)."""
        b = self.batcher
        now = time.time_ns()
        node = self.node_info
        gpus = {g.index: GpuStatus(index=g.index, name=g.name, uuid=g.uuid, pci_bus_id=g.pci_bus_id or None,
                                   memory_total_bytes=g.memory_total_bytes or None) for g in node.gpus}
        host = HostStatus()
        for s in self.samplers:
            for gpu, xid in (getattr(s, "last_xid", None) or {}).items():
                gpus.setdefault(gpu, GpuStatus(index=gpu)).last_xid = xid
            if getattr(s, "name", "") == "gpu":
                for gpu, cur in list(getattr(s, "last", {}).items()):
                    g = gpus.setdefault(gpu, GpuStatus(index=gpu))
                    g.activity_source, g.instances = cur.get("activity_source"), gpu_instances_status(cur)
                    g.pods = gpu_pods_status(cur)
        latest = b.latest_values()      # one copy of every series' latest value, for the status and health
        for (metric, gpu, labels), (_ts, v) in latest.items():
            if gpu >= 0:
                # not setdefault(gpu, GpuStatus(...)): that built a GpuStatus for every GPU series of every tick
                # (thousands on an 8-GPU node with NVLink), a quarter of the agent's tick (py-spy, 2026-12-05)
                g = gpus.get(gpu)
                if g is None:
                    g = gpus[gpu] = GpuStatus(index=gpu)
                if metric in GPU_METRICS and not labels:    # per-MIG-instance GPM series stay out
                    setattr(g, GPU_METRICS[metric], v)
                elif metric == "gpu_throttle_active" and v >= 1 and labels:
                    g.throttle_reasons.append(dict(labels).get("reason", "?"))
            elif not labels and metric in HOST_METRICS:
                setattr(host, metric, v)
            elif labels and metric in HOST_DEVICE_METRICS:
                table, key = HOST_DEVICE_METRICS[metric]
                dev = dict(labels).get(key)
                if dev is not None:
                    if getattr(host, table) is None:
                        setattr(host, table, {})
                    getattr(host, table).setdefault(dev, {})[metric] = v
        if host.cpu_idle_percent is not None:
            host.cpu_busy_percent = max(0.0, 100.0 - host.cpu_idle_percent)

        # Job processes sampled in the last few ticks; forgotten a minute after that.
        horizon = now - int(3 * self.cfg.interval_s * 1e9) - 2_000_000_000
        jobs: list[JobStatus] = []
        for j, step in b.recent_jobs(horizon, horizon - 60_000_000_000):
            row = JobStatus(**{k: j.get(k) for k in _JOB_SAMPLE_KEYS}, gpu_instance=job_gpu_instance(j),
                            **job_scheduler_fields(j))
            if step:
                for k in _STEP_KEYS:
                    setattr(row, k, step.get(k))
            jobs.append(row)
        throughput = self.job_steps.live() if self.job_steps is not None else []
        for live in throughput:
            row = next((j for j in jobs if j.job_id == live["job_id"]), None)
            if row is None:
                row = JobStatus(job_id=live["job_id"], job_name=live.get("job_name"))
                jobs.append(row)
            for k in (*_STEP_KEYS, "ranks"):
                setattr(row, k, live.get(k))

        unavailable = list(self.unavailable)
        for s in self.samplers:
            unavailable.extend(getattr(s, "unavailable", None) or [])
            nv = getattr(s, "nvml", None)
            unavailable.extend(getattr(nv, "unavailable", None) or [])
        return StatusSnapshot(
            state=state, pid=os.getpid(), agent_version=__version__, started_ns=self.started_ns, updated_ns=now,
            interval_s=self.cfg.interval_s, batch_interval_s=self.cfg.batch_interval_s,
            state_dir=str(self.state_dir), config_file=self.cfg.config_file,
            node=NodeStatus(hostname=node.hostname, machine_id=node.machine_id, node_id=self.sender.state.node_id,
                            labels=dict(node.labels), cpu_model=node.cpu_model, kernel=node.kernel,
                            driver_version=node.driver_version, gpu_count=len(node.gpus)),
            fingerprint=self._fingerprint_dict(node.fingerprint),
            host=host,
            gpus=[gpus[i] for i in sorted(gpus)],
            jobs=jobs,
            job_throughput=[JobThroughput(**t) for t in throughput],
            probes={name: ProbeStatus(**p) for name, p in b.last_probes().items()},
            collector=self.sender.link(),
            spool=SpoolStatus(**self.spool.stats()),
            unavailable=sorted(set(map(str, unavailable))),
            recent_events=[RecentEvent(**e) for e in b.last_events(10)],
            counters=TickCounters(ticks=self.ticks, late_ticks=self.late_ticks, skipped_ticks=self.skipped_ticks,
                                  batches=b.total_batches, samples=b.total_samples),
            torch_loaded="torch" in sys.modules,
            fabric=next((x.fabric_status() for x in self.extras if hasattr(x, "fabric_status")), None),
            kubelet=self._kubelet_status(),
            health=health_status(b, gpus, jobs, now, latest_values=latest),
        )

    def write_status(self, state: str = "running") -> None:
        try:
            snap = self.status_snapshot(state)
            if self.exporter is not None:
                self.exporter.update(snap)   # scrapes see this tick from now on, the same one as the file
            write_status(self.state_dir, snap)
        except Exception:  # noqa: BLE001 - status is best effort; the data path matters more
            if ("status", "write") not in self._sampler_errors:
                self._sampler_errors.add(("status", "write"))
                log.exception("writing the status file failed (reported once)")
