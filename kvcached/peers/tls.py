"""Mutual TLS for the peer tier: who this daemon is, whom it accepts, and resumption tickets.

Every daemon holds a certificate signed by the cluster CA (``kvcached certs``). Both ends of a
peer connection check the other's chain against that CA, its validity dates and its name:

- as a client, against the name of the ``[quic] peers`` entry it dialled (aioquic checks the
  server's chain and name during the handshake; :meth:`PeerAuth.check_server` checks again with
  the same code the server side uses, so both sides apply one policy);
- as a server, against the names of all ``[quic] peers`` entries. aioquic 1.x does not ask a
  client for a certificate unless the private ``tls.Context._request_client_certificate`` flag
  is set, and when it asks it checks only the client's signature, not its chain; a client that
  sends no certificate completes the handshake. So the server asks (see quic.py), and
  :meth:`PeerAuth.check_client` decides when the handshake completes: the connection is closed
  unless it passes.

Resumption: a resumed handshake (PSK) carries no certificate at all, so a session ticket is
worth exactly the identity that was verified when it was issued. :class:`ServerTickets` keeps a
ticket only once the connection that received it has passed ``check_client``, bound to that
peer's name; a ticket is used once (0-RTT data can be replayed; single-use tickets stop the
replay of a whole resumed connection) and expires after ``TICKET_LIFETIME_S``.
"""

from __future__ import annotations

import datetime
import ssl
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import SessionTicket
from cryptography import x509
from cryptography.x509 import verification

__all__ = ["ALPN", "PeerAuth", "PeerRefused", "QuicOptions", "ServerTickets", "TICKET_LIFETIME_S"]

ALPN = "kvcached-peer/1"
TICKET_LIFETIME_S = 3600.0     # a peer seen within the hour resumes (and may send 0-RTT pulls)
MAX_TICKETS = 4096


class PeerRefused(Exception):
    """A peer failed mutual TLS: the reason is the message (logged, and the connection closed)."""


@dataclass(frozen=True)
class QuicOptions:
    """Transport settings from ``[quic]`` (docs/peers.md explains the choice of each)."""

    max_datagram_size: int = 1350
    max_data: int = 64 << 20          # connection flow-control window, bytes
    max_stream_data: int = 16 << 20   # per-stream window, bytes
    idle_timeout: float = 30.0


class PeerAuth:
    """This daemon's certificate and the cluster CA, and the checks of a peer's certificate."""

    def __init__(self, ca_pem: bytes, cert_path: str | Path, key_path: str | Path, peer_names: Iterable[str],
                 clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.timezone.utc)) -> None:
        try:
            self.ca = x509.load_pem_x509_certificate(ca_pem)
        except ValueError as exc:
            raise PeerRefused(f"the cluster CA is not a PEM certificate: {exc}") from None
        self.ca_pem = ca_pem
        self.cert_path, self.key_path = str(cert_path), str(key_path)
        self.peer_names = frozenset(peer_names)
        self.clock = clock
        self._store = verification.Store([self.ca])

    @classmethod
    def from_files(cls, ca: str, cert: str, key: str, peer_names: Iterable[str]) -> "PeerAuth":
        return cls(Path(ca).read_bytes(), cert, key, peer_names)

    def configuration(self, options: QuicOptions, *, server_name: str | None = None) -> QuicConfiguration:
        """A QUIC configuration with this daemon's certificate: a client's (dialling
        ``server_name``) or, without it, the server's."""
        config = QuicConfiguration(
            is_client=server_name is not None, alpn_protocols=[ALPN], server_name=server_name,
            cadata=self.ca_pem, verify_mode=ssl.CERT_REQUIRED,
            max_datagram_size=options.max_datagram_size, max_data=options.max_data,
            max_stream_data=options.max_stream_data, idle_timeout=options.idle_timeout)
        config.load_cert_chain(self.cert_path, self.key_path)
        return config

    def own_certificate_problem(self) -> str | None:
        """Why peers would refuse this daemon's own certificate (expired, not yet valid, not
        from the cluster CA), or None: said at start, where an operator looks."""
        try:
            cert = x509.load_pem_x509_certificate(Path(self.cert_path).read_bytes())
            builder = verification.PolicyBuilder().store(self._store).time(self.clock())
            builder.build_client_verifier().verify(cert, [])
        except (OSError, ValueError, verification.VerificationError) as exc:
            return str(exc)
        return None

    def check_server(self, leaf: x509.Certificate | None, chain: list[x509.Certificate], name: str) -> None:
        """The certificate of the server dialled as ``name``: chains to the CA, valid now, names
        ``name``, allows serverAuth."""
        if leaf is None:
            raise PeerRefused("no certificate was presented")
        builder = verification.PolicyBuilder().store(self._store).time(self.clock())
        try:
            builder.build_server_verifier(x509.DNSName(name)).verify(leaf, chain)
        except verification.VerificationError as exc:
            raise PeerRefused(f"server certificate refused for {name!r}: {exc}") from None

    def check_client(self, leaf: x509.Certificate | None, chain: list[x509.Certificate]) -> str:
        """The certificate a client presented: chains to the CA, valid now, allows clientAuth,
        and names one of the configured peers. Returns that peer's name."""
        if leaf is None:
            raise PeerRefused("no certificate was presented")
        builder = verification.PolicyBuilder().store(self._store).time(self.clock())
        try:
            verified = builder.build_client_verifier().verify(leaf, chain)
        except verification.VerificationError as exc:
            raise PeerRefused(f"client certificate refused: {exc}") from None
        names = {s.value for s in verified.subjects or [] if isinstance(s, x509.DNSName)}
        known = sorted(names & self.peer_names)
        if not known:
            raise PeerRefused(f"client certificate names {sorted(names)}, none of them a configured peer")
        return known[0]


class ServerTickets:
    """Session tickets this server issued, each usable once, and only for the peer it was
    issued to after that peer's certificate passed (see the module docstring)."""

    def __init__(self, clock: Callable[[], float], lifetime: float = TICKET_LIFETIME_S,
                 limit: int = MAX_TICKETS) -> None:
        self.clock, self.lifetime, self.limit = clock, lifetime, limit
        self._bound: OrderedDict[bytes, tuple[SessionTicket, str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def bind(self, ticket: SessionTicket, peer: str) -> None:
        """Keep ``ticket`` for ``peer``, whose certificate passed (or who resumed as ``peer``)."""
        self._bound[ticket.ticket] = (ticket, peer, self.clock() + self.lifetime)
        while len(self._bound) > self.limit:
            self._bound.popitem(last=False)

    def take(self, label: bytes) -> tuple[SessionTicket, str] | None:
        """The ticket a client offers, with its peer's name; removed (single use). None if it is
        unknown, used or expired: the handshake then goes the full way, certificate included."""
        entry = self._bound.pop(label, None)
        if entry is None or entry[2] < self.clock():
            return None
        return entry[0], entry[1]
