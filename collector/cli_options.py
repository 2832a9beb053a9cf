"""The options several `gpuagent-collector` commands share, defined once, and what they turn into.

``connection_options`` is how a command reaches a live collector (--target, --token, --token-file,
--tls-ca, --tls-client-cert, --tls-client-key), handed to the command as one ``Connection``;
``source_options`` adds --db and --window for the commands that read either a file or a collector
(compare, fabric, report); ``load_config`` reads ``--config`` once (collector/config.py) and turns its
one-sentence error into the command's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import click

from gpuagent.collector.views.client import DEFAULT_TARGET

TOKEN_ENV = "GPUAGENT_COLLECTOR_TOKEN"
TARGET_ENV = "GPUAGENT_COLLECTOR"
_CONNECTION_PARAMS = ("target", "token", "token_file", "tls_ca", "tls_client_cert", "tls_client_key")


def load_token(token: str | None, token_file: str | None) -> str | None:
    """The bearer token (the file wins over the flag or environment), or one sentence."""
    from gpuagent.collector.ingest.auth import TokenError
    from gpuagent.collector.ingest.auth import load_token as read

    try:
        return read(None, token_file) if token_file else read(token, None)
    except TokenError as exc:
        raise click.ClickException(str(exc)) from None


@dataclass(frozen=True)
class Connection:
    """How to reach a live collector, as the connection options gave it."""

    target: str | None
    token: str | None
    token_file: str | None
    tls_ca: str | None
    client_cert: str | None
    client_key: str | None

    def check(self) -> None:
        """A client certificate travels only over TLS and only with its key; anything else is one sentence."""
        if bool(self.client_cert) != bool(self.client_key):
            raise click.ClickException("--tls-client-cert and --tls-client-key go together; give both or neither")
        if self.client_cert and not self.tls_ca:
            raise click.ClickException("--tls-client-cert needs --tls-ca (a client certificate is only sent over TLS)")

    def bearer(self) -> str | None:
        """The token to send (read from --token-file when given)."""
        return load_token(self.token, self.token_file)

    @property
    def tls(self) -> dict[str, str | None]:
        """The TLS keywords of views/client.py's calls."""
        return {"tls_ca": self.tls_ca, "client_cert": self.client_cert, "client_key": self.client_key}


def connection_options(fn=None, *, target_default: str | None = DEFAULT_TARGET, target_help: str | None = None,
                       target_names: tuple[str, ...] = ("--target",)):
    """Add the connection options to a command and pass them to it as ``conn`` (a Connection)."""
    if fn is None:
        return lambda f: connection_options(f, target_default=target_default, target_help=target_help,
                                            target_names=target_names)

    @functools.wraps(fn)
    def command(*args, **kwargs):
        values = [kwargs.pop(name) for name in _CONNECTION_PARAMS]
        return fn(*args, conn=Connection(*values), **kwargs)

    opts = [
        click.option(*target_names, "target", envvar=TARGET_ENV, default=target_default,
                     show_default=target_default is not None, metavar="HOST:PORT",
                     help=target_help or f"The live collector [env {TARGET_ENV}]."),
        click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Bearer token [env {TOKEN_ENV}]."),
        click.option("--token-file", type=click.Path(dir_okay=False), default=None, help="Read the token from this file."),
        click.option("--tls-ca", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="PEM of the CA that signed the collector's certificate (TLS)."),
        click.option("--tls-client-cert", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="PEM client certificate (OU=query or admin) for a collector that requires one."),
        click.option("--tls-client-key", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="PEM private key of --tls-client-cert."),
    ]
    for opt in reversed(opts):
        command = opt(command)
    return command


def source_options(fn=None, *, reference_pool: bool = True):
    """--db or a live collector (the connection options), and --window [and --reference-pool]."""
    if fn is None:
        return lambda f: source_options(f, reference_pool=reference_pool)
    opts = [
        click.option("--db", "db_path", type=click.Path(dir_okay=False), default=None,
                     help="Read this DuckDB file (read-only; not while a collector holds it)."),
        connection_options(target_default=None,
                           target_help=f"Ask this live collector [env {TARGET_ENV}; default {DEFAULT_TARGET} "
                                       "without --db]."),
        click.option("--window", default="24h", show_default=True,
                     help="Window ending at the newest stored data: 30m, 24h, 7d, ..."),
    ]
    if reference_pool:
        opts.append(click.option("--reference-pool", default=None,
                                 help="Pool the others are compared with (default: the largest all-bare-metal pool)."))
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def source_args(ctx: click.Context, db_path: str | None, target: str | None) -> tuple[str | None, str | None]:
    """--db wins over a --target that only came from the environment; with neither, the local default
    collector (127.0.0.1:7443), as for `sql` and `analyze`."""
    if db_path and target and ctx.get_parameter_source("target") == click.core.ParameterSource.ENVIRONMENT:
        target = None
    if not db_path and not target:
        target = DEFAULT_TARGET
    return db_path, target or None


def load_config(config_path: str | None):
    """--config read once and checked whole (collector/config.py); the defaults without one."""
    from gpuagent.collector.config import load
    from gpuagent.collector.config_file import CollectorConfigError

    try:
        return load(config_path)
    except CollectorConfigError as exc:
        raise click.ClickException(str(exc)) from None


def with_window(config, window: str):
    """An AnalyzerConfig over --window (`analyze`), or the duration's one sentence."""
    from gpuagent.collector.analysis.analyzer import with_window as over
    from gpuagent.common.durations import DurationError, parse_duration

    try:
        return over(config, parse_duration(window))
    except DurationError as exc:
        raise click.ClickException(str(exc)) from None
