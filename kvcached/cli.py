"""The ``kvcached`` command: run the daemon, and inspect or change a running one.

Exit codes: 0 success, 1 the daemon answered with an error (or a fetched block failed its
checksum), 2 bad usage or configuration (one line naming the key and the problem).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

DEFAULT_CONFIG = "config/kvcached.toml"


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH", help=f"TOML config file (default: {DEFAULT_CONFIG} if it exists, else built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key; VALUE is read as TOML (repeatable), e.g. --set kv.ram_gib=2")


def _client_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--target", help="daemon address in gRPC syntax (unix:PATH or HOST:PORT); "
                                    "default: the first grpc.listen of the config, or $KVCACHED_TARGET")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--tenant", help="act as this tenant (the operator may name any; docs/security.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcached", description="Tiered KV-cache daemon for LLM inference engines.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon in the foreground")
    _config_args(p)
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as JSON and exit")
    p.add_argument("--takeover", action="store_true",
                   help="take over from the daemon running on this configuration: its RAM tier and listening "
                        "sockets, with no gap for clients (docs/operations.md)")
    p.add_argument("--rolling", action="store_true",
                   help="take over from a daemon running on this configuration if one answers, else start on its "
                        "own; after handing over, wait for SIGTERM (a Kubernetes pod's rolling update: "
                        "docs/kubernetes.md)")

    p = sub.add_parser("upgrade", help="replace the running daemon with the code installed now, keeping its RAM "
                                       "tier and sockets (docs/operations.md)")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = sub.add_parser("stat", help="daemon counters and tier occupancy")
    _client_args(p)

    p = sub.add_parser("ls", help="list blocks in the index")
    _client_args(p)
    p.add_argument("--model", default="", help="only blocks of this model")
    p.add_argument("--tier", choices=["ram", "ssd", "gone"], help="only blocks in this tier (gone: metadata only)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default 100; 0: all)")

    p = sub.add_parser("put", help="store a file as one block")
    _client_args(p)
    p.add_argument("address", help="block address: 64 hex digits, optionally :LAYER (default: cross-layer)")
    p.add_argument("file", help="payload file ('-' for stdin)")
    p.add_argument("--model", default="", help="model label for listing")

    p = sub.add_parser("get", help="fetch one block into a file (checksum verified)")
    _client_args(p)
    p.add_argument("address", help="block address: 64 hex digits, optionally :LAYER")
    p.add_argument("file", help="output file ('-' for stdout)")

    p = sub.add_parser("rm", help="delete blocks")
    _client_args(p)
    p.add_argument("addresses", nargs="+", help="block addresses")

    p = sub.add_parser("mrc", help="the tiers' live miss-ratio curves: hit rate at other sizes, and MIN's "
                                   "(docs/operations.md)")
    _client_args(p)
    p.add_argument("--plot", metavar="FILE.svg", help="also write them as a plot there")

    p = sub.add_parser("drop", help="drop a model's blocks, or these blocks, from a tier or all (Admin Evict)")
    _client_args(p)
    p.add_argument("addresses", nargs="*", help="block addresses (one layer), instead of --model")
    p.add_argument("--model", default="", help="every block of this model")
    p.add_argument("--tier", choices=["ram", "ssd"], help="only the copies in this tier (ram: those also on SSD)")

    p = sub.add_parser("certs", help="create the cluster CA and node certificates for peers (docs/peers.md)")
    p.add_argument("--dir", default="var/certs", help="where the CA and certificates live (default var/certs)")
    p.add_argument("--days", type=int, default=825, help="validity of new node certificates, days (default 825)")
    p.add_argument("--san", action="append", default=[], metavar="NODE=NAME_OR_IP",
                   help="an extra DNS name or IP address in NODE's certificate (repeatable)")
    p.add_argument("nodes", nargs="*", help="node names to issue certificates for (the CA is made if missing)")

    p = sub.add_parser("sim", help="replay synthetic workloads or trace files (--trace) against the eviction "
                       "policies and Belady's MIN: block and prefix hits (docs/policies.md)")
    from kvcached.sim.__main__ import add_arguments
    add_arguments(p)

    p = sub.add_parser("hash", help="print the block digests of a token sequence (docs/addressing.md)")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--block-tokens", type=int, required=True)
    p.add_argument("--namespace", default="")
    p.add_argument("tokens", nargs="+", type=int, help="token ids")
    return parser


def _die(code: int, message: str) -> int:
    print(f"kvcached: {message}", file=sys.stderr)
    return code


def _load(args: argparse.Namespace):
    from kvcached.config import load_config

    path = args.config
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    return load_config(path, args.overrides)


def _target(args: argparse.Namespace) -> str:
    if args.target:
        return args.target
    if os.environ.get("KVCACHED_TARGET"):
        return os.environ["KVCACHED_TARGET"]
    return _load(args).grpc.listen[0]


def _serve(args: argparse.Namespace) -> int:
    from kvcached.config import as_mapping

    config = _load(args)
    if args.print_config:
        print(json.dumps(as_mapping(config), indent=2))
        return 0
    from kvcached.host.logs import setup_logging
    from kvcached.lifecycle.daemon import serve

    setup_logging(config.log.level, config.log.format)
    argv = [sys.executable, "-m", "kvcached.cli", *sys.argv[1:]]
    return serve(config, reload=lambda: _load(args), takeover=args.takeover, rolling=args.rolling, argv=argv)


def _upgrade(args: argparse.Namespace) -> int:
    """Ask the running daemon to start its successor and hand over; print how it went."""
    from kvcached.lifecycle.handover import HandoverBroken, handover_path, request_upgrade

    config = _load(args)
    try:
        answer = request_upgrade(handover_path(config.kv.index_dir))
    except HandoverBroken as exc:
        return _die(1, f"upgrade: {exc}")
    if args.json:
        print(json.dumps(answer))
    elif answer.get("op") == "upgraded" and answer.get("ok"):
        print(f"upgraded: pid {answer['pid']} serves now (handover {answer['elapsed_s']:.3f} s, "
              f"{answer['total_s']:.3f} s with its start)")
    else:
        print(f"upgrade failed: {answer.get('reason', answer)}", file=sys.stderr)
    return 0 if answer.get("op") == "upgraded" and answer.get("ok") else 1


def _certs(args: argparse.Namespace) -> int:
    from kvcached.peers.certs import CertError, make_cluster

    extra: dict[str, list[str]] = {}
    for item in args.san:
        node, sep, name = item.partition("=")
        if not sep or not node or not name:
            return _die(2, f"--san expects NODE=NAME_OR_IP, got {item!r}")
        if node not in args.nodes:
            return _die(2, f"--san {item}: {node!r} is not one of the nodes named")
        extra.setdefault(node, []).append(name)
    if not 1 <= args.days <= 3650:
        return _die(2, f"--days must be in 1..3650, got {args.days}")
    try:
        files, done = make_cluster(Path(args.dir), args.nodes, extra, args.days)
    except CertError as exc:
        return _die(1, str(exc))
    for line in done or ["nothing to do: the CA and every certificate named exist"]:
        print(line)
    for name, (cert, key) in files.nodes.items():
        print(f"\n# {name}: in its kvcached.toml\n[quic]\nca = \"{files.ca}\"\ncert = \"{cert}\"\nkey = \"{key}\"")
    return 0


def _iso(ts) -> str:
    return datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, timezone.utc).isoformat(timespec="seconds")


def _client_command(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from kvcached.api.convert import address_from_pb
    from kvcached.client import KvCacheClient
    from kvcached.v1 import kvcache_pb2 as pb
    from kvcached_agent.address import BlockAddress

    def parse(text: str) -> BlockAddress:
        try:
            return BlockAddress.parse(text)
        except ValueError as exc:
            raise SystemExit(_die(2, f"bad address {text!r}: {exc}"))

    with KvCacheClient(_target(args), tenant=args.tenant) as client:
        if args.command == "stat":
            s = client.stats()
            if args.json:
                print(json.dumps(MessageToDict(s, preserving_proto_field_name=True), indent=2))
                return 0
            print(f"kvcached {s.version}, up {s.uptime_seconds:.0f} s, index entries ~{s.index_entries}")
            for t in s.tiers:
                print(f"  {pb.Tier.Name(t.tier)[5:].lower():5} {t.blocks} blocks, {t.bytes} bytes "
                      f"of {t.capacity_bytes} ({t.evictions} evictions)")
            print(f"  puts {s.puts}, hits {s.hits}, misses {s.misses}, lookups {s.lookups}, deletes {s.deletes}")
            if any(t.tier == pb.TIER_SSD for t in s.tiers):
                print(f"  ssd: {s.promotions} promotions, {s.demotions} demotions, {s.ram_dirty_bytes} dirty bytes in RAM, "
                      f"{s.dirty_dropped} dropped dirty, {s.ssd_corrupt} corrupt, {s.ssd_write_errors} write errors"
                      f"{'' if s.ssd_reconciled else ', boot reconcile running'}")
            print(f"  agents: {s.agents} connected, {s.agent_held_bytes} bytes held, {s.gpu_blocks} blocks in the GPU view")
            print(f"  threads: {s.hash_threads} checksumming saved blocks"
                  + (f", {s.ssd_io_threads} for SSD I/O" if s.ssd_io_threads else ""))
            if s.loads_skipped_ssd or s.loads_skipped_peer:
                print(f"  load plans skipped {s.loads_skipped_ssd} SSD and {s.loads_skipped_peer} peer blocks "
                      "as slower to load than to recompute")
            for peer in s.peers:
                state = ("up" if peer.up else "down") + (", connected" if peer.connected else "")
                error = f", last error: {peer.last_error}" if peer.last_error else ""
                print(f"  peer {peer.name}: {state}, {peer.blocks} blocks announced{error}")
            if s.peers:
                print(f"  peer pulls: {s.peer_pulled} blocks ({s.peer_pulled_bytes} bytes), {s.peer_missed} missed, "
                      f"{s.peer_corrupt} corrupt, {s.peer_failed} failed, {s.peer_hedged} hedged, "
                      f"{s.peer_lane_pulls} over the lane ({s.peer_lane_fallbacks} fell back to QUIC); "
                      f"served {s.peer_served} ({s.peer_served_bytes} bytes)")
        elif args.command == "ls":
            tier = {None: pb.TIER_UNSPECIFIED, "ram": pb.TIER_RAM, "ssd": pb.TIER_SSD, "gone": pb.TIER_GONE}[args.tier]
            for info in client.list_blocks(model=args.model, tier=tier, limit=args.limit or None):
                address = address_from_pb(info.address)
                if args.json:
                    print(json.dumps(MessageToDict(info, preserving_proto_field_name=True)))
                else:
                    where = ",".join(pb.Tier.Name(t)[5:].lower() for t in info.tiers) or f"gone ({info.gone_reason})"
                    owner = f"  tenant {info.tenant}" if info.tenant else ""
                    print(f"{address}  {info.nbytes:>10}  {info.model or '-'}  {where}  last seen "
                          f"{_iso(info.last_seen)}{owner}")
        elif args.command == "put":
            address = parse(args.address)
            data = sys.stdin.buffer.read() if args.file == "-" else open(args.file, "rb").read()
            r = client.put_stream([(address, data)], model=args.model)
            print(json.dumps({"stored": r.stored, "already_present": r.already_present}) if args.json
                  else f"{address}: {'stored' if r.stored else 'already present'} ({len(data)} bytes)")
        elif args.command == "get":
            address = parse(args.address)
            found, _ = client.get_stream([address])
            payload = found[0].payload
            if args.file == "-":
                sys.stdout.buffer.write(payload)
            else:
                with open(args.file, "wb") as fh:
                    fh.write(payload)
                print(f"{address}: {len(payload)} bytes, checksum ok", file=sys.stderr)
        elif args.command == "mrc":
            return _print_curves(client.stats(), args.json, args.plot)
        elif args.command == "drop":
            addresses = [parse(a) for a in args.addresses]
            if bool(addresses) == bool(args.model) or len({a.layer for a in addresses}) > 1:
                raise SystemExit(_die(2, "drop: name a --model or block addresses of one layer, not both"))
            tier = {None: pb.TIER_UNSPECIFIED, "ram": pb.TIER_RAM, "ssd": pb.TIER_SSD}[args.tier]
            e = client.evict(model=args.model, digests=[a.digest for a in addresses],
                             layer=addresses[0].layer if addresses else None, tier=tier)
            print(json.dumps({"evicted": e.evicted, "busy": e.busy, "not_found": e.not_found}) if args.json
                  else f"evicted {e.evicted}, busy {e.busy}, not found {e.not_found}")
        elif args.command == "rm":
            r = client.delete([parse(a) for a in args.addresses])
            print(json.dumps({"deleted": r.deleted, "not_found": r.not_found}) if args.json
                  else f"deleted {r.deleted}, not found {r.not_found}")
    return 0


_MORE = {"cap": "the sample is at its cap of one key in 8; more keys in the traffic give more",
         "budget": "the curves' budget (1% of the daemon's CPU) holds the sample there at this traffic; it grows as "
                   "the traffic falls",
         "memory": "[kv] curve_sample_keys bounds the copies; a larger one gives more (some 600 bytes a key)",
         "": "more traffic gives more"}


def _print_curves(stats: Any, as_json: bool, plot: str | None) -> int:
    """``kvcached mrc``: the curves of Stats as a table (or JSON), and a plot."""
    from google.protobuf.json_format import MessageToDict

    from kvcached.policies.curves import MIN_COPY
    from kvcached.sim.replay import Result
    from kvcached.sim.report import svg
    from kvcached.v1 import kvcache_pb2 as pb

    if not stats.HasField("curves"):
        return _die(1, "mrc: no curves in this daemon's Stats: either it keeps none (kv.curves = false) or this "
                       "connection acts as a tenant, and the curves, which cover every tenant's traffic, are the "
                       "operator's to read (the operator's socket or certificate)")
    c = stats.curves
    if as_json:
        print(json.dumps(MessageToDict(c, preserving_proto_field_name=True), indent=2))
    results = []
    for tier in (pb.TIER_RAM, pb.TIER_SSD):
        points = [p for p in c.points if p.tier == tier]
        if not points:
            continue
        name = pb.Tier.Name(tier)[5:]
        one = next((p.size_blocks for p in points if p.size_multiple == 1.0), 0)
        worst = max((max(p.error, p.min_error) for p in points), default=0.0)
        shown = all(p.known for p in points) and worst <= c.accuracy
        if not as_json:
            print(f"{name} tier ({points[0].policy}): {one} blocks of the mean size seen; hit rate by size")
            print(f"  from {points[0].window_uses} sampled uses of {points[0].window_keys} keys: ", end="")
            if not points[0].known:
                print("nothing sampled yet")
            elif not shown:
                small = min(p.copy_entries for p in points) < MIN_COPY
                print("too few for a curve (" + (f"copies of {min(p.copy_entries for p in points)} keys at the smallest size, "
                      f"under the {MIN_COPY} a figure needs" if small else f"the figures could be {worst:.3f} off, more than "
                      f"the {c.accuracy:g} a curve is shown within") + f"): {_MORE[c.rate_limited_by]}")
            else:
                print(f"every figure within {worst:.3f} (about 95% of the time)")
                print(f"  {'size':>6}  {'blocks':>10}  {points[0].policy:>8}  {'MIN':>6}")
                for p in points:
                    print(f"  {p.size_multiple:>5g}x  {p.size_blocks:>10}  {p.hit_rate:8.3f}  {p.min_hit_rate:6.3f}")
        if shown:
            results.append(Result(f"{name} tier (live)", c.sampled_accesses, one, [max(1, p.size_blocks) for p in points],
                                  {points[0].policy: [p.hit_rate for p in points],
                                   "belady": [p.min_hit_rate for p in points]}))
    if not as_json:
        print(f"from {c.accesses} block uses, {c.sampled_accesses} of them of the {c.sampled_keys} keys sampled "
              f"({c.sampling_rate:.2%} of keys); figures over the recent window, computed {c.figures_age_seconds:.0f} s ago")
        print(f"what they took since start: {c.busy_seconds:.3f} s counting uses (on the event loop), "
              f"{c.min_busy_seconds:.3f} s computing the figures")
    if plot and results and all(r.unique for r in results):
        Path(plot).write_text(svg(results, "kvcached: hit rate at other tier sizes (live)", "size (multiple of the tier)",
                                  "{:g}x"))
        print(f"plot: {plot}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvcached.config import ConfigError

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "upgrade":
            return _upgrade(args)
        if args.command == "certs":
            return _certs(args)
        if args.command == "sim":
            from kvcached.sim.__main__ import execute

            return execute(args)
        if args.command == "hash":
            from kvcached_agent.address import chain_digests

            for d in chain_digests(args.tokens, args.block_tokens, model=args.model, dtype=args.dtype,
                                   namespace=args.namespace):
                print(d.hex())
            return 0
        return _client_command(args)
    except ConfigError as exc:
        return _die(2, str(exc))
    except ValueError as exc:
        return _die(2, str(exc))
    except OSError as exc:
        return _die(1, f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    except Exception as exc:  # grpc errors and checksum mismatches
        import grpc

        from kvcached.client import ChecksumMismatch

        if isinstance(exc, grpc.RpcError):
            return _die(1, f"{exc.code().name}: {exc.details()}")
        if isinstance(exc, ChecksumMismatch):
            return _die(1, str(exc))
        raise


if __name__ == "__main__":
    sys.exit(main())
