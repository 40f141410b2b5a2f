"""Whether a pull from a peer asks for its blocks coded (``[quic] link_codec``, issue 64), sans-I/O.

Coding a block for the wire pays on a link slower than the codec and costs on a fast one: the
holder encodes, the wire carries fewer bytes, the puller decodes. Whether it pays with one
peer depends on that link's rate now, the holder's cores and the puller's, and how well this
traffic codes, none of which a constant knows. So :class:`LinkCoding` measures what each form
delivers from each peer, and pulls take the form that delivers more.

What a form delivers is measured over a window of its recent pulls, not pull by pull: the block
bytes they brought over the time at least one of them was in flight (the union of their
intervals, each from its request on the wire to its last block checked; the time a pull waited
for a connection to open is not the link's). So pulls that overlap (an engine's load asks its
next chunk while one is copied) are counted together, as the link carries them, and the size
of one pull weighs little. A pull that was on the wire at the same time as a pull of the other
form from the same peer shared the link with it: it is not counted at all (when a probe starts,
the pulls of the form left are still finishing).

Pulls take one form. Every :data:`LinkCoding.PROBE_S`, once the form taken has moved
:data:`LinkCoding.PROBE_BYTES`, pulls take the other form until it has moved as much (or
:data:`LinkCoding.PROBE_MAX_S` passed): a probe. Then the two windows are compared, and the
other form is taken only if it delivered :data:`LinkCoding.BETTER` times as much (no flapping
between two forms that are near equal). A probe that changes the form is confirmed at once: the
form left is probed again, now measured beside the new one's fresh window, since what made it
look slower may have passed (the first pulls from a peer run on new connections still in TCP's
slow start and into slots touched for the first time). A peer starts raw (the form that needs
no holder work), so its first probe tries the codec. A link that slows down or speeds up is
followed soon where the form taken shows it (its newest PROBE_BYTES delivering
:data:`LinkCoding.CHANGE` times more or less than the PROBE_BYTES before them: the other form
is probed at the next pull, or :data:`LinkCoding.CHANGE_GAP_S` after the last probe), else
within a probe period; the cost is one probe's bytes in the worse form per ``PROBE_S``, and
on a link whose rate swings by CHANGE, per ``CHANGE_GAP_S`` at most.

``always`` (``link_codec`` names a codec) asks for every pull coded; the holder still sends
raw each block its codec does not shrink. The clock is passed in; the peer tier's fetches
report each pull (:meth:`LinkCoding.took`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvcached.codecs import AUTO, codec_named
from kvcached.codecs.stored import AUTO_CODEC

__all__ = ["LinkCoding", "LinkPull", "link_coding"]


class _Window:
    """One form's recent pulls from one peer: (start, end, bytes) each, the oldest dropped once
    the rest hold ``keep`` bytes, or once there are ``most`` (each pull's rate and change are
    worked out over the window on the event loop: its length is what that costs; a peer whose
    pulls are so small that ``most`` of them hold less than a probe's bytes is never probed,
    and its pulls stay raw)."""

    def __init__(self, keep: int, most: int) -> None:
        self.keep, self.most = keep, most
        self.pulls: deque[tuple[float, float, int]] = deque()
        self.bytes = 0
        self.unchecked = 0           # bytes added since :meth:`changed` last looked

    def add(self, start: float, end: float, nbytes: int) -> None:
        self.pulls.append((start, end, nbytes))
        self.bytes += nbytes
        self.unchecked += nbytes
        while len(self.pulls) > self.most or (len(self.pulls) > 1 and self.bytes - self.pulls[0][2] >= self.keep):
            self.bytes -= self.pulls.popleft()[2]

    def clear(self) -> None:
        self.pulls.clear()
        self.bytes = self.unchecked = 0

    def rate(self) -> float:
        """Bytes per second of the time at least one pull was in flight (0: none measured)."""
        return _rate(self.pulls)

    def changed(self, recent: int, factor: float) -> bool:
        """Whether the newest pulls, ``recent`` bytes or more of them, delivered ``factor``
        times more or less than the ``recent`` bytes or more before them; if so, the older
        pulls are dropped (they say nothing of the link now). Looked at once a quarter of
        ``recent`` came since the last look, so that its cost per pull stays small."""
        if self.unchecked < recent // 4:
            return False
        self.unchecked = 0
        newer: list[tuple[float, float, int]] = []
        moved = 0
        for pull in reversed(self.pulls):
            if moved >= recent:
                break
            newer.append(pull)
            moved += pull[2]
        older = list(self.pulls)[:len(self.pulls) - len(newer)]
        if moved < recent or sum(p[2] for p in older) < recent:
            return False
        now, before = _rate(newer), _rate(older)
        if before <= 0 or 1 / factor < now / before < factor:
            return False
        for _ in older:
            self.bytes -= self.pulls.popleft()[2]
        return True


def _rate(pulls: "deque[tuple[float, float, int]] | list[tuple[float, float, int]]") -> float:
    """The bytes of ``pulls`` over the time at least one of them was in flight (0: no time)."""
    busy, reach = 0.0, float("-inf")
    for start, end, _ in sorted(pulls):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return sum(p[2] for p in pulls) / busy if busy > 0 else 0.0


@dataclass(eq=False)
class LinkPull:
    """One pull on the wire, from :meth:`LinkCoding.started` to :meth:`LinkCoding.took`."""

    peer: str
    coded: bool
    start: float
    shared: bool = False                 # a pull of the other form was on the wire meanwhile


@dataclass
class _Link:
    """One peer: each form's window (True: coded), the form pulls take, and the probe."""

    windows: dict[bool, _Window]
    coded: bool = False
    probe: bool | None = None            # the form being probed, while a probe runs
    probe_at: float = 0.0
    confirming: bool = False             # the probe running confirms a change of form
    next_probe: float = float("-inf")
    decided_at: float = float("-inf")    # when the last probe ended
    in_flight: dict[bool, set[LinkPull]] = field(default_factory=lambda: {False: set(), True: set()})


