"""Saves and loads of one protocol batch, in chunks whose round trips overlap the copies.

A save asks the daemon for slots (Allocate), copies the blocks into them and commits them
(Commit); a load asks for the blocks' places (Load), copies them out and releases them. Done
whole, a batch of 64 blocks of 1 MiB waited some 2.3 ms for its slots and 0.8 ms for its
commit around a 7 ms copy: the daemon's work per block (its index, its policy, its records)
sat between the engine and its copy. Here a batch goes in chunks (:func:`chunks`): the request
of the next chunk is in flight while this one's bytes are copied, so the daemon reserves (or
pins) on its own core while the engine copies on this one, and only the first chunk's request
is waited for. That first chunk is small (``FIRST_CHUNK_BYTES``) and each next one up to
``GROWTH`` times bigger, up to ``CHUNK_BYTES``: the daemon answers for a block several times
faster than its bytes are copied (some 10-25 us a block against ~70 us a MiB on a 2-core
machine), so the next chunk's request is ready by the end of this chunk's copy while the wait
for the first is as short as can be. A save sends one Commit
of every chunk's slots after the last copy: committed chunk by chunk, the daemon's checksums of
one chunk competed with the next one's copy on a 2-core machine (bench/README.md). A loaded
chunk is released as soon as it is copied.

What a block goes through is unchanged: a saved block is in the daemon's arena before its
Commit is sent, and the daemon checks it before any load may see it; a loaded block is pinned
from its Load until its Release, which follows its copy. A copy that fails releases every slot
or pin of the batch, the request in flight included. Blocks of a few KiB make one chunk of the
whole batch, as before: their requests cost more than their copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from kvcached_agent import protocol as p
from kvcached_agent.address import BlockAddress
from kvcached_agent.client import AgentClient, AgentError, ConnectionClosed
from kvcached_agent.copy import ArenaCopier, PageRows, Piece

__all__ = ["Block", "CHUNK_BYTES", "FIRST_CHUNK_BYTES", "GROWTH", "LoadResult", "SaveResult", "WHOLE_BATCH_BYTES", "chunks",
           "load_batch", "save_batch"]

# One block's bytes on the engine side: a contiguous tensor, or several pieces whose bytes follow
# each other in the block (an engine's paged cache keeps a block's layers, or K and V, apart):
# tensors, and PageRows for the block's pages in each layer. In a load, an int stands for that many
# bytes of the block that are not copied (pages the engine already holds).
Block = Union[Piece, Sequence[Union[Piece, int]]]

FIRST_CHUNK_BYTES = 1 << 20  # bytes the first chunk holds at most (its request is the one waited for)
GROWTH = 4                   # each next chunk holds at most this many times the bytes of the one before
CHUNK_BYTES = 64 << 20       # bytes a chunk holds at most (a larger block is a chunk alone): see the module
WHOLE_BATCH_BYTES = 4 << 20  # a batch of at most this many bytes is one chunk: its requests would cost more than its copies


@dataclass(slots=True)
class SaveResult:
    stored: int = 0                                        # written and committed now (confirm=False: commit sent)
    present: int = 0                                       # the daemon had them already
    declined: int = 0                                      # the daemon's admission policy did not take them
    skipped: list[int] = field(default_factory=list)       # indexes not stored (busy, full, failed)


@dataclass(slots=True)
class LoadResult:
    loaded: int = 0
    missing: list[int] = field(default_factory=list)       # indexes no tier holds (tensors untouched)

    @property
    def prefix(self) -> int:
        """How many blocks from the first were loaded."""
        return self.missing[0] if self.missing else self.loaded


def pieces_of(block: Block) -> list[Piece | int]:
    return [block] if isinstance(block, (torch.Tensor, PageRows)) else list(block)


def size_of(pieces: Sequence[Piece | int]) -> int:
    return sum(p if isinstance(p, int) else p.nbytes for p in pieces)


def placed(pieces: Sequence[Piece | int], offset: int, tensors: list[Piece], offsets: list[int]) -> None:
    """Append each piece and its arena offset (pieces follow each other from ``offset``)."""
    for piece in pieces:
        if isinstance(piece, int):
            offset += piece
            continue
        tensors.append(piece)
        offsets.append(offset)
        offset += piece.nbytes


def chunks(sizes: Sequence[int], first: int = FIRST_CHUNK_BYTES, most: int = CHUNK_BYTES) -> list[range]:
    """Consecutive blocks of ``sizes`` bytes grouped into chunks: the first of at most ``first``
    bytes, each next one of at most ``GROWTH`` times the bound of the one before, never more
    than ``most``; a block larger than its chunk's bound is a chunk of its own, and a batch of
    at most ``WHOLE_BATCH_BYTES`` is one chunk. Every block in one chunk, in order."""
    if sum(sizes) <= WHOLE_BATCH_BYTES:
        return [range(len(sizes))] if sizes else []
    out: list[range] = []
    start, held, bound = 0, 0, min(first, most)
    for i, n in enumerate(sizes):
        if i > start and held + n > bound:
            out.append(range(start, i))
            start, held, bound = i, 0, min(bound * GROWTH, most)
        held += n
    if sizes:
        out.append(range(start, len(sizes)))
    return out


def save_batch(client: AgentClient, copier: ArenaCopier, addresses: Sequence[BlockAddress], tensors: Sequence[Block],
               base: int, result: SaveResult, confirm: bool = True) -> None:
    """Save one protocol batch (at most p.MAX_BATCH blocks) in chunks (see the module); counts
    into ``result``, block ``i`` counted as ``base + i``. ``confirm=False``: the commits are
    sent and not waited for (Agent.save)."""
    blocks = [pieces_of(t) for t in tensors]
    if any(isinstance(piece, int) for pieces in blocks for piece in pieces):
        raise ValueError("a saved block must be given as tensors only")
    sizes = [size_of(pieces) for pieces in blocks]
    spans = chunks(sizes)
    if not spans:
        return

    def allocate(span: range) -> int:
        return client.submit(p.Allocate([(addresses[i].digest, addresses[i].layer, sizes[i]) for i in span]))

    written: list[tuple[int, int]] = []             # (index, handle) of the blocks copied
    asked = allocate(spans[0])
    for k, span in enumerate(spans):
        ahead = allocate(spans[k + 1]) if k + 1 < len(spans) else None
        try:
            slots = client.answer(asked)
            assert isinstance(slots, p.Slots)
            todo: list[tuple[int, int, int]] = []    # (index, handle, offset)
            for i, (status, handle, offset) in zip(span, slots.entries):
                if status == p.Status.OK:
                    todo.append((i, handle, offset))
                elif status == p.Status.PRESENT:
                    result.present += 1
                elif status == p.Status.DECLINED:
                    result.declined += 1
                else:
                    result.skipped.append(base + i)
            if todo:
                handles = [h for _, h, _ in todo]
                sources: list[Piece] = []
                offsets: list[int] = []
                for i, _, offset in todo:
                    placed(blocks[i], offset, sources, offsets)
                try:
                    copier.save(sources, offsets)
                except BaseException:
                    client.send(p.Release(handles))      # the slots go back; nothing half-written is kept
                    raise
                written += [(i, h) for i, h, _ in todo]
        except BaseException:
            _release(client, [h for _, h in written])
            if ahead is not None:
                _release_unused(client, ahead)
            raise
        asked = ahead if ahead is not None else asked
    if not written:
        return
    handles = [h for _, h in written]
    if not confirm:
        client.send(p.Commit(handles))       # its answer is read (and dropped) by a later call
        result.stored += len(written)
        return
    committed = client.call(p.Commit(handles))
    assert isinstance(committed, p.Committed)
    for (i, _), status in zip(written, committed.statuses):
        if status == p.Status.OK:
            result.stored += 1
        else:
            result.skipped.append(base + i)
    result.skipped.sort()


def _release_unused(client: AgentClient, request: int) -> None:
    """What an Allocate or Load in flight was given (slots, pins), released unused: a copy of an
    earlier chunk failed."""
    try:
        answer = client.answer(request)
    except AgentError:               # an Error answer holds nothing; a closed connection holds nothing any more
        return
    if isinstance(answer, (p.Slots, p.Loaded)):         # each entry: (status, handle, ...)
        _release(client, [entry[1] for entry in answer.entries if entry[0] == p.Status.OK])


def _release(client: AgentClient, handles: list[int]) -> None:
    """Release ``handles`` without waiting (a closed connection has released them already)."""
    if handles:
        try:
            client.send(p.Release(handles))
        except ConnectionClosed:
            pass


def load_batch(client: AgentClient, copier: ArenaCopier, addresses: Sequence[BlockAddress], tensors: Sequence[Block],
               base: int, result: LoadResult) -> None:
    """Load one protocol batch in chunks (see the module), each released once copied; counts
    into ``result``, block ``i`` counted as ``base + i``. The chunks follow the tensors' sizes
    (the blocks' own, checked against what the daemon says)."""
    blocks = [pieces_of(t) for t in tensors]
    spans = chunks([size_of(pieces) for pieces in blocks])
    if not spans:
        return

    def ask(span: range) -> int:
        return client.submit(p.Load([(addresses[i].digest, addresses[i].layer) for i in span]))

    asked = ask(spans[0])
    for k, span in enumerate(spans):
        ahead = ask(spans[k + 1]) if k + 1 < len(spans) else None
        handles: list[int] = []
        try:
            loaded = client.answer(asked)
            assert isinstance(loaded, p.Loaded)
            handles = [h for status, h, _, _ in loaded.entries if status == p.Status.OK]
            targets: list[Piece] = []
            offsets: list[int] = []
            found = 0
            for i, (status, _, offset, length) in zip(span, loaded.entries):
                if status != p.Status.OK:
                    result.missing.append(base + i)
                    continue
                size = size_of(blocks[i])
                if size != length:
                    raise ValueError(f"block {addresses[i]} is {length} bytes but its tensor holds {size}")
                placed(blocks[i], offset, targets, offsets)
                found += 1
            copier.load(targets, offsets)
            result.loaded += found
        except BaseException:
            if ahead is not None:
                _release_unused(client, ahead)
            raise
        finally:
            _release(client, handles)         # no need to wait: the copies are complete
        asked = ahead if ahead is not None else asked
