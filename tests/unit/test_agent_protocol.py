"""The agent protocol codec, byte for byte and without sockets (docs/agent-protocol.md)."""

from __future__ import annotations

import struct

import pytest

from kvcached_agent import protocol as p

D1 = bytes(range(32))
D2 = bytes(range(32, 64))


def header(length: int, type_: int, request_id: int, version: int = 1, flags: int = 0) -> bytes:
    return struct.pack("<IBBHI", length, version, type_, flags, request_id)


def roundtrip(message: p.Message, request_id: int = 7) -> p.Message:
    decoder = p.FrameDecoder()
    decoder.feed(p.encode(message, request_id))
    frame = decoder.next_frame()
    assert frame is not None and frame.request_id == request_id and decoder.buffered == 0
    return p.decode(frame)


# -- exact bytes ---------------------------------------------------------------------------------

def test_header_layout() -> None:
    assert p.HEADER.size == 12
    assert p.encode(p.Heartbeat(), 0x01020304) == bytes.fromhex("00000000" "01" "12" "0000" "04030201")


def test_hello_bytes() -> None:
    body = (b"\x01\x00" + b"\x02\x00a1" + b"\x01\x00m" + b"\x04\x00bf16" + b"\x02\x00ns"
            + struct.pack("<IIQ", 16, 32, 1 << 20))
    assert p.encode(p.Hello("a1", "m", "bf16", 16, 32, 1 << 20, b"ns"), 1) == header(len(body), 0x01, 1) + body


def test_allocate_bytes() -> None:
    body = struct.pack("<I", 2) + D1 + struct.pack("<II", 3, 4096) + D2 + struct.pack("<II", 0xFFFFFFFF, 1)
    assert p.encode(p.Allocate([(D1, 3, 4096), (D2, 0xFFFFFFFF, 1)]), 9) == header(len(body), 0x02, 9) + body


def test_commit_and_release_bytes() -> None:
    body = struct.pack("<IQQ", 2, 5, 1 << 40)
    assert p.encode(p.Commit([5, 1 << 40]), 2) == header(len(body), 0x03, 2) + body
    assert p.encode(p.Release([5, 1 << 40]), 2) == header(len(body), 0x06, 2) + body


def test_lookup_load_and_event_bytes() -> None:
    body = struct.pack("<II", 7, 2) + D1 + D2
    assert p.encode(p.Lookup(7, [D1, D2]), 3) == header(len(body), 0x04, 3) + body
    body = struct.pack("<I", 1) + D1 + struct.pack("<I", 9)
    assert p.encode(p.Load([(D1, 9)]), 4) == header(len(body), 0x05, 4) + body
    body = struct.pack("<I", 2) + D1 + D2
    assert p.encode(p.Overlap([D1, D2]), 5) == header(len(body), 0x07, 5) + body
    assert p.encode(p.Pinned([D1, D2]), 0) == header(len(body), 0x10, 0) + body
    assert p.encode(p.Evicted([D1, D2]), 0) == header(len(body), 0x11, 0) + body
    body = struct.pack("<II", 7, 2) + D1 + D2
    assert p.encode(p.Present(7, [D1, D2]), 6) == header(len(body), 0x08, 6) + body


def test_reply_bytes() -> None:
    body = struct.pack("<HQQQI", 1, 3, 1 << 30, 16 << 20, 5000) + b"\x05\x000.1.0"
    assert p.encode(p.Welcome(3, 1 << 30, 16 << 20, 5000, "0.1.0"), 1) == header(len(body), 0x81, 1) + body
    body = struct.pack("<I", 2) + struct.pack("<BQQ", 0, 11, 8192) + struct.pack("<BQQ", 1, 0, 0)
    assert p.encode(p.Slots([(0, 11, 8192), (1, 0, 0)]), 2) == header(len(body), 0x82, 2) + body
    body = struct.pack("<I", 3) + bytes([0, 6, 7])
    assert p.encode(p.Committed([0, 6, 7]), 3) == header(len(body), 0x83, 3) + body
    body = struct.pack("<5I", 9, 1, 8, 4, 0)
    assert p.encode(p.LookupResult(9, 1, 8, 4, 0), 4) == header(len(body), 0x84, 4) + body
    body = struct.pack("<I", 1) + struct.pack("<BQQI", 0, 2, 4096, 1000)
    assert p.encode(p.Loaded([(0, 2, 4096, 1000)]), 5) == header(len(body), 0x85, 5) + body
    body = struct.pack("<II", 3, 1)
    assert p.encode(p.Released(3, 1), 6) == header(len(body), 0x86, 6) + body
    body = struct.pack("<I", 1) + struct.pack("<QII", 2, 4321, 7) + b"\x03\x00vl0"
    assert p.encode(p.OverlapResult([p.AgentPrefix(2, 4321, 7, "vl0")]), 7) == header(len(body), 0x87, 7) + body
    body = struct.pack("<I", 3) + bytes([0, p.HELD_RAM | p.HELD_SSD, p.HELD_PEER])
    assert p.encode(p.PresentResult(bytes([0, 6, 8])), 9) == header(len(body), 0x88, 9) + body
    body = struct.pack("<H", 6) + b"\x03\x00bad"
    assert p.encode(p.Error(6, "bad"), 8) == header(len(body), 0xFF, 8) + body


