"""``gpuagent-sim``: a SYNTHETIC fleet that speaks the real agent protocol to a real collector.

For tests, benchmarks and demos. Each simulated node calls ``Register`` (hostname ``sim-0001`` ...,
labels ``synthetic=true``, ``pool`` and ``inject_*``) and then ``Stream``s real ``gpuagent.v1.Batch``
messages; the collector stores them like any agent's, and nothing distinguishes them except those labels —
which is the point: the analyzer's flags can be scored against the ``inject_*`` labels.

Time: by default the simulator *backfills* ``--sim-hours`` ending now (timestamps in the past, sent as fast
as the collector acks, or paced with ``--speed`` sim-seconds per wall-second). ``--duration S`` instead
runs live: timestamps start now and each batch is sent when its window has elapsed.

How to inject per-node conditions (see :mod:`gpuagent.sim.fleet` for their exact semantics):

- from Python: build ``NodeSpec(index, hostname, pool, virtualized, inject={"virt_penalty_h2d": 20,
  "noise_cv": 0.3, "idle_fraction": 0.5, ...})`` and call ``run_sim(SimConfig(...), fleet)``;
- from a TOML file: ``gpuagent-sim --scenario-file fleet.toml`` (format in ``load_scenario_file``);
- from a named mix: ``--scenario mixed`` or ``--scenario healthy``.

Efficiency: one process (or ``--procs N``) drives all its nodes from one asyncio event loop over one gRPC
channel, with at most ``--streams`` RPCs in flight; sample columns are encoded straight to wire bytes.

Delivery follows the agent's rules (:mod:`gpuagent.common.retry`: the same RPC paths, retryable codes and
backoff with jitter), so a collector sees what a real fleet would send it after a hiccup. Unlike the
agent, a simulated node gives up after ``retries`` attempts and the run stops on refused credentials: a
one-shot load generator must end.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import click
import grpc

from gpuagent.common.retry import REFUSED, RETRYABLE, STREAM_METHOD, Backoff
from gpuagent.proto import pb, pb_grpc
from gpuagent.proto.wire import bearer_metadata
from gpuagent.common.resolution import valid_summary_interval
from gpuagent.sim.data import GPU_METRIC_SETS, NS, Cadence, NodeSim, SimTiming
from gpuagent.sim.fabric import FabricSim, NodeFabric, link_factors
from gpuagent.sim.fleet import GPU_MODELS, NodeSpec, ScenarioError, load_scenario_file, scenario_fleet, validate

AGENT_VERSION = "gpuagent-sim/0.1.0 (SYNTHETIC)"
# A simulated node's first resend comes 0.1-0.2 s after a failure, later ones at most 5 s apart: short,
# because a backfill run is waiting on it, and jittered like the agent's so nodes do not resend in lockstep.
RESEND_BACKOFF_S = (0.2, 5.0)


class SimError(RuntimeError):
    """The simulation could not run at all (collector unreachable, refused credentials); one sentence."""


@dataclass(frozen=True, kw_only=True)
class SimConfig(Cadence):
    """What to simulate and where to send it; the cadence fields come from :class:`Cadence`."""

    collector: str = "127.0.0.1:7443"
    token: str | None = None
    nodes: int = 10
    scenario: str = "mixed"
    scenario_file: str | None = None
    seed: int = 0
    sim_hours: float = 1.0
    duration_s: float | None = None       # live mode when set
    speed: float = 0.0                    # sim-seconds per wall-second; 0 = as fast as the collector acks
    gpu_model: str = "h100-sxm"
    gpus: int = 8
    streams: int = 16
    procs: int = 1
    prefix: str = "sim"
    end_ns: int | None = None             # backfill end (default: now); fixes timestamps for tests
    connect_timeout_s: float = 15.0
    retries: int = 3
    fabric_sweeps: int = 0                # full pair-wise net_pair sweeps per pool over the span (0: none)
    fabric_gbits: float = 25.0            # a healthy link's SYNTHETIC rate, Gbit/s each way
    fabric_scope: str = "pool"            # node label whose values the pairs never cross (the [fabric] scope_key)


@dataclass
class SimSummary:
    """What was sent and acknowledged. Counts are of SYNTHETIC rows."""

    nodes: int = 0
    nodes_ok: int = 0
    batches_sent: int = 0
    batches_acked: int = 0
    duplicates: int = 0
    samples: int = 0
    probe_results: int = 0
    job_samples: int = 0
    job_steps: int = 0
    events: int = 0
    bytes_sent: int = 0
    retries: int = 0
    sim_start_ns: int = 0
    sim_end_ns: int = 0
    wall_s: float = 0.0
    pools: dict[str, int] = field(default_factory=dict)
    node_ids: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    synthetic: bool = True

    def merge(self, other: "SimSummary") -> None:
        for k in ("nodes", "nodes_ok", "batches_sent", "batches_acked", "duplicates", "samples", "probe_results",
                  "job_samples", "job_steps", "events", "bytes_sent", "retries"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.node_ids.update(other.node_ids)
        self.errors.extend(other.errors)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["samples_per_s"] = round(self.samples_per_s, 1)
        return d


def build_fleet(config: SimConfig) -> list[NodeSpec]:
    """The fleet a config describes (scenario file wins over the named scenario)."""
    if config.scenario_file:
        return load_scenario_file(config.scenario_file, prefix=config.prefix)
    return scenario_fleet(config.scenario, config.nodes, seed=config.seed, prefix=config.prefix,
                          gpu_model=config.gpu_model, gpu_count=config.gpus)


def _span(config: SimConfig) -> tuple[int, int, bool]:
    """(start_ns, end_ns, live)."""
    if config.duration_s is not None:
        start = (time.time_ns() // NS) * NS
        return start, start + int(config.duration_s * NS), True
    end = config.end_ns if config.end_ns is not None else (time.time_ns() // NS) * NS
    return end - int(config.sim_hours * 3600 * NS), end, False


def validate_config(config: SimConfig) -> None:
    checks = [
        (config.sim_hours > 0, "--sim-hours must be positive"),
        (config.duration_s is None or config.duration_s > 0, "--duration must be positive"),
        (config.speed >= 0, "--speed must be 0 (as fast as possible) or positive"),
        (config.duration_s is None or config.speed == 0,
         "--speed paces a --sim-hours backfill; --duration always runs in real time"),
        (config.interval_s > 0, "--interval-s must be positive"),
        (config.batch_s >= config.interval_s, "--batch-s must be at least --interval-s"),
        (config.probe_interval_s >= 120, "--probe-interval-s must be at least 120 (a probe round takes ~105 s)"),
        (0 < config.job_sample_interval_s <= 60, "--job-sample-interval-s must be in (0, 60] "
                                                 "(the analyzer needs a job sample per held GPU per minute)"),
        (config.step_window_s > 0, "--step-window-s must be positive"),
        (valid_summary_interval(config.summary_interval_s),
         "--summary-interval-s must be 0 (every sample raw) or a whole number of seconds that divides a minute"),
        (config.streams >= 1 and config.procs >= 1, "--streams and --procs must be at least 1"),
        (config.gpu_metrics in GPU_METRIC_SETS, f"--gpu-metrics must be one of {', '.join(sorted(GPU_METRIC_SETS))}"),
        (config.fabric_sweeps >= 0, "--fabric-sweeps must not be negative"),
        (config.fabric_gbits > 0, "--fabric-gbits must be positive"),
        (config.gpu_model in GPU_MODELS, f"--gpu-model must be one of {', '.join(sorted(GPU_MODELS))}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ScenarioError(msg)


# ----------------------------------------------------------------------------------- one process


class _Runner:
    """Drives a slice of the fleet from one event loop and one channel."""

    def __init__(self, config: SimConfig, start_ns: int, end_ns: int, live: bool, fabric=None):
        self.c = config
        self.fabric = fabric    # (FabricSim, schedule, {hostname: NodeSpec}, node ids, link factors) or None
        self.timing = SimTiming.over(config, start_ns, end_ns)
        self.live = live
        self.summary = SimSummary(sim_start_ns=start_ns, sim_end_ns=end_ns)
        self.metadata = bearer_metadata(config.token) or None
        self.wall0 = time.monotonic()
        self.fatal: str | None = None

    async def run(self, fleet: list[NodeSpec]) -> SimSummary:
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(self.c.collector, options=opts) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.c.connect_timeout_s)
            except asyncio.TimeoutError:
                raise SimError(f"cannot reach the collector at {self.c.collector} "
                               f"within {self.c.connect_timeout_s:g} s") from None
            self.register = pb_grpc.CollectorStub(channel).Register
            # Identity serializer: the batches are already wire bytes.
            self.stream = channel.stream_stream(STREAM_METHOD, request_serializer=None,
                                                response_deserializer=pb.Ack.FromString)
            self.sem = asyncio.Semaphore(self.c.streams)
            await asyncio.gather(*(self._node(n) for n in fleet))
        if self.fatal:
            raise SimError(self.fatal)
        return self.summary

    async def _node(self, node: NodeSpec) -> None:
        s = self.summary
        s.nodes += 1
        sim = NodeSim(node, self.timing, seed=self.c.seed)
        if self.fabric is not None:
            fs, schedule, by_host, ids, links = self.fabric
            sim.fabric = NodeFabric(fs, node.hostname, schedule.get(node.hostname, []), by_host, ids, links)
        try:
            async with self.sem:
                if self.fatal:
                    return
                resp = await self.register(sim.register_request(AGENT_VERSION), metadata=self.metadata,
                                           timeout=60)
        except grpc.aio.AioRpcError as exc:
            self._error(node, "Register", exc)
            return
        node_id, seq = resp.node_id, resp.last_committed_seq
        s.node_ids[node.hostname] = node_id
        windows = sim.windows()
        groups = [windows] if not self.live and self.c.speed == 0 else [[w] for w in windows]
        first = True
        for group in groups:
            if self.live or self.c.speed > 0:
                speed = 1.0 if self.live else self.c.speed
                due = self.wall0 + (group[-1][1] - self.timing.start_ns) / NS / speed
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            batches = []
            for w in group:
                seq += 1
                batches.append((seq, w, first))
                first = False
            if not await self._flush(node, sim, node_id, batches):
                return
        s.nodes_ok += 1

    async def _flush(self, node: NodeSpec, sim: NodeSim, node_id: str, batches) -> bool:
        """Send batches on one Stream until all are acked; resend unacked ones on retryable errors."""
        s = self.summary
        encoded: dict[int, object] = {}
        pending = list(batches)
        backoff = Backoff(*RESEND_BACKOFF_S)
        for attempt in range(self.c.retries + 1):
            acked: set[int] = set()

            async def requests():
                for seq, w, first in pending:
                    if seq not in encoded:
                        encoded[seq] = sim.encode(node_id, seq, w, time.time_ns(), first=first)
                    b = encoded[seq]
                    s.batches_sent += 1
                    s.bytes_sent += len(b.data)
                    yield b.data

            try:
                async with self.sem:
                    if self.fatal:
                        return False
                    call = self.stream(requests(), metadata=self.metadata)
                    async for ack in call:
                        if ack.seq in encoded and ack.seq not in acked:
                            acked.add(ack.seq)
                            b = encoded.pop(ack.seq)
                            s.batches_acked += 1
                            s.duplicates += int(ack.duplicate)
                            s.samples += b.n_samples
                            s.probe_results += b.n_probe_results
                            s.job_samples += b.n_job_samples
                            s.job_steps += b.n_job_steps
                            s.events += b.n_events
                pending = [p for p in pending if p[0] not in acked]
                if not pending:
                    return True
                exc_text = "the stream ended before every batch was acknowledged"
            except grpc.aio.AioRpcError as exc:
                pending = [p for p in pending if p[0] not in acked]
                if exc.code() not in RETRYABLE or attempt == self.c.retries:
                    self._error(node, "Stream", exc)
                    return False
                exc_text = exc.details()
            s.retries += 1
            await asyncio.sleep(backoff.next_wait())
        s.errors.append(f"{node.hostname}: Stream: {exc_text}")
        return False

    def _error(self, node: NodeSpec, rpc: str, exc: grpc.aio.AioRpcError) -> None:
        msg = f"{node.hostname}: {rpc} failed: {exc.code().name}: {exc.details()}"
        self.summary.errors.append(msg)
        if exc.code() in REFUSED:
            self.fatal = f"the collector at {self.c.collector} refused the credentials: {exc.details()}"
        elif exc.code() == grpc.StatusCode.UNAVAILABLE and rpc == "Register":
            self.fatal = f"cannot reach the collector at {self.c.collector}: {exc.details()}"


def _run_slice(config: SimConfig, fleet: list[NodeSpec], start_ns: int, end_ns: int, live: bool,
               fabric=None) -> SimSummary:
    return asyncio.run(_Runner(config, start_ns, end_ns, live, fabric).run(fleet))


async def _register_all(config: SimConfig, fleet: list[NodeSpec], start_ns: int) -> dict[str, str]:
    """{hostname: node_id}: fabric results name both ends by the collector's node ids."""
    metadata = bearer_metadata(config.token) or None
    timing = SimTiming.over(config, start_ns, start_ns + NS)
    async with grpc.aio.insecure_channel(config.collector) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), config.connect_timeout_s)
        except asyncio.TimeoutError:
            raise SimError(f"cannot reach the collector at {config.collector} "
                           f"within {config.connect_timeout_s:g} s") from None
        register = pb_grpc.CollectorStub(channel).Register
        sem = asyncio.Semaphore(config.streams)

        async def one(node: NodeSpec) -> tuple[str, str]:
            async with sem:
                try:
                    resp = await register(NodeSim(node, timing, seed=config.seed).register_request(AGENT_VERSION),
                                          metadata=metadata, timeout=60)
                except grpc.aio.AioRpcError as exc:
                    raise SimError(f"{node.hostname}: Register failed: {exc.code().name}: {exc.details()}") from None
            return node.hostname, resp.node_id

        return dict(await asyncio.gather(*(one(n) for n in fleet)))


