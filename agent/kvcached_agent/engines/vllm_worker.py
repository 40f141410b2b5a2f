"""The worker side of the vLLM connector: copies between vLLM's paged KV cache and the daemon.

Each worker (one per tensor-parallel rank) holds its own agent, whose addresses carry the rank,
so a rank stores and loads only its own shard. A kvcached block is one address holding every
layer of ``pages_per_block`` vLLM pages: layer by layer, page by page (a cross-layer block), so a
prompt's blocks are one lookup and one batched copy, with no staging buffer in between: the agent
copies each page straight between vLLM's cache tensors and the daemon's shared arena. A hybrid
model's block of a kind holds the layers of each vLLM group of that kind, group after group
(kvcached_agent.engines.hybrid), each group's from its own pages.

Loads the scheduler marked synchronous run in ``start_load`` before the forward; asynchronous ones
(blocks on the SSD or at a peer) run on one background thread and are reported by ``finished``.
Saves run in ``save`` once the step's forward is done. Blocks a load could not fill are reported
to vLLM, which recomputes them: a down daemon or an evicted block costs time, never a wrong token
(a hybrid model's failed load is reported as the request's, every load of it being asynchronous:
vLLM then recomputes the whole request).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from kvcached_agent.copy import PageRows
from kvcached_agent.engines.common import TokenChain
from kvcached_agent.engines.hybrid import FULL, PRIMARY, GroupKind, kind_digests
from kvcached_agent.engines.vllm_scheduler import KindPages, LoadOp, SaveOp

__all__ = ["WorkerSide", "page_views"]

log = logging.getLogger("kvcached_agent")


def page_views(kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], num_pages: int,
               page_bytes: int) -> list[torch.Tensor]:
    """Per layer, a (num_pages, page_bytes) uint8 view of its cache tensor: row p is page p.

    vLLM keeps a page of a layer contiguous, pages one stride apart along dimension 0 (which may
    be split into kernel blocks); other layouts are refused with a clear error. A state layer's
    page may be padded to the attention pages' size: only its content (the row vLLM's tensor
    spans) is copied, never the padding."""
    views = []
    for name in layer_names:
        cache = kv_caches[name]
        if cache.dim() == 0 or cache.shape[0] % num_pages:
            raise ValueError(f"KV cache of layer {name} has shape {tuple(cache.shape)}: kvcached needs the "
                             f"{num_pages} pages along dimension 0")
        grouped = cache if cache.shape[0] == num_pages else cache.unflatten(0, (num_pages, -1))
        size = cache.element_size()
        stride = grouped.stride(0) * size
        if grouped[0].is_contiguous():
            page_bytes = min(page_bytes, grouped[0].numel() * size)
        if stride < page_bytes:
            raise ValueError(f"KV cache of layer {name}: pages are {stride} bytes apart but hold {page_bytes}")
        view = torch.empty(0, dtype=torch.uint8, device=cache.device)
        view.set_(cache.untyped_storage(), grouped.storage_offset() * size, (num_pages, page_bytes), (stride, 1))
        views.append(view)
    return views


class WorkerSide:
    """Runs one worker's loads and saves through its agent.

    ``kinds`` and ``roots``: the model's kinds of KV cache group and their address roots (as the
    scheduler's); a model with full attention only has the one full kind over group 0."""

    def __init__(self, agent: Any, root: bytes, *, block_tokens: int, pages_per_block: int,
                 reports_gpu: bool = True, kinds: Sequence[GroupKind] | None = None,
                 roots: Sequence[bytes] | None = None) -> None:
        self.agent = agent
        self.reports_gpu = reports_gpu        # the first rank tells the daemon what vLLM's GPU cache holds
        self.root = root
        self.block_tokens = block_tokens
        self.per_block = pages_per_block
        self.kinds = list(kinds or [GroupKind(PRIMARY, FULL, (0,))])
        self.roots = list(roots or [root] * len(self.kinds))
        # A failed load is the whole request's (vLLM recomputes it) for a model of more than one
        # KV cache group (vLLM takes no block-level errors from one) and for one whose blocks are
        # not a chain (sliding window, state: recomputing from the first failed block would lack
        # the window or state before it).
        self.hybrid = (sum(len(k.group_ids) for k in self.kinds) > 1
                       or any(k.name != PRIMARY for k in self.kinds))
        self.views: dict[int, list[torch.Tensor]] = {}         # per vLLM group, its layers' page views
        self._chains: dict[str, TokenChain] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvcached-load")
        self._lock = threading.Lock()
        self._pending: dict[str, Future[set[int]]] = {}
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        self.loaded_blocks = 0
        self.saved_blocks = 0

    def register(self, views: dict[int, list[torch.Tensor]]) -> None:
        """The page views of each vLLM group's layers (page_views)."""
        self.views = views

    def _digests(self, op: LoadOp | SaveOp, copy: KindPages) -> list[bytes]:
        chain = self._chains.get(op.req_id)
        if chain is None:
            chain = self._chains[op.req_id] = TokenChain(self.root, self.block_tokens)
        digests = chain.upto(op.tokens, op.end)
        return kind_digests(self.roots[copy.kind], self.kinds[copy.kind], digests, copy.positions)

    def _blocks(self, copy: KindPages, skip: int = 0) -> list[list[PageRows | int]]:
        """The copy's blocks, each its pieces in block order: group by group, every layer's pages
        (the first block's first ``skip`` pages as gaps)."""
        n = self.per_block
        groups = [(self.views[g], pages) for g, pages in zip(self.kinds[copy.kind].group_ids, copy.pages)]
        out = []
        for j in range(len(copy.positions)):
            cut = skip if j == 0 else 0
            pieces: list[PageRows | int] = []
            for views, pages in groups:
                rows = pages[j * n:(j + 1) * n]
                if not cut:
                    pieces.append(PageRows(views, rows))
                    continue
                gap = cut * int(views[0].shape[1]) if views else 0
                pieces += [piece for view in views for piece in (gap, PageRows((view,), rows[cut:]))]
            out.append(pieces)
        return out

    # -- loads ---------------------------------------------------------------------------------

    def start_load(self, loads: Sequence[LoadOp]) -> None:
        for op in loads:
            if op.is_async:
                digests = [self._digests(op, c) for c in op.copies]   # hashed here: the chain cache is this thread's
                self._pending[op.req_id] = self._pool.submit(self._load, op, digests)
            else:
                failed = self._load(op, [self._digests(op, c) for c in op.copies])
                with self._lock:
                    self._errors |= failed

    def _load(self, op: LoadOp, digests: list[list[bytes]]) -> set[int]:
        """Copy the op's blocks into its pages; the vLLM pages that could not be filled (vLLM
        recomputes from the first of them; for a hybrid model, any of them fails the request)."""
        addresses: list[Any] = []
        blocks: list[list[PageRows | int]] = []
        full_at: list[int] = []           # per block: its index among the full kind's, or -1
        for copy, names in zip(op.copies, digests):
            addresses += self.agent.addresses(names)
            is_full = self.kinds[copy.kind].kind == FULL
            blocks += self._blocks(copy, op.skip_pages if is_full else 0)
            full_at += list(range(len(names))) if is_full else [-1] * len(names)
        count = len(addresses)
        if op.doomed:
            missing = list(range(count)) or [0]
        else:
            try:
                missing = self.agent.load(addresses, blocks).missing if addresses else []
            except Exception:
                log.exception("kvcached load failed; vLLM recomputes the blocks", extra={"request": op.req_id})
                missing = list(range(count)) or [0]
        with self._lock:                 # this runs on the load thread too
            self.loaded_blocks += count - len(missing)
        if not missing:
            return set()
        pages = [p for copy in op.copies for group in copy.pages for p in group]
        if self.hybrid:
            return set(pages) or {-1}
        full = op.copies[0]
        first_bad = full_at[missing[0]] * self.per_block + (op.skip_pages if full_at[missing[0]] == 0 else 0)
        return set(full.pages[0][first_bad:])

    def load_errors(self) -> set[int]:
        """vLLM pages that a load reported since the last call could not fill."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous load completed (failed blocks are in load_errors, or for
        a hybrid model the request in failed); forgets the per-request state of requests vLLM
        finished."""
        done = set()
        for req_id, future in list(self._pending.items()):
            if future.done():
                del self._pending[req_id]
                failed = future.result()
                with self._lock:
                    if failed and self.hybrid:
                        self._failed.add(req_id)
                    else:
                        self._errors |= failed
                done.add(req_id)
        for req_id in finished_req_ids:
            self._chains.pop(req_id, None)
        return done

    def failed(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call (a hybrid model's: vLLM
        recomputes them whole)."""
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def report(self, pinned: Sequence[bytes], evicted: Sequence[bytes]) -> None:
        """GPU residency events from the scheduler (its digests are the first rank's)."""
        if not self.reports_gpu:
            return
        if evicted:
            self.agent.report_evicted(evicted)
        if pinned:
            self.agent.report_pinned(pinned)

    # -- saves ---------------------------------------------------------------------------------

    def save(self, saves: Sequence[SaveOp]) -> None:
        """Store the blocks this step completed. On a GPU the agent's copies wait for the work
        already queued on the current stream (this step's forward), so no sync is needed here."""
        addresses: list[Any] = []
        blocks: list[list[PageRows | int]] = []
        for op in saves:
            for copy in op.copies:
                addresses += self.agent.addresses(self._digests(op, copy))
                blocks += self._blocks(copy)
        if not addresses:
            return
        try:
            # The step waits for the copy into the arena, not for the daemon's checksums or SSD
            # write (write-through): the pages are free once their bytes are in the arena.
            result = self.agent.save(addresses, blocks, confirm=False)
        except Exception:
            log.exception("kvcached save failed; the blocks stay uncached")
            return
        self.saved_blocks += result.stored

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.agent.close()
