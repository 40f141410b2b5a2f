"""What outlives a daemon process, the daemon's side: the RAM arena it starts with, and both
ends of an upgrade's handover.

- :func:`open_arenas`: new arenas and slot directory, or those a predecessor left (systemd's
  file descriptor store after a crash, an upgrade's handover), put in the fd store either way;
  the store's keeper takes their blocks up (kvcached.store.keeper, adoption).
- :func:`begin_takeover`: the successor asks the running daemon to hand over.
- :class:`Succession`, a collaborator the daemon holds: :meth:`Succession.hand_over` is the
  running daemon's answer to a successor, :meth:`Succession.upgrade` starts one for ``kvcached
  upgrade``. It reads what it passes on through :class:`Predecessor` (the daemon is one) and
  winds the daemon down through the callback it is given.

kvcached.lifecycle.handover carries the protocol; this drives the daemon through it (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Sequence

from kvcached import __version__
from kvcached.api.agent_server import AgentServer, listener_name
from kvcached.api.grpc_servers import GrpcServers
from kvcached.config import Config
from kvcached.host.logs import fields
from kvcached.host.process import StartupError, shmem_huge_pages
from kvcached.host.shared_memory import SharedFiles, shared_files
from kvcached.lifecycle.handover import (
    HandoverBroken,
    Takeover,
    handover_path,
    network_namespace,
    send_files,
    send_released,
    tcp_migrate_req,
    wait_gone,
    wait_listening,
    wait_serving,
)
from kvcached.lifecycle.systemd import LISTEN_FDS_START, Notifier
from kvcached.store import Store
from kvcached.tiers.arena import SharedArena
from kvcached.tiers.arenas import Arenas, fd_name, owner_of_fd_name
from kvcached.tiers.slabs import SlabAllocator
from kvcached.tiers.slot_directory import VERSION, Geometry, SlotDirectory, SlotEntry, owner_digest

if TYPE_CHECKING:
    from kvcached.peers.tier import PeerTier

__all__ = ["SLOTS_FD_NAME", "Predecessor", "Succession", "begin_takeover", "exec_with_fds",
           "nothing_passed", "open_arenas", "passed_arenas", "same_listeners"]

log = logging.getLogger("kvcached.daemon")

SLOTS_FD_NAME = "kvcached-slots"    # in systemd's fd store and a handover, beside each arena's (tiers.arenas.fd_name)
HANDOVER_SETTLE_S = 0.05   # after the successor listens: what reached this daemon's queues just before is accepted
UPGRADE_TIMEOUT_S = 300.0


class Predecessor(Protocol):
    """What a handover passes on, read from the daemon when it happens."""

    @property
    def config(self) -> Config: ...
    @property
    def arenas(self) -> Arenas | None: ...
    @property
    def slot_directory(self) -> SlotDirectory | None: ...
    @property
    def store(self) -> Store | None: ...
    @property
    def agents(self) -> AgentServer | None: ...
    @property
    def peers(self) -> PeerTier | None: ...
    @property
    def grpc(self) -> GrpcServers | None: ...
    @property
    def metrics_server(self) -> Any: ...


def open_arenas(cfg: Config, notifier: Notifier, inherited: dict[str, int], trusted: bool,
                tags: Sequence[str]) -> tuple[Arenas, SlotDirectory, list[SlotEntry], list[str]]:
    """The RAM tier's arenas and their slot directory: those a previous process left (systemd's
    file descriptor store, or an upgrade's handover: ``trusted``, its directory true as passed)
    when they fit this configuration, with the entries to take up and the owners' tags in id
    order (kvcached.tiers.arenas: a predecessor's numbering is kept); new ones otherwise.
    ``tags``: the tenants configured (Tenant.tag; "" the default's alone: one arena). Either way
    every arena and the directory go into the fd store, and so does each arena made later
    (docs/operations.md). With ``kv.arena = "file"`` the arenas are files in ``kv.arena_dir``
    instead: those a previous process left there are taken up when nothing was passed (a crash,
    a pod replaced), every block checked, and the fd store is not needed."""
    geometry = SlabAllocator.geometry(cfg.ram_bytes, cfg.max_block_bytes)
    try:
        files = shared_files(cfg.kv.arena, cfg.kv.arena_dir)
    except (ValueError, OSError) as exc:
        raise StartupError(f"kv.arena_dir: {exc}") from None
    if cfg.ram_bytes % files.page_bytes:
        raise StartupError(f"kv.ram_gib: {cfg.ram_bytes} bytes is not a whole number of the huge pages of "
                           f"{cfg.kv.arena_dir} ({files.page_bytes} bytes)")
    if not inherited and files.persistent:
        inherited = files.left([SLOTS_FD_NAME] + [fd_name(owner) for owner in range(256)])
    if any(tag != "" for tag in tags) and shmem_huge_pages() in ("never", "deny"):
        log.warning("tenants' arenas pass memory between them in 4 KiB pages (about 1 ms a MiB, ten times what "
                    "huge pages cost): set /sys/kernel/mm/transparent_hugepage/shmem_enabled to advise "
                    "(docs/operations.md)", extra=fields(shmem_enabled=shmem_huge_pages()))
    slots_fd = inherited.pop(SLOTS_FD_NAME, None)
    arena_fds = {owner: inherited.pop(name) for name in list(inherited)
                 if (owner := owner_of_fd_name(name)) is not None}
    for name, fd in inherited.items():
        log.warning("file descriptor passed at start not used", extra=fields(name=name))
        os.close(fd)
    passed = set(arena_fds)
    directory, adopted, owners, entries = _take_up(cfg, geometry, slots_fd, arena_fds, tags, files)
    for owner in passed - set(adopted):        # not taken up: systemd must not keep its memory
        notifier.notify(fdstoreremove=1, fdname=fd_name(owner))
        files.drop(fd_name(owner))
    if directory is None:
        directory = SlotDirectory.create(geometry, SLOTS_FD_NAME, files)
        notifier.notify(fdstoreremove=1, fdname=SLOTS_FD_NAME)   # an unusable one left there
    arenas = Arenas(cfg.ram_bytes, adopted, files)

    def store(owner: int, arena: SharedArena) -> None:
        notifier.notify(fdstoreremove=1, fdname=fd_name(owner))  # a stale one of that name
        notifier.store_fd(fd_name(owner), arena.fd)

    if not files.persistent:       # files in kv.arena_dir outlive the process by themselves
        notifier.store_fd(SLOTS_FD_NAME, directory.fd)      # systemd keeps one copy of a file it holds already
        for owner, arena in arenas.items():
            notifier.store_fd(fd_name(owner), arena.fd)
        arenas.on_made.append(store)
    arenas.get(0)          # the default tenant's, always: a successor takes up the arenas only with it
    if entries:
        log.info("RAM arenas taken over from the previous process", extra=fields(
            blocks=len(entries), arenas=len(adopted), checked="no (a clean handover)" if trusted else "yes"))
    return arenas, directory, entries, owners


def _take_up(cfg: Config, geometry: Geometry, slots_fd: int | None, arena_fds: dict[int, int],
             tags: Sequence[str], files: SharedFiles) -> tuple[SlotDirectory | None, dict[int, SharedArena], list[str], list[SlotEntry]]:
    """The predecessor's directory, the arenas of it this configuration keeps (by owner), the
    owners' tags in id order and the directory's committed entries; (None, {}, [], []) where
    nothing usable was passed. A version-1 directory's entries go into a new directory."""
    if slots_fd is None or 0 not in arena_fds:
        if slots_fd is not None or arena_fds:
            log.warning("the arenas were passed at start without their slot directory (or the other way round): "
                        "starting with an empty RAM tier")
        for fd in [*arena_fds.values(), *([slots_fd] if slots_fd is not None else [])]:
            os.close(fd)
        return None, {}, [], []
    try:
        directory = SlotDirectory.adopt(slots_fd, geometry, files.page_bytes)
    except (ValueError, OSError) as exc:
        log.warning("the RAM arena left by the previous process does not fit this configuration: "
                    "starting with an empty RAM tier", extra=fields(reason=str(exc)))
        for fd in [slots_fd, *arena_fds.values()]:
            os.close(fd)
        return None, {}, [], []
    several = any(tag != "" for tag in tags)        # else the default tenant's owner 0 alone
    by_digest = {owner_digest(tag): tag for tag in (["", *tags] if several else [""])}
    names = directory.owner_names()
    owners = [by_digest.get(names.get(o, b""), f"\x00gone.{o}") for o in range(max(names, default=0) + 1)]
    adopted: dict[int, SharedArena] = {}
    for owner, fd in arena_fds.items():
        try:
            if owner >= len(owners) or owners[owner].startswith("\x00gone"):
                raise ValueError("its tenant is no longer configured")
            files.check(fd, cfg.ram_bytes)
            adopted[owner] = SharedArena(cfg.ram_bytes, fd_name(owner), fd=fd)
        except (ValueError, OSError) as exc:
            log.warning("an arena left by the previous process is not taken up: its blocks are dropped",
                        extra=fields(arena=fd_name(owner), reason=str(exc)))
            os.close(fd)
    if 0 not in adopted:
        for arena in adopted.values():
            arena.close()
        directory.close()
        return None, {}, [], []
    entries = list(directory.committed_entries())
    if directory.version < VERSION:         # one arena's directory: its entries go into a new one
        directory.close()
        files.drop(SLOTS_FD_NAME)
        directory = SlotDirectory.create(geometry, SLOTS_FD_NAME, files)
        directory.name_owner(0, "")
        for e in entries:
            directory.reserved(e.slot, e.key, e.length, e.cls, e.owner)
            directory.committed(e.slot, e.clean)
    return directory, adopted, owners, entries


def passed_arenas(take: Callable[[str], int | None]) -> dict[str, int]:
    """The arenas' and the slot directory's files a predecessor's handover passed, by name."""
    names = [SLOTS_FD_NAME] + [fd_name(owner) for owner in range(256)]
    return {name: fd for name in names if (fd := take(name)) is not None}


async def begin_takeover(config: Config, *, if_running: bool = False) -> Takeover | None:
    """Ask the daemon running on ``config`` to hand over (kvcached.lifecycle.handover). None if it went
    away before it passed anything, or (``if_running``: ``serve --rolling``) if none answers:
    this process then starts on its own."""
    takeover = Takeover(handover_path(config.kv.index_dir))
    if if_running and not takeover.path.exists():
        return None
    log.info("asking the running daemon to hand over", extra=fields(socket=str(takeover.path)))
    try:
        await takeover.begin(__version__)
    except HandoverBroken as exc:
        connected = takeover.sock is not None
        takeover.close()
        if not connected and if_running:
            log.info("no daemon to take over from: starting on its own", extra=fields(reason=str(exc)))
            return None
        if not connected:
            raise StartupError(f"--takeover: {exc}") from None
        log.warning("the daemon being taken over went away before it passed anything: starting on its own",
                    extra=fields(reason=str(exc)))
        if not await wait_gone(takeover.predecessor_pid):    # its sockets close as it exits
            raise StartupError(f"--takeover: the daemon being taken over (pid {takeover.predecessor_pid}) "
                               "stopped answering but did not exit") from None
        return None
    log.warning("taking over from the running daemon", extra=fields(files=",".join(takeover.files)))
    return takeover


class Succession:
    """The running daemon's side of a handover, and ``kvcached upgrade`` (see the module).
    ``daemon``: what is passed on; ``wind_down``: the daemon's wind-down (once: a stop during a
    handover waits for the handover's); ``stop``: ends the daemon's run; ``argv``: the command
    line an upgrade runs again with ``--takeover`` (None: upgrades are refused)."""

    def __init__(self, daemon: Predecessor, wind_down: Callable[[], Awaitable[None]], stop: Callable[[], None],
                 argv: list[str] | None) -> None:
        self.daemon, self.wind_down, self.stop, self.argv = daemon, wind_down, stop, argv
        self.handing_over = False            # a successor takes the RAM tier: no write-back at stop
        self.handed_over = False             # the successor owns the sockets now
        self.restart_with: dict[str, int] = {}   # files to start this process again with (kvcached.lifecycle.daemon.serve)
        self._done: asyncio.Future[dict[str, Any]] | None = None

    async def hand_over(self, conn: socket.socket, request: dict[str, Any]) -> None:
        """The predecessor's side of a handover (kvcached.lifecycle.handover): pass the files, wait until
        the successor listens, wind down, release the index, wait until it serves, exit."""
        d, cfg = self.daemon, self.daemon.config
        files: dict[str, int] = {}
        try:
            assert d.arenas is not None and d.slot_directory is not None
            own = {SLOTS_FD_NAME: d.slot_directory.fd, **{fd_name(o): a.fd for o, a in d.arenas.items()}}
            info: dict[str, Any] = {"grpc_tcp": d.grpc.ports if d.grpc is not None else {},
                                    "netns": network_namespace()}
            if d.agents is not None:
                own.update(d.agents.listening_fds)
                info["agent"], info["agent_sockets"] = cfg.agent.socket, cfg.tenants.agent_sockets
            if d.metrics_server is not None:
                own["metrics"], info["metrics"] = d.metrics_server.socket.fileno(), cfg.metrics.listen
            if d.peers is not None:
                own.update(d.peers.listening_fds)
                info["quic"], info["lane"] = cfg.quic.listen, cfg.quic.lane
            files = {name: os.dup(fd) for name, fd in own.items()}
            await send_files(conn, files, info)
        finally:
            for fd in files.values():
                os.close(fd)
        await wait_listening(conn)            # gone before this: nothing changed, serve on
        t0 = time.monotonic()
        self.handing_over = True
        if self._tcp_listeners() and not tcp_migrate_req():
            log.warning("net.ipv4.tcp_migrate_req is 0: TCP connections waiting in this daemon's accept queue "
                        "when it stops listening are reset instead of passed to the successor (docs/operations.md)")
        await asyncio.sleep(HANDOVER_SETTLE_S)   # connections queued just before the switch are accepted
        blocks = len(d.store.ram) if d.store is not None else 0
        await self.wind_down()
        await send_released(conn, {"ram_blocks": blocks, "wind_down_s": round(time.monotonic() - t0, 3)})
        log.info("released the index to the successor", extra=fields(ram_blocks=blocks))
        self.handed_over = True
        try:
            await wait_serving(conn)
        except HandoverBroken as exc:
            # Nothing serves now. Start again in this process (the same pid: systemd's MAINPID
            # stays right) with the arena and its directory, every block checked: see serve().
            log.error("the successor went away before it served; starting again in this process, the RAM tier "
                      "checked block by block", extra=fields(reason=str(exc)))
            assert d.arenas is not None and d.slot_directory is not None
            self.restart_with = {SLOTS_FD_NAME: os.dup(d.slot_directory.fd),
                                 **{fd_name(o): os.dup(a.fd) for o, a in d.arenas.items()}}
        if self._done is not None and not self._done.done():
            self._done.set_result({"op": "upgraded", "ok": not self.restart_with,
                                   "elapsed_s": round(time.monotonic() - t0, 3)})
        self.stop()

    async def upgrade(self) -> dict[str, Any]:
        """``kvcached upgrade``: start this command line again with ``--takeover`` (the code now
        installed), in this service's process group and cgroup, and wait for the handover."""
        if self.argv is None:
            return {"op": "failed", "reason": "this daemon was not started by `kvcached serve`: start the successor "
                                              "with `kvcached serve --takeover` yourself"}
        if self._done is not None and not self._done.done():
            return {"op": "failed", "reason": "an upgrade is under way already"}
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        t0 = time.monotonic()
        argv = [a for a in self.argv if a != "--takeover"] + ["--takeover"]
        # A plain Popen: asyncio's subprocess transport kills a child still running when it
        # closes, and the successor must outlive this process.
        # WATCHDOG_PID names this process: without it systemd's watchdog is the successor's to ping.
        env = {k: v for k, v in os.environ.items() if k != "WATCHDOG_PID"}
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
        log.warning("upgrade: successor started", extra=fields(pid=proc.pid))
        done = self._done
        deadline = time.monotonic() + UPGRADE_TIMEOUT_S
        while not done.done() and proc.poll() is None and time.monotonic() < deadline:
            await asyncio.wait([done], timeout=0.1)
        if done.done():
            return {**done.result(), "pid": proc.pid, "total_s": round(time.monotonic() - t0, 3)}
        self._done = None
        if proc.returncode is not None:
            return {"op": "failed", "pid": proc.pid,
                    "reason": f"the successor exited with {proc.returncode} before taking over (see its log)"}
        return {"op": "failed", "pid": proc.pid, "reason": f"no handover within {UPGRADE_TIMEOUT_S:.0f} s"}

    def _tcp_listeners(self) -> bool:
        d = self.daemon
        return (bool(d.grpc is not None and d.grpc.ports) or d.metrics_server is not None
                or (d.peers is not None and "lane" in d.peers.listening_fds))


def exec_with_fds(argv: list[str], files: dict[str, int]) -> None:
    """Replace this process with ``argv``, passing ``files`` as systemd does (fd 3 on, with
    LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES): the new program finds them with
    kvcached.lifecycle.systemd.listen_fds. Returns only if the exec failed (logged)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in files.values()]   # out of the way of 3, 4, ...
    for i, fd in enumerate(high):
        os.dup2(fd, LISTEN_FDS_START + i, inheritable=True)
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(high)), LISTEN_FDNAMES=":".join(files))
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        log.error("starting again failed", extra=fields(argv=" ".join(argv), error=exc.strerror))


def nothing_passed(name: str) -> None:
    return None


def same_listeners(info: dict[str, Any], config: Config) -> dict[str, bool]:
    """Which of a predecessor's listening sockets (kvcached.lifecycle.handover: ``info`` says where each
    listens) this configuration listens on too, by name. Its network sockets only where it runs in
    this network namespace: a Kubernetes pod's successor is another pod, with an address of its own."""
    q = config.quic
    here = info.get("netns", network_namespace()) == network_namespace()
    quic = here and bool(q.listen) and info.get("quic") == q.listen
    theirs = info.get("agent_sockets", {})
    return {"agent": bool(config.agent.socket) and info.get("agent") == config.agent.socket,
            **{listener_name(t): theirs.get(t) == path for t, path in config.tenants.agent_sockets.items()},
            **{listener_name(t): False for t in theirs if t not in config.tenants.agent_sockets},
            "metrics": here and bool(config.metrics.listen) and info.get("metrics") == config.metrics.listen,
            "quic": quic, "lane": quic and info.get("lane") == q.lane}
