"""`gpuagent-collector analyze`: one analysis pass now, on a database file (--db) or a live collector
(--target), and the open findings it leaves, worst first, with the actions the pass led to."""

from __future__ import annotations

import re

import click

from gpuagent.collector.cli_options import TARGET_ENV, connection_options, load_config, with_window


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


@click.command()
@click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
              help="Analyse this database file directly (only while no collector holds it).")
@connection_options(target_help=f"Ask this live collector to run the pass [env {TARGET_ENV}] (ignored with --db).")
@click.option("--window", default=None, help="Analysis window for this pass, e.g. 15m, 1h (default: config, 1h).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Collector TOML config with [analyzer]/[baselines]/[pricing] (with --db).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--max-flags", type=click.IntRange(1), default=200, show_default=True)
@click.option("--flags", "show_flags", is_flag=True, help="List each finding's open flags under it.")
@click.option("--memory-limit", default="512MB", show_default=True,
              help="With --db: DuckDB's memory limit for the pass, as serve's (steps spill beyond it).")
@click.option("--wait-actions", default="30s", show_default=True,
              help="With --target and [actions] on: how long to wait for the actions after the pass, to print them "
                   "(0 does not wait; they still run).")
def analyze(db_path, conn, window, config_path, fmt, max_flags, show_flags, memory_limit, wait_actions):
    """Run one analysis pass now (rollups + flags + findings) and print the open findings, worst first."""
    conn.check()
    if db_path:
        from gpuagent.collector.analysis.analyzer import AnalyzerError, analyze_db, open_findings_in, open_flags_in

        collector_config = load_config(config_path)
        config = with_window(collector_config.analyzer, window) if window else collector_config.analyzer
        lake_config = collector_config.lake
        loader = None
        if lake_config.fleet_baselines:
            from gpuagent.collector.lake.fleet import LakeBaselineLoader

            loader = LakeBaselineLoader(lake_config.path)
        actions_config = collector_config.actions
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
    from gpuagent.collector.analysis.analyzer import FINDINGS_SQL
    from gpuagent.collector.views.client import QueryError
    from gpuagent.collector.views.client import analyze as run_analyze
    from gpuagent.collector.views.client import query as run_query
    from gpuagent.common.durations import DurationError, parse_duration

    if config_path:
        raise click.ClickException("--config applies with --db; a live collector uses its own serve --config")
    try:
        window_s = parse_duration(window) if window else 0.0
        wait_s = 0.0 if re.fullmatch(r"\s*0+(\.0*)?\s*(ms|s|m|h|d)?\s*", str(wait_actions)) else \
            parse_duration(wait_actions)
    except DurationError as exc:
        raise click.ClickException(str(exc)) from None
    if not 0 <= wait_s <= 120:
        raise click.ClickException(f"--wait-actions must be from 0 to 2m, not {wait_actions!r}")
    tok = conn.bearer()
    try:
        res = run_analyze(conn.target, window_s, token=tok, max_flags=max_flags, wait_actions_s=wait_s, **conn.tls)
        found = run_query(conn.target, FINDINGS_SQL.format(limit=1000), token=tok, **conn.tls)
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

