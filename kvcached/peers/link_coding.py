"""Whether a pull from a peer asks for its blocks coded (``[quic] link_codec``, issue 64), sans-I/O.

Coding a block for the wire pays on a link slower than the codec and costs on a fast one: the
holder encodes, the wire carries fewer bytes, the puller decodes. Whether it pays with one
peer depends on that link's rate now, the holder's cores and the puller's, and how well this
traffic codes, none of which a constant knows. So :class:`LinkCoding` measures what each form
delivered from each peer: the block bytes a pull brought (decoded) over the seconds it took,
for pulls of at least :data:`LinkCoding.MIN_BYTES` (smaller ones measure latency, not rate),
averaged per form. The next pull from that peer takes the form that delivered more, the other
only once it delivers :data:`LinkCoding.BETTER` times as much (no flapping between two forms
that are near equal); the form not taken is tried again once its last measurement is
:data:`LinkCoding.PROBE_S` old, so a link that speeds up or slows down is followed, at the cost
of one pull in that form per ``PROBE_S``. A peer's first pull is raw (the form that needs no
holder work); the next large one tries the codec.

``always`` (``link_codec`` names a codec) asks for every pull coded; the holder still sends
raw each block its codec does not shrink. The clock is passed in; the peer tier's fetches
report what they took (:meth:`LinkCoding.took`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvcached.codecs import AUTO, codec_named
from kvcached.codecs.stored import AUTO_CODEC

__all__ = ["LinkCoding", "link_coding"]


@dataclass
class _Rates:
    """One peer: the bytes per second each form delivered lately (True: coded), when each was
    last measured, and when each was last tried as a probe."""

    rate: dict[bool, float] = field(default_factory=dict)
    measured: dict[bool, float] = field(default_factory=dict)
    tried: dict[bool, float] = field(default_factory=dict)
    coded: bool = False                  # the form pulls take now


class LinkCoding:
    """Per peer, the codec a pull asks for (0: none). ``codec``: the kvcached.codecs code of the
    link codec (0: links are never coded); ``always``: ask for it on every pull, measured or
    not; else choose by measurement (the module docstring)."""

    MIN_BYTES = 256 << 10        # a pull smaller than this says little of a link's rate
    PROBE_S = 30.0               # the form not taken is tried again this often
    BETTER = 1.1                 # the other form must deliver this much more to be taken
    WEIGHT = 0.5                 # of a new measurement in a form's average

    def __init__(self, codec: int, clock: Callable[[], float], *, always: bool = False) -> None:
        self.codec, self.clock, self.always = codec, clock, always
        self._peers: dict[str, _Rates] = {}
        self.coded_pulls = 0             # pulls that asked for their blocks coded (counted by the fetches)

    def codec_for(self, peer: str) -> int:
        """The codec the next pull from ``peer`` asks for (0: a raw pull)."""
        if not self.codec or self.always:
            return self.codec
        rates = self._peers.setdefault(peer, _Rates())
        if False not in rates.rate:
            return 0                                # measure raw first
        now = self.clock()
        other = not rates.coded
        last = max(rates.measured.get(other, -self.PROBE_S), rates.tried.get(other, -self.PROBE_S))
        if now - last >= self.PROBE_S:
            rates.tried[other] = now                # one probe per PROBE_S, however many pulls ask meanwhile
            return self.codec if other else 0
        return self.codec if rates.coded else 0

    def took(self, peer: str, coded: bool, nbytes: int, seconds: float) -> None:
        """A pull from ``peer`` (coded or not) brought ``nbytes`` of blocks in ``seconds``."""
        if not self.codec or self.always or nbytes < self.MIN_BYTES or seconds <= 0:
            return
        rates = self._peers.setdefault(peer, _Rates())
        now = self.clock()
        rate = nbytes / seconds
        before = rates.rate.get(coded)
        stale = now - rates.measured.get(coded, now) > 2 * self.PROBE_S
        rates.rate[coded] = rate if before is None or stale else before + self.WEIGHT * (rate - before)
        rates.measured[coded] = now
        raw, coded_rate = rates.rate.get(False), rates.rate.get(True)
        if raw is None or coded_rate is None:
            return
        if rates.coded and raw > self.BETTER * coded_rate:
            rates.coded = False
        elif not rates.coded and coded_rate > self.BETTER * raw:
            rates.coded = True

    def rates(self, peer: str) -> dict[str, float]:
        """What each form delivered lately from ``peer`` (bytes per second; a form not measured
        is left out), for stats and tests."""
        rates = self._peers.get(peer)
        if rates is None:
            return {}
        return {("coded" if coded else "raw"): rate for coded, rate in rates.rate.items()}

    def coded_now(self, peer: str) -> bool:
        """Whether pulls from ``peer`` take the coded form now (probes aside)."""
        if self.always:
            return bool(self.codec)
        rates = self._peers.get(peer)
        return rates is not None and rates.coded


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
