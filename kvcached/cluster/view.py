"""The cluster's live members as this daemon knows them (sans-I/O).

:class:`MembershipView` is fed what etcd says, by the thin layer in :mod:`kvcached.cluster.etcd`:
a full listing at a revision (:meth:`reset`: at start, and again whenever the watch had to be
opened anew), then each change (:meth:`put`, :meth:`delete`) with its revision. Each call
returns the :class:`Change` it made, so the peer tier and the placement follow it.

While etcd cannot be reached the view simply stays as it was: the daemon keeps serving the last
membership, and no node it has not seen registered is ever added (only etcd adds members).
Only a registration that proves itself counts (kvcached.cluster.proof: the member's certificate
from the cluster CA, the lease etcd attaches it to, a signature by the member's key): one that
does not, or cannot be used otherwise (:class:`~kvcached.cluster.member.MemberError`), is left
out and counted in ``refused``, with the reason kept for Stats. A member whose certificate
expires leaves the view at :meth:`expire` (peers would refuse its connections from then on).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from kvcached.cluster.member import Member, MemberError, name_of_key
from kvcached.cluster.proof import Proven

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


class Verifier(Protocol):
    """What proves a registration (kvcached.cluster.proof.RegistrationVerifier)."""

    def verify(self, key: str, name: str, value: bytes, lease: int) -> Proven: ...


class MembershipView:
    """See the module. ``verifier`` decides which registrations prove themselves."""

    def __init__(self, prefix: str, verifier: Verifier) -> None:
        self.prefix = prefix
        self.verifier = verifier
        self.members: dict[str, Member] = {}
        self._valid_until: dict[str, datetime.datetime] = {}
        self.revision = 0                       # the etcd revision this view is at
        self.refused = 0                        # registrations refused, in all
        self.refusals: dict[str, str] = {}      # key -> why, the latest REFUSED_KEPT

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.members)

    def reset(self, rows: Iterable[tuple[str, bytes, int]], revision: int) -> Change:
        """The full listing under the members prefix (key, value, lease), as of ``revision``:
        members not in it have left, new ones joined."""
        listed: dict[str, Proven] = {}
        for key, value, lease in rows:
            proven = self._parse(key, value, lease)
            if proven is not None:
                listed[proven.member.name] = proven
        change = Change()
        for name in sorted(self.members.keys() - listed.keys()):
            self._valid_until.pop(name, None)
            change.left.append(self.members.pop(name))
        for name, proven in sorted(listed.items()):
            self._set(proven, change)
        self.revision = revision              # a listing is the truth, even of an etcd that started over
        return change

    def put(self, key: str, value: bytes, lease: int, revision: int) -> Change:
        change = Change()
        if revision <= self.revision:          # seen already (a watch opened anew replays from a revision)
            return change
        self.revision = revision
        proven = self._parse(key, value, lease)
        if proven is None:                     # an unusable registration: the member (if any) is not used
            self._remove(key, change)
        else:
            self._set(proven, change)
        return change

    def expire(self, now: datetime.datetime) -> Change:
        """Members whose certificate is no longer valid at ``now`` leave (counted as refused)."""
        change = Change()
        for name in sorted(n for n, until in self._valid_until.items() if until <= now):
            del self._valid_until[name]
            change.left.append(self.members.pop(name))
            self._refuse(f"{self.prefix.rstrip('/')}/members/{name}", f"the certificate of {name!r} expired")
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
            self._valid_until.pop(name, None)
            change.left.append(self.members.pop(name))

    def _set(self, proven: Proven, change: Change) -> None:
        member = proven.member
        self._valid_until[member.name] = proven.valid_until
        old = self.members.get(member.name)
        if old == member:
            return
        self.members[member.name] = member
        (change.joined if old is None else change.updated).append(member)

    def _parse(self, key: str, value: bytes, lease: int) -> Proven | None:
        try:
            return self.verifier.verify(key, name_of_key(self.prefix, key), value, lease)
        except MemberError as exc:
            self._refuse(key, str(exc))
            return None

    def _refuse(self, key: str, reason: str) -> None:
        self.refused += 1
        self.refusals.pop(key, None)
        self.refusals[key] = reason
        while len(self.refusals) > REFUSED_KEPT:
            del self.refusals[next(iter(self.refusals))]
