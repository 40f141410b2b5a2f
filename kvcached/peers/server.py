"""The QUIC server socket: aioquic's QuicServer with the bounds of handshakes.py applied.

aioquic's QuicServer creates a connection for every Initial it cannot route and keeps it until
its idle timeout; this subclass decides first, per datagram that holds no connection:

- unsupported version: a version negotiation reply, within the reply budget;
- not a full-size Initial: dropped (as aioquic does);
- an Initial without a token while Retry is due (``retry = "always"``, or ``"under_load"`` once a
  quarter of the handshake table is taken): a stateless Retry, within the reply budget, and
  nothing kept;
- an Initial whose token does not open (forged, expired, another address): dropped, or closed
  with INVALID_TOKEN within the budget;
- otherwise :meth:`HandshakeTable.admit` decides; handshakes it names are dropped first.

Datagrams for existing connections go straight to them. A connection leaves the handshake set
when its peer is verified (:class:`PeerServerProtocol` calls back); one still in handshake after
``handshake_timeout_s`` is dropped outright: its connection IDs forgotten, its timer cancelled,
nothing sent (a closing period would keep state for three more PTOs).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from aioquic.quic.retry import QuicRetryTokenHandler

from kvcached.peers.handshakes import BUDGET, DISPLACED, TIMEOUT, HandshakeLimits, HandshakeTable, ReplyBudget, source_of

__all__ = ["GuardedQuicServer"]

log = logging.getLogger("kvcached.peers")


class GuardedQuicServer(QuicServer):
    """A QUIC server whose connection state a stranger cannot grow without bound.

    ``create_protocol`` builds a protocol that calls ``on_verified()`` (set here) once its
    peer's certificate is verified. Counters: ``retries`` (Retry packets sent), ``dropped``
    (datagrams for no connection left unanswered: not an Initial, budget spent),
    ``table.refused`` (by reason)."""

    def __init__(self, *, configuration: QuicConfiguration, create_protocol: Callable[..., QuicConnectionProtocol],
                 limits: HandshakeLimits) -> None:
        super().__init__(configuration=configuration, create_protocol=self._make_protocol, retry=True)
        self._create = create_protocol
        self.limits = limits
        self.table = HandshakeTable(limits)
        self.replies = ReplyBudget(limits.stateless_replies_per_s, self._loop.time())
        self.retries = 0
        self.dropped = 0
        self._supported = frozenset(configuration.supported_versions)
        self._cids: dict[QuicConnectionProtocol, set[bytes]] = {}
        self._admitting: tuple[str, bool, bytes] | None = None    # the connection being created
        self._sweep: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        super().close()

    @property
    def handshaking(self) -> int:
        return self.table.handshaking

    def close_peer(self, name: str) -> int:
        """Close every connection the verified peer ``name`` holds here (it left the cluster:
        what it sent over them is forgotten, and it must connect anew, and be let in, to be
        heard again). Returns how many were closed."""
        mine = [p for p in set(self._protocols.values()) if getattr(p, "peer", None) == name]
        for protocol in mine:
            protocol.close()
        return len(mine)

    # -- datagrams --

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        data = cast(bytes, data)
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            self.dropped += 1
            return
        protocol = self._protocols.get(header.destination_cid)
        if protocol is not None:
            protocol.datagram_received(data, addr)
            return
        now = self._loop.time()
        if (header.packet_type != QuicPacketType.VERSION_NEGOTIATION and header.version is not None
                and header.version not in self._supported):
            self._stateless_reply(data, addr, now)              # version negotiation
            return
        if header.packet_type != QuicPacketType.INITIAL or len(data) < SMALLEST_MAX_DATAGRAM_SIZE:
            self.dropped += 1
            return
        if header.token:
            if not self._token_opens(header.token, header.destination_cid, addr, now):
                self._stateless_reply(data, addr, now)         # INVALID_TOKEN close
                return
            validated = True
        elif self._retry_now():
            if self._stateless_reply(data, addr, now):         # a Retry: no state kept
                self.retries += 1
            return
        else:
            validated = False
        source = source_of(addr)
        refused, victims = self.table.admit(source, validated)
        if refused is not None:
            self.dropped += 1
            return
        for victim in victims:
            self._discard(cast(QuicConnectionProtocol, victim), DISPLACED)
        self._admitting = (source, validated, header.destination_cid)
        retry, self._retry = self._retry, (self._retry if validated else None)  # type: ignore[assignment]   # aioquic reads None as: no Retry for this one
        try:
            super().datagram_received(data, addr)              # creates the connection (_make_protocol)
        finally:
            self._admitting, self._retry = None, retry

    def _retry_now(self) -> bool:
        """Whether a new connection must first prove its address: always, or (under_load) once
        a quarter of the handshake table is taken."""
        return self.limits.retry == "always" or self.table.handshaking >= self.limits.max_handshakes // 4

    def _stateless_reply(self, data: bytes, addr: NetworkAddress, now: float) -> bool:
        """Let aioquic answer a datagram that creates no state, if the budget allows."""
        if not self.replies.take(now):
            self.table.count(BUDGET)
            self.dropped += 1
            return False
        super().datagram_received(data, addr)
        return True

    def _token_opens(self, token: bytes, cid: bytes, addr: NetworkAddress, now: float) -> bool:
        try:
            cast(QuicRetryTokenHandler, self._retry).validate_token(address=addr, destination_cid=cid, token=token,
                                                                    now=now)
            return True
        except ValueError:
            return False

    # -- connections --

    def _make_protocol(self, connection: QuicConnection, stream_handler: Any = None) -> QuicConnectionProtocol:
        protocol = self._create(connection, stream_handler=stream_handler)
        source, validated, cid = self._admitting or ("?", False, b"")
        self.table.add(protocol, source, validated, self._loop.time())
        self._cids[protocol] = {connection.host_cid, cid}
        protocol.on_verified = lambda: self.table.verified(protocol)      # type: ignore[attr-defined]
        self._arm_sweep()
        return protocol

    def _connection_id_issued(self, cid: bytes, protocol: QuicConnectionProtocol) -> None:
        super()._connection_id_issued(cid, protocol)
        self._cids.setdefault(protocol, set()).add(cid)

    def _connection_id_retired(self, cid: bytes, protocol: QuicConnectionProtocol) -> None:
        super()._connection_id_retired(cid, protocol)
        self._cids.get(protocol, set()).discard(cid)

    def _connection_terminated(self, protocol: QuicConnectionProtocol) -> None:
        for cid in self._cids.pop(protocol, ()):
            if self._protocols.get(cid) is protocol:
                del self._protocols[cid]
        self.table.closed(protocol)

    def _discard(self, protocol: QuicConnectionProtocol, reason: str) -> None:
        """Forget a connection still in handshake at once: no closing period, nothing sent."""
        self.table.drop(protocol, reason)
        for cid in self._cids.pop(protocol, ()):
            if self._protocols.get(cid) is protocol:
                del self._protocols[cid]
        timer = protocol._timer  # noqa: SLF001 (aioquic: no public API)
        if timer is not None:
            timer.cancel()
            protocol._timer = None  # noqa: SLF001 (aioquic: no public API)
        if protocol._transmit_task is not None:  # noqa: SLF001 (aioquic: no public API)
            protocol._transmit_task.cancel()  # noqa: SLF001 (aioquic: no public API)
            protocol._transmit_task = None  # noqa: SLF001 (aioquic: no public API)
        protocol._closed.set()  # noqa: SLF001 (aioquic: no public API)
        # aioquic's connection and its TLS context refer to each other (callbacks), so the
        # collector would free them only at its next full pass: a flood that keeps displacing
        # handshakes would pile them up meanwhile. Nothing runs on this connection any more.
        protocol._quic.__dict__.clear()  # noqa: SLF001 (aioquic: no public API)

    def _arm_sweep(self) -> None:
        deadline = self.table.next_deadline()
        if deadline is not None and self._sweep is None:
            self._sweep = self._loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._sweep = None
        expired = self.table.expired(self._loop.time())
        for protocol in expired:
            self._discard(cast(QuicConnectionProtocol, protocol), TIMEOUT)
        if expired:
            log.debug("handshakes dropped after the timeout",
                     extra={"fields": {"connections": len(expired), "timeout_s": self.limits.handshake_timeout_s}})
        self._arm_sweep()
