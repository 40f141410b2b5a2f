"""A cluster CA and node certificates for the peer tier's mutual TLS (``kvcached certs``).

Every daemon of a cluster holds a certificate signed by one cluster CA; peers verify each
other's chain against that CA, the validity dates, and the name in the certificate against
their ``[quic] peers`` entry (docs/peers.md). This module makes such a CA and such certificates
with the ``cryptography`` package (already a dependency of aioquic), so a small cluster can be
set up on one machine in minutes, and checks a node certificate the way a peer will.

Keys are ECDSA P-256 (small, fast handshakes, supported by every TLS 1.3 stack). Node
certificates carry the node name as the subject CN and as a DNS subjectAltName (the name peers
check), any extra names or IP addresses asked for, and both serverAuth and clientAuth: a daemon
is the server of the pulls it answers and the client of the pulls it makes. Private keys are
written with mode 0600 and never overwritten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CertError", "ClusterFiles", "create_ca", "issue_node", "verify_node", "make_cluster", "certificate_names"]

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
CA_DAYS = 3650
NODE_DAYS = 825        # the longest life browsers accept for a leaf; rotate with `kvcached certs` again
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,61}[A-Za-z0-9])?$")
_SKEW = datetime.timedelta(minutes=5)   # not_before in the past: clocks of a cluster differ a little


class CertError(Exception):
    """A certificate problem, in one line (the CLI prints it)."""


@dataclass(frozen=True, slots=True)
class ClusterFiles:
    ca: Path
    ca_key: Path
    nodes: dict[str, tuple[Path, Path]]   # name -> (certificate, key)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never replacing a file: keys are not overwritten)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def check_name(name: str) -> None:
    if not _NAME.match(name):
        raise CertError(f"node name {name!r} must be a DNS label or name: letters, digits, '-' and '.', "
                        "at most 63 characters, starting and ending with a letter or digit")


def create_ca(directory: Path, name: str = "kvcached cluster CA", days: int = CA_DAYS) -> tuple[Path, Path]:
    """Create the cluster CA in ``directory`` (ca.pem, ca-key.pem). CertError if one is there."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise CertError(f"{directory} has a CA already ({CA_CERT}); remove it to make a new one "
                        "(every node certificate must then be issued again)")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_new(key_path, _key_pem(key), 0o600)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError:
        raise CertError(f"no cluster CA in {directory} (run `kvcached certs --dir {directory}` first)") from None
    except ValueError as exc:
        raise CertError(f"{directory}: the CA files cannot be read: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{directory / CA_KEY}: not an EC key made by kvcached certs")
    return cert, key


def issue_node(directory: Path, name: str, extra_names: Sequence[str] = (), days: int = NODE_DAYS, *,
               valid_from: datetime.datetime | None = None) -> tuple[Path, Path]:
    """Issue ``<name>.pem`` and ``<name>-key.pem`` in ``directory``, signed by its CA, valid for
    ``days`` from ``valid_from`` (default now; a past start gives an expired certificate, which
    tests of the refusal need)."""
    check_name(name)
    ca_cert, ca_key = _load_ca(directory)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    if cert_path.exists() or key_path.exists():
        raise CertError(f"{cert_path} exists already; remove {cert_path.name} and {key_path.name} to issue it again")
    sans: list[x509.GeneralName] = [x509.DNSName(name)]
    for extra in extra_names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            check_name(extra)
            sans.append(x509.DNSName(extra))
    key = ec.generate_private_key(ec.SECP256R1())
    now = valid_from or _now()
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_new(key_path, _key_pem(key), 0o600)
    _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def certificate_names(cert_path: str | Path) -> list[str]:
    """The DNS names a PEM certificate carries (its subjectAltName); [] if it cannot be read."""
    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return []
    return list(sans.get_values_for_type(x509.DNSName))


def verify_node(ca_pem: bytes, cert_pem: bytes, name: str, at: datetime.datetime | None = None) -> None:
    """Check a node certificate as a peer will: chain to the cluster CA, validity at ``at``
    (default now), and ``name`` among its DNS names. CertError says what is wrong."""
    from cryptography.x509 import verification

    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise CertError(f"not a PEM certificate: {exc}") from None
    store = verification.Store([ca])
    builder = verification.PolicyBuilder().store(store).time(at or _now())
    try:
        builder.build_server_verifier(x509.DNSName(name)).verify(cert, [])
    except verification.VerificationError as exc:
        raise CertError(f"certificate of {name!r} refused: {exc}") from None


def make_cluster(directory: Path, names: Sequence[str], extra_names: dict[str, list[str]] | None = None,
                 days: int = NODE_DAYS) -> tuple[ClusterFiles, list[str]]:
    """The CA (made if missing) and a certificate for each of ``names`` that has none yet.
    Returns the files and what was created, in words."""
    done: list[str] = []
    if not (directory / CA_CERT).exists():
        create_ca(directory)
        done.append(f"created the cluster CA {directory / CA_CERT}")
    nodes = {}
    for name in names:
        cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
        if not cert_path.exists():
            issue_node(directory, name, (extra_names or {}).get(name, ()), days)
            done.append(f"issued {cert_path} (key {key_path.name})")
        nodes[name] = (cert_path, key_path)
    return ClusterFiles(directory / CA_CERT, directory / CA_KEY, nodes), done
