"""The daemon process: wires config, index, tiers, store and listeners; runs until a signal.

Start-up order: the umask (kvcached.host.fsmodes: state 0700/0600 whatever the caller's umask), a
check that no other daemon owns our sockets (their missing directories created first, searchable
by whom the sockets admit; a successor taking over asks the running daemon instead and listens
beside it: kvcached.lifecycle.succession), the state directories (created 0700, or checked: refused if
others can write to them), the RAM arena (new, or the previous process's: kvcached.lifecycle.succession),
the index (its lock: no other daemon; its boot reconcile), the SSD tier's directory, the gRPC
listeners (KvCache, health, reflection), the agent socket, metrics, background tasks:
maintenance, index recovery, taking up the previous process's RAM tier, the SSD reconcile (it
runs while the daemon serves), the write-back demoter and the SSD evictor.

While the index cannot be written (its disk is full), puts are refused UNAVAILABLE and reads go
on; the background tasks that write the index wait, and the index recovers by itself once its
disk has room (BlockIndex.recover, about every second). Health stays SERVING meanwhile: reads
are served, and a restart would not free the disk but would lose every block held only in RAM.

Shutdown on SIGTERM or SIGINT: health goes NOT_SERVING, listeners stop accepting, in-flight
calls get ``grpc.grace_s`` to finish, background tasks stop, SSD commits in progress finish,
then last-seen times are flushed and the index is closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from kvcached import __version__
from kvcached.api.access import Gate
from kvcached.api.agent_server import AgentServer
from kvcached.api.grpc_servers import GrpcServers
from kvcached.config import RELOADABLE, Config, ConfigError, changed_keys, parse_listen, with_reloaded
from kvcached.events import EventStreams, streams_for
from kvcached.host.aio import cancel_and_wait
from kvcached.host.fsmodes import set_daemon_umask
from kvcached.host.logs import fields, set_level
from kvcached.host.loop_lag import LoopLag, watch_loop
from kvcached.host.process import (
    StartupError,
    claim_unix_socket,
    cpu_threads,
    group_id,
    tune_malloc,
    tune_switch_interval,
)
from kvcached.index import BlockIndex
from kvcached.lifecycle.handover import (
    HandoverServer,
    handover_path,
)
from kvcached.lifecycle.linger import linger
from kvcached.lifecycle.opening import open_index, open_ssd, prepare_state_dirs
from kvcached.lifecycle.succession import (
    Succession,
    begin_takeover,
    exec_with_fds,
    nothing_passed,
    open_arenas,
    passed_arenas,
    same_listeners,
)
from kvcached.lifecycle.systemd import Notifier, listen_fds
from kvcached.policies import PolicySettings, make_eviction_policy, make_keyed_policy
from kvcached.policies.admission import SsdWriteBudget, make_admission_policy
from kvcached.policies.prefetch import make_prefetch_policy
from kvcached.policies.write import make_write_policy
from kvcached.store import Store
from kvcached.store.adoption import RamAdoption
from kvcached.store.keeper import KeeperSettings, StoreKeeper
from kvcached.tenants import TenantMap, ram_shares, ssd_shares, tenants_for
from kvcached.tiers.arenas import Arenas
from kvcached.tiers.ram import RamTier
from kvcached.tiers.slot_directory import SlotDirectory
from kvcached.tiers.ssd import SsdTier

if TYPE_CHECKING:          # the peer tier, the cluster and metrics are imported when configured (start-up time)
    from kvcached.cluster.etcd import EtcdMembership
    from kvcached.peers.tier import PeerTier

__all__ = ["Daemon", "StartupError", "serve"]

log = logging.getLogger("kvcached.daemon")

MAINTENANCE_PERIOD_S = 5.0
DEMOTE_PERIOD_S = 1.0
EVICT_PERIOD_S = 1.0
PRUNE_SLICE = 10_000       # tombstones deleted per slice before requests get the loop back
INDEX_CHECK_S = 1.0        # how often an unwritable index is asked to recover (it backs off by itself)


class Daemon:
    def __init__(self, config: Config, reload: Callable[[], Config] | None = None, *, takeover: bool = False,
                 rolling: bool = False, argv: list[str] | None = None) -> None:
        """``takeover``: start by taking over from the daemon running on this configuration
        (kvcached.lifecycle.handover); ``rolling``: do so if one answers, else start on its own
        (``serve --rolling``: a Kubernetes pod's rolling update); ``argv``: this process's command line, which an upgrade runs again
        with ``--takeover`` (None: upgrades are refused)."""
        self.config = config
        self._load_config = reload
        self.started_at = time.time()
        self.index: BlockIndex | None = None
        self.arenas: Arenas | None = None                 # the RAM tier's, one per tenant
        self.store: Store | None = None
        self.keeper: StoreKeeper | None = None            # the store's timed work
        self.ssd: SsdTier | None = None
        self.grpc: GrpcServers | None = None
        self.agents: AgentServer | None = None
        self.tenants: TenantMap | None = None             # who callers are ([tenants]), from the start
        self.peers: PeerTier | None = None
        self.membership: EtcdMembership | None = None
        self.metrics_server: Any = None
        self.loop_lag = LoopLag()                         # how late the event loop runs (metrics)
        self._tasks: list[asyncio.Task[None]] = []
        self._own_sockets: list[tuple[str, int]] = []   # Unix sockets this process bound (path, inode): removed if still ours
        self._stop = asyncio.Event()
        self.notifier = Notifier()              # systemd (Type=notify); a no-op elsewhere
        self.index_reconcile: dict[str, Any] = {}        # the boot reconcile's counts (Admin ReconcileStatus)
        self.slot_directory: SlotDirectory | None = None
        self.adoption: RamAdoption | None = None          # the previous process's RAM tier, being taken up
        self.events: EventStreams | None = None          # [events], tenants.events: the KV event streams
        self._inherited_fds: dict[str, int] = {}          # passed by an upgrade's predecessor
        self._trusted_arena = False                       # a clean handover: its directory is true as passed
        self._takeover = takeover
        self._rolling = rolling
        self._gate: Gate | None = None                    # gRPC calls held until the successor serves
        self._handover: HandoverServer | None = None
        self._winding: asyncio.Future[None] | None = None   # the wind-down, once (a stop, or a handover)
        self.exit_code = 0
        self.succession = Succession(self, self._wind_down_once, self._stop.set, argv)   # handovers, upgrades

    @property
    def ssd_reconcile_summary(self) -> dict[str, Any]:
        """The SSD boot reconcile's findings, once it is done (Admin ReconcileStatus)."""
        return self.keeper.ssd_reconcile_summary if self.keeper is not None else {}

    @property
    def ram_adoption_summary(self) -> dict[str, Any]:
        """What the take-up of a predecessor's RAM tier found, once done (Admin ReconcileStatus)."""
        return self.keeper.ram_adoption_summary if self.keeper is not None else {}

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        listeners = cfg.listeners
        agent_sockets = [cfg.agent.socket] * bool(cfg.agent.socket) + list(cfg.tenants.agent_sockets.values())
        agent_gid = group_id(cfg.agent.group, "agent.group") if agent_sockets else -1
        grpc_gid = group_id(cfg.grpc.socket_group, "grpc.socket_group")   # before any listener: fail early
        # Sockets first: a directory shared with the state (var/ of the default configuration)
        # is then created searchable for the sockets' clients; the state under it stays 0700.
        # A successor takes them over from the daemon that owns them instead.
        takeover = await begin_takeover(cfg, if_running=not self._takeover) if self._takeover or self._rolling else None
        if takeover is None:
            for path in agent_sockets:
                claim_unix_socket(path, cfg.agent.mode_bits, agent_gid)
            for address in listeners:
                if address.unix_path:
                    claim_unix_socket(address.unix_path, cfg.socket_mode_bits, grpc_gid)
            for path in cfg.tenants.sockets.values():      # a tenant's own: its ACL admits it alone
                claim_unix_socket(path, 0o666, -1)
        prepare_state_dirs(cfg)
        try:
            self.tenants = tenants_for(cfg)
        except OSError as exc:
            raise StartupError(f"tenants.key_file: {exc}") from None
        if takeover is not None:       # listen beside the predecessor (calls wait at the gate), then take its state
            self._gate = Gate()
            self.grpc = GrpcServers(cfg, self, None, self.started_at, self._gate, self.tenants)
            await self.grpc.start(listeners, grpc_gid, takeover.info.get("grpc_tcp", {}))
            self._trusted_arena = await takeover.listening()
            self._inherited_fds = passed_arenas(takeover.take)
        kv = cfg.kv
        self.arenas, self.slot_directory, entries, owners = open_arenas(
            cfg, self.notifier, self._inherited_fds or listen_fds(), self._trusted_arena, self.tenants.tags)
        settings = PolicySettings(slru_ratio=kv.slru_ratio)
        ram = RamTier(self.arenas, cfg.max_block_bytes, make_eviction_policy(kv.ram_policy, settings), self.slot_directory,
                      ram_shares(cfg, self.arenas.size), count_tenants=self.tenants.several, owners=owners)
        self.adoption = RamAdoption(ram, entries, trusted=self._trusted_arena) if entries else None
        try:
            self.events = streams_for(cfg, cfg.cluster.name or socket.gethostname())
        except OSError as exc:
            raise StartupError(f"events: {exc}") from None
        # After a clean handover the index is as true as the predecessor left it: no boot scan.
        self.index, self.index_reconcile = open_index(
            cfg, self.notifier.status, self.adoption.placed_keys if self.adoption else frozenset(),
            reconcile=not self._trusted_arena, tier_feed=self.events.feed if self.events else None)
        self.ssd = open_ssd(cfg, self.tenants)
        ssd_order = make_keyed_policy(kv.ssd_policy, settings) if self.ssd and kv.ssd_policy != "lru" else None
        peer_tier = bool(cfg.quic.listen or cfg.quic.peers)
        self.store = Store(ram, self.index, ssd=self.ssd, write_policy=make_write_policy(kv.write_policy, kv.write_through_threshold),
                           ssd_ttl=kv.ssd_ttl, gone_ttl=kv.gone_ttl, max_gpu_blocks=cfg.agent.max_gpu_blocks,
                           admission=make_admission_policy(kv.admission, kv.admission_threshold, kv.admission_window),
                           ssd_budget=SsdWriteBudget(int(kv.ssd_write_budget_gib * (1 << 30))),
                           ssd_order=ssd_order, rebuild_ssd_order=ssd_order is not None,   # after the reconcile
                           adoption=self.adoption, mirror_pulls=kv.mirror_pulls,
                           prefetch=make_prefetch_policy(kv.prefetch_policy, kv.prefetch_timeout_ms / 1000),
                           timed_tiers=(["gpu"] * bool(agent_sockets) + ["ram"] + ["ssd"] * bool(self.ssd)   # read latencies
                                        + ["peer"] * peer_tier) if cfg.metrics.listen else (),
                           count_tenants=self.tenants.several, ssd_shares=ssd_shares(cfg),
                           curve_keys=kv.curve_sample_keys if kv.curves else 0, hash_threads=cpu_threads(kv.hash_threads),
                           route_keys_bytes=cfg.events.route_keys_mib << 20)
        self.keeper = StoreKeeper(self.store, self.index, KeeperSettings(
            kv.policy_save_s, kv.ram_policy, kv.ssd_policy, kv.slru_ratio, cfg.grpc.grace_s), status=self.notifier.status)
        self.keeper.restore_policies()
        if self.events is not None:      # the predecessor (an upgrade) has closed its endpoints with its index
            try:                         # a RAM tier not taken up is said with a RAM-scoped clear
                self.events.start(ram_lost=self.adoption is None and not self._trusted_arena)
            except OSError as exc:
                raise StartupError(str(exc.strerror or exc)) from None
        if takeover is not None:              # the predecessor's listening sockets where ours are the same
            takeover.keep(same_listeners(takeover.info, cfg))
        passed = takeover.take if takeover is not None else nothing_passed
        if peer_tier:
            await self._start_peers(passed)
        if self.grpc is None:
            self.grpc = GrpcServers(cfg, self, self.store, self.started_at, tenants=self.tenants)
            await self.grpc.start(listeners, grpc_gid)
        self.grpc.set_store(self.store)        # built before the store when listening beside a predecessor
        if agent_sockets:
            self.agents = AgentServer(self.store, cfg.agent.socket, arena_for=ram.agent_fds, arena_bytes=ram.arenas.size,
                                      mode=cfg.agent.mode_bits, gid=agent_gid, heartbeat_s=cfg.agent.heartbeat_s,
                                      max_agents=cfg.agent.max_agents, tenants=self.tenants,
                                      tenant_sockets=cfg.tenants.agent_sockets)
            try:
                await self.agents.start(passed)
            except OSError as exc:
                raise StartupError(f"agent socket {exc.strerror or exc}") from None
            self._own_sockets += [(path, os.stat(path).st_ino) for path in agent_sockets]
            log.info("agent sockets listening", extra=fields(paths=",".join(agent_sockets), mode=cfg.agent.mode))
        if cfg.metrics.listen:
            from kvcached.api.metrics import start_metrics
            try:
                self.metrics_server = start_metrics(cfg.metrics.listen, self.store, passed("metrics"), self.loop_lag,
                                                   self.keeper, self.events.counters if self.events else None,
                                                   self.agents, self.grpc.refusals if self.grpc else None)
            except OSError as exc:
                raise StartupError(f"metrics.listen {cfg.metrics.listen}: {exc.strerror or exc}") from None
            log.info("metrics listening", extra=fields(listen=cfg.metrics.listen))
        if takeover is not None:
            takeover.close_files()
        self._handover = HandoverServer(handover_path(cfg.kv.index_dir), self.succession.hand_over,
                                        self.succession.upgrade)
        self._handover.start()
        # The store's timed work; RAM adoption runs while serving (a request settles the blocks it names first).
        self.keeper.start(self.adoption)
        self._tasks.append(asyncio.create_task(watch_loop(self.loop_lag), name="loop-lag"))
        log.info("ready", extra=fields(version=__version__, ram_bytes=ram.capacity, pid=os.getpid(),
                                       ssd_bytes=self.ssd.capacity if self.ssd else 0,
                                       ssd_direct_io=self.ssd.direct if self.ssd else False,
                                       startup_s=round(time.time() - self.started_at, 3)))
        if self._gate is not None:
            await self.grpc.serving()
            self._gate.open()
        # Every listener accepts by now: systemd may start what depends on this daemon (after
        # an upgrade, MAINPID tells it this process is the service now).
        self.notifier.ready("serving" if self.ssd is None or self.store.ssd_reconciled else
                            "serving; reconciling the SSD tier")
        if takeover is not None:
            await takeover.serving()
            log.warning("took over from the previous daemon", extra=fields(
                ram_blocks=len(ram), trusted=self._trusted_arena, startup_s=round(time.time() - self.started_at, 3)))
        if self.notifier.watchdog_s is not None:
            self._tasks.append(asyncio.create_task(self._watchdog(self.notifier.watchdog_s), name="watchdog"))

    async def _watchdog(self, every_s: float) -> None:
        """WATCHDOG=1 from the event loop itself: a wedged loop stops the pings and systemd
        restarts the daemon (WatchdogSec in deploy/kvcached.service)."""
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(every_s)

    async def _start_peers(self, passed: Callable[[str], int | None]) -> None:
        """The peer tier: the QUIC server, and a link to each configured peer (docs/peers.md)."""
        from kvcached.peers.certs import certificate_names
        from kvcached.peers.handshakes import HandshakeLimits
        from kvcached.peers.tier import PeerSettings, PeerTier
        from kvcached.peers.tls import PeerAuth, PeerRefused, QuicOptions

        assert self.store is not None and self.index is not None
        q, c = self.config.quic, self.config.cluster
        if c.etcd and c.name not in certificate_names(q.cert):
            raise StartupError(f"cluster.name: {c.name!r} is not a name quic.cert carries "
                               f"({', '.join(certificate_names(q.cert)) or 'none'}): peers would refuse it")
        try:
            auth = PeerAuth.from_files(q.ca, q.cert, q.key, [peer["name"] for peer in q.peers])
            auth.configuration(QuicOptions())          # loads the certificate and key: fail here, not at a pull
        except (OSError, ValueError, PeerRefused) as exc:
            raise StartupError(f"quic.cert/quic.key/quic.ca: {exc}") from None
        problem = auth.own_certificate_problem()
        if problem:
            log.warning("this daemon's certificate will be refused by its peers", extra=fields(problem=problem))
        listen = parse_listen(q.listen) if q.listen else None
        endpoint = None
        if listen is not None:
            assert listen.host is not None and listen.port is not None, "config takes only host:port for quic.listen"
            endpoint = (listen.host.strip("[]"), listen.port)
        settings = PeerSettings(
            listen=endpoint,
            peers={peer["name"]: _host_port(peer["address"]) for peer in q.peers},
            options=QuicOptions(q.max_datagram_size, int(q.max_data_mib * (1 << 20)),
                                int(q.max_stream_data_mib * (1 << 20))),
            pull_timeout_s=q.pull_timeout_s, hedge_s=q.hedge_ms / 1000, fail_limit=q.fail_limit, lane=q.lane,
            lane_stripes=q.lane_stripes, lane_max_connections=q.lane_max_connections, link_codec=q.link_codec,
            backoff_s=q.backoff_s, backoff_max_s=q.backoff_max_s, max_payload=self.config.max_block_bytes,
            limits=HandshakeLimits(q.retry, q.max_handshakes, q.max_handshakes_per_source, q.max_connections,
                                   q.handshake_timeout_s, q.stateless_replies_per_s),
            member=c.name if c.etcd else None, replicas=c.replicas, placement_bits=c.placement_bits,
            nixl_hold_s=q.nixl_hold_s)
        assert self.arenas is not None
        self.peers = PeerTier(self.store, auth, settings,
                              nixl=nixl_endpoint(self.arenas, self.store.ram, self.tenants.tags if self.tenants else [""],
                                                 q.nixl_transports)
                              if q.nixl else None)
        try:
            await self.peers.start(passed("quic"), passed("lane"))
        except OSError as exc:
            raise StartupError(f"quic.listen {q.listen}: {exc.strerror or exc}") from None
        self.store.peers = self.peers
        self.index.presence = self.peers.presence
        log.info("peer tier listening", extra=fields(listen=q.listen or None, peers=len(q.peers),
                                                     mirror_pulls=self.config.kv.mirror_pulls))
        if c.etcd:
            await self._join_cluster(listen.host if listen is not None and listen.host else "")

    async def _join_cluster(self, listen_host: str) -> None:
        """Register in etcd and follow the membership ([cluster], docs/cluster.md): the peer
        tier dials the members and shares the homes of blocks with them."""
        from kvcached.cluster.etcd import EtcdMembership, EtcdSettings
        from kvcached.cluster.member import Member
        from kvcached.cluster.proof import RegistrationSigner, RegistrationVerifier
        from kvcached.cluster.view import Change, MembershipView

        peers, c = self.peers, self.config.cluster
        assert peers is not None and peers.address is not None, "a cluster needs quic.listen (config checks it)"
        port = peers.address[1]
        me = Member(c.name, c.advertise or listen_host.strip("[]"), port, port,
                    self.config.ram_bytes + int(self.config.kv.ssd_gib * (1 << 30)), __version__)
        q = self.config.quic
        try:
            signer = RegistrationSigner(Path(q.cert).read_bytes(), Path(q.key).read_bytes())
            view = MembershipView(c.prefix, RegistrationVerifier(Path(q.ca).read_bytes()))
        except (OSError, ValueError) as exc:
            raise StartupError(f"cluster: cannot sign or check registrations with quic.cert, quic.key and quic.ca: "
                               f"{exc}") from None

        def changed(_: Change) -> None:
            peers.apply_membership({name: (m.host, m.quic_port) for name, m in view.members.items()}, c.name)

        try:
            tls = [Path(f).read_bytes() if f else None for f in (c.etcd_ca, c.etcd_cert, c.etcd_key)]
        except OSError as exc:
            raise StartupError(f"cluster.etcd_ca/etcd_cert/etcd_key: {exc}") from None
        self.membership = EtcdMembership(EtcdSettings(tuple(c.etcd), c.prefix, c.lease_s, *tls), me, signer, view,
                                         changed)
        peers.membership = self.membership
        joined = await self.membership.start(wait_s=min(5.0, c.lease_s))
        log.info("cluster joined" if joined else "cluster: etcd not reached yet, serving alone until it is",
                 extra=fields(name=c.name, etcd=",".join(c.etcd), members=len(view.members), lease_s=c.lease_s))

    def _index_writable(self) -> bool:
        return self.index is not None and self.index.writable

    def request_stop(self, signame: str = "") -> None:
        if not self._stop.is_set():
            log.info("stopping", extra=fields(signal=signame))
            self.notifier.stopping()
            self._stop.set()

    def reload(self) -> None:
        """SIGHUP: read the configuration again and apply what can change while serving
        (config.RELOADABLE); a bad file changes nothing, and other changes wait for a restart."""
        if self._load_config is None:
            log.warning("SIGHUP ignored: this daemon has no configuration file to read again")
            return
        self.notifier.notify(reloading=1, monotonic_usec=time.monotonic_ns() // 1000)
        try:
            try:
                new = self._load_config()
            except ConfigError as exc:
                log.error("reload refused; nothing changed", extra=fields(reason=str(exc)))
                return
            changed = changed_keys(self.config, new)
            applied = [f"{s}.{k}" for s, k in changed if (s, k) in RELOADABLE]
            later = [f"{s}.{k}" for s, k in changed if (s, k) not in RELOADABLE]
            self.config = with_reloaded(self.config, new)
            set_level(self.config.log.level)
            if self.store is not None:
                kv = self.config.kv
                self.store.ssd_ttl, self.store.gone_ttl = kv.ssd_ttl, kv.gone_ttl
                self.store.prefetch = make_prefetch_policy(kv.prefetch_policy, kv.prefetch_timeout_ms / 1000)
            log.warning("configuration reloaded", extra=fields(applied=",".join(applied) or None,
                                                               needs_restart=",".join(later) or None))
        finally:
            self.notifier.notify(ready=1, status="serving")

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig.name)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        """Stop in order; a step that fails is logged and the next ones still run, so the index
        is closed whatever happened before. After a handover (:meth:`_hand_over`) the work is
        done already and the sockets are the successor's: only the mappings are closed."""
        await self._wind_down_once()
        if self._handover is not None:
            await self._step("handover socket", self._handover.stop(unlink=not self.succession.handed_over))
        if self.arenas is not None:
            self._step_sync("arenas close", self.arenas.close)
            self.arenas = None
        if self.slot_directory is not None:
            self._step_sync("slot directory close", self.slot_directory.close)
            self.slot_directory = None
        own = self._own_sockets + (self.grpc.own_sockets if self.grpc is not None else [])
        for path, inode in [] if self.succession.handed_over else own:
            try:
                if os.stat(path).st_ino == inode:     # a successor's socket under the same name stays
                    self._step_sync("socket removal", os.unlink, path)
            except FileNotFoundError:
                pass
        log.info("stopped" if not self.succession.handed_over else "handed over; exiting",
                 extra=fields(uptime_s=round(time.time() - self.started_at, 1)))

    async def _wind_down_once(self) -> None:
        """:meth:`_wind_down`, run once: a SIGTERM during a handover waits for the handover's."""
        if self._winding is None:
            self._winding = asyncio.ensure_future(self._wind_down())
        await asyncio.shield(self._winding)

    async def _wind_down(self) -> None:
        """Everything a stop does up to closing the index: listeners, agents, peers, background
        work, write-back (not when handing over: the successor keeps the dirty blocks in RAM),
        last-seen times, policy state."""
        handing_over = self.succession.handing_over
        if self.grpc is not None:
            await self._step("grpc", self.grpc.stop(self.config.grpc.grace_s, graceful_health=not handing_over))
        if self.agents is not None:
            await self._step("agent socket", self.agents.stop())
        if self.membership is not None:         # leave the cluster first: the others stop asking at once
            # (a successor registers under the same name: leaving would make the others forget us)
            await self._step("cluster membership", self.membership.stop(revoke=not handing_over))
        if self.peers is not None:
            await self._step("peer tier", self.peers.stop())
        if self.keeper is not None:     # its rounds finish, write-back (not when handing over), a save completes
            await self._step("store keeper", self.keeper.stop(handing_over))
        await cancel_and_wait(self._tasks)
        if self.store is not None:
            await self._step("background work", self.store.drain(self.config.grpc.grace_s))
            self._step_sync("checksum thread", self.store.close)
        if self.keeper is not None:
            self._step_sync("scan thread", self.keeper.close)
        if self.ssd is not None:                 # before the arena goes: SSD threads read from it
            await self._step("ssd close", self.ssd.close())
        if self.metrics_server is not None:
            self._step_sync("metrics", self.metrics_server.shutdown)
            self._step_sync("metrics", self.metrics_server.server_close)
        if self.store is not None and self._index_writable():
            if handing_over:    # evictions the last request noted, not yet written
                self._step_sync("index write", self.store.ledger.commit)
            self._step_sync("last-seen flush", self.store.flush_last_seen)
            if self.keeper is not None:
                self._step_sync("policy state save", self.keeper.save_policies)
        if self.events is not None:      # the last changes, then the next sequence number persisted
            await self._step("kv events", self.events.stop())
        if self.index is not None:
            self._step_sync("index close", self.index.close)
            self.index = None

    @staticmethod
    async def _step(name: str, awaitable: Any) -> None:
        try:
            await awaitable
        except Exception:
            log.exception("shutdown step failed", extra=fields(step=name))

    @staticmethod
    def _step_sync(name: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("shutdown step failed", extra=fields(step=name))


def _host_port(text: str) -> tuple[str, int]:
    address = parse_listen(text)
    return address.host.strip("[]"), address.port  # type: ignore[union-attr,return-value]


def serve(config: Config, reload: Callable[[], Config] | None = None, *, takeover: bool = False,
          rolling: bool = False, argv: list[str] | None = None) -> int:
    """Run the daemon in this process on uvloop; returns the exit code. ``reload`` reads the
    configuration again (SIGHUP); ``takeover``, ``rolling`` and ``argv``: see :class:`Daemon`.
    With ``rolling``, a daemon that handed over waits for SIGTERM before it exits: a pod's
    container that exits is started again, and it is the pod's deletion that ends it."""
    import uvloop

    set_daemon_umask()      # what this process creates is private whatever umask it was started under
    if not tune_malloc():
        log.warning("mallopt unavailable (not glibc?): large calls will page-fault their buffers")
    tune_switch_interval()   # a worker thread running Python holds the event loop's callbacks 0.5 ms, not 5

    async def main() -> tuple[int, dict[str, int], bool]:
        daemon = Daemon(config, reload, takeover=takeover, rolling=rolling, argv=argv)
        await daemon.run()
        return daemon.exit_code, daemon.succession.restart_with, daemon.succession.handed_over

    try:
        code, restart_with, handed_over = uvloop.run(main())
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 1
    if restart_with and argv is not None:
        exec_with_fds([a for a in argv if a != "--takeover"], restart_with)
    elif rolling and handed_over and code == 0:
        uvloop.run(linger(config))
    return code


def nixl_endpoint(arenas: Arenas, ram: RamTier, tags: list[str], transports: list[str]) -> Any:
    """The NIXL agent the NIXL lane reads this daemon's arenas through ([quic] nixl), or None
    where NIXL cannot load or start here: the daemon runs without the lane and says why. Every
    configured tenant's arena is made first: NIXL registers them once, at its start."""
    from kvcached.peers.nixl_transfer import NixlEndpoint, NixlUnavailable

    for tag in tags:
        ram.agent_fds(tag)
    regions = [arena.view for _, arena in sorted(arenas.items(), key=lambda item: item[0])]
    try:
        endpoint = NixlEndpoint(f"kvcached-{socket.gethostname()}-{os.getpid()}", regions, tuple(transports))
    except NixlUnavailable as exc:
        log.warning("NIXL lane off: NIXL cannot start here", extra=fields(reason=str(exc)))
        return None
    log.info("NIXL lane served", extra=fields(transports=",".join(transports) or "UCX's choice", arenas=len(regions)))
    return endpoint
