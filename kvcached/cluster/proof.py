"""Proof of membership: a registration signed by the member's own cluster key (sans-I/O).

etcd decides who is in the cluster, and anyone who can write its keys could otherwise add a
member: a well-formed registration whose certificate never verifies was placed like any other,
so it was a home for its share of blocks (their records went nowhere: misses) and every Locate
to it waited for the hedge (issue 37). Now a registration proves itself, so every daemon decides
the same membership from etcd alone, and only a holder of a cluster certificate can add one:

- it carries the member's certificate (PEM; a chain may follow the leaf), which must chain to the
  cluster CA, be valid now, allow serverAuth and name the member (the checks a peer dialling it
  makes: :meth:`kvcached.peers.tls.PeerAuth.check_server`);
- it carries the etcd lease it is attached to, which must be the lease etcd reports for the key
  (a copy written elsewhere, without a lease or under another, is refused: a registration ends
  with its lease and nobody can keep it alive by copying it);
- a signature by the certificate's key over all of that and the key it lies under (so it cannot
  be moved to another prefix, another cluster sharing the etcd):
  ``sig = Sign(key, "kvcached registration v2\\0" || etcd key || "\\0" || canonical JSON)``, the
  canonical JSON being every field but ``sig``, keys sorted, no spaces. ECDSA keys sign with
  SHA-256 (DER signature), Ed25519 keys as they are, RSA keys with PKCS#1 v1.5 and SHA-256.

What fails any of these is a :class:`~kvcached.cluster.member.MemberError` whose text says why;
the view counts it and leaves the registration out. The verifier keeps the last results, so an
unchanged registration is checked once, not at every listing.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections import OrderedDict
from typing import Any, Callable

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509 import verification

from kvcached.cluster.member import MAX_VALUE, Member, MemberError, member_fields

__all__ = ["RegistrationSigner", "RegistrationVerifier", "Proven", "signed_bytes"]

CONTEXT = b"kvcached registration v2\x00"
CACHED = 4096                # registrations whose check is remembered

Clock = Callable[[], datetime.datetime]


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def signed_bytes(key: str, doc: dict[str, Any]) -> bytes:
    """What the signature covers: the context, the etcd key and every field but ``sig``."""
    fields = {k: v for k, v in doc.items() if k != "sig"}
    return CONTEXT + key.encode() + b"\x00" + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


class RegistrationSigner:
    """Signs this daemon's registration with its cluster key (``quic.key``), its certificate
    (``quic.cert``) carried along. ValueError if the key does not belong to the certificate."""

    def __init__(self, cert_pem: bytes, key_pem: bytes) -> None:
        self.cert_pem = cert_pem.decode().strip() + "\n"
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        public = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if public != cert.public_key().public_bytes(serialization.Encoding.DER,
                                                    serialization.PublicFormat.SubjectPublicKeyInfo):
            raise ValueError("the private key does not belong to the certificate")
        self._key = key

    def value(self, member: Member, key: str, lease: int) -> bytes:
        """The registration of ``member`` to put under ``key`` on ``lease``."""
        doc: dict[str, Any] = {**member_fields(member), "lease": lease, "cert": self.cert_pem}
        doc["sig"] = base64.b64encode(self._sign(signed_bytes(key, doc))).decode()
        return json.dumps(doc, separators=(",", ":")).encode()

    def _sign(self, data: bytes) -> bytes:
        key = self._key
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key.sign(data, ec.ECDSA(hashes.SHA256()))
        if isinstance(key, ed25519.Ed25519PrivateKey):
            return key.sign(data)
        if isinstance(key, rsa.RSAPrivateKey):
            return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
        raise ValueError(f"a {type(key).__name__} cannot sign a registration (EC, Ed25519 or RSA keys)")


class Proven:
    """A registration that proved itself: the member, and until when its certificate is valid."""

    __slots__ = ("member", "valid_until")

    def __init__(self, member: Member, valid_until: datetime.datetime) -> None:
        self.member, self.valid_until = member, valid_until


class RegistrationVerifier:
    """Checks registrations against the cluster CA (module docstring); ``clock`` gives the time
    certificates must be valid at."""

    def __init__(self, ca_pem: bytes, clock: Clock = _utc_now) -> None:
        self._store = verification.Store([x509.load_pem_x509_certificate(ca_pem)])
        self.clock = clock
        self._checked: OrderedDict[tuple[str, bytes, int], Proven] = OrderedDict()

    def verify(self, key: str, name: str, value: bytes, lease: int) -> Proven:
        """The member registered under ``key`` (whose name is ``name``) with ``value``, attached
        to ``lease`` (0: none), if it proves itself; MemberError with the reason if not."""
        seen = (key, value, lease)
        proven = self._checked.get(seen)
        if proven is not None and proven.valid_until > self.clock():
            self._checked.move_to_end(seen)
            return proven
        proven = self._verify(key, name, value, lease)
        self._checked[seen] = proven
        while len(self._checked) > CACHED:
            self._checked.popitem(last=False)
        return proven

    def _verify(self, key: str, name: str, value: bytes, lease: int) -> Proven:
        if len(value) > MAX_VALUE:
            raise MemberError(f"registration of {name!r}: {len(value)} bytes, over {MAX_VALUE}")
        member = Member.decode(name, value)          # the member's own fields, checked
        doc = json.loads(value)
        if doc.get("lease") != lease or not lease:
            raise MemberError(f"registration of {name!r} is not proven: it names lease {doc.get('lease')!r}, "
                              f"etcd attaches it to {lease or 'no lease'}")
        chain = self._certificates(name, doc.get("cert"))
        try:
            path = (verification.PolicyBuilder().store(self._store).time(self.clock())
                    .build_server_verifier(x509.DNSName(name)).verify(chain[0], chain[1:]))
        except verification.VerificationError as exc:
            raise MemberError(f"registration of {name!r} is not proven: its certificate: {exc}") from None
        signature = doc.get("sig")
        try:
            raw = base64.b64decode(signature, validate=True) if isinstance(signature, str) else b""
        except ValueError:
            raw = b""
        if not raw or not _signed_by(chain[0], raw, signed_bytes(key, doc)):
            raise MemberError(f"registration of {name!r} is not proven: its signature does not match")
        valid_until = min(c.not_valid_after_utc for c in [chain[0], *path])
        return Proven(member, valid_until)

    @staticmethod
    def _certificates(name: str, pem: object) -> list[x509.Certificate]:
        if not isinstance(pem, str) or not pem:
            raise MemberError(f"registration of {name!r} is not proven: it carries no certificate")
        try:
            chain = x509.load_pem_x509_certificates(pem.encode())
        except ValueError as exc:
            raise MemberError(f"registration of {name!r}: its certificate is not PEM: {exc}") from None
        if not chain:
            raise MemberError(f"registration of {name!r} is not proven: it carries no certificate")
        return chain


def _signed_by(cert: x509.Certificate, signature: bytes, data: bytes) -> bool:
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except InvalidSignature:
        return False
    return True
