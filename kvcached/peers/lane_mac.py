"""The bulk lane's ``mac`` mode: its keys, handshake and frame seals (sans-I/O).

For fabrics the operator trusts not to be read, a lane may be plain TCP, with every byte that
matters authenticated instead of encrypted (integrity and authenticity, no confidentiality):

- **The key.** Over its QUIC connection to a peer (mutual TLS, kvcached.peers.quic) a daemon
  asks for a lane key (LaneOpen); the peer draws 32 random bytes and a 16-byte key id and answers
  them (LaneKey), encrypted by that connection. The key is known to the two endpoints of that
  QUIC session only and is revoked when the session ends: a lane is as strong as the session it
  came from. (A TLS exporter would give the same property without the round trip, but aioquic,
  the QUIC stack here, has no exporter API; reaching into its key schedule would tie the
  security of lanes to private code of one aioquic version.)
- **The handshake.** The client sends ``hello`` (magic, key id, client nonce); the server,
  which knows the key for that id, answers ``challenge`` (server nonce, server proof); the client
  checks the proof and sends its own. Proofs and the connection key are keyed BLAKE3 of the key
  id and both nonces: both sides prove the key without sending it, and every connection has its
  own key even under the same grant.
- **The seals.** Every frame on the lane, either way, is preceded by a Seal frame holding the
  keyed BLAKE3 (connection key) of a direction byte, the frame's sequence number in that
  direction and the frame's header and body. A Block's payload is bound through its head, which
  carries the payload's BLAKE3-256; the receiver checks that checksum before it commits the block
  (as on every transport), so a payload changed in flight is never committed. Sequence numbers
  stop replays and reordering within a connection; connection keys stop replays from another
  connection or session.

Nothing unauthenticated is accepted or answered: a server answers a hello only with a proof of
the key (a key id it never granted gets the connection closed, not an answer), serves requests
only after the client's proof, and a frame without its seal, or whose seal does not match, ends
the connection. Byte layouts: docs/peer-protocol.md, "The bulk lane".
"""

from __future__ import annotations

import hmac
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

from blake3 import blake3

from kvcached.peers import protocol as p
from kvcached.peers import stream as st

__all__ = ["KEY_BYTES", "KEY_ID_BYTES", "NONCE_BYTES", "TAG_BYTES", "HELLO", "CHALLENGE", "PROOF", "MAGIC",
           "CLIENT_TO_SERVER", "SERVER_TO_CLIENT", "MacRefused", "LaneSecrets", "derive", "LaneKeys",
           "ClientHandshake", "ServerHandshake", "Sealer", "Opener"]

KEY_BYTES, KEY_ID_BYTES, NONCE_BYTES, TAG_BYTES = 32, 16, 16, 32
MAGIC = b"KVLM"                                   # a mac lane, version 1
HELLO = struct.Struct("<4s16s16s")                # magic | key id | client nonce           (36 bytes)
CHALLENGE = struct.Struct("<16s32s")              # server nonce | server proof             (48 bytes)
PROOF = struct.Struct("<32s")                     # client proof                            (32 bytes)
CLIENT_TO_SERVER, SERVER_TO_CLIENT = 1, 2         # the direction byte in a seal
_SEQ = struct.Struct("<Q")
_LABEL_SERVER = b"kvcached lane v1 server proof"
_LABEL_CLIENT = b"kvcached lane v1 client proof"
_LABEL_CONNECTION = b"kvcached lane v1 connection key"


class MacRefused(Exception):
    """What the other side sent does not prove the key: a wrong magic or key id, a bad proof, a
    frame without its seal or with a seal that does not match. The connection ends."""


def _keyed(key: bytes, *parts: bytes) -> bytes:
    h = blake3(key=key)
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class LaneSecrets:
    """What both ends of one lane connection derive from the granted key and the two nonces."""

    server_proof: bytes
    client_proof: bytes
    connection_key: bytes


def derive(key: bytes, key_id: bytes, client_nonce: bytes, server_nonce: bytes) -> LaneSecrets:
    """Proofs and connection key: keyed BLAKE3 (the granted key) of a label, the key id and both nonces."""
    context = key_id + client_nonce + server_nonce
    return LaneSecrets(_keyed(key, _LABEL_SERVER, context), _keyed(key, _LABEL_CLIENT, context),
                       _keyed(key, _LABEL_CONNECTION, context))


