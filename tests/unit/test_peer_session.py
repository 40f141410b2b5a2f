"""The peer session's rules shared by QUIC and the bulk lane (kvcached.peers.session), no sockets."""

from __future__ import annotations

import pytest

from kvcached.peers import protocol as p
from kvcached.peers import stream as st
from kvcached.peers.session import PullAnswers, PullSink, RequestIds, SendRoom, take_request

DIGEST = bytes(range(32))


def frame_of(message: p.Message, request_id: int = 7) -> p.Frame:
    decoder = st.FrameDecoder()
    decoder.feed(p.encode(message, request_id))
    item = next(decoder)
    assert isinstance(item, p.Frame)
    return item


@pytest.mark.parametrize(("message", "early", "carries", "code"), [
    (p.Pull([(DIGEST, 0)]), True, p.REQUESTS, None),                   # idempotent: taken as early data
    (p.LaneOpen(), True, p.REQUESTS, p.ErrorCode.EARLY_DATA),           # changes state: not as early data
    (p.Announce([(DIGEST, 0)]), True, p.REQUESTS, p.ErrorCode.EARLY_DATA),
    (p.LaneOpen(), False, p.REQUESTS, None),
    (p.Miss(DIGEST, 0, 1), False, p.REQUESTS, p.ErrorCode.UNEXPECTED),  # an answer sent as a request
    (p.Exists(0, [DIGEST]), False, frozenset({p.Pull.TYPE}), p.ErrorCode.UNEXPECTED),   # not carried here
])
def test_take_request(message: p.Message, early: bool, carries: frozenset[int], code: p.ErrorCode | None) -> None:
    frame = frame_of(message)
    if code is None:
        assert take_request(frame, early=early, carries=carries) == message
    else:
        with pytest.raises(p.ProtocolError) as err:
            take_request(frame, early=early, carries=carries, where="a lane")
        assert err.value.code == code and err.value.request_id == 7 and not err.value.fatal


def test_take_request_refuses_a_body_that_does_not_parse() -> None:
    with pytest.raises(p.ProtocolError) as err:
        take_request(p.Frame(p.Pull.TYPE, 3, b"\x01"))
    assert err.value.code == p.ErrorCode.MALFORMED and err.value.request_id == 3


def test_request_ids_count_from_1_and_skip_0_when_they_wrap() -> None:
    ids = RequestIds()
    assert [ids.next(), ids.next()] == [1, 2]
    ids._next = 0xFFFFFFFF
    assert [ids.next(), ids.next()] == [0xFFFFFFFF, 1]


class Buffers(PullSink):
    def __init__(self) -> None:
        self.got: dict[bytes, bytearray] = {}
        self.misses: list[p.Miss] = []

    def slot(self, block: p.Block) -> memoryview:
        self.got[block.digest] = bytearray(block.payload_length)
        return memoryview(self.got[block.digest])

    def arrived(self, block: p.Block) -> None:
        assert block.verify(self.got[block.digest])

    def missed(self, miss: p.Miss) -> None:
        self.misses.append(miss)


def answers_to(data: bytes, request_id: int = 5, expected: int = 2) -> tuple[PullAnswers, Buffers]:
    decoder, sink = st.FrameDecoder(), Buffers()
    answers = PullAnswers("node-a", decoder, sink, request_id=request_id, expected=expected)
    decoder.feed(data)
    for item in decoder:
        answers.take(item)
    return answers, sink


def test_pull_answers_take_blocks_and_misses_until_complete() -> None:
    payload = b"kv" * 100
    data = p.encode(p.Block.of(DIGEST, 0, "m", payload), 5) + payload + p.encode(p.Miss(DIGEST, 1, 1), 5)
    answers, sink = answers_to(data)
    assert answers.complete and bytes(sink.got[DIGEST]) == payload and len(sink.misses) == 1


def test_pull_answers_take_a_run_of_blocks_into_their_slots() -> None:
    other = bytes(range(1, 33))
    first, second = b"kv" * 100, b"vk" * 50
    heads = [p.Block.of(DIGEST, 0, "m", first), p.Block.of(other, 0, "m", second)]
    data = p.encode(p.Miss(DIGEST, 1, 1), 5) + p.encode(p.Blocks(heads), 5) + first + second
    answers, sink = answers_to(data, expected=3)
    assert answers.complete and bytes(sink.got[DIGEST]) == first and bytes(sink.got[other]) == second
    assert len(sink.misses) == 1


def test_a_run_with_a_payload_the_sink_skips_still_lands_the_others() -> None:
    """A sink may refuse a slot (no room, asked already): that payload is read past and dropped,
    the blocks after it in the same run still land whole."""
    other = bytes(range(1, 33))
    first, again, second = b"kv" * 100, b"xx" * 100, b"vk" * 50
    heads = [p.Block.of(DIGEST, 0, "m", first), p.Block.of(DIGEST, 0, "m", again), p.Block.of(other, 0, "m", second)]

    class Once(Buffers):
        def slot(self, block: p.Block) -> memoryview | None:      # type: ignore[override]
            return None if block.digest in self.got else super().slot(block)

    decoder, sink = st.FrameDecoder(), Once()
    answers = PullAnswers("node-a", decoder, sink, request_id=5, expected=3)
    decoder.feed(p.encode(p.Blocks(heads), 5) + first + again + second)
    for item in decoder:
        answers.take(item)
    assert answers.complete and bytes(sink.got[DIGEST]) == first and bytes(sink.got[other]) == second


@pytest.mark.parametrize("case", ["another request", "more than the answer", "more than the answer, in a run"])
def test_pull_answers_refuse_what_does_not_answer_this_pull(case: str) -> None:
    miss = p.encode(p.Miss(DIGEST, 0, 1), 5)
    payload = b"kv" * 10
    run = p.encode(p.Blocks([p.Block.of(DIGEST, 0, "m", payload)] * 3), 5) + payload * 3
    data = {"another request": p.encode(p.Miss(DIGEST, 0, 1), 6), "more than the answer": miss * 3,
            "more than the answer, in a run": run}[case]
    with pytest.raises(p.ProtocolError, match=case.split(",")[0]):
        answers_to(data)


def test_an_error_about_the_whole_stream_is_taken_as_the_answer() -> None:
    with pytest.raises(p.ProtocolError, match="bad header") as err:
        answers_to(p.encode(p.Error(p.ErrorCode.MALFORMED, "bad header"), 0))
    assert err.value.code == p.ErrorCode.MALFORMED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_send_room_lets_a_piece_go_when_it_fits_or_nothing_waits() -> None:
    room = SendRoom(100, 30.0, Clock())
    assert room.fits(0, 500) and room.peak == 500      # larger than the whole queue, but nothing waits: it goes
    assert not room.fits(500, 1)
    assert room.fits(40, 60) and not room.fits(100, 1) and room.peak == 500


def test_send_room_gives_up_a_queue_that_did_not_go_down_for_stall_s() -> None:
    clock = Clock()
    room = SendRoom(100, 30.0, clock)
    assert room.fits(0, 80) and not room.fits(80, 40)
    clock.now += 20
    assert not room.moved(80) and not room.stalled() and room.wait_s() == 10.0
    clock.now += 10
    assert room.stalled() and room.wait_s() == 0.0
    assert room.moved(79) and not room.stalled() and room.wait_s() == 30.0     # the peer took a byte
    clock.now += 29
    room.moved(90)                                    # queued more (another answer): no progress
    clock.now += 1
    assert room.stalled()
    room.moved(0)                                     # all gone: nothing waits, nothing is stalled
    clock.now += 60
    assert not room.stalled()
