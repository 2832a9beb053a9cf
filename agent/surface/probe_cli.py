"""`gpuagent probe list` and `gpuagent probe run NAME [--json] [--param k=v]`.

A manual run takes the node-wide probe lock (waiting up to --lock-wait seconds), runs the probe in a
subprocess with its timeout, shows a progress bar on a terminal (the probe's parts done, the part now
running, elapsed time against the timeout), and prints a readable
result (or the JSON). A manual run is not gated on jobs: you asked for it. Exit status: 0 for ok and
skipped, 1 for failed and timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import click

from gpuagent.probes import registry
from gpuagent.probes.format import format_result
from gpuagent.probes.lock import LOCK_NAME, ProbeLock
from gpuagent.probes.runner import run_probe

SPINNER = "|/-\\"


@click.group("probe")
def probe() -> None:
    """Active probes: list them, or run one now."""


@probe.command("list")
@click.option("--json", "as_json", is_flag=True, help="print the registry as JSON")
def list_cmd(as_json: bool) -> None:
    """List the probes with their platform and default parameters."""
    specs = registry.specs()
    if as_json:
        click.echo(json.dumps([{"name": s.name, "platform": s.platform, "resources": sorted(s.resources),
                                "timeout_s": s.timeout_s, "interval_s": s.interval_s,
                                "defaults": dict(s.defaults), "description": s.description,
                                "limits": {k: list(v) for k, v in s.limits.items()}}
                               for s in specs], indent=2))
        return
    w = max(len(s.name) for s in specs)
    for s in specs:
        click.echo(f"{s.name.ljust(w)}  {s.platform:<9}  timeout {s.timeout_s:g} s  {s.description}")
        defaults = " ".join(f"{k}={v}" for k, v in s.defaults.items())
        click.echo(f"{''.ljust(w)}  params: {defaults}")


def _bar(name: str, width: int = 24):
    """Progress display on stderr: a bar once the probe has said how far it is, a spinner before."""
    state = {"i": 0, "last": -1.0, "w": 0}   # w: width of the last line drawn, to blank its tail

    def show(elapsed: float, timeout: float, step: tuple[int, int, str] | None) -> None:
        if elapsed - state["last"] < 0.1:
            return
        state["last"] = elapsed
        state["i"] += 1
        if step is not None and step[1] > 0:
            done, total, label = step
            filled = min(width, round(width * done / total))
            head = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"
        else:
            head = f"{SPINNER[state['i'] % 4]} starting"
        line = f"{name} {head}  {elapsed:.1f} s (timeout {timeout:g} s)"
        cols = shutil.get_terminal_size((100, 24)).columns
        sys.stderr.write("\r" + line[:cols - 1].ljust(state["w"]))
        state["w"] = min(len(line), cols - 1)
        sys.stderr.flush()
    return show


def _agent_lock_path() -> str | None:
    """The running agent's lock: <state_dir>/probe.lock from its config (flag-less: file/env/default)."""
    try:
        from gpuagent.agent.config import load_config
        return os.path.join(str(load_config(None).state_dir), LOCK_NAME)
    except Exception:  # noqa: BLE001 - no readable agent config: the documented default
        return None


@probe.command("run")
@click.argument("name")
@click.option("--param", "params", multiple=True, metavar="K=V", help="probe parameter (repeatable)")
@click.option("--json", "as_json", is_flag=True, help="print the result as one JSON object")
@click.option("--timeout", "timeout_s", type=float, default=None, help="seconds (default: the probe's)")
@click.option("--lock-wait", type=float, default=60.0, show_default=True,
              help="seconds to wait for another probe run to finish")
@click.option("--lock-path", default=None, help="node-wide probe lock file (default: the agent's state_dir/probe.lock)")
def run_cmd(name: str, params: tuple[str, ...], as_json: bool, timeout_s: float | None, lock_wait: float,
            lock_path: str | None) -> None:
    """Run probe NAME now and print its result."""
    try:
        parsed = registry.parse_params(name, list(params))
    except registry.ParamError as exc:
        raise click.ClickException(str(exc)) from None
    if timeout_s is not None and timeout_s <= 0:
        raise click.ClickException("--timeout must be positive")
    tty = sys.stderr.isatty()
    lock = ProbeLock(lock_path or _agent_lock_path())
    try:
        if not lock.acquire(0):
            if tty:
                sys.stderr.write(f"waiting up to {lock_wait:g} s for the probe lock "
                                 f"({lock.holder() or 'holder unknown'})\n")
            if not lock.acquire(lock_wait, what=name):
                raise click.ClickException(f"another probe run holds {lock.path} "
                                           f"({lock.holder() or 'holder unknown'}); try again later")
    except OSError as exc:
        raise click.ClickException(f"cannot open the probe lock {lock.path}: {exc.strerror or exc} "
                                   "(pass --lock-path or set GPUAGENT_STATE_DIR)") from None
    try:
        t0 = time.monotonic()
        result = run_probe(name, parsed, timeout_s, progress=_bar(name) if tty else None)
        if tty:
            sys.stderr.write(f"\r{name}: done in {time.monotonic() - t0:.1f} s".ljust(
                shutil.get_terminal_size((100, 24)).columns - 1) + "\n")
    except KeyboardInterrupt:
        # run_probe has stopped the probe (SIGTERM, so it cleaned up, then SIGKILL); nothing was recorded.
        click.echo(("\n" if tty else "") + f"Interrupted: probe {name} stopped after "
                   f"{time.monotonic() - t0:.1f} s and cleaned up; no result.", err=True)
        sys.exit(130)
    finally:
        lock.release()
    d = result.to_dict()
    click.echo(json.dumps(d, sort_keys=True) if as_json else format_result(d))
    if result.status in ("failed", "timeout"):
        sys.exit(1)
