"""Blocks coded for the wire (issue 64, [quic] link_codec): the CodedPull and CodedBlocks
messages byte for byte, a coded answer taken by the session's rules, the puller's decode and
check, and the choice of form by what each delivered (kvcached.peers.link_coding). No sockets:
tests/integration/test_link_codec.py pulls coded over real lanes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvcached.codecs import codec_named
from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.fetch import _decoded
from kvcached.peers.link_coding import LinkCoding, link_coding
from kvcached.peers.session import PullAnswers, PullSink
from tests.unit.conftest import FakeClock

DIGEST = bytes(range(32))
OTHER = bytes(range(1, 33))
PLANES = codec_named("planes-zstd")
assert PLANES is not None


def kv_like(seed: int, size: int) -> bytes:
    """``size`` bytes of bf16 values drawn as activations are (a normal distribution): what KV
    blocks hold, and what the byte-plane codec shrinks."""
    values = np.random.default_rng(seed).standard_normal(size // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def coded_head(digest: bytes, payload: bytes) -> tuple[p.Block, bytes]:
    coded = PLANES.encode(memoryview(payload), 0.05)
    assert coded is not None and len(coded) < len(payload)
    head = p.Block.of(digest, 0, "m", payload)
    return p.Block(head.digest, 0, "m", head.payload_length, head.checksum, PLANES.code, len(coded)), coded


# -- the messages ------------------------------------------------------------------------------

def test_a_coded_pull_is_its_codec_the_tenant_and_a_pulls_body() -> None:
    request = p.pull_of([(DIGEST, 3)], 1 << 20, "team-a", codec=PLANES.code)
    assert isinstance(request, p.CodedPull)
    body = p.encode(request, 9)[p.HEADER.size:]
    assert body == (bytes([PLANES.code]) + struct.pack("<H", 6) + b"team-a" + struct.pack("<Q", 1 << 20)
                    + struct.pack("<I", 1) + DIGEST + struct.pack("<I", 3))
    assert p.decode(p.Frame(p.CodedPull.TYPE, 9, body)) == request
    default = p.pull_of([(DIGEST, 3)], codec=PLANES.code)
    assert p.decode(p.Frame(p.CodedPull.TYPE, 1, p.encode(default)[p.HEADER.size:])) == default   # "": the default tenant
    assert request.part([(OTHER, 0)]) == p.CodedPull([(OTHER, 0)], 1 << 20, "team-a", PLANES.code)


def test_a_coded_pull_of_codec_0_is_refused() -> None:
    body = bytes([0]) + p.encode(p.Pull([(DIGEST, 0)]))[p.HEADER.size:]
    with pytest.raises(p.ProtocolError) as err:
        p.decode(p.Frame(p.CodedPull.TYPE, 1, b"\x00\x00\x00" + body[1:]))
    assert err.value.code == p.ErrorCode.MALFORMED
    with pytest.raises(ValueError):
        p.encode(p.CodedPull([(DIGEST, 0)], codec=0))


def test_coded_blocks_carry_each_heads_codec_and_wire_length_before_a_blocks_head() -> None:
    payload = kv_like(1, 8192)
    head, coded = coded_head(DIGEST, payload)
    raw = p.Block.of(OTHER, 0, "m", b"x" * 100)
    message = p.CodedBlocks([head, raw])
    body = p.encode(message, 4)[p.HEADER.size:]
    assert body[:4] == struct.pack("<I", 2)
    assert body[4:13] == struct.pack("<BQ", PLANES.code, len(coded)) and body[13:13 + 32] == DIGEST
    back = p.decode(p.Frame(p.CodedBlocks.TYPE, 4, body))
    assert isinstance(back, p.CodedBlocks) and list(back.heads) == [head, raw]
    assert back.heads[0].wire == len(coded) and back.heads[1].wire == 100 and back.heads[1].codec == 0


@pytest.mark.parametrize(("codec", "wire", "length"), [
    (PLANES.code, 101, 100),       # a coded payload longer than the block: never sent
    (PLANES.code, 0, 100),
    (0, 99, 100),                  # a raw payload is the block's length
])
def test_coded_blocks_refuse_wire_lengths_that_cannot_be(codec: int, wire: int, length: int) -> None:
    head = p.Block.of(DIGEST, 0, "m", b"y" * length)
    body = struct.pack("<I", 1) + struct.pack("<BQ", codec, wire) + head.encode_body()
    with pytest.raises(p.ProtocolError) as err:
        p.decode(p.Frame(p.CodedBlocks.TYPE, 1, body))
    assert err.value.code == p.ErrorCode.MALFORMED
    decoder = st.FrameDecoder()                   # on a stream the payloads' lengths are lost: fatal
    decoder.feed(p.HEADER.pack(len(body), p.VERSION, p.CodedBlocks.TYPE, 0, 1) + body)
    with pytest.raises(p.ProtocolError) as err:
        next(decoder)
    assert err.value.fatal


# -- the session's rules -------------------------------------------------------------------------

class Slots(PullSink):
    """Slots of the block's length; coded payloads decoded by the puller's own worker function."""

    def __init__(self) -> None:
        self.slots: dict[bytes, bytearray] = {}
        self.good: dict[bytes, bool] = {}

    def slot(self, block: p.Block) -> memoryview:
        self.slots[block.digest] = bytearray(block.payload_length)
        return memoryview(self.slots[block.digest])

    def arrived(self, block: p.Block) -> None:
        self.good[block.digest] = block.verify(self.slots[block.digest])

    def arrived_coded(self, block: p.Block, coded: memoryview) -> None:
        self.good[block.digest] = _decoded(block, coded, memoryview(self.slots[block.digest]))

    def missed(self, miss: p.Miss) -> None:
        pass


def take_all(data: bytes, codec: int, sink: PullSink, expected: int = 2) -> PullAnswers:
    decoder = st.FrameDecoder()
    answers = PullAnswers("node-a", decoder, sink, request_id=5, expected=expected, codec=codec)
    decoder.feed(data)
    for item in decoder:
        answers.take(item)
    return answers


def test_a_coded_answer_lands_decoded_and_checked_beside_a_raw_one() -> None:
    payload, plain = kv_like(2, 16384), b"r" * 300
    head, coded = coded_head(DIGEST, payload)
    data = p.encode(p.CodedBlocks([head, p.Block.of(OTHER, 0, "m", plain)]), 5) + coded + plain
    sink = Slots()
    answers = take_all(data, PLANES.code, sink)
    assert answers.complete and sink.good == {DIGEST: True, OTHER: True}
    assert bytes(sink.slots[DIGEST]) == payload and bytes(sink.slots[OTHER]) == plain


def test_a_coded_payload_damaged_on_the_way_is_refused_not_served() -> None:
    payload = kv_like(3, 16384)
    head, coded = coded_head(DIGEST, payload)
    for at in (0, len(coded) // 2, len(coded) - 1):
        damaged = bytearray(coded)
        damaged[at] ^= 0x40
        sink = Slots()
        take_all(p.encode(p.CodedBlocks([head]), 5) + bytes(damaged), PLANES.code, sink, expected=1)
        assert sink.good == {DIGEST: False}
    unknown = p.Block(head.digest, 0, "m", head.payload_length, head.checksum, 250, head.wire_length)
    assert not _decoded(unknown, memoryview(coded), memoryview(bytearray(len(payload))))   # a codec not known here


def test_coded_answers_are_refused_where_none_were_asked_or_in_another_codec() -> None:
    payload = kv_like(4, 8192)
    head, coded = coded_head(DIGEST, payload)
    data = p.encode(p.CodedBlocks([head]), 5) + coded
    for codec in (0, PLANES.code + 1):
        with pytest.raises(p.ProtocolError) as err:
            take_all(data, codec, Slots(), expected=1)
        assert err.value.code == p.ErrorCode.UNEXPECTED


def test_a_sink_that_asked_for_nothing_coded_refuses_a_coded_payload() -> None:
    class Plain(PullSink):
        def slot(self, block: p.Block) -> memoryview:
            return memoryview(bytearray(block.payload_length))

        def arrived(self, block: p.Block) -> None:
            pass

        def missed(self, miss: p.Miss) -> None:
            pass

    head, coded = coded_head(DIGEST, kv_like(5, 8192))
    with pytest.raises(p.ProtocolError):
        take_all(p.encode(p.CodedBlocks([head]), 5) + coded, PLANES.code, Plain(), expected=1)


# -- the choice of form --------------------------------------------------------------------------

MIB = 1 << 20
PROBE = LinkCoding.PROBE_BYTES
N = PROBE // MIB                 # pulls of 1 MiB a probe takes


def pull(coding: LinkCoding, clock: FakeClock, rate: float, nbytes: int = MIB, peer: str = "b") -> bool:
    """One pull from ``peer`` in the form ``coding`` asks for, delivering at ``rate`` bytes/s;
    whether it was coded."""
    coded = bool(coding.codec_for(peer))
    on_wire = coding.started(peer, coded)
    clock.advance(nbytes / rate)
    coding.took(on_wire, nbytes)
    return coded


def test_a_window_measures_overlapping_pulls_together_and_idle_time_not_at_all() -> None:
    from kvcached.peers.link_coding import _Window

    window = _Window(keep=100 * MIB, most=100)
    window.add(0.0, 1.0, MIB)                  # two pulls in flight at once: one second of the link
    window.add(0.5, 1.0, MIB)
    window.add(5.0, 6.0, 2 * MIB)              # after four idle seconds
    assert window.rate() == pytest.approx(4 * MIB / 2.0)
    small = _Window(keep=2 * MIB, most=100)    # the oldest dropped once the rest hold ``keep``
    for i in range(4):
        small.add(float(i), i + 1.0, MIB)
    assert small.bytes == 2 * MIB and small.rate() == pytest.approx(MIB)
    short = _Window(keep=100 * MIB, most=3)    # ... or once there are ``most``
    for i in range(5):
        short.add(float(i), i + 1.0, MIB)
    assert len(short.pulls) == 3 and short.bytes == 3 * MIB


def test_auto_starts_raw_probes_the_codec_and_keeps_what_delivers_more() -> None:
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    forms = [pull(coding, clock, 110e6) for _ in range(N)]         # raw until it has moved PROBE_BYTES
    assert forms == [False] * N and not coding.coded_now("b")
    forms = [pull(coding, clock, 150e6) for _ in range(N)]         # then the probe: coded, 1.36x as fast
    assert forms == [True] * N and coding.coded_now("b")
    forms = [pull(coding, clock, 110e6) for _ in range(N)]         # the change confirmed: raw probed at once
    assert forms == [False] * N and coding.coded_now("b")
    assert all(pull(coding, clock, 150e6) for _ in range(2 * N))       # coded it stays within PROBE_S
    clock.advance(LinkCoding.PROBE_S)
    forms = [pull(coding, clock, 110e6) for _ in range(N)]         # raw probed again, still the slower
    assert forms == [False] * N and coding.coded_now("b")
    assert pull(coding, clock, 150e6)
    assert set(coding.rates("b")) == {"raw", "coded"} and coding.rates("nobody") == {}


def test_a_change_made_on_a_cold_start_is_undone_by_its_confirmation() -> None:
    """The first raw pulls ran on new connections (slow start): the codec's probe looks faster
    than raw is. Raw, probed again at once, shows it is not; raw is taken back, and that change
    is not confirmed in turn (the next probe is PROBE_S away)."""
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    for _ in range(N):
        pull(coding, clock, 0.2e9)                                   # raw, cold
    assert all(pull(coding, clock, 0.4e9) for _ in range(N))         # the probe: the codec, warm
    assert coding.coded_now("b")
    assert not any(pull(coding, clock, 1e9) for _ in range(N))       # the confirmation: raw, warm
    assert not coding.coded_now("b")
    assert not any(pull(coding, clock, 1e9) for _ in range(5 * N))      # settled: no probe within PROBE_S


def test_a_pull_that_shared_the_link_with_the_other_form_measures_neither() -> None:
    """When a probe starts, the last pulls of the form left are still on the wire: the first
    probe pulls share the link with them, and the probe would look slower than it is."""
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    for _ in range(N):
        pull(coding, clock, 100e6)
    raw_tail = coding.started("b", False)                            # still finishing as the probe starts
    assert coding.codec_for("b") == PLANES.code
    first = coding.started("b", True)
    clock.advance(0.02)
    coding.took(raw_tail, MIB)
    coding.took(first, MIB)                                          # shared: measures neither form
    assert coding.rates("b").get("coded") is None and coding.rates("b")["raw"] == pytest.approx(100e6)
    for _ in range(N):
        pull(coding, clock, 150e6)                                   # the probe's own pulls decide
    assert coding.coded_now("b")
    late = coding.started("b", True)
    clock.advance(0.001)                                             # 1 GB/s: were it counted, coded would move
    coding.took(late, MIB, coded=False)                              # pulled raw in the end (an older peer)
    assert coding.rates("b")["coded"] == pytest.approx(150e6)


def test_auto_stays_raw_where_the_link_is_faster_than_the_codec() -> None:
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    for _ in range(N):
        pull(coding, clock, 1e9)                                     # loopback
    assert all(pull(coding, clock, 0.4e9) for _ in range(N))         # the probe: the codec is the bottleneck
    assert not coding.coded_now("b")
    assert not any(pull(coding, clock, 1e9) for _ in range(5 * N))      # no probe again within PROBE_S
    clock.advance(LinkCoding.PROBE_S)
    assert pull(coding, clock, 0.4e9)                                # then one


def test_a_link_that_slows_down_is_followed_at_the_next_probe() -> None:
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    for _ in range(N):
        pull(coding, clock, 1e9)
    for _ in range(N):
        pull(coding, clock, 0.4e9)
    assert not coding.coded_now("b")
    clock.advance(LinkCoding.PROBE_S)
    for _ in range(2 * N):                                               # the link drops to 1 Gbit/s: raw at 0.11 GB/s
        pull(coding, clock, 0.11e9)
    assert not coding.coded_now("b")                                 # raw's window still holds the fast pulls
    clock.advance(LinkCoding.PROBE_S)
    for _ in range(4 * N):
        pull(coding, clock, 0.11e9)                                  # ... until they leave it
    clock.advance(LinkCoding.PROBE_S)
    assert all(pull(coding, clock, 0.16e9) for _ in range(N))        # the probe: coded, 1.45x
    assert coding.coded_now("b")


def test_a_change_of_rate_the_form_taken_shows_is_probed_at_once() -> None:
    """The throttle lifts while pulls are coded: coded pulls get 2.7x faster (the codec is now
    the bottleneck). Raw is probed at the next pull, not PROBE_S later, and taken back."""
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    for _ in range(N):
        pull(coding, clock, 110e6)                                   # 1 Gbit/s, raw
    for _ in range(N):
        pull(coding, clock, 160e6)                                   # the probe: coded pays
    for _ in range(N):
        pull(coding, clock, 110e6)                                   # the confirmation: raw still slower
    assert coding.coded_now("b")
    for _ in range(N):
        assert pull(coding, clock, 160e6)                            # coded, steady: no change
    forms = [pull(coding, clock, 440e6) for _ in range(N)]          # the throttle lifts: 2.75x
    assert all(forms)                                                # within CHANGE_GAP_S of the last probe: not yet
    clock.advance(LinkCoding.CHANGE_GAP_S)
    assert coding.codec_for("b") == 0                                # then raw probed, not PROBE_S later
    for _ in range(N):
        pull(coding, clock, 1e9)
    assert not coding.coded_now("b")


def test_near_equal_forms_do_not_flap_and_a_probe_that_moves_nothing_changes_nothing() -> None:
    clock = FakeClock()
    coding = LinkCoding(PLANES.code, clock)
    for _ in range(N):
        pull(coding, clock, 100e6)
    for _ in range(N):
        pull(coding, clock, 105e6)                                   # 5% better: not BETTER
    assert not coding.coded_now("b")
    clock.advance(LinkCoding.PROBE_S)
    assert coding.codec_for("b") == PLANES.code                      # a probe starts; no pull ever ends
    clock.advance(LinkCoding.PROBE_MAX_S + 1)
    assert coding.codec_for("b") == 0 and not coding.coded_now("b")  # judged on nothing: the form taken stays


def test_none_never_codes_and_a_named_codec_always_does() -> None:
    clock = FakeClock()
    never, always = link_coding("none", clock), link_coding("planes-zstd", clock)
    always.took(always.started("b", True), 4 * MIB)
    assert never.codec_for("b") == 0 and always.codec_for("b") == PLANES.code and always.coded_now("b")
    assert link_coding("auto", clock).codec == PLANES.code
    with pytest.raises(KeyError):
        link_coding("lz-nothing", clock)
