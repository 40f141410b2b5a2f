"""kvcached.policies.links: dense ids for keys, id queues threaded through shared columns, and
columns laid out in anonymous memory."""

from __future__ import annotations

import pytest

from kvcached.policies.links import IdLinks, IdQueue, KeyIds, column


def test_key_ids_are_dense_and_reused() -> None:
    ids = KeyIds()
    assert [ids.add(k) for k in (b"a", b"b", b"c")] == [0, 1, 2]
    assert ids.add(b"b") == 1, "a key keeps its id"
    assert ids.discard(b"b") == 1 and ids.discard(b"b") is None
    assert b"b" not in ids and ids.get(b"b") is None and len(ids) == 2
    assert ids.add(b"d") == 1, "a freed id is handed out again before a new one"
    assert ids.size == 3 and ids.key_of(1) == b"d" and list(ids.items()) == [(b"a", 0), (b"c", 2), (b"d", 1)]
    ids.discard(b"a")
    with pytest.raises(KeyError, match="free"):
        ids.key_of(0)


def test_queues_share_links_and_keep_order() -> None:
    links = IdLinks()
    first, second = IdQueue(links, 1), IdQueue(links, 2)
    for entry in (5, 1, 9):
        first.push(entry, value=entry)
    second.push(3)
    assert list(first) == [5, 1, 9] and list(second) == [3] and len(first) == 3
    assert 1 in first and 1 not in second and links.tag_of(3) == 2 and links.tag_of(1000) == 0
    first.move_to_back(5)
    assert list(first) == [1, 9, 5] and links.value[5] == 5, "a move keeps the value"
    first.remove(9)
    assert list(first) == [1, 5] and (first.head, first.tail) == (1, 5) and 9 not in first
    first.remove(1)
    first.remove(5)
    assert not first and list(first) == [] and (first.head, first.tail) == (-1, -1)
    second.push(9)
    assert list(second) == [3, 9], "an id left one queue and joined the other"
    with pytest.raises(ValueError):
        IdQueue(links, 0)


def test_columns_grow_until_sized_then_hold_their_size() -> None:
    links = IdLinks()
    queue = IdQueue(links, 1)
    for entry in range(200):                 # grows as arrays, by a quarter at least
        queue.push(entry, value=entry % 7)
    links.size_for(1000)                     # laid out for 1000, what they held kept
    assert list(queue) == list(range(200)) and [links.value[e] for e in range(200)] == [e % 7 for e in range(200)]
    queue.push(999)
    assert list(queue)[-2:] == [199, 999]
    with pytest.raises(IndexError, match="sized for"):
        queue.push(1000)


def test_a_column_is_zeros_and_typed() -> None:
    col = column("q", 10)
    assert len(col) == 10 and list(col) == [0] * 10
    col[9] = -(1 << 40)
    assert col[9] == -(1 << 40)
    with pytest.raises((OverflowError, ValueError)):
        column("B", 4)[0] = 256
