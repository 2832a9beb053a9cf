"""The SYNTHETIC fleet model behind ``gpuagent-sim``: which nodes exist and what is injected into each.

A fleet is a list of :class:`NodeSpec`. Build one from a named scenario (:func:`scenario_fleet`), from a
TOML scenario file (:func:`load_scenario_file`), or directly in Python (benchmarks do this so that they can
score flags against the injections).

Injected conditions (names and semantics follow docs/FLAGS.md "Simulator injection"):

- ``virt_penalty_<component>`` (percent; only on virtualized nodes): the component's higher-is-better
  metrics are multiplied by ``1 - P/100``, lower-is-better ones by ``1 + P/100``; for ``steal`` P is the CPU
  steal in percentage points. Components: see :data:`VIRT_COMPONENTS`.
- ``noise_cv``: each probe run's metrics and each step-time window are multiplied by ``1 + N(0, C)``;
  healthy nodes use :data:`HEALTHY_CV`. Noisy nodes also get bursts of CPU steal (virtualized) and PSI.
- ``idle_fraction``: the job holds the GPUs but they sit at ~0 % utilization for this share of each hour.
- ``no_job_fraction``: no job holds the GPUs for this share of each hour.
- ``busy_idle_fraction``: "busy but idle inside": the job holds the GPUs and NVML utilization reads busy
  (a kernel is always running) while GPM SM activity (``gpu_sm_active_percent``, sent with
  ``--gpu-metrics util_gpm``) is 1-5 % for this share of each hour.
- ``net_factor`` (0 < f <= 1; with ``--fabric-sweeps``): every fabric link of the node runs at f x the
  healthy rate (a bad NIC, cable or port). A bad path between two nodes is the label ``inject_net_links``
  ("peer-host:factor,...", :mod:`gpuagent.sim.fabric`).
- ``input_bound_fraction``: job steps report ``data_wait_fraction = f`` and GPU utilization is scaled by
  ``1 - f``.
- ``hw_<component>`` (1 or 2: the fault's first or second form), ``hw_reset``, ``hw_reboot``, ``hw_app_xid``,
  ``hw_series`` (1): one hardware fault (flag kind hardware_fault) or a condition that must raise none; the
  node then sends hardware series (sim/data.py; the benchmark's rows: sim/synthetic_rows.py).

Every injected condition is recorded as a node label ``inject_<name>`` (plus ``synthetic=true`` and
``pool``), so that whatever the collector computes can be scored against what was injected.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

# component -> (probe, metrics it scales, better) ; from docs/FLAGS.md's virtualization table.
# "better" is "higher" or "lower"; "points" means additive percentage points (steal).
VIRT_COMPONENTS: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "collective_busbw": ("collective", (("busbw_gbps", "higher"), ("algbw_gbps", "higher"))),
    "collective_latency": ("collective", (("small_msg_latency_us", "lower"),)),
    "h2d": ("pcie", (("h2d_gbps", "higher"),)),
    "d2h": ("pcie", (("d2h_gbps", "higher"),)),
    "gpu_compute": ("gpu_compute", (("bf16_tflops", "higher"), ("fp32_tflops", "higher"))),
    "launch_latency": ("gpu_compute", (("launch_latency_us", "lower"), ("sync_latency_us", "lower"))),
    "storage_seq_read": ("storage", (("seq_read_gbps", "higher"),)),
    "storage_seq_write": ("storage", (("seq_write_gbps", "higher"),)),
    "storage_rand_read": ("storage", (("rand_read_iops", "higher"), ("rand_read_p50_latency_us", "lower"),
                                      ("rand_read_p99_latency_us", "lower"))),
    "host_syscall": ("host", (("syscall_ns", "lower"), ("pipe_roundtrip_us", "lower"))),
    "host_timer": ("host", (("clock_gettime_ns", "lower"),)),
    "steal": ("host", (("cpu_steal_percent", "points"),)),
}

FRACTIONS = ("idle_fraction", "no_job_fraction", "input_bound_fraction", "busy_idle_fraction")
# Hardware faults (issue 23, flag kind hardware_fault): inject_hw_<component> = 1 (the first form) or 2 (the
# second form) of sim.synthetic_rows.hardware_rows; hw_reset, hw_reboot and hw_app_xid = 1 are conditions that
# must raise nothing (a counter reset, a planned reboot's link flap, an application XID of one job).
HW_COMPONENTS = ("xid", "ecc", "row_remap", "retired_pages", "nvlink", "pcie_link", "clocks", "ib_port", "eth_link")
# hw_series = 1 alone: the node sends the hardware series, healthy (any other hw_ key implies them).
HW_INJECT_KEYS = tuple(f"hw_{c}" for c in HW_COMPONENTS) + ("hw_reset", "hw_reboot", "hw_app_xid", "hw_series")
INJECT_KEYS = (tuple(f"virt_penalty_{c}" for c in VIRT_COMPONENTS) + ("noise_cv",) + FRACTIONS + ("net_factor",)
               + HW_INJECT_KEYS)
HEALTHY_CV = 0.02


@dataclass(frozen=True)
class GpuModel:
    """Nominal (synthetic) probe levels for one hardware class. Round numbers in the range public
    spec sheets and nccl-tests/nvbandwidth reports give; they are a simulator's inputs, not measurements."""

    key: str
    name: str
    pcie_gen: int
    pcie_width: int
    memory_bytes: int
    power_limit_watts: float
    idle_power_watts: float
    h2d_gbps: float
    d2h_gbps: float
    bf16_tflops: float
    fp32_tflops: float
    launch_latency_us: float
    busbw_gbps: float          # 8-GPU all-reduce bus bandwidth at the largest size
    step_time_s: float         # the synthetic job's step time on this model
    tokens_per_step: int = 8192   # per GPU (rank)
    samples_per_step: int = 2


