"""A peer's Pull, answered out of this daemon's local tiers: the peer side of the store.

:func:`serve_pull` pins the asked blocks in RAM (promoting from SSD; never pulling from another
peer: a pull never starts another pull) and answers per row the block's head, a view of its bytes
and a release, or a Miss with its reason. The blocks stay pinned until their release is called
(once the answer is sent). Runs on the event loop.
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
                  peers: bool = True) -> list[Pinned | Miss]: ...
    def unpin(self, pinned: Pinned) -> None: ...
    def models(self, keys: list[bytes]) -> list[str | None]: ...
    def view(self, block: RamBlock) -> memoryview: ...

Answer = tuple[p.Block, memoryview, Callable[[], None]] | p.Miss


async def serve_pull(store: StoreLink, rows: Sequence[tuple[bytes, int]], max_payload: int,
                     counters: Any) -> list[Answer]:
    """A peer's Pull: per row a (Block head, payload view, release) or a Miss, in order. Only
    local tiers are asked (a pull never starts another pull). The blocks stay pinned until their
    release is called."""
    addresses: list[BlockAddress | None] = []
    for digest, layer in rows:
        try:
            addresses.append(BlockAddress(digest, layer))
        except ValueError:
            addresses.append(None)
    valid = [a for a in addresses if a is not None]
    results = iter(await store.pin(valid, allow_partial=True, peers=False)) if valid else iter(())
    out: list[Pinned | Miss | None] = [next(results) if address is not None else None for address in addresses]
    pinned = [r for r in out if isinstance(r, Pinned)]
    models = iter(store.models([x.block.key for x in pinned]))            # in the order of ``pinned``
    answers: list[Answer] = []
    for (digest, layer), result in zip(rows, out):
        if not isinstance(result, Pinned):
            reason = p.MissReason.NOT_FOUND
            if isinstance(result, Miss) and result.gone is GoneReason.CORRUPT:
                reason = p.MissReason.DAMAGED
            answers.append(p.Miss(digest, layer, reason))
            continue
        model = next(models)
        if result.block.length > max_payload or model is None:
            store.unpin(result)
            answers.append(p.Miss(digest, layer, p.MissReason.NOT_FOUND if model is None else p.MissReason.TOO_LARGE))
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
