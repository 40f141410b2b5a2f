"""Conversions between protobuf messages of kvcached.v1 and the daemon's own types.

One place for them: the gRPC service, the client and the CLI all name blocks the same way
(an absent ``layer`` is the cross-layer block).
"""

from __future__ import annotations

from kvcached.errors import InvalidArgument
from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import CROSS_LAYER, BlockAddress

__all__ = ["address_from_pb", "address_to_pb", "tier_name"]


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
