"""What one configuration value may be (the rest of the configuration is kvcached.config's):
durations, listen addresses, and the checks each declared key runs, with :func:`setting`, the
declaration of a key (its documentation, default, check and type).

A check raises ValueError with the problem in words ("must be between 1 and 16, got 0");
kvcached.config names the key in front of it.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["ListenAddress", "parse_listen", "parse_duration", "is_loopback", "setting", "between", "count_1_to",
           "positive", "non_negative", "path", "unix_path_or_empty", "octal_mode", "one_of", "listen_list",
           "same_place", "listen_or_empty", "host_port_or_empty", "peers", "host_port_entry"]


# ---------------------------------------------------------------------------------------------
# value parsers


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``"90s"``, ``"15m"``, ``"24h"``, ``"7d"``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration, got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as 3600, \"90s\", \"24h\" or \"7d\", got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be finite, got {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {value!r}")
    return seconds


def is_loopback(host: str) -> bool:
    """Whether ``host`` (as a listener names it, IPv6 in brackets or not) can only be reached from
    this machine: ``localhost`` or a loopback address, which is all of 127.0.0.0/8 (RFC 1122
    3.2.1.3) and ::1 (RFC 4291 2.5.3), also written IPv4-mapped (::ffff:127.x.y.z)."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False             # another name: it may resolve to anything
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A listener in gRPC's own syntax: ``unix:PATH`` or ``HOST:PORT``."""

    text: str
    unix_path: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def is_unix(self) -> bool:
        return self.unix_path is not None

    @property
    def is_loopback(self) -> bool:
        """A Unix socket, or a host only this machine reaches (:func:`is_loopback`)."""
        return self.is_unix or is_loopback(self.host or "")


def parse_listen(text: str) -> ListenAddress:
    """Parse ``unix:path``, ``unix:///abs/path``, ``host:port`` or ``[v6]:port``."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"expected a listener such as \"unix:var/kvcached.sock\" or \"127.0.0.1:7400\", got {text!r}")
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ValueError(f"empty Unix socket path in {text!r}")
        if len(os.fsencode(os.path.abspath(path))) > 107:
            raise ValueError(f"Unix socket path too long (max 107 bytes): {path!r}")
        return ListenAddress(text, unix_path=path)
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected \"unix:PATH\" or \"HOST:PORT\", got {text!r}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port out of range 0..65535 in {text!r}")
    if host.startswith("[") != host.endswith("]"):
        raise ValueError(f"unbalanced brackets in {text!r}")
    return ListenAddress(text, host=host, port=port)


# ---------------------------------------------------------------------------------------------
# checks (each raises ValueError with the problem; the loader adds the key)


def positive(v: float) -> None:
    if v <= 0:
        raise ValueError(f"must be greater than 0, got {v}")


def non_negative(v: float) -> None:
    if v < 0:
        raise ValueError(f"must be 0 or more, got {v}")


def path(v: str) -> None:
    if not v.strip():
        raise ValueError("must be a path, got an empty string")
    if "\0" in v:
        raise ValueError("a path cannot contain a NUL byte")


def path_or_empty(v: str) -> None:
    if v:
        path(v)


def unix_path_or_empty(v: str) -> None:
    if v:
        path(v)
        if len(os.fsencode(os.path.abspath(v))) > 107:
            raise ValueError(f"Unix socket path too long (max 107 bytes): {v!r}")


def octal_mode(v: str) -> None:
    if not re.fullmatch(r"0?[0-7]{3}", v):
        raise ValueError(f"must be octal permission bits such as \"0660\", got {v!r}")


def one_of(*choices: str) -> Callable[[str], None]:
    def check(v: str) -> None:
        if v not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {v!r}")

    return check


def listen_list(v: list[str]) -> None:
    if not v:
        raise ValueError("needs at least one listener")
    seen = [same_place(parse_listen(item)) for item in v]
    if len(set(seen)) != len(seen):
        raise ValueError("lists the same listener twice")


def same_place(address: ListenAddress) -> str:
    """A form in which two spellings of one listener compare equal."""
    return os.path.abspath(address.unix_path) if address.unix_path else address.text


def listen_or_empty(v: str) -> None:
    if v:
        parse_listen(v)


def host_port_or_empty(v: str) -> None:
    if v and parse_listen(v).is_unix:
        raise ValueError(f"must be HOST:PORT (UDP/TCP), not a Unix socket: {v!r}")


def peers(v: list[Any]) -> None:
    names = set()
    for i, peer in enumerate(v):
        if not isinstance(peer, dict) or set(peer) != {"name", "address"}:
            raise ValueError(f"entry {i} must be a table {{ name = \"...\", address = \"HOST:PORT\" }}, got {peer!r}")
        if not isinstance(peer["name"], str) or not peer["name"]:
            raise ValueError(f"entry {i}: name must be a non-empty string")
        if peer["name"] in names:
            raise ValueError(f"peer name {peer['name']!r} appears twice")
        names.add(peer["name"])
        host_port_entry(i, peer["address"])


def host_port_entry(i: int, address: object) -> None:
    """Entry ``i`` of a list of HOST:PORT addresses."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"entry {i}: address must be HOST:PORT, got {address!r}")
    try:
        host_port_or_empty(address)
    except ValueError as exc:
        raise ValueError(f"entry {i}: {exc}") from None


