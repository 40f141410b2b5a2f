"""`kvcached certs`: a cluster CA and node certificates, checked as peers will check them, and
used for a real mutual-TLS handshake (Python's ssl over a socket pair)."""

from __future__ import annotations

import datetime
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509

from kvcached.cli import main
from kvcached.peers.certs import CertError, create_ca, issue_node, make_cluster, verify_node


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    make_cluster(directory, ["node-a", "node-b"], {"node-a": ["127.0.0.1", "a.example"]})
    return directory


def test_files_and_modes(cluster: Path) -> None:
    for name in ("ca-key.pem", "node-a-key.pem", "node-b-key.pem"):
        assert stat.S_IMODE((cluster / name).stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((cluster / "node-a.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["node-a", "a.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ca = x509.load_pem_x509_certificate((cluster / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_node_certificate_passes_as_its_own_name_only(cluster: Path) -> None:
    ca = (cluster / "ca.pem").read_bytes()
    verify_node(ca, (cluster / "node-a.pem").read_bytes(), "node-a")
    verify_node(ca, (cluster / "node-a.pem").read_bytes(), "a.example")
    with pytest.raises(CertError, match="'node-b' refused"):
        verify_node(ca, (cluster / "node-a.pem").read_bytes(), "node-b")


def test_other_ca_and_dates_are_refused(cluster: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    make_cluster(other, ["node-a"])
    ca = (cluster / "ca.pem").read_bytes()
    with pytest.raises(CertError, match="refused"):
        verify_node(ca, (other / "node-a.pem").read_bytes(), "node-a")
    cert = (cluster / "node-b.pem").read_bytes()
    now = datetime.datetime.now(datetime.timezone.utc)
    with pytest.raises(CertError, match="refused"):
        verify_node(ca, cert, "node-b", at=now + datetime.timedelta(days=900))     # expired
    with pytest.raises(CertError, match="refused"):
        verify_node(ca, cert, "node-b", at=now - datetime.timedelta(days=1))       # not yet valid


def test_nothing_is_overwritten(cluster: Path) -> None:
    with pytest.raises(CertError, match="has a CA already"):
        create_ca(cluster)
    with pytest.raises(CertError, match="exists already"):
        issue_node(cluster, "node-a")
    _, done = make_cluster(cluster, ["node-a", "node-c"])
    assert done == [f"issued {cluster / 'node-c.pem'} (key node-c-key.pem)"]


def test_bad_names_and_a_missing_ca(tmp_path: Path) -> None:
    with pytest.raises(CertError, match="no cluster CA"):
        issue_node(tmp_path, "node-a")
    create_ca(tmp_path)
    for bad in ("", "-a", "a b", "x" * 64, "é"):
        with pytest.raises(CertError, match="must be a DNS label"):
            issue_node(tmp_path, bad)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "c"
    assert main(["certs", "--dir", str(d), "--san", "n1=10.0.0.1", "n1", "n2"]) == 0
    out = capsys.readouterr().out
    assert "created the cluster CA" in out and f'cert = "{d / "n1.pem"}"' in out
    assert main(["certs", "--dir", str(d), "n1"]) == 0 and "nothing to do" in capsys.readouterr().out
    assert main(["certs", "--dir", str(d), "--san", "n9=x", "n1"]) == 2
    assert main(["certs", "--dir", str(d), "--days", "0", "n3"]) == 2
    assert "--days must be in 1..3650" in capsys.readouterr().err


def test_mutual_tls_handshake_with_the_issued_files(cluster: Path) -> None:
    def context(side: int, name: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(side)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(cluster / f"{name}.pem", cluster / f"{name}-key.pem")
        ctx.load_verify_locations(cluster / "ca.pem")
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    server_ctx = context(ssl.PROTOCOL_TLS_SERVER, "node-a")
    client_ctx = context(ssl.PROTOCOL_TLS_CLIENT, "node-b")
    left, right = socket.socketpair()
    seen: dict[str, object] = {}

    def serve() -> None:
        with server_ctx.wrap_socket(left, server_side=True) as tls:
            seen["client"] = tls.getpeercert()
            tls.sendall(tls.recv(5))

    thread = threading.Thread(target=serve)
    thread.start()
    with client_ctx.wrap_socket(right, server_hostname="node-a") as tls:
        tls.sendall(b"hello")
        assert tls.recv(5) == b"hello"
    thread.join(10)
    client = seen["client"]
    assert isinstance(client, dict) and ("DNS", "node-b") in client["subjectAltName"]


def test_a_certificate_issued_from_a_past_start_is_expired_now(cluster: Path) -> None:
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    cert_path, _ = issue_node(cluster, "node-old", days=9, valid_from=start)
    ca = (cluster / "ca.pem").read_bytes()
    with pytest.raises(CertError, match="refused"):
        verify_node(ca, cert_path.read_bytes(), "node-old")
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert cert.not_valid_after_utc == (start + datetime.timedelta(days=9)).replace(microsecond=0)
