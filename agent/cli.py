"""`gpuagent`: the node agent's command line. Commands parse flags, call one library function, and turn
domain errors into one-sentence ``click.ClickException``s."""

from __future__ import annotations

import json
import os

import click

from gpuagent import __version__
from gpuagent.agent.surface.probe_cli import probe


def _label_pairs(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        if "=" not in v:
            raise click.BadParameter(f"{v!r} is not KEY=VALUE.", param_hint="--label")
        k, val = v.split("=", 1)
        out[k.strip()] = val.strip()
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpuagent")
def main() -> None:
    """gpuagent: GPU and host telemetry, probes and job samples from this node to a collector."""


@main.command()
@click.option("--config", "config_file", metavar="FILE",
              help="TOML config (default /etc/gpuagent/agent.toml when it exists; env GPUAGENT_CONFIG).")
@click.option("--collector", metavar="HOST:PORT", help="Collector address (env GPUAGENT_COLLECTOR).")
@click.option("--state-dir", metavar="DIR", help="State dir for spool and status (env GPUAGENT_STATE_DIR; default /var/lib/gpuagent).")
@click.option("--interval", type=float, metavar="SECONDS", help="Sampling interval (env GPUAGENT_INTERVAL; default 1).")
@click.option("--batch-interval", type=float, metavar="SECONDS", help="Batch interval (env GPUAGENT_BATCH_INTERVAL; default 5).")
@click.option("--summary-interval", type=float, metavar="SECONDS",
              help="Series no rule reads per sample travel as summaries of this many seconds; 0 sends every "
                   "sample raw (env GPUAGENT_SUMMARY_INTERVAL; default 60; docs/RESOLUTION.md).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Node label, repeatable (pool, provider, region, price_per_gpu_hour, ...).")
def run(config_file, collector, state_dir, interval, batch_interval, summary_interval, labels) -> None:
    """Run the agent in the foreground (what the systemd unit starts)."""
    import faulthandler
    import signal

    # `kill -USR2 <pid>`: every thread's stack to stderr (the journal, or a test's agent.log), for an agent
    # that does not stop or sample; it keeps running.
    try:
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    except (OSError, ValueError, RuntimeError):   # stderr without a file descriptor (click's runner), or None
        pass
    from gpuagent.agent.config import ConfigError, load_config
    from gpuagent.agent.daemon import StartupError, run_agent
    try:
        cfg = load_config(config_file, collector=collector, state_dir=state_dir, interval_s=interval,
                          batch_interval_s=batch_interval, summary_interval_s=summary_interval, labels=_label_pairs(labels) or None)
        run_agent(cfg)
    except (ConfigError, StartupError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--state-dir", metavar="DIR", help="The agent's state dir (default: env GPUAGENT_STATE_DIR, the config's, /var/lib/gpuagent).")
@click.option("--config", "config_file", metavar="FILE", help="Read the state dir from this config.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (the status file's keys).")
def status(state_dir, config_file, as_json) -> None:
    """Show the running agent's live status; exits 1 when it is not running or its status is stale."""
    from gpuagent.agent.config import ConfigError
    from gpuagent.agent.snapshot import StatusError, read_status
    from gpuagent.agent.surface.status import render
    try:
        snap = read_status(_state_dir(state_dir, config_file))
    except (ConfigError, StatusError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(snap.to_json(), indent=2, sort_keys=True) if as_json else render(snap))


@main.command()
@click.option("--state-dir", metavar="DIR", help="The agent's state dir (default: env GPUAGENT_STATE_DIR, the config's, /var/lib/gpuagent).")
@click.option("--config", "config_file", metavar="FILE", help="Read the state dir from this config.")
@click.option("--source", type=click.Choice(["auto", "agent", "local"]), default="auto", show_default=True,
              help="auto: the running agent's latest state, else this command's own NVML and sysfs reads; "
                   "agent: only the agent's (UNKNOWN when it is not running); local: only this command's reads.")
@click.option("--format", "fmt", type=click.Choice(["nagios", "npd", "json"]), default="nagios", show_default=True,
              help="nagios: exit 0 OK, 1 warning, 2 critical, 3 unknown, a summary line then one line per fault; "
                   "npd: node-problem-detector's custom plugin protocol (exit 0 OK, 1 NonOK, 2 Unknown; one line); "
                   "json: the health section as JSON, Nagios exit codes.")
def health(state_dir, config_file, source, fmt) -> None:
    """Check this node's hardware health once (XID, ECC, row remapping, retired pages, NVLink, PCIe link,
    clocks, InfiniBand, Ethernet); one line per fault with its action. docs/HEALTH.md."""
    from gpuagent.agent.surface.health import check, npd_message, verdict
    try:
        state_dir = _state_dir(state_dir, config_file)
        v = check(state_dir, source=source)
    except Exception as exc:  # noqa: BLE001 - a health check must answer UNKNOWN, never a traceback
        from gpuagent.common.errors import first_line
        v = verdict(None, source, [f"the check itself failed: {first_line(exc)}"])
    if fmt == "npd":
        click.echo(npd_message(v))
    elif fmt == "json":
        body = {"state": v.state, "origin": v.origin, "summary": v.summary, "lines": v.lines,
                "health": _health_json(v.health)}
        click.echo(json.dumps(body, indent=2, sort_keys=True))
    else:
        click.echo(v.summary)
        for line in v.lines:
            click.echo(line)
    raise SystemExit(v.exit_code(fmt))


def _health_json(h):
    from gpuagent.agent.snapshot import _dump
    return None if h is None else _dump(h)   # the status file's form of the health section


def _state_dir(state_dir: str | None, config_file: str | None) -> str:
    """--state-dir, else the config's, else env GPUAGENT_STATE_DIR / the default (agent.toml may be root-only)."""
    from gpuagent.agent.config import ConfigError, load_config
    if state_dir is not None:
        return state_dir
    try:
        return load_config(config_file).state_dir
    except ConfigError:
        if config_file:
            raise
        from gpuagent.agent.config import DEFAULT_STATE_DIR
        return os.environ.get("GPUAGENT_STATE_DIR") or DEFAULT_STATE_DIR


@main.group()
def slurm() -> None:
    """Programs for slurm.conf: HealthCheckProgram, Prolog, Epilog (docs/SLURM.md)."""


def _slurm_options(fn):
    opts = [
        click.option("--state-dir", metavar="DIR", help="The agent's state dir (default: env GPUAGENT_STATE_DIR, the config's, /var/lib/gpuagent)."),
        click.option("--config", "config_file", metavar="FILE", help="Read the state dir from this config."),
        click.option("--source", type=click.Choice(["auto", "agent", "local"]), default="auto", show_default=True,
                     help="As for `gpuagent health`: the running agent's verdict, this command's own reads, or auto."),
        click.option("--sys-root", default="/sys", show_default=True, metavar="DIR",
                     help="sysfs for --source local (a container's view of the host's /sys)."),
        click.option("--kmsg", "kmsg_path", default="/dev/kmsg", show_default=True, metavar="PATH",
                     help="The kernel log for --source local ('' to skip it)."),
        click.option("--proc-root", default="/proc", show_default=True, metavar="DIR", help="procfs for --source local."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _hook_exit(res) -> None:
    for line in res.lines:
        click.echo(line)
    for line in res.err:
        click.echo(line, err=True)
    raise SystemExit(res.exit_code)


@slurm.command("healthcheck")
@_slurm_options
def slurm_healthcheck(state_dir, config_file, source, sys_root, kmsg_path, proc_root) -> None:
    """HealthCheckProgram: on a critical hardware fault, drain this node (SLURMD_NODENAME, else the short
    hostname) with the fault's sentence as the reason. Resumes nothing."""
    from gpuagent.agent.surface.slurm_hooks import healthcheck
    _hook_exit(healthcheck(_state_dir(state_dir, config_file), source=source, sys_root=sys_root,
                           kmsg_path=kmsg_path or None, proc_root=proc_root))


@slurm.command("prolog")
@_slurm_options
def slurm_prolog(state_dir, config_file, source, sys_root, kmsg_path, proc_root) -> None:
    """Prolog: exit 1 when this node has an open critical hardware fault (Slurm drains the node and requeues
    the job held); 0 otherwise."""
    from gpuagent.agent.surface.slurm_hooks import prolog
    _hook_exit(prolog(_state_dir(state_dir, config_file), source=source, sys_root=sys_root,
                      kmsg_path=kmsg_path or None, proc_root=proc_root))


@slurm.command("epilog")
@click.option("--state-dir", metavar="DIR", help="The agent's state dir (default: env GPUAGENT_STATE_DIR, the config's, /var/lib/gpuagent).")
@click.option("--config", "config_file", metavar="FILE", help="Read the state dir from this config.")
@click.option("--wait-s", type=float, default=10.0, show_default=True, metavar="SECONDS",
              help="Wait this long for the agent's job_end of the job (it comes [jobs] end_grace_s after the job's last process).")
def slurm_epilog(state_dir, config_file, wait_s) -> None:
    """Epilog: the job's GPU-hours, effective GPU utilization and the faults it met, as one JSON line appended
    to <state_dir>/slurm-epilog.jsonl and printed. Always exits 0 (a failing Epilog drains the node)."""
    from gpuagent.agent.surface.slurm_hooks import epilog
    _hook_exit(epilog(_state_dir(state_dir, config_file), wait_s=wait_s))


main.add_command(probe)


if __name__ == "__main__":
    main()
