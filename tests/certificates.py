"""Certificates the tests need beyond what ``kvcached certs`` issues, made with the same code."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

from kvcached.cluster.member import Member, member_key
from kvcached.cluster.proof import RegistrationSigner, RegistrationVerifier
from kvcached.peers.certs import CA_CERT, CA_KEY, issue_node, make_cluster


def expired_certificate(ca_dir: Path, into: Path, name: str) -> tuple[Path, Path]:
    """A certificate for ``name`` signed by the CA in ``ca_dir``, valid for nine days from ten days
    ago: expired yesterday. Issued in ``into`` (a copy of the CA goes there with it)."""
    into.mkdir(parents=True, exist_ok=True)
    for file in (CA_CERT, CA_KEY):
        shutil.copyfile(ca_dir / file, into / file)
    ten_days_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    return issue_node(into, name, days=9, valid_from=ten_days_ago)


class Registrar:
    """Signed member registrations for tests: a cluster CA in ``directory`` and a certificate for
    each name asked for, made on first use (kvcached.cluster.proof)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca_pem = make_cluster(directory, [])[0].ca.read_bytes()

    def files(self, name: str) -> tuple[Path, Path]:
        """``name``'s certificate and key (issued by this CA if it has none yet)."""
        return make_cluster(self.directory, [name])[0].nodes[name]

    def signer(self, name: str) -> RegistrationSigner:
        cert, key = self.files(name)
        return RegistrationSigner(cert.read_bytes(), key.read_bytes())

    def verifier(self) -> RegistrationVerifier:
        return RegistrationVerifier(self.ca_pem)

    def value(self, member: Member, prefix: str, lease: int) -> bytes:
        """``member``'s registration under ``prefix``, signed by its own certificate for ``lease``."""
        return self.signer(member.name).value(member, member_key(prefix, member.name), lease)
