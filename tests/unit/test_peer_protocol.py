"""The peer protocol codec, byte for byte and without sockets (docs/peer-protocol.md)."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached_agent.integrity import payload_checksum

D1 = bytes(range(32))
D2 = bytes(range(32, 64))
PAYLOAD = bytes(range(256)) * 4                  # 1024 bytes
BLOCK = p.Block.of(D1, 3, "llama", PAYLOAD)


def header(length: int, type_: int, request_id: int, version: int = 1, flags: int = 0) -> bytes:
    return struct.pack("<IBBHI", length, version, type_, flags, request_id)


def fatal(decoder: st.FrameDecoder) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as err:
        decoder.next_event()
    assert err.value.fatal
    return err.value


def normalized(events: list[st.Event]) -> list[Any]:
    """Events with adjacent payload chunks joined (how the payload is cut depends on the feeding)."""
    out: list[Any] = []
    for event in events:
        if isinstance(event, st.PayloadChunk):
            if out and isinstance(out[-1], tuple):
                out[-1] = ("payload", event.request_id, out[-1][2] + bytes(event.data))
            else:
                out.append(("payload", event.request_id, bytes(event.data)))
        else:
            out.append(event)
    return out


# -- exact bytes ---------------------------------------------------------------------------------

def test_constants() -> None:
    assert p.HEADER.size == 12 and p.VERSION == 1
    assert (p.MAX_BODY, p.MAX_BATCH, p.MAX_TEXT, p.MAX_PAYLOAD) == (4 << 20, 65536, 1024, 1 << 30)
    assert [int(c) for c in p.ErrorCode] == list(range(1, 11))
    assert [c.name for c in p.ErrorCode][4] == "EARLY_DATA"
    assert [(r.name, int(r)) for r in p.MissReason] == [
        ("NOT_FOUND", 1), ("DAMAGED", 2), ("BUSY", 3), ("OVERLOADED", 4), ("TOO_LARGE", 5)]


@pytest.mark.parametrize("message, request_id, head, body", [
    (p.Pull([(D1, 3), (D2, 0xFFFFFFFF)], 1 << 20), 9, "54000000 01 01 0000 09000000",
     struct.pack("<QI", 1 << 20, 2) + D1 + struct.pack("<I", 3) + D2 + struct.pack("<I", 0xFFFFFFFF)),
    (p.TenantPull([(D1, 3)], 1 << 20, "alice"), 9, "37000000 01 05 0000 09000000",
     b"\x05\x00alice" + struct.pack("<QI", 1 << 20, 1) + D1 + struct.pack("<I", 3)),
    (p.Exists(7, [D1, D2]), 2, "48000000 01 02 0000 02000000", struct.pack("<II", 7, 2) + D1 + D2),
    (p.Announce([(D1, 1)]), 0, "28000000 01 10 0000 00000000", struct.pack("<I", 1) + D1 + struct.pack("<I", 1)),
    (p.Drop([(D2, 2)]), 0, "28000000 01 11 0000 00000000", struct.pack("<I", 1) + D2 + struct.pack("<I", 2)),
    (p.Snapshot(2, True, [(D1, 1)]), 5, "2d000000 01 12 0000 05000000",
     struct.pack("<IBI", 2, 1, 1) + D1 + struct.pack("<I", 1)),
    (BLOCK, 9, "53000000 01 81 0000 09000000",
     D1 + struct.pack("<IQ", 3, 1024) + payload_checksum(PAYLOAD) + b"\x05\x00llama"),
    (p.Miss(D2, 4, p.MissReason.BUSY), 9, "25000000 01 82 0000 09000000", D2 + struct.pack("<IB", 4, 3)),
    (p.ExistsResult(2), 2, "04000000 01 83 0000 02000000", b"\x02\x00\x00\x00"),
    (p.Error(5, "again"), 0xFFFFFFFF, "09000000 01 ff 0000 ffffffff", b"\x05\x00\x05\x00again"),
])
def test_exact_bytes(message: p.Message, request_id: int, head: str, body: bytes) -> None:
    assert p.encode(message, request_id) == bytes.fromhex(head) + body


def test_worked_example_of_the_spec() -> None:
    """docs/peer-protocol.md, "A worked example": the same hex."""
    pull = ("30000000 01 01 0000 01000000" "00000001 00000000" "01000000"
            + D1.hex() + "03000000")
    assert p.encode(p.Pull([(D1, 3)], 16 << 20), 1) == bytes.fromhex(pull)
    checksum = "b6fb73fc46938c981e2b0b4b1ef282adcfc89854d01bfe3972fdc4785b41b2c7"
    head = ("53000000 01 81 0000 01000000" + D1.hex() + "03000000" "00100000 00000000" + checksum
            + "0500 6c6c616d61")
    assert p.encode(p.Block.of(D1, 3, "llama", bytes(4096)), 1) == bytes.fromhex(head)
    run = "57000000 01 85 0000 01000000" "01000000" + head[len("53000000 01 81 0000 01000000"):]
    assert p.encode(p.Blocks([p.Block.of(D1, 3, "llama", bytes(4096))]), 1) == bytes.fromhex(run)


# -- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("message", [
    p.Pull([(D1, 0), (D2, 0xFFFFFFFF)]), p.Pull([], 1), p.Exists(0, [D1]), p.Exists(1, []),
    p.TenantPull([(D1, 0)], 7, "bob"), p.TenantPull([], 1, "é" * 512),
    p.Announce([(D1, 1), (D2, 2)]), p.Announce([]), p.Drop([(D2, 5)]),
    p.Snapshot(0, False, []), p.Snapshot(0xFFFFFFFF, True, [(D1, 7)]),
    BLOCK, p.Block(D2, 0, "", p.MAX_PAYLOAD, bytes(32)), p.Block(D1, 1, "é" * 512, 1, bytes(32)),
    p.Miss(D1, 2, p.MissReason.TOO_LARGE), p.ExistsResult(0), p.ExistsResult(0xFFFFFFFF),
    p.Error(p.ErrorCode.INTERNAL, ""), p.Error(1, "ünïcode"),
    p.Blocks((BLOCK,)), p.Blocks((BLOCK, p.Block(D1, 1, "é" * 512, 1, bytes(32)))),
])
def test_every_message_round_trips(message: p.Message) -> None:
    frame = p.encode(message, 42)
    assert p.decode(p.Frame(message.TYPE, 42, frame[12:])) == message
    decoder = st.FrameDecoder()
    decoder.feed(frame)
    event = decoder.next_event()
    if isinstance(message, p.Block):
        assert event == st.BlockHeader(42, message) and decoder.payload_remaining == message.payload_length
    elif isinstance(message, p.Blocks):
        assert event == st.BlocksHeader(42, tuple(message.heads), frame[12:])
        assert decoder.payload_remaining == message.heads[0].payload_length
    else:
        assert event == p.Frame(message.TYPE, 42, frame[12:])
        assert decoder.next_event() is None and decoder.buffered == 0


# -- the decoder ---------------------------------------------------------------------------------

SMALL = p.Block.of(D1, 3, "llama", PAYLOAD[:40])
STREAM = p.encode(p.Exists(1, [D1]), 1) + p.encode(SMALL, 2) + PAYLOAD[:40] + p.encode(p.Miss(D2, 0, 1), 2)
EXPECTED = [p.Frame(0x02, 1, p.encode(p.Exists(1, [D1]))[12:]), st.BlockHeader(2, SMALL),
            ("payload", 2, PAYLOAD[:40]), st.BlockEnd(2), p.Frame(0x82, 2, p.encode(p.Miss(D2, 0, 1))[12:])]


def test_decoder_in_one_piece_and_one_byte_at_a_time() -> None:
    decoder = st.FrameDecoder()
    decoder.feed(STREAM)
    assert normalized(list(decoder)) == EXPECTED and decoder.buffered == 0
    decoder, events = st.FrameDecoder(), []
    for i in range(len(STREAM)):
        decoder.feed(STREAM[i:i + 1])
        events += list(decoder)
    assert normalized(events) == EXPECTED and decoder.buffered == 0


def test_decoder_split_at_every_position() -> None:
    for cut in range(len(STREAM) + 1):
        decoder = st.FrameDecoder()
        decoder.feed(STREAM[:cut])
        events = list(decoder)
        decoder.feed(STREAM[cut:])
        assert normalized(events + list(decoder)) == EXPECTED, f"cut at {cut}"


def test_payload_comes_as_views_of_what_was_fed() -> None:
    fed = p.encode(BLOCK, 7) + PAYLOAD
    decoder = st.FrameDecoder()
    decoder.feed(fed)
    assert decoder.next_event() == st.BlockHeader(7, BLOCK)
    chunk = decoder.next_event()
    assert isinstance(chunk, st.PayloadChunk) and chunk.request_id == 7
    assert chunk.data.readonly and chunk.data.obj is fed and chunk.data == PAYLOAD    # no copy
    assert decoder.next_event() == st.BlockEnd(7) and decoder.next_event() is None


def test_mutable_input_is_copied() -> None:
    fed = bytearray(p.encode(BLOCK, 7) + PAYLOAD)
    decoder = st.FrameDecoder()
    decoder.feed(fed)
    fed[:] = bytes(len(fed))                    # the caller reuses its buffer
    assert decoder.next_event() == st.BlockHeader(7, BLOCK)
    chunk = decoder.next_event()
    assert isinstance(chunk, st.PayloadChunk) and chunk.data == PAYLOAD


@pytest.mark.parametrize("before", [0, 1, 500, 1024])
def test_receive_into_a_slice_of_a_bigger_buffer(before: int) -> None:
    after = p.encode(p.ExistsResult(1), 8)
    decoder = st.FrameDecoder()
    decoder.feed(p.encode(BLOCK, 7) + PAYLOAD[:before])
    assert decoder.next_event() == st.BlockHeader(7, BLOCK)
    arena = bytearray(b"\xee" * 3000)
    decoder.receive_into(memoryview(arena)[100:100 + len(PAYLOAD)])
    assert decoder.payload_remaining == len(PAYLOAD) - before and decoder.buffered == 0
    rest = bytearray(PAYLOAD[before:] + after)
    decoder.feed(rest)
    rest[:] = bytes(len(rest))                  # what went past the payload was copied
    assert decoder.next_event() == st.BlockEnd(7)
    assert arena[100:100 + len(PAYLOAD)] == PAYLOAD and arena[:100] + arena[1124:] == b"\xee" * 1976
    assert decoder.next_event() == p.Frame(0x83, 8, after[12:]) and decoder.buffered == 0


def test_receive_into_after_some_chunks() -> None:
    decoder = st.FrameDecoder()
    decoder.feed(p.encode(BLOCK, 7) + PAYLOAD[:100])
    assert isinstance(decoder.next_event(), st.BlockHeader)
    assert isinstance(decoder.next_event(), st.PayloadChunk) and decoder.next_event() is None
    buf = bytearray(924)
    decoder.receive_into(buf)
    decoder.feed(PAYLOAD[100:])
    assert decoder.next_event() == st.BlockEnd(7) and buf == PAYLOAD[100:]


def test_payload_target_and_payload_written() -> None:
    decoder = st.FrameDecoder()
    assert len(decoder.payload_target()) == 0
    decoder.feed(p.encode(BLOCK, 7) + PAYLOAD[:10])
    decoder.next_event()
    buf = bytearray(1024)
    decoder.receive_into(buf)
    target = decoder.payload_target()
    assert len(target) == 1014
    target[:500] = PAYLOAD[10:510]              # as a socket's recv_into would
    decoder.payload_written(500)
    assert decoder.next_event() is None and decoder.payload_remaining == 514
    with pytest.raises(ValueError):
        decoder.payload_written(515)
    decoder.payload_target()[:] = PAYLOAD[510:]
    decoder.payload_written(514)
    assert decoder.next_event() == st.BlockEnd(7) and buf == PAYLOAD
    assert len(decoder.payload_target()) == 0
    with pytest.raises(ValueError):
        decoder.payload_written(1)


def test_receive_into_refusals() -> None:
    decoder = st.FrameDecoder()
    with pytest.raises(RuntimeError):
        decoder.receive_into(bytearray(1))      # no payload is coming
    decoder.feed(p.encode(BLOCK, 7))
    decoder.next_event()
    with pytest.raises(ValueError, match="1024 bytes"):
        decoder.receive_into(bytearray(1023))
    with pytest.raises(ValueError, match="read-only"):
        decoder.receive_into(bytes(1024))
    decoder.receive_into(bytearray(1024))
    with pytest.raises(RuntimeError):
        decoder.receive_into(bytearray(1024))   # it already has a buffer


def test_block_of_and_verify() -> None:
    assert BLOCK.payload_length == 1024 and BLOCK.checksum == payload_checksum(PAYLOAD)
    assert BLOCK.verify(PAYLOAD) and BLOCK.verify(memoryview(bytearray(PAYLOAD)))
    flipped = bytearray(PAYLOAD)
    flipped[700] ^= 1
    assert not BLOCK.verify(flipped)
    assert not BLOCK.verify(PAYLOAD[:-1])


# -- limits and errors ---------------------------------------------------------------------------

def test_oversize_body_is_refused_from_the_header_alone() -> None:
    for decoder, length in ((st.FrameDecoder(max_body=100), 101), (st.FrameDecoder(), p.MAX_BODY + 1)):
        decoder.feed(header(length, 0x01, 7))    # 12 bytes: no body sent
        err = fatal(decoder)
        assert err.code == p.ErrorCode.TOO_LARGE and err.request_id == 7 and decoder.buffered == 0


@pytest.mark.parametrize("raw, code", [
    (p.encode(BLOCK, 7), p.ErrorCode.TOO_LARGE),                  # over this decoder's max_payload
    (header(78, 0x81, 7) + D1 + struct.pack("<IQ", 0, 1 << 31) + bytes(34), p.ErrorCode.TOO_LARGE),
    (header(78, 0x81, 7) + D1 + struct.pack("<IQ", 0, 0) + bytes(34), p.ErrorCode.MALFORMED),
    (header(77, 0x81, 7) + D1 + struct.pack("<IQ", 0, 1) + bytes(33), p.ErrorCode.MALFORMED),
    (header(79, 0x81, 7) + D1 + struct.pack("<IQ", 0, 1) + bytes(32) + b"\x01\x00\xff", p.ErrorCode.MALFORMED),
    (header(1102, 0x81, 7) + D1 + struct.pack("<IQ", 0, 1) + bytes(32) + b"\x01\x04" + bytes(1024),
     p.ErrorCode.TOO_LARGE),                                      # a model of 1025 bytes
    (header(1103, 0x81, 7), p.ErrorCode.MALFORMED),               # a head longer than any Block head
])
def test_bad_block_heads_are_fatal(raw: bytes, code: p.ErrorCode) -> None:
    decoder = st.FrameDecoder(max_payload=1023)
    decoder.feed(raw)                           # no payload byte sent
    err = fatal(decoder)
    assert err.code == code and err.request_id == 7


@pytest.mark.parametrize("raw, code", [
    (header(4, 0x83, 7, version=2) + bytes(4), p.ErrorCode.UNSUPPORTED_VERSION),
    (header(4, 0x83, 7, version=0), p.ErrorCode.UNSUPPORTED_VERSION),
    (header(4, 0x83, 7, flags=0x0100), p.ErrorCode.MALFORMED),
])
def test_bad_headers_are_fatal_and_stay_fatal(raw: bytes, code: p.ErrorCode) -> None:
    decoder = st.FrameDecoder()
    decoder.feed(raw)
    err = fatal(decoder)
    assert err.code == code and err.request_id == 7
    decoder.feed(p.encode(p.ExistsResult(1), 8))   # nothing after a broken header is trusted
    assert fatal(decoder) is err and decoder.buffered == 0


@pytest.mark.parametrize("type_, body, code, text", [
    (0x10, struct.pack("<I", p.MAX_BATCH + 1), p.ErrorCode.TOO_LARGE, "over the limit of 65536"),
    (0x02, struct.pack("<II", 0, p.MAX_BATCH + 1), p.ErrorCode.TOO_LARGE, "over the limit"),
    (0x10, struct.pack("<I", 2) + D1 + b"\x00" * 4, p.ErrorCode.MALFORMED, "need 72 bytes"),
    (0x02, struct.pack("<II", 0, 1) + D1 + b"x", p.ErrorCode.MALFORMED, "need 32 bytes"),
    (0x01, struct.pack("<QI", 0, 0), p.ErrorCode.MALFORMED, "max_payload 0"),
    (0x01, struct.pack("<QI", p.MAX_PAYLOAD + 1, 0), p.ErrorCode.MALFORMED, "max_payload"),
    (0x12, struct.pack("<IBI", 0, 2, 0), p.ErrorCode.MALFORMED, "last is 2"),
    (0xFF, struct.pack("<HH", 1, p.MAX_TEXT + 1) + b"x" * 1025, p.ErrorCode.TOO_LARGE, "over 1024"),
    (0xFF, struct.pack("<HH", 1, 2) + b"\xc3\x28", p.ErrorCode.MALFORMED, "not UTF-8"),
    (0xFF, struct.pack("<HH", 1, 5) + b"abc", p.ErrorCode.MALFORMED, "ends early"),
    (0x83, b"\x01\x00\x00\x00\x00", p.ErrorCode.MALFORMED, "1 bytes left over"),
    (0x82, D1, p.ErrorCode.MALFORMED, "ends early"),
    (0x5A, b"", p.ErrorCode.UNKNOWN_TYPE, "0x5a"),
])
def test_bad_bodies_lose_only_their_request(type_: int, body: bytes, code: p.ErrorCode, text: str) -> None:
    decoder = st.FrameDecoder()
    decoder.feed(header(len(body), type_, 7) + body + p.encode(p.ExistsResult(1), 8))
    frame = decoder.next_event()
    assert isinstance(frame, p.Frame)
    with pytest.raises(p.ProtocolError, match=text) as err:
        p.decode(frame)
    assert err.value.code == code and not err.value.fatal and err.value.request_id == 7
    assert decoder.next_event() == p.Frame(0x83, 8, b"\x01\x00\x00\x00")   # the stream goes on


@pytest.mark.parametrize("message, text", [
    (p.Pull([(b"short", 0)]), "not 32"), (p.Exists(0, [D1 + b"x"]), "not 32"),
    (p.Miss(b"", 0, 1), "not 32"), (p.Block(D1[:31], 0, "m", 1, bytes(32)), "not 32"),
    (p.Block(D1, 0, "m", 1, bytes(31)), "checksum is 31 bytes"),
    (p.Block(D1, 0, "m", 0, bytes(32)), "payload_length 0"),
    (p.Block(D1, 0, "m", p.MAX_PAYLOAD + 1, bytes(32)), "outside"),
    (p.Block(D1, 0, "m" * 1025, 1, bytes(32)), "over 1024"),
    (p.Pull([(D1, 0)], 0), "max_payload 0"), (p.Pull([(D1, 0)], p.MAX_PAYLOAD + 1), "outside"),
    (p.Announce([(D1, 0)] * (p.MAX_BATCH + 1)), "split the batch"),
    (p.Exists(0, [D1] * (p.MAX_BATCH + 1)), "split the batch"),
])
def test_encoder_refuses_what_the_decoder_would(message: p.Message, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        p.encode(message)


def test_full_batches_fit_in_a_body() -> None:
    assert len(p.encode(p.Snapshot(0, True, [(D1, 0)] * p.MAX_BATCH))) - 12 == 9 + 36 * p.MAX_BATCH
    assert 9 + 36 * p.MAX_BATCH <= p.MAX_BODY


@pytest.mark.parametrize("message, kept", [
    ("x" * 5000, "x" * 1024),
    ("a" + "é" * 1000, "a" + "é" * 511),        # 1024 bytes would end inside an é: cut before it
    ("€" * 400, "€" * 341),                     # 3-byte characters: 1023 bytes
])
def test_error_messages_are_cut_not_refused(message: str, kept: str) -> None:
    body = p.encode(p.Error(1, message))[12:]
    back = p.decode(p.Frame(0xFF, 0, body))
    assert isinstance(back, p.Error) and back.message == kept and len(body) == 4 + len(kept.encode())


# -- early data and the type sets ----------------------------------------------------------------

@pytest.mark.parametrize("type_", [0x01, 0x02, 0x03, 0x05, 0x06, 0x07, 0x08, 0x10, 0x11, 0x12, 0x20, 0x81, 0x82, 0x83, 0x84,
                                   0x87, 0x88, 0xFF, 0x5A])
def test_only_pulls_and_exists_are_taken_as_early_data(type_: int) -> None:
    assert p.allowed_as_early_data(type_) is (type_ in (0x01, 0x02, 0x05))


def test_type_sets() -> None:
    assert p.REQUESTS == {0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x10, 0x11, 0x12}
    assert p.EVENTS == {0x08, 0x10, 0x11, 0x12}
    assert p.STATE_CHANGING == {0x03, 0x06, 0x07, 0x08, 0x10, 0x11, 0x12}
    assert p.EARLY_DATA_TYPES == {0x01, 0x02, 0x04, 0x05, 0x09} == p.REQUESTS - p.STATE_CHANGING
    assert set(p.MESSAGES) - p.REQUESTS == {0x20, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0xFF}


def test_locate_and_located_byte_for_byte() -> None:
    """docs/peer-protocol.md, "Locate and Located": the test vector there."""
    digest = bytes(range(32))
    assert p.encode(p.Locate([(digest, 2)]), 9).hex() == (
        "28000000" "01" "04" "0000" "09000000" "01000000" + digest.hex() + "02000000")
    frame = p.encode(p.Located([("node-a", "node-b"), (), ("node-b",)]), 9)
    assert frame.hex() == ("1d000000" "01" "86" "0000" "09000000"
                           "0200" "06" + b"node-a".hex() + "06" + b"node-b".hex()
                           + "03000000" "02" "0000" "0100" "00" "01" "0100")
    decoder = st.FrameDecoder()
    decoder.feed(frame)
    event = decoder.next_event()
    assert isinstance(event, p.Frame) and p.decode(event) == p.Located([("node-a", "node-b"), (), ("node-b",)])


@pytest.mark.parametrize("body, code", [
    (b"\x01\x00\x01a\x01\x00\x00\x00\x01\x05\x00", p.ErrorCode.MALFORMED),          # a name index past the table
    (b"\x01\x00\x00", p.ErrorCode.MALFORMED),                                          # an empty name
    (b"\x01\x00\x01\xff\x00\x00\x00\x00", p.ErrorCode.MALFORMED),                       # a name that is not UTF-8
    (b"\x00\x00\x01\x00\x00\x00\x41", p.ErrorCode.TOO_LARGE),                            # 65 holders of one block
    (b"\x01\x10", p.ErrorCode.TOO_LARGE),                                              # 4,097 names
    (b"\x00\x00\x00\x00\x00\x00\x00", p.ErrorCode.MALFORMED),                            # a byte left over
])
def test_a_bad_located_is_refused(body: bytes, code: p.ErrorCode) -> None:
    frame = p.Frame(p.Located.TYPE, 1, body)
    with pytest.raises(p.ProtocolError) as info:
        p.decode(frame)
    assert info.value.code == code


def test_located_refuses_to_encode_past_its_limits() -> None:
    with pytest.raises(ValueError, match="holders"):
        p.Located([tuple(f"n{i}" for i in range(p.MAX_HOLDERS + 1))]).encode_body()
    with pytest.raises(ValueError, match="names"):
        p.Located([(f"n{i}",) for i in range(p.MAX_NAMES + 1)]).encode_body()
    with pytest.raises(ValueError, match="1..255"):
        p.Located([("x" * 256,)]).encode_body()


def test_lane_messages_byte_for_byte() -> None:
    """docs/peer-protocol.md, "The bulk lane": LaneOpen, LaneKey and Seal frames."""
    assert p.encode(p.LaneOpen(), 7).hex() == "00000000" "01" "03" "0000" "07000000"
    key_id, key = bytes(range(16)), bytes(range(32, 64))
    frame = p.encode(p.LaneKey(key_id, key), 7)
    assert frame[:12].hex() == "30000000" "01" "84" "0000" "07000000" and frame[12:] == key_id + key
    assert p.decode(p.Frame(0x84, 7, frame[12:])) == p.LaneKey(key_id, key)
    seal = p.encode(p.Seal(b"\xab" * 32), 0)
    assert seal[:12].hex() == "20000000" "01" "20" "0000" "00000000" and seal[12:] == b"\xab" * 32
    with pytest.raises(p.ProtocolError):
        p.decode(p.Frame(0x20, 0, b"\xab" * 31))
    with pytest.raises(ValueError):
        p.encode(p.LaneKey(b"short", key))


# -- Blocks: a run of heads, then their payloads back to back -------------------------------------

PAYLOAD2 = bytes(range(255, -1, -1)) * 2        # 512 bytes
BLOCK2 = p.Block.of(D2, 0xFFFFFFFF, "", PAYLOAD2)


def test_blocks_byte_for_byte() -> None:
    """docs/peer-protocol.md, Blocks: a u32 count, then each head as a Block frame's body."""
    frame = p.encode(p.Blocks([BLOCK, BLOCK2]), 9)
    body = struct.pack("<I", 2) + BLOCK.encode_body() + BLOCK2.encode_body()
    assert frame == header(len(body), 0x85, 9) + body
    assert frame[:16].hex() == f"{len(body):02x}000000" "01" "85" "0000" "09000000" "02000000"
    assert len(body) == 4 + (78 + len("llama")) + 78
    assert p.decode(p.Frame(0x85, 9, body)) == p.Blocks((BLOCK, BLOCK2))
    with pytest.raises(ValueError):
        p.encode(p.Blocks([]))


