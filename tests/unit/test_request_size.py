"""Request size bounds (kvcached/api/request_size.py): every method of the services has one, and
the largest request each method is allowed (grpc.max_batch entries, each as large as an entry
can be) fits it, so the bounds refuse only what the count check would refuse anyway."""

from __future__ import annotations

import pytest

from kvcached.api.request_size import BATCHED, READ_ONLY_BATCHED, UNBOUNDED, largest_read_only_request, largest_request
from kvcached.config import GrpcSection
from kvcached.v1 import kvcache_pb2 as pb

MAX_LAYER = (1 << 32) - 1          # the largest layer a BlockAddress may name (its varint is longest)


def largest_allowed(method: str, n: int) -> bytes:
    """The largest well-formed request of ``method`` with ``n`` entries."""
    digests = [bytes([i % 251]) * 32 for i in range(n)]
    addresses = [pb.BlockAddress(digest=d, layer=MAX_LAYER) for d in digests]
    name = method.rsplit("/", 1)[-1]
    request = {
        "Get": lambda: pb.GetRequest(addresses=addresses, allow_partial=True),
        "GetStream": lambda: pb.GetRequest(addresses=addresses, allow_partial=True),
        "Delete": lambda: pb.DeleteRequest(addresses=addresses),
        "Lookup": lambda: pb.LookupRequest(digests=digests, layer=MAX_LAYER),
        "Overlap": lambda: pb.OverlapRequest(digests=digests),
        "Evict": lambda: pb.EvictRequest(model="m" * 1024, digests=digests, layer=MAX_LAYER, tier=pb.TIER_SSD),
    }[name]()
    return bytes(request.SerializeToString())


def every_method() -> set[str]:
    return {f"/{service.full_name}/{m.name}" for service in pb.DESCRIPTOR.services_by_name.values()
            for m in service.methods}


@pytest.mark.parametrize("max_batch", [1, 512, GrpcSection().max_batch])
@pytest.mark.parametrize("method", sorted(BATCHED))
def test_the_largest_allowed_request_of_each_batched_method_fits_its_bound(method: str, max_batch: int) -> None:
    size = len(largest_allowed(method, max_batch))
    bound = largest_request(method, max_batch)
    assert bound is not None and size <= bound
    if method in READ_ONLY_BATCHED:
        assert size <= largest_read_only_request(max_batch)


def test_every_method_has_a_bound_and_only_puts_go_unbounded() -> None:
    methods = every_method()
    assert BATCHED <= methods and UNBOUNDED <= methods
    assert {m for m in methods if largest_request(m, 65536) is None} == UNBOUNDED
    small = {m for m in methods - BATCHED - UNBOUNDED}
    assert "/kvcached.v1.KvCache/ListBlocks" in small and "/kvcached.v1.Admin/GetConfig" in small
    assert largest_read_only_request(65536) < 8 << 20          # the read-only listener's limit: a few MiB
