"""Dense ids for keys, and FIFO lists of ids threaded through arrays (no I/O).

A tier with a million resident blocks pays for every byte it keeps per block. A dict entry with
its key costs some 40 bytes plus the key; an OrderedDict entry some 90 more. So the RAM tier and
the eviction policies name a block by a small dense int, its *id*, and keep per-block state in
``array`` columns indexed by it: a few bytes a block.

- :class:`KeyIds` hands out ids for keys (lowest freed first, so ids stay below the peak number of
  keys held at once) and maps each way.
- :class:`IdLinks` holds the columns that several :class:`IdQueue` share: previous and next id,
  which queue an id is in (``where``) and one small value per id (``value``: a reference bit, a
  frequency). An id is in at most one queue of a set of links.
- :class:`IdQueue` is one FIFO: push at the back, remove anywhere, move to the back, all O(1).

Where the most ids there can ever be is known (the RAM tier: one per arena slot), the columns
are laid out for all of them at once in anonymous memory (:func:`column`) whose pages the
kernel backs only once touched: no copy as they fill, and no heap left in holes by the copies
(which cost some 35 bytes a block at a million blocks). Elsewhere they grow as ``array``s.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from typing import Callable, Iterator, Literal, Union, cast

__all__ = ["KeyIds", "IdLinks", "IdQueue", "column", "grown"]

Column = Union["array[int]", bytearray, memoryview]
Format = Literal["B", "i", "I", "q"]
_LINK_FORMATS: tuple[tuple[str, Format], ...] = (("prev", "i"), ("next", "i"), ("where", "B"), ("value", "B"))

NONE = -1


def column(fmt: Format, size: int) -> memoryview:
    """``size`` zeros of the struct format ``fmt`` ("B", "i", "I", "q"), indexable as ints, in
    anonymous memory: pages cost RAM once written, so a column sized for every id a tier can
    hand out costs only what the ids in use touch."""
    return memoryview(mmap.mmap(-1, max(1, size) * struct.calcsize(fmt), flags=mmap.MAP_PRIVATE)).cast(fmt)


def grown(column: array[int], size: int) -> None:
    """Extend ``column`` with zeros to at least ``size`` entries, by a quarter at least (amortised
    O(1), and at most a quarter of the column unused)."""
    if len(column) < size:
        column.frombytes(bytes(max(size - len(column), len(column) // 4, 64) * column.itemsize))


class KeyIds:
    """Keys to dense ids and back: a dict, a list and a stack of freed ids."""

    __slots__ = ("index", "keys", "_free")

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}      # key -> id (read it directly on hot paths)
        self.keys: list[bytes | None] = []      # id -> key (None: free)
        self._free: list[int] = []

    def get(self, key: bytes) -> int | None:
        return self.index.get(key)

    def add(self, key: bytes) -> int:
        """The id of ``key``, a new one if it has none."""
        entry = self.index.get(key)
        if entry is not None:
            return entry
        if self._free:
            entry = self._free.pop()
            self.keys[entry] = key
        else:
            entry = len(self.keys)
            self.keys.append(key)
        self.index[key] = entry
        return entry

    def discard(self, key: bytes) -> int | None:
        """Forget ``key``; its id (returned, None if it had none) may be handed out again."""
        entry = self.index.pop(key, None)
        if entry is not None:
            self.keys[entry] = None
            self._free.append(entry)
        return entry

    @property
    def key_getter(self) -> Callable[[int], bytes]:
        """The key of an id in use, as one C-level call: what walks over a million ids (policy
        snapshots) use instead of :meth:`key_of`, which checks."""
        return cast(Callable[[int], bytes], self.keys.__getitem__)

    def key_of(self, entry: int) -> bytes:
        key = self.keys[entry]
        if key is None:
            raise KeyError(f"id {entry} is free")
        return key

    @property
    def size(self) -> int:
        """One more than the highest id ever handed out (how long id-indexed columns must be)."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.index)

    def entries(self) -> Iterator[int]:
        """The ids in use, in the order their keys were added."""
        return iter(self.index.values())

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter(self.index.items())


