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

A snapshot of a million entries cannot be walked in one step of the event loop (some 0.1 s a
million). :meth:`IdLinks.frozen` copies the columns a walk reads (one C-level copy each, a few
milliseconds for a million ids), and :meth:`IdQueue.frozen` gives the queue over the copy: the
copy never changes, so it can be walked a slice at a time (:meth:`IdQueue.entries_steps`, which
yields every ``STEP`` entries, into an ``array`` of ids: a list of a million ints costs some
10 ms to free) while the live queue goes on changing. The keys of the ids walked come from
:meth:`KeyIds.frozen_keys`: the live key table, with the keys of the ids given back since kept
aside (copying the table, and freeing the copy, cost some 8 ms each a million ids).
"""

from __future__ import annotations

import mmap
import struct
from array import array
from typing import Callable, Iterator, Literal, Sequence, TypeVar, Union, cast

__all__ = ["KeyIds", "FrozenKeys", "IdLinks", "IdQueue", "column", "grown", "frozen", "gathered", "STEP"]

Column = Union["array[int]", bytearray, memoryview]
Format = Literal["B", "i", "I", "q"]
_LINK_FORMATS: tuple[tuple[str, Format], ...] = (("prev", "i"), ("next", "i"), ("where", "B"), ("value", "B"))

NONE = -1
T = TypeVar("T")
STEP = 2048        # entries a walk or a gather handles between two yields (a few tenths of a millisecond)


def column(fmt: Format, size: int) -> memoryview:
    """``size`` zeros of the struct format ``fmt`` ("B", "i", "I", "q"), indexable as ints, in
    anonymous memory: pages cost RAM once written, so a column sized for every id a tier can
    hand out costs only what the ids in use touch."""
    return memoryview(mmap.mmap(-1, max(1, size) * struct.calcsize(fmt), flags=mmap.MAP_PRIVATE)).cast(fmt)


def frozen(col: Column) -> memoryview:
    """A copy of ``col``, indexable as ints as it is: one C-level copy of its bytes."""
    view = memoryview(col)
    return memoryview(bytes(view.cast("B"))).cast(cast(Format, view.format))


def gathered(entries: Sequence[int], of: Callable[[int], T], out: list[T]) -> Iterator[None]:
    """Append ``of(entry)`` for each of ``entries`` to ``out``, ``STEP`` entries a step (yields
    between steps): keys (:class:`FrozenKeys`), values of a frozen column. ``of`` must give what
    it gave when the steps began."""
    many = of.many if isinstance(of, FrozenKeys) else None
    for start in range(0, len(entries), STEP):
        piece = entries[start:start + STEP]
        if many is not None:
            many(piece, cast(list[bytes], out))
        else:
            out.extend(map(of, piece))
        yield None


def grown(column: array[int], size: int) -> None:
    """Extend ``column`` with zeros to at least ``size`` entries, by a quarter at least (amortised
    O(1), and at most a quarter of the column unused)."""
    if len(column) < size:
        column.frombytes(bytes(max(size - len(column), len(column) // 4, 64) * column.itemsize))


class KeyIds:
    """Keys to dense ids and back: a dict, a list and a stack of freed ids."""

    __slots__ = ("index", "keys", "_free", "_watches")

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}      # key -> id (read it directly on hot paths)
        self.keys: list[bytes | None] = []      # id -> key (None: free)
        self._free: list[int] = []
        self._watches: list[dict[int, bytes]] = []   # of FrozenKeys: ids given back since, their keys

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
            for gone in self._watches:
                gone.setdefault(entry, key)
            self.keys[entry] = None
            self._free.append(entry)
        return entry

    def frozen_keys(self) -> "FrozenKeys":
        """The key of each id in use now, for as long as the result lives (see FrozenKeys)."""
        return FrozenKeys(self.keys, self._watches)

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


class FrozenKeys:
    """The keys of the ids a :class:`KeyIds` had in use when this was made, while the table goes
    on giving ids back and handing them out again: the live key table, and the keys of the ids
    given back since (the table keeps them aside while this lives: :meth:`close`, or its end).
    Call it for one key; :meth:`many` for many, at C speed."""

    __slots__ = ("_keys", "_watches", "_gone")

    def __init__(self, keys: list[bytes | None], watches: list[dict[int, bytes]]) -> None:
        """``keys``: the table's id -> key list; ``watches``: where the table looks for the
        dicts to note the ids it gives back in (KeyIds.frozen_keys passes both)."""
        self._keys, self._watches = keys, watches
        self._gone: dict[int, bytes] = {}
        watches.append(self._gone)

    def __call__(self, entry: int) -> bytes:
        key = self._gone.get(entry)
        return key if key is not None else cast(bytes, self._keys[entry])

    def many(self, entries: Sequence[int], out: list[bytes]) -> None:
        """Append the keys of ``entries`` (ids in use when this was made) to ``out``."""
        start = len(out)
        out.extend(cast(Iterator[bytes], map(self._keys.__getitem__, entries)))
        gone = self._gone
        if gone and any(map(gone.__contains__, entries)):    # C-level, over these entries only
            for i, entry in enumerate(entries):
                key = gone.get(entry)
                if key is not None:
                    out[start + i] = key

    def close(self) -> None:
        """Stop keeping the keys of ids given back (at once; also when this is freed)."""
        watches = self._watches
        if any(w is self._gone for w in watches):
            watches[:] = [w for w in watches if w is not self._gone]

    def __del__(self) -> None:
        self.close()


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

    def frozen(self) -> "IdLinks":
        """A copy of the columns a walk reads (``next``, ``where``, ``value``; not ``prev``), as
        they are now: queues over it (:meth:`IdQueue.frozen`) can be walked in steps."""
        copy = IdLinks()
        copy.next, copy.where, copy.value = frozen(self.next), frozen(self.where), frozen(self.value)
        copy._fixed = True
        return copy


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

    def frozen(self, links: IdLinks) -> "IdQueue":
        """This queue as it is now, over ``links``, a :meth:`IdLinks.frozen` copy of its links
        taken at the same time."""
        copy = IdQueue(links, self.tag)
        copy.head, copy.tail, copy.size = self.head, self.tail, self.size
        return copy

    def entries_steps(self, out: array[int]) -> Iterator[None]:
        """:meth:`entries` into ``out``, yielding every ``STEP`` entries: for a queue over frozen
        links only (the walk spans several steps, so the links must not change between them)."""
        append, following = out.append, self.links.next
        entry = self.head
        while entry != NONE:
            for _ in range(STEP):
                append(entry)
                entry = following[entry]
                if entry == NONE:
                    break
            yield None

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
