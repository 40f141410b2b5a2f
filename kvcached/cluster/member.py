"""One daemon's registration in the cluster, as it lies in etcd (sans-I/O).

Key layout, under the cluster's prefix (``[cluster] prefix``, default ``/kvcached``)::

    {prefix}/members/{name}   ->  JSON registration (below), attached to the daemon's lease

The name is the daemon's certificate name: peers dial it at ``host:quic_port`` and verify that
its certificate carries that name. A registration proves itself (kvcached.cluster.proof: the
member's certificate, the lease it is attached to and a signature by the certificate's key over
all of it); a value that does not prove itself, whose ``name`` differs from its key, or that does
not parse, is refused and counted, never used. Nothing per block is ever written to etcd.

The value, version 2 (unknown fields are ignored, so later versions can add some; version 1
carried no proof and is refused)::

    {"v": 2, "name": "node-a", "host": "10.0.0.5", "quic_port": 7400, "lane_port": 7400,
     "capacity_bytes": 68719476736, "version": "0.1.0",
     "lease": 7587881226395124745, "cert": "-----BEGIN CERTIFICATE-----...", "sig": "MEUCIQ..."}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

__all__ = ["Member", "MemberError", "member_fields", "member_key", "name_of_key", "members_prefix", "NAME"]

FORMAT = 2
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")   # a DNS-like certificate name
MAX_VALUE = 16384           # a certificate chain of a few PEM certificates fits


class MemberError(ValueError):
    """A registration that cannot be used (the reason is the text)."""


def members_prefix(prefix: str) -> str:
    return prefix.rstrip("/") + "/members/"


def member_key(prefix: str, name: str) -> str:
    if not NAME.match(name):
        raise MemberError(f"member name {name!r}: letters, digits, '.', '_', '-' only, at most 253")
    return members_prefix(prefix) + name


def name_of_key(prefix: str, key: str) -> str:
    """The member name a key under ``{prefix}/members/`` names; MemberError for any other key."""
    head = members_prefix(prefix)
    if not key.startswith(head) or not NAME.match(key[len(head):]):
        raise MemberError(f"key {key!r} is not a member key under {head!r}")
    return key[len(head):]


def _port(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise MemberError(f"{what} must be a port number 1..65535, got {value!r}")
    return value


@dataclass(frozen=True)
class Member:
    """A live daemon of the cluster, as registered: where to dial it and what it offers."""

    name: str
    host: str
    quic_port: int
    lane_port: int
    capacity_bytes: int = 0
    version: str = ""

    @classmethod
    def decode(cls, name: str, value: bytes) -> Member:
        """The member fields of the registration stored under ``name``'s key; MemberError if
        they cannot be used. Its proof is kvcached.cluster.proof's to check."""
        if len(value) > MAX_VALUE:
            raise MemberError(f"registration of {name!r}: {len(value)} bytes, over {MAX_VALUE}")
        try:
            doc = json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MemberError(f"registration of {name!r} is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise MemberError(f"registration of {name!r} is not a JSON object")
        if doc.get("v") != FORMAT:
            raise MemberError(f"registration of {name!r}: format {doc.get('v')!r}, this daemon reads {FORMAT} "
                              "(a registration that proves itself)")
        if doc.get("name") != name:
            raise MemberError(f"registration under {name!r} names {doc.get('name')!r}")
        host = doc.get("host")
        if not isinstance(host, str) or not host or len(host) > 253:
            raise MemberError(f"registration of {name!r}: host must be a non-empty string, got {host!r}")
        capacity = doc.get("capacity_bytes", 0)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise MemberError(f"registration of {name!r}: capacity_bytes must be a count, got {capacity!r}")
        version = doc.get("version", "")
        if not isinstance(version, str) or len(version) > 64:
            raise MemberError(f"registration of {name!r}: version must be a short string, got {version!r}")
        return cls(name, host, _port(doc.get("quic_port"), "quic_port"), _port(doc.get("lane_port"), "lane_port"),
                   capacity, version)


def member_fields(member: Member) -> dict[str, object]:
    """The fields of ``member``'s registration, before its proof (kvcached.cluster.proof adds it)."""
    return {"v": FORMAT, "name": member.name, "host": member.host, "quic_port": member.quic_port,
            "lane_port": member.lane_port, "capacity_bytes": member.capacity_bytes, "version": member.version}