def between(least: float, most: float, unit: str = "", *, zero: str | None = None) -> Callable[[float], None]:
    """The check of a number that must lie in [least, most] (``unit``: what follows the bounds
    in the message); with ``zero``, 0 is allowed too and ``zero`` says what it means."""
    def check(v: float) -> None:
        if zero is not None and v == 0:
            return
        if not least <= v <= most:
            either = f"{zero} or " if zero is not None else ""
            raise ValueError(f"must be {either}between {number(least)} and {number(most)}{unit}, got {v}")

    return check


def number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def count_1_to(most: int) -> Callable[[float], None]:
    return between(1, most)


def setting(doc: str, default: Any, check: Callable[[Any], None] | None = None, kind: type | tuple[type, ...] | None = None) -> Any:
    meta = {"doc": doc, "check": check, "kind": kind}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)




def zmq_endpoint_or_empty(v: str) -> None:
    """A ZMQ endpoint the daemon binds: ``tcp://HOST:PORT`` (``*`` for every address) or
    ``ipc://PATH``; "" for none."""
    if v == "":
        return
    if v.startswith("ipc://@"):
        raise ValueError(f"{v} is an abstract Unix socket, which has no file mode: every local user could connect. "
                         "Give a path (ipc:///run/kvcached/events)")
    if v.startswith("ipc://") and len(v) > len("ipc://"):
        return
    if v.startswith("tcp://"):
        host, sep, port = v[len("tcp://"):].rpartition(":")
        if sep and host and port.isdigit() and int(port) < 65536:
            return
    raise ValueError(f"expected a ZMQ endpoint such as \"tcp://127.0.0.1:5557\" or \"ipc:///run/kvcached/events\", got {v!r}")


def zmq_endpoint_is_local(v: str) -> bool:
    """Whether only this machine can reach the ZMQ endpoint ``v`` (ipc, or tcp on loopback)."""
    if v.startswith("ipc://"):
        return True
    host = v[len("tcp://"):].rpartition(":")[0]
    return host != "*" and is_loopback(host)


def event_topic(v: str) -> None:
    try:
        v.format(node="n", model="m")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"only {{node}} and {{model}} may be filled in, got {v!r} ({exc})") from None
    if len(v) > 256:
        raise ValueError("at most 256 characters")


def event_medium(v: str) -> None:
    event_topic(v)
    if not v:
        raise ValueError("must not be empty")


_TENANT = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")     # a bare TOML key, so as_toml writes it as is
MAX_ID = (1 << 32) - 2          # uid and gid 4294967295 is (uid_t) -1: nobody's


