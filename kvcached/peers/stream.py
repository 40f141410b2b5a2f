"""One ordered byte stream of the peer protocol cut into events (sans-I/O).

:class:`FrameDecoder` is fed what a transport reads and hands out, in order, each whole frame
(:class:`~kvcached.peers.protocol.Frame`; :func:`~kvcached.peers.protocol.decode` it), and each
Block's head, payload and end as they come (:class:`BlockHeader`, :class:`PayloadChunk` or a
buffer the caller gave, :class:`BlockEnd`; a Blocks frame as :class:`BlocksHeader` and its
payloads in turn). The messages and their bytes are kvcached.peers.protocol's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Iterator, NoReturn, Sequence, Union

from kvcached.peers.protocol import LIMITS, MAX_BODY, MAX_PAYLOAD, MAX_TEXT, Block, Blocks, CodedBlocks, ErrorCode
from kvcached_agent.framing import HEADER, BodyReader, Frame, ProtocolError, header_problem

__all__ = ["FrameDecoder", "Event", "BlockHeader", "BlocksHeader", "PayloadChunk", "BlockEnd"]

_BLOCK_HEAD_MAX = Block.FIXED.size + 2 + MAX_TEXT


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A Block frame's head is in; ``block.payload_length`` payload bytes come next, either as
    PayloadChunk events or into the buffer given to :meth:`FrameDecoder.receive_into`."""

    request_id: int
    block: Block


@dataclass(frozen=True, slots=True)
class BlocksHeader:
    """A Blocks (or CodedBlocks) frame's heads are in; the payloads of ``blocks`` come next, in
    order, each ``block.wire`` bytes and ending with a :class:`BlockEnd`: as PayloadChunk
    events, or into the buffers given to :meth:`FrameDecoder.receive_train`."""

    request_id: int
    blocks: tuple[Block, ...]
    body: bytes                       # the frame's body as it came (a mac lane's seal covers it)
    type: int = Blocks.TYPE           # Blocks or CodedBlocks


@dataclass(frozen=True, slots=True)
class PayloadChunk:
    """The next bytes of the current block's payload: a read-only view of what was fed (no copy)."""

    request_id: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class BlockEnd:
    """The current block's payload is all delivered (in chunks or into the receive_into buffer)."""

    request_id: int


Event = Union[Frame, BlockHeader, BlocksHeader, PayloadChunk, BlockEnd]


