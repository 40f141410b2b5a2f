"""The scheduler side of the vLLM connector: which blocks each step loads and saves.

It runs in vLLM's scheduler process, asks the daemon how long a prefix of a prompt it holds
(one lookup over all tiers), and turns vLLM's allocations into per-step work for the workers:
:class:`LoadOp` (blocks to copy into vLLM pages before the forward) and :class:`SaveOp` (blocks
completed by this step, copied out after it). A block is saved once, when its last token's KV has
been computed (deferred store: never a partial block), and never if it was just loaded from
kvcached. It also works out which blocks sit in vLLM's GPU prefix cache (pinned) and when vLLM
reuses their pages (evicted); the first worker reports those to the daemon, so the daemon's
overlap query stays true. (Its own agent reports nothing: a lookup would then count the blocks
vLLM already holds, and only what the daemon can hand over is a hit here.)

vLLM objects are read by attribute only (Request, KVCacheBlocks, SchedulerOutput, ...), so this
module imports nothing of vLLM. Terms: a *page* is one vLLM block (``page_tokens`` tokens); a
*block* is one kvcached block of ``pages_per_block`` pages, the unit of addressing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kvcached_agent.engines.common import TokenChain

__all__ = ["LoadOp", "SaveOp", "SchedulerSide"]


@dataclass(slots=True)
class LoadOp:
    """Copy blocks [first, end) of a request into its pages (``pages``: the vLLM block ids of
    those blocks, ``pages_per_block`` each). The first ``skip_pages`` pages are already computed
    in vLLM (a local prefix hit that ends inside a block) and are not written."""

    req_id: str
    tokens: Sequence[int]        # the request's tokens, at least end * block_tokens of them
    first: int
    end: int
    pages: list[int]
    skip_pages: int = 0
    is_async: bool = False       # reported through get_finished (the request waits in WAITING_FOR_REMOTE_KVS)


@dataclass(slots=True)
class SaveOp:
    """Copy blocks [first, end) of a request, complete after this step's forward, to the daemon."""

    req_id: str
    tokens: Sequence[int]
    first: int
    end: int
    pages: list[int]


@dataclass(slots=True)
class _Request:
    request: Any                         # vllm.v1.request.Request
    chain: TokenChain
    pages: list[int] = field(default_factory=list)
    saved: int = 0                       # blocks [0, saved) are stored, loaded or handed to a worker to store
    local: int = 0                       # tokens vLLM had computed (its own prefix cache) at the last lookup
    hit: tuple[int, bool] = (0, False)   # from the last lookup: (blocks, async)
    hit_tiers: tuple[int, int, int] = (0, 0, 0)   # blocks of that hit found in RAM, on SSD, at a peer
    loading: bool = False                # an asynchronous load is in flight
    finished: bool = False


