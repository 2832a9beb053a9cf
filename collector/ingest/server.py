"""The collector's gRPC server: grpc.aio on an event loop in its own thread, with health and reflection.

Hundreds of long-lived agent streams cost no thread each. The handlers are in servicer.py, the token check
in auth.py; the database, the writer and every other subsystem are started by collector/service.py, which
owns this server through the collector's handle.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpuagent.collector.ingest.auth import AuthInterceptor, AuthPolicy
from gpuagent.collector.ingest.listen import CollectorError, split_listen
from gpuagent.collector.ingest.options import ServerOptions
from gpuagent.collector.ingest.ratelog import OneLineServicerErrors, RateLimitedLog
from gpuagent.collector.ingest.rpc import SERVICE, add_collector_servicer
from gpuagent.collector.ingest.servicer import CollectorServicer

log = logging.getLogger("gpuagent.collector")

SERVICE_NAME = SERVICE


def reflection_module():
    """grpc_reflection's module (for ``--reflection``); CollectorError when the package is not installed."""
    try:
        from grpc_reflection.v1alpha import reflection as grpc_reflection  # noqa: PLC0415 - an optional extra
    except ImportError:
        raise CollectorError("--reflection needs the grpcio-reflection package "
                             "(pip install 'gpuagent[collector]')") from None
    return grpc_reflection


class GrpcServer:
    """The server on its own loop thread: ``start()`` returns once it listens (``.port``, ``.address``).

    ``on_serving`` runs on the loop after the server started and before health turns SERVING (the fabric
    coordinator starts there, as it lives on this loop)."""

    def __init__(self, servicer: CollectorServicer, policy: AuthPolicy, options: ServerOptions, listen: str,
                 credentials: grpc.ServerCredentials | None = None, reflection=None,
                 on_serving: Callable[[], None] | None = None):
        self._servicer = servicer
        self._policy = policy
        self._options = options
        self._listen = listen
        self._credentials = credentials
        self._reflection = reflection        # reflection_module() when --reflection is on
        self._on_serving = on_serving
        self.port: int = 0
        self.address: str = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread and wait until the server listens; CollectorError (one sentence) when it could not."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run():
            try:
                asyncio.run(self._main(started))
            except BaseException as exc:  # noqa: BLE001 - reported to start's caller
                failure.append(exc)
                started.set()

        self._thread = threading.Thread(target=run, name="gpuagent-collector-grpc", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._loop = None
            exc = failure[0]
            if isinstance(exc, CollectorError):
                raise exc
            raise CollectorError(f"the collector failed to start: {exc}") from exc

    async def _main(self, started: threading.Event) -> None:
        options, listen = self._options, self._listen
        loop = asyncio.get_running_loop()
        self._servicer.bind_loop(loop)
        self._loop = loop
        self._stop_event = asyncio.Event()
        interceptors = [AuthInterceptor(self._policy)] if self._policy.enabled else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", options.max_message_bytes),
                     ("grpc.max_send_message_length", options.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        add_collector_servicer(self._servicer, server)
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        if not any(isinstance(f, OneLineServicerErrors) for f in grpc_log.filters):
            grpc_log.addFilter(OneLineServicerErrors(RateLimitedLog(log)))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if self._reflection is not None:
            self._reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, self._reflection.SERVICE_NAME), server)
        try:
            creds = self._credentials
            port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
        except RuntimeError:
            port = 0
        if not port:
            raise CollectorError(f"cannot listen on {listen}: the address is in use or not available on this host")
        await server.start()
        if self._on_serving is not None:
            self._on_serving()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        host, _ = split_listen(listen)
        self.port = port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        started.set()
        await self._stop_event.wait()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(options.stop_grace_s)

    def run_on_loop(self, coro, timeout: float | None = None):
        """Run ``coro`` on the server's loop from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def alive(self) -> bool:
        """False once the server thread has ended (stopped, or broken)."""
        return self._thread is None or self._thread.is_alive()

    def stop(self, grace: float) -> None:
        """Stop accepting calls (those in flight get ``stop_grace_s``) and wait up to ``grace`` + 30 s for the thread."""
        if self._loop is not None and self._stop_event is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
            self._thread.join(grace + 30)
