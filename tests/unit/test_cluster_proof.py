"""Registrations that prove themselves (kvcached/cluster/proof.py): real certificates from
``kvcached certs``' code, every way a registration can fail to prove itself, and the view that
keeps only those that do."""

from __future__ import annotations

import base64
import datetime
import json
from pathlib import Path

import pytest

from kvcached.cluster.member import Member, MemberError, member_fields, member_key
from kvcached.cluster.proof import RegistrationSigner, RegistrationVerifier, signed_bytes
from kvcached.cluster.view import MembershipView
from tests.certificates import Registrar, expired_certificate

PREFIX = "/kvcached"
LEASE = 7587881226395124745
A = Member("node-a", "10.0.0.5", 7400, 7401, 1 << 36, "0.1.0")


@pytest.fixture(scope="module")
def registrar(tmp_path_factory: pytest.TempPathFactory) -> Registrar:
    return Registrar(tmp_path_factory.mktemp("cluster"))


def key_of(member: Member) -> str:
    return member_key(PREFIX, member.name)


def test_a_signed_registration_proves_itself_and_says_until_when(registrar: Registrar) -> None:
    value = registrar.value(A, PREFIX, LEASE)
    proven = registrar.verifier().verify(key_of(A), "node-a", value, LEASE)
    assert proven.member == A
    assert proven.valid_until > datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=30)
    doc = json.loads(value)
    assert doc["v"] == 2 and doc["lease"] == LEASE and doc["cert"].startswith("-----BEGIN CERTIFICATE-----")


def _resigned(registrar: Registrar, doc: dict[str, object], signer_name: str = "node-a") -> bytes:
    """``doc`` signed again by ``signer_name``'s key (its certificate is whatever doc carries)."""
    signer = registrar.signer(signer_name)
    raw = signer._sign(signed_bytes(key_of(A), doc))        # noqa: SLF001  (a test forging on purpose)
    return json.dumps({**doc, "sig": base64.b64encode(raw).decode()}).encode()


def test_every_way_of_not_proving_a_registration_is_refused_with_its_reason(registrar: Registrar,
                                                                          tmp_path: Path) -> None:
    verifier = registrar.verifier()
    good = json.loads(registrar.value(A, PREFIX, LEASE))
    other = Registrar(tmp_path / "other")                      # another cluster's CA
    expired_cert, expired_key = expired_certificate(registrar.directory, tmp_path / "expired", "node-a")
    expired = RegistrationSigner(expired_cert.read_bytes(), expired_key.read_bytes())
    cases = {
        "unsigned (format 1)": (json.dumps({**member_fields(A), "v": 1}).encode(), LEASE, "format 1"),
        "unsigned (format 2)": (json.dumps(member_fields(A)).encode(), LEASE, "lease"),
        "no lease in etcd": (registrar.value(A, PREFIX, LEASE), 0, "no lease"),
        "another lease in etcd": (registrar.value(A, PREFIX, LEASE), LEASE + 1, "lease"),
        "no certificate": (json.dumps({k: v for k, v in good.items() if k != "cert"}).encode(), LEASE, "no certificate"),
        "a changed host": (json.dumps({**good, "host": "10.6.6.6"}).encode(), LEASE, "signature does not match"),
        "a changed lease": (json.dumps({**good, "lease": LEASE + 1}).encode(), LEASE + 1, "signature does not match"),
        "moved to another prefix": (registrar.value(A, "/other", LEASE), LEASE, "signature does not match"),
        "garbage signature": (json.dumps({**good, "sig": "!!"}).encode(), LEASE, "signature does not match"),
        "another member's certificate and key": (
            _resigned(registrar, {**good, "cert": registrar.signer("node-b").cert_pem}, "node-b"), LEASE, "certificate"),
        "another CA": (other.value(A, PREFIX, LEASE), LEASE, "certificate"),
        "an expired certificate": (expired.value(A, key_of(A), LEASE), LEASE, "certificate"),
        "not PEM": (json.dumps({**good, "cert": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"}).encode(),
                    LEASE, "certificate"),
        "signed by a key not the certificate's": (_resigned(registrar, good, "node-c"), LEASE, "signature does not match"),
    }
    for case, (value, lease, why) in cases.items():
        try:
            verifier.verify(key_of(A), "node-a", value, lease)
        except MemberError as exc:
            assert why in str(exc), (case, str(exc))
        else:
            pytest.fail(f"{case}: proved itself")


def test_a_signer_refuses_a_key_that_is_not_its_certificates(registrar: Registrar) -> None:
    cert, _ = registrar.files("node-a")
    _, key_b = registrar.files("node-b")
    with pytest.raises(ValueError, match="does not belong"):
        RegistrationSigner(cert.read_bytes(), key_b.read_bytes())


def test_the_view_keeps_only_proven_members_and_drops_them_when_their_certificate_expires(registrar: Registrar) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    view = MembershipView(PREFIX, registrar.verifier())
    b = Member("node-b", "h2", 2, 2)
    change = view.reset([(key_of(A), registrar.value(A, PREFIX, 5), 5),
                         (key_of(b), json.dumps(member_fields(b)).encode(), 6)], revision=9)
    assert [m.name for m in change.joined] == ["node-a"] and view.refused == 1
    assert "not proven" in view.refusals[key_of(b)]
    assert not view.put(key_of(A), registrar.value(A, PREFIX, 5), 5, revision=10)      # the same: no change
    change = view.put(key_of(A), registrar.value(A, PREFIX, 5), 0, revision=11)        # copied without its lease
    assert [m.name for m in change.left] == ["node-a"] and view.refused == 2
    view.put(key_of(A), registrar.value(A, PREFIX, 7), 7, revision=12)
    assert view.names == {"node-a"}
    assert not view.expire(now)
    change = view.expire(now + datetime.timedelta(days=4000))                          # past its certificate
    assert [m.name for m in change.left] == ["node-a"] and not view.members and "expired" in view.refusals[key_of(A)]


def test_a_registration_is_checked_once_while_it_stays_the_same(registrar: Registrar) -> None:
    verifier = registrar.verifier()
    value = registrar.value(A, PREFIX, LEASE)
    first = verifier.verify(key_of(A), "node-a", value, LEASE)
    assert verifier.verify(key_of(A), "node-a", value, LEASE) is first
    with pytest.raises(MemberError):
        verifier.verify(key_of(A), "node-a", value, LEASE + 1)      # the cache is keyed by the lease too


def test_registrations_verify_against_the_clock_they_are_given(registrar: Registrar) -> None:
    late = RegistrationVerifier(registrar.ca_pem, clock=lambda: datetime.datetime(2200, 1, 1, tzinfo=datetime.timezone.utc))
    with pytest.raises(MemberError, match="certificate"):
        late.verify(key_of(A), "node-a", registrar.value(A, PREFIX, LEASE), LEASE)
