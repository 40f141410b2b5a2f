"""Peer payloads over NIXL (issue 43; docs/peers.md, "The NIXL lane"): the transport GPU clusters
run, RDMA where the node has an RDMA NIC, else UCX over TCP or shared memory.

This module is the blocking layer over NIXL's Python API and nothing else: one NIXL agent per
daemon over UCX, its registered regions (the RAM tier's arenas, one per tenant, each registered
once as it is mapped once, read as one run of offsets: region i's byte o at ``i * size + o``),
the metadata that lets a peer read from them, and READs of byte ranges from a peer's regions
into this one's. Which ranges to read, what they must hash to and when a slot may be published
stay with the caller, over the authenticated QUIC session: NIXL moves bytes, it vouches for
none of them (its payloads are not encrypted, and a holder could change a slot after it
answered), so every range read is checked against the checksum that came over QUIC before the
block is published.

READ, not WRITE: the puller owns its slots and the deadline, the holder only keeps its pinned
blocks until the puller says it is done; NIXL's own connectors pull the same way (the side that
needs the KV reads it from the side that has it).

NIXL is loaded on first use (:func:`load_nixl`): a daemon without it, or where it cannot start,
raises :class:`NixlUnavailable` with the reason, and the caller falls back to its other lanes.
The daemon needs NIXL's UCX build and numpy, not the CUDA torch NIXL's wheel names
(``make nixl`` installs it ``--no-deps``).
"""

from __future__ import annotations

import ctypes
import logging
import logging.config
import os
import threading
import time
from typing import Any, Sequence

__all__ = ["NixlEndpoint", "NixlTransferError", "NixlUnavailable", "load_nixl", "nixl_agent", "region_address"]

PROGRESS_DELAY_US = 10         # the agent's progress thread's sleep between polls (see nixl_agent)
POLL_S = 0.0002                  # how often a transfer in progress is checked (a 1 MiB block takes ~0.2 ms over shm)


class NixlUnavailable(Exception):
    """NIXL cannot be loaded or started here; the message says why."""


class NixlTransferError(Exception):
    """A transfer failed, or did not finish in time."""


def load_nixl() -> Any:
    """NIXL's Python API (``nixl._api``), or NixlUnavailable saying why not.

    NIXL configures Python's logging as it is imported (``logging.config.dictConfig``: every
    handler of the process closed and its own INFO lines on stdout). The daemon's structured
    logs stay as they are: that call is held off while NIXL loads, and NIXL's logger then
    speaks through the daemon's handlers, warnings and worse only."""
    real = logging.config.dictConfig
    logging.config.dictConfig = lambda config: None
    try:
        import nixl  # noqa: F401  (the package picks the build that matches the machine's CUDA, or any)
        from nixl import _api
    except Exception as exc:  # ImportError, or a native library that fails to load
        raise NixlUnavailable(f"NIXL cannot be loaded: {exc} (make nixl installs it)") from None
    finally:
        logging.config.dictConfig = real
    nixl_log = logging.getLogger("nixl")
    nixl_log.setLevel(logging.WARNING)
    nixl_log.propagate = True
    return _api


def nixl_agent(api: Any, name: str) -> Any:
    """A NIXL agent over UCX whose progress thread sleeps PROGRESS_DELAY_US between polls.

    NIXL's Python API starts the progress thread with no delay (``pthrDelay = 0``, not a setting
    of ``nixl_agent_config``): an idle agent then spins a whole core for as long as the daemon
    runs (3.0 s of CPU in 3 s here). The thread cannot simply be left off: over UCX's TCP the
    holder's worker must progress for a peer's READ to be served (without it a read hangs). So
    the delay is set on the agent's configuration as it is built: 10 us took an idle agent to
    0.09 s of CPU in 3 s. It slows a READ over TCP somewhat (longer delays more); bench_lane's
    figure 3 measures the lane with it against a bare READ whose agents are built alike."""
    bindings = api.nixlBind
    build = bindings.nixlAgent

    def with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_DELAY_US
        return build(agent_name, config)

    bindings.nixlAgent = with_delay
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    finally:
        bindings.nixlAgent = build


def region_address(buffer: Any) -> int:
    """The address of a writable buffer's first byte (an mmap, a bytearray)."""
    view = (ctypes.c_char * 1).from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view                 # the buffer may be closed once nothing exports it