class LaneKeys:
    """The lane keys a server granted, each bound to the QUIC connection (``owner``) that asked.

    At most ``per_owner`` keys per connection (a new grant past that drops its oldest) and
    ``limit`` in all (the oldest grant goes first). ``revoke(owner)`` when the connection ends:
    lanes opened with its keys are served no further request."""

    def __init__(self, *, per_owner: int = 4, limit: int = 4096,
                 random: Callable[[int], bytes] = os.urandom) -> None:
        self.per_owner, self.limit, self.random = per_owner, limit, random
        self._keys: OrderedDict[bytes, tuple[str, bytes, Hashable]] = OrderedDict()   # id -> (peer, key, owner)
        self._owned: dict[Hashable, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def grant(self, peer: str, owner: Hashable) -> tuple[bytes, bytes]:
        """A new (key id, key) for ``peer``, bound to ``owner``."""
        owned = self._owned.setdefault(owner, [])
        while len(owned) >= self.per_owner:
            self._keys.pop(owned.pop(0), None)
        while len(self._keys) >= self.limit:
            old_id, (_, _, old_owner) = self._keys.popitem(last=False)
            self._owned[old_owner].remove(old_id)
        key_id, key = self.random(KEY_ID_BYTES), self.random(KEY_BYTES)
        self._keys[key_id] = (peer, key, owner)
        owned.append(key_id)
        return key_id, key

    def get(self, key_id: bytes) -> tuple[str, bytes] | None:
        """(peer, key) of a live grant, or None (never granted, or revoked)."""
        entry = self._keys.get(key_id)
        return (entry[0], entry[1]) if entry is not None else None

    def revoke(self, owner: Hashable) -> None:
        """Forget every key granted to ``owner`` (its QUIC connection ended)."""
        for key_id in self._owned.pop(owner, []):
            self._keys.pop(key_id, None)


class ClientHandshake:
    """The client's side: send :attr:`hello`, give the server's challenge to :meth:`challenge`,
    send the proof it returns; then seal with the secrets."""

    def __init__(self, key_id: bytes, key: bytes, nonce: bytes | None = None) -> None:
        if len(key_id) != KEY_ID_BYTES or len(key) != KEY_BYTES:
            raise ValueError("a lane key id is 16 bytes and a key 32")
        self.key_id, self.key = key_id, key
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self.hello = HELLO.pack(MAGIC, key_id, self.nonce)

    def challenge(self, data: bytes) -> tuple[bytes, LaneSecrets]:
        """The proof to send and this connection's secrets. MacRefused if the server did not prove the key."""
        server_nonce, server_proof = CHALLENGE.unpack(data)
        secrets = derive(self.key, self.key_id, self.nonce, server_nonce)
        if not hmac.compare_digest(server_proof, secrets.server_proof):
            raise MacRefused("the peer did not prove the lane key (a stale key or not the peer)")
        return PROOF.pack(secrets.client_proof), secrets


class ServerHandshake:
    """The server's side: :meth:`hello` returns the challenge to send; :meth:`proof` returns the
    peer and the connection's secrets once the client proved the key."""

    def __init__(self, keys: LaneKeys, nonce: bytes | None = None) -> None:
        self.keys = keys
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self._pending: tuple[str, LaneSecrets] | None = None
        self.key_id = b""

    def hello(self, data: bytes) -> bytes:
        magic, key_id, client_nonce = HELLO.unpack(data)
        if magic != MAGIC:
            raise MacRefused(f"not a mac lane hello (magic {magic!r})")
        grant = self.keys.get(key_id)
        if grant is None:
            raise MacRefused("a lane key id this daemon did not grant, or revoked")
        peer, key = grant
        secrets = derive(key, key_id, client_nonce, self.nonce)
        self._pending, self.key_id = (peer, secrets), key_id
        return CHALLENGE.pack(self.nonce, secrets.server_proof)

    def proof(self, data: bytes) -> tuple[str, LaneSecrets]:
        if self._pending is None:
            raise RuntimeError("proof before hello")
        peer, secrets = self._pending
        (proof,) = PROOF.unpack(data)
        if not hmac.compare_digest(proof, secrets.client_proof):
            raise MacRefused("the client did not prove the lane key")
        return peer, secrets


def _frame_bytes(item: p.Frame | st.BlockHeader | st.BlocksHeader) -> bytes:
    """A frame's header and body as its sender wrote them (the header is canonical, and a Block
    head the decoder took encodes back to the bytes it came from)."""
    if isinstance(item, st.BlockHeader):
        return p.encode(item.block, item.request_id)
    return p.HEADER.pack(len(item.body), p.VERSION, item.type, 0, item.request_id) + item.body


class Sealer:
    """Seals the frames one side sends: :meth:`seal` gives the Seal frame to write before ``frame``."""

    def __init__(self, connection_key: bytes, direction: int) -> None:
        self.key, self.direction, self.sequence = connection_key, bytes([direction]), 0

    def tag(self, frame: bytes) -> bytes:
        tag = _keyed(self.key, self.direction, _SEQ.pack(self.sequence), frame)
        self.sequence += 1
        return tag

    def seal(self, frame: bytes) -> bytes:
        return p.encode(p.Seal(self.tag(frame)))


class Opener:
    """Checks the frames one side receives, in order, as the decoder hands them out.

    :meth:`take` returns True for a Seal (kept for the next frame, nothing for the caller), False
    for an event the caller handles (a frame whose seal matched, a payload chunk, a block's end).
    MacRefused for a frame without a seal, two seals in a row, or a seal that does not match."""

    def __init__(self, connection_key: bytes, direction: int) -> None:
        self._expected = Sealer(connection_key, direction)
        self._tag: bytes | None = None

    def take(self, item: st.Event) -> bool:
        if type(item) is st.BlockEnd or type(item) is st.PayloadChunk:
            return False                   # payload bytes: bound through their sealed head
        if isinstance(item, p.Frame) and item.type == p.Seal.TYPE:
            if self._tag is not None:
                raise MacRefused("two seals in a row")
            try:
                seal = p.decode(item)
            except p.ProtocolError as exc:
                raise MacRefused(f"a Seal frame that does not parse: {exc}") from None
            assert isinstance(seal, p.Seal)
            self._tag = seal.tag
            return True
        if isinstance(item, (p.Frame, st.BlockHeader, st.BlocksHeader)):
            tag, self._tag = self._tag, None
            if tag is None:
                raise MacRefused("a frame without a seal")
            if not hmac.compare_digest(tag, self._expected.tag(_frame_bytes(item))):
                raise MacRefused("a frame whose seal does not match (changed, replayed or out of order)")
        return False
