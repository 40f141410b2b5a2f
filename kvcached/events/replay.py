"""Replay requests answered from the event log within a fixed bound of memory, without I/O
(docs/events.md "Sequence numbers, replay, restarts"; kvcached.events.replay_server moves the
bytes). The clock is passed in.

The protocol is vLLM's ``ZmqEventPublisher``'s: a request is one frame, the first sequence
number wanted as 8 bytes big-endian; the answer is every batch kept from there, each as
``(topic, seq, payload)``, then the end marker ``(b"", -1 as 8 signed bytes, reason)``. vLLM's
reason is empty and its subscribers ignore it; kvcached says there why an answer is not whole
(a malformed request, a number not published or not kept, an answer cut short).

What replay clients can make the daemon hold is bounded here, because ZMQ does not bound it:
a ROUTER socket keeps every message queued to a client until the client reads it, and keeps
it after the client has gone, until the socket closes (libzmq 4.3, measured). So:

- **Shared, not copied.** Answers send the log's own batches (zero-copy, but for batches so
  small that sharing costs more): a client holding a batch costs its bytes only once the log
  has dropped it (*stale*).
- **A small queue per client.** The socket queues at most :data:`CLIENT_HWM` messages per
  client; an answer goes on as the client reads (:meth:`ReplayAnswers.due`, paced by the I/O
  layer) and is cut after :data:`STALL_S` without progress. One answer per client at a time.
- **A cap on connections** (:meth:`ReplayAnswers.admits`, asked at each connection's handshake):
  half the budget for connections and their queues, and an eighth of those for one peer (a
  uid on an ipc endpoint, whose credentials the kernel gives; an address on TCP), so one local
  user's thousand clients leave room for everyone else's.
- **An upper bound of what is held** (:attr:`ReplayAnswers.held_bytes`): per connection what
  libzmq keeps for it, per client its last ``CLIENT_HWM + 2`` messages (no more can still be
  queued in ZMQ: its pipe, the session and the engine's one message), and the stale batches
  among those. When the queues' half of the budget is passed, the I/O layer resets the
  endpoint, closing the socket, which frees all of it (:meth:`ReplayAnswers.reset`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from kvcached.events.stream import END_SEQ, EventLog

__all__ = ["CLIENT_HWM", "CONNECTION_BYTES", "COPY_BELOW", "MAX_ANSWERS", "MESSAGE_BYTES", "STALL_S", "Answer", "ReplayAnswers",
           "ReplayCounts", "end_marker"]

CLIENT_HWM = 16              # messages ZMQ queues to one replay client (the socket's SNDHWM)
STALL_S = 5.0                # an answer no send of which succeeded for this long is cut
MAX_ANSWERS = 4096           # answers under way; a request past them is told to ask again
MESSAGE_BYTES = 1024         # one queued message beside a shared payload (pyzmq and libzmq: ~660 B, measured),
                             # or with a copied one (payloads under COPY_BELOW bytes)
COPY_BELOW = 512             # smaller payloads are copied: sharing costs more than that
CONNECTION_BYTES = 32 << 10  # what libzmq keeps per connection (~28 KiB measured: its buffers, pipes)
ANSWER_BYTES = 512           # an answer under way, here
_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.005, 0.5


def end_marker(reason: str = "") -> tuple[bytes, bytes, bytes]:
    return (b"", END_SEQ, reason.encode())


@dataclass(slots=True)
class Answer:
    """One request being answered: the next batch to send, and why the answer will not be
    whole (``note``: said in its end marker)."""

    identity: bytes
    next_seq: int
    note: str
    last_progress: float
    retry_at: float = 0.0
    backoff: float = 0.0


@dataclass(slots=True)
class ReplayCounts:
    answered: int = 0        # requests answered (whole or not), refused ones included
    refused: int = 0         # malformed, or asking for numbers not published or not kept, or busy
    cut: int = 0             # answers cut short: the client stopped reading, or the endpoint was reset
    resets: int = 0          # times the endpoint was reset to free what clients held
    refused_connections: int = 0   # connections refused at their handshake: past the caps


class ReplayAnswers:
    """Replay requests and the answers under way, over ``log`` (see the module)."""

    def __init__(self, log: EventLog, *, budget: int = 64 << 20, client_hwm: int = CLIENT_HWM,
                 stall_s: float = STALL_S, max_answers: int = MAX_ANSWERS) -> None:
        self.log = log
        self.budget = budget
        self.client_hwm = client_hwm
        self.stall_s = stall_s
        self.max_answers = max_answers
        self.counts = ReplayCounts()
        per_connection = CONNECTION_BYTES + (client_hwm + 2) * MESSAGE_BYTES + ANSWER_BYTES
        self.max_connections = max(2, budget // (2 * per_connection))
        self.max_per_peer = max(1, self.max_connections // 8)
        self._peers: dict[int, tuple[str, bool]] = {}   # connection (its descriptor) -> its peer, admitted
        self._by_peer: dict[str, int] = {}        # peer -> connections admitted
        self._admitted = 0
        self._undecided: dict[str, deque[int]] = {}     # peer -> its connections waiting for their handshake
        self._answers: dict[bytes, Answer] = {}
        self._recent: dict[bytes, deque[int]] = {}   # per client, the seqs of its last messages (-1: a marker)
        self._recent_messages = 0
        self._pins: dict[int, int] = {}           # seq -> clients whose recent messages hold it
        self._stale: dict[int, int] = {}          # pinned seqs the log dropped -> their bytes
        self.stale_bytes = 0
        log.on_drop = self._dropped

    # -- requests ----------------------------------------------------------------------------

    def ask(self, identity: bytes, request: Sequence[bytes], now: float) -> tuple[bytes, bytes, bytes] | None:
        """A client's request (the frames after its identity and empty delimiter): None when an
        answer begins (its messages come from :meth:`next_message`), else the end marker to
        send at once, saying why nothing follows."""
        self.counts.answered += 1
        if len(request) != 1 or len(request[0]) != 8:
            return self._refuse(f"malformed replay request: {len(request)} frames of {[len(f) for f in request][:4]} "
                                "bytes; send one frame, the first sequence number wanted as 8 bytes big-endian")
        start = int.from_bytes(request[0], "big", signed=True)
        log = self.log
        if start < 0:
            return self._refuse(f"sequence number {start} does not exist (they start at 0)")
        if start > log.next_seq:
            return self._refuse(f"sequence number {start} is not published yet (the next is {log.next_seq})")
        if identity in self._answers:
            return self._refuse("an answer to this client is still being sent: read it first")
        if len(self._answers) >= self.max_answers:
            return self._refuse(f"{self.max_answers} replays are under way: ask again shortly")
        oldest = log.oldest_kept if log.oldest_kept is not None else log.next_seq
        note = ""
        if start < oldest:
            note = (f"batches {start}..{oldest - 1} are no longer kept (the oldest kept is {oldest}): "
                    "keep what you knew of this node and follow what comes next")
            start = oldest
        self._answers[identity] = Answer(identity, start, note, now)
        return None

    def _refuse(self, reason: str) -> tuple[bytes, bytes, bytes]:
        self.counts.refused += 1
        return end_marker(reason)

    # -- answers under way -------------------------------------------------------------------

    def due(self, now: float) -> list[Answer]:
        """The answers to go on with now (those that met a full queue wait a little longer
        each time)."""
        return [a for a in self._answers.values() if a.retry_at <= now]

    def next_message(self, answer: Answer) -> tuple[int, tuple[bytes, bytes, bytes]]:
        """(seq, frames) of the answer's next message: a kept batch, or (-1, the end marker)
        once it reached the newest batch, or when its next batch is no longer kept (the
        client read more slowly than batches were dropped: ask again)."""
        log = self.log
        if answer.next_seq >= log.next_seq:
            return -1, end_marker(answer.note)
        batch = log.batch(answer.next_seq)
        if batch is None:
            return -1, end_marker(f"batch {answer.next_seq} was dropped while this answer was sent (read faster): "
                                  f"ask again from {answer.next_seq}")
        topic, payload = batch
        return answer.next_seq, (topic, answer.next_seq.to_bytes(8, "big"), payload)

    def sent(self, answer: Answer, seq: int, now: float) -> None:
        """The answer's message ``seq`` (-1: its end marker, which ends it) is queued to its client."""
        self.queued(answer.identity, seq)
        answer.last_progress = now
        answer.backoff = answer.retry_at = 0.0
        if seq < 0:
            self._answers.pop(answer.identity, None)
        else:
            answer.next_seq = seq + 1

    def blocked(self, answer: Answer, now: float) -> None:
        """The client's queue is full: try again later, or cut the answer once it has stalled
        for :attr:`stall_s`."""
        if now - answer.last_progress >= self.stall_s:
            self.end(answer.identity)
            return
        answer.backoff = min(_BACKOFF_MAX_S, max(_BACKOFF_FIRST_S, 2 * answer.backoff))
        answer.retry_at = now + answer.backoff

    def end(self, identity: bytes) -> None:
        """The answer to ``identity`` stops here, cut short (it stalled, or the client left)."""
        if self._answers.pop(identity, None) is not None:
            self.counts.cut += 1

    @property
    def under_way(self) -> int:
        return len(self._answers)

    # -- connections -------------------------------------------------------------------------
    # Each connection is counted from its accept to its end, by its descriptor, and given its
    # place then: admitted while its peer and the endpoint are under their caps. Its handshake
    # comes later (a ZAP request naming the peer, not the descriptor): it takes the verdict of
    # the peer's oldest connection still waiting for one. Swapping two connections of one peer
    # changes nothing that is counted.

    def accepted(self, connection: int, peer: str) -> None:
        """A connection of ``peer`` (a uid, or an address) was accepted: counted until
        :meth:`disconnected`."""
        self.disconnected(connection)             # its descriptor reused: the event of its end was lost
        admitted = self._admitted < self.max_connections and self._by_peer.get(peer, 0) < self.max_per_peer
        if admitted:
            self._admitted += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        self._peers[connection] = (peer, admitted)
        self._undecided.setdefault(peer, deque()).append(connection)

    def disconnected(self, connection: int) -> None:
        entry = self._peers.pop(connection, None)
        if entry is None:
            return
        peer, admitted = entry
        if admitted:
            self._admitted -= 1
            left = self._by_peer[peer] - 1
            if left:
                self._by_peer[peer] = left
            else:
                del self._by_peer[peer]
        waiting = self._undecided.get(peer)
        if waiting is not None:
            if connection in waiting:
                waiting.remove(connection)
            if not waiting:
                del self._undecided[peer]

    def admits(self, peer: str) -> bool:
        """The verdict on a handshake of ``peer``'s (refused ones are told so and closed)."""
        waiting = self._undecided.get(peer)
        if waiting:
            ok = self._peers[waiting.popleft()][1]
            if not waiting:
                del self._undecided[peer]
        else:                                     # its accept not seen yet (never, in order)
            ok = self._admitted < self.max_connections and self._by_peer.get(peer, 0) < self.max_per_peer
        if not ok:
            self.counts.refused_connections += 1
        return ok

    @property
    def connections(self) -> int:
        return len(self._peers)

    # -- what clients hold -------------------------------------------------------------------

    def queued(self, identity: bytes, seq: int) -> None:
        """A message (batch ``seq``, or -1 for a marker) was queued to ``identity``: it may hold
        it until it reads it, or, gone, until the endpoint is reset."""
        recent = self._recent.get(identity)
        if recent is None:
            recent = self._recent[identity] = deque()
        recent.append(seq)
        self._recent_messages += 1
        if seq >= 0:
            self._pins[seq] = self._pins.get(seq, 0) + 1
        if len(recent) > self.client_hwm + 2:     # no more than these can still be queued in ZMQ
            self._unpin(recent.popleft())
            self._recent_messages -= 1

    def _unpin(self, seq: int) -> None:
        if seq < 0:
            return
        left = self._pins[seq] - 1
        if left:
            self._pins[seq] = left
            return
        del self._pins[seq]
        stale = self._stale.pop(seq, None)
        if stale is not None:
            self.stale_bytes -= stale

    def _dropped(self, seq: int, nbytes: int) -> None:
        """The log let batch ``seq`` go: clients that may still hold it keep its bytes alive."""
        if seq in self._pins:
            self._stale[seq] = nbytes
            self.stale_bytes += nbytes

    @property
    def queued_bytes(self) -> int:
        """What clients' queues and the answers under way may hold: past half the budget, the
        endpoint is reset (the connections' half is capped by :meth:`admits`)."""
        return self._recent_messages * MESSAGE_BYTES + len(self._answers) * ANSWER_BYTES + self.stale_bytes

    @property
    def over_budget(self) -> bool:
        return self.queued_bytes > self.budget // 2

    @property
    def held_bytes(self) -> int:
        """An upper bound of the memory replay clients make the daemon hold beyond the log's
        own batches (see the module): at most the budget once the connections counted have
        had their handshake (those refused there are closed at once)."""
        return self.connections * CONNECTION_BYTES + self.queued_bytes

    def reset(self) -> None:
        """The endpoint was reset (its socket closed): every client and what it held is gone."""
        self.counts.cut += len(self._answers)
        self.counts.resets += 1
        self._answers.clear()
        self._recent.clear()
        self._recent_messages = 0
        self._pins.clear()
        self._stale.clear()
        self.stale_bytes = 0
        self._peers.clear()
        self._by_peer.clear()
        self._undecided.clear()
        self._admitted = 0