def _fabric_inputs(config: SimConfig, fleet: list[NodeSpec], start_ns: int, end_ns: int):
    links = link_factors(fleet)
    ids = asyncio.run(_register_all(config, fleet, start_ns))
    fs = FabricSim(sweeps=config.fabric_sweeps, gbits=config.fabric_gbits, seed=config.seed,
                   scope_key=config.fabric_scope)
    return fs, fs.schedule(fleet, start_ns, end_ns), {n.hostname: n for n in fleet}, ids, links


def run_sim(config: SimConfig, fleet: list[NodeSpec] | None = None) -> SimSummary:
    """Run a SYNTHETIC fleet against ``config.collector`` and return what was sent and acked.

    ``fleet`` defaults to :func:`build_fleet`; a given fleet is validated (and completed) node by node.
    Raises :class:`ScenarioError` for an impossible scenario and :class:`SimError` when the collector cannot
    be reached or refuses the credentials. Per-node stream errors do not stop the others; they are listed in
    ``summary.errors``.
    """
    validate_config(config)
    fleet = build_fleet(config) if fleet is None else [validate(n) for n in fleet]
    if not fleet:
        raise ScenarioError("the fleet has no nodes")
    start_ns, end_ns, live = _span(config)
    wall0 = time.monotonic()
    fabric = _fabric_inputs(config, fleet, start_ns, end_ns) if config.fabric_sweeps else None
    procs = max(1, min(config.procs, len(fleet)))
    if procs == 1:
        summary = _run_slice(config, fleet, start_ns, end_ns, live, fabric)
    else:
        slices = [fleet[i::procs] for i in range(procs)]
        summary = SimSummary(sim_start_ns=start_ns, sim_end_ns=end_ns)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold gRPC state
        with ProcessPoolExecutor(max_workers=procs, mp_context=ctx) as ex:
            futures = [ex.submit(_run_slice, config, sl, start_ns, end_ns, live, fabric) for sl in slices]
            for f in futures:
                summary.merge(f.result())
    summary.pools = dict(Counter(n.pool for n in fleet))
    summary.wall_s = time.monotonic() - wall0
    return summary


