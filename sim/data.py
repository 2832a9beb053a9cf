"""SYNTHETIC telemetry for one simulated node, encoded as real ``gpuagent.v1.Batch`` wire bytes.

Everything here is generated, never measured: values come from :mod:`gpuagent.sim.fleet`'s
nominal levels, scaled by the node's injected conditions and random noise (numpy, seeded per node, so a
fleet is reproducible whatever the number of processes).

Time model: the node covers ``[start_ns, end_ns)`` on a grid of ``interval_s`` (1 s by default). Samples
are one value per series per tick; probe runs happen every ``probe_interval_s``; job samples every
``job_sample_interval_s`` for GPUs a job holds; job steps one per rank per ``step_window_s``. Idle and
no-job periods are blocks inside each hour (minute-of-hour pattern with a per-node phase), so any one-hour
window holds the injected fractions.

Speed: the sample columns are written straight into protobuf wire format (packed varints and doubles from
numpy buffers), because building 10^8 values through the protobuf Python API would take minutes. The rest
of the batch (probe results, job rows, events) goes through the generated classes. ``tests/test_sim.py``
decodes the bytes with the generated ``Batch`` class and compares them with the arrays.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import numpy as np

from gpuagent.sim.fleet import HW_INJECT_KEYS, VIRT_COMPONENTS, NodeSpec
from gpuagent.common.resolution import needs_raw
from gpuagent.proto import pb
from gpuagent.proto.wire import length_delimited, varint

NS = 1_000_000_000
IDLE, BUSY, NO_JOB, BUSY_IDLE = 1, 0, 2, 3

HOST_METRICS = (
    ("cpu_user_percent", ()), ("cpu_system_percent", ()), ("cpu_iowait_percent", ()),
    ("cpu_steal_percent", ()), ("cpu_idle_percent", ()),
    ("psi_cpu_some_avg10_percent", ()), ("psi_io_some_avg10_percent", ()),
    ("psi_memory_some_avg10_percent", ()), ("disk_read_latency_ms", (("device", "nvme0n1"),)),
)
GPU_METRICS_FULL = ("gpu_util_percent", "gpu_memory_used_bytes", "gpu_power_watts", "gpu_temperature_celsius")
# util_gpm: utilization plus GPM SM activity, as an agent on a Hopper GPU sends them
GPU_METRIC_SETS = {"full": GPU_METRICS_FULL, "util": ("gpu_util_percent",),
                   "util_gpm": ("gpu_util_percent", "gpu_sm_active_percent")}

# Hardware-health series (docs/METRICS.md names) a node sends when it carries an inject_hw_* key
# (sim/fleet.py): a compact set, one NVLink and one IB port, enough for every hardware_fault component.
HW_GPU_SERIES = (("gpu_remapped_rows_pending", ()), ("gpu_row_remap_failure", ()), ("gpu_ecc_uncorrected_total", ()),
                 ("gpu_ecc_corrected_total", ()), ("gpu_retired_pages_total", (("cause", "double_bit_ecc"),)),
                 ("gpu_pcie_link_gen", ()), ("gpu_pcie_link_gen_max", ()), ("gpu_pcie_link_width", ()),
                 ("gpu_pcie_link_width_max", ()), ("gpu_nvlink_link_up", (("link", "0"),)),
                 ("gpu_nvlink_errors_total", (("counter", "crc_flit"), ("link", "0"))),
                 ("gpu_clock_event_duration_seconds_total", (("reason", "hw_thermal"),)),
                 ("gpu_clock_event_duration_seconds_total", (("reason", "hw_power_brake"),)))
_IB = (("device", "mlx5_0"), ("link_layer", "InfiniBand"), ("port", "1"))
HW_HOST_SERIES = (("ib_port_state", _IB),
                  ("ib_port_errors_total", (("counter", "symbol_error"), ("device", "mlx5_0"), ("port", "1"))),
                  ("net_carrier_changes_total", (("device", "eth0"),)), ("net_link_speed_mbps", (("device", "eth0"),)),
                  ("net_link_speed_max_mbps", (("device", "eth0"),)))

# Nominal node-level probe values that do not depend on the GPU model (a local NVMe, a modern x86 host).
STORAGE = {"seq_read_gbps": 6.5, "seq_write_gbps": 3.2, "rand_read_iops": 750_000.0,
           "rand_read_p50_latency_us": 85.0, "rand_read_p99_latency_us": 210.0}
HOST = {"syscall_ns": 55.0, "clock_gettime_ns": 22.0, "page_fault_ns": 260.0, "pipe_roundtrip_us": 9.0,
        "memcpy_gbps": 11.0}
PROBE_PARAMS = {
    "collective": {"backend": "nccl", "op": "all_reduce", "size_bytes": "268435456"},
    "pcie": {"size_bytes": "268435456", "pinned": "1", "iters": "20"},
    "gpu_compute": {"m": "8192", "n": "8192", "k": "8192", "dtype": "bf16"},
    "storage": {"engine": "fio", "size_bytes": "1073741824", "bs_seq": "1M", "bs_rand": "4k", "iodepth": "32"},
    "host": {"iters": "100000"},
}
# Offset of each probe inside the probe interval (s) and how long a run takes (s).
PROBE_SLOTS = {"collective": (0, 8), "pcie": (15, 2), "gpu_compute": (30, 3), "storage": (45, 25),
               "host": (80, 1)}


def encode_sample_columns(series: bytes, ts_ns: np.ndarray, n_series: int, values: np.ndarray) -> bytes:
    """Wire bytes of a SampleColumns whose rows are tick-major: for each tick, every series in id order.

    ``series`` is the serialized ``repeated Series`` part; ``values`` has shape (ticks, n_series)."""
    if len(ts_ns) == 0:
        return series
    ts_bytes = b"".join(varint(int(t)) * n_series for t in ts_ns)
    ids = b"".join(varint(i) for i in range(n_series)) * len(ts_ns)
    vals = np.ascontiguousarray(values, dtype="<f8").tobytes()
    return series + length_delimited(2, ts_bytes) + length_delimited(3, ids) + length_delimited(4, vals)


@dataclass(frozen=True, kw_only=True)
class Cadence:
    """How often a simulated node samples, batches, probes and reports job rows, and which GPU series it
    sends. Its fields are also :class:`gpuagent.sim.run.SimConfig`'s (and the CLI's) defaults."""

    interval_s: float = 1.0
    batch_s: float = 300.0
    probe_interval_s: float = 300.0
    job_sample_interval_s: float = 30.0
    step_window_s: float = 60.0
    gpu_metrics: str = "full"
    # The agent's [agent] summary_interval_s (docs/RESOLUTION.md): series no rule reads per sample travel as
    # summaries of this many seconds. 0 (the simulator's default) sends every sample raw, as agents did before.
    summary_interval_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SimTiming(Cadence):
    """A cadence over the simulated span ``[start_ns, end_ns)``."""

    start_ns: int
    end_ns: int

    @classmethod
    def over(cls, cadence: Cadence, start_ns: int, end_ns: int) -> "SimTiming":
        """``cadence`` (a SimConfig, say) over ``[start_ns, end_ns)``."""
        return cls(start_ns=start_ns, end_ns=end_ns, **{f.name: getattr(cadence, f.name) for f in fields(Cadence)})


@dataclass
class EncodedBatch:
    seq: int
    window: tuple[int, int]
    data: bytes
    n_samples: int
    n_probe_results: int
    n_job_samples: int
    n_job_steps: int
    n_events: int


class NodeSim:
    """Generates one node's batches. ``seed`` makes it reproducible; the node index is mixed in."""

    def __init__(self, node: NodeSpec, timing: SimTiming, seed: int = 0):
        self.node = node
        self.t = timing
        # zlib.crc32 is stable across processes (hash() of a str is not).
        self.rng = np.random.default_rng([seed, node.index, zlib.crc32(node.hostname.encode())])
        rng = self.rng
        self.model = node.model
        self.gpus = node.gpu_count
        span_s = (timing.end_ns - timing.start_ns) / NS
        self.minutes = max(1, int(np.ceil(span_s / 60.0)))
        # Per-minute state from a minute-of-hour pattern: idle block, busy-but-idle block, no-job block, rest busy.
        phase = int(rng.integers(60))
        moh = (np.arange(self.minutes) + phase) % 60
        n_idle = int(round(node.fraction("idle_fraction") * 60))
        n_bi = int(round(node.fraction("busy_idle_fraction") * 60))
        n_nojob = int(round(node.fraction("no_job_fraction") * 60))
        self.state = np.where(moh < n_idle, IDLE, np.where(moh < n_idle + n_bi, BUSY_IDLE,
                                                           np.where(moh < n_idle + n_bi + n_nojob, NO_JOB, BUSY)))
        self.noisy = node.noise_cv >= 0.10
        self.episode = (rng.random(self.minutes) < 0.3) if self.noisy else np.zeros(self.minutes, bool)
        self.f_in = node.fraction("input_bound_fraction")
        self.base_util = rng.uniform(88.0, 96.0, self.gpus)
        self.steal_base = node.penalty("steal") if node.penalty("steal") else (0.2 if node.virtualized else 0.0)
        # A fixed per-node, per-GPU "silicon lottery" offset (±1 %), so healthy nodes are not identical.
        self.offset = 1.0 + rng.normal(0.0, 0.01, (self.gpus + 1, 32))
        self.probe_phase = float(rng.uniform(0, timing.probe_interval_s))
        self.gpu_metrics = GPU_METRIC_SETS[timing.gpu_metrics]
        self.series = [(m, -1, dict(lbl)) for m, lbl in HOST_METRICS]
        self.series += [(m, g, {}) for g in range(self.gpus) for m in self.gpu_metrics]
        # SYNTHETIC hardware faults: one class, on one GPU (or the node's port / NIC), from one moment on
        self.hw = any(float(node.inject.get(k, 0)) for k in HW_INJECT_KEYS)
        self.hw_fault, self.hw_form = None, 0
        for key in HW_INJECT_KEYS:
            if key != "hw_series" and float(node.inject.get(key, 0)):
                self.hw_fault, self.hw_form = key[3:], int(float(node.inject[key]))
                break
        self.hw_gpu = node.index % self.gpus
        self.hw_at_ns, self.hw_base = timing.start_ns, np.zeros(3)
        self.hw_first = len(self.series)
        if self.hw:   # draws only for such nodes: every other node's random stream (and data) stays as it was
            self.hw_at_ns = timing.start_ns + int((timing.end_ns - timing.start_ns) * float(rng.uniform(0.2, 0.6)))
            self.hw_base = rng.integers(0, 50, 3).astype(float)
            self.series += [(m, g, dict(lbl)) for g in range(self.gpus) for m, lbl in HW_GPU_SERIES]
            self.series += [(m, -1, dict(lbl)) for m, lbl in HW_HOST_SERIES]
        # Resolution: the columns of the series sent raw, and of the ones summarised (common/resolution.py)
        summarise = timing.summary_interval_s > 0
        self.raw_cols = np.array([i for i, (m, _, _) in enumerate(self.series) if not summarise or needs_raw(m)],
                                 dtype=np.int64)
        self.summary_cols = np.array([i for i, (m, _, _) in enumerate(self.series) if summarise and not needs_raw(m)],
                                     dtype=np.int64)
        self.series_bytes = b"".join(
            length_delimited(1, pb.Series(id=k, metric=m, gpu=g, labels=lbl).SerializeToString())
            for k, (m, g, lbl) in enumerate(self.series[i] for i in self.raw_cols))
        self.summary_series = [pb.Series(id=k, metric=m, gpu=g, labels=lbl)
                               for k, (m, g, lbl) in enumerate(self.series[i] for i in self.summary_cols)]
        self.job_id = f"synthetic:{node.hostname}:{node.job_name}"
        self.fabric = None      # a sim.fabric.NodeFabric when the run simulates fabric probes

    # ------------------------------------------------------------------ Register

    def register_request(self, agent_version: str) -> pb.RegisterRequest:
        n, m = self.node, self.model
        virt = n.virtualized
        fp = pb.Fingerprint(
            cpuid_hypervisor_bit=virt, cpuid_hypervisor_vendor="KVMKVMKVM" if virt else "",
            dmi_sys_vendor=(f"{n.provider} (synthetic)" if virt else "Supermicro (synthetic)"),
            dmi_product_name=("gpu-8x-vm (synthetic)" if virt else "SYS-821GE-TNHR (synthetic)"),
            sys_hypervisor_type="", nvml_virtualization_mode="passthrough" if virt else "none",
            virt_type=n.virt_type, virtualized=virt, in_container=False,
            clocksource="kvm-clock" if virt else "tsc")
        gpus = [pb.GpuInfo(index=g, uuid=f"GPU-synthetic-{n.hostname}-{g}", name=m.name,
                           pci_bus_id=f"00000000:{0x18 + g * 0x10:02X}:00.0", pcie_gen_max=m.pcie_gen,
                           pcie_gen_current=m.pcie_gen, pcie_width_max=m.pcie_width,
                           pcie_width_current=m.pcie_width, memory_total_bytes=m.memory_bytes,
                           mig_mode="disabled", virtualization_mode="passthrough" if virt else "none",
                           numa_node=0 if g < self.gpus / 2 else 1)
                for g in range(self.gpus)]
        info = pb.NodeInfo(hostname=n.hostname, machine_id=n.machine_id, agent_version=agent_version,
                           labels=n.labels(), cpu_model="Synthetic x86_64 CPU (gpuagent-sim)",
                           cpu_cores_logical=192, cpu_cores_physical=96, memory_total_bytes=2048 << 30,
                           kernel="6.1.0-synthetic", driver_version="550.54.15", cuda_version="12.4",
                           gpus=gpus, fingerprint=fp, numa_nodes=2, os="gpuagent-sim (SYNTHETIC)",
                           boot_time_ns=self.t.start_ns - 86_400 * NS)
        return pb.RegisterRequest(node=info)

    # ------------------------------------------------------------------ generation

    def _minute(self, ts_ns: np.ndarray) -> np.ndarray:
        return np.minimum((ts_ns - self.t.start_ns) // (60 * NS), self.minutes - 1)

    def _util(self, state: np.ndarray, rng) -> np.ndarray:
        """GPU utilization for a (ticks, gpus) state array."""
        busy = self.base_util * (1.0 - self.f_in) + rng.normal(0.0, 3.0, state.shape)
        idle = rng.uniform(0.0, 2.0, state.shape)
        # busy but idle inside: the counter reads like a busy GPU (some kernel always runs)
        return np.clip(np.where((state == BUSY) | (state == BUSY_IDLE), busy, np.where(state == IDLE, idle, 0.0)),
                       0.0, 100.0)

    def _sm_active(self, state: np.ndarray, util: np.ndarray, rng) -> np.ndarray:
        """GPM SM activity: 70-90 % of the utilization counter when working, 1-5 % when busy but idle."""
        working = util * rng.uniform(0.7, 0.9, state.shape)
        return np.clip(np.where(state == BUSY_IDLE, rng.uniform(1.0, 5.0, state.shape), working), 0.0, 100.0)

    def samples(self, ts_ns: np.ndarray) -> np.ndarray:
        """Values of shape (ticks, series) for the given tick timestamps."""
        rng = self.rng
        T = len(ts_ns)
        minute = self._minute(ts_ns)
        st = self.state[minute]
        ep = self.episode[minute].astype(float)
        busy = (st == BUSY).astype(float)
        n = lambda sd: rng.normal(0.0, sd, T)  # noqa: E731
        user = np.clip(3.0 + 19.0 * busy + n(2.0), 0, 100)
        system = np.clip(4.0 + n(0.8), 0, 100)
        iowait = np.clip(1.0 + 25.0 * self.f_in * busy + n(0.5), 0, 100)
        steal = np.clip(self.steal_base + (4.0 * ep if self.node.virtualized else 0.0) + n(0.1), 0, 100)
        idle = np.clip(100.0 - user - system - iowait - steal, 0, 100)
        psi_cpu = np.clip(0.5 + 18.0 * ep + n(0.3), 0, 100)
        psi_io = np.clip(0.3 + 20.0 * self.f_in * busy + 8.0 * ep + n(0.2), 0, 100)
        psi_mem = np.clip(0.1 + 3.0 * ep + n(0.05), 0, 100)
        disk_lat = 0.12 * rng.lognormal(0.0, 0.2, T) + 2.0 * ep
        # Each value with the precision of the real source (docs: the sim is SYNTHETIC, its precision is not):
        # /proc/stat percentages are ratios of whole jiffies (USER_HZ 100, 192 logical CPUs, 1 s tick);
        # /proc/pressure prints avg10 with two decimals; a /proc/diskstats latency is whole ms over whole I/Os.
        jiffies = 192 * 100.0
        user, system, iowait, steal = (np.round(x * jiffies / 100.0) * 100.0 / jiffies
                                       for x in (user, system, iowait, steal))
        idle = np.clip(100.0 - user - system - iowait - steal, 0, 100)
        psi_cpu, psi_io, psi_mem = (np.round(x, 2) for x in (psi_cpu, psi_io, psi_mem))
        ios = rng.poisson(2000.0, T) + 1
        disk_lat = np.round(disk_lat * ios) / ios
        cols = [user, system, iowait, steal, idle, psi_cpu, psi_io, psi_mem, disk_lat]
        stg = np.repeat(st[:, None], self.gpus, axis=1)
        util = self._util(stg, rng)
        m = self.model
        per_gpu = {"gpu_util_percent": util}
        if "gpu_sm_active_percent" in self.gpu_metrics:
            per_gpu["gpu_sm_active_percent"] = self._sm_active(stg, util, rng)
        if "gpu_memory_used_bytes" in self.gpu_metrics:
            held = (stg != NO_JOB)
            per_gpu["gpu_memory_used_bytes"] = np.where(held, 0.86 * m.memory_bytes, 0.6 * (1 << 30)) \
                + rng.normal(0.0, 64 << 20, stg.shape).clip(-(64 << 20), 64 << 20)
            per_gpu["gpu_power_watts"] = np.clip(
                m.idle_power_watts + (m.power_limit_watts - m.idle_power_watts) * 0.92 * util / 100.0
                + rng.normal(0.0, 8.0, stg.shape), 0.0, m.power_limit_watts)
            per_gpu["gpu_temperature_celsius"] = 33.0 + 0.4 * util + rng.normal(0.0, 0.7, stg.shape)
            # NVML: memory in whole bytes, power in whole mW (reported here in W), temperature in whole °C.
            per_gpu["gpu_memory_used_bytes"] = np.round(per_gpu["gpu_memory_used_bytes"])
            per_gpu["gpu_power_watts"] = np.round(per_gpu["gpu_power_watts"] * 1000.0) / 1000.0
            per_gpu["gpu_temperature_celsius"] = np.round(per_gpu["gpu_temperature_celsius"])
        # NVML reports utilization as a whole percent.
        per_gpu["gpu_util_percent"] = np.round(util)
        out = np.empty((T, len(self.series)), dtype=np.float64)
        out[:, :len(cols)] = np.column_stack(cols)
        k = len(cols)
        for g in range(self.gpus):
            for metric in self.gpu_metrics:
                out[:, k] = per_gpu[metric][:, g]
                k += 1
        if self.hw:
            out[:, k:] = self._hardware(ts_ns)
        return out

    def _hardware(self, ts_ns: np.ndarray) -> np.ndarray:
        """The hardware series (HW_GPU_SERIES per GPU, then HW_HOST_SERIES) for these ticks: healthy and
        steady, with the node's one injected fault (sim/fleet.py HW_INJECT_KEYS) from hw_at_ns on."""
        T = len(ts_ns)
        f, form = self.hw_fault, self.hw_form
        on = (ts_ns >= self.hw_at_ns).astype(float)
        hours = (ts_ns - self.t.start_ns) / (3600.0 * NS)
        secs = hours * 3600.0
        reset = on if f == "reset" else np.zeros(T)
        cols = []
        for g in range(self.gpus):
            hit = g == self.hw_gpu
            mine = lambda fault, want: hit and f == fault and form == want  # noqa: E731
            cols += [on if mine("row_remap", 1) else np.zeros(T), on if mine("row_remap", 2) else np.zeros(T),
                     on if mine("ecc", 1) else np.zeros(T),
                     (self.hw_base[0] + np.floor(600.0 * hours if mine("ecc", 2) else 0.0)) * (1 - reset),
                     on if mine("retired_pages", 1) or mine("retired_pages", 2) else np.zeros(T),
                     np.where(on > 0, 3.0, 5.0) if mine("pcie_link", 1) else np.full(T, 5.0), np.full(T, 5.0),
                     np.where(on > 0, 8.0, 16.0) if mine("pcie_link", 2) else np.full(T, 16.0), np.full(T, 16.0),
                     1.0 - on if mine("nvlink", 1) else np.ones(T),
                     self.hw_base[1] + (np.floor(1200.0 * hours) if mine("nvlink", 2) else 0.0),
                     0.4 * secs if mine("clocks", 1) else np.zeros(T),
                     0.4 * secs if mine("clocks", 2) else np.zeros(T)]
        carrier = 2.0 + (2.0 * on + 2.0 * (ts_ns >= self.hw_at_ns + 60 * NS) if f == "eth_link" and form == 1
                         else 2.0 * on if f == "reboot" else 0.0)
        cols += [np.where(on > 0, 1.0, 4.0) if f == "ib_port" and form == 1 else np.full(T, 4.0),
                 (self.hw_base[2] + (np.floor(240.0 * hours) if f == "ib_port" and form == 2 else 0.0)) * (1 - reset),
                 carrier * (1 - reset),
                 np.where(on > 0, 25000.0, 100000.0) if f == "eth_link" and form == 2 else np.full(T, 100000.0),
                 np.full(T, 100000.0)]
        return np.column_stack([np.broadcast_to(np.asarray(c, dtype=np.float64), (T,)) for c in cols])

    def hardware_events(self, t0: int, t1: int) -> list[pb.Event]:
        """The injected fault's events in [t0, t1): XID 79 from NVML and again from the kernel log 2 s later
        (one fault), an application XID 13 of the node's job, or the agent_start of a planned reboot."""
        out = []
        at, g = self.hw_at_ns, self.hw_gpu
        if self.hw_fault == "xid":
            out += [pb.Event(ts_ns=at, kind="xid", gpu=g, value=79, message="SYNTHETIC Xid 79",
                             attrs={"xid": "79", "source": "nvml", "synthetic": "true"}),
                    pb.Event(ts_ns=at + 2 * NS, kind="xid", gpu=g, value=79,
                             message="NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus. (SYNTHETIC)",
                             attrs={"source": "kmsg", "pci_bus_id": f"00000000:{0x18 + g * 0x10:02X}:00.0",
                                    "synthetic": "true"})]
        elif self.hw_fault == "app_xid":
            out.append(pb.Event(ts_ns=at, kind="xid", gpu=g, value=13, message="SYNTHETIC Xid 13",
                                attrs={"xid": "13", "source": "nvml", "job_id": self.job_id, "synthetic": "true"}))
        elif self.hw_fault == "reboot":
            out.append(pb.Event(ts_ns=at - 60 * NS, kind="agent_start", gpu=-1,
                                message="SYNTHETIC node restarted (planned reboot)", attrs={"synthetic": "true"}))
        return [e for e in out if t0 <= e.ts_ns < t1]

    def _scaled(self, probe: str, metric: str, nominal: float, gpu: int, j: int) -> float:
        """Nominal value × per-node offset × injected penalty × run-to-run noise."""
        v = nominal * self.offset[gpu + 1, j]
        for comp, (p, metrics) in VIRT_COMPONENTS.items():
            if p != probe:
                continue
            for name, better in metrics:
                if name == metric:
                    pen = self.node.penalty(comp)
                    if better == "higher":
                        v *= 1.0 - pen / 100.0
                    elif better == "lower":
                        v *= 1.0 + pen / 100.0
        return v * max(0.05, 1.0 + self.rng.normal(0.0, self.node.noise_cv))

    def probe_nominal(self, probe: str) -> dict[str, float]:
        m, n = self.model, self.gpus
        if probe == "collective":
            return {"busbw_gbps": m.busbw_gbps, "algbw_gbps": m.busbw_gbps * n / (2.0 * (n - 1)),
                    "small_msg_latency_us": 18.0 if m.busbw_gbps > 100 else 45.0}
        if probe == "pcie":
            return {"h2d_gbps": m.h2d_gbps, "d2h_gbps": m.d2h_gbps, "bidir_gbps": 0.9 * (m.h2d_gbps + m.d2h_gbps)}
        if probe == "gpu_compute":
            return {"bf16_tflops": m.bf16_tflops, "fp32_tflops": m.fp32_tflops,
                    "launch_latency_us": m.launch_latency_us, "sync_latency_us": 2.0 * m.launch_latency_us}
        if probe == "storage":
            return dict(STORAGE)
        return dict(HOST)

    def probe_results(self, t0: int, t1: int) -> list[pb.ProbeResult]:
        """Probe runs whose start falls in [t0, t1)."""
        out = []
        iv = int(self.t.probe_interval_s * NS)
        first = self.t.start_ns + int(self.probe_phase * NS)
        k = max(0, -(-(t0 - first - 200 * NS) // iv))
        while True:
            base = first + k * iv
            if base >= t1 + 200 * NS:
                break
            k += 1
            for probe, (off, dur) in PROBE_SLOTS.items():
                start = base + off * NS
                if not t0 <= start < t1 or start >= self.t.end_ns:
                    continue
                gpus = range(self.gpus) if probe in ("pcie", "gpu_compute") else (-1,)
                for g in gpus:
                    out.append(self._probe_result(probe, g, start, start + dur * NS))
        return out

    def _probe_result(self, probe: str, gpu: int, start: int, end: int) -> pb.ProbeResult:
        env = {"synthetic": "true", "generator": "gpuagent-sim"}
        params = dict(PROBE_PARAMS[probe])
        if probe == "collective":
            params["world_size"] = str(self.gpus)
            if self.gpus < 2:
                return pb.ProbeResult(probe=probe, status="skipped", reason="one GPU: nothing to reduce",
                                      params=params, started_ns=start, ended_ns=end, env=env, gpu=-1)
        metrics = {name: self._scaled(probe, name, v, gpu, j)
                   for j, (name, v) in enumerate(self.probe_nominal(probe).items())}
        if probe == "pcie":
            metrics["numa_local"] = 1.0
        elif probe == "storage":
            metrics["o_direct"] = 1.0
        elif probe == "host":
            noisy = self.node.virtualized and self.episode[self._minute(np.array([start]))[0]]
            steal = self.steal_base + (4.0 if noisy else 0.0)
            metrics["cpu_steal_percent"] = max(0.0, steal + self.rng.normal(0.0, 0.05))
        return pb.ProbeResult(probe=probe, status="ok", params=params, metrics=metrics, started_ns=start,
                              ended_ns=end, env=env, gpu=gpu)

    def slowdown(self) -> float:
        """How much the injected penalties stretch the synthetic job's step time (a made-up, documented mix)."""
        n = self.node
        return (1.0 + 0.35 * n.penalty("collective_busbw") / 100 + 0.6 * n.penalty("gpu_compute") / 100
                + 0.05 * n.penalty("h2d") / 100 + 0.01 * n.penalty("steal"))

    def job_rows(self, t0: int, t1: int) -> tuple[list[pb.JobSample], list[pb.JobStep]]:
        """Job samples at ticks in [t0, t1) and step windows ending in (t0, t1]."""
        rng, n, m = self.rng, self.node, self.model
        js_iv = int(self.t.job_sample_interval_s * NS)
        first = self.t.start_ns + ((t0 - self.t.start_ns + js_iv - 1) // js_iv) * js_iv
        ts = np.arange(first, min(t1, self.t.end_ns), js_iv, dtype=np.int64)
        samples: list[pb.JobSample] = []
        if len(ts):
            st = self.state[self._minute(ts)]
            stg = np.repeat(st[:, None], self.gpus, axis=1)
            util = self._util(stg, rng)
            for i, t in enumerate(ts):
                if st[i] == NO_JOB:
                    continue
                for g in range(self.gpus):
                    samples.append(pb.JobSample(
                        ts_ns=int(t), job_id=self.job_id, job_name=n.job_name, source="synthetic",
                        pid=40_000 + g, rank=g, local_rank=g, world_size=self.gpus, gpu=g,
                        gpu_util_percent=float(util[i, g]), gpu_memory_bytes=0.86 * m.memory_bytes,
                        cpu_percent=float(np.clip(98.0 + rng.normal(0, 4), 0, 400)), rss_bytes=float(14 << 30),
                        read_bytes_per_s=2.0e8 * (1.0 + 2.0 * self.f_in), write_bytes_per_s=1.0e6,
                        attrs={"synthetic": "true"}))
        steps: list[pb.JobStep] = []
        w = int(self.t.step_window_s * NS)
        k0 = (t0 - self.t.start_ns) // w + 1
        end = self.t.start_ns + k0 * w
        while end <= min(t1, self.t.end_ns):
            mid = np.array([end - w // 2], dtype=np.int64)
            if self.state[self._minute(mid)[0]] == BUSY:
                for g in range(self.gpus):
                    p50 = (m.step_time_s * self.slowdown() / (1.0 - self.f_in)
                           * max(0.05, 1.0 + rng.normal(0.0, n.noise_cv)))
                    mean = p50 * 1.01
                    p95 = p50 * (1.04 + abs(rng.normal(0.0, max(n.noise_cv, 0.02))))
                    dwf = self.f_in if self.f_in > 0 else float(np.clip(0.02 + rng.normal(0, 0.005), 0, 1))
                    steps.append(pb.JobStep(
                        ts_ns=int(end), job_id=self.job_id, job_name=n.job_name, rank=g,
                        window_s=self.t.step_window_s, steps=max(1, int(round(self.t.step_window_s / mean))),
                        step_time_p50_s=p50, step_time_p95_s=p95, step_time_max_s=p95 * 1.08,
                        step_time_mean_s=mean, steps_per_s=1.0 / mean,
                        samples_per_s=m.samples_per_step / mean, tokens_per_s=m.tokens_per_step / mean,
                        data_wait_fraction=dwf, pid=40_000 + g))
            end += w
        return samples, steps

    # ------------------------------------------------------------------ batches

    def windows(self) -> list[tuple[int, int]]:
        b = int(self.t.batch_s * NS)
        return [(s, min(s + b, self.t.end_ns)) for s in range(self.t.start_ns, self.t.end_ns, b)]

    def encode(self, node_id: str, seq: int, window: tuple[int, int], created_ns: int,
               first: bool = False) -> EncodedBatch:
        t0, t1 = window
        iv = int(self.t.interval_s * NS)
        k0 = -(-(t0 - self.t.start_ns) // iv)
        ts = self.t.start_ns + np.arange(k0, (t1 - self.t.start_ns + iv - 1) // iv, dtype=np.int64) * iv
        ts = ts[ts < t1]
        values = self.samples(ts)
        probes = self.probe_results(t0, t1)
        if self.fabric is not None:
            probes += self.fabric.results(t0, t1)
        jsamples, jsteps = self.job_rows(t0, t1)
        events = []
        if first:
            events.append(pb.Event(ts_ns=t0, kind="agent_start", gpu=-1,
                                   message="SYNTHETIC node started by gpuagent-sim",
                                   attrs={"synthetic": "true"}))
        if self.hw:
            events += self.hardware_events(t0, t1)
        head = pb.Batch(node_id=node_id, seq=seq, created_ns=created_ns, probe_results=probes,
                        job_samples=jsamples, job_steps=jsteps, events=events).SerializeToString()
        raw = values[:, self.raw_cols] if len(self.summary_cols) else values
        cols = encode_sample_columns(self.series_bytes, ts, len(self.raw_cols), raw)
        data = head + length_delimited(4, cols)
        if len(self.summary_cols) and len(ts):
            data += length_delimited(9, self._summaries(ts, values[:, self.summary_cols]).SerializeToString())
        return EncodedBatch(seq, window, data, raw.size, len(probes), len(jsamples), len(jsteps), len(events))

    def _summaries(self, ts: np.ndarray, values: np.ndarray) -> pb.SummaryColumns:
        """Per-interval count, sum, min and max of each summarised series over this batch's ticks (an interval
        the batch cuts in two is summarised in each part; the collector's rollup merges them exactly)."""
        iv = int(self.t.summary_interval_s * NS)
        start = ts - ts % iv
        edges = np.flatnonzero(np.diff(start)) + 1
        bounds = np.concatenate(([0], edges, [len(ts)]))
        out = pb.SummaryColumns(interval_ns=iv, series=self.summary_series)
        k = values.shape[1]
        for a, b in zip(bounds[:-1], bounds[1:]):
            chunk = values[a:b]
            out.start_ns.extend([int(start[a])] * k)
            out.series_id.extend(range(k))
            out.count.extend([int(b - a)] * k)
            out.sum.extend(chunk.sum(axis=0).tolist())
            out.min.extend(chunk.min(axis=0).tolist())
            out.max.extend(chunk.max(axis=0).tolist())
        return out