GPU_MODELS: dict[str, GpuModel] = {m.key: m for m in (
    GpuModel("h100-sxm", "NVIDIA H100 80GB HBM3", 5, 16, 80 << 30, 700.0, 70.0,
             53.0, 52.0, 700.0, 50.0, 4.0, 360.0, 0.90),
    GpuModel("a100-sxm", "NVIDIA A100-SXM4-80GB", 4, 16, 80 << 30, 400.0, 55.0,
             25.0, 26.0, 260.0, 19.0, 5.0, 230.0, 2.30),
    GpuModel("l40s", "NVIDIA L40S", 4, 16, 48 << 30, 350.0, 35.0,
             25.0, 26.0, 180.0, 80.0, 5.5, 22.0, 3.10),
)}


@dataclass(frozen=True)
class NodeSpec:
    """One synthetic node and the conditions injected into it."""

    index: int
    hostname: str
    pool: str
    virtualized: bool
    gpu_model: str = "h100-sxm"
    gpu_count: int = 8
    provider: str = "on-prem"
    region: str = "sim-1"
    price_per_gpu_hour: float | None = 2.50
    virt_type: str = ""                       # default: "kvm" when virtualized, else "none"
    inject: Mapping[str, float] = field(default_factory=dict)
    job_name: str = "llama-8b-pretrain"
    extra_labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def model(self) -> GpuModel:
        return GPU_MODELS[self.gpu_model]

    def penalty(self, component: str) -> float:
        return float(self.inject.get(f"virt_penalty_{component}", 0.0))

    @property
    def noise_cv(self) -> float:
        return float(self.inject.get("noise_cv", HEALTHY_CV))

    def fraction(self, name: str) -> float:
        return float(self.inject.get(name, 0.0))

    @property
    def machine_id(self) -> str:
        return f"synthetic-{self.hostname}"

    def labels(self) -> dict[str, str]:
        """Node labels sent at Register: synthetic=true, pool, price and every injected condition."""
        out = {"synthetic": "true", "pool": self.pool, "provider": self.provider, "region": self.region,
               "gpu_model_class": self.gpu_model}
        if self.price_per_gpu_hour is not None:
            out["price_per_gpu_hour"] = f"{self.price_per_gpu_hour:g}"
        for key in INJECT_KEYS:
            if key in self.inject:
                out[f"inject_{key}"] = f"{float(self.inject[key]):g}"
        out.update({str(k): str(v) for k, v in self.extra_labels.items()})
        return out


class ScenarioError(ValueError):
    """A scenario or injection that cannot be simulated; the message is one sentence for the user."""