# ----------------------------------------------------------------------------------- CLI


def _describe(fleet: list[NodeSpec]) -> list[str]:
    lines = []
    for n in fleet:
        inj = ", ".join(f"{k}={v:g}" for k, v in sorted(n.inject.items())) or "nothing injected"
        lines.append(f"SYNTHETIC {n.hostname} pool={n.pool} {'virtualized' if n.virtualized else 'bare-metal'} "
                     f"{n.gpu_count}x{n.gpu_model}: {inj}")
    return lines


# The CLI shows and uses the library's defaults: one place to change them.
_DEFAULTS = SimConfig()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--collector", envvar="GPUAGENT_COLLECTOR", default=_DEFAULTS.collector,
              help="collector HOST:PORT")
@click.option("--token", envvar=["GPUAGENT_TOKEN", "GPUAGENT_COLLECTOR_TOKEN"], default=None,
              help="bearer token for the collector [env GPUAGENT_TOKEN or GPUAGENT_COLLECTOR_TOKEN]")
@click.option("--nodes", type=int, default=_DEFAULTS.nodes, help="number of simulated nodes (named scenarios)")
@click.option("--scenario", default=_DEFAULTS.scenario, help="named mix: mixed or healthy")
@click.option("--scenario-file", type=click.Path(dir_okay=False), default=None,
              help="TOML file with pools and per-node injections (overrides --scenario/--nodes)")
