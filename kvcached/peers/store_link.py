"""A peer's Pull, answered out of this daemon's local tiers: the peer side of the store.

:func:`serve_pull` pins the asked blocks in RAM (promoting from SSD; never pulling from another
peer: a pull never starts another pull) and answers per row the block's head, a view of its bytes
and a release, or a Miss with its reason. The blocks stay pinned until their release is called
(once the answer is sent). Runs on the event loop.

A Pull names whose blocks it asks for (the tenant); a block whose index record names another
tenant is answered NOT_FOUND, as a block never stored, and counted (``other_tenant``). A
tenant's addresses are keyed by the tenant key (kvcached.tenants), so a member with that key
asks only for its own; this check is the holder's own, as the checksum is: a member that maps a
tenant wrongly still gets none of another tenant's blocks.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from kvcached.index import GoneReason
from kvcached.peers import protocol as p
from kvcached.store.inflight import release_view
from kvcached.store.results import Miss, Pinned
from kvcached.tiers.ram import RamBlock
from kvcached_agent.address import BlockAddress

__all__ = ["StoreLink", "serve_pull"]


class StoreLink(Protocol):
    """What the peer side asks of the store (kvcached.store.Store), and nothing more."""

    def present_wire_keys(self) -> list[bytes]: ...
    def local_prefix(self, digests: Sequence[bytes], layer: int) -> int: ...
    async def pin(self, addresses: Sequence[BlockAddress], *, allow_partial: bool = False,
                  peers: bool = True, tenant: str | None = "") -> list[Pinned | Miss]: ...
    def unpin(self, pinned: Pinned) -> None: ...
    def owners(self, keys: list[bytes]) -> list[tuple[str, str] | None]: ...
    def view(self, block: RamBlock) -> memoryview: ...

Answer = tuple[p.Block, memoryview, Callable[[], None]] | p.Miss


async def serve_pull(store: StoreLink, rows: Sequence[tuple[bytes, int]], max_payload: int,
                     counters: Any, tenant: str = "") -> list[Answer]:
    """A peer's Pull of ``tenant``'s blocks (a Tenant.tag): per row a (Block head, payload view,
    release) or a Miss, in order. Only local tiers are asked (a pull never starts another pull).
    The blocks stay pinned until their release is called."""
    addresses: list[BlockAddress | None] = []
    for digest, layer in rows:
        try:
            addresses.append(BlockAddress(digest, layer))
        except ValueError:
            addresses.append(None)
    valid = [a for a in addresses if a is not None]
    # Pinned as the operator's read (tenant None): whose each block is, is checked below, so a
    # block of another tenant is counted as the peer tier's (``other_tenant``) and never sent.
    results = iter(await store.pin(valid, allow_partial=True, peers=False, tenant=None)) if valid else iter(())
    out: list[Pinned | Miss | None] = [next(results) if address is not None else None for address in addresses]
    pinned = [r for r in out if isinstance(r, Pinned)]
    owners = iter(store.owners([x.block.key for x in pinned]))            # in the order of ``pinned``
    answers: list[Answer] = []
    for (digest, layer), result in zip(rows, out):
        if not isinstance(result, Pinned):
            reason = p.MissReason.NOT_FOUND
            if isinstance(result, Miss) and result.gone is GoneReason.CORRUPT:
                reason = p.MissReason.DAMAGED
            answers.append(p.Miss(digest, layer, reason))
            continue
        owner = next(owners)
        if owner is None or owner[1] != tenant:
            store.unpin(result)
            counters.other_tenant += owner is not None
            answers.append(p.Miss(digest, layer, p.MissReason.NOT_FOUND))
            continue
        model = owner[0]
        if result.block.length > max_payload:
            store.unpin(result)
            answers.append(p.Miss(digest, layer, p.MissReason.TOO_LARGE))
            continue
        view = store.view(result.block)
        counters.served += 1
        counters.served_bytes += result.block.length
        answers.append((p.Block(digest, layer, model, result.block.length, result.checksum), view,
                        _releaser(store, result, view)))
    return answers


def _releaser(store: StoreLink, pinned: Pinned, view: memoryview) -> Callable[[], None]:
    def release() -> None:
        release_view(view)
        store.unpin(pinned)
    return release
