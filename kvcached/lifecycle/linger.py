"""What a daemon of a Kubernetes pod does once it handed over (``serve --rolling``): it holds
nothing and waits for the pod's deletion (SIGTERM), because a container that exits is started
again by the kubelet, and one started again would take the node back from its successor.

While it waits it answers Kubernetes' gRPC probes on ``grpc.health_listen``: alive (the
liveness service, :data:`LIVENESS_SERVICE`, SERVING) but not ready (the server's status,
NOT_SERVING). A liveness probe that failed here for longer than the DaemonSet controller takes
to delete the pod would make the kubelet restart it. Where the successor listens on the same
port (the same network namespace: no pod), this process does not listen at all.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from kvcached.api.grpc_servers import LIVENESS_SERVICE
from kvcached.config import Config, parse_listen
from kvcached.host.logs import fields

__all__ = ["linger"]

log = logging.getLogger("kvcached.daemon")


async def linger(config: Config) -> None:
    """Wait for SIGTERM or SIGINT, answering probes as the module says."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = None
    if config.grpc.health_listen:
        address = parse_listen(config.grpc.health_listen)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        try:
            port = server.add_insecure_port(f"{address.host}:{address.port}")
        except RuntimeError:
            port = 0
        if port:
            await server.start()
        else:
            server = None
    log.info("handed over to the successor; holding nothing, waiting for SIGTERM (the pod's deletion)",
             extra=fields(probes="alive, not ready" if server is not None else "none (the successor's port)"))
    await stop.wait()
    if server is not None:
        await server.stop(0)