@click.option("--seed", type=int, default=_DEFAULTS.seed)
@click.option("--sim-hours", type=float, default=_DEFAULTS.sim_hours,
              help="backfill this much simulated time ending now")
@click.option("--duration", "duration_s", type=float, default=None,
              help="run live for this many seconds instead of backfilling")
@click.option("--speed", type=float, default=_DEFAULTS.speed,
              help="backfill pace in sim-seconds per wall-second (0: as fast as the collector acks)")
@click.option("--interval-s", type=float, default=_DEFAULTS.interval_s, help="sample interval")
@click.option("--batch-s", type=float, default=_DEFAULTS.batch_s, help="simulated seconds per batch")
@click.option("--probe-interval-s", type=float, default=_DEFAULTS.probe_interval_s)
@click.option("--job-sample-interval-s", type=float, default=_DEFAULTS.job_sample_interval_s)
@click.option("--step-window-s", type=float, default=_DEFAULTS.step_window_s)
@click.option("--gpu-metrics", type=click.Choice(sorted(GPU_METRIC_SETS)), default=_DEFAULTS.gpu_metrics,
              help="per-GPU series: util, memory, power, temperature (full) or util only")
@click.option("--summary-interval-s", type=float, default=_DEFAULTS.summary_interval_s,
              help="summarise the series no rule reads per sample over this many seconds, as the agent's default "
                   "(60) does; 0 sends every sample raw (docs/RESOLUTION.md)")