def validate(node: NodeSpec) -> NodeSpec:
    """Reject what the simulator cannot honour, with a sentence naming the node."""
    if node.gpu_model not in GPU_MODELS:
        raise ScenarioError(f"{node.hostname}: unknown gpu_model {node.gpu_model!r} "
                            f"(known: {', '.join(sorted(GPU_MODELS))})")
    if not 1 <= node.gpu_count <= 16:
        raise ScenarioError(f"{node.hostname}: gpu_count must be 1..16, got {node.gpu_count}")
    for key, value in node.inject.items():
        if key not in INJECT_KEYS:
            raise ScenarioError(f"{node.hostname}: unknown injection {key!r} "
                                f"(known: {', '.join(INJECT_KEYS)})")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ScenarioError(f"{node.hostname}: injection {key} must be a number, got {value!r}") from None
        if key.startswith("virt_penalty_"):
            if v and not node.virtualized:
                raise ScenarioError(f"{node.hostname}: {key} needs a virtualized node "
                                    f"(pool {node.pool!r} is bare metal)")
            if not 0 <= v <= 95:
                raise ScenarioError(f"{node.hostname}: {key} must be between 0 and 95 percent, got {v:g}")
        elif key == "noise_cv" and not 0 <= v <= 1:
            raise ScenarioError(f"{node.hostname}: noise_cv must be between 0 and 1, got {v:g}")
        elif key == "net_factor" and not 0 < v <= 1:
            raise ScenarioError(f"{node.hostname}: net_factor must be in (0, 1], got {v:g}")
        elif key in HW_INJECT_KEYS and v not in (0, 1, 2):
            raise ScenarioError(f"{node.hostname}: {key} must be 0 (none), 1 or 2 (the fault's first or second "
                                f"form), got {v:g}")
        elif key in FRACTIONS and not 0 <= v <= 1:
            raise ScenarioError(f"{node.hostname}: {key} must be between 0 and 1, got {v:g}")
    if node.fraction("idle_fraction") + node.fraction("no_job_fraction") > 1:
        raise ScenarioError(f"{node.hostname}: idle_fraction + no_job_fraction must not exceed 1")
    if node.fraction("idle_fraction") + node.fraction("no_job_fraction") + node.fraction("busy_idle_fraction") > 1:
        raise ScenarioError(f"{node.hostname}: idle_fraction + no_job_fraction + busy_idle_fraction must not exceed 1")
    if not node.virt_type:
        node = replace(node, virt_type="kvm" if node.virtualized else "none")
    return node


def hostname(prefix: str, index: int) -> str:
    return f"{prefix}-{index + 1:04d}"


# ------------------------------------------------------------------------------------- named scenarios

POOL_DEFAULTS: dict[str, dict[str, Any]] = {
    "bare-metal": dict(virtualized=False, provider="on-prem", price_per_gpu_hour=2.20),
    "cloud-a": dict(virtualized=True, provider="cloud-a", price_per_gpu_hour=3.90),
    "cloud-b": dict(virtualized=True, provider="cloud-b", price_per_gpu_hour=2.90),
}


def scenario_fleet(name: str, nodes: int, seed: int = 0, prefix: str = "sim",
                   gpu_model: str = "h100-sxm", gpu_count: int = 8) -> list[NodeSpec]:
    """A named mix of pools and injections.

    - ``healthy``: every node bare metal, nothing injected.
    - ``mixed``: 40 % ``bare-metal`` (healthy), 30 % ``cloud-a`` (slower PCIe copies: H2D/D2H −18…−25 %),
      30 % ``cloud-b`` (collective busbw −15…−22 %, storage −30 %, 3 pp steal on some nodes); across the
      fleet some noisy nodes (CV 0.25), some idle, no-job and input-bound GPUs. Injections stay clear of the
      flag thresholds (0 or ≥ 15 %, ≥ 0.2 CV, ≥ 0.4 fractions) so that scoring is unambiguous.
    """
    if nodes < 1:
        raise ScenarioError("--nodes must be at least 1")
    rng = random.Random(seed)
    out: list[NodeSpec] = []
    if name == "healthy":
        for i in range(nodes):
            out.append(NodeSpec(i, hostname(prefix, i), "bare-metal", gpu_model=gpu_model, gpu_count=gpu_count,
                                **POOL_DEFAULTS["bare-metal"]))
        return [validate(n) for n in out]
    if name != "mixed":
        raise ScenarioError(f"unknown scenario {name!r} (known: healthy, mixed)")
    n_bare = max(1, round(nodes * 0.4)) if nodes >= 3 else nodes
    n_a = round((nodes - n_bare) / 2)
    pools = ["bare-metal"] * n_bare + ["cloud-a"] * n_a + ["cloud-b"] * (nodes - n_bare - n_a)
    for i, pool in enumerate(pools):
        inject: dict[str, float] = {}
        if pool == "cloud-a":
            p = float(rng.choice((18, 20, 22, 25)))
            inject.update(virt_penalty_h2d=p, virt_penalty_d2h=p)
        elif pool == "cloud-b":
            inject.update(virt_penalty_collective_busbw=float(rng.choice((15, 18, 22))),
                          virt_penalty_storage_seq_read=30.0)
            if rng.random() < 0.3:
                inject["virt_penalty_steal"] = 3.0
        r = rng.random()
        if r < 0.10:
            inject["noise_cv"] = 0.25
        elif r < 0.18:
            inject["idle_fraction"] = 0.5
        elif r < 0.24:
            inject["no_job_fraction"] = 0.5
        elif r < 0.30:
            inject["input_bound_fraction"] = 0.45
        out.append(NodeSpec(i, hostname(prefix, i), pool, gpu_model=gpu_model, gpu_count=gpu_count,
                            inject=inject, **POOL_DEFAULTS[pool]))
    return [validate(n) for n in out]


