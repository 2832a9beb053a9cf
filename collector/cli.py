"""`gpuagent-collector`: run the collector and query it.

Each command parses its options, calls one library function and turns domain errors into one-line
``click.ClickException``s. This module holds the ``main`` group, `serve`, `sql` and `token`; the bigger
commands live beside it (`analyze`: cli_analyze.py; `compare`, `fabric`, `report`: cli_views.py; `lake`:
cli_lake.py) and the options they share in cli_options.py. A new command joins ``main`` with
``main.add_command``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

import click

# gRPC core prints its own multi-line log lines (a port in use, an unreachable collector) next to our one
# sentence; it reads this before the first `import grpc`, so it is set here, ahead of every import of grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from gpuagent.collector.cli_analyze import analyze  # noqa: E402 - after GRPC_VERBOSITY
from gpuagent.collector.cli_lake import lake  # noqa: E402
from gpuagent.collector.cli_raw import raw_window  # noqa: E402
from gpuagent.collector.cli_options import TOKEN_ENV, connection_options, load_config, load_token  # noqa: E402
from gpuagent.collector.cli_views import compare, fabric, report  # noqa: E402
from gpuagent.collector.views.client import DEFAULT_TARGET  # noqa: E402


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpuagent")
def main() -> None:
    """Central collector for gpuagent: gRPC ingest into DuckDB, SQL, analysis."""


for _command in (analyze, compare, fabric, report, lake, raw_window):
    main.add_command(_command)



def _write_port_file(path: str, port: int) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


@main.command()
@click.option("--listen", default=DEFAULT_TARGET, show_default=True, metavar="HOST:PORT",
              help="Address to bind; port 0 picks a free one (see --port-file).")
@click.option("--db", "db_path", required=True, type=click.Path(dir_okay=False),
              help="DuckDB database file (created and migrated as needed).")
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token clients must send [env {TOKEN_ENV}].")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None, help="Read the token from this file.")
@click.option("--tls-cert", type=click.Path(dir_okay=False), default=None, help="PEM certificate for TLS.")
@click.option("--tls-key", type=click.Path(dir_okay=False), default=None, help="PEM private key for TLS.")
@click.option("--tokens-file", type=click.Path(dir_okay=False), default=None,
              help="TOML file of per-role, per-node tokens (docs/COLLECTOR.md, Security); re-read on SIGHUP.")
@click.option("--tls-client-ca", type=click.Path(dir_okay=False), default=None,
              help="Require client certificates signed by this CA (mutual TLS; CN = node); re-read on SIGHUP.")
@click.option("--insecure", is_flag=True, help="Allow plaintext when listening beyond loopback.")
@click.option("--reflection", is_flag=True, help="Serve gRPC reflection (off by default).")
@click.option("--port-file", type=click.Path(dir_okay=False), default=None,
              help="Write the bound port to this file once listening.")
@click.option("--max-samples-per-batch", type=click.IntRange(1), default=1_000_000, show_default=True,
              help="Larger batches are refused with RESOURCE_EXHAUSTED.")
@click.option("--max-message-bytes", type=click.IntRange(1024), default=64 * 1024 * 1024, show_default=True,
              help="Largest gRPC message accepted (RESOURCE_EXHAUSTED beyond).")
@click.option("--memory-limit", default="512MB", show_default=True,
              help="DuckDB memory limit (queries and inserts spill beyond it).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Collector TOML config: [analyzer], [baselines], [pricing], [metrics], [fabric], [auth], "
                   "[storage], [lake], [actions] (see docs/FLAGS.md, docs/FABRIC.md, docs/COLLECTOR.md, "
                   "docs/LAKE.md and docs/ACTIONS.md).")
@click.option("--no-analyze", is_flag=True, help="Do not run the scheduled analysis passes.")
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              help="Serve Prometheus /metrics here (off by default; [metrics] listen in --config; "
                   "behind --token when one is set).")
@click.option("--metrics-port-file", type=click.Path(dir_okay=False), default=None,
              help="Write the bound metrics port to this file once serving.")
@click.option("--ui-listen", default=None, metavar="HOST:PORT",
              help="Serve the read-only web console here (off by default; [console] listen in --config; needs a "
                   "token with the query role when the collector has auth; docs/CONSOLE.md).")
@click.option("--ui-port-file", type=click.Path(dir_okay=False), default=None,
              help="Write the bound console port to this file once serving.")
def serve(listen, db_path, token, token_file, tls_cert, tls_key, tokens_file, tls_client_ca, insecure, reflection,
          port_file, max_samples_per_batch, max_message_bytes, memory_limit, log_level, config_path, no_analyze,
          metrics_listen, metrics_port_file, ui_listen, ui_port_file):
    """Receive agent batches over gRPC and store them in DuckDB until SIGTERM/SIGINT.

    SIGHUP re-reads the tokens file and the TLS certificate, key and client CA; open streams stay."""
    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from gpuagent.collector.service import CollectorError, ServerOptions, start_collector
    from gpuagent.collector.ingest.validate import Limits

    tok = load_token(token, token_file)
    config = load_config(config_path)
    analyzer_config = config.analyzer
    tokens_file = tokens_file or config.auth.get("tokens_file")
    tls_client_ca = tls_client_ca or config.auth.get("tls_client_ca")
    stop = threading.Event()
    reload = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: (reload.set(), stop.set()))
    try:
        handle = start_collector(db_path, listen, tok, tls_cert=tls_cert, tls_key=tls_key, insecure=insecure,
                                 tokens_file=tokens_file, tls_client_ca=tls_client_ca,
                                 reflection=reflection, limits=Limits(max_samples_per_batch=max_samples_per_batch),
                                 options=ServerOptions(max_message_bytes=max_message_bytes,
                                                       memory_limit=memory_limit),
                                 analyzer_config=analyzer_config, analyze=not no_analyze,
                                 metrics_listen=metrics_listen or analyzer_config.metrics_listen,
                                 fabric=config.fabric, lake_config=config.lake,
                                 maintenance_config=config.maintenance, actions_config=config.actions,
                                 ui_listen=ui_listen or config.console.get("listen"),
                                 ui_fleet_cache_s=config.console.get("fleet_cache_s"))
    except CollectorError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if port_file:
            _write_port_file(port_file, handle.port)
        if metrics_port_file and handle.metrics is not None:
            _write_port_file(metrics_port_file, handle.metrics.port)
        if ui_port_file and handle.console is not None:
            _write_port_file(ui_port_file, handle.console.port)
        if handle.console is not None:
            logging.getLogger("gpuagent.collector").info("console on %s://%s/", handle.console.scheme, handle.console.address)
        logging.getLogger("gpuagent.collector").info(
            "listening on %s (db %s, %s, %s)", handle.address, os.path.abspath(db_path),
            "token required" if tok or tokens_file else "no token",
            ("mutual tls" if tls_client_ca else "tls") if tls_cert else "plaintext")
        notifier = _notifier()
        if notifier is not None:
            notifier.ready(f"listening on {handle.address}")
        wd = notifier.watchdog_interval_s if notifier is not None else 0.0
        interval = min(wd, 1.0) if wd else 1.0
        problem = None
        while True:
            if stop.wait(interval):
                if not reload.is_set():
                    break
                stop.clear()
                reload.clear()
                _reload(handle)
            problem = handle.problem()
            if problem is not None:
                break      # no more WATCHDOG=1: systemd (or the operator) restarts a collector that broke
            if notifier is not None:
                notifier.watchdog()
        if notifier is not None:
            notifier.stopping()
        logging.getLogger("gpuagent.collector").info("stopping: draining the writer queue")
    finally:
        handle.stop()
    stats = handle.writer.stats
    logging.getLogger("gpuagent.collector").info(
        "stopped; stored %d batches (%d samples) and ignored %d duplicates since start; %d batches could not "
        "be stored; %.1f s in commits", stats["batches"], stats["samples"], stats["duplicates"],
        stats["failed_batches"], stats["commit_s"])
    if problem is not None:
        raise click.ClickException(problem)


def _reload(handle) -> None:
    """SIGHUP: re-read credentials; a part that cannot be read keeps its current setting."""
    clog = logging.getLogger("gpuagent.collector")
    problems = handle.reload()
    for p in problems:
        clog.error("SIGHUP: %s; keeping the current setting", p)
    if not problems:
        clog.info("SIGHUP: re-read the tokens file and TLS files")


def _notifier():
    """sd_notify(3) (READY=1, WATCHDOG=1, STOPPING=1) under systemd; None elsewhere. Shared with the agent."""
    from gpuagent.common.sdnotify import Notifier

    n = Notifier()
    return n if n.enabled else None



@main.command()
@click.argument("query")
@connection_options(target_names=("--target", "--collector"))
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--max-rows", type=click.IntRange(0), default=0, help="Row cap (0: the collector's default).")
def sql(query, conn, fmt, max_rows):
    """Run a read-only SQL QUERY on the live collector (writes, files and extensions are refused)."""
    from gpuagent.collector.views.client import QueryError, format_result
    from gpuagent.collector.views.client import query as run_query

    conn.check()
    try:
        result = run_query(conn.target, query, token=conn.bearer(), max_rows=max_rows, **conn.tls)
    except QueryError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(format_result(result, fmt))
    if result.truncated and fmt != "table":
        click.echo(f"warning: result truncated to {len(result.rows)} rows", err=True)



@main.group()
def token() -> None:
    """Make credentials for the tokens file (--tokens-file)."""


@token.command("new")
@click.option("--role", type=click.Choice(["ingest", "query", "admin"]), required=True)
@click.option("--nodes", default=None, metavar="PATTERNS",
              help="Ingest only: comma-separated node names or glob patterns it may write as, e.g. 'gpu-*'.")
@click.option("--name", default="", help="A label for the entry, shown in refusals.")
def token_new(role, nodes, name):
    """Print a new token once, and the [[token]] entry (its SHA-256 only) to add to the tokens file."""
    import json

    from gpuagent.collector.ingest.auth import new_token, token_digest

    patterns = [p.strip() for p in (nodes or "").split(",") if p.strip()]
    if role == "ingest" and not patterns:
        raise click.ClickException("an ingest token needs --nodes (for example --nodes 'gpu-*')")
    if role != "ingest" and patterns:
        raise click.ClickException("--nodes only applies to --role ingest")
    secret = new_token()
    click.echo(f"token (shown once; give it to the client): {secret}", err=True)
    click.echo("add to the tokens file, then send SIGHUP to the collector:", err=True)
    click.echo("[[token]]")
    if name:
        click.echo(f"name = {json.dumps(name)}")
    click.echo(f'sha256 = "{token_digest(secret)}"')
    click.echo(f'role = "{role}"')
    if patterns:
        click.echo(f"nodes = {json.dumps(patterns)}")


if __name__ == "__main__":  # pragma: no cover
    main()
