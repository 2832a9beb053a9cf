"""`gpuagent-collector`: run the collector and query it.

Each command parses its options, calls one library function and turns domain errors into one-line
``click.ClickException``s. Other commands join the ``main`` group with ``@main.command()``.
"""

from __future__ import annotations

import logging
import re
import os
import signal
import sys
import threading
from pathlib import Path

import click

# gRPC core prints its own multi-line log lines (a port in use, an unreachable collector) next to our one
# sentence; it reads this before the first `import grpc`, so it is set here, ahead of every import of grpc.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from gpuagent.collector.views.client import DEFAULT_TARGET  # noqa: E402 - after GRPC_VERBOSITY

TOKEN_ENV = "GPUAGENT_COLLECTOR_TOKEN"
TARGET_ENV = "GPUAGENT_COLLECTOR"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gpuagent")
def main() -> None:
    """Central collector for gpuagent: gRPC ingest into DuckDB, SQL, analysis."""


def _token(token: str | None, token_file: str | None) -> str | None:
    from gpuagent.collector.ingest.auth import TokenError, load_token

    try:
        return load_token(token, token_file)
    except TokenError as exc:
        raise click.ClickException(str(exc)) from None


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
def serve(listen, db_path, token, token_file, tls_cert, tls_key, tokens_file, tls_client_ca, insecure, reflection,
          port_file, max_samples_per_batch, max_message_bytes, memory_limit, log_level, config_path, no_analyze,
          metrics_listen, metrics_port_file):
    """Receive agent batches over gRPC and store them in DuckDB until SIGTERM/SIGINT.

    SIGHUP re-reads the tokens file and the TLS certificate, key and client CA; open streams stay."""
    logging.basicConfig(level=getattr(logging, log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from gpuagent.collector.service import CollectorError, ServerOptions, start_collector
    from gpuagent.collector.ingest.validate import Limits

    tok = _token(None, token_file) if token_file else _token(token, None)
    analyzer_config = _analyzer_config(config_path)
    maintenance_config = _maintenance_config(config_path)
    fabric_config = _fabric_config(config_path)
    auth = _auth_config(config_path)
    tokens_file = tokens_file or auth.get("tokens_file")
    tls_client_ca = tls_client_ca or auth.get("tls_client_ca")
    lake_config = _lake_config(config_path)
    actions_config = _actions_config(config_path)
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
                                 fabric=fabric_config, lake_config=lake_config,
                                 maintenance_config=maintenance_config, actions_config=actions_config)
    except CollectorError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        if port_file:
            _write_port_file(port_file, handle.port)
        if metrics_port_file and handle.metrics is not None:
            _write_port_file(metrics_port_file, handle.metrics.port)
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


_CLIENT_CERT_OPTS = (
    click.option("--tls-client-cert", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="PEM client certificate (OU=query or admin) for a collector that requires one."),
    click.option("--tls-client-key", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="PEM private key of --tls-client-cert."),
)


def _client_cert_options(fn):
    for opt in reversed(_CLIENT_CERT_OPTS):
        fn = opt(fn)
    return fn


def _check_client_cert(tls_ca: str | None, cert: str | None, key: str | None) -> None:
    """A client certificate travels only over TLS and only with its key; anything else is one sentence."""
    if bool(cert) != bool(key):
        raise click.ClickException("--tls-client-cert and --tls-client-key go together; give both or neither")
    if cert and not tls_ca:
        raise click.ClickException("--tls-client-cert needs --tls-ca (a client certificate is only sent over TLS)")


@main.command()
@click.argument("query")
@click.option("--target", "--collector", "target", envvar=TARGET_ENV, default=DEFAULT_TARGET, show_default=True,
              metavar="HOST:PORT", help=f"The live collector [env {TARGET_ENV}].")
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token [env {TOKEN_ENV}].")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None)
@click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False), default=None,
              help="PEM of the CA that signed the collector's certificate (TLS).")
