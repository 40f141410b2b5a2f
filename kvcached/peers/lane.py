"""The bulk lane: pull payloads over TCP beside QUIC, in ``tls`` or ``mac`` mode.

QUIC (kvcached.peers.quic) stays the control connection: mutual TLS, 0-RTT, announcements,
Exists. A lane carries Pulls, and a cluster's Locates (a TCP round trip costs a home and its
asker a third of what aioquic's does: bench_cluster_daemons). A pull's payloads are bytes in
bulk, and aioquic's pure-Python packet handling is most of a pull's time (bench_peers figure
3), so pulls go over a lane when the peer offers one: TCP connections to the same port number
as the peer's QUIC port, in one of two modes (``[quic] lane``; docs/peers.md says what each
protects against):

- ``tls``: TLS 1.3 with the cluster certificates, both sides checking chain, dates and name
  exactly as the QUIC side does (:class:`~kvcached.peers.tls.PeerAuth`);
- ``mac``: plain TCP, each connection proving a key granted over the QUIC session and every
  frame sealed with keyed BLAKE3 (kvcached.peers.lane_mac): integrity and authenticity, no
  confidentiality.

The bytes on a lane are the peer protocol's frames (kvcached.peers.protocol): the client sends
one Pull, the server answers every entry in order with a Miss or a block, each run of blocks as
one Blocks frame (their heads) and then their payloads back to back (one frame to decode and,
on ``mac``, one seal to check per run, not per block), or the whole request with an Error.
One pull is in flight per connection; a client may stripe a large pull over several
connections (``[quic] lane_stripes``), keeps a few open for the next pulls, and closes one
whose pull it gives up (a deadline, a hedge that lost), which is the lane's STOP_SENDING.

This module holds what both ends share: :class:`LaneConnection` (the bytes of one lane) and
the TLS contexts. The server, with the bounds on what a sender without a certificate can make
it hold, is kvcached.peers.lane_server; the client, kvcached.peers.lane_client.

Receive side: :class:`LaneConnection` is a buffered protocol. While a Block's payload is coming,
the buffer it hands the event loop is the arena slot the store reserved for it (the decoder's
:meth:`~kvcached.peers.stream.FrameDecoder.payload_target`), so the kernel (``mac``) or
OpenSSL (``tls``) writes the payload straight into the slot: no intermediate bytes object, no
copy. The store checks the BLAKE3 checksum and only then commits. Send side: heads and payloads
are written as memoryviews of the pinned slot; a pinned block is released only once the
transport holds no reference to it (``tls``: encrypted at once; ``mac``: the kernel took it).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Callable

from cryptography import x509

from kvcached.peers import lane_mac as m
from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.session import PeerGone
from kvcached.peers.tls import PeerAuth

__all__ = ["LANE_ALPN", "LANE_MODES", "LaneConnection", "client_context", "server_context", "peer_certificate"]

LANE_ALPN = "kvcached-lane/1"
LANE_MODES = ("tls", "mac")
SCRATCH_BYTES = 4 << 10        # one read outside payloads: heads, Misses, requests (payload bytes read here are copied)
WRITE_HIGH = 4 << 20           # a server's send buffer above this waits for the kernel
STALL_S = 30.0                 # an answer whose send buffer has not drained this long is given up
RAW_HIGH = 64 << 10            # bytes gathered before framing starts (the handshake) past which reading pauses


def _context(auth: PeerAuth, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(auth.cert_path, auth.key_path)
    ctx.load_verify_locations(cadata=auth.ca_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = False            # the name is checked by PeerAuth, as on the QUIC side
    ctx.set_alpn_protocols([LANE_ALPN])
    return ctx


def server_context(auth: PeerAuth) -> ssl.SSLContext:
    """A lane server's TLS: TLS 1.3 only, this node's certificate, client certificates required."""
    return _context(auth, server=True)


def client_context(auth: PeerAuth) -> ssl.SSLContext:
    """A lane client's TLS: TLS 1.3 only, this node's certificate presented, the server's required."""
    return _context(auth, server=False)


