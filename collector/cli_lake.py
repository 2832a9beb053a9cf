"""`gpuagent-collector lake`: export a database's closed hours to the Parquet lake, and fleet-wide SQL and
baselines over the lake on DuckDB or Spark (docs/LAKE.md)."""

from __future__ import annotations

import click

from gpuagent.collector.cli_options import load_config

@click.group()
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
    from gpuagent.collector.lake.export import export_db
    from gpuagent.collector.lake.layout import LakeError
    from gpuagent.common.durations import DurationError, parse_duration

    try:
        res = export_db(db_path, lake_path, shard, parse_duration(grace), again)
    except (LakeError, DurationError) as exc:
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

    from gpuagent.collector.analysis.errors import AnalyzerError
    from gpuagent.collector.lake.engines import open_engine
    from gpuagent.collector.lake.fleet import (compute_baselines, compute_noise_medians, publish_baselines,
                                               publish_noise_medians, write_baselines_to_db)
    from gpuagent.collector.lake.layout import LakeError
    from gpuagent.common.durations import DurationError, parse_duration
    from gpuagent.common.timeutil import utc_now

    config = load_config(config_path).analyzer
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
    except (LakeError, AnalyzerError, DurationError) as exc:
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