class IdLinks:
    """The columns a set of :class:`IdQueue` share (see the module docstring)."""

    __slots__ = ("prev", "next", "where", "value", "_fixed")

    def __init__(self) -> None:
        self.prev: Column = array("i")
        self.next: Column = array("i")
        self.where: Column = bytearray()   # 0: in no queue; else the tag of the queue holding the id
        self.value: Column = bytearray()
        self._fixed = False

    def size_for(self, capacity: int) -> None:
        """Ids will stay below ``capacity``: lay the columns out for that many now (see
        :func:`column`), keeping what they hold."""
        if capacity <= len(self.where):
            return
        for name, fmt in _LINK_FORMATS:
            old = getattr(self, name)
            new = column(fmt, capacity)
            if len(old):
                new[:len(old)] = memoryview(old).cast("B").cast(fmt)
            setattr(self, name, new)
        self._fixed = True

    def ensure(self, entry: int) -> None:
        if entry >= len(self.where):
            if self._fixed:
                raise IndexError(f"id {entry} is beyond the {len(self.where)} the policy was sized for")
            assert isinstance(self.prev, array) and isinstance(self.next, array)
            assert isinstance(self.where, bytearray) and isinstance(self.value, bytearray)
            size = entry + 1
            grown(self.prev, size)
            grown(self.next, size)
            self.where.extend(bytes(max(size - len(self.where), len(self.where) // 4, 64)))
            self.value.extend(bytes(len(self.where) - len(self.value)))

    def tag_of(self, entry: int) -> int:
        """The tag of the queue holding ``entry`` (0: none)."""
        return self.where[entry] if entry < len(self.where) else 0


class IdQueue:
    """One FIFO list of ids (oldest first) over shared :class:`IdLinks`; ``tag`` (1..255)
    names it in ``links.where``."""

    __slots__ = ("links", "tag", "head", "tail", "size")

    def __init__(self, links: IdLinks, tag: int) -> None:
        if not 0 < tag < 256:
            raise ValueError("a queue's tag is 1..255")
        self.links = links
        self.tag = tag
        self.head = NONE
        self.tail = NONE
        self.size = 0

    def __contains__(self, entry: int) -> bool:
        where = self.links.where
        return entry < len(where) and where[entry] == self.tag

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.entries())

    def entries(self) -> list[int]:
        """The ids, oldest first (a copy: the queue may change while it is used)."""
        out: list[int] = []
        append, following = out.append, self.links.next
        entry = self.head
        while entry != NONE:
            append(entry)
            entry = following[entry]
        return out

    # The three changes are written out, not built on shared helpers: a Python call costs
    # about as much as the whole change, and these run once or twice per block per request.

    def push(self, entry: int, value: int = 0) -> None:
        """Append ``entry`` (in no queue of these links now) at the back, with ``value``."""
        links = self.links
        if entry >= len(links.where):
            links.ensure(entry)
        tail = self.tail
        links.prev[entry] = tail
        links.next[entry] = NONE
        if tail == NONE:
            self.head = entry
        else:
            links.next[tail] = entry
        self.tail = entry
        self.size += 1
        links.where[entry] = self.tag
        links.value[entry] = value

    def remove(self, entry: int) -> None:
        """Take ``entry`` (in this queue) out; its value is kept until it is pushed again."""
        links = self.links
        before, after = links.prev[entry], links.next[entry]
        if before == NONE:
            self.head = after
        else:
            links.next[before] = after
        if after == NONE:
            self.tail = before
        else:
            links.prev[after] = before
        self.size -= 1
        links.where[entry] = 0

    def move_to_back(self, entry: int) -> None:
        """``entry`` (in this queue) becomes the youngest, its value unchanged."""
        tail = self.tail
        if entry == tail:
            return
        links = self.links
        prev, following = links.prev, links.next
        before, after = prev[entry], following[entry]      # after is not NONE: entry is not the tail
        if before == NONE:
            self.head = after
        else:
            following[before] = after
        prev[after] = before
        prev[entry] = tail
        following[entry] = NONE
        following[tail] = entry
        self.tail = entry