class LaneConnection(asyncio.BufferedProtocol):
    """One lane connection's bytes, either side.

    Before framing starts (``mac``: the handshake) bytes are gathered raw for :meth:`read_raw`.
    Then they go through :attr:`decoder`, and every event it hands out goes, synchronously, to
    :attr:`on_event` (so a Block head's slot is the very next read's buffer). An exception from
    ``on_event`` ends the connection and becomes :attr:`error`. :meth:`abandon` cuts the
    connection off from every buffer a pull gave it, at once, before closing it.

    Its owner calls :meth:`dispose` once it is done with the connection: that breaks every
    reference cycle it is part of (callbacks that close over it, its error's traceback, a TLS
    transport that holds it), so its memory is freed when the last reference goes, not at the
    next full garbage collection (a flood of refused connections would otherwise pile up in the
    oldest generation: tens of MiB a few thousand connections, docs/security.md)."""

    def __init__(self, decoder: st.FrameDecoder, *, framed: bool) -> None:
        self.decoder = decoder
        self.framed = framed
        self.on_event: Callable[[st.Event], None] = self._unexpected
        self.sealer: m.Sealer | None = None
        self.opener: m.Opener | None = None
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None
        self.stalled = False                  # a write waited STALL_S for the peer to read
        self._scratch: memoryview | None = None     # made at the first read (a refused connection reads nothing)
        self._into_payload = False
        self._raw = bytearray()
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._wake: asyncio.Future[None] | None = None
        self._until: Callable[[], bool] = bool      # what the waiting task waits for (see wait)
        self._writable: asyncio.Future[None] | None = None

    # -- asyncio.BufferedProtocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]   # a stream transport (uvloop's are not asyncio.Transport subclasses)

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self.decoder.payload_target() if self.framed else None
        self._into_payload = bool(target)
        if target:
            return target
        if self._scratch is None:
            self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._into_payload:
            self._take(self.decoder.payload_written, nbytes)
            return
        assert self._scratch is not None
        if self.framed:
            self._take(self.decoder.feed, bytes(self._scratch[:nbytes]))
        else:
            self._raw += self._scratch[:nbytes]
            if len(self._raw) >= RAW_HIGH and self.transport is not None:
                self.transport.pause_reading()     # nobody reads past the handshake yet
            self._notify()

    def eof_received(self) -> bool | None:
        return None                        # close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None and exc is not None:
            self.error = exc
        if not self.closed.done():
            self.closed.set_result(None)
        self._notify()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # -- for the client and server --

    def _take(self, give: Callable[[Any], None], data: Any) -> None:
        """Give the decoder new input (``give(data)``), then hand out every event it makes whole."""
        try:
            give(data)
            decoder, opener = self.decoder, self.opener
            while (item := decoder.next_event()) is not None:
                if opener is not None and opener.take(item):
                    continue               # a seal, kept for the frame it precedes
                self.on_event(item)
            self._notify()
        except Exception as exc:           # a protocol error, a bad seal, a sink that failed
            self.fail(exc)

    def expect_nothing(self) -> None:
        """No answer is due (an idle lane kept for the next pull): any input is an error."""
        self.on_event = self._unexpected

    def _unexpected(self, item: st.Event) -> None:
        raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(item).__name__} when no answer was due")

    def _notify(self) -> None:
        """Wake the waiting task if what it waits for now holds, or the connection failed: not
        on every read (a pull's task would step once per block for nothing)."""
        wake = self._wake
        if wake is not None and not wake.done() and (
                self._until() or self.error is not None or self.closed.done()):
            wake.set_result(None)

    def fail(self, exc: BaseException) -> None:
        """Stop taking input, with ``exc`` as the connection's error (the first one is kept): no
        buffer a pull gave is written into any more. The owner then answers or closes."""
        if self.error is None:
            self.error = exc
        self._detach()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._notify()

    def abandon(self) -> None:
        """Write nothing more into any buffer a pull gave, and close now (unsent bytes dropped)."""
        self._detach()
        if self.transport is not None:
            self.transport.abort()

    def _detach(self) -> None:
        self.on_event = _ignore
        self.decoder = st.FrameDecoder(max_body=0, max_payload=1)   # holds no slot; reads go to scratch
        self.framed = True

    @property
    def gone(self) -> bool:
        return (self.error is not None or self.closed.done() or self.transport is None
                or self.transport.is_closing())

    def failure(self) -> BaseException:
        return self.error if self.error is not None else PeerGone("the peer closed the lane")

    def dispose(self) -> None:
        """The owner is done with this connection (closed or given up): drop what ties it into
        reference cycles, so that it is freed by reference counting alone. Reads go to scratch
        from now on; nothing waits on it any more."""
        self._detach()
        self._until = bool
        self._wake = None
        error = self.error
        while error is not None:             # its traceback holds the frames that hold this connection
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
        if self.transport is not None and self.transport.is_closing():
            self.transport = None            # a TLS transport holds its protocol (this) until it is freed

    async def wait(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds after some input; the connection's failure if it ends first."""
        while not condition():
            if self.error is not None or self.closed.done():
                raise self.failure()
            self._until = condition
            self._wake = asyncio.get_running_loop().create_future()
            await self._wake

    async def read_raw(self, n: int) -> bytes:
        """The next ``n`` bytes before framing (a handshake message)."""
        await self.wait(lambda: len(self._raw) >= n)
        data = bytes(self._raw[:n])
        del self._raw[:n]
        self._resume_raw()
        return data

    def _resume_raw(self) -> None:
        if len(self._raw) < RAW_HIGH and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def start_framing(self) -> None:
        """From now on bytes are frames (what came after the handshake is decoded first)."""
        self.framed = True
        rest, self._raw = bytes(self._raw), bytearray()
        self._resume_raw()
        if rest:
            self._take(self.decoder.feed, rest)

    def sealed(self, frame: bytes) -> bytes:
        """``frame`` as it goes on this lane: after its Seal where the lane is ``mac``."""
        return self.sealer.seal(frame) + frame if self.sealer is not None else frame

    def send(self, data: bytes) -> None:
        """Write ``data`` (a handshake message, a frame); the connection's failure (PeerGone
        where it simply closed) if it is gone: a transport the peer reset may not be written to
        (uvloop raises RuntimeError for it, which no caller would take for a lane that broke)."""
        if self.gone:
            raise self.failure()
        assert self.transport is not None
        self.transport.write(data)

    def write_frame(self, frame: bytes) -> None:
        """Write one frame (sealed where the lane is ``mac``)."""
        self.send(self.sealed(frame))

    @property
    def buffered(self) -> int:
        """Bytes the transport holds, not yet taken by the kernel."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0

    async def flushed(self) -> None:
        """Until the transport holds nothing (the kernel took every byte written)."""
        if self.buffered and self.transport is not None and not self.gone:
            self.transport.set_write_buffer_limits(high=0, low=0)      # pauses writing: resumed at empty
            try:
                await self.drain()
            finally:
                if not self.transport.is_closing():
                    self.transport.set_write_buffer_limits(high=WRITE_HIGH, low=0)
        if self.closed.done():
            raise self.failure()

    async def drain(self) -> None:
        """Until the transport is under its high-water mark again; asyncio.TimeoutError when it
        has not moved for STALL_S (the peer stopped reading)."""
        writable = self._writable
        if writable is not None and not writable.done():
            try:
                await asyncio.wait_for(asyncio.shield(writable), STALL_S)
            except asyncio.TimeoutError:
                self.stalled = True
                raise
        if self.closed.done():
            raise self.failure()


def _ignore(item: st.Event) -> None:
    """What a connection cut off from its pull does with input: nothing."""


def peer_certificate(transport: asyncio.BaseTransport | None) -> x509.Certificate | None:
    """The certificate the other end of a TLS lane presented (None: none, or not TLS)."""
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return x509.load_der_x509_certificate(der) if der else None


