"""Daemon configuration: TOML (tomllib) plus ``--set section.key=value`` overrides.

Every key is declared once, below, with its type, default and check; config/kvcached.toml
documents the same keys (a test keeps the two in step). A wrong key, a wrong type or an
impossible value raises :class:`ConfigError`, whose text is the one line the CLI prints:
``config: <section.key>: <what is wrong>``.

Relative paths are relative to the daemon's working directory (``make run`` runs from the
repository, so state lands under ./var; the systemd unit uses absolute paths).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvcached.config.sections import (
    AgentSection,
    ClusterSection,
    EventsSection,
    GrpcSection,
    KvSection,
    LogSection,
    MetricsSection,
    QuicSection,
    TenantsSection,
)
from kvcached.config.values import ListenAddress, is_loopback, parse_duration, parse_listen, zmq_endpoint_is_local
from kvcached.policies import EVICTION_POLICIES

__all__ = ["Config", "ConfigError", "ListenAddress", "is_loopback", "load_config", "parse_listen", "parse_duration",
           "tenant_share_bytes"]

MAX_TENANTS = 253          # tenants besides the default one: each has an arena (kvcached.tiers.arenas, 255 owners)
ARENA_SPACE = 64 << 40     # address space the arenas may take together: half of x86-64's 128 TiB for a process

GIB = 1 << 30
MIB = 1 << 20


class ConfigError(ValueError):
    """A configuration problem, named by its ``section.key``."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config: {key}: {problem}")
        self.key = key
        self.problem = problem


SECTIONS: dict[str, type] = {
    "kv": KvSection,
    "grpc": GrpcSection,
    "agent": AgentSection,
    "metrics": MetricsSection,
    "quic": QuicSection,
    "cluster": ClusterSection,
    "events": EventsSection,
    "tenants": TenantsSection,
    "log": LogSection,
}


