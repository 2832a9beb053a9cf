"""The commands that read a database file or a live collector and show the fleet: `compare` (pools side by
side, or jobs by Slurm partition or account), `fabric` (the pair-wise plan and the link matrix) and `report`
(one self-contained HTML page)."""

from __future__ import annotations

import click

from gpuagent.collector.cli_options import load_config, source_args, source_options


@click.command()
@click.option("--by", type=click.Choice(["pool", "partition", "account"]), default="pool", show_default=True,
              help="pool: nodes by pool; partition, account: jobs as Slurm groups them (docs/SLURM.md).")
@source_options
@click.option("--lake", "lake_path", default=None, metavar="PATH",
              help="Compare the whole fleet from this lake (folder or s3://...) instead of one collector.")
@click.option("--engine", type=click.Choice(["duckdb", "spark"]), default="duckdb", show_default=True,
              help="With --lake: the engine that reads it.")
@click.option("--master", default=None, help="With --engine spark: the Spark master (default local[*]).")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.pass_context
def compare(ctx, by, db_path, conn, window, reference_pool, lake_path, engine, master, fmt):
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
    conn.check()
    db_path, target = source_args(ctx, db_path, conn.target)
    tok = conn.bearer()
    try:
        if by != "pool":
            from gpuagent.collector.views.jobs_by import run_jobs_by

            click.echo(run_jobs_by(db_path, target, by, window=window, fmt=fmt, token=tok, **conn.tls))
            return
        click.echo(run_compare(db_path, target, window=window, fmt=fmt, token=tok, reference_pool=reference_pool,
                               **conn.tls))
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@source_options(reference_pool=False)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="Collector TOML config: [fabric] scope and cap for the plan, [analyzer] fabric_* settings.")
@click.option("--top", type=click.IntRange(1), default=10, show_default=True, help="Worst nodes and links shown.")
@click.option("--rounds", "max_rounds", type=click.IntRange(0), default=10, show_default=True,
              help="Rounds of the plan listed.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_context
def fabric(ctx, db_path, conn, window, config_path, top, max_rounds, fmt):
    """Fabric probes: the pair-wise plan, the last round, the link matrix, the worst nodes and links."""
    from gpuagent.collector.views.compare import CompareError
    from gpuagent.collector.views.fabric import run_fabric

    conn.check()
    db_path, target = source_args(ctx, db_path, conn.target)
    config = load_config(config_path)
    analyzer = config.analyzer
    tok = conn.bearer()
    try:
        click.echo(run_fabric(db_path, target, window=window, fmt=fmt, token=tok, **conn.tls,
                              config=config.fabric, runs=analyzer.fabric_runs,
                              slow_fraction=analyzer.fabric_slow_fraction, top=top, max_rounds=max_rounds),
                   nl=False)
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="HTML file to write.")
@source_options
@click.pass_context
def report(ctx, out, db_path, conn, window, reference_pool):
    """Write one self-contained HTML fleet report (opens offline: no CDN, no fetches)."""
    from gpuagent.collector.views.compare import CompareError
    from gpuagent.collector.views.report import write_report

    conn.check()
    db_path, target = source_args(ctx, db_path, conn.target)
    tok = conn.bearer()
    try:
        info = write_report(out, db=db_path, target=target, window=window, token=tok,
                            reference_pool=reference_pool, **conn.tls)
    except CompareError as exc:
        raise click.ClickException(str(exc)) from None
    note = " (includes SYNTHETIC nodes from gpuagent-sim)" if info["synthetic"] else ""
    click.echo(f"wrote {info['out']}: {info['bytes']:,} bytes, {info['svg_plots']} plots{note}")
