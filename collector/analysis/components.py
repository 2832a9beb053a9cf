"""What each flag kind measures: one row per component, with its probe metric, direction and thresholds.

docs/FLAGS.md is the source of truth for these rows; the analyzer writes them into ``_components`` for the
SQL steps, the config checks threshold keys against them, and the reference baselines name their components.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("virtualization_overhead", "noisy_neighbor_variance", "utilization_gap")


# ----------------------------------------------------------------------------------------------- components

@dataclass(frozen=True)
class Component:
    """One thing a flag kind measures (docs/FLAGS.md is the source of truth for these rows)."""

    kind: str
    component: str
    probe: str          # probe registry name, or "job_steps"
    metric: str
    better: str         # higher, lower, points (steal: percentage points above the baseline)
    per_gpu: bool
    threshold: float    # virtualization_overhead: % (or points); noisy: CV
    critical: float
    label: str          # how a sentence names it
    unit: str           # the value's unit as stored in flags.unit
    unit_label: str     # how a sentence prints the unit
    advice: str = ""    # the actionable half of the sentence


_VO = "virtualization_overhead"
_NN = "noisy_neighbor_variance"

COMPONENTS: tuple[Component, ...] = (
    Component(_VO, "collective_busbw", "collective", "busbw_gbps", "higher", False, 10, 25,
              "collective busbw", "gbps", "GB/s",
              "check the VM's NVLink/NIC passthrough, GPUDirect RDMA and NCCL topology"),
    Component(_VO, "collective_latency", "collective", "small_msg_latency_us", "lower", False, 10, 25,
              "collective small-message latency", "us", "µs",
              "check the VM's NIC passthrough and vCPU pinning of the NCCL proxy threads"),
    Component(_VO, "h2d", "pcie", "h2d_gbps", "higher", True, 10, 25, "H2D", "gbps", "GB/s",
              "check PCIe passthrough, IOMMU/ATS settings and the NUMA placement of this VM"),
    Component(_VO, "d2h", "pcie", "d2h_gbps", "higher", True, 10, 25, "D2H", "gbps", "GB/s",
              "check PCIe passthrough, IOMMU/ATS settings and the NUMA placement of this VM"),
    Component(_VO, "gpu_compute", "gpu_compute", "bf16_tflops", "higher", True, 10, 25,
              "BF16 compute", "tflops", "TFLOPS",
              "check for vGPU time-slicing, MIG partitioning or capped clocks on this VM"),
    Component(_VO, "launch_latency", "gpu_compute", "launch_latency_us", "lower", True, 10, 25,
              "kernel launch latency", "us", "µs",
              "check vGPU scheduling and CPU contention on the host (pin the VM's vCPUs)"),
    Component(_VO, "storage_seq_read", "storage", "seq_read_gbps", "higher", False, 10, 25,
              "storage sequential read", "gbps", "GB/s",
              "check the virtual disk type and its provisioned throughput cap"),
    Component(_VO, "storage_seq_write", "storage", "seq_write_gbps", "higher", False, 10, 25,
              "storage sequential write", "gbps", "GB/s",
              "check the virtual disk type and its provisioned throughput cap"),
    Component(_VO, "storage_rand_read", "storage", "rand_read_iops", "higher", False, 10, 25,
              "storage random read", "iops", "IOPS",
              "check the virtual disk type and its provisioned IOPS cap"),
    Component(_VO, "host_syscall", "host", "syscall_ns", "lower", False, 10, 25,
              "syscall latency", "ns", "ns",
              "check for exits to the hypervisor (mitigations, no PV features) and vCPU pinning"),
    Component(_VO, "host_timer", "host", "clock_gettime_ns", "lower", False, 10, 25,
              "clock_gettime latency", "ns", "ns",
              "switch the guest clocksource to tsc if the host offers a stable TSC"),
    Component(_VO, "steal", "host", "cpu_steal_percent", "points", False, 2, 10,
              "CPU steal", "percent", "%",
              "ask the provider for dedicated vCPUs or move to a less contended host"),
    Component(_NN, "collective_busbw", "collective", "busbw_gbps", "higher", False, 0.10, 0.20,
              "collective busbw", "gbps", "GB/s"),
    Component(_NN, "h2d", "pcie", "h2d_gbps", "higher", True, 0.10, 0.20, "H2D", "gbps", "GB/s"),
    Component(_NN, "d2h", "pcie", "d2h_gbps", "higher", True, 0.10, 0.20, "D2H", "gbps", "GB/s"),
    Component(_NN, "gpu_compute", "gpu_compute", "bf16_tflops", "higher", True, 0.10, 0.20,
              "BF16 compute", "tflops", "TFLOPS"),
    Component(_NN, "storage_seq_read", "storage", "seq_read_gbps", "higher", False, 0.10, 0.20,
              "storage sequential read", "gbps", "GB/s"),
    Component(_NN, "storage_rand_read", "storage", "rand_read_iops", "higher", False, 0.10, 0.20,
              "storage random read", "iops", "IOPS"),
    Component(_NN, "storage_rand_read_p99", "storage", "rand_read_p99_latency_us", "lower", False, 0.25, 0.50,
              "storage random-read p99 latency", "us", "µs"),
    Component(_NN, "host_syscall", "host", "syscall_ns", "lower", False, 0.25, 0.50,
              "syscall latency", "ns", "ns"),
    Component(_NN, "host_pipe", "host", "pipe_roundtrip_us", "lower", False, 0.25, 0.50,
              "pipe round-trip latency", "us", "µs"),
    Component(_NN, "host_memcpy", "host", "memcpy_gbps", "higher", False, 0.10, 0.20,
              "memcpy bandwidth", "gbps", "GB/s"),
    # a fabric link's rate over its runs (61_link_variance.sql reads link_results, not probe_metrics)
    Component(_NN, "link", "net_pair", "link_gbits", "higher", False, 0.10, 0.20,
              "fabric link rate", "gbps", "Gbit/s"),
    Component(_NN, "step_time", "job_steps", "step_time_p50_s", "lower", False, 0.10, 0.20,
              "training step time", "s", "s"),
    # Passive (no tracker): threshold = the fraction of the job's progress lost while contended. A co-tenant
    # needs less than steal: its flag also needs a named command whose use rose by the margin and, for CPU
    # and disk, pressure risen with it, which the job's own slower phases do not give. A CPU-bound co-tenant
    # of two workers beside a 2-rank job on 2 cores took 19 % of its progress, under 0.20 (issue 45).
    Component(_NN, "co_tenant", "job_samples", "job_progress_percent", "higher", False, 0.10, 0.40,
              "job progress under co-tenant CPU use", "fraction", ""),
    Component(_NN, "hypervisor", "job_samples", "job_progress_percent", "higher", False, 0.20, 0.40,
              "job progress under CPU steal", "fraction", ""),
)

# What a declared value or a reference row may be for: the virtualization_overhead components, and a fabric
# link's rate (network_degraded, Gbit/s of the slower direction).
BASELINE_COMPONENTS = frozenset({c.component for c in COMPONENTS if c.kind == _VO} | {"net_pair_gbits"})