class LinkCoding:
    """Per peer, the codec a pull asks for (0: none). ``codec``: the kvcached.codecs code of the
    link codec (0: links are never coded); ``always``: ask for it on every pull, measured or
    not; else choose by measurement (the module docstring)."""

    PROBE_BYTES = 16 << 20       # what a form must move before it is compared (a window holds 4x this)
    PROBE_S = 30.0               # the form not taken is probed again this often
    PROBE_MAX_S = 5.0            # a probe that has not moved PROBE_BYTES by then is judged on what it has
    BETTER = 1.1                 # the other form must deliver this much more to be taken
    CHANGE = 1.5                 # the form taken delivering this much more or less than before: probe soon
    CHANGE_GAP_S = 5.0           # ... but not sooner than this after the last probe (a noisy link's bound)
    WINDOW_PULLS = 512           # pulls a window keeps at most: what a pull costs the loop stays small

    def __init__(self, codec: int, clock: Callable[[], float], *, always: bool = False) -> None:
        self.codec, self.clock, self.always = codec, clock, always
        self._links: dict[str, _Link] = {}
        self.coded_pulls = 0             # pulls that asked for their blocks coded (counted by the fetches)

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            keep, most = 4 * self.PROBE_BYTES, self.WINDOW_PULLS
            link = self._links[peer] = _Link({False: _Window(keep, most), True: _Window(keep, most)})
        return link

    def codec_for(self, peer: str) -> int:
        """The codec the next pull from ``peer`` asks for (0: a raw pull)."""
        if not self.codec or self.always:
            return self.codec
        link, now = self._link(peer), self.clock()
        if link.probe is not None and now - link.probe_at > self.PROBE_MAX_S:
            self._decide(link, now)
        if link.probe is None and now >= link.next_probe and link.windows[link.coded].bytes >= self.PROBE_BYTES:
            link.probe, link.probe_at = not link.coded, now
            link.windows[link.probe].clear()          # what it delivered a probe period ago says nothing now
        form = link.coded if link.probe is None else link.probe
        return self.codec if form else 0

    def started(self, peer: str, coded: bool) -> LinkPull:
        """A pull from ``peer`` in the form ``coded`` goes on the wire now (its connection open);
        :meth:`took` must follow, whatever becomes of it."""
        pull = LinkPull(peer, coded, self.clock())
        if self.codec and not self.always:
            link = self._link(peer)
            others = link.in_flight[not coded]
            if others:
                pull.shared = True
                for other in others:
                    other.shared = True
            link.in_flight[coded].add(pull)
        return pull

    def took(self, pull: LinkPull, nbytes: int, coded: bool | None = None) -> None:
        """``pull`` ended now, having brought ``nbytes`` of blocks (0: it failed) in the form
        ``coded`` (None: the form it started in; a peer that predates coded pulls is pulled
        raw, and such a pull measures neither form)."""
        link = self._links.get(pull.peer)
        if link is None:
            return
        link.in_flight[pull.coded].discard(pull)
        end = self.clock()
        if nbytes <= 0 or pull.shared or end <= pull.start or (coded is not None and coded != pull.coded):
            return
        window = link.windows[pull.coded]
        window.add(pull.start, end, nbytes)
        if link.probe is pull.coded and window.bytes >= self.PROBE_BYTES:
            self._decide(link, end)
        elif link.probe is None and pull.coded == link.coded and window.changed(self.PROBE_BYTES, self.CHANGE):
            # The link changed: whether the other form pays now is probed at once, or once
            # CHANGE_GAP_S has passed since the last probe (noise must not make probes constant).
            link.next_probe = min(link.next_probe, max(end, link.decided_at + self.CHANGE_GAP_S))

    def _decide(self, link: _Link, now: float) -> None:
        """End the probe: the probed form is taken if it delivered BETTER times as much."""
        assert link.probe is not None
        probed, taken = link.windows[link.probe], link.windows[link.coded]
        changed = bool(probed.bytes) and probed.rate() > self.BETTER * taken.rate()
        if changed:
            link.coded = link.probe
        confirm = changed and not link.confirming           # the form just left, probed again at once
        link.probe, link.confirming, link.decided_at = None, confirm, now
        link.next_probe = now if confirm else now + self.PROBE_S

    def rates(self, peer: str) -> dict[str, float]:
        """What each form delivered lately from ``peer`` (bytes per second; a form not measured
        is left out), for tests and debugging."""
        link = self._links.get(peer)
        if link is None:
            return {}
        return {("coded" if coded else "raw"): window.rate() for coded, window in link.windows.items() if window.bytes}

    def coded_now(self, peer: str) -> bool:
        """Whether pulls from ``peer`` take the coded form now (probes aside)."""
        if self.always:
            return bool(self.codec)
        link = self._links.get(peer)
        return link is not None and link.coded


def link_coding(name: str, clock: Callable[[], float]) -> LinkCoding:
    """The coding ``[quic] link_codec`` names: "none" (never), "auto" (kvcached.codecs' AUTO_CODEC
    where it measures faster), or a codec's name (asked for on every pull); KeyError for a name
    no codec has."""
    if name == AUTO:
        codec = codec_named(AUTO_CODEC)
        assert codec is not None
        return LinkCoding(codec.code, clock)
    named = codec_named(name)
    return LinkCoding(named.code if named is not None else 0, clock, always=True)
