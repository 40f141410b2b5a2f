"""The bulk lane's client: pulls and Locates from one peer over lanes (kvcached.peers.lane).

Opening a lane is bounded apart from the request it serves: :meth:`LaneClient.pull` and
:meth:`LaneClient.locate` take ``setup_s``, the most the connection and its handshake may take
(the peer tier gives it half of what is left of a pull's deadline), so a lane that cannot be had
(refused, reset, a server that accepts and never answers) fails in time for the same request to
go over QUIC instead. Every failure to open one is an OSError (ssl.SSLError, a timeout, a reset),
PeerRefused or PeerGone, never a transport's own complaint about being written after it closed.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

from kvcached.peers import lane_mac as m
from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.lane import LANE_MODES, LaneConnection, client_context, peer_certificate
from kvcached.peers.session import PeerGone, PullAnswers, PullSink, RequestIds
from kvcached.peers.tls import PeerAuth, PeerRefused

__all__ = ["LaneClient", "STRIPE_MIN"]

STRIPE_MIN = 8                 # entries per stripe at least: smaller pulls go on one connection
MAX_OPENING = 4                # connections opened at once to one peer: under the server's per-source
                               # handshake limit (quic.max_handshakes_per_source, 8), so a burst of
                               # pulls never has its own lanes refused; more pulls wait their turn


class LaneClient:
    """Pulls from one peer over lanes: a connection per pull (or stripe) in flight, up to
    ``keep`` kept open for the next ones. A pull of ``2 * STRIPE_MIN`` entries or more is split
    over up to ``stripes`` connections at once. ``mac`` mode: each pull names the key the QUIC
    session granted; connections opened with another key are closed."""

    def __init__(self, auth: PeerAuth, peer: str, address: tuple[str, int], max_payload: int, *,
                 mode: str = "tls", keep: int = 4, stripes: int = 1, connect_timeout_s: float = 5.0) -> None:
        if mode not in LANE_MODES:
            raise ValueError(f"lane mode {mode!r}: one of {', '.join(LANE_MODES)}")
        self.auth, self.peer, self.address, self.max_payload = auth, peer, address, max_payload
        self.mode, self.keep, self.stripes, self.connect_timeout_s = mode, keep, max(stripes, 1), connect_timeout_s
        self._context = client_context(auth) if mode == "tls" else None
        self._idle: list[tuple[LaneConnection, bytes]] = []      # (connection, key id it proved)
        self._ids = RequestIds()
        self._opening = asyncio.Semaphore(MAX_OPENING)
        self.refused = 0           # servers that did not prove the key, frames whose seal failed
        self.uncoded = False       # the peer answered a CodedPull UNKNOWN_TYPE (it predates them)

    async def _connect(self, key: tuple[bytes, bytes] | None, setup_s: float | None) -> LaneConnection:
        """A new lane, proved both ways, within ``setup_s`` (at most ``connect_timeout_s``):
        asyncio.TimeoutError past it."""
        if self.mode == "mac" and key is None:
            raise PeerRefused(f"no lane key from {self.peer} (its QUIC session grants one)")
        budget = self.connect_timeout_s if setup_s is None else min(setup_s, self.connect_timeout_s)
        made: list[LaneConnection] = []

        def factory() -> LaneConnection:
            conn = LaneConnection(st.FrameDecoder(max_payload=self.max_payload), framed=self.mode == "tls")
            made.append(conn)
            return conn

        try:
            async with asyncio.timeout(max(budget, 0.001)), self._opening:
                if self.mode == "tls":
                    return await self._tls(factory)
                assert key is not None
                return await self._mac(factory, key)
        except BaseException:
            for conn in made:          # reset, cut off from everything, freed
                conn.abandon()
                conn.dispose()
            raise

    async def _tls(self, factory: Callable[[], LaneConnection]) -> LaneConnection:
        loop = asyncio.get_running_loop()
        host, port = self.address
        _, conn = await loop.create_connection(factory, host, port, ssl=self._context, server_hostname=self.peer,
                                               ssl_handshake_timeout=self.connect_timeout_s)
        self.auth.check_server(peer_certificate(conn.transport), [], self.peer)
        return conn

    async def _mac(self, factory: Callable[[], LaneConnection], key: tuple[bytes, bytes]) -> LaneConnection:
        loop = asyncio.get_running_loop()
        host, port = self.address
        _, conn = await loop.create_connection(factory, host, port)
        handshake = m.ClientHandshake(*key)
        conn.send(handshake.hello)
        try:
            proof, secrets = handshake.challenge(await conn.read_raw(m.CHALLENGE.size))
        except m.MacRefused as exc:
            self.refused += 1
            raise PeerRefused(f"{self.peer}: {exc}") from None
        conn.send(proof)
        conn.sealer = m.Sealer(secrets.connection_key, m.CLIENT_TO_SERVER)
        conn.opener = m.Opener(secrets.connection_key, m.SERVER_TO_CLIENT)
        conn.start_framing()
        return conn

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.abandon()
            conn.dispose()

    async def pull(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink,
                   key: tuple[bytes, bytes] | None = None, setup_s: float | None = None,
                   tenant: str = "", codec: int = 0, on_request: Callable[[], None] | None = None) -> int:
        """As :meth:`PeerClientProtocol.pull`: answers go to ``sink`` as they arrive; returns once
        every entry is answered. ``tenant``: whose blocks they are (the Pull names it). ``key``:
        the (key id, key) granted over QUIC (``mac`` mode); ``setup_s``: the most a new
        connection may take to open (module docstring). ``codec``: ask for the blocks coded
        with it (a CodedPull; coded payloads go to ``sink.arrived_coded``); a peer that
        predates coded pulls is asked again plainly, and never coded again. ``on_request`` is
        called as each request goes on the wire (its connection open: the time before is not
        the link's). Returns the codec the pull asked for in the end (0: none).
        OSError (a timeout too), PeerRefused or PeerGone where the lane cannot be had (the caller
        pulls over QUIC instead); PeerGone, ProtocolError or MacRefused as it breaks."""
        if codec and self.uncoded:
            codec = 0
        try:
            await self._pull_striped(addresses, sink, key, setup_s, tenant, codec, on_request)
        except p.ProtocolError as exc:
            if not codec or exc.code != p.ErrorCode.UNKNOWN_TYPE:
                raise
            self.uncoded = True          # the holder predates coded pulls: it answered before sending a block
            codec = 0
            await self._pull_striped(addresses, sink, key, setup_s, tenant, codec, on_request)
        return codec

    async def _pull_striped(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink,
                            key: tuple[bytes, bytes] | None, setup_s: float | None, tenant: str, codec: int,
                            on_request: Callable[[], None] | None) -> None:
        n = min(self.stripes, len(addresses) // STRIPE_MIN) if len(addresses) >= 2 * STRIPE_MIN else 1
        if n <= 1:
            await self._pull_one(addresses, sink, key, setup_s, tenant, codec, on_request)
            return
        size = -(-len(addresses) // n)
        parts = [asyncio.ensure_future(self._pull_one(addresses[i:i + size], sink, key, setup_s, tenant, codec, on_request))
                 for i in range(0, len(addresses), size)]
        try:
            done, pending = await asyncio.wait(parts, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for part in parts:
                part.cancel()          # on a failure or a cancel: the other stripes give up too
            await asyncio.gather(*parts, return_exceptions=True)
        for part in parts:
            if part.done() and not part.cancelled() and part.exception() is not None:
                raise part.exception()  # type: ignore[misc]

    async def _pull_one(self, addresses: Sequence[tuple[bytes, int]], sink: PullSink,
                        key: tuple[bytes, bytes] | None, setup_s: float | None, tenant: str, codec: int,
                        on_request: Callable[[], None] | None) -> None:
        conn = await self._take(key, setup_s)
        done = False
        if on_request is not None:
            on_request()
        try:
            await self._pull_on(conn, p.pull_of(addresses, self.max_payload, tenant, codec), sink, codec)
            done = True
        except m.MacRefused:
            self.refused += 1
            raise
        finally:
            self._give_back(conn, key, done)

    async def locate(self, addresses: Sequence[tuple[bytes, int]], key: tuple[bytes, bytes] | None = None,
                     setup_s: float | None = None) -> list[tuple[str, ...]]:
        """As :meth:`PeerClientProtocol.locate`, over the lane (a home's answer costs a TCP round
        trip, not aioquic's packet handling); the same failures as :meth:`pull`."""
        conn = await self._take(key, setup_s)
        done = False
        try:
            holders = await self._locate_on(conn, addresses)
            done = True
            return holders
        except m.MacRefused:
            self.refused += 1
            raise
        finally:
            self._give_back(conn, key, done)

    async def _take(self, key: tuple[bytes, bytes] | None, setup_s: float | None) -> LaneConnection:
        """An idle connection proved with ``key``'s id, or a new one."""
        key_id = key[0] if key is not None else b""
        while self._idle:
            candidate, proved = self._idle.pop()
            if candidate.gone or proved != key_id:
                candidate.abandon()    # closed by the server meanwhile (idle), or an older session's key
                candidate.dispose()
            else:
                return candidate
        return await self._connect(key, setup_s)

    def _give_back(self, conn: LaneConnection, key: tuple[bytes, bytes] | None, done: bool) -> None:
        if done and not conn.gone and len(self._idle) < self.keep:
            conn.expect_nothing()
            self._idle.append((conn, key[0] if key is not None else b""))
        else:
            conn.abandon()             # given up or failed: nothing more reaches the slots
            conn.dispose()

    async def _locate_on(self, conn: LaneConnection, addresses: Sequence[tuple[bytes, int]]) -> list[tuple[str, ...]]:
        request_id = self._ids.next()
        answers = PullAnswers(self.peer, conn.decoder, None, request_id=request_id)
        got: list[p.Located] = []

        def on_event(item: st.Event) -> None:
            message = answers.take(item)
            if not isinstance(message, p.Located) or got:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} does not answer a Locate")
            got.append(message)

        conn.on_event = on_event
        conn.write_frame(p.encode(p.Locate(addresses), request_id))
        await conn.wait(lambda: bool(got))
        if len(got[0].holders) != len(addresses):
            raise p.ProtocolError(p.ErrorCode.MALFORMED, f"Located answers {len(got[0].holders)} of "
                                  f"{len(addresses)} addresses")
        return [tuple(h) for h in got[0].holders]

    async def _pull_on(self, conn: LaneConnection, request: p.AnyPull, sink: PullSink, codec: int) -> None:
        request_id = self._ids.next()
        answers = PullAnswers(self.peer, conn.decoder, sink, request_id=request_id, expected=len(request.addresses),
                              codec=codec)

        def on_event(item: st.Event) -> None:
            message = answers.take(item)
            if message is not None:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} does not answer a Pull")

        conn.on_event = on_event
        conn.write_frame(p.encode(request, request_id))
        try:
            await conn.wait(lambda: answers.complete)
        except PeerGone:
            raise PeerGone(f"{self.peer} closed the lane with {len(request.addresses) - answers.answered} of "
                           f"{len(request.addresses)} entries unanswered") from None
        if conn.decoder.buffered or conn.decoder.payload_remaining:
            raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer} sent more than the answer")
