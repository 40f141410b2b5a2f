"""The daemon configuration's sections: every key, declared once with its type, default and
check (kvcached.config loads them; config/kvcached.toml documents the same keys, and a test keeps
the two in step)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvcached.codecs import CODECS
from kvcached.config.values import (
    between,
    certificate_names,
    count_1_to,
    event_medium,
    event_topic,
    host_port_entry,
    host_port_or_empty,
    listen_list,
    non_negative,
    octal_mode,
    one_of,
    parse_listen,
    path,
    path_or_empty,
    peers,
    positive,
    setting,
    tenant_event_endpoints,
    tenant_ids,
    tenant_name_or_empty,
    tenant_names,
    tenant_shares,
    tenant_sockets,
    unix_path_or_empty,
    zmq_endpoint_or_empty,
)
from kvcached.host.shared_memory import ARENA_BACKINGS
from kvcached.policies.admission import ADMISSION_POLICIES
from kvcached.policies.prefetch import PREFETCH_POLICIES
from kvcached.policies.slru import MAX_RATIO
from kvcached.policies.write import WRITE_POLICIES
from kvcached_agent.protocol import MAX_BATCH

__all__ = ["AgentSection", "ClusterSection", "EventsSection", "GrpcSection", "KvSection", "LogSection", "MetricsSection",
           "QuicSection", "TenantsSection"]



@dataclass(frozen=True)
class KvSection:
    ram_gib: float = setting("Size of the shared-memory RAM arena that holds block bytes, GiB.", 1.0, positive, (int, float))
    max_block_mib: float = setting("Largest block payload accepted, MiB; also the arena's slab size.", 16.0, positive, (int, float))
    arena: str = setting("Where the RAM tier's arenas live: memfd (anonymous memory; kept across a crash by systemd's fd "
                         "store) or file (files in arena_dir on a tmpfs or hugetlbfs mount, kept across a crash and a "
                         "pod's replacement wherever the mount outlives the process).", "memfd", one_of(*ARENA_BACKINGS))
    arena_dir: str = setting("Directory of the arena files under arena = file: a tmpfs or hugetlbfs mount, the daemon's "
                             "alone (0700).", "var/arena", path)
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
    ssd_codec: str = setting("What SSD block files hold (docs/codecs.md): none (the payload as it is), a lossless "
                             "codec: planes-zstd (16-bit KV's bytes split into planes, then zstd), or auto (planes-zstd "
                             "where the read time it saves beats its decoding, measured on this disk and these cores).",
                             "none", one_of("none", "auto", *sorted(CODECS)))
    ssd_codec_margin: float = setting("Least fraction of a block ssd_codec must save; a block it shrinks less is stored "
                                      "raw.", 0.1, between(0, 0.9), (int, float))
    ssd_io_threads: int = setting("Threads doing SSD I/O (blocks in flight at once).", 8, between(1, 256), int)
    hash_threads: int = setting("Threads checksumming saved blocks (BLAKE3; 0: one per CPU this daemon may run on, "
                                "16 at most).", 0, between(0, 256, zero="0 (one per CPU, 16 at most)"), int)
    index_dir: str = setting("RocksDB directory of the persistent block index.", "var/index", path)
    mirror_pulls: bool = setting("Keep a local copy of blocks pulled from peers.", True)
    curves: bool = setting("Keep live miss-ratio curves of the RAM and SSD tiers (kvcached mrc, docs/operations.md).",
                           True)
    curve_sample_keys: int = setting("Keys the live curves' miniature copies of a tier hold at most, in all (their memory: "
                                     "some 600 bytes a key; fewer sample fewer keys of a large tier).",
                                     32768, between(256, 1 << 22), int)
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


def _ucx_transports(v: list[str]) -> None:
    for item in v:
        if not re.fullmatch(r"[a-z0-9_]+(:[a-z0-9_]+)?", item):
            raise ValueError(f"UCX transport names such as \"tcp\", \"rc\", \"sm\"; got {item!r}")


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
    health_listen: str = setting("A plaintext gRPC listener HOST:PORT serving the standard health service alone "
                                 "(grpc.health.v1: Kubernetes' gRPC probes); \"\": none.", "", host_port_or_empty)
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
    link_codec: str = setting("Blocks pulled over a lane coded for the wire (docs/codecs.md): auto (planes-zstd where "
                              "it measures faster than raw from that peer: a link slower than the codec), none, or a "
                              "codec asked for on every pull (planes-zstd). The holder sends raw each block the codec "
                              "does not shrink; lossless, so a pulled block is the same bytes either way.", "auto",
                              one_of("none", "auto", *sorted(CODECS)))
    lane_stripes: int = setting("Lane connections one large pull (16 blocks or more) is split over at once. 1 "
                             "(no striping) measured fastest on 2 cores; more may pay on hosts with many.", 1,
                             between(1, 16), int)
    lane_max_connections: int = setting("Verified lanes the lane server keeps open at once (connections in handshake "
                                     "are bounded apart, by max_handshakes and max_handshakes_per_source).", 256,
                                     count_1_to(65536), int)
    nixl: bool = setting("Serve the NIXL lane (docs/peers.md): peers read pinned blocks straight from this daemon's "
                      "arena by NIXL (RDMA where there is an RDMA NIC, else UCX over TCP or shared memory), told "
                      "where and what checksum over the QUIC session. Needs NIXL (make nixl); where it cannot "
                      "start, the daemon runs without it and says why.", False)
    nixl_transports: list[str] = setting("UCX transports of the NIXL lane (UCX_TLS), e.g. [\"rc\", \"ud\", \"sm\", "
                                      "\"self\"] for InfiniBand or RoCE, [\"tcp\", \"sm\"] on one host; [] lets "
                                      "UCX choose.", [], _ucx_transports)
    nixl_hold_s: float = setting("How long blocks a peer was told to read over NIXL stay pinned at most, if it "
                              "never says it is done.", 10.0, between(0.1, 300, " seconds"), (int, float))
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
    route_keys_mib: int = setting("Most MiB of engine keys (Route frames) of blocks agents are about to save, held "
                                  "until the saves reserve them (60 s at most); a quarter of it per agent connection, "
                                  "the oldest going first.", 64, between(1, 65536), int)
    replay_clients_mib: int = setting("Most MiB replay clients together may make the daemon hold beyond the kept "
                                      "batches (their connections, their queued messages, batches they hold that "
                                      "replay no longer keeps); past it the replay endpoint is reset.", 64,
                                      between(8, 65536), int)
    ram_medium: str = setting("medium of events about the RAM tier ({node} filled in).", "CPU", event_medium)
    ssd_medium: str = setting("medium of events about the SSD tier ({node} filled in).", "STORAGE", event_medium)


@dataclass(frozen=True)
class LogSection:
    level: str = setting("Log level: debug, info, warning or error.", "info", one_of("debug", "info", "warning", "error"))
    format: str = setting("Log format: text (key=value) or json (one object a line).", "text", one_of("text", "json"))


@dataclass(frozen=True)
class TenantsSection:
    default: str = setting("Tenant of agents that uids and gids do not name; \"\" refuses them. The tenant called "
                           "\"default\" owns every block stored before tenants were configured.", "default",
                           tenant_name_or_empty)
    uids: dict[str, list[int]] = setting("Tenants by the agent process's uid (the kernel's word, SO_PEERCRED): "
                                         "{ alice = [1001], bob = [1002, 1003] }.", {}, tenant_ids, dict)
    gids: dict[str, list[int]] = setting("Tenants by the agent process's gid, for uids that uids does not name: "
                                         "{ ml = [2000] }.", {}, tenant_ids, dict)
    key_file: str = setting("The 32-byte key that makes each tenant's block addresses its own, created (0600) if "
                            "missing; every node of a cluster needs the same file. \"\": tenants.key in kv.index_dir.",
                            "", path_or_empty)
    sockets: dict[str, str] = setting("gRPC Unix sockets bound to one tenant each, the full API: { alice = "
                                      "\"/run/kvcached/alice.sock\" }. The kernel admits only the tenant's uids and "
                                      "gids (the socket's ACL) and every call on it acts as that tenant.", {},
                                      tenant_sockets, dict)
    agent_sockets: dict[str, str] = setting("Agent sockets bound to one tenant each: { alice = "
                                            "\"/run/kvcached/tenants/alice/agent.sock\" }. An agent that connects "
                                            "through one is that tenant (one whose uid or gid names another tenant is "
                                            "refused); mode and group as agent.mode and agent.group. In Kubernetes each "
                                            "socket's directory is mounted into its tenant's pods alone.", {},
                                            tenant_sockets, dict)
    certs: dict[str, list[str]] = setting("Tenants by client certificate on mutual-TLS gRPC listeners (grpc.tls): "
                                          "{ alice = [\"alice-engine\"] }, names as cert_field says. {}: every "
                                          "certificate the CA signed is the operator's, as before tenants.", {},
                                          tenant_names, dict)
    events: dict[str, str] = setting("KV event streams of one tenant's blocks each (kvcached.events), \"ipc://PATH\" "
                                     "only: { alice = \"ipc:///run/kvcached/alice-events\" }. The kernel admits only "
                                     "the tenant's uids and gids (the socket's ACL), as for sockets.", {},
                                     tenant_event_endpoints, dict)
    ram_shares: dict[str, float | int] = setting(
        "RAM each tenant keeps for itself, a fraction of kv.ram_gib (0.25) or bytes (1073741824): { alice = 0.5 }. "
        "Unused room is lent; a tenant over its share evicts its own blocks first and never another's within its "
        "share. {}: no shares.", {}, tenant_shares, dict)
    seal_ssd: bool = setting("Seal every SSD block file with AES-256-GCM under a key of its tenant's own, derived from "
                             "key_file (docs/codecs.md): a disk without that file, or another tenant's key, reads "
                             "nothing.", False)
    ssd_shares: dict[str, float | int] = setting(
        "SSD each tenant keeps for itself, a fraction of kv.ssd_gib (0.25) or bytes of block files: { alice = 0.5 }. "
        "Unused room is lent; eviction for room takes only blocks of tenants over their shares. {}: no shares.", {},
        tenant_shares, dict)
    event_replays: dict[str, str] = setting("Replay endpoints of the tenants' own streams (as events.replay_endpoint), "
                                            "ipc:// only, admitting the tenant alone: { alice = "
                                            "\"ipc:///run/kvcached/alice-replay\" }.", {}, tenant_event_endpoints, dict)
    cert_field: str = setting("What names a client certificate: san (its DNS subjectAltNames) or cn (its common "
                              "name).", "san", one_of("san", "cn"))
    operators: list[str] = setting("Client certificate names that act as the operator (any tenant, named by the "
                                   "kvcached-tenant header) when certs is set.", [], certificate_names, list)