# -- round trips and the decoder -----------------------------------------------------------------

@pytest.mark.parametrize("message", [
    p.Hello("agent", "llama", "float16", 16, 32, 65536, b"tenant"),
    p.Allocate([(D1, 0, 1), (D2, 5, 1 << 24)]), p.Commit([1, 2]), p.Release([]), p.Lookup(3, [D1]),
    p.Load([(D2, 1)]), p.Overlap([]), p.Pinned([D1]), p.Evicted([D2]), p.Heartbeat(),
    p.Welcome(1, 2, 3, 4, "v"), p.Slots([(0, 1, 2)]), p.Committed([0]), p.LookupResult(1, 2, 3, 4, 5),
    p.Loaded([(4, 0, 0, 0)]), p.Released(0, 0), p.OverlapResult([p.AgentPrefix(1, 2, 3, "é")]), p.Error(1, "x"),
    p.Present(0xFFFFFFFF, [D1, D2]), p.PresentResult(b""), p.PresentResult(bytes([1, 15])),
    p.PlanLoads(3, 0.0015, 65536, [D1, D2]), p.LoadPlan(2, 6, 1, 1, 1, 3, 0.01, 0.02, 0.03),
])
def test_every_message_round_trips(message: p.Message) -> None:
    back = roundtrip(message)
    assert type(back) is type(message)
    assert p.encode(back, 1) == p.encode(message, 1)


def test_decoder_takes_bytes_one_at_a_time_and_several_frames_at_once() -> None:
    stream = p.encode(p.Lookup(1, [D1]), 1) + p.encode(p.Heartbeat(), 2) + p.encode(p.Commit([3]), 3)
    decoder = p.FrameDecoder()
    frames = []
    for i in range(len(stream)):
        decoder.feed(stream[i:i + 1])
        frames += list(decoder)
    assert [f.request_id for f in frames] == [1, 2, 3]
    decoder.feed(stream)
    assert [f.type for f in decoder] == [0x04, 0x12, 0x03]


@pytest.mark.parametrize("raw, code", [
    (header(0, 0x12, 1, version=2), p.ErrorCode.UNSUPPORTED_VERSION),
    (header(0, 0x12, 1, flags=1), p.ErrorCode.MALFORMED),
    (header(p.MAX_BODY + 1, 0x04, 1), p.ErrorCode.TOO_LARGE),
])
def test_bad_headers_are_fatal(raw: bytes, code: p.ErrorCode) -> None:
    decoder = p.FrameDecoder()
    decoder.feed(raw)
    with pytest.raises(p.ProtocolError) as err:
        decoder.next_frame()
    assert err.value.code == code and err.value.fatal
    decoder.feed(p.encode(p.Heartbeat()))     # nothing after a broken header is trusted
    with pytest.raises(p.ProtocolError):
        decoder.next_frame()


def test_oversize_is_refused_from_the_header_alone() -> None:
    decoder = p.FrameDecoder(max_body=100)
    decoder.feed(header(101, 0x04, 1))        # no body sent: the length alone is enough
    with pytest.raises(p.ProtocolError, match="over the limit of 100"):
        decoder.next_frame()


def test_truncated_frame_waits_for_more() -> None:
    data = p.encode(p.Lookup(0, [D1, D2]))
    decoder = p.FrameDecoder()
    decoder.feed(data[:-1])
    assert decoder.next_frame() is None
    decoder.feed(data[-1:])
    assert decoder.next_frame() is not None