def test_blocks_train_into_buffers_split_at_every_position() -> None:
    stream = p.encode(p.Blocks([BLOCK, BLOCK2]), 9) + PAYLOAD + PAYLOAD2 + p.encode(p.ExistsResult(1), 10)
    for cut in range(len(stream) + 1):
        decoder = st.FrameDecoder()
        first, second = bytearray(len(PAYLOAD)), bytearray(len(PAYLOAD2))
        events: list[st.Event] = []
        for piece in (stream[:cut], stream[cut:]):
            decoder.feed(piece)
            for event in decoder:
                events.append(event)
                if isinstance(event, st.BlocksHeader):
                    decoder.receive_train([first, second])
        assert [type(e) for e in events] == [st.BlocksHeader, st.BlockEnd, st.BlockEnd, p.Frame], cut
        assert events[0] == st.BlocksHeader(9, (BLOCK, BLOCK2), stream[12:12 + len(events[0].body)])
        assert first == PAYLOAD and second == PAYLOAD2 and events[1] == events[2] == st.BlockEnd(9)
        assert decoder.buffered == 0 and decoder.payload_remaining == 0


def test_blocks_train_with_a_payload_skipped_and_through_payload_target() -> None:
    decoder = st.FrameDecoder()
    decoder.feed(p.encode(p.Blocks([BLOCK, BLOCK2, BLOCK]), 9) + PAYLOAD[:10])
    head = decoder.next_event()
    assert isinstance(head, st.BlocksHeader)
    last = bytearray(len(PAYLOAD))
    decoder.receive_train([None, bytearray(len(PAYLOAD2)), last])
    events = [decoder.next_event()]
    decoder.feed(PAYLOAD[10:] + PAYLOAD2)
    events += list(decoder)
    assert normalized(events) == [("payload", 9, PAYLOAD), st.BlockEnd(9), st.BlockEnd(9)]
    target = decoder.payload_target()                 # the third payload goes straight into ``last``
    assert len(target) == len(PAYLOAD)
    target[:] = PAYLOAD
    decoder.payload_written(len(PAYLOAD))
    assert list(decoder) == [st.BlockEnd(9)] and last == PAYLOAD


