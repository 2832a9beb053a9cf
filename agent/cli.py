"""`gpuagent`: the node agent's command line. Commands parse flags, call one library function, and turn
domain errors into one-sentence ``click.ClickException``s."""

from __future__ import annotations

import json
import os

import click

from gpuagent import __version__
from gpuagent.agent.probe_cli import probe


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
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Node label, repeatable (pool, provider, region, price_per_gpu_hour, ...).")
def run(config_file, collector, state_dir, interval, batch_interval, labels) -> None:
    """Run the agent in the foreground (what the systemd unit starts)."""
    from gpuagent.agent.config import ConfigError, load_config
    from gpuagent.agent.daemon import StartupError, run_agent
    try:
        cfg = load_config(config_file, collector=collector, state_dir=state_dir, interval_s=interval,
                          batch_interval_s=batch_interval, labels=_label_pairs(labels) or None)
        run_agent(cfg)
    except (ConfigError, StartupError) as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--state-dir", metavar="DIR", help="The agent's state dir (default: env GPUAGENT_STATE_DIR, the config's, /var/lib/gpuagent).")
@click.option("--config", "config_file", metavar="FILE", help="Read the state dir from this config.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (the status file's keys).")
def status(state_dir, config_file, as_json) -> None:
    """Show the running agent's live status; exits 1 when it is not running or its status is stale."""
    from gpuagent.agent.config import ConfigError, load_config
    from gpuagent.agent.status import StatusError, read_status, render
    try:
        if state_dir is None:
            try:
                state_dir = load_config(config_file).state_dir
            except ConfigError:
                if config_file:
                    raise
                # The node's agent.toml may be root-only; status still works from the default state dir.
                from gpuagent.agent.config import DEFAULT_STATE_DIR
                state_dir = os.environ.get("GPUAGENT_STATE_DIR") or DEFAULT_STATE_DIR
        snap = read_status(state_dir)
    except (ConfigError, StatusError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(snap.to_json(), indent=2, sort_keys=True) if as_json else render(snap))


main.add_command(probe)


if __name__ == "__main__":
    main()
