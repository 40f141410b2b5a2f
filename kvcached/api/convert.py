"""Conversions between protobuf messages of kvcached.v1 and the daemon's own types.

One place for them: the gRPC service, the client and the CLI all name blocks the same way
(an absent ``layer`` is the cross-layer block).
"""

from __future__ import annotations

from kvcached.errors import InvalidArgument
from kvcached.policies.curves import ACCURACY, MissRatioCurves
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import CROSS_LAYER, BlockAddress

__all__ = ["address_from_pb", "address_to_pb", "curve_stats", "tier_name"]


def address_from_pb(msg: pb.BlockAddress, where: str = "address") -> BlockAddress:
    """The BlockAddress of ``msg``; InvalidArgument naming ``where`` if it is malformed."""
    layer = msg.layer if msg.HasField("layer") else CROSS_LAYER
    try:
        return BlockAddress(msg.digest, layer)
    except ValueError as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


def address_to_pb(address: BlockAddress) -> pb.BlockAddress:
    if address.layer == CROSS_LAYER:
        return pb.BlockAddress(digest=address.digest)
    return pb.BlockAddress(digest=address.digest, layer=address.layer)


def tier_name(value: int) -> str:
    """``TIER_RAM`` for a known enum value, the number for any other (proto3 accepts any)."""
    return pb.Tier.Name(value) if value in pb.Tier.values() else str(value)


_CURVE_TIERS = {"ram": pb.TIER_RAM, "ssd": pb.TIER_SSD}


def curve_stats(curves: MissRatioCurves) -> pb.CurveStats:
    """The live curves as Stats carries them (computed from the window if the last figures are
    old: call it off the event loop)."""
    points = curves.points()
    return pb.CurveStats(
        points=[pb.CurvePoint(tier=_CURVE_TIERS[p.tier], policy=p.policy, size_multiple=p.multiple, size_blocks=p.blocks,
                              hit_rate=p.hit_rate or 0.0, min_hit_rate=p.min_hit_rate or 0.0, known=p.hit_rate is not None,
                              error=p.error or 0.0, min_error=p.min_error or 0.0, window_uses=p.uses, window_keys=p.keys,
                              copy_entries=p.entries)
                for p in points],
        sampled_keys=len(curves.sample), sampling_rate=curves.sample.rate, accesses=curves.accesses,
        sampled_accesses=curves.sampled, busy_seconds=curves.busy_s, min_busy_seconds=curves.min_busy_s,
        accuracy=ACCURACY, figures_age_seconds=curves.figures_age, rate_limited_by=curves.limited_by)
