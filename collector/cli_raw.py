"""`gpuagent-collector raw-window`: ask a node for the 1 s samples of its summarised series (docs/RESOLUTION.md)."""

from __future__ import annotations

import time

import click

from gpuagent.collector.cli_options import TARGET_ENV, connection_options

STATUS_SQL = ("SELECT request_id, node_id, since, until, sent_at, answered_at, rows, held_since, "
              "held_since IS NOT NULL AND held_since > since AS partial FROM raw_requests WHERE request_id = '{rid}'")


@click.command("raw-window")
@connection_options(target_help=f"The live collector [env {TARGET_ENV}].")
@click.option("--node", "node_id", required=True, help="The node's id (SELECT node_id FROM nodes).")
@click.option("--last", "last", default="10m", show_default=True,
              help="The span that ends now, e.g. 90s, 10m (a node holds its agent's raw_keep_s, 15m by default).")
@click.option("--reason", default="asked from the command line", show_default=True)
@click.option("--wait", "wait", default="30s", show_default=True,
              help="Wait this long for the node's answer (0: print the request id and return).")
def raw_window(conn, node_id, last, reason, wait):
    """Ask a node for its 1 s samples of the last --last; they land in table raw_windows."""
    from gpuagent.collector.views.client import QueryError, query, request_raw_window
    from gpuagent.common.durations import DurationError, parse_duration

    conn.check()
    try:
        seconds = parse_duration(last)
        wait_s = 0.0 if str(wait).strip() in ("0", "0s") else parse_duration(wait)
    except DurationError as exc:
        raise click.ClickException(str(exc)) from None
    tok = conn.bearer()
    try:
        rid = request_raw_window(conn.target, node_id, seconds, reason, token=tok, **conn.tls)
        click.echo(f"asked node {node_id} for its raw window of the last {last} (request {rid})")
        deadline = time.monotonic() + wait_s
        row = None
        while wait_s > 0:
            res = query(conn.target, STATUS_SQL.format(rid=rid), token=tok, **conn.tls)
            row = dict(zip(res.columns, res.rows[0])) if res.rows else None
            if (row and row["answered_at"]) or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
    except QueryError as exc:
        raise click.ClickException(str(exc)) from None
    if wait_s <= 0:
        return
    if not row or not row["answered_at"]:
        sent = "the node's ack carried it" if row and row["sent_at"] else "no ack to the node carried it yet"
        raise click.ClickException(f"node {node_id} did not answer within {wait} ({sent}); its rows will land in "
                                   f"raw_windows when it does: SELECT * FROM raw_requests WHERE request_id = '{rid}'")
    part = " (partial: the node held samples only from {})".format(row["held_since"]) if row["partial"] else ""
    if not row["rows"]:
        part += (" (none held for that window; an agent at summary_interval_s = 0 holds none at all: it sends "
                 "every sample raw, so its window is in samples already)")
    click.echo(f"{row['rows']} samples arrived{part}: SELECT * FROM raw_windows WHERE request_id = '{rid}'")
