"""The NIXL lane's control messages (kvcached.peers.protocol_nixl): their exact bytes, round
trips through the peer protocol's decoder, and the limits a hostile peer meets."""

from __future__ import annotations

import struct

import pytest

from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.protocol_nixl import MAX_METADATA, MAX_ROWS

D1 = bytes(range(32))
D2 = bytes(range(32, 64))
SUM = bytes(range(100, 132))
FOUND = p.NixlSpan(1 << 33, 4096, SUM, "llama")
MISSING = p.NixlSpan(missing=p.MissReason.BUSY)


def head(length: int, type_: int, request_id: int) -> bytes:
    return struct.pack("<IBBHI", length, 1, type_, 0, request_id)


@pytest.mark.parametrize("message, body", [
    (p.NixlOpen(), b""),
    (p.NixlAgent(0x7F00_0000_1000, 1 << 30, b"meta"), struct.pack("<QQI", 0x7F00_0000_1000, 1 << 30, 4) + b"meta"),
    (p.NixlPull([(D1, 3)], 1 << 20, "alice"), b"\x05\x00alice" + struct.pack("<QI", 1 << 20, 1) + D1 + struct.pack("<I", 3)),
    (p.NixlPull([(D2, 0)], 7), b"\x00\x00" + struct.pack("<QI", 7, 1) + D2 + struct.pack("<I", 0)),
    (p.NixlSpans(9, 2000, (FOUND, MISSING)),
     struct.pack("<QII", 9, 2000, 2) + b"\x00" + struct.pack("<QI", 1 << 33, 4096) + SUM + b"\x05\x00llama" + b"\x03"),
    (p.NixlDone(1 << 63), struct.pack("<Q", 1 << 63)),
])
def test_exact_bytes_and_round_trips(message: p.Message, body: bytes) -> None:
    frame = p.encode(message, 5)
    assert frame == head(len(body), message.TYPE, 5) + body
    decoder = st.FrameDecoder()
    decoder.feed(frame)
    event = decoder.next_event()
    assert isinstance(event, p.Frame) and p.decode(event) == message


def test_types_and_sets() -> None:
    assert (p.NixlOpen.TYPE, p.NixlPull.TYPE, p.NixlDone.TYPE, p.NixlAgent.TYPE, p.NixlSpans.TYPE) == (6, 7, 8, 0x87, 0x88)
    for message in (p.NixlOpen, p.NixlPull, p.NixlDone):      # each pins, frees or hands out keys: never 0-RTT
        assert message.TYPE in p.REQUESTS and message.TYPE in p.STATE_CHANGING
        assert not p.allowed_as_early_data(message.TYPE)
    assert p.NixlDone.TYPE in p.EVENTS and p.NixlPull.TYPE not in p.EVENTS
    assert FOUND.found and not MISSING.found


@pytest.mark.parametrize("type_, body, code, text", [
    (0x87, struct.pack("<QQI", 0, 1, 0), p.ErrorCode.MALFORMED, "no metadata"),
    (0x87, struct.pack("<QQI", 0, 0, 1) + b"m", p.ErrorCode.MALFORMED, "empty region"),
    (0x87, struct.pack("<QQI", 0, 1, MAX_METADATA + 1), p.ErrorCode.TOO_LARGE, "over"),
    (0x87, struct.pack("<QQI", 0, 1, 5) + b"meta", p.ErrorCode.MALFORMED, "ends early"),
    (0x07, b"\x00\x00" + struct.pack("<QI", 0, 0), p.ErrorCode.MALFORMED, "max_payload 0"),
    (0x07, b"\x00\x00" + struct.pack("<QI", 1, MAX_ROWS + 1) + (D1 + bytes(4)) * (MAX_ROWS + 1),
     p.ErrorCode.TOO_LARGE, "over 1024"),
    (0x88, struct.pack("<QII", 1, 1, 1) + b"\x09", p.ErrorCode.MALFORMED, "unknown miss reason 9"),
    (0x88, struct.pack("<QII", 1, 1, 1) + b"\x00" + struct.pack("<QI", 0, 0) + SUM + b"\x00\x00",
     p.ErrorCode.MALFORMED, "length 0"),
    (0x88, struct.pack("<QII", 1, 1, MAX_ROWS + 1), p.ErrorCode.TOO_LARGE, "spans, over"),
    (0x88, struct.pack("<QII", 1, 1, 2) + b"\x01", p.ErrorCode.MALFORMED, "ends early"),
    (0x08, b"\x01\x02", p.ErrorCode.MALFORMED, "ends early"),
])
def test_bad_bodies_lose_only_their_request(type_: int, body: bytes, code: p.ErrorCode, text: str) -> None:
    with pytest.raises(p.ProtocolError, match=text) as err:
        p.decode(p.Frame(type_, 7, body))
    assert err.value.code == code and not err.value.fatal and err.value.request_id == 7


@pytest.mark.parametrize("message, text", [
    (p.NixlAgent(0, 1, b""), "outside"), (p.NixlAgent(0, 1, bytes(MAX_METADATA + 1)), "outside"),
    (p.NixlAgent(0, 0, b"m"), "empty region"),
    (p.NixlPull([(D1, 0)], 0), "max_payload 0"), (p.NixlPull([(D1, 0)] * (MAX_ROWS + 1)), "over 1024"),
    (p.NixlPull([(D1[:5], 0)]), "not 32"),
    (p.NixlSpans(1, 1, [p.NixlSpan(0, 0, SUM, "m")]), "length 0"),
    (p.NixlSpans(1, 1, [p.NixlSpan(0, 1, SUM[:31], "m")]), "checksum is 31 bytes"),
    (p.NixlSpans(1, 1, [MISSING] * (MAX_ROWS + 1)), "over 1024"),
])
def test_encoder_refuses_what_the_decoder_would(message: p.Message, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        p.encode(message)


def test_a_full_answer_fits_in_a_body() -> None:
    """MAX_ROWS spans with the longest model names stay within the body limit."""
    spans = [p.NixlSpan(0, 1, SUM, "m" * p.MAX_TEXT)] * MAX_ROWS
    assert len(p.encode(p.NixlSpans(1, 1, spans))) - 12 <= p.MAX_BODY
