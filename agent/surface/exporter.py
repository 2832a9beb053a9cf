"""The agent's Prometheus ``/metrics`` (``[exporter]``): GPU metrics under dcgm-exporter's names, types,
units and labels (in the naming generation ``[exporter] dcgm_names`` picks), everything else under
``gpuagent_*``. Names, units, sources and the PromQL job join: docs/EXPORTER.md.

A scrape renders the latest tick's :class:`StatusSnapshot` and nothing else: the daemon swaps in a new
(never mutated) snapshot after each tick with one reference assignment, so a scrape never calls NVML,
never takes a lock the tick loop holds, and never delays a tick. Each tick is formatted once per format;
one daemon thread serves the scrapes in turn.

Why the DCGM families have their own text writer: dcgm-exporter types TOTAL_ENERGY_CONSUMPTION and
four other defaults ``counter`` without a ``_total`` suffix. prometheus_client names every counter family
``<name>_total`` in its TYPE line, and OpenMetrics requires the suffix on a counter's samples, so neither
can say "counter" for those names. The Prometheus text format (0.0.4) can, and it is what dcgm-exporter
serves: scrapers that accept it (Prometheus does) get it; a client that accepts only OpenMetrics gets
OpenMetrics with those counters typed ``unknown``.

This module is the endpoint: the HTTP server, the registries and the per-tick cache of the rendered bytes.
What a snapshot becomes: dcgm-exporter's names and units (dcgm_names.py), the DCGM families and the text
writer (dcgm_families.py), the gpuagent_* families (gpuagent_families.py).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.process_collector import ProcessCollector

from gpuagent.agent.config import ExporterConfig
from gpuagent.agent.snapshot import StatusSnapshot
from gpuagent.agent.surface.dcgm_families import as_client_metric, dcgm_families, render_text
from gpuagent.agent.surface.gpuagent_families import gpuagent_families

log = logging.getLogger("gpuagent.exporter")


class SnapshotCollector:
    """A prometheus_client collector over the latest tick's snapshot (``update`` swaps it in): the
    gpuagent_* families. The DCGM families are written by render_text (see the module docstring)."""

    def __init__(self, settings: ExporterConfig | None = None) -> None:
        self._snap: StatusSnapshot | None = None
        self.settings = settings or ExporterConfig()

    @property
    def snapshot(self) -> StatusSnapshot | None:
        return self._snap

    def update(self, snap: StatusSnapshot) -> None:
        self._snap = snap      # one reference store: atomic, and the snapshot is not mutated afterwards

    def describe(self) -> list[Metric]:
        return []              # names depend on what the node has; nothing to register up front

    def collect(self) -> Iterator[Metric]:
        snap = self._snap
        if snap is None:
            return
        yield from gpuagent_families(snap, self.settings)


class _DcgmForOpenMetrics:
    """The DCGM families for prometheus_client's OpenMetrics encoder (clients that refuse text/plain)."""

    def __init__(self, collector: SnapshotCollector) -> None:
        self._collector = collector

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._collector.snapshot
        if snap is not None:
            for f in dcgm_families(snap, self._collector.settings):
                yield as_client_metric(f)


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape; a client that stalls mid-request is dropped after 10 s."""

    timeout = 10.0

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics only for a client that does not take the text format: Prometheus lists both and gets
    text, the one format in which dcgm-exporter's counters keep their type (module docstring)."""
    types = [part.split(";")[0].strip().lower() for part in (accept or "").split(",")]
    return "application/openmetrics-text" in types and not {"text/plain", "text/*", "*/*"} & set(types)


class Exporter:
    """The /metrics endpoint: private registries (no default collectors that would touch the tick's
    state) with the snapshot collector and the process collector (the agent's own RSS and CPU)."""

    def __init__(self, listen: str, settings: ExporterConfig | None = None) -> None:
        host, _, port = listen.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.settings = settings or ExporterConfig(listen=listen)
        self.collector = SnapshotCollector(self.settings)
        self.registry = CollectorRegistry(auto_describe=False)          # text: gpuagent_* after the DCGM text
        self.registry.register(self.collector)
        ProcessCollector(namespace="gpuagent", registry=self.registry)
        self.om_registry = CollectorRegistry(auto_describe=False)       # OpenMetrics: everything
        self.om_registry.register(_DcgmForOpenMetrics(self.collector))
        self.om_registry.register(self.collector)
        ProcessCollector(namespace="gpuagent", registry=self.om_registry)
        self._server = None
        self._render_lock = threading.Lock()
        self._rendered: dict[str, tuple[StatusSnapshot | None, bytes]] = {}

    def render(self, accept: str) -> tuple[bytes, str]:
        """The exposition of the latest tick, text (0.0.4) unless the client takes only OpenMetrics,
        formatted once per tick and format: further scrapes of the same tick get the same bytes, so
        scraping often costs the tick loop no more than scraping once per tick."""
        snap = self.collector.snapshot
        if wants_openmetrics(accept):
            encoder, content_type = choose_encoder(accept)
            make = lambda: encoder(self.om_registry)
        else:
            content_type = CONTENT_TYPE_PLAIN_0_0_4
            make = lambda: (render_text(dcgm_families(snap, self.settings)) if snap is not None else b"") \
                + generate_latest(self.registry)
        with self._render_lock:
            cached = self._rendered.get(content_type)
            # the snapshot itself, not its id(): a freed snapshot's id can come back for a later one
            if cached is None or cached[0] is not snap:
                cached = self._rendered[content_type] = (snap, make())
        return cached[1], content_type

    def _app(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "GET":
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b"use GET /metrics\n"]
        body, content_type = self.render(environ.get("HTTP_ACCEPT", ""))
        start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body)))])
        return [body]

    def start(self) -> "Exporter":
        """Listen; OSError (e.g. the port is taken) goes to the caller."""
        family = socket.getaddrinfo(self.host or None, self.port, type=socket.SOCK_STREAM)[0][0]
        # One thread serves scrapes in turn: each is a cached copy of the tick, and handler threads competing
        # for the GIL were what delayed the tick loop when /metrics was hammered.
        server_class = type("ExporterServer", (WSGIServer,), {"address_family": family})
        self._server = make_server(self.host, self.port, self._app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="gpuagent-exporter", daemon=True).start()
        self.port = self._server.server_address[1]
        log.info("serving Prometheus metrics on http://%s:%d/metrics", self.host, self.port)
        return self

    def update(self, snap: StatusSnapshot) -> None:
        self.collector.update(snap)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