@click.option("--gpu-model", type=click.Choice(sorted(GPU_MODELS)), default=_DEFAULTS.gpu_model)
@click.option("--gpus", type=int, default=_DEFAULTS.gpus, help="GPUs per node (named scenarios)")
@click.option("--streams", type=int, default=_DEFAULTS.streams, help="RPCs in flight per process")
@click.option("--procs", type=int, default=_DEFAULTS.procs, help="worker processes")
@click.option("--prefix", default=_DEFAULTS.prefix, help="hostname prefix (sim-0001, ...)")
@click.option("--connect-timeout", "connect_timeout_s", type=float, default=_DEFAULTS.connect_timeout_s,
              help="seconds to wait for the collector to answer")
@click.option("--fabric-sweeps", type=int, default=_DEFAULTS.fabric_sweeps,
              help="SYNTHETIC net_pair sweeps (every pair of each pool) over the span, reported by both ends")
@click.option("--fabric-gbits", type=float, default=_DEFAULTS.fabric_gbits,
              help="a healthy link's SYNTHETIC rate, Gbit/s each way")
@click.option("--fabric-scope", default=_DEFAULTS.fabric_scope,
              help="node label whose values fabric pairs never cross (e.g. a rack label)")
@click.option("--dry-run", is_flag=True, help="print the fleet and its injections, send nothing")
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def main(dry_run: bool, as_json: bool, **kw) -> None:
    """Start a SYNTHETIC fleet of agents that stream generated telemetry to a real collector."""
    config = SimConfig(**kw)
    try:
        validate_config(config)
        fleet = build_fleet(config)
    except ScenarioError as exc:
        raise click.ClickException(str(exc)) from None
    pools = Counter(n.pool for n in fleet)
    mode = (f"live for {config.duration_s:g} s" if config.duration_s is not None
            else f"backfilling {config.sim_hours:g} h")
    click.echo(f"SYNTHETIC fleet: {len(fleet)} nodes "
               f"({', '.join(f'{p} {c}' for p, c in sorted(pools.items()))}), {mode} at {config.interval_s:g} s "
               f"-> {config.collector}", err=as_json)
    if dry_run:
        for line in _describe(fleet):
            click.echo(line)
        return
    try:
        summary = run_sim(config, fleet)
    except (ScenarioError, SimError) as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("\nSYNTHETIC run interrupted: the batches the collector acknowledged stay stored; the rest "
                   "were not sent.", err=True)
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2, sort_keys=True))
    else:
        click.echo(f"SYNTHETIC data acknowledged by the collector: {summary.nodes_ok}/{summary.nodes} nodes, "
                   f"{summary.batches_acked} batches ({summary.duplicates} duplicates), {summary.samples} samples, "
                   f"{summary.probe_results} probe results, {summary.job_samples} job samples, "
                   f"{summary.job_steps} job steps in {summary.wall_s:.1f} s "
                   f"({summary.samples_per_s:,.0f} samples/s)")
    for err in summary.errors[:10]:
        click.echo(f"SYNTHETIC node error: {err}", err=True)
    if summary.nodes_ok < summary.nodes:
        raise click.ClickException(f"{summary.nodes - summary.nodes_ok} of {summary.nodes} SYNTHETIC nodes "
                                   f"did not deliver all their batches (first error: "
                                   f"{summary.errors[0] if summary.errors else 'unknown'})")


if __name__ == "__main__":  # pragma: no cover
    main()