@_client_cert_options
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--max-rows", type=click.IntRange(0), default=0, help="Row cap (0: the collector's default).")
def sql(query, target, token, token_file, tls_ca, tls_client_cert, tls_client_key, fmt, max_rows):
    """Run a read-only SQL QUERY on the live collector (writes, files and extensions are refused)."""
    from gpuagent.collector.views.client import QueryError, format_result
    from gpuagent.collector.views.client import query as run_query

    _check_client_cert(tls_ca, tls_client_cert, tls_client_key)
    tok = _token(None, token_file) if token_file else _token(token, None)
    try:
        result = run_query(target, query, token=tok, max_rows=max_rows, tls_ca=tls_ca,
                           client_cert=tls_client_cert, client_key=tls_client_key)
    except QueryError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(format_result(result, fmt))
    if result.truncated and fmt != "table":
        click.echo(f"warning: result truncated to {len(result.rows)} rows", err=True)


def _analyzer_config(config_path: str | None, window: str | None = None):
    from gpuagent.collector.analysis.analyzer import AnalyzerConfig, AnalyzerError, parse_duration, with_window

    try:
        config = AnalyzerConfig.from_toml(config_path) if config_path else AnalyzerConfig()
        if window:
            config = with_window(config, parse_duration(window))
        return config
    except AnalyzerError as exc:
        raise click.ClickException(str(exc)) from None


def _actions_config(config_path: str | None):
    """[actions] of the collector config (collector/actions/config.py); off when absent."""
    from gpuagent.collector.actions.config import ActionsConfig, ActionsError

    try:
        return ActionsConfig.from_toml(config_path) if config_path else ActionsConfig()
    except ActionsError as exc:
        raise click.ClickException(str(exc)) from None


AUTH_KEYS = ("tokens_file", "tls_client_ca")


def _auth_config(config_path: str | None) -> dict[str, str]:
    """[auth] of the collector config: file paths, relative ones taken from the config file's directory.
    The --tokens-file and --tls-client-ca flags win over these."""
    if not config_path:
        return {}
    import tomllib

    try:
        with open(config_path, "rb") as fh:
            table = tomllib.load(fh).get("auth", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.ClickException(f"config file {config_path} cannot be read: {exc}") from None
    if not isinstance(table, dict):
        raise click.ClickException(f"config file {config_path}: [auth] must be a table")
    out = {}
    for key, value in table.items():
        if key not in AUTH_KEYS:
            raise click.ClickException(f"config file {config_path}: unknown key auth.{key} "
                                       f"(expected {' or '.join(AUTH_KEYS)})")
        if not isinstance(value, str) or not value:
            raise click.ClickException(f"config file {config_path}: auth.{key} must be a file path")
        out[key] = os.path.join(os.path.dirname(os.path.abspath(config_path)), value)
    return out


def _lake_config(config_path: str | None):
    """[lake] of the collector config (collector/lake/export.py); disabled when absent."""
    from gpuagent.collector.lake.export import LakeConfig
    from gpuagent.collector.lake.layout import LakeError

    try:
        return LakeConfig.from_toml(config_path) if config_path else LakeConfig()
    except LakeError as exc:
        raise click.ClickException(str(exc)) from None


def _maintenance_config(config_path: str | None):
    from gpuagent.collector.store.maintenance_config import MaintenanceConfig, MaintenanceConfigError

    try:
        return MaintenanceConfig.from_toml(config_path) if config_path else MaintenanceConfig()
    except MaintenanceConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _fabric_config(config_path: str | None):
    """[fabric] of the collector config (collector/fabric/coordinator.py); None when absent."""
    if not config_path:
        return None
    import tomllib

    from gpuagent.collector.fabric.coordinator import FabricConfig

    try:
        with open(config_path, "rb") as fh:
            table = tomllib.load(fh).get("fabric")
        return FabricConfig.from_mapping(table) if table is not None else None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.ClickException(f"config file {config_path} cannot be read: {exc}") from None
    except ValueError as exc:
        raise click.ClickException(f"config file {config_path}: {exc}") from None


def _flag_line(f: dict) -> str:
    gpu = "" if f.get("gpu") is None else f" gpu {f['gpu']}"
    return f"[{f['severity']}] {f['kind']}/{f['component']} {f['node_id']}{gpu}: {f['sentence']}"


def _print_analysis(run: dict, flags: list[dict], fmt: str, truncated: bool, findings: list[dict],
                    show_flags: bool, actions: list[dict] | None = None, actions_pending: bool = False) -> None:
    """Findings first, worst first; with ``show_flags`` each finding's open flags under it; then one line per
    action ([actions]) the pass led to."""
    import json

    if fmt == "json":
        click.echo(json.dumps({"pass": run, "open_findings": findings, "open_flags": flags, "truncated": truncated,
                               "actions": actions or [], "actions_pending": actions_pending}, default=str))
        return
    click.echo(f"analysis pass at {run['now']}: rolled up {run['rollup_rows_in']} new raw rows in "
               f"{run['rollup_s']:.2f} s, flags in {run['flags_s']:.2f} s; {run['conditions']} conditions, "
               f"{run['opened']} opened, {run['updated']} updated, {run['closed']} closed; "
               f"{len(findings)} open findings over {len(flags)}{'+' if truncated else ''} open flags")
    for step, error in (run.get("failed_steps") or {}).items():
        click.echo(f"step {step} could not run (rolled back alone; the next pass retries it): {error}")
    if not findings and not flags:
        click.echo("no open findings")
    by_finding: dict = {}
    for f in flags:
        by_finding.setdefault(f.get("finding_id"), []).append(f)
    for d in findings:
        click.echo(f"[{d['severity']}] {d['scope']} {d['kind']}: {d['sentence']}")
        if show_flags:
            for f in by_finding.get(d["finding_id"], []):
                click.echo("    " + _flag_line(f))
    ungrouped = [f for f in flags if f.get("finding_id") not in {d["finding_id"] for d in findings}]
    if show_flags and ungrouped:   # a flag opened by another pass than the one that grouped the findings
        click.echo("flags in no finding:")
        for f in ungrouped:
            click.echo("    " + _flag_line(f))
    if not show_flags and flags:
        click.echo("(--flags lists each finding's flags)")
    if truncated:
        click.echo(f"(flags: showing the first {len(flags)} open flags)")
    if actions:
        from gpuagent.collector.actions.engine import action_line

        for a in actions:
            click.echo(action_line(a))


@main.command()
@click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
              help="Analyse this database file directly (only while no collector holds it).")
@click.option("--target", envvar=TARGET_ENV, default=DEFAULT_TARGET, show_default=True, metavar="HOST:PORT",
              help=f"Ask this live collector to run the pass [env {TARGET_ENV}] (ignored with --db).")
@click.option("--window", default=None, help="Analysis window for this pass, e.g. 15m, 1h (default: config, 1h).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Collector TOML config with [analyzer]/[baselines]/[pricing] (with --db).")
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token [env {TOKEN_ENV}].")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None)
@click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False), default=None)
@_client_cert_options
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--max-flags", type=click.IntRange(1), default=200, show_default=True)
@click.option("--flags", "show_flags", is_flag=True, help="List each finding's open flags under it.")
@click.option("--memory-limit", default="512MB", show_default=True,
              help="With --db: DuckDB's memory limit for the pass, as serve's (steps spill beyond it).")
