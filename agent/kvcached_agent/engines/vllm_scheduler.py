"""The scheduler side of the vLLM connector: which blocks each step loads and saves.

It runs in vLLM's scheduler process, asks the daemon how long a prefix of a prompt it can resume
from, and turns vLLM's allocations into per-step work for the workers: :class:`LoadOp` (blocks to
copy into vLLM pages before the forward) and :class:`SaveOp` (blocks completed by this step,
copied out after it). A block is saved once, when its last token's KV has been computed
(deferred store: never a partial block), and never if it was just loaded from kvcached. It also
works out which blocks sit in vLLM's GPU prefix cache (pinned) and when vLLM reuses their pages
(evicted); the first worker reports those to the daemon, so the daemon's overlap query stays
true. (Its own agent reports nothing: a lookup would then count the blocks vLLM already holds,
and only what the daemon can hand over is a hit here.)

Hybrid models (several KV cache groups: sliding-window or state layers beside full attention)
follow kvcached_agent.engines.hybrid: a hit is one every kind of group can resume from, the
sliding-window and state kinds are saved at the request's resume points only, and their loads
are asynchronous (vLLM takes a failed load of a multi-group model only as a whole request, which
it then recomputes).

vLLM objects are read by attribute only (Request, KVCacheBlocks, SchedulerOutput, ...), so this
module imports nothing of vLLM. Terms: a *page* is one vLLM block (``page_tokens`` tokens); a
*block* is one kvcached block of ``pages_per_block`` pages, the unit of addressing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvcached_agent.engines.common import TokenChain
from kvcached_agent.engines.hybrid import FULL, PRIMARY, STATE, GroupKind, hit_length, kind_digests, resume_points
from kvcached_agent.engines.vllm_routes import RouteBook
from kvcached_agent.prefill import PrefillRate, StepClock

__all__ = ["KindPages", "LoadOp", "SaveOp", "SchedulerSide"]

NULL_PAGE = 0          # vLLM's placeholder page: a position the group does not keep


@dataclass(slots=True)
class KindPages:
    """Blocks of one kind (``kind``: its index in the connector's kinds) at block ``positions``:
    per vLLM group of the kind, the pages of those blocks, ``pages_per_block`` each, in order."""

    kind: int
    positions: list[int]
    pages: list[list[int]]


@dataclass(slots=True)
class LoadOp:
    """Copy these blocks of a request into its pages. The token chain up to block ``end`` names
    them. The first ``skip_pages`` pages of the first full-attention block are already computed
    in vLLM (a local prefix hit that ends inside a block) and are not written."""

    req_id: str
    tokens: Sequence[int]        # the request's tokens, at least end * block_tokens of them
    end: int
    copies: list[KindPages]
    skip_pages: int = 0
    is_async: bool = False       # reported through get_finished (the request waits in WAITING_FOR_REMOTE_KVS)
    doomed: bool = False         # vLLM gave a placeholder page where a block must go: fail it, vLLM recomputes


@dataclass(slots=True)
class SaveOp:
    """Copy these blocks, complete after this step's forward, to the daemon."""

    req_id: str
    tokens: Sequence[int]
    end: int
    copies: list[KindPages]


@dataclass(slots=True)
class _Request:
    request: Any                         # vllm.v1.request.Request
    chain: TokenChain
    tables: list[list[int]] = field(default_factory=list)   # per vLLM group, the request's pages
    saved: int = 0                       # full kind: blocks [0, saved) are stored, loaded or handed to a worker
    kept: set[tuple[int, int]] = field(default_factory=set)  # other kinds: (kind, position) stored or loaded
    junction: int = 0                    # a block position where a stored prefix ends that this one shares
    local: int = 0                       # tokens vLLM had computed (its own prefix cache) at the last lookup
    hit: tuple[int, bool] = (0, False)   # from the last lookup: (blocks, async)
    hit_tiers: tuple[int, int, int] = (0, 0, 0)   # blocks of that hit found in RAM, on SSD, at a peer
    loading: bool = False                # an asynchronous load is in flight
    finished: bool = False


class SchedulerSide:
    """Per-request bookkeeping of the connector's scheduler role (no I/O but ``agent`` calls).

    ``kinds``: the model's kinds of KV cache group (a model with full attention only has one,
    ``GroupKind("full", FULL, (0,))``); ``roots``: each kind's address root. ``prefill``: the
    engine's prefill rate, fed from its steps as they are scheduled (``clock``), for load plans
    (docs/engines.md "Loads that pay"); None: every hit is loaded."""

    def __init__(self, agent: Any, root: bytes, *, block_tokens: int, page_tokens: int,
                 kinds: Sequence[GroupKind] | None = None, roots: Sequence[bytes] | None = None,
                 routes: RouteBook | None = None, prefill: PrefillRate | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_tokens % page_tokens:
            raise ValueError(f"kvcached block_tokens ({block_tokens}) must be a multiple of vLLM's "
                             f"block size ({page_tokens})")
        self.agent = agent
        self.root = root
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.per_block = block_tokens // page_tokens
        self.kinds = list(kinds or [GroupKind(PRIMARY, FULL, (0,))])
        self.roots = list(roots or [root] * len(self.kinds))
        self.routes = routes              # the engine's keys of saved and loaded blocks (KV events)
        self.prefill = prefill
        self._steps = StepClock(prefill) if prefill is not None else None
        self._clock = clock
        # More than one KV cache group: a hit is asked of every kind, and loads are asynchronous
        # (vLLM takes a failed load of such a model only as the whole request's).
        self.hybrid = sum(len(k.group_ids) for k in self.kinds) > 1
        primary = [k for k in self.kinds if k.name == PRIMARY]
        self._gpu_group = primary[0].group_ids[0] if primary else None   # whose pages the residency events follow
        # Kinds whose blocks a Lookup of the token chain does not find (all of them for a model
        # of sliding-window or state layers only): asked with Present.
        self._present_kinds = any(k.name != PRIMARY for k in self.kinds)
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
        waits on the SSD or a peer (then asynchronously, so the step is not held up; always for a
        hybrid model)."""
        state = self._state(request)
        state.local = num_computed
        # At least the prompt's last token is computed by vLLM: it gives the next token's logits.
        usable = (request.num_tokens - 1) // self.block_tokens
        first = num_computed // self.block_tokens
        state.hit = (0, False)
        if usable <= first:
            return 0, False
        digests = state.chain.upto(request.all_token_ids, usable)
        found = self._loadable(digests[first:]) if self._gpu_group is not None else None
        full = first + found[0] if found is not None else usable
        stored = first + found[3] if found is not None else usable      # where the stored prefix ends
        blocks = self._hybrid_hit(digests, first, usable, full) if self._present_kinds else full
        if self._present_kinds and stored > blocks and not state.junction:
            # A prefix stored by another prompt ends here (the full-attention blocks reach it, the
            # other kinds cannot resume there yet): keep this request's state there, as vLLM's
            # prefix cache keeps a shared-prefix junction, so the next prompt sharing it resumes.
            # vLLM's scheduler ends a prefill chunk at its request's junction (the state exists
            # only at a chunk's end); the one it found itself, if any, comes first.
            state.junction = stored
            if getattr(request, "shared_prefix_boundary", None) == 0:
                request.shared_prefix_boundary = stored * self.block_tokens
        external = blocks * self.block_tokens - num_computed
        if blocks <= first or external <= 0:
            return 0, False
        longest = blocks - first
        ram = min(found[1], longest) if found is not None else 0
        ssd = min(found[2], longest - ram) if found is not None else 0
        state.hit = (blocks, self._present_kinds or self.hybrid or ram < longest)
        state.hit_tiers = (ram, ssd, longest - ram - ssd)
        return external, state.hit[1]

    def _loadable(self, chain: list[bytes]) -> tuple[int, int, int, int]:
        """How many blocks of ``chain`` to load, of them how many from RAM and from SSD, and the
        prefix some tier holds: a load plan once the engine's prefill rate is known (SSD and
        peer blocks slower to load than to recompute are left out), else every block held."""
        per_token = self.prefill.seconds_per_token() if self.prefill is not None else None
        if per_token is not None:
            plan = self.agent.plan_loads(chain, per_token * self.block_tokens)
            return plan.load, plan.ram, plan.ssd, plan.held
        found = self.agent.lookup(chain)
        ram = min(found.ram, found.longest)
        return found.longest, ram, min(max(found.ssd, ram), found.longest) - ram, found.longest

    def _hybrid_hit(self, chain: list[bytes], first: int, usable: int, full: int) -> int:
        """The hit every kind can resume from (hybrid.hit_length): one Present for the blocks of
        every kind but the first full-attention one (whose chain the Lookup followed) at
        positions [first, full); blocks before ``first`` are vLLM's own hit, which it has every
        kind of. Another full-attention kind caps ``full`` at its own prefix."""
        asked: list[tuple[int, int]] = []       # (kind, position) in the order asked
        digests: list[bytes] = []
        for i, kind in enumerate(self.kinds):
            if kind.name == PRIMARY:
                continue
            positions = range(first, full)
            asked += [(i, k) for k in positions]
            digests += kind_digests(self.roots[i], kind, chain, positions)
        flags = self.agent.present(digests) if digests else b""
        held = {key for key, flag in zip(asked, flags) if flag}
        for i, kind in enumerate(self.kinds):
            if kind.kind == FULL and kind.name != PRIMARY:
                reach = first
                while reach < full and (i, reach) in held:
                    reach += 1
                full = reach
        index = {id(kind): i for i, kind in enumerate(self.kinds)}
        return hit_length(self.kinds, usable, full, lambda kind, k: k < first or (index[id(kind)], k) in held)

    def hit_tiers(self, request: Any) -> tuple[int, int, int]:
        """Blocks of the last hit (RAM, SSD, peer), for vLLM's per-source hit metrics."""
        state = self._requests.get(request.request_id)
        return state.hit_tiers if state is not None else (0, 0, 0)

    def after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]], num_external: int) -> None:
        """vLLM allocated pages for ``request`` (per group, all of them, in order); plan the load."""
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
        copies, doomed = self._copies(state, {i: [k for k in kind.needs(blocks) if k >= first]
                                              for i, kind in enumerate(self.kinds)})
        op = LoadOp(request.request_id, request.all_token_ids, blocks, copies,
                    skip_pages=local // self.page_tokens - first * self.per_block, is_async=is_async, doomed=doomed)
        state.loading = is_async
        state.saved = max(state.saved, blocks)
        state.kept.update((c.kind, k) for c in copies if self.kinds[c.kind].kind != FULL for k in c.positions)
        self._loads.append(op)
        self._on_gpu(state, first, blocks)
        if self.routes is not None:
            self.routes.loaded(request, [(c.kind, c.positions) for c in copies])

    def _copies(self, state: _Request, positions: dict[int, list[int]]) -> tuple[list[KindPages], bool]:
        """Per kind, its blocks at ``positions`` with their pages; and whether some page is a
        placeholder (the group does not keep that position: nothing can be copied there)."""
        n = self.per_block
        out, placeholder = [], False
        for i, wanted in positions.items():
            if not wanted:
                continue
            pages = [[page for k in wanted for page in state.tables[g][k * n:(k + 1) * n]]
                     for g in self.kinds[i].group_ids]
            placeholder |= any(len(p) != len(wanted) * n or NULL_PAGE in p for p in pages)
            out.append(KindPages(i, wanted, pages))
        return out, placeholder

    # -- each step -----------------------------------------------------------------------------

    def build(self, scheduler_output: Any) -> tuple[list[LoadOp], list[SaveOp], list[bytes], list[bytes]]:
        """This step's loads and saves, and the GPU residency events gathered meanwhile
        (pinned, evicted digests)."""
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        if self._steps is not None:
            self._steps.scheduled(self._clock(), sum(scheduled.values()), frozenset(scheduled),
                                  frozenset(cached.req_ids) - resumed)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                self._assign(state, new.block_ids, new.num_computed_tokens)
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            added = cached.new_block_ids[i]
            if state is None or added is None:
                continue
            if req_id in resumed:         # preempted earlier: a new page list (its start may be prefix hits)
                self._assign(state, added, cached.num_computed_tokens[i])
            else:
                grown = [old + list(new) for old, new in zip(state.tables, added)]
                self._assign(state, grown, self._computed_pages(state) * self.page_tokens)
        saves = []
        for req_id, count in scheduled.items():
            state = self._requests.get(req_id)
            if state is not None and not state.finished:
                save = self._save(state, count)
                if save is not None:
                    saves.append(save)
        loads, self._loads = self._loads, []
        pinned, self._pinned = list(dict.fromkeys(self._pinned)), []
        evicted, self._evicted = self._evicted, []
        return loads, saves, pinned, evicted

    def _save(self, state: _Request, count: int) -> SaveOp | None:
        """What this step completes of the request: full-attention blocks once whole; the
        blocks of the other kinds that a resume point needs, in the step that computes them
        (their pages are the group's then: vLLM may free them once out of the window)."""
        request = state.request
        before = request.num_computed_tokens
        # Tokens whose KV exists once this step's forward is done: a block is stored only when
        # all of it is there.
        done = min(before + count, request.num_tokens)
        bt = self.block_tokens
        wanted: dict[int, list[int]] = {}
        for i, kind in enumerate(self.kinds):
            if kind.kind == FULL:
                full = min(done // bt, min(len(state.tables[g]) for g in kind.group_ids) // self.per_block)
                if full > state.saved:
                    wanted[i] = list(range(state.saved, full))
                continue
            points = resume_points(request.num_prompt_tokens, bt, state.junction)
            if kind.kind == STATE:     # a snapshot exactly at a point: this step's chunk ends there
                needed = {p - 1 for p in points if p * bt == done}
            else:
                needed = {k for p in points for k in kind.needs(p) if before < (k + 1) * bt <= done}
            positions = sorted(k for k in needed if (i, k) not in state.kept)
            if positions:
                wanted[i] = positions
        if not wanted:
            return None
        copies = [c for c in (self._real(c) for c in self._copies(state, wanted)[0]) if c.positions]
        if not copies:
            return None
        end = max(c.positions[-1] + 1 for c in copies)
        chain = state.chain.upto(request.all_token_ids, end)
        if self.routes is not None:       # before the workers commit the blocks: their events carry the keys
            self.routes.saved(request, chain, [(c.kind, c.positions) for c in copies])
        for c in copies:
            if self.kinds[c.kind].kind == FULL:
                self._on_gpu(state, state.saved, c.positions[-1] + 1)
                state.saved = c.positions[-1] + 1
            else:
                state.kept.update((c.kind, k) for k in c.positions)
        return SaveOp(request.request_id, request.all_token_ids, end, copies)

    def _real(self, copy: KindPages) -> KindPages:
        """``copy`` without the positions whose pages are placeholders (never saved)."""
        n = self.per_block
        keep = [j for j in range(len(copy.positions))
                if all(NULL_PAGE not in pages[j * n:(j + 1) * n] and len(pages) >= (j + 1) * n for pages in copy.pages)]
        if len(keep) == len(copy.positions):
            return copy
        if self.kinds[copy.kind].kind == FULL:      # full blocks are a chain: stop at the first gap
            keep = [j for i, j in enumerate(keep) if i == j]
        return KindPages(copy.kind, [copy.positions[j] for j in keep],
                         [[p for j in keep for p in pages[j * n:(j + 1) * n]] for pages in copy.pages])

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

    def _pages(self, state: _Request) -> list[int]:
        return state.tables[self._gpu_group] if self._gpu_group is not None and state.tables else []

    def _computed_pages(self, state: _Request) -> int:
        return len(self._pages(state))

    def _on_gpu(self, state: _Request, first: int, end: int) -> None:
        """Full-attention blocks [first, end) of the request are (about to be) in vLLM pages."""
        pages_of = self._pages(state)
        if not pages_of:
            return
        for k, digest in enumerate(state.chain.digests[first:end], start=first):
            pages = pages_of[k * self.per_block:(k + 1) * self.per_block]
            for page in pages:
                self._page_digest[page] = digest
            self._digest_pages[digest] = pages
            self._pinned.append(digest)

    def _assign(self, state: _Request, tables: Sequence[Sequence[int]], computed: int) -> None:
        """The request's pages are now ``tables`` (per group); those of the residency group from
        ``computed`` tokens on that it did not hold before are newly handed out by vLLM."""
        known = set(self._pages(state))
        state.tables = [list(t) for t in tables]
        self._fresh([page for page in self._pages(state)[computed // self.page_tokens:] if page not in known])

    def _fresh(self, pages: Sequence[int]) -> None:
        """vLLM handed out these pages anew: whatever block they held left the GPU."""
        for page in pages:
            digest = self._page_digest.pop(page, None)
            if digest is None:
                continue
            for other in self._digest_pages.pop(digest, ()):
                self._page_digest.pop(other, None)
            self._evicted.append(digest)