class FrameDecoder:
    """Cuts one ordered byte stream into events. Feed it what arrives; take the events that are whole.

    Frames other than Block and Blocks come whole (:class:`Frame`; :func:`decode` them). A Block
    comes as :class:`BlockHeader`, then its payload, then :class:`BlockEnd`; a Blocks frame as
    :class:`BlocksHeader`, then each payload followed by a BlockEnd. A payload is never
    gathered: by default it comes as :class:`PayloadChunk` views of the fed bytes; after
    :meth:`receive_into` (:meth:`receive_train` for a Blocks frame's payloads) it is written
    straight into the caller's buffer (an arena slot), and a transport that reads from a socket
    can ``recv_into(payload_target())`` and report :meth:`payload_written`, so the bytes go from
    the kernel to the slot once.

    Fed ``bytes`` are kept by reference until used; a mutable buffer is copied (or written into
    the receive_into buffer at once), so the caller may reuse it. A bad header or Block head
    raises a fatal ProtocolError (nothing after it can be trusted); the decoder then refuses
    further input. Lengths are checked as soon as the header (or Block head, or Blocks heads) is
    in, before any byte of what they announce is buffered."""

    def __init__(self, max_body: int = MAX_BODY, max_payload: int = MAX_PAYLOAD) -> None:
        self.max_body = max_body
        self.max_payload = max_payload
        self._pending: deque[memoryview] = deque()    # fed, not yet used
        self._pending_bytes = 0
        self._head = bytearray()                      # the header and body being gathered
        self._frame: tuple[int, int, int] | None = None   # (body length, type, request id) once a header is in
        self._request_id = 0                          # of the Block whose payload is coming
        self._in_payload = False
        self._remaining = 0
        self._sink: memoryview | None = None
        self._filled = 0
        self._train: deque[int] = deque()             # payload lengths of a Blocks frame's blocks after the current
        self._views: deque[memoryview | None] = deque()   # their receive_train buffers
        self._train_fresh = False                     # a BlocksHeader went out; receive_train may come
        self._broken: ProtocolError | None = None

    # -- input --

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken is not None or not len(data):
            return
        view = memoryview(data).cast("B")
        if self._sink is not None and not self._pending:
            view = view[self._to_sink(view):]
            if not len(view):
                return
        if not view.readonly:
            view = memoryview(bytes(view))
        self._pending.append(view)
        self._pending_bytes += len(view)

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet handed out (a payload written into the caller's buffer is not counted)."""
        return self._pending_bytes + len(self._head)

    @property
    def payload_remaining(self) -> int:
        """Payload bytes of the current Block not yet handed out or written (0 outside a payload)."""
        return self._remaining

    def receive_into(self, buffer: bytearray | memoryview) -> None:
        """Write the rest of the current Block's payload into ``buffer``, which must be writable
        and exactly :attr:`payload_remaining` bytes long (slice an arena slot to fit). Payload
        bytes already fed are written at once; the next ones as they are fed."""
        if not self._in_payload or self._sink is not None:
            raise RuntimeError("receive_into: no block payload is coming, or it already has a buffer")
        self._train_fresh = False
        self._attach(_writable(buffer, self._remaining, "receive_into"))

    def receive_train(self, buffers: Sequence[bytearray | memoryview | None]) -> None:
        """After a :class:`BlocksHeader`, before anything else: the buffers its payloads go
        into, one per block in order, each writable and exactly that payload's length, or None
        for a payload to skip (it comes as PayloadChunk events). As :meth:`receive_into`, for a
        run of blocks."""
        if not self._train_fresh or self._sink is not None:
            raise RuntimeError("receive_train: only right after a BlocksHeader")
        if len(buffers) != 1 + len(self._train):
            raise ValueError(f"receive_train: {len(buffers)} buffers for {1 + len(self._train)} blocks")
        lengths = [self._remaining, *self._train]
        views = [None if b is None else _writable(b, n, "receive_train") for b, n in zip(buffers, lengths)]
        self._train_fresh = False
        self._views = deque(views[1:])
        if views[0] is not None:
            self._attach(views[0])

    def _attach(self, view: memoryview) -> None:
        """Write the current payload into ``view`` (checked: writable, payload_remaining bytes)."""
        self._sink, self._filled = view, 0
        while self._pending and self._remaining:
            chunk = self._pending.popleft()
            n = self._to_sink(chunk)
            self._pending_bytes -= n
            if n < len(chunk):
                self._pending.appendleft(chunk[n:])

    def payload_target(self) -> memoryview:
        """The part of the receive_into buffer still to be written (empty if none): a socket
        transport may ``recv_into`` it and then call :meth:`payload_written`."""
        if self._sink is None:
            return memoryview(b"")
        return self._sink[self._filled:]

    def payload_written(self, n: int) -> None:
        """``n`` bytes were written at the start of :meth:`payload_target` by the caller."""
        if self._sink is None or not 0 <= n <= self._remaining:
            raise ValueError(f"payload_written: {n} bytes, with {self._remaining} expected into a buffer")
        self._filled += n
        self._remaining -= n

    def _to_sink(self, view: memoryview) -> int:
        assert self._sink is not None
        n = min(len(view), self._remaining)
        self._sink[self._filled:self._filled + n] = view[:n]
        self._filled += n
        self._remaining -= n
        return n

    # -- output --

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        event = self.next_event()
        if event is None:
            raise StopIteration
        return event

    def next_event(self) -> Event | None:
        """The next whole event, or None until more bytes arrive."""
        if self._broken is not None:
            raise self._broken
        if self._in_payload:
            return self._payload_event()
        if self._frame is None:
            if not self._gather(HEADER.size):
                return None
            length, version, type_, flags, request_id = HEADER.unpack(self._head)
            problem = header_problem(LIMITS, length, version, flags, request_id, self.max_body)
            if problem is not None:
                self._fail(problem.code, str(problem), request_id)
            if type_ == Block.TYPE and length > _BLOCK_HEAD_MAX:
                self._fail(ErrorCode.MALFORMED, f"Block: a head of {length} bytes; at most {_BLOCK_HEAD_MAX}",
                           request_id)
            self._frame = (length, type_, request_id)
            self._head.clear()
        length, type_, request_id = self._frame
        pending = self._pending
        if not self._head and pending and len(pending[0]) >= length:    # the whole body in one piece: one copy
            chunk = pending.popleft()
            body = bytes(chunk[:length])
            if len(chunk) > length:
                pending.appendleft(chunk[length:])
            self._pending_bytes -= length
        elif self._gather(length):
            body = bytes(self._head)
            self._head.clear()
        else:
            return None
        self._frame = None
        if type_ == Blocks.TYPE or type_ == CodedBlocks.TYPE:
            return self._blocks_header(body, request_id, type_)
        if type_ != Block.TYPE:
            return Frame(type_, request_id, body)
        reader = BodyReader(body, "Block", LIMITS)
        try:
            block = Block.decode_body(reader)
            reader.end()
        except ProtocolError as err:     # the payload's length is not known: the framing is lost
            self._fail(err.code, str(err), request_id)
        if block.payload_length > self.max_payload:
            self._fail(ErrorCode.TOO_LARGE, f"Block: payload of {block.payload_length} bytes is over the limit "
                       f"of {self.max_payload}", request_id)
        self._request_id, self._remaining, self._in_payload = request_id, block.payload_length, True
        return BlockHeader(request_id, block)

    def _blocks_header(self, body: bytes, request_id: int, type_: int) -> BlocksHeader:
        kind = CodedBlocks if type_ == CodedBlocks.TYPE else Blocks
        reader = BodyReader(body, kind.__name__, LIMITS)
        try:
            heads = kind.decode_body(reader).heads
            reader.end()
        except ProtocolError as err:     # the payloads' lengths are not known: the framing is lost
            self._fail(err.code, str(err), request_id)
        for head in heads:
            if head.payload_length > self.max_payload:
                self._fail(ErrorCode.TOO_LARGE, f"{kind.__name__}: a payload of {head.payload_length} bytes is over "
                           f"the limit of {self.max_payload}", request_id)
        self._request_id, self._remaining, self._in_payload = request_id, heads[0].wire, True
        self._train = deque(head.wire for head in heads[1:])
        self._views.clear()
        self._train_fresh = True
        return BlocksHeader(request_id, tuple(heads), body, type_)

    def _payload_event(self) -> PayloadChunk | BlockEnd | None:
        if not self._remaining:
            self._sink, self._train_fresh = None, False
            if self._train:                       # the next payload of a Blocks frame
                self._remaining = self._train.popleft()
                view = self._views.popleft() if self._views else None
                if view is not None:
                    self._attach(view)
            else:
                self._in_payload = False
            return BlockEnd(self._request_id)
        self._train_fresh = False
        if self._sink is not None or not self._pending:
            return None
        chunk = self._pending.popleft()
        if len(chunk) > self._remaining:
            self._pending.appendleft(chunk[self._remaining:])
            chunk = chunk[:self._remaining]
        self._pending_bytes -= len(chunk)
        self._remaining -= len(chunk)
        return PayloadChunk(self._request_id, chunk)

    def _gather(self, n: int) -> bool:
        """Move fed bytes into the header/body buffer until it holds ``n`` bytes; whether it does."""
        head, pending = self._head, self._pending
        while len(head) < n and pending:
            chunk = pending.popleft()
            take = n - len(head)
            if len(chunk) > take:
                pending.appendleft(chunk[take:])
                chunk = chunk[:take]
            head += chunk
            self._pending_bytes -= len(chunk)
        return len(head) >= n

    def _fail(self, code: IntEnum, message: str, request_id: int) -> NoReturn:
        problem = ProtocolError(code, message, fatal=True, request_id=request_id)
        self._broken = problem
        self._pending.clear()
        self._pending_bytes = 0
        self._head = bytearray()
        self._sink = None
        self._train.clear()
        self._views.clear()
        raise problem


def _writable(buffer: bytearray | memoryview, length: int, what: str) -> memoryview:
    view = memoryview(buffer).cast("B")
    if view.readonly or len(view) != length:
        raise ValueError(f"{what}: needs a writable buffer of {length} bytes, "
                         f"got {len(view)} bytes{' (read-only)' if view.readonly else ''}")
    return view