@click.option("--wait-actions", default="30s", show_default=True,
              help="With --target and [actions] on: how long to wait for the actions after the pass, to print them "
                   "(0 does not wait; they still run).")
def analyze(db_path, target, window, config_path, token, token_file, tls_ca, tls_client_cert, tls_client_key, fmt,
            max_flags, show_flags, memory_limit, wait_actions):
    """Run one analysis pass now (rollups + flags + findings) and print the open findings, worst first."""
    _check_client_cert(tls_ca, tls_client_cert, tls_client_key)
    if db_path:
        from gpuagent.collector.analysis.analyzer import AnalyzerError, analyze_db, open_findings_in, open_flags_in

        config = _analyzer_config(config_path, window)
        lake_config = _lake_config(config_path)
        loader = None
        if lake_config.fleet_baselines:
            from gpuagent.collector.lake.fleet import LakeBaselineLoader

            loader = LakeBaselineLoader(lake_config.path)
        actions_config = _actions_config(config_path)
        try:
            result = analyze_db(db_path, config, baselines_loader=loader, memory_limit=memory_limit)
            flags = open_flags_in(db_path, max_flags + 1)
            findings = open_findings_in(db_path)
        except AnalyzerError as exc:
            raise click.ClickException(str(exc)) from None
        actions = _act_on_db(db_path, actions_config, result.now) if actions_config.enabled else []
        _print_analysis(result.as_dict(), flags[:max_flags], fmt, len(flags) > max_flags, findings, show_flags,
                        actions)
        return
    from gpuagent.collector.analysis.analyzer import FINDINGS_SQL, AnalyzerError, parse_duration
    from gpuagent.collector.views.client import QueryError
    from gpuagent.collector.views.client import analyze as run_analyze
    from gpuagent.collector.views.client import query as run_query

    if config_path:
        raise click.ClickException("--config applies with --db; a live collector uses its own serve --config")
    try:
        window_s = parse_duration(window) if window else 0.0
        wait_s = 0.0 if re.fullmatch(r"\s*0+(\.0*)?\s*(ms|s|m|h|d)?\s*", str(wait_actions)) else \
            parse_duration(wait_actions)
    except AnalyzerError as exc:
        raise click.ClickException(str(exc)) from None
    if not 0 <= wait_s <= 120:
        raise click.ClickException(f"--wait-actions must be from 0 to 2m, not {wait_actions!r}")
    tok = _token(None, token_file) if token_file else _token(token, None)
    try:
        tls = {"tls_ca": tls_ca, "client_cert": tls_client_cert, "client_key": tls_client_key}
        res = run_analyze(target, window_s, token=tok, max_flags=max_flags, wait_actions_s=wait_s, **tls)
        found = run_query(target, FINDINGS_SQL.format(limit=1000), token=tok, **tls)
    except QueryError as exc:
        raise click.ClickException(str(exc)) from None
    findings = [dict(zip(found.columns, row)) for row in found.rows]
    _print_analysis(res.run, res.flags, fmt, res.truncated, findings, show_flags, res.actions, res.actions_pending)
    if res.actions_pending and fmt == "text":
        click.echo(f"(the collector's actions were still running after {wait_actions}; more may follow: "
                   "SELECT * FROM actions ORDER BY action_id DESC)")


