"""The daemon's gRPC servers: who may call what on which listener, and how they are built.

Two servers (kvcached.api.access says who may call what): the full API on the Unix sockets and
the mutual-TLS TCP listeners; read-only calls on plaintext TCP listeners and
``grpc.read_only_listen``; and one more for each tenant socket (tenants.sockets), the full API
acting as that tenant, admitting its uids and gids alone (kvcached.tenants.socket_acl). Each
names the tenant of its calls its own way (kvcached.api.callers). All carry the KvCache and
Admin services (their requests measured before they are parsed: kvcached.api.request_size),
health and reflection (grpcurl).

So that a successor can listen beside this daemon at an upgrade (kvcached.lifecycle.handover), TCP
listeners set SO_REUSEPORT (a start that is not a takeover first checks that no other process
holds the port), and a Unix socket is bound under a temporary name and renamed into place: the
successor's rename replaces it atomically, and gRPC's removal of the name it bound, at this
server's stop, removes nothing. At a takeover the calls wait at ``gate`` until the successor
serves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvcached.api.access import Gate, OperatorOnly, ReadOnly
from kvcached.api.admin_service import AdminService, Operated
from kvcached.api.callers import BoundTenant, Callers, OperatorOrCertificate, Refusals, Unauthenticated
from kvcached.api.grpc_service import KvCacheService
from kvcached.api.request_size import bounded, largest_read_only_request
from kvcached.config import Config, ListenAddress, parse_listen
from kvcached.host.logs import fields
from kvcached.host.process import StartupError, check_tcp_port_free
from kvcached.store import Store
from kvcached.tenants import TenantMap
from kvcached.tenants.socket_acl import admit_only
from kvcached.v1 import kvcache_pb2, kvcache_pb2_grpc

__all__ = ["GrpcServers", "LIVENESS_SERVICE", "SERVICE_NAME", "ADMIN_SERVICE_NAME"]

# What an unauthenticated sender may make the read-only listener's HTTP/2 transport hold. Its
# requests are small (kvcached.api.request_size), so a fixed receive window (64 KiB a stream:
# no BDP probing, which grows the window with what a sender pushes) costs it nothing, and a
# sender repeating refused 34 MB Lookups no longer grows the daemon's memory: measured with
# eight such senders, anonymous memory +207 MiB with probing, +3 MiB without. At most 16 calls
# at once per connection.
READ_ONLY_HTTP2 = [("grpc.http2.bdp_probe", 0), ("grpc.max_concurrent_streams", 16)]

log = logging.getLogger("kvcached.daemon")

SERVICE_NAME = kvcache_pb2.DESCRIPTOR.services_by_name["KvCache"].full_name
LIVENESS_SERVICE = "kvcached.liveness"      # Kubernetes' liveness probe (kvcached.lifecycle.linger says why)
ADMIN_SERVICE_NAME = kvcache_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class GrpcServers:
    """The full and the read-only server (see the module). ``operated``: what the Admin
    service operates (the daemon); ``store``: what KvCache answers from (None until built,
    at a takeover: :meth:`set_store`). ``ports``: each TCP listener's port in use (as
    configured -> port); ``own_sockets``: the Unix sockets bound (path, inode). ``tenants``:
    who callers are (None: every call is the operator's); ``refusals``: calls refused for who
    made them, by reason."""

    def __init__(self, config: Config, operated: Operated, store: Store | None, started_at: float,
                 gate: Gate | None = None, tenants: TenantMap | None = None) -> None:
        self.config, self.operated, self.store, self.started_at, self.gate = config, operated, store, started_at, gate
        self.tenants = tenants
        self.refusals = Refusals()
        self.health = health.aio.HealthServicer()
        self.full: grpc.aio.Server | None = None
        self.read_only: grpc.aio.Server | None = None
        self.services: list[KvCacheService] = []
        self.tenant_servers: list[grpc.aio.Server] = []
        self.health_server: grpc.aio.Server | None = None
        self.ports: dict[str, int] = {}
        self.own_sockets: list[tuple[str, int]] = []

    async def start(self, listeners: list[ListenAddress], gid: int,
                    predecessor_ports: dict[str, int] | None = None) -> None:
        """Listen on ``listeners`` (the Unix sockets' group ``gid``, -1: the daemon's) and serve.
        ``predecessor_ports``: the ports the predecessor's TCP listeners got (for those
        configured with port 0), at a takeover."""
        cfg = self.config
        tcp = [a for a in listeners if not a.unix_path]
        full = [a for a in listeners if a.unix_path] + (tcp if cfg.grpc.tls else [])
        read_only = ([] if cfg.grpc.tls else tcp) + [parse_listen(x) for x in cfg.grpc.read_only_listen]
        credentials = self._tls_credentials() if cfg.grpc.tls else None
        renames: list[tuple[str, str]] = []
        try:
            await self._bind_all(full, read_only, credentials, predecessor_ports, renames, gid)
        except BaseException:                    # a failed start leaves no socket under a temporary name
            for temporary, _ in renames:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            raise
        for temporary, path in renames:
            os.rename(temporary, path)
            self.own_sockets.append((path, os.stat(path).st_ino))
        if self.gate is None:
            await self.serving()

    async def _bind_all(self, full: list[ListenAddress], read_only: list[ListenAddress],
                        credentials: grpc.ServerCredentials | None, predecessor_ports: dict[str, int] | None,
                        renames: list[tuple[str, str]], gid: int) -> None:
        """Every server started, its Unix sockets bound under temporary names (``renames``)."""
        cfg = self.config
        self.full = await self._grpc_server(full, credentials, predecessor_ports, renames, gid, read_only=False,
                                            callers=self._callers(cfg))
        if read_only:
            self.read_only = await self._grpc_server(
                read_only, self._tls_credentials(require_client_auth=False) if cfg.grpc.tls else None,
                predecessor_ports, renames, gid, read_only=True,
                callers=Unauthenticated(self.tenants, self.refusals) if self.tenants else None)
        if cfg.grpc.health_listen:
            self.health_server = await self._health_server(parse_listen(cfg.grpc.health_listen), predecessor_ports)
        for name, path in cfg.tenants.sockets.items():
            tenant = self.tenants.named(name) if self.tenants else None
            assert tenant is not None, name          # the configuration checks each names a uid or gid
            admit = (cfg.tenants.uids.get(name, []), cfg.tenants.gids.get(name, []))
            self.tenant_servers.append(await self._grpc_server(
                [parse_listen(f"unix:{path}")], None, None, renames, -1, read_only=False,
                callers=BoundTenant(self.tenants, self.refusals, tenant), admit=admit))  # type: ignore[arg-type]

    async def serving(self) -> None:
        """Health: SERVING, for the server and each service."""
        for name in ("", SERVICE_NAME, ADMIN_SERVICE_NAME, LIVENESS_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def set_store(self, store: Store) -> None:
        """The store the services answer from (built after them at a takeover)."""
        for service in self.services:
            service.store = store

    async def stop(self, grace_s: float, graceful_health: bool) -> None:
        """Stop both servers (calls in flight finish within ``grace_s``); with
        ``graceful_health``, health says NOT_SERVING first."""
        if graceful_health:
            await self.health.enter_graceful_shutdown()
        for server in (self.full, self.read_only, self.health_server, *self.tenant_servers):
            if server is not None:
                await server.stop(grace_s)

    async def _health_server(self, address: ListenAddress, predecessor_ports: dict[str, int] | None) -> grpc.aio.Server:
        """grpc.health.v1 alone, plaintext (grpc.health_listen: Kubernetes' gRPC probes on the
        pod's address): it tells whether the daemon serves, and nothing of what it holds. Held at
        the gate like every call at a takeover, so a successor is not ready before it serves."""
        server = grpc.aio.server(interceptors=[self.gate] if self.gate else None, options=[("grpc.so_reuseport", 1)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        key = f"grpc.health_listen {address.text}"
        if predecessor_ports is None:
            check_tcp_port_free(address.host or "", address.port or 0, key)
        port = server.add_insecure_port(f"{address.host}:{address.port or (predecessor_ports or {}).get(address.text, 0)}")
        if port == 0:
            raise StartupError(f"{key}: cannot listen (address in use?)")
        self.ports[address.text] = port
        log.info("grpc health listening", extra=fields(listen=f"{address.host}:{port}"))
        await server.start()
        return server

    def _callers(self, cfg: Config) -> Callers | None:
        if self.tenants is None:
            return None
        t = cfg.tenants
        return OperatorOrCertificate(self.tenants, self.refusals, by_certificate=bool(t.certs), cert_field=t.cert_field,
                                     operators=t.operators)

    def _tls_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials:
        cert, key, ca = self.config.grpc_tls_files()
        try:
            with open(key, "rb") as k, open(cert, "rb") as c, open(ca, "rb") as a:
                return grpc.ssl_server_credentials([(k.read(), c.read())], root_certificates=a.read(),
                                                   require_client_auth=require_client_auth)
        except OSError as exc:
            raise StartupError(f"grpc.tls_cert/tls_key/tls_ca: {exc}") from None

    async def _grpc_server(self, addresses: list[ListenAddress], credentials: grpc.ServerCredentials | None,
                           predecessor_ports: dict[str, int] | None, renames: list[tuple[str, str]], gid: int, *,
                           read_only: bool, callers: Callers | None,
                           admit: tuple[list[int], list[int]] | None = None) -> grpc.aio.Server:
        """One gRPC server on ``addresses``, its calls' tenants named by ``callers``; a Unix socket
        is bound at a temporary name, added to ``renames`` as (temporary, path) with its mode and
        group set (see :meth:`start`), or, with ``admit`` (uids, gids), opened to those alone."""
        limit = self.config.grpc.max_message_mib << 20
        max_batch = self.config.grpc.max_batch
        # The read-only listener receives no more than its largest allowed request: gRPC refuses
        # the rest from their length prefix (kvcached.api.request_size).
        receive = min(limit, largest_read_only_request(max_batch)) if read_only else limit
        several = self.tenants is not None and self.tenants.several
        interceptors: list[grpc.aio.ServerInterceptor] = ([self.gate] if self.gate else []) + (
            [ReadOnly()] if read_only else []) + ([OperatorOnly(callers, self.refusals)] if several and callers else [])
        server = grpc.aio.server(interceptors=interceptors or None, options=[
            ("grpc.max_receive_message_length", receive),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 1),
        ] + (READ_ONLY_HTTP2 if read_only else []))
        service = KvCacheService(self.store, max_message_bytes=limit, started_at=self.started_at,  # type: ignore[arg-type]
                                 grpc_config=self.config.grpc,     # the store is set here later in a takeover
                                 callers=callers, several_tenants=several)
        self.services.append(service)
        bounded(server, max_batch, functools.partial(kvcache_pb2_grpc.add_KvCacheServicer_to_server, service))
        bounded(server, max_batch, functools.partial(kvcache_pb2_grpc.add_AdminServicer_to_server,
                                                     AdminService(self.operated, callers)))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        for address in addresses:
            tls = credentials is not None and address.unix_path is None
            bind = address.text
            if address.unix_path:
                temporary = f"{address.unix_path}.{os.getpid()}.new"
                bind = f"unix:{temporary}"
            elif predecessor_ports is not None:
                if not address.port and address.text in predecessor_ports:
                    bind = f"{address.host}:{predecessor_ports[address.text]}"
            else:
                check_tcp_port_free(address.host or "", address.port or 0, f"grpc.listen {address.text}")
            try:
                port = (server.add_secure_port(bind, credentials) if tls else server.add_insecure_port(bind))
            except RuntimeError as exc:
                raise StartupError(f"grpc.listen {address.text}: cannot listen ({exc})") from None
            if address.unix_path is None and port == 0:
                raise StartupError(f"grpc.listen {address.text}: cannot listen (address in use?)")
            if address.unix_path and admit is not None:
                renames.append((temporary, address.unix_path))
                try:
                    admit_only(temporary, *admit)
                except OSError as exc:
                    raise StartupError(f"tenants.sockets {address.unix_path}: {exc.strerror or exc}") from None
            elif address.unix_path:
                renames.append((temporary, address.unix_path))
                os.chmod(temporary, self.config.socket_mode_bits)
                if gid >= 0:
                    os.chown(temporary, -1, gid)
            else:
                self.ports[address.text] = port
            where = address.text if address.unix_path else f"{address.host}:{port}"
            security = ("unix socket" if address.unix_path else
                        "mutual TLS" if tls and not read_only else "TLS" if tls else "plaintext")
            log.info("grpc listening", extra=fields(listen=where, security=security,
                                                    calls="read-only" if read_only else "all"))
            if address.unix_path is None and not tls and not address.is_loopback:
                log.warning("plaintext gRPC on a non-loopback address (grpc.insecure): read-only calls, unencrypted",
                            extra=fields(listen=where))
        await server.start()
        return server