def tenant_name_or_empty(v: str) -> None:
    """A tenant's name (lower-case letters, digits, '_', '-'; at most 63), or ""."""
    if v and not _TENANT.match(v):
        raise ValueError(f"must be a tenant name (lower-case letters, digits, '_', '-'; at most 63), got {v!r}")


def _tenant_map(v: dict[str, Any], fits: Callable[[Any], bool], expected: str, *, many: bool,
                same: Callable[[Any], Any] | None = None, shown: Callable[[Any], str] = str,
                check: Callable[[str, Any], None] = lambda name, item: None) -> None:
    """``{tenant: [item, ...]}`` (``many``) or ``{tenant: item}``: tenant names, items that
    ``fits`` and pass ``check``; with ``same``, no item (as ``same`` compares them) named for
    two tenants."""
    owner: dict[Any, str] = {}
    for name, items in v.items():
        if not name:
            raise ValueError("a tenant's name must not be empty")
        tenant_name_or_empty(name)
        if not (isinstance(items, list) and items and all(map(fits, items)) if many else fits(items)):
            raise ValueError(f"{name}: expected {expected}, got {items!r}")
        for item in items if many else [items]:
            check(name, item)
            if same is None:
                continue
            key = same(item)
            if key in owner:
                raise ValueError(f"{shown(item)} is mapped twice: to {owner[key]} and to {name}")
            owner[key] = name


def _an_id(name: str, i: int) -> None:
    if not 0 <= i <= MAX_ID:
        raise ValueError(f"{name}: {i} is not an id (0..{MAX_ID})")


def tenant_ids(v: dict[str, Any]) -> None:
    """``{tenant: [id, ...]}``: tenant names, lists of uids or gids, no id named twice."""
    _tenant_map(v, lambda i: type(i) is int, "a non-empty list of integers", many=True, same=int, check=_an_id)


def tenant_sockets(v: dict[str, Any]) -> None:
    """``{tenant: "/path.sock"}``: tenant names, each with a Unix socket path of its own."""
    _tenant_map(v, lambda p: isinstance(p, str) and bool(p), "a Unix socket path", many=False, same=os.path.abspath,
                shown=lambda p: f"socket {p}", check=lambda name, p: unix_path_or_empty(p))


def tenant_event_endpoints(v: dict[str, Any]) -> None:
    """``{tenant: "ipc://PATH"}``: a ZMQ ipc endpoint of its own for each tenant (TCP would
    admit every local process)."""
    def ipc(name: str, endpoint: str) -> None:
        if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
            raise ValueError(f"{name}: {endpoint} is not ipc://PATH; a tenant's stream needs a Unix socket file that "
                             "admits the tenant alone (an abstract socket, ipc://@NAME, has no file mode to admit by)")
        unix_path_or_empty(endpoint[len("ipc://"):])
    _tenant_map(v, lambda e: isinstance(e, str) and len(e) > len("ipc://"), "an ipc://PATH endpoint", many=False,
                same=lambda e: os.path.abspath(e[len("ipc://"):]), check=ipc)


def tenant_shares(v: dict[str, Any]) -> None:
    """``{tenant: share}``: a fraction of the tier (a float in (0, 1]) or bytes (an integer);
    two tenants may have the same share."""
    def fits(x: Any) -> bool:
        return (type(x) is float and 0 < x <= 1) or (type(x) is int and x >= 0)
    _tenant_map(v, fits, "a fraction of the tier (0 < x <= 1.0) or a number of bytes", many=False)


def tenant_names(v: dict[str, Any]) -> None:
    """``{tenant: ["name", ...]}``: tenant names, lists of certificate names, no name twice."""
    _tenant_map(v, lambda n: isinstance(n, str) and bool(n), "a non-empty list of certificate names", many=True,
                same=str, shown=repr)


def certificate_names(v: list[str]) -> None:
    if not isinstance(v, list) or not all(isinstance(n, str) and n for n in v):
        raise ValueError(f"expected a list of certificate names, got {v!r}")