def _act_on_db(db_path: str, config, pass_ts) -> list[dict]:
    """[actions] after an `analyze --db` pass, on the file the pass just committed (the actions of this pass)."""
    from gpuagent.collector.actions.engine import Actions, ConnectionDb
    from gpuagent.collector.store import db

    try:
        con = db.open_database(db_path)
    except db.DatabaseError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return Actions(config).run_once(ConnectionDb(con), pass_ts)
    finally:
        con.close()


def _source_args(ctx: click.Context, db_path: str | None, target: str | None) -> tuple[str | None, str | None]:
    """--db wins over a --target that only came from the environment; with neither, the local default
    collector (127.0.0.1:7443), as for `sql` and `analyze`."""
    if db_path and target and ctx.get_parameter_source("target") == click.core.ParameterSource.ENVIRONMENT:
        target = None
    if not db_path and not target:
        target = DEFAULT_TARGET
    return db_path, target or None


def _source_options(fn=None, *, reference_pool: bool = True):
    if fn is None:
        return lambda f: _source_options(f, reference_pool=reference_pool)
    opts = [
        click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
                     help="Read this DuckDB file (read-only; not while a collector holds it)."),
        click.option("--target", envvar=TARGET_ENV, default=None, metavar="HOST:PORT",
                     help=f"Ask this live collector [env {TARGET_ENV}; default {DEFAULT_TARGET} without --db]."),
        click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token [env {TOKEN_ENV}]."),
        click.option("--token-file", type=click.Path(dir_okay=False), default=None),
        click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="PEM of the CA that signed the collector's certificate (TLS)."),
        *_CLIENT_CERT_OPTS,
        click.option("--window", default="24h", show_default=True,
                     help="Window ending at the newest stored data: 30m, 24h, 7d, ..."),
    ]
    if reference_pool:
        opts.append(click.option("--reference-pool", default=None,
                                 help="Pool the others are compared with (default: the largest all-bare-metal pool)."))
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@main.command()
@click.option("--by", type=click.Choice(["pool", "partition", "account"]), default="pool", show_default=True,
              help="pool: nodes by pool; partition, account: jobs as Slurm groups them (docs/SLURM.md).")
