"""Replay answered within a bound (kvcached.events.replay), without I/O and with the clock
passed in: requests refused or answered as docs/events.md says, an answer paced by its client's
queue and cut once it stalls, and an upper bound of what clients may hold that follows every
message queued, every batch the log drops while clients hold it, and every reset."""

from __future__ import annotations

import pytest

from kvcached.events.replay import CONNECTION_BYTES, MESSAGE_BYTES, ReplayAnswers
from kvcached.events.stream import END_SEQ, EventLog, EventNaming, clear_event

BATCH = clear_event(EventNaming(), None)


def log_with(n: int, first: int = 0, max_batches: int = 1000) -> EventLog:
    log = EventLog(first, max_batches=max_batches, max_bytes=1 << 30)
    for _ in range(n):
        log.add("t", [BATCH], 1.0)
    return log


def drain(answers: ReplayAnswers, identity: bytes, now: float = 0.0) -> list[int]:
    """Every message of ``identity``'s answer, as a client that reads at once gets them."""
    answer = next(a for a in answers.due(now) if a.identity == identity)
    seqs = []
    while True:
        seq, frames = answers.next_message(answer)
        answers.sent(answer, seq, now)
        seqs.append(seq)
        if seq < 0:
            assert frames[1] == END_SEQ
            return seqs


def seq(n: int) -> list[bytes]:
    return [n.to_bytes(8, "big", signed=True)]


@pytest.mark.parametrize("request_, says", [
    ([b"abc"], "malformed"), ([b"12345678", b"x"], "malformed"), ([], "malformed"),
    (seq(-1), "does not exist"), (seq(-(1 << 63)), "does not exist"), (seq(99), "not published yet"),
])
def test_bad_requests_are_refused_at_once_and_serve_nothing(request_: list[bytes], says: str) -> None:
    answers = ReplayAnswers(log_with(5))
    refusal = answers.ask(b"c", request_, 0.0)
    assert refusal is not None and refusal[1] == END_SEQ and says in refusal[2].decode()
    assert answers.under_way == 0 and answers.counts.refused == 1 and answers.counts.cut == 0


def test_an_answer_is_every_kept_batch_from_the_one_asked_then_the_end_marker() -> None:
    answers = ReplayAnswers(log_with(5))
    assert answers.ask(b"c", seq(2), 0.0) is None
    assert drain(answers, b"c") == [2, 3, 4, -1]
    assert answers.under_way == 0 and answers.counts.refused == 0 and answers.counts.cut == 0
    assert answers.ask(b"c", seq(5), 0.0) is None and drain(answers, b"c") == [-1], "from the next: nothing, whole"


def test_an_answer_from_before_the_oldest_kept_starts_there_and_says_so() -> None:
    log = log_with(6, max_batches=3)                     # keeps 3, 4, 5
    answers = ReplayAnswers(log)
    assert answers.ask(b"c", seq(0), 0.0) is None
    answer = answers.due(0.0)[0]
    got = []
    while (m := answers.next_message(answer))[0] >= 0:
        got.append(m[0])
        answers.sent(answer, m[0], 0.0)
    assert got == [3, 4, 5] and b"no longer kept" in m[1][2]


def test_one_answer_per_client_at_a_time_and_a_bounded_number_under_way() -> None:
    answers = ReplayAnswers(log_with(3), max_answers=2)
    assert answers.ask(b"a", seq(0), 0.0) is None
    again = answers.ask(b"a", seq(0), 0.0)
    assert again is not None and b"still being sent" in again[2]
    assert answers.ask(b"b", seq(0), 0.0) is None
    busy = answers.ask(b"c", seq(0), 0.0)
    assert busy is not None and b"ask again" in busy[2] and answers.under_way == 2