@dataclass(frozen=True)
class Config:
    kv: KvSection = field(default_factory=KvSection)
    grpc: GrpcSection = field(default_factory=GrpcSection)
    agent: AgentSection = field(default_factory=AgentSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    quic: QuicSection = field(default_factory=QuicSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    events: EventsSection = field(default_factory=EventsSection)
    tenants: TenantsSection = field(default_factory=TenantsSection)
    log: LogSection = field(default_factory=LogSection)

    @property
    def ram_bytes(self) -> int:
        return int(self.kv.ram_gib * GIB)

    @property
    def ssd_bytes(self) -> int:
        """The SSD tier's capacity in bytes (0: no SSD tier)."""
        return int(self.kv.ssd_gib * GIB)

    @property
    def max_block_bytes(self) -> int:
        return int(self.kv.max_block_mib * MIB)

    @property
    def listeners(self) -> list[ListenAddress]:
        return [parse_listen(x) for x in self.grpc.listen]

    @property
    def socket_mode_bits(self) -> int:
        return int(self.grpc.socket_mode, 8)

    def grpc_tls_files(self) -> tuple[str, str, str]:
        """(certificate, key, CA) of the TLS TCP listeners: the [grpc] keys, else the [quic] ones."""
        g, q = self.grpc, self.quic
        return g.tls_cert or q.cert, g.tls_key or q.key, g.tls_ca or q.ca


def documented_keys() -> dict[str, dict[str, tuple[str, Any]]]:
    """``{section: {key: (doc, default)}}`` for every key, for docs and the doc-sync test."""
    out: dict[str, dict[str, tuple[str, Any]]] = {}
    for name, cls in SECTIONS.items():
        defaults = cls()
        out[name] = {f.name: (f.metadata["doc"], getattr(defaults, f.name)) for f in dataclasses.fields(cls)}
    return out


# ---------------------------------------------------------------------------------------------
# loading


def _type_name(value: object) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a table"}.get(
        type(value), type(value).__name__)


def _unknown(kind: str, name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind}{hint}; known: {', '.join(known)}"


def _coerce(section: str, f: dataclasses.Field[Any], value: Any) -> Any:
    key = f"{section}.{f.name}"
    if f.default is not dataclasses.MISSING:
        default = f.default
    else:
        assert f.default_factory is not dataclasses.MISSING, f"{key} has no default"
        default = f.default_factory()
    kind = f.metadata["kind"] or type(default)
    if f.name.endswith("_ttl"):
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
    # bool is an int in Python; never accept one for the other.
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        want = {bool: "a boolean", int: "an integer", str: "a string", list: "a list", dict: "a table"}.get(kind, "a number")
        raise ConfigError(key, f"expected {want}, got {_type_name(value)} {value!r}")
    if kind is list and f.name == "listen" and not all(isinstance(x, str) for x in value):
        raise ConfigError(key, f"expected a list of strings, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    check = f.metadata["check"]
    if check is not None:
        try:
            check(value)
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
    return float(value) if kind == (int, float) else value


def _parse_override(item: str) -> tuple[str, str, Any]:
    name, sep, raw = item.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(name.strip() or item, "--set expects section.key=value, e.g. --set kv.ram_gib=2")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as var/ssd: take it as a string; the type check still applies
    return section, key, value


def load_config(path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = (),
                *, total_memory: int | None = None) -> Config:
    """Read ``path`` (None: defaults only), apply ``overrides``, check everything."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            with p.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(str(p), "no such file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(str(p), f"not valid TOML: {exc}") from None
    for item in overrides:
        section, key, value = _parse_override(item)
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(section, "must be a table")
        data[section][key] = value
    sections: dict[str, Any] = {}
    for section, table in data.items():
        cls = SECTIONS.get(section)
        if cls is None:
            raise ConfigError(section, _unknown("section", section, list(SECTIONS)))
        if not isinstance(table, dict):
            raise ConfigError(section, f"must be a table [{section}], got {_type_name(table)}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in table.items():
            if key not in fields:
                raise ConfigError(f"{section}.{key}", _unknown("key", key, list(fields)))
            values[key] = _coerce(section, fields[key], value)
        sections[section] = cls(**values)
    for section, cls in SECTIONS.items():
        sections.setdefault(section, cls())
    config = Config(**sections)
    _check_whole(config, total_memory)
    return config


def _check_whole(config: Config, total_memory: int | None) -> None:
    """Checks that relate several keys or the machine."""
    kv = config.kv
    if total_memory is None:
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if config.ram_bytes >= total_memory:
        raise ConfigError("kv.ram_gib", f"{kv.ram_gib:g} GiB is more than this machine's memory ({total_memory / GIB:.1f} GiB)")
    if config.max_block_bytes < 4096:
        raise ConfigError("kv.max_block_mib", "must be at least 4 KiB (0.00390625)")
    if config.max_block_bytes > config.ram_bytes:
        raise ConfigError("kv.max_block_mib", f"{kv.max_block_mib:g} MiB does not fit in kv.ram_gib = {kv.ram_gib:g}")
    if not 1 <= config.grpc.max_message_mib <= 2047:
        raise ConfigError("grpc.max_message_mib", f"must be in 1..2047 (gRPC's limit is 2 GiB), got {config.grpc.max_message_mib}")

    if kv.ram_policy not in EVICTION_POLICIES:
        raise ConfigError("kv.ram_policy", f"unknown policy {kv.ram_policy!r}; known: {', '.join(sorted(EVICTION_POLICIES))}")
    if kv.ssd_policy not in EVICTION_POLICIES:
        raise ConfigError("kv.ssd_policy", f"unknown policy {kv.ssd_policy!r}; known: {', '.join(sorted(EVICTION_POLICIES))}")
    quic = config.quic
    if quic.listen or quic.peers:
        for name in ("ca", "cert", "key"):
            value = getattr(quic, name)
            if not value:
                raise ConfigError(f"quic.{name}", "required when quic.listen or quic.peers is set")
            if not os.path.isfile(value):
                raise ConfigError(f"quic.{name}", f"no such file: {value}")
            if not os.access(value, os.R_OK):
                raise ConfigError(f"quic.{name}", f"not readable: {value}")
    _check_cluster(config)
    if quic.backoff_max_s < quic.backoff_s:
        raise ConfigError("quic.backoff_max_s", f"{quic.backoff_max_s:g} is less than quic.backoff_s = {quic.backoff_s:g}")
    _check_grpc_security(config)
    _check_events(config)
    unix_paths = [os.path.abspath(a.unix_path) for a in config.listeners if a.unix_path]
    if config.agent.socket and os.path.abspath(config.agent.socket) in unix_paths:
        raise ConfigError("agent.socket", "is also a gRPC listener; each socket needs its own path")
    _check_tenants(config, unix_paths)


def tenant_share_bytes(share: float | int, capacity: int) -> int:
    """A share of ``tenants.ram_shares`` or ``ssd_shares`` in bytes of a tier of ``capacity`` bytes."""
    return int(share * capacity) if isinstance(share, float) else share


def _check_tenants(config: Config, unix_paths: list[str]) -> None:
    """Every tenant a socket is bound to is named by a uid or gid (the socket admits those, and
    no one else), each tenant socket has a path of its own, and certificates name tenants only
    where gRPC sees certificates (grpc.tls), and there are no more tenants than RAM arenas."""
    t = config.tenants
    named = {*t.uids, *t.gids, *t.certs, *t.agent_sockets, t.default} - {"", "default"}
    if len(named) > MAX_TENANTS:
        raise ConfigError("tenants.uids", f"{len(named)} tenants are configured; each has a RAM arena of its own, and "
                          f"a daemon keeps at most {MAX_TENANTS} besides the default tenant's")
    if named and (len(named) + 1) * config.ram_bytes > ARENA_SPACE:
        raise ConfigError("kv.ram_gib", f"{len(named) + 1} tenants' arenas of {config.kv.ram_gib:g} GiB each take "
                          f"{(len(named) + 1) * config.ram_bytes / (1 << 40):.0f} TiB of address space, more than the "
                          f"{ARENA_SPACE >> 40} TiB a process can spare for them (each arena is the tier's size in "
                          "address space; only its slabs in use cost memory)")
    taken = unix_paths + ([os.path.abspath(config.agent.socket)] if config.agent.socket else [])
    for name, endpoint in t.events.items():
        key = f"tenants.events.{name}"
        if name not in t.uids and name not in t.gids:
            raise ConfigError(key, f"tenant {name} is named by no uid or gid (tenants.uids, tenants.gids): its stream "
                              "would admit no one")
        if endpoint in (config.events.endpoint, config.events.replay_endpoint):
            raise ConfigError(key, f"{endpoint} is also events.endpoint or events.replay_endpoint")
    for name, endpoint in t.event_replays.items():
        if name not in t.events:
            raise ConfigError(f"tenants.event_replays.{name}", f"tenant {name} has no stream to replay (tenants.events)")
        if endpoint in (config.events.endpoint, config.events.replay_endpoint, *t.events.values()):
            raise ConfigError(f"tenants.event_replays.{name}", f"{endpoint} is also another events endpoint")
    for name, path in t.sockets.items():
        key = f"tenants.sockets.{name}"
        if name not in t.uids and name not in t.gids:
            raise ConfigError(key, f"tenant {name} is named by no uid or gid (tenants.uids, tenants.gids): its socket "
                              "would admit no one")
        if os.path.abspath(path) in taken:
            raise ConfigError(key, f"{path} is also the agent socket or a gRPC listener; each socket needs its own path")
    taken += [os.path.abspath(p) for p in t.sockets.values()]
    for name, path in t.agent_sockets.items():
        if os.path.abspath(path) in taken:
            raise ConfigError(f"tenants.agent_sockets.{name}", f"{path} is also the agent socket, a gRPC listener or a "
                              "tenant's gRPC socket; each socket needs its own path")
    _check_shares(config, "RAM", t.ram_shares, config.ram_bytes)
    if t.ssd_shares and not config.kv.ssd_gib:
        raise ConfigError("tenants.ssd_shares", "is set but the SSD tier is off (kv.ssd_gib = 0)")
    _check_shares(config, "SSD", t.ssd_shares, config.ssd_bytes)
    if (t.certs or t.operators) and not config.grpc.tls:
        raise ConfigError("tenants.certs" if t.certs else "tenants.operators",
                          "names client certificates, which gRPC sees only with grpc.tls = true")
    if t.operators and not t.certs:
        raise ConfigError("tenants.operators", "applies when tenants.certs is set (without it, every certificate the "
                          "CA signed is the operator's)")
    mapped = {n: tenant for tenant, names in t.certs.items() for n in names}
    for n in t.operators:
        if n in mapped:
            raise ConfigError("tenants.operators", f"{n!r} is also tenant {mapped[n]}'s certificate (tenants.certs)")


def _check_shares(config: Config, tier: str, shares: dict[str, float | int], capacity: int) -> None:
    """Shares name configured tenants and add up to no more than the tier."""
    t = config.tenants
    key, size_key = f"{tier.lower()}_shares", f"kv.{tier.lower()}_gib"
    named = {*t.uids, *t.gids, *t.certs, *t.agent_sockets} | ({t.default} if t.default else set())
    for name in shares:
        if name not in named:
            raise ConfigError(f"tenants.{key}.{name}", f"no tenant called {name} is configured (tenants.uids, "
                              "gids, certs or default)")
    total = sum(tenant_share_bytes(v, capacity) for v in shares.values())
    if total > capacity:
        raise ConfigError(f"tenants.{key}", f"the shares add up to {total} bytes, more than the {tier} tier's {capacity} "
                          f"({size_key})")


def _check_cluster(config: Config) -> None:
    c, quic = config.cluster, config.quic
    if not c.etcd:
        return
    if quic.peers:
        raise ConfigError("cluster.etcd", "set either quic.peers (a static list of peers) or cluster.etcd, not both")
    if not quic.listen:
        raise ConfigError("quic.listen", "required when cluster.etcd is set: the other daemons dial this one there")
    if not c.name:
        raise ConfigError("cluster.name", "required when cluster.etcd is set: the name quic.cert carries")
    host = parse_listen(quic.listen).host or ""
    if not c.advertise and host.strip("[]") in ("0.0.0.0", "::", ""):
        raise ConfigError("cluster.advertise", f"required when quic.listen ({quic.listen}) is a wildcard address")
    if (c.etcd_cert or c.etcd_key) and not (c.etcd_ca and c.etcd_cert and c.etcd_key):
        raise ConfigError("cluster.etcd_ca" if not c.etcd_ca else "cluster.etcd_cert" if not c.etcd_cert
                          else "cluster.etcd_key", "etcd_ca, etcd_cert and etcd_key go together (mutual TLS to etcd)")
    for name in ("etcd_ca", "etcd_cert", "etcd_key"):
        value = getattr(c, name)
        if value and not (os.path.isfile(value) and os.access(value, os.R_OK)):
            raise ConfigError(f"cluster.{name}", f"no such readable file: {value}")


def _check_events(config: Config) -> None:
    """Events go to loopback or a Unix path unless events.remote says otherwise; a replay
    endpoint needs the stream it replays."""
    e = config.events
    if e.replay_endpoint and not e.endpoint:
        raise ConfigError("events.replay_endpoint", "set events.endpoint too: a replay endpoint replays its stream")
    if e.endpoint and e.endpoint == e.replay_endpoint:
        raise ConfigError("events.replay_endpoint", "must differ from events.endpoint")
    t = config.tenants
    tenants = sorted({*t.uids, *t.gids, *t.certs, t.default} - {"", "default"})
    for key, value in (("endpoint", e.endpoint), ("replay_endpoint", e.replay_endpoint)):
        if value and tenants and value.startswith("tcp://"):
            raise ConfigError(f"events.{key}", f"{value} admits every process that reaches it, and with tenants "
                              f"configured ({', '.join(tenants)}) the operator's stream names every tenant's blocks: "
                              "bind an ipc:// path (only the daemon's user may open it), and give each tenant a stream "
                              "of its own (tenants.events)")
        if value and not e.remote and not zmq_endpoint_is_local(value):
            raise ConfigError(f"events.{key}", f"{value} can be reached from other machines, and the events name every "
                              "block this daemon holds: bind loopback or ipc://, or set events.remote = true")


def _check_grpc_security(config: Config) -> None:
    """No plaintext TCP listener on a non-loopback address without grpc.insecure; TLS needs its
    three files."""
    g = config.grpc
    tcp = [a for a in config.listeners if not a.unix_path] + [parse_listen(x) for x in g.read_only_listen]
    if g.tls:
        for key, value in zip(("tls_cert", "tls_key", "tls_ca"), config.grpc_tls_files()):
            fallback = {"tls_cert": "quic.cert", "tls_key": "quic.key", "tls_ca": "quic.ca"}[key]
            if not value:
                raise ConfigError(f"grpc.{key}", f"required when grpc.tls is true (or set {fallback})")
            if not os.path.isfile(value) or not os.access(value, os.R_OK):
                raise ConfigError(f"grpc.{key}", f"no such readable file: {value}")
    elif not g.insecure:
        public = [a.text for a in tcp if not a.is_loopback]
        if public:
            raise ConfigError("grpc.listen" if public[0] in g.listen else "grpc.read_only_listen",
                              f"plaintext gRPC on the non-loopback address {public[0]}: anyone on the network could "
                              "call it. Set grpc.tls = true (mutual TLS with the cluster CA), listen on loopback, or "
                              "set grpc.insecure = true to allow it anyway")


def as_mapping(config: Config) -> Mapping[str, Mapping[str, Any]]:
    """The effective configuration as plain data (for logs and `kvcached serve --print-config`)."""
    return dataclasses.asdict(config)


SECRET_KEYS = {("quic", "ca"), ("quic", "cert"), ("quic", "key"), ("grpc", "tls_cert"), ("grpc", "tls_key"),
               ("grpc", "tls_ca"), ("tenants", "key_file")}


def to_toml(config: Config, *, redact: bool = True) -> str:
    """The configuration as a TOML file ``load_config`` reads back; with ``redact``, key files and
    certificate paths read ``"<redacted>"`` (they say where the cluster's secrets live)."""
    lines: list[str] = []
    for section, table in as_mapping(config).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            if redact and (section, key) in SECRET_KEYS and value:
                value = "<redacted>"
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)          # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {type(value).__name__}")


# Keys SIGHUP applies while the daemon serves; any other change waits for a restart.
RELOADABLE = frozenset({("log", "level"), ("kv", "ssd_ttl"), ("kv", "gone_ttl"), ("kv", "prefetch_policy"),
                        ("kv", "prefetch_timeout_ms")})


def changed_keys(old: Config, new: Config) -> list[tuple[str, str]]:
    """(section, key) of every value that differs between two configurations."""
    a, b = as_mapping(old), as_mapping(new)
    return [(section, key) for section in a for key in a[section] if a[section][key] != b[section][key]]


def with_reloaded(old: Config, new: Config) -> Config:
    """``old`` with the reloadable keys taken from ``new``."""
    sections = {name: getattr(old, name) for name in SECTIONS}
    for section, key in changed_keys(old, new):
        if (section, key) in RELOADABLE:
            sections[section] = dataclasses.replace(sections[section], **{key: getattr(getattr(new, section), key)})
    return Config(**sections)