@_source_options
@click.option("--lake", "lake_path", default=None, metavar="PATH",
              help="Compare the whole fleet from this lake (folder or s3://...) instead of one collector.")
@click.option("--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True,
              help="With --lake: the engine that reads it.")
@click.option("--master", default=None, help="With --engine spark: the Spark master (default local[*]).")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.pass_context
def compare(ctx, by, db_path, target, token, token_file, tls_ca, tls_client_cert, tls_client_key, window,
            reference_pool, lake_path, engine, master, fmt):
    """Pools side by side: probe medians and spread, utilization, flagged nodes, cost per effective GPU-hour.
    With --by partition or account: jobs, nodes, GPU-hours held and mean GPU utilization per group."""
    from gpuagent.collector.views.compare import CompareError, run_compare

    if by != "pool" and (lake_path or reference_pool):
        raise click.ClickException(f"--by {by} reads one collector (--db or --target); "
                                   f"{'--lake' if lake_path else '--reference-pool'} goes with --by pool")
    if lake_path:
        if db_path or ctx.get_parameter_source("target") == click.core.ParameterSource.COMMANDLINE:
            raise click.ClickException("give --lake or --db/--target, not both")
        from gpuagent.collector.lake.engines import open_engine
        from gpuagent.collector.lake.layout import LakeError
        from gpuagent.collector.views.compare import compare_pools, formatter, parse_window

        try:
            seconds = parse_window(window)
            src = open_engine(engine, lake_path, master)
            try:
                click.echo(formatter(fmt)(compare_pools(src, seconds, reference_pool)))
            finally:
                src.close()
        except (CompareError, LakeError) as exc:
            raise click.ClickException(str(exc)) from None
        return
    _check_client_cert(tls_ca, tls_client_cert, tls_client_key)
    db_path, target = _source_args(ctx, db_path, target)
    tok = _token(None, token_file) if token_file else _token(token, None)
    try:
        if by != "pool":
            from gpuagent.collector.views.jobs_by import run_jobs_by

            click.echo(run_jobs_by(db_path, target, by, window=window, fmt=fmt, token=tok, tls_ca=tls_ca,
                                   client_cert=tls_client_cert, client_key=tls_client_key))
            return
        click.echo(run_compare(db_path, target, window=window, fmt=fmt, token=tok, reference_pool=reference_pool,
                               tls_ca=tls_ca, client_cert=tls_client_cert, client_key=tls_client_key))
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@_source_options(reference_pool=False)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Collector TOML config: [fabric] scope and cap for the plan, [analyzer] fabric_* settings.")
@click.option("--top", type=click.IntRange(1), default=10, show_default=True, help="Worst nodes and links shown.")
@click.option("--rounds", "max_rounds", type=click.IntRange(0), default=10, show_default=True,
              help="Rounds of the plan listed.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_context
def fabric(ctx, db_path, target, token, token_file, tls_ca, tls_client_cert, tls_client_key, window, config_path,
           top, max_rounds, fmt):
    """Fabric probes: the pair-wise plan, the last round, the link matrix, the worst nodes and links."""
    from gpuagent.collector.views.compare import CompareError
    from gpuagent.collector.views.fabric import run_fabric

    _check_client_cert(tls_ca, tls_client_cert, tls_client_key)
    db_path, target = _source_args(ctx, db_path, target)
    analyzer = _analyzer_config(config_path)
    tok = _token(None, token_file) if token_file else _token(token, None)
    try:
        click.echo(run_fabric(db_path, target, window=window, fmt=fmt, token=tok, tls_ca=tls_ca,
                              client_cert=tls_client_cert, client_key=tls_client_key,
                              config=_fabric_config(config_path), runs=analyzer.fabric_runs,
                              slow_fraction=analyzer.fabric_slow_fraction, top=top, max_rounds=max_rounds),
                   nl=False)
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="HTML file to write.")
@_source_options
@click.pass_context
def report(ctx, out, db_path, target, token, token_file, tls_ca, tls_client_cert, tls_client_key, window,
           reference_pool):
    """Write one self-contained HTML fleet report (opens offline: no CDN, no fetches)."""
    from gpuagent.collector.views.compare import CompareError
    from gpuagent.collector.views.report import write_report

    _check_client_cert(tls_ca, tls_client_cert, tls_client_key)
    db_path, target = _source_args(ctx, db_path, target)
    tok = _token(None, token_file) if token_file else _token(token, None)
    try:
        info = write_report(out, db=db_path, target=target, window=window, token=tok,
                            reference_pool=reference_pool, tls_ca=tls_ca, client_cert=tls_client_cert,
                            client_key=tls_client_key)
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None
    note = " (includes SYNTHETIC nodes from gpuagent-sim)" if info["synthetic"] else ""
    click.echo(f"wrote {info['out']}: {info['bytes']:,} bytes, {info['svg_plots']} plots{note}")


