"""The hit length of a hybrid model (kvcached_agent.engines.hybrid): vLLM's hybrid prefix cache
rules over what the daemon holds, with no engine (the end-to-end tests compare with vLLM)."""

from __future__ import annotations

from kvcached_agent.engines.hybrid import FULL, SLIDING, STATE, GroupKind, hit_length, kind_digests, kind_root, resume_points

FULL_KIND = GroupKind("full", FULL, (1,))
SWA = GroupKind("sliding128", SLIDING, (0,), window_blocks=2)
MAMBA = GroupKind("state", STATE, (0,))


def held_at(positions: dict[str, set[int]]):  # type: ignore[no-untyped-def]
    return lambda kind, k: k in positions.get(kind.name, set())


def test_a_sliding_window_hit_needs_its_window_before_the_end() -> None:
    kinds = [SWA, FULL_KIND]
    # The window tail of a resume point at 7 blocks is held: the hit is 7.
    assert hit_length(kinds, 10, 9, held_at({"sliding128": {5, 6}})) == 7
    # Only one block of the tail: no run of two anywhere, and none from block 0.
    assert hit_length(kinds, 10, 9, held_at({"sliding128": {6}})) == 0
    # The full-attention prefix caps the candidate before the sliding kind is asked.
    assert hit_length(kinds, 10, 6, held_at({"sliding128": {5, 6}})) == 0
    assert hit_length(kinds, 10, 6, held_at({"sliding128": {4, 5, 6}})) == 6
    # A run from block 0 shorter than the window is a hit (the window reaches the start).
    assert hit_length(kinds, 10, 9, held_at({"sliding128": {0}})) == 1
    # The longest of several tails within the limit.
    assert hit_length(kinds, 8, 9, held_at({"sliding128": {1, 2, 5, 6, 8, 9}})) == 7


def test_a_state_hit_needs_the_snapshot_exactly_at_its_end() -> None:
    kinds = [MAMBA, FULL_KIND]
    assert hit_length(kinds, 8, 8, held_at({"state": {3}})) == 4          # the state after block 3
    assert hit_length(kinds, 8, 3, held_at({"state": {3}})) == 0          # full attention stops short of it
    assert hit_length(kinds, 8, 8, held_at({"state": {1, 6}})) == 7
    assert hit_length(kinds, 5, 8, held_at({"state": {1, 6}})) == 2       # the limit (the prompt) comes first


def test_every_kind_must_agree_and_the_candidate_only_shrinks() -> None:
    kinds = [SWA, MAMBA, FULL_KIND]
    # The sliding kind could resume at 7, the state only at 4: 4 needs the sliding tail at 4 too.
    assert hit_length(kinds, 9, 9, held_at({"sliding128": {5, 6}, "state": {3}})) == 0
    assert hit_length(kinds, 9, 9, held_at({"sliding128": {2, 3, 5, 6}, "state": {3}})) == 4
    assert hit_length(kinds, 9, 9, held_at({"sliding128": {2, 3, 5, 6}, "state": {3, 6}})) == 7
    # No full-attention kind: the limit is the only cap.
    assert hit_length([MAMBA], 6, 0, held_at({"state": {5}})) == 6


def test_resume_points_are_the_replay_boundary_and_a_junction() -> None:
    assert resume_points(1000, 128) == [7]              # 999 tokens before the last: 7 whole blocks
    assert resume_points(1025, 256) == [4]
    assert resume_points(1024, 256) == [3]              # a resend recomputes the last token's block
    assert resume_points(1000, 128, junction=3) == [3, 7]
    assert resume_points(100, 128) == []


def test_each_kind_has_addresses_of_its_own() -> None:
    chain = [bytes([i]) * 32 for i in range(4)]
    roots = {kind.name: kind_root("m", "bfloat16", 128, "tp0of1", kind) for kind in (FULL_KIND, SWA, MAMBA)}
    assert kind_digests(roots["full"], FULL_KIND, chain, [1, 2]) == chain[1:3]
    swa, state = kind_digests(roots["sliding128"], SWA, chain, [1]), kind_digests(roots["state"], MAMBA, chain, [1])
    assert len({chain[1], swa[0], state[0]}) == 3
    assert len(set(roots.values())) == 3
    # A second full-attention kind (another spec) is not the chain's own: addresses of its own.
    other = GroupKind("full1", FULL, (2,))
    assert kind_digests(kind_root("m", "bfloat16", 128, "tp0of1", other), other, chain, [1]) != chain[1:2]
