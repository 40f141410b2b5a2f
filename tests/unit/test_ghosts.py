"""GhostFilter (kvcached/policies/ghosts.py): a FIFO of about ``limit`` evicted keys in a dozen
bytes each, with a rare false "yes", surviving a restart."""

from __future__ import annotations

import os

from kvcached.policies.ghosts import CELLS_PER_KEY, GhostFilter


def test_the_last_keys_added_are_found_and_older_ones_forgotten() -> None:
    ghosts = GhostFilter()
    keys = [os.urandom(32) for _ in range(45_000)]
    for key in keys:
        ghosts.add(key, 10_000)
    assert all(key in ghosts for key in keys[-15_000:])     # the generation of 40,000-44,999 and the one before
    assert sum(key in ghosts for key in keys[:25_000]) < 25_000 * 0.01
    assert sum(os.urandom(32) in ghosts for _ in range(20_000)) < 20_000 * 0.01
    assert len(ghosts.cells) == CELLS_PER_KEY * ghosts.capacity <= CELLS_PER_KEY * 30_000
    assert len(ghosts) == 15_000


def test_short_keys_are_hashed_and_the_cells_grow_with_the_limit() -> None:
    ghosts = GhostFilter()
    ghosts.add(b"a", 10)
    assert b"a" in ghosts and b"b" not in ghosts
    ghosts.add(b"b", 1000)                          # outgrown: laid out again, empty
    assert ghosts.capacity >= 2000 and b"b" in ghosts and b"a" not in ghosts


def test_state_round_trips_and_a_damaged_one_is_refused() -> None:
    ghosts = GhostFilter()
    keys = [os.urandom(32) for _ in range(300)]
    for key in keys:
        ghosts.add(key, 200)
    again = GhostFilter()
    assert again.restore(ghosts.state())
    assert [key in again for key in keys] == [key in ghosts for key in keys]
    again.add(keys[0], 200)
    ghosts.add(keys[0], 200)
    assert again.state() == ghosts.state()
    fresh = GhostFilter()
    for bad in (b"", b"\x00" * 5, bytes(CELLS_PER_KEY * 64) + b"\x09" + bytes(16), b"\x07" * (CELLS_PER_KEY * 64 + 17)):
        assert not fresh.restore(bad)
    assert fresh.state() == GhostFilter().state()
