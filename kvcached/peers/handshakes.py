"""What a peer that has not proven itself may make this daemon hold: bounded, with no I/O here.

Anyone who can reach the [quic] port can send Initial packets, and aioquic keeps a whole
connection (TLS state, buffers, timers: several KiB) for each one it accepts, until its idle
timeout. Left alone, that state grows with the rate of packets a stranger sends. Three rules
bound it (docs/security.md):

1. Address validation before state. A new connection's first Initial is answered with a
   stateless Retry (a token sealed with a key only this process knows, bound to the source
   address, valid 30 s); only an Initial that returns a valid token may create a connection. A
   flood from spoofed or unanswering addresses therefore costs a reply at most, never state, and
   replies come out of a :class:`ReplyBudget` (so the daemon is no amplifier either). With
   ``retry = "under_load"`` this starts once a quarter of the handshake table is taken, which
   keeps 0-RTT resumption (a Retry makes a client send its early data again) while state stays
   bounded by rule 2.
2. A :class:`HandshakeTable` caps connections in handshake (not yet verified by mutual TLS): per
   source address and in all, and all connections together. When the table is full, an
   unvalidated handshake (Retry off) gives way first; then the oldest handshake of the source
   that holds the most (the newcomer's own source counted with the newcomer). So a source with
   fewer handshakes than the others is never displaced by them: strangers who fill the table from
   a few addresses make room for a peer from another, and their own refills then displace each
   other, not the peer. Only a sender with as many addresses as the table has places can push a
   peer's handshake out, and only by refilling the whole table faster than that handshake takes
   (a round trip or two).
3. A handshake that has not verified its peer within ``handshake_timeout_s`` is dropped outright:
   every byte it held is freed at once, with no closing period.

The table knows connections only as opaque keys and is driven with ``now`` passed in. Two
servers use it: the QUIC server (kvcached/peers/server.py, with rules 1 to 3) and the bulk
lane's (kvcached/peers/lane_server.py: TCP has validated the source address by the time a
connection is accepted, so every lane handshake is validated, and rules 2 and 3 apply).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

from kvcached.host.pace import TokenBucket

__all__ = ["RETRY_MODES", "HandshakeLimits", "HandshakeTable", "Refused", "ReplyBudget", "SOURCE_LIMIT", "FULL", "TIMEOUT",
           "DISPLACED", "BUDGET", "source_of"]


RETRY_MODES = ("always", "under_load")


@dataclass(frozen=True)
class HandshakeLimits:
    """Bounds on connection state at the QUIC server ([quic] keys of the same names)."""

    retry: str = "always"                  # address validation (Retry) before any state: always | under_load
    max_handshakes: int = 64               # connections not yet verified, in all (~90 KiB each)
    max_handshakes_per_source: int = 8     # of them, from one source address
    max_connections: int = 1024            # every connection, verified or not
    handshake_timeout_s: float = 5.0       # to prove a certificate, from the first Initial
    stateless_replies_per_s: float = 5000.0   # Retry, version negotiation, INVALID_TOKEN replies


Refused = str    # why a connection was not admitted or a handshake dropped (a metrics label):

SOURCE_LIMIT: Refused = "source_limit"   # this source already has its share of handshakes
FULL: Refused = "full"                   # the table is full of validated handshakes and verified peers
TIMEOUT: Refused = "timeout"             # dropped: no verified peer within handshake_timeout_s
DISPLACED: Refused = "displaced"         # dropped to make room for a newer handshake
BUDGET: Refused = "budget"               # a stateless reply not sent: the budget is spent


def source_of(addr: tuple[Any, ...]) -> str:
    """The source a handshake counts against: the IPv4 address, or the IPv6 /64 (one host
    commonly holds a whole /64, so per-address limits would not bind it). An IPv4 address a
    dual-stack socket reports as IPv6 (``::ffff:a.b.c.d``) counts as that IPv4 address, not as
    one /64 shared by every IPv4 sender."""
    host = str(addr[0])
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%")[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network(f"{address}/64", strict=False))


@dataclass
class _Handshake:
    source: str
    validated: bool
    started: float


class HandshakeTable:
    """Connections at one server: those in handshake, by age, and how many are verified.

    ``admit`` decides whether a new connection may be created and which handshakes must be
    dropped first to make room (the module's rule 2); the caller drops those (``drop``), creates
    the connection and ``add``s it. ``verified`` moves a connection out of the handshake set; ``closed`` forgets it
    wherever it is; ``expired`` lists the handshakes past their deadline, oldest first.
    """

    def __init__(self, limits: HandshakeLimits) -> None:
        self.limits = limits
        self._handshakes: OrderedDict[Hashable, _Handshake] = OrderedDict()   # oldest first
        self._unvalidated: OrderedDict[Hashable, None] = OrderedDict()
        self._by_source: dict[str, OrderedDict[Hashable, None]] = {}          # each oldest first
        self._sources_holding: dict[int, set[str]] = {}                      # n -> sources with n handshakes
        self._verified: set[Hashable] = set()
        self.refused: dict[str, int] = {}      # reason -> count (admissions refused, handshakes dropped)

    @property
    def handshaking(self) -> int:
        return len(self._handshakes)

    @property
    def connections(self) -> int:
        return len(self._handshakes) + len(self._verified)

    def count(self, reason: Refused, n: int = 1) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + n

    def admit(self, source: str, validated: bool) -> tuple[Refused | None, list[Hashable]]:
        """May a new connection from ``source`` be created? (None, handshakes to drop first) if
        so, (reason, []) if not (counted). ``validated``: its Initial returned a Retry token."""
        limits = self.limits
        held = len(self._by_source.get(source, ()))
        if held >= limits.max_handshakes_per_source:
            self.count(SOURCE_LIMIT)
            return SOURCE_LIMIT, []
        victims: list[Hashable] = []
        if len(self._handshakes) >= limits.max_handshakes or self.connections >= limits.max_connections:
            if self._unvalidated:
                victims.append(next(iter(self._unvalidated)))
            elif validated and self._handshakes:
                victims.append(self._fair_victim(source, held + 1))
            else:            # an unvalidated newcomer never displaces a validated handshake
                self.count(FULL)
                return FULL, []
        return None, victims

    def _fair_victim(self, newcomer: str, newcomer_holds: int) -> Hashable:
        """The oldest handshake of the source that holds the most, the newcomer's own source
        counted as holding ``newcomer_holds`` (ties: the oldest of those sources' oldest)."""
        most = max((n for n, sources in self._sources_holding.items() if sources), default=0)
        candidates = set(self._sources_holding.get(most, ()))
        if newcomer_holds > most:
            candidates = {newcomer}
        elif newcomer_holds == most:
            candidates.add(newcomer)
        oldest: Hashable | None = None
        for source in candidates:
            mine = self._by_source.get(source)
            if not mine:
                continue             # the newcomer's source, holding none yet
            first = next(iter(mine))
            if oldest is None or self._handshakes[first].started < self._handshakes[oldest].started:
                oldest = first
        return oldest if oldest is not None else next(iter(self._handshakes))

    def add(self, key: Hashable, source: str, validated: bool, now: float) -> None:
        self._handshakes[key] = _Handshake(source, validated, now)
        if not validated:
            self._unvalidated[key] = None
        mine = self._by_source.setdefault(source, OrderedDict())
        self._move(source, len(mine), len(mine) + 1)
        mine[key] = None

    def verified(self, key: Hashable) -> None:
        """The connection proved its certificate: it leaves the handshake set."""
        if self._forget_handshake(key):
            self._verified.add(key)

    def closed(self, key: Hashable) -> None:
        """The connection is gone (terminated or dropped)."""
        self._forget_handshake(key)
        self._verified.discard(key)

    def drop(self, key: Hashable, reason: Refused) -> None:
        """Forget a handshake the caller drops (``reason``: counted)."""
        if key in self._handshakes:
            self.count(reason)
        self.closed(key)

    def expired(self, now: float) -> list[Hashable]:
        """Handshakes started more than handshake_timeout_s before ``now``, oldest first."""
        before = now - self.limits.handshake_timeout_s
        out = []
        for key, handshake in self._handshakes.items():
            if handshake.started > before:
                break
            out.append(key)
        return out

    def next_deadline(self) -> float | None:
        """When the oldest handshake expires (None: none in handshake)."""
        for handshake in self._handshakes.values():
            return handshake.started + self.limits.handshake_timeout_s
        return None

    def is_handshaking(self, key: Hashable) -> bool:
        return key in self._handshakes

    def _forget_handshake(self, key: Hashable) -> bool:
        handshake = self._handshakes.pop(key, None)
        if handshake is None:
            return False
        self._unvalidated.pop(key, None)
        mine = self._by_source[handshake.source]
        del mine[key]
        self._move(handshake.source, len(mine) + 1, len(mine))
        if not mine:
            del self._by_source[handshake.source]
        return True

    def _move(self, source: str, held: int, now_holds: int) -> None:
        """``source`` held ``held`` handshakes and now holds ``now_holds`` (the count buckets)."""
        if held:
            self._sources_holding[held].discard(source)
        if now_holds:
            self._sources_holding.setdefault(now_holds, set()).add(source)


class ReplyBudget(TokenBucket):
    """A token bucket for replies sent to addresses that hold no connection (Retry, version
    negotiation, INVALID_TOKEN): at most ``rate`` a second, bursts of one second's worth. Past
    it, such packets are dropped unanswered, so a flood costs this daemon a bounded share of a
    core and cannot use it to send as many packets as it receives to a spoofed victim."""
