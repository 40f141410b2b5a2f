"""The peer session's rules, whatever carries them (sans-I/O).

A pull travels over a QUIC stream (kvcached.peers.quic) or a bulk-lane connection
(kvcached.peers.lane); both are thin adapters over what is here: which frames a server takes as
requests (:func:`take_request`: early-data gating, the types a transport carries), how a client
numbers its requests (:class:`RequestIds`), and how a client takes a pull's answers
(:class:`PullAnswers`: request ids checked, Blocks into the slots its :class:`PullSink` gives,
Misses and Errors, nothing past the last entry), and how much a server's answers may queue
unsent and when a peer that reads nothing is given up (:class:`SendRoom`, the clock passed in).
No sockets; the only clock is the one a SendRoom is given.
"""

from __future__ import annotations

import abc
from collections import deque
from typing import Callable

from kvcached.peers import protocol as p
from kvcached.peers import stream as st

__all__ = ["REQUEST_BODY", "PeerGone", "PeerHandler", "PullSink", "PullAnswers", "RequestIds", "take_request"]

REQUEST_BODY = 4 << 20  # a request body is at most a full batch of addresses


class PeerGone(Exception):
    """The connection ended (or never came up) before the answer was complete."""


class PeerHandler(abc.ABC):
    """What a server does with a verified peer's requests (the peer tier implements it)."""

    @abc.abstractmethod
    async def pull(self, peer: str, request: p.AnyPull) -> list[tuple[p.Block, memoryview, Callable[[], None]] | p.Miss]:
        """Per address in order: a Block head, its payload and a release callback (called once
        the payload is queued), or a Miss."""

    @abc.abstractmethod
    def exists(self, peer: str, request: p.Exists) -> int:
        """How long a prefix of the chain this daemon holds."""

    def answer_locate(self, peer: str, request: p.Locate) -> p.Located:
        """Who holds each address asked, from the location records this daemon keeps as a home
        (kvcached.cluster.location); a daemon that keeps none answers no holders."""
        return p.Located([() for _ in request.addresses])

    @abc.abstractmethod
    def event(self, peer: str, message: p.Announce | p.Drop | p.Snapshot, request_id: int) -> None:
        """An announcement or snapshot part from ``peer``."""

    @abc.abstractmethod
    def connected(self, peer: str) -> None:
        """``peer`` dialled in and proved who it is."""


class PullSink(abc.ABC):
    """Where a pull's answers go, entry by entry (the store: slots in the arena)."""

    @abc.abstractmethod
    def slot(self, block: p.Block) -> memoryview | None:
        """A writable buffer of exactly ``block.payload_length`` bytes for this block, or None
        to skip its payload (no room, not asked for)."""

    @abc.abstractmethod
    def arrived(self, block: p.Block) -> None:
        """The payload of ``block`` is all in the buffer :meth:`slot` gave."""

    @abc.abstractmethod
    def missed(self, miss: p.Miss) -> None:
        """The peer does not send this one."""

    def arrived_coded(self, block: p.Block, coded: memoryview) -> None:
        """The payload of ``block`` came coded with ``block.codec`` and is all in ``coded``: the
        sink decodes it into the buffer :meth:`slot` gave (``block.payload_length`` bytes) and
        checks it, as it checks what :meth:`arrived` says is in. Only answers to a CodedPull
        come coded; a sink that never asks for them need not take them."""
        raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a coded payload answers only a coded pull")