def test_a_client_that_stops_reading_is_retried_less_and_less_often_then_cut() -> None:
    answers = ReplayAnswers(log_with(10), stall_s=5.0)
    answers.ask(b"c", seq(0), 0.0)
    answer = answers.due(0.0)[0]
    answers.sent(answer, answers.next_message(answer)[0], 0.0)
    now, waits = 0.0, []
    while answers.under_way:
        due = answers.due(now)
        if due:
            answers.blocked(due[0], now)
            waits.append(due[0].backoff)
        now += 0.001
    assert waits == sorted(waits) and waits[-1] <= 0.5 and 4.9 < now < 5.6
    assert answers.counts.cut == 1


def test_a_batch_the_log_drops_under_an_answer_ends_it_saying_where_to_ask_again() -> None:
    log = log_with(3, max_batches=3)
    answers = ReplayAnswers(log)
    answers.ask(b"c", seq(0), 0.0)
    answer = answers.due(0.0)[0]
    for _ in range(4):
        log.add("t", [BATCH], 1.0)                       # 0..3 dropped before the client read them
    s, frames = answers.next_message(answer)
    assert s == -1 and b"ask again from 0" in frames[2]


def test_held_bytes_bound_what_clients_may_still_hold_and_a_reset_frees_it() -> None:
    log = log_with(200, max_batches=200)
    answers = ReplayAnswers(log, client_hwm=8)
    for fd in (7, 8, 9):
        answers.accepted(fd, "uid:1000")
    for client in (b"a", b"b"):                          # two clients that read nothing: each holds its last 10
        answers.ask(client, seq(0), 0.0)
        answer = answers.due(0.0)[-1]
        for _ in range(50):
            s, _ = answers.next_message(answer)
            answers.sent(answer, s, 0.0)
    assert answers.held_bytes == 3 * CONNECTION_BYTES + 2 * 10 * MESSAGE_BYTES + 2 * 512
    assert answers.stale_bytes == 0, "shared with the log: nothing extra while it keeps them"
    for _ in range(60):                                  # the log drops 0..59: both clients hold 40..49
        log.add("t", [BATCH], 1.0)
    one = len(log.add("t", [BATCH], 1.0)[0][2]) + 1      # a batch's bytes (payload and topic)
    assert answers.stale_bytes == 10 * one, "ten batches the log dropped, held by both clients, counted once"
    answers.reset()
    assert answers.held_bytes == 0 and answers.stale_bytes == 0 and answers.counts.resets == 1
    assert answers.counts.cut == 2


def test_connections_are_capped_in_all_and_per_peer_so_one_user_leaves_room_for_others() -> None:
    answers = ReplayAnswers(log_with(1), budget=8 << 20)
    assert answers.max_per_peer < answers.max_connections
    for fd in range(1000):                               # a stranger's thousand connections, accepted at once
        answers.accepted(fd, "uid:1001")
    answers.accepted(5000, "uid:0")                      # and the operator's router among them
    verdicts = [answers.admits("uid:1001") for _ in range(1000)]
    assert verdicts.count(True) == answers.max_per_peer, "the first of them, up to the peer's cap"
    assert answers.admits("uid:0"), "another user's router still gets in"
    assert answers.counts.refused_connections == 1000 - answers.max_per_peer
    for fd in range(answers.max_per_peer, 1000):         # the refused ones are closed
        answers.disconnected(fd)
    assert answers.connections == answers.max_per_peer + 1
    answers.accepted(5001, "uid:1001")
    assert not answers.admits("uid:1001"), "still at the peer's cap"
    answers.disconnected(0)
    answers.accepted(5002, "uid:1001")
    answers.disconnected(5001)
    assert answers.admits("uid:1001"), "one left: room for one more"
    answers.accepted(5002, "uid:1002")                   # a descriptor reused before its end was seen
    for fd in [*range(1, answers.max_per_peer), 5000, 5002]:
        answers.disconnected(fd)
    assert answers.connections == 0 and answers.held_bytes == 0
    answers.accepted(7, "uid:1001")
    answers.disconnected(7)                              # gone before its handshake: no verdict left behind
    answers.accepted(8, "uid:1001")
    assert answers.admits("uid:1001")
