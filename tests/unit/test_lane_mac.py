"""The mac lane's keys, handshake and seals (kvcached.peers.lane_mac), with the test vectors of
docs/peer-protocol.md, "The bulk lane"."""

from __future__ import annotations

import itertools

import pytest

from kvcached.peers import lane_mac as m
from kvcached.peers import protocol as p
from kvcached.peers import stream as st

KEY = bytes(range(32))
KEY_ID = bytes(range(0x40, 0x50))
CLIENT_NONCE = bytes(range(0x60, 0x70))
SERVER_NONCE = bytes(range(0x70, 0x80))
PULL = p.encode(p.Pull([(bytes(32), 0)], 1 << 20), 1)


def test_vectors() -> None:
    """The bytes docs/peer-protocol.md gives, so another implementation can check itself."""
    secrets = m.derive(KEY, KEY_ID, CLIENT_NONCE, SERVER_NONCE)
    assert secrets.server_proof.hex() == "767caaeafd2ed0f86996f9855b5a389b9d7c764ade2470b57c7d19b8aa49c62b"
    assert secrets.client_proof.hex() == "819225638dbabe7c2598a6427f0778903dd0cc70046bc9ac20f88f25da4f6f72"
    assert secrets.connection_key.hex() == "e421abaa03ddd35800fee843809fdb6e76f3721065a0bd2bc690b6808a8cbe10"
    assert m.ClientHandshake(KEY_ID, KEY, CLIENT_NONCE).hello.hex() == (
        "4b564c4d" "404142434445464748494a4b4c4d4e4f" "606162636465666768696a6b6c6d6e6f")
    seal = m.Sealer(secrets.connection_key, m.CLIENT_TO_SERVER).seal(PULL)
    assert seal.hex() == ("20000000" "01" "20" "0000" "00000000"
                          "1180832739216e8c5d6821a99b42b817843ed23756932178d029067c88c0c0aa")


def keys_with(random_bytes: list[bytes]) -> m.LaneKeys:
    it = iter(random_bytes)
    return m.LaneKeys(random=lambda n: next(it)[:n])


def test_a_handshake_proves_the_key_both_ways_and_gives_both_sides_one_connection_key() -> None:
    keys = keys_with([KEY_ID, KEY])
    assert keys.grant("node-b", "session") == (KEY_ID, KEY)
    client, server = m.ClientHandshake(KEY_ID, KEY, CLIENT_NONCE), m.ServerHandshake(keys, SERVER_NONCE)
    challenge = server.hello(client.hello)
    proof, client_secrets = client.challenge(challenge)
    peer, server_secrets = server.proof(proof)
    assert peer == "node-b" and client_secrets == server_secrets and server.key_id == KEY_ID


@pytest.mark.parametrize("case", ["unknown id", "wrong magic", "revoked"])
def test_a_server_answers_no_hello_it_cannot_check(case: str) -> None:
    keys = keys_with([KEY_ID, KEY])
    keys.grant("node-b", "session")
    hello = m.ClientHandshake(KEY_ID, KEY, CLIENT_NONCE).hello
    if case == "unknown id":
        hello = m.ClientHandshake(b"\x09" * 16, KEY, CLIENT_NONCE).hello
    elif case == "wrong magic":
        hello = b"KVLX" + hello[4:]
    else:
        keys.revoke("session")
    with pytest.raises(m.MacRefused):
        m.ServerHandshake(keys).hello(hello)


def test_a_wrong_key_fails_the_proof_on_either_side() -> None:
    keys = keys_with([KEY_ID, KEY])
    keys.grant("node-b", "session")
    impostor = m.ClientHandshake(KEY_ID, b"\x00" * 32, CLIENT_NONCE)
    server = m.ServerHandshake(keys, SERVER_NONCE)
    challenge = server.hello(impostor.hello)
    with pytest.raises(m.MacRefused):                 # the client sees the server proved another key
        impostor.challenge(challenge)
    with pytest.raises(m.MacRefused):                 # and the server refuses a proof made without the key
        server.proof(m.derive(b"\x00" * 32, KEY_ID, CLIENT_NONCE, SERVER_NONCE).client_proof)


def frames(data: bytes) -> list[st.Event]:
    decoder = st.FrameDecoder()
    decoder.feed(data)
    return list(decoder)


def test_sealed_frames_open_in_order_and_nothing_else_does() -> None:
    key = m.derive(KEY, KEY_ID, CLIENT_NONCE, SERVER_NONCE).connection_key
    sealer = m.Sealer(key, m.SERVER_TO_CLIENT)
    head = p.Block.of(bytes(32), 0, "m", b"payload!")
    first, second = p.encode(head, 1), p.encode(p.Miss(bytes(32), 0, 1), 1)
    stream = sealer.seal(first) + first + b"payload!" + sealer.seal(second) + second
    opener = m.Opener(key, m.SERVER_TO_CLIENT)
    taken = [item for item in frames(stream) if not opener.take(item)]
    assert [type(item).__name__ for item in taken] == ["BlockHeader", "PayloadChunk", "BlockEnd", "Frame"]

    events = frames(stream)
    cases = {
        "no seal": events[1:],
        "reordered": events[4:] + events[:4],                       # the second frame first
        "other direction": None,
        "two seals": [events[0]] + events,
    }
    for case, items in cases.items():
        opener = m.Opener(key, m.CLIENT_TO_SERVER if case == "other direction" else m.SERVER_TO_CLIENT)
        with pytest.raises(m.MacRefused):
            for item in items if items is not None else events:
                opener.take(item)


def test_a_changed_head_fails_its_seal() -> None:
    key = m.derive(KEY, KEY_ID, CLIENT_NONCE, SERVER_NONCE).connection_key
    frame = p.encode(p.Block.of(bytes(32), 0, "m", b"payload!"), 1)
    seal = m.Sealer(key, m.SERVER_TO_CLIENT).seal(frame)
    for at in range(len(frame)):
        changed = bytearray(frame)
        changed[at] ^= 0x01
        opener = m.Opener(key, m.SERVER_TO_CLIENT)
        try:
            taken = [item for item in frames(seal + bytes(changed) + b"payload!") if not opener.take(item)]
        except (m.MacRefused, p.ProtocolError):       # the seal, or the framing itself
            continue
        # a longer length in the header: the frame is not whole yet, and nothing was taken
        assert not any(isinstance(item, (p.Frame, st.BlockHeader)) for item in taken), at


def test_lane_keys_are_bounded_per_session_and_in_all() -> None:
    counter = itertools.count()
    keys = m.LaneKeys(per_owner=2, limit=3, random=lambda n: next(counter).to_bytes(n, "big"))
    a1, a2, a3 = (keys.grant("node-b", "a")[0] for _ in range(3))
    assert keys.get(a1) is None and keys.get(a2) is not None and keys.get(a3) is not None   # per session
    b1 = keys.grant("node-c", "b")[0]
    b2 = keys.grant("node-c", "b")[0]                                  # the limit: the oldest grant goes
    assert keys.get(a2) is None and len(keys) == 3 and keys.get(b2) is not None and keys.get(b2)[0] == "node-c"
    keys.revoke("b")
    assert keys.get(b1) is None and keys.get(b2) is None and len(keys) == 1
    keys.revoke("nobody")