class NixlEndpoint:
    """One NIXL agent named ``name`` over UCX, ``regions`` (writable buffers of one size, kept
    mapped by the caller for the endpoint's life; or one buffer) registered with it, read as one
    run of :attr:`size` bytes. ``transports``: UCX's transports (``UCX_TLS``, for example
    ``("tcp",)``, ``("shm", "self")``, ``("rc", "ud")`` for InfiniBand); empty: UCX's own
    choice. Blocking: the asyncio layer runs it in a thread; one transfer is posted at a time
    per endpoint, others wait for it."""

    def __init__(self, name: str, regions: Any, transports: Sequence[str] = ()) -> None:
        api = load_nixl()
        if not isinstance(regions, (list, tuple)):
            regions = [regions]
        if not regions or len({len(r) for r in regions}) != 1:
            raise ValueError("NIXL regions must be one or more buffers of one size")
        if transports:
            # UCX reads its settings when the agent's backend starts: one NIXL agent a process.
            os.environ["UCX_TLS"] = ",".join(transports)
        try:
            self._agent = nixl_agent(api, name)
            if "UCX" not in self._agent.backends:
                raise NixlUnavailable("NIXL's UCX backend did not start")
            self.bases = tuple(region_address(region) for region in regions)
            self.region_size = len(regions[0])
            self.base = self.bases[0]
            self.size = self.region_size * len(self.bases)
            self._registered = self._agent.register_memory([(b, self.region_size, 0, "") for b in self.bases], "DRAM")
        except NixlUnavailable:
            raise
        except Exception as exc:
            raise NixlUnavailable(f"NIXL could not start: {exc}") from None
        self.name = name
        self._peers: dict[str, tuple[tuple[int, ...], int]] = {}   # NIXL agent name -> its regions' bases, size
        self._lock = threading.Lock()

    def offset_of(self, view: memoryview) -> int:
        """Where ``view`` (a writable slice of a registered region: a block's slot) starts in the
        run of regions."""
        address = region_address(view)
        for i, base in enumerate(self.bases):
            offset = address - base
            if 0 <= offset <= self.region_size - len(view):
                return i * self.region_size + offset
        raise ValueError("a view outside the registered regions")

    @property
    def metadata(self) -> bytes:
        """What a peer needs to read from this endpoint's region (NIXL's agent metadata):
        handed over the authenticated channel only."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, base: int, bases: Sequence[int] = (), size: int = 0) -> str:
        """A peer's endpoint, from its metadata and its regions' base addresses (``bases``, of
        ``size`` bytes in all; or its one region at ``base``); its NIXL name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise NixlTransferError(f"a peer's NIXL metadata was refused: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        regions = tuple(bases) or (base,)
        self._peers[name] = (regions, size // len(regions) if size else 0)
        return name

    def remove_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass             # already gone on NIXL's side

    def read(self, peer: str, spans: Sequence[tuple[int, int, int]], timeout_s: float) -> None:
        """Read ``spans`` (peer region offset, own region offset, length) from ``peer`` into
        this endpoint's region; NixlTransferError if NIXL fails or it takes over ``timeout_s``."""
        known = self._peers.get(peer)
        if known is None:
            raise NixlTransferError(f"no NIXL peer {peer!r}")
        if not spans:
            return
        bases, size = known
        local_at, remote_at = [], []
        for remote, local, length in spans:
            if length <= 0 or local < 0 or local + length > self.size or remote < 0:
                raise NixlTransferError(f"a span outside the region: {remote}, {local}, {length}")
            i, at = divmod(local, self.region_size)
            if at + length > self.region_size:
                raise NixlTransferError(f"a span across two regions: {local}, {length}")
            local_at.append((self.bases[i] + at, length, 0))
            j, rat = divmod(remote, size) if size else (0, remote)
            if j >= len(bases) or (size and rat + length > size):
                raise NixlTransferError(f"a span outside the peer's regions: {remote}, {length}")
            remote_at.append((bases[j] + rat, length, 0))
        local_descs = self._agent.get_xfer_descs(local_at, "DRAM")
        remote_descs = self._agent.get_xfer_descs(remote_at, "DRAM")
        with self._lock:
            try:
                handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
            except Exception as exc:
                raise NixlTransferError(f"NIXL could not set up a read from {peer}: {exc}") from None
            try:
                state = self._agent.transfer(handle)
                deadline = time.monotonic() + timeout_s
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise NixlTransferError(f"a NIXL read from {peer} took over {timeout_s} s")
                    time.sleep(POLL_S)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlTransferError(f"a NIXL read from {peer} failed")
            finally:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:
                    pass         # a transfer NIXL still runs is released with the agent

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:
            pass