# ------------------------------------------------------------------------------------- scenario files

_NODE_KEYS = {"pool", "virtualized", "gpu_model", "gpu_count", "provider", "region", "price_per_gpu_hour",
              "virt_type", "job_name", "labels", "inject"}


def _node_fields(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    unknown = set(table) - _NODE_KEYS - {"name", "nodes", "hostname", "index"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    out = {k: v for k, v in table.items() if k in _NODE_KEYS}
    if "labels" in out:
        out["extra_labels"] = {str(k): str(v) for k, v in dict(out.pop("labels")).items()}
    if "inject" in out:
        if not isinstance(out["inject"], Mapping):
            raise ScenarioError(f"{where}: inject must be a table, e.g. inject = {{ noise_cv = 0.3 }}")
        out["inject"] = {str(k).removeprefix("inject_"): v for k, v in out["inject"].items()}
    return out


def fleet_from_dict(doc: Mapping[str, Any], prefix: str = "sim", source: str = "scenario") -> list[NodeSpec]:
    """Build a fleet from a parsed scenario document (see :func:`load_scenario_file`)."""
    defaults = _node_fields(doc.get("defaults", {}), f"{source} [defaults]")
    pools = doc.get("pools", [])
    if not pools:
        raise ScenarioError(f"{source}: needs at least one [[pools]] table with name and nodes")
    fleet: list[NodeSpec] = []
    for p in pools:
        name = p.get("name")
        count = p.get("nodes")
        if not isinstance(name, str) or not isinstance(count, int) or count < 0:
            raise ScenarioError(f"{source}: every [[pools]] needs name (text) and nodes (a count ≥ 0)")
        fields = {**defaults, **_node_fields(p, f"{source} pool {name!r}")}
        inject = {**defaults.get("inject", {}), **fields.pop("inject", {})}
        if "virtualized" not in fields:
            if name not in POOL_DEFAULTS:
                raise ScenarioError(f"{source}: pool {name!r} needs virtualized = true or false")
            fields["virtualized"] = POOL_DEFAULTS[name]["virtualized"]
        for _ in range(count):
            i = len(fleet)
            fleet.append(NodeSpec(i, hostname(prefix, i), name, inject=dict(inject),
                                  **{k: v for k, v in fields.items() if k != "pool"}))
    by_host = {n.hostname: n for n in fleet}
    for o in doc.get("nodes", []):
        key = o.get("hostname") or (hostname(prefix, o["index"]) if isinstance(o.get("index"), int) else None)
        if key not in by_host:
            raise ScenarioError(f"{source}: [[nodes]] override names no node of this fleet "
                                f"(hostname {o.get('hostname')!r}, index {o.get('index')!r})")
        base = by_host[key]
        fields = _node_fields(o, f"{source} node {key}")
        inject = {**base.inject, **fields.pop("inject", {})}
        by_host[key] = replace(base, inject=inject, **fields)
    try:
        return [validate(by_host[n.hostname]) for n in fleet]
    except TypeError as exc:  # a value of the wrong type for a NodeSpec field
        raise ScenarioError(f"{source}: {exc}") from None


def load_scenario_file(path: str, prefix: str = "sim") -> list[NodeSpec]:
    """Read a TOML scenario. Example::

        [defaults]
        gpu_model = "h100-sxm"          # h100-sxm, a100-sxm, l40s
        gpu_count = 8

        [[pools]]
        name = "bare-metal"
        nodes = 3
        virtualized = false
        price_per_gpu_hour = 2.2

        [[pools]]
        name = "cloud-a"
        nodes = 2
        virtualized = true
        price_per_gpu_hour = 3.9
        inject = { virt_penalty_h2d = 20, virt_penalty_d2h = 20 }

        [[nodes]]                       # per-node overrides, by hostname or 0-based index
        hostname = "sim-0004"
        inject = { noise_cv = 0.3, idle_fraction = 0.5 }
    """
    try:
        import tomllib  # noqa: PLC0415
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]  # noqa: PLC0415
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario file {path} is not valid TOML: {exc}") from None
    return fleet_from_dict(doc, prefix=prefix, source=path)