class SchedulerSide:
    """Per-request bookkeeping of the connector's scheduler role (no I/O but ``agent`` calls)."""

    def __init__(self, agent: Any, root: bytes, *, block_tokens: int, page_tokens: int) -> None:
        if block_tokens % page_tokens:
            raise ValueError(f"kvcached block_tokens ({block_tokens}) must be a multiple of vLLM's "
                             f"block size ({page_tokens})")
        self.agent = agent
        self.root = root
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.per_block = block_tokens // page_tokens
        self._requests: dict[str, _Request] = {}
        self._loads: list[LoadOp] = []
        self._page_digest: dict[int, bytes] = {}          # vLLM page -> the block it holds (saved or loaded)
        self._digest_pages: dict[bytes, list[int]] = {}
        self._pinned: list[bytes] = []
        self._evicted: list[bytes] = []

    # -- lookups -------------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        state = self._requests.get(request.request_id)
        if state is None:
            state = _Request(request, TokenChain(self.root, self.block_tokens))
            self._requests[request.request_id] = state
        return state

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """How many tokens after ``num_computed`` the daemon can supply, and whether loading them
        waits on the SSD or a peer (then asynchronously, so the step is not held up)."""
        state = self._state(request)
        state.local = num_computed
        # At least the prompt's last token is computed by vLLM: it gives the next token's logits.
        usable = (request.num_tokens - 1) // self.block_tokens
        first = num_computed // self.block_tokens
        if usable <= first:
            state.hit = (0, False)
            return 0, False
        digests = state.chain.upto(request.all_token_ids, usable)
        found = self.agent.lookup(digests[first:])
        blocks = first + found.longest
        external = blocks * self.block_tokens - num_computed
        if found.longest == 0 or external <= 0:
            state.hit = (0, False)
            return 0, False
        from_ram = min(found.ram, found.longest)
        from_ssd = min(max(found.ssd, from_ram), found.longest) - from_ram
        state.hit = (blocks, from_ram < found.longest)
        state.hit_tiers = (from_ram, from_ssd, found.longest - from_ram - from_ssd)
        return external, state.hit[1]

    def hit_tiers(self, request: Any) -> tuple[int, int, int]:
        """Blocks of the last hit (RAM, SSD, peer), for vLLM's per-source hit metrics."""
        state = self._requests.get(request.request_id)
        return state.hit_tiers if state is not None else (0, 0, 0)

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated pages for ``request`` (all of them, in order); plan the load."""
        state = self._state(request)
        local = state.local
        self._assign(state, block_ids, local)
        if num_external <= 0:
            return
        blocks, is_async = state.hit
        end_tokens = local + num_external
        if end_tokens != blocks * self.block_tokens:
            # vLLM's count differs from the lookup's: cover all of it (a block the daemon lacks
            # is reported as a load error and recomputed, never left unwritten).
            blocks = -(-end_tokens // self.block_tokens)
        first = local // self.block_tokens
        op = LoadOp(request.request_id, request.all_token_ids, first, blocks,
                    state.pages[first * self.per_block:blocks * self.per_block],
                    skip_pages=local // self.page_tokens - first * self.per_block, is_async=is_async)
        state.loading = is_async
        state.saved = max(state.saved, blocks)
        self._loads.append(op)
        self._on_gpu(state, first, blocks)

    # -- each step -----------------------------------------------------------------------------

    def build(self, scheduler_output: Any) -> tuple[list[LoadOp], list[SaveOp], list[bytes], list[bytes]]:
        """This step's loads and saves, and the GPU residency events gathered meanwhile
        (pinned, evicted digests)."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                self._assign(state, new.block_ids[0], new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            added = cached.new_block_ids[i]
            if state is None or added is None:
                continue
            if req_id in resumed:         # preempted earlier: a new page list (its start may be prefix hits)
                self._assign(state, added[0], cached.num_computed_tokens[i])
            else:
                self._assign(state, state.pages + list(added[0]), len(state.pages) * self.page_tokens)
        saves = []
        for req_id, count in scheduled.items():
            state = self._requests.get(req_id)
            if state is None or state.finished:
                continue
            request = state.request
            # Tokens whose KV exists once this step's forward is done: a block is stored only
            # when all of it is there.
            done = min(request.num_computed_tokens + count, request.num_tokens)
            full = min(done // self.block_tokens, len(state.pages) // self.per_block)
            if full > state.saved:
                state.chain.upto(request.all_token_ids, full)
                saves.append(SaveOp(req_id, request.all_token_ids, state.saved, full,
                                    state.pages[state.saved * self.per_block:full * self.per_block]))
                self._on_gpu(state, state.saved, full)
                state.saved = full
        loads, self._loads = self._loads, []
        pinned, self._pinned = list(dict.fromkeys(self._pinned)), []
        evicted, self._evicted = self._evicted, []
        return loads, saves, pinned, evicted

    def finished(self, request: Any) -> bool:
        """The request is done (or aborted). True while an asynchronous load still writes into
        its pages: vLLM then frees them only after the workers report the load finished."""
        state = self._requests.get(request.request_id)
        if state is None:
            return False
        if state.loading:
            state.finished = True
            return True
        del self._requests[request.request_id]
        return False

    def transfers_done(self, finished_recving: Sequence[str] | None) -> None:
        """Workers reported these asynchronous loads complete (or failed: vLLM recomputes)."""
        for req_id in finished_recving or ():
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.loading = False
            if state.finished:
                del self._requests[req_id]

    # -- GPU residency events ------------------------------------------------------------------

    def _on_gpu(self, state: _Request, first: int, end: int) -> None:
        """Blocks [first, end) of the request are (about to be) in vLLM pages."""
        for k, digest in enumerate(state.chain.digests[first:end], start=first):
            pages = state.pages[k * self.per_block:(k + 1) * self.per_block]
            for page in pages:
                self._page_digest[page] = digest
            self._digest_pages[digest] = pages
            self._pinned.append(digest)

    def _assign(self, state: _Request, pages: Sequence[int], computed: int) -> None:
        """The request's pages are now ``pages``; those from ``computed`` tokens on that it did not
        hold before are newly handed out by vLLM."""
        known = set(state.pages)
        self._fresh([page for page in pages[computed // self.page_tokens:] if page not in known])
        state.pages = list(pages)

    def _fresh(self, pages: Sequence[int]) -> None:
        """vLLM handed out these pages anew: whatever block they held left the GPU."""
        for page in pages:
            digest = self._page_digest.pop(page, None)
            if digest is None:
                continue
            for other in self._digest_pages.pop(digest, ()):
                self._page_digest.pop(other, None)
            self._evicted.append(digest)
