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
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvcached.config.values import (
    ListenAddress,
    between,
    count_1_to,
    event_medium,
    event_topic,
    host_port_entry,
    host_port_or_empty,
    is_loopback,
    listen_list,
    non_negative,
    octal_mode,
    one_of,
    parse_duration,
    parse_listen,
    path,
    peers,
    positive,
    setting,
    unix_path_or_empty,
    zmq_endpoint_is_local,
    zmq_endpoint_or_empty,
)
from kvcached.policies import EVICTION_POLICIES
from kvcached.policies.admission import ADMISSION_POLICIES
from kvcached.policies.prefetch import PREFETCH_POLICIES
from kvcached.policies.slru import MAX_RATIO
from kvcached.policies.write import WRITE_POLICIES
from kvcached_agent.protocol import MAX_BATCH

__all__ = ["Config", "ConfigError", "ListenAddress", "is_loopback", "load_config", "parse_listen", "parse_duration"]

GIB = 1 << 30
MIB = 1 << 20


class ConfigError(ValueError):
    """A configuration problem, named by its ``section.key``."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config: {key}: {problem}")
        self.key = key
        self.problem = problem


# ---------------------------------------------------------------------------------------------
# sections


@dataclass(frozen=True)
class KvSection:
    ram_gib: float = setting("Size of the shared-memory RAM arena that holds block bytes, GiB.", 1.0, positive, (int, float))
    max_block_mib: float = setting("Largest block payload accepted, MiB; also the arena's slab size.", 16.0, positive, (int, float))
    ram_policy: str = setting("Eviction policy of the RAM tier (registry key).", "slru")
    slru_ratio: float = setting("Age ratio of the slru policy: a block used once is evicted at 1/ratio of the age a "
                             "reused block may reach (1: plain LRU); 0 tunes it online.", 0.0,
                             between(1, MAX_RATIO, zero="0 (tuned online)"), (int, float))
    ssd_dir: str = setting("Directory of SSD block files (SSD tier).", "var/ssd", path)
    ssd_gib: float = setting("SSD tier capacity, GiB (0 disables the SSD tier).", 16.0, non_negative, (int, float))
    ssd_ttl: float = setting("Blocks unused this long leave the SSD tier (seconds or \"90s\", \"24h\", \"7d\").", 7 * 86400.0)
    ssd_policy: str = setting("Capacity eviction order of the SSD tier: lru (the index's own queue) or an in-memory "
                           "ram_policy name.", "lru")
    write_policy: str = setting("When new blocks go to SSD: write_back (soon after the Put), write_through (before it "
                             "returns) or write_through_selective (once hit write_through_threshold times).",
                             "write_back", one_of(*WRITE_POLICIES))
    write_through_threshold: int = setting("Hits a new block needs before it goes to SSD under "
                                        "write_through_selective.", 2, positive, int)
    admission: str = setting("Which offered new blocks are stored: always, or reuse (on the admission_threshold-th "
                          "offer within admission_window offers).", "always", one_of(*ADMISSION_POLICIES))
    admission_threshold: int = setting("Offers a block needs before it is stored under admission = reuse (1..255).", 2,
                                    between(1, 255, " (the sketch counts up to 255)"), int)
    admission_window: int = setting("Offers after which admission = reuse halves its counts (16 bytes of memory each).",
                                 100_000, between(1000, 1_000_000_000, " offers"), int)
    ssd_write_budget_gib: float = setting("Most bytes written to the SSD tier in any 24 hours, GiB (0: no budget).",
                                       0.0, non_negative, (int, float))
    policy_save_s: float = setting("How often what the policies learned is saved to the index, seconds (0: on a clean "
                                "stop only).", 60.0, between(1, 86400, " seconds", zero="0 (save on a clean stop only)"), (int, float))
    ssd_durability: str = setting("How SSD block files are made durable: always, batch or none.", "batch",
                               one_of("always", "batch", "none"))
    ssd_commit_ms: float = setting("Longest wait to gather a group commit (ssd_durability = batch), ms.", 10.0,
                                between(0, 1000, " ms"), (int, float))
    ssd_direct_io: str = setting("O_DIRECT for SSD reads and writes: auto, on or off.", "auto", one_of("auto", "on", "off"))
    ssd_io_threads: int = setting("Threads doing SSD I/O (blocks in flight at once).", 8, between(1, 256), int)
    index_dir: str = setting("RocksDB directory of the persistent block index.", "var/index", path)
    mirror_pulls: bool = setting("Keep a local copy of blocks pulled from peers.", True)
    prefetch_policy: str = setting("How long a load waits for SSD reads and peer pulls: wait_complete, best_effort (not at "
                                "all) or timeout (prefetch_timeout_ms).", "wait_complete",
                                one_of(*PREFETCH_POLICIES))
    prefetch_timeout_ms: float = setting("Longest wait of a load for its reads under prefetch_policy = timeout, ms.", 50.0,
                                      positive, (int, float))
    gone_ttl: float = setting("How long the index remembers blocks whose bytes are gone (evicted, lost at restart).", 3600.0)


def _tcp_listen_list(v: list[str]) -> None:
    for item in v:
        if parse_listen(item).unix_path is not None:
            raise ValueError(f"TCP listeners only (HOST:PORT), got {item!r}")
    if len(set(v)) != len(v):
        raise ValueError("lists the same listener twice")


@dataclass(frozen=True)
class GrpcSection:
    listen: list[str] = setting("gRPC listeners in gRPC syntax: \"unix:PATH\" and/or \"HOST:PORT\".",
                                ["unix:var/kvcached.sock"], listen_list)
    socket_mode: str = setting("Permission bits of the gRPC Unix sockets, octal (who may call the API).", "0660", octal_mode)
    socket_group: str = setting("Group that owns the gRPC Unix sockets (name or number); \"\" keeps the daemon's group.", "")
    tls: bool = setting("TCP listeners of grpc.listen serve mutual TLS: a client certificate from the CA is required.", False)
    tls_cert: str = setting("PEM certificate of the TCP listeners (tls = true); \"\": quic.cert.", "")
    tls_key: str = setting("PEM private key of tls_cert; \"\": quic.key.", "")
    tls_ca: str = setting("PEM CA that signs the clients' certificates; \"\": quic.ca (the cluster CA).", "")
    read_only_listen: list[str] = setting("TCP listeners for read-only calls by anyone who reaches them (TLS without client "
                                       "certificates when tls = true).", [], _tcp_listen_list)
    insecure: bool = setting("Allow plaintext TCP listeners on non-loopback addresses (read-only calls only).", False)
    max_message_mib: int = setting("Largest gRPC message either way, MiB; bigger payloads use GetStream/PutStream.", 64, None, int)
    grace_s: float = setting("Seconds in-flight requests get to finish on SIGTERM/SIGINT.", 5.0, non_negative, (int, float))
    max_batch: int = setting("Most entries in one request: digests of Lookup, Overlap and Evict, addresses of Get, "
                          "GetStream and Delete, blocks of Put; more is refused with INVALID_ARGUMENT (at most "
                          "65536, the agent socket's limit).", MAX_BATCH, count_1_to(MAX_BATCH), int)
    batch_slice: int = setting("Entries of a longer list decoded, fetched (Get, GetStream) or evicted at a time: other "
                            "requests get the event loop between slices, so one request holds it for a slice's work, "
                            "not the whole batch's.", 64, count_1_to(MAX_BATCH), int)
    lookup_slice: int = setting("Digests of a longer Lookup or Overlap taken at a time (a digest costs a Lookup several "
                             "times less than an address costs a Get).", 512, count_1_to(MAX_BATCH), int)


@dataclass(frozen=True)
class AgentSection:
    socket: str = setting("Unix socket of the agent endpoint (engine-side agents); \"\" disables it.", "var/agent.sock",
                       unix_path_or_empty)
    mode: str = setting("Permission bits of the agent socket, octal (who may connect).", "0660", octal_mode)
    group: str = setting("Group that owns the agent socket (name or number); \"\" keeps the daemon's group.", "")
    heartbeat_s: float = setting("Agents send a heartbeat when idle this long; one silent for three intervals is dropped.",
                              5.0, between(0.05, 3600, " seconds"), (int, float))
    max_agents: int = setting("Most agents connected at once.", 256, between(1, 65536), int)
    max_gpu_blocks: int = setting("Most blocks the GPU view keeps per agent (pinned events beyond are refused).",
                               1_000_000, between(1, 100_000_000), int)

    @property
    def mode_bits(self) -> int:
        return int(self.mode, 8)


@dataclass(frozen=True)
class MetricsSection:
    listen: str = setting("Prometheus /metrics HTTP listener HOST:PORT; \"\" disables it.", "127.0.0.1:9464", host_port_or_empty)


@dataclass(frozen=True)
class QuicSection:
    listen: str = setting("QUIC (UDP) listener for peer pulls HOST:PORT; \"\" disables the peer tier.", "", host_port_or_empty)
    peers: list[dict[str, str]] = setting("Peer daemons: [{ name = \"node-b\", address = \"HOST:PORT\" }, ...].", [], peers)
    ca: str = setting("PEM file of the cluster CA that signs every daemon's certificate.", "")
    cert: str = setting("PEM certificate of this daemon, signed by the cluster CA.", "")
    key: str = setting("PEM private key of this daemon's certificate.", "")
    max_datagram_size: int = setting("Largest UDP datagram QUIC sends, bytes: 1350 fits any 1500-byte MTU path; "
                                  "raise it on jumbo-frame networks.", 1350, between(1200, 16000, " bytes (1200: QUIC's minimum)"), int)
    max_data_mib: float = setting("Connection flow-control window, MiB (bytes in flight per peer).", 64.0,
                               between(0.0625, 1024, " MiB"), (int, float))
    max_stream_data_mib: float = setting("Stream flow-control window, MiB (bytes in flight per pull).", 16.0,
                                      between(0.0625, 1024, " MiB"), (int, float))
    lane: str = setting("Pull payloads over a TCP lane on the QUIC port's number: tls (TLS 1.3, the cluster "
                     "certificates) or mac (plain TCP, keyed BLAKE3 seals with a key granted over QUIC: "
                     "authenticated, not encrypted, for a fabric nobody else can read); QUIC where the lane "
                     "cannot be had. quic: no lane.", "tls", one_of("tls", "mac", "quic"))
    lane_stripes: int = setting("Lane connections one large pull (16 blocks or more) is split over at once. 1 "
                             "(no striping) measured fastest on 2 cores; more may pay on hosts with many.", 1,
                             between(1, 16), int)
    lane_max_connections: int = setting("Verified lanes the lane server keeps open at once (connections in handshake "
                                     "are bounded apart, by max_handshakes and max_handshakes_per_source).", 256,
                                     count_1_to(65536), int)
    pull_timeout_s: float = setting("Deadline of a pull from peers: what has not arrived by then is a miss.", 2.0,
                                 between(0.01, 300, " seconds"), (int, float))
    hedge_ms: float = setting("A pull not finished after this long is also asked of the next peer holding the "
                           "blocks; 0 asks both at once.", 50.0, non_negative, (int, float))
    fail_limit: int = setting("Failed requests in a row that mark a peer down.", 3, between(1, 1000), int)
    backoff_s: float = setting("How long a peer marked down is left alone at first; doubles on each failed retry.",
                            1.0, positive, (int, float))
    backoff_max_s: float = setting("Longest time a peer marked down is left alone.", 60.0, positive, (int, float))
    retry: str = setting("Address validation before any connection state (docs/security.md): always (a stateless "
                      "Retry answers every new connection's first packet) or under_load (only once a quarter of "
                      "max_handshakes is taken; keeps 0-RTT resumption).", "always", one_of("always", "under_load"))
    max_handshakes: int = setting("Connections in handshake (no verified certificate or lane key yet) the QUIC server, "
                               "and apart the lane server, holds at once; when full, the oldest gives way to a "
                               "newer one (about 90 KiB each).", 64, count_1_to(65536), int)
    max_handshakes_per_source: int = setting("Connections in handshake from one source address (IPv6: one /64) at "
                                          "once, at each server (a peer opens at most 4 lanes at once).", 8,
                                          count_1_to(65536), int)
    max_connections: int = setting("Connections the server holds at once, verified peers included.", 1024,
                                count_1_to(1 << 20), int)
    handshake_timeout_s: float = setting("A connection (QUIC or lane) that has not proved its certificate or key this "
                                      "long after its first packet is dropped, with all it held.", 5.0, positive,
                                      (int, float))
    stateless_replies_per_s: float = setting("Replies to packets that hold no connection (Retry, version negotiation), "
                                          "per second; past it they are dropped unanswered.", 5000.0, positive,
                                          (int, float))


def _endpoints(v: list[Any]) -> None:
    for i, endpoint in enumerate(v):
        host_port_entry(i, endpoint)


def _member_name(v: str) -> None:
    if v and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$", v):
        raise ValueError(f"must be a certificate name (letters, digits, '.', '_', '-'), got {v!r}")


def _prefix(v: str) -> None:
    if not v.startswith("/") or len(v) > 200 or any(c in v for c in " \n\t"):
        raise ValueError(f"must be an etcd key prefix starting with '/', without spaces, got {v!r}")


@dataclass(frozen=True)
class ClusterSection:
    etcd: list[str] = setting("etcd endpoints HOST:PORT of the cluster's membership; [] (the default): no cluster, "
                           "the static quic.peers list.", [], _endpoints)
    name: str = setting("This daemon's member name: the name its certificate (quic.cert) carries. Required with etcd.",
                     "", _member_name)
    advertise: str = setting("Host (name or address) the other daemons dial this one at; \"\": quic.listen's host, "
                          "which must then not be a wildcard.", "")
    prefix: str = setting("etcd key prefix of the cluster (several clusters may share one etcd).", "/kvcached", _prefix)
    lease_s: int = setting("Lease of this daemon's registration, seconds: a daemon that dies is out of every view "
                        "this long after (2..300).", 10, between(2, 300), int)
    replicas: int = setting("Home nodes that keep the location of each block (1..8).", 2, count_1_to(8), int)
    placement_bits: int = setting("2**bits placement buckets (8..24): more balance the location records better "
                               "and cost 12 bytes of table each.", 18, between(8, 24), int)
    etcd_ca: str = setting("PEM CA that signs etcd's certificate: etcd over TLS. \"\": plaintext etcd.", "")
    etcd_cert: str = setting("PEM client certificate for etcd (with etcd_key: mutual TLS).", "")
    etcd_key: str = setting("PEM private key of etcd_cert.", "")


@dataclass(frozen=True)
class EventsSection:
    endpoint: str = setting("ZMQ PUB endpoint of the KV events (vLLM's schema: docs/events.md), \"tcp://HOST:PORT\" or "
                         "\"ipc://PATH\"; \"\" (the default) publishes none.", "", zmq_endpoint_or_empty)
    replay_endpoint: str = setting("ZMQ ROUTER endpoint where subscribers ask for batches they missed, by sequence "
                                "number; \"\": none.", "", zmq_endpoint_or_empty)
    remote: bool = setting("Allow endpoints other machines can reach (a non-loopback or wildcard address): the events "
                        "name every block this daemon holds, to anyone who connects.", False)
    topic: str = setting("Topic of each batch; {node} and {model} are filled in (llm-d reads kv@<pod>@<model>).",
                      "kv@{node}@{model}", event_topic)
    node: str = setting("This daemon's name in topics and ownership; \"\": cluster.name, else the host name.", "")
    batch_ms: float = setting("Milliseconds between batches: a block's event reaches subscribers within about one.",
                           50.0, between(1, 10_000, " ms"), (int, float))
    hwm: int = setting("Batches queued per subscriber; past it a slow subscriber misses batches (counted), never "
                    "slowing the daemon.", 10_000, between(1, 10_000_000), int)
    replay_batches: int = setting("Last batches kept for replay.", 10_000, between(1, 10_000_000), int)
    replay_mib: int = setting("Most MiB of batches kept for replay (the oldest go first).", 64, between(1, 65536), int)
    ram_medium: str = setting("medium of events about the RAM tier ({node} filled in).", "CPU", event_medium)
    ssd_medium: str = setting("medium of events about the SSD tier ({node} filled in).", "STORAGE", event_medium)


@dataclass(frozen=True)
class LogSection:
    level: str = setting("Log level: debug, info, warning or error.", "info", one_of("debug", "info", "warning", "error"))
    format: str = setting("Log format: text (key=value) or json (one object a line).", "text", one_of("text", "json"))


SECTIONS: dict[str, type] = {
    "kv": KvSection,
    "grpc": GrpcSection,
    "agent": AgentSection,
    "metrics": MetricsSection,
    "quic": QuicSection,
    "cluster": ClusterSection,
    "events": EventsSection,
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
    log: LogSection = field(default_factory=LogSection)

    @property
    def ram_bytes(self) -> int:
        return int(self.kv.ram_gib * GIB)

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
        want = {bool: "a boolean", int: "an integer", str: "a string", list: "a list"}.get(kind, "a number")
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
    for key, value in (("endpoint", e.endpoint), ("replay_endpoint", e.replay_endpoint)):
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
               ("grpc", "tls_ca")}


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