def test_blocks_refusals() -> None:
    decoder = st.FrameDecoder()
    decoder.feed(p.encode(p.Blocks([BLOCK, BLOCK2]), 9))
    with pytest.raises(RuntimeError):
        decoder.receive_train([None, None])           # no BlocksHeader out yet
    decoder.next_event()
    with pytest.raises(ValueError):
        decoder.receive_train([bytearray(len(PAYLOAD))])                      # one buffer for two blocks
    with pytest.raises(ValueError):
        decoder.receive_train([bytearray(len(PAYLOAD)), bytearray(1)])       # the wrong length
    with pytest.raises(ValueError):
        decoder.receive_train([bytes(len(PAYLOAD)), None])                   # read-only
    decoder.receive_train([None, None])
    with pytest.raises(RuntimeError):
        decoder.receive_train([None, None])           # only once
    small = st.FrameDecoder(max_payload=len(PAYLOAD) - 1)
    small.feed(p.encode(p.Blocks([BLOCK2, BLOCK]), 9))
    assert fatal(small).code == p.ErrorCode.TOO_LARGE
    for count in (0, p.MAX_BATCH + 1, 3):             # none, too many, more than the body holds
        body = struct.pack("<I", count) + BLOCK.encode_body()
        broken = st.FrameDecoder()
        broken.feed(header(len(body), 0x85, 9) + body)
        assert fatal(broken).code == (p.ErrorCode.TOO_LARGE if count > p.MAX_BATCH else p.ErrorCode.MALFORMED)


# -- a tenant's pulls ----------------------------------------------------------------------------

def test_a_pull_names_its_tenant_and_the_default_tenants_is_the_same_bytes_as_before() -> None:
    assert p.pull_of([(D1, 3)], 1 << 20) == p.Pull([(D1, 3)], 1 << 20) and p.Pull([]).tenant == ""
    tenant = p.pull_of([(D1, 3), (D2, 4)], 1 << 20, "alice")
    assert isinstance(tenant, p.TenantPull) and tenant.tenant == "alice"
    assert tenant.part([(D2, 4)]) == p.TenantPull([(D2, 4)], 1 << 20, "alice")
    assert p.Pull([(D1, 3)]).part([]) == p.Pull([])
    with pytest.raises(ValueError, match="no tenant"):
        p.encode(p.TenantPull([(D1, 3)], 1, ""))
    empty = b"\x00\x00" + struct.pack("<QI", 1, 0)
    with pytest.raises(p.ProtocolError, match="no tenant") as err:
        p.decode(p.Frame(0x05, 3, empty))
    assert err.value.code == p.ErrorCode.MALFORMED and err.value.request_id == 3