# ------------------------------------------------------------------------------------------------ lake

@main.group()
def lake() -> None:
    """The Parquet lake: export closed hours, and fleet-wide SQL and baselines over it (docs/LAKE.md)."""


def _engine_options(fn):
    opts = [
        click.option("--lake", "lake_path", required=True, metavar="PATH", help="The lake: a folder or s3://..."),
        click.option("--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True),
        click.option("--master", default=None, help="Spark master with --engine spark (default local[*])."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@lake.command("export")
@click.option("--db", "db_path", required=True, type=click.Path(dir_okay=False),
              help="The collector database to export (not while a collector holds it).")
@click.option("--lake", "lake_path", required=True, metavar="PATH", help="The lake: a folder or s3://... (created).")
@click.option("--shard", required=True, help="This database's shard name in the lake.")
@click.option("--grace", default="10m", show_default=True, help="An hour is closed this long after it ends.")
@click.option("--again", is_flag=True, help="Export hours already exported again (replacing them).")
def lake_export(db_path, lake_path, shard, grace, again):
    """Export the closed hours of a database file to the lake (a running collector uses [lake] instead)."""
    from gpuagent.collector.analysis.analyzer import AnalyzerError, parse_duration
    from gpuagent.collector.lake.export import export_db
    from gpuagent.collector.lake.layout import LakeError

    try:
        res = export_db(db_path, lake_path, shard, parse_duration(grace), again)
    except (LakeError, AnalyzerError) as exc:
        raise click.ClickException(str(exc)) from None
    note = (f"; {res.skipped_not_rolled_up} hours of samples_1m wait for an analysis pass"
            if res.skipped_not_rolled_up else "")
    click.echo(f"exported {res.partitions} partitions ({res.rows:,} rows, {res.bytes:,} bytes) and "
               f"{res.snapshots} snapshots to {lake_path} as shard {shard}{note}")


@lake.command("sql")
@click.argument("query")
@_engine_options
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
def lake_sql(query, lake_path, engine, master, fmt):
    """Run QUERY over the whole lake: tables as in the collector, plus date, hour and shard columns."""
    from gpuagent.collector.lake.engines import open_engine
    from gpuagent.collector.lake.layout import LakeError
    from gpuagent.collector.views.client import format_result
    from gpuagent.collector.views.result import QueryResult

    try:
        src = open_engine(engine, lake_path, master)
    except LakeError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        table = src.arrow(query)
    except Exception as exc:  # noqa: BLE001 - the engine's own message names the problem
        raise click.ClickException(f"the query failed on {engine}: {str(exc).strip().splitlines()[0]}") from None
    finally:
        src.close()
    rows = [[_json_ready(v) for v in row.values()] for row in table.to_pylist()]
    click.echo(format_result(QueryResult(table.column_names, [str(t) for t in table.schema.types], rows, False), fmt))


def _json_ready(v):
    import datetime as dt
    import decimal

    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat(sep=" ") if isinstance(v, dt.datetime) else v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    return v


def _as_of(text: str):
    """--as-of TIME as an aware UTC datetime, or one sentence."""
    import datetime as dt

    try:
        t = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time such as 2026-12-01T15:00:00",
                                 param_hint="--as-of") from None
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t.astimezone(dt.timezone.utc)


@lake.command("baselines")
@_engine_options
@click.option("--lookback", default=None, help="Probe runs this far back from now (default: the config's "
              "baseline_lookback, 24h).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="The shards' collector TOML config: its [analyzer] windows, min_runs and baseline_lookback.")
@click.option("--db", "db_paths", multiple=True, type=click.Path(dir_okay=False),
              help="Also write the baselines into this stopped collector's database (repeatable).")
@click.option("--as-of", "as_of", default=None, metavar="TIME",
              help="Compute as of this UTC time (ISO 8601, e.g. 2026-12-01T15:00:00) instead of now: to repeat a "
                   "run, or to compare engines over the same windows.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True)
def lake_baselines(lake_path, engine, master, lookback, config_path, db_paths, as_of, fmt):
    """What needs the whole fleet, published for every shard: bare-metal baselines per hardware class
    (fleet_baselines) and each class's median noise (the noisy-neighbor peers)."""
    import json
    from dataclasses import replace

    from gpuagent.collector.analysis.analyzer import AnalyzerError, parse_duration
    from gpuagent.collector.lake.engines import open_engine
    from gpuagent.collector.lake.fleet import (compute_baselines, compute_noise_medians, publish_baselines,
                                               publish_noise_medians, write_baselines_to_db)
    from gpuagent.collector.lake.layout import LakeError
    from gpuagent.common.timeutil import utc_now

    config = _analyzer_config(config_path, None)
    try:
        if lookback:
            config = replace(config, baseline_lookback_s=parse_duration(lookback))
        now = _as_of(as_of) if as_of else utc_now()
        src = open_engine(engine, lake_path, master)
        try:
            rows = compute_baselines(src, now=now, lookback_s=config.baseline_lookback_s)
            noise = compute_noise_medians(src, config, now=now)
        finally:
            src.close()
        where = publish_baselines(src.lake, rows)
        noise_where = publish_noise_medians(src.lake, noise)
        for path in db_paths:
            write_baselines_to_db(path, rows)
    except (LakeError, AnalyzerError) as exc:
        raise click.ClickException(str(exc)) from None
    if fmt == "json":
        click.echo(json.dumps({"baselines": rows, "noise_medians": noise}, default=str, indent=2))
    else:
        for r in rows:
            click.echo(f"{r['class_label']} | {r['component']} | {r['params_key'] or '-'}: {r['baseline']:.6g} "
                       f"({r['nodes']} nodes, {r['runs']} runs)")
        for r in noise:
            click.echo(f"noise {r['component']} | {r['peer_key']}: median CV {r['fleet_cv']:.4g} ({r['nodes']} nodes)")
    click.echo(f"{len(rows)} baselines written to {where}" + (f" and {len(db_paths)} database(s)" if db_paths else "")
               + f"; {len(noise)} class noise medians to {noise_where}", err=fmt == "json")


if __name__ == "__main__":  # pragma: no cover
    main()


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