class PullAnswers:
    """The answers to one request as its decoder hands them out, whatever carries them (a QUIC
    stream, a lane): a Block's payload goes into the buffer its sink gives and the sink hears
    when it is all in; a Miss goes to the sink; an Error answer raises ProtocolError.

    With ``request_id``, an answer with another id is refused (an Error with id 0, about the
    whole stream, is taken); with ``expected`` (the Pull's entry count), anything after the
    last entry's answer is refused. ProtocolError either way: the carrier ends the request.

    With ``codec`` (the request was a CodedPull), CodedBlocks answers are taken: a coded
    payload is read into a buffer of its own (its wire length, at most the block's, and only
    for a block the sink gave a slot), then handed to :meth:`PullSink.arrived_coded`. A coded
    answer to a request that asked for none, or in another codec, is refused."""

    def __init__(self, peer: str, decoder: st.FrameDecoder, sink: PullSink | None, *,
                 request_id: int | None = None, expected: int | None = None, codec: int = 0) -> None:
        self.peer, self.decoder, self.sink = peer, decoder, sink
        self.request_id, self.expected, self.codec = request_id, expected, codec
        # heads whose payload is coming: (head, skipped, the buffer a coded payload goes into)
        self.blocks: deque[tuple[p.Block, bool, bytearray | None]] = deque()
        self.answered = 0            # entries answered (Blocks whole, Misses)

    @property
    def complete(self) -> bool:
        """Every entry of the Pull is answered (``expected`` given)."""
        return self.expected is not None and self.answered >= self.expected

    def take(self, item: st.Event) -> p.Message | None:
        """Handle one decoded event; an answer that is neither a Block nor a Miss (an
        ExistsResult, a LaneKey) is returned for the caller to take."""
        if self.request_id is not None and item.request_id != self.request_id and not (
                isinstance(item, p.Frame) and item.type == p.Error.TYPE and item.request_id == 0):
            raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer}: an answer to another request")
        if self.complete:
            raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer} sent more than the answer")
        sink = self.sink
        if isinstance(item, st.BlockEnd):
            block, skipped, coded = self.blocks.popleft()
            self.answered += 1
            if not skipped and sink is not None:
                if coded is None:
                    sink.arrived(block)
                else:
                    sink.arrived_coded(block, memoryview(coded))
        elif isinstance(item, st.BlockHeader):
            if sink is None:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a Block answers only a Pull")
            view = sink.slot(item.block)
            self.blocks.append((item.block, view is None, None))
            if view is not None:
                self.decoder.receive_into(view)
        elif isinstance(item, st.BlocksHeader):
            if sink is None:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "Blocks answer only a Pull")
            if self.expected is not None and self.answered + len(item.blocks) > self.expected:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer} sent more than the answer")
            if item.type == p.CodedBlocks.TYPE and (not self.codec or any(
                    block.codec not in (0, self.codec) for block in item.blocks)):
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{self.peer} sent blocks coded as not asked")
            targets: list[memoryview | bytearray | None] = []
            for block in item.blocks:
                view = sink.slot(block)
                coded = bytearray(block.wire) if view is not None and block.codec else None
                self.blocks.append((block, view is None, coded))
                targets.append(coded if coded is not None else view)
            if any(target is not None for target in targets):
                self.decoder.receive_train(targets)
        elif isinstance(item, st.PayloadChunk):
            pass                       # a payload the sink skipped
        else:
            message = p.decode(item)
            if isinstance(message, p.Error):
                code = p.ErrorCode(message.code) if message.code in p.ErrorCode._value2member_map_ else p.ErrorCode.INTERNAL
                raise p.ProtocolError(code, f"{self.peer}: {message.message}")
            if not isinstance(message, p.Miss):
                return message
            if sink is None:
                raise p.ProtocolError(p.ErrorCode.UNEXPECTED, "a Miss answers only a Pull")
            self.answered += 1
            sink.missed(message)
        return None




class SendRoom:
    """A connection's send queue as a policy, no I/O: how many answer bytes may wait unsent
    (``limit``: a piece goes when it fits, or alone when nothing waits, so a block larger than
    the whole queue still goes), and when a peer that takes nothing is given up (the queue has
    not gone down for ``stall_s`` by ``clock``), so it cannot keep blocks pinned. The carrier
    says how many bytes wait (:meth:`fits`, :meth:`moved`) and does the waiting."""

    def __init__(self, limit: int, stall_s: float, clock: Callable[[], float]) -> None:
        self.limit, self.stall_s, self.clock = limit, stall_s, clock
        self.peak = 0                  # the most bytes ever queued and not yet sent
        self._queued = 0
        self._moved_at = clock()

    def fits(self, queued: int, need: int) -> bool:
        """Whether ``need`` more bytes may be queued now that ``queued`` wait (if so, the
        carrier queues them at once)."""
        self.moved(queued)
        if queued and queued + need > self.limit:
            return False
        self.peak = max(self.peak, queued + need)
        self._queued = queued + need
        return True

    def moved(self, queued: int) -> bool:
        """Note that ``queued`` bytes wait now; whether that is fewer than before (the peer took
        some): the stall clock starts again then, and whenever nothing waits."""
        went_down = queued < self._queued
        if went_down or not queued:
            self._moved_at = self.clock()
        self._queued = queued
        return went_down

    def stalled(self) -> bool:
        """Bytes wait and none has gone for ``stall_s``."""
        return self._queued > 0 and self.clock() - self._moved_at >= self.stall_s

    def wait_s(self) -> float:
        """How long the carrier may wait for the queue to go down before asking :meth:`stalled`."""
        return max(0.0, self.stall_s - (self.clock() - self._moved_at))


class RequestIds:
    """A client's request ids: 1, 2, ... wrapping at 2^32, never 0 (0 names no request)."""

    def __init__(self) -> None:
        self._next = 1

    def next(self) -> int:
        request_id = self._next
        self._next = (self._next + 1) & 0xFFFFFFFF or 1
        return request_id


def take_request(frame: p.Frame, *, early: bool = False, carries: frozenset[int] = p.REQUESTS,
                 where: str = "this connection") -> p.Message:
    """The request in ``frame``, as a server takes it. ProtocolError (not fatal, with the code
    and text to answer in an Error) for: a type not taken as 0-RTT early data while ``early``,
    a body that does not parse or a type not known, an answer sent as a request, or a request
    ``where`` does not carry (``carries``)."""
    if early and not p.allowed_as_early_data(frame.type):
        raise p.ProtocolError(p.ErrorCode.EARLY_DATA,
                              "not taken as 0-RTT early data: send it again once the handshake is complete",
                              request_id=frame.request_id)
    message = p.decode(frame)
    if message.TYPE not in p.REQUESTS:
        raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{type(message).__name__} is an answer, not a request",
                              request_id=frame.request_id)
    if message.TYPE not in carries:
        raise p.ProtocolError(p.ErrorCode.UNEXPECTED, f"{where} carries no {type(message).__name__}",
                              request_id=frame.request_id)
    return message
