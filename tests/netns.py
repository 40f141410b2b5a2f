"""Network namespaces as hosts for tests (root only): a bridge in this namespace and hosts
joined to it by veth pairs, each with its own address; a partition cuts chosen hosts apart
(blackhole routes both ways) and heals them. Everything is torn down by :meth:`Hosts.close`."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["Hosts", "netns_usable"]


def _ip(*args: str, ns: str | None = None) -> None:
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True, text=True)


TIMER_HZ = 250                 # the kernel timer's ticks a second (CONFIG_HZ of these machines' kernels)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def rate_bits(rate: str) -> int:
    """tc's rate ``rate`` ("16mbit", "1gbit") in bits a second."""
    for unit in sorted(_UNITS, key=len, reverse=True):
        if rate.endswith(unit):
            return int(float(rate[:-len(unit)]) * _UNITS[unit])
    raise ValueError(f"a rate in tc's units (bit, kbit, mbit, gbit), not {rate!r}")


def netns_usable() -> bool:
    """Root, with the ip tool: namespaces can be made here."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


@dataclass
class Hosts:
    """A bridge ``{tag}br`` at ``{subnet}.1`` in this namespace, and hosts added by :meth:`add`."""

    tag: str = "kvc"
    subnet: str = "10.251.7"
    hosts: dict[str, str] = field(default_factory=dict)        # namespace -> address
    _cuts: set[tuple[str, str]] = field(default_factory=set)   # (namespace, "" for this one; address)

    def __post_init__(self) -> None:
        self.bridge = f"{self.tag}br"
        self.close()                                           # what an interrupted run left behind
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def add(self, name: str) -> str:
        """A host (namespace ``{tag}-{name}``) on the bridge; returns its namespace name."""
        ns, n = f"{self.tag}-{name}", len(self.hosts) + 2
        address = f"{self.subnet}.{n}"
        outside, inside = f"{self.tag}v{n}", f"{self.tag}i{n}"
        _ip("netns", "add", ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("addr", "add", f"{address}/24", "dev", inside, ns=ns)
        _ip("link", "set", inside, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        self.hosts[ns] = address
        return ns

    def throttle(self, ns: str, rate: str | None) -> None:
        """What host ``ns`` sends is held to ``rate`` (tc's units: "8mbit", "1gbit"); None lifts
        it. A token bucket (tc tbf: netem is not in these machines' kernels) whose burst is what
        the rate sends in one timer tick, at least 16 KiB: tc-tbf(8) asks for a burst of at
        least rate / HZ, and a smaller one (16 KiB at 1 Gbit/s, a tenth of a tick) holds the
        rate only by throttling packet by packet, which costs both hosts several times the CPU
        of the traffic itself (bench_link_codec measured it)."""
        n = list(self.hosts).index(ns) + 2
        if rate is None:
            _tc(ns, "qdisc", "del", "dev", f"{self.tag}i{n}", "root")
        else:
            burst = max(16 << 10, rate_bits(rate) // 8 // TIMER_HZ)
            _tc(ns, "qdisc", "replace", "dev", f"{self.tag}i{n}", "root", "tbf", "rate", rate, "burst", str(burst),
                "latency", "2s")

    def exec(self, ns: str) -> list[str]:
        """The command prefix that runs a program in host ``ns``."""
        return ["ip", "netns", "exec", ns]

    def cut(self, ns: str, address: str) -> None:
        """Host ``ns`` can no longer reach ``address``, nor ``address`` it (where that is another
        host or the gateway: this namespace, where etcd runs)."""
        _ip("route", "add", "blackhole", f"{address}/32", ns=ns)
        self._cuts.add((ns, address))
        other = next((h for h, a in self.hosts.items() if a == address), "" if address == self.gateway else None)
        if other is not None and (other, self.hosts[ns]) not in self._cuts:
            _ip("route", "add", "blackhole", f"{self.hosts[ns]}/32", ns=other or None)   # "": this namespace
            self._cuts.add((other, self.hosts[ns]))

    def heal(self) -> None:
        for ns, address in sorted(self._cuts):
            _ip("route", "del", "blackhole", f"{address}/32", ns=ns or None)
        self._cuts.clear()

    def close(self) -> None:
        for ns, address in list(self._cuts):
            if not ns:                                          # routes in this namespace outlive the hosts
                subprocess.run(["ip", "route", "del", "blackhole", f"{address}/32"], capture_output=True)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        for ns in listed:
            if ns.startswith(f"{self.tag}-"):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.tag}br"], capture_output=True)
        self.hosts.clear()
        self._cuts.clear()