@pytest.mark.parametrize("type_, body, code, text", [
    (0x04, struct.pack("<II", 0, 2) + D1, p.ErrorCode.MALFORMED, "need 64 bytes"),
    (0x02, struct.pack("<I", 1) + D1, p.ErrorCode.MALFORMED, "need 40 bytes"),
    (0x03, struct.pack("<I", p.MAX_BATCH + 1), p.ErrorCode.TOO_LARGE, "over the limit"),
    (0x01, b"\x01\x00\x02\x00a", p.ErrorCode.MALFORMED, "ends early"),
    (0x01, b"\x01\x00" + struct.pack("<H", p.MAX_TEXT + 1), p.ErrorCode.TOO_LARGE, "over 1024"),
    (0x01, b"\x01\x00\x01\x00\xff" + b"\x00\x00" * 3 + struct.pack("<IIQ", 1, 1, 1), p.ErrorCode.MALFORMED, "not UTF-8"),
    (0x12, b"x", p.ErrorCode.MALFORMED, "left over"),
    (0x5A, b"", p.ErrorCode.UNKNOWN_TYPE, "0x5a"),
])
def test_bad_bodies_lose_only_their_request(type_: int, body: bytes, code: p.ErrorCode, text: str) -> None:
    with pytest.raises(p.ProtocolError, match=text) as err:
        p.decode(p.Frame(type_, 1, body))
    assert err.value.code == code and not err.value.fatal


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ValueError, match="split the batch"):
        p.encode(p.Commit(list(range(p.MAX_BATCH + 1))))
    with pytest.raises(ValueError, match="not 32"):
        p.encode(p.Lookup(0, [b"short"]))
    with pytest.raises(ValueError, match="over 1024"):
        p.encode(p.Hello("x" * 2000, "m", "d", 1, 1, 1))


def test_error_messages_are_cut_not_refused() -> None:
    back = roundtrip(p.Error(1, "é" * 2000))
    assert isinstance(back, p.Error) and len(back.message.encode()) <= p.MAX_TEXT


def test_events_are_the_requests_without_replies() -> None:
    assert p.EVENTS == {p.Pinned.TYPE, p.Evicted.TYPE, p.Heartbeat.TYPE, p.Route.TYPE}


def test_route_and_features_round_trip_and_bad_route_bodies_are_refused() -> None:
    from kvcached_agent.route import RouteKey, decode_routes, encode_routes
    blob = encode_routes([RouteKey([b"h" * 32, 7], None, list(range(32)), 16, group_idx=1)])
    message = p.Route([(b"d" * 32, 5, blob), (b"e" * 32, p.CROSS_LAYER if hasattr(p, "CROSS_LAYER") else 0xFFFFFFFF, b"")])
    frame = p.encode(message, 9)
    decoder = p.FrameDecoder()
    decoder.feed(frame)
    back = p.decode(next(iter(decoder)))
    assert back == message
    assert decode_routes(back.entries[0][2])[0].block_hashes == [b"h" * 32, 7]
    for message in (p.Features(), p.FeatureSet(p.FeatureSet.ROUTE_KEYS)):
        decoder.feed(p.encode(message))
        assert p.decode(next(iter(decoder))) == message
    # an entry count the body cannot hold, and a blob cut short: refused, the connection goes on
    for body in (struct.pack("<I", 1000) + b"x" * 40, struct.pack("<I32sII", 1, b"d" * 32, 0, 10) + b"abc"):
        decoder.feed(struct.pack("<IBBHI", len(body), p.VERSION, p.Route.TYPE, 0, 3) + body)
        with pytest.raises(p.ProtocolError) as err:
            p.decode(next(iter(decoder)))
        assert not err.value.fatal
    for bad in (b"\x91\x01", b"\xc1", encode_routes([RouteKey([], None, [], 16)])):
        with pytest.raises(ValueError):
            decode_routes(bad)


def test_plan_loads_bytes_and_a_bad_duration() -> None:
    body = struct.pack("<IdQ", 3, 0.005, 65536) + struct.pack("<I", 1) + D1
    assert p.encode(p.PlanLoads(3, 0.005, 65536, [D1]), 9)[12:] == body
    assert p.encode(p.LoadPlan(2, 6, 1, 1, 1, 3, 0.5, 1.0, 2.0), 9)[12:] == struct.pack("<6I3d", 2, 6, 1, 1, 1, 3, 0.5, 1.0, 2.0)
    for value in (float("nan"), -0.0, -1e-300, 1e308, float("inf"), p.MAX_RECOMPUTE_S * 1.0001):
        bad = struct.pack("<IdQ", 3, value, 1) + struct.pack("<I", 0)
        with pytest.raises(p.ProtocolError, match="not a duration"):
            p.decode(p.Frame(p.PlanLoads.TYPE, 1, bad))
        with pytest.raises(ValueError):
            p.encode(p.PlanLoads(3, value, 1, []))
    for value in (0.0, 5e-324, p.MAX_RECOMPUTE_S):
        good = struct.pack("<IdQ", 3, value, 1) + struct.pack("<I", 0)
        assert p.decode(p.Frame(p.PlanLoads.TYPE, 1, good)).recompute_s == value
