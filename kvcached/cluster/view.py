"""The cluster's live members as this daemon knows them (sans-I/O).

:class:`MembershipView` is fed what etcd says, by the thin layer in :mod:`kvcached.cluster.etcd`:
a full listing at a revision (:meth:`reset`: at start, and again whenever the watch had to be
opened anew), then each change (:meth:`put`, :meth:`delete`) with its revision. Each call
returns the :class:`Change` it made, so the peer tier and the placement follow it.

While etcd cannot be reached the view simply stays as it was: the daemon keeps serving the last
membership, and no node it has not seen registered is ever added (only etcd adds members).
A registration that cannot be used (:class:`~kvcached.cluster.member.MemberError`) is left out
and counted in ``refused``, with the reason kept for Stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from kvcached.cluster.member import Member, MemberError, name_of_key

__all__ = ["MembershipView", "Change"]

REFUSED_KEPT = 64            # reasons kept for Stats (the count has them all)


@dataclass
class Change:
    """What one update changed: members that joined, left, or registered anew (another
    address or capacity: a restart under the same name)."""

    joined: list[Member] = field(default_factory=list)
    left: list[Member] = field(default_factory=list)
    updated: list[Member] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.joined or self.left or self.updated)


class MembershipView:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.members: dict[str, Member] = {}
        self.revision = 0                       # the etcd revision this view is at
        self.refused = 0                        # registrations refused, in all
        self.refusals: dict[str, str] = {}      # key -> why, the latest REFUSED_KEPT

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.members)

    def reset(self, rows: Iterable[tuple[str, bytes]], revision: int) -> Change:
        """The full listing under the members prefix, as of ``revision``: members not in it
        have left, new ones joined."""
        listed: dict[str, Member] = {}
        for key, value in rows:
            member = self._parse(key, value)
            if member is not None:
                listed[member.name] = member
        change = Change()
        for name in sorted(self.members.keys() - listed.keys()):
            change.left.append(self.members.pop(name))
        for name, member in sorted(listed.items()):
            self._set(member, change)
        self.revision = revision              # a listing is the truth, even of an etcd that started over
        return change

    def put(self, key: str, value: bytes, revision: int) -> Change:
        change = Change()
        if revision <= self.revision:          # seen already (a watch opened anew replays from a revision)
            return change
        self.revision = revision
        member = self._parse(key, value)
        if member is None:                     # an unusable registration: the member (if any) is not used
            self._remove(key, change)
        else:
            self._set(member, change)
        return change

    def delete(self, key: str, revision: int) -> Change:
        change = Change()
        if revision > self.revision:
            self.revision = revision
            self._remove(key, change)
        return change

    def _remove(self, key: str, change: Change) -> None:
        try:
            name = name_of_key(self.prefix, key)
        except MemberError:
            return
        if name in self.members:
            change.left.append(self.members.pop(name))

    def _set(self, member: Member, change: Change) -> None:
        old = self.members.get(member.name)
        if old == member:
            return
        self.members[member.name] = member
        (change.joined if old is None else change.updated).append(member)

    def _parse(self, key: str, value: bytes) -> Member | None:
        try:
            return Member.decode(name_of_key(self.prefix, key), value)
        except MemberError as exc:
            self.refused += 1
            self.refusals[key] = str(exc)
            while len(self.refusals) > REFUSED_KEPT:
                del self.refusals[next(iter(self.refusals))]
            return None
