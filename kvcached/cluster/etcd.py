"""Membership in etcd: the thin asyncio layer over :class:`~kvcached.cluster.view.MembershipView`.

:class:`EtcdMembership` keeps this daemon registered (``{prefix}/members/{name}``, on a lease
of ``lease_s`` refreshed every third of it) and the view in step with etcd (a listing, then a
watch from the next revision; a listing again whenever the watch had to be opened anew or its
revision was compacted away). Every change goes to ``on_change``.

The client is etcd3aio: an asyncio client over grpc.aio (the gRPC stack the daemon already
runs), kept up (2026 releases), with mutual TLS and several endpoints; docs/cluster.md says why
it was chosen over the others.

Registrations prove themselves (kvcached.cluster.proof): this daemon's is signed with its
cluster key for the lease it is put on, and the view keeps only those that verify. A daemon
watches its own key too: when it finds its registration replaced (another value, another lease,
or deleted) it puts its own back at once (at most once a second, so two daemons configured
with one name do not hammer etcd), says so in the log, and counts it (``restorations``).

Failure rules:
- etcd unreachable: the view stays as it was (the daemon serves with the last membership; no
  node it has not seen registered is added), ``reachable`` turns False, and every loop retries
  with backoff. When etcd answers again the view is listed afresh and the registration renewed.
- this daemon's lease ended (etcd was away longer than ``lease_s``, or a revoke): it registers
  again under a new lease at once.
- stop(): the lease is revoked, so the other daemons see this one leave at once, not
  ``lease_s`` later.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from etcd3aio import Etcd3Client, EtcdError, prefix_range_end

from kvcached.cluster.member import Member, member_key, members_prefix
from kvcached.cluster.proof import RegistrationSigner
from kvcached.cluster.view import Change, MembershipView
from kvcached.host.aio import cancel_and_wait

__all__ = ["EtcdMembership", "EtcdSettings", "EtcdCounters"]

log = logging.getLogger("kvcached.cluster")

BACKOFF_S = 0.25             # first retry after an etcd error; doubles up to BACKOFF_MAX_S
BACKOFF_MAX_S = 2.0
RESTORE_GAP_S = 1.0          # this daemon's registration is put back at most this often
RESTORE_LOG_S = 10.0         # and said in the log at most this often (with how many since)
PUTTING = 1 << 62            # the put revision while a registration's put is on its way


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...]                 # "HOST:PORT", one or more
    prefix: str = "/kvcached"
    lease_s: int = 10
    ca: bytes | None = None                    # PEM; with cert and key: mutual TLS to etcd
    cert: bytes | None = None
    key: bytes | None = None

    @property
    def call_timeout_s(self) -> float:
        """One etcd call's deadline: a third of the lease, so a refresh that fails can be tried
        again before the lease ends."""
        return max(0.5, self.lease_s / 3)


@dataclass
class EtcdCounters:
    registrations: int = 0       # leases granted and registration written (1 for a daemon that never lost it)
    lease_losses: int = 0        # the lease ended under this daemon (etcd away past lease_s)
    listings: int = 0            # full listings of the members prefix (1 + watches opened anew)
    errors: int = 0              # etcd calls that failed
    events: int = 0              # watch events taken
    restorations: int = 0        # this daemon's registration put back after it was found replaced or deleted
    last_error: str = ""


@dataclass
class EtcdMembership:
    """See the module. ``me`` is this daemon's registration, signed by ``signer``; ``view`` is
    updated in place and every non-empty change handed to ``on_change`` (on the event loop)."""

    settings: EtcdSettings
    me: Member
    signer: RegistrationSigner
    view: MembershipView
    on_change: Callable[[Change], None]
    counters: EtcdCounters = field(default_factory=EtcdCounters)
    reachable: bool = False
    lease_id: int = 0
    _client: Any = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _listed: asyncio.Event = field(default_factory=asyncio.Event)
    _registered: asyncio.Event = field(default_factory=asyncio.Event)
    _value: bytes = b""                  # this daemon's registration as last put
    _put_revision: int = 0               # the etcd revision of that put
    _replaced: asyncio.Event = field(default_factory=asyncio.Event)
    _replaced_by: str = ""               # what was found there instead, for the log
    _restore_logged_at: float = -RESTORE_LOG_S
    _restores_unlogged: int = 0

    @property
    def key(self) -> str:
        return member_key(self.settings.prefix, self.me.name)

    async def start(self, wait_s: float = 5.0) -> bool:
        """Start keeping the registration and the view; returns whether both were done within
        ``wait_s`` (the daemon starts either way: etcd may come later)."""
        s = self.settings
        if s.ca is not None:
            self._client = Etcd3Client(list(s.endpoints), rpc_max_attempts=1, ca_cert=s.ca, cert_key=s.key,
                                       cert_chain=s.cert)
        else:
            self._client = Etcd3Client(list(s.endpoints), rpc_max_attempts=1)
        await self._client.connect()
        self._tasks = [asyncio.ensure_future(self._keep_registered()), asyncio.ensure_future(self._keep_view()),
                       asyncio.ensure_future(self._keep_own_key())]
        try:
            await asyncio.wait_for(asyncio.gather(self._listed.wait(), self._registered.wait()), wait_s)
            return True
        except asyncio.TimeoutError:
            log.warning("etcd not reached yet; serving with what is known", extra={"fields": {
                "endpoints": ",".join(s.endpoints), "reason": self.counters.last_error}})
            return False

    async def stop(self, revoke: bool = True) -> None:
        """Stop refreshing and watching; with ``revoke`` leave the cluster at once (without, the
        registration stays until its lease runs out: an upgrade's successor registers again
        under the same name before then)."""
        await cancel_and_wait(self._tasks)
        if self._client is not None:
            if self.lease_id and revoke:
                try:
                    await self._client.lease.revoke(self.lease_id, timeout=self.settings.call_timeout_s)
                except Exception as exc:      # etcd away: the lease ends by itself
                    log.info("lease not revoked", extra={"fields": {"reason": _why(exc)}})
            await self._client.close()
            self._client = None

    # -- the registration --

    async def _keep_registered(self) -> None:
        s, backoff = self.settings, BACKOFF_S
        key = self.key
        while True:
            try:
                lease = await self._client.lease.grant(s.lease_s, timeout=s.call_timeout_s)
                value = self.signer.value(self.me, key, lease.ID)
                # What is about to be put, and no news of the key heeded until the put's revision
                # is known: the watch may report it (or the old lease's end) before the put returns.
                self._value, self.lease_id, self._put_revision = value, lease.ID, PUTTING
                put = await self._client.kv.put(key, value, lease=lease.ID, timeout=s.call_timeout_s)
                self._put_revision, backoff = int(put.header.revision), BACKOFF_S
                self.counters.registrations += 1
                self._ok()
                self._registered.set()
                log.info("registered in etcd", extra={"fields": {"key": key, "lease_s": s.lease_s}})
                await self._refresh_until_lost()
                self.counters.lease_losses += 1
                log.warning("etcd lease lost; registering again", extra={"fields": {"key": key}})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _refresh_until_lost(self) -> None:
        """Refresh the lease every third of its time; return once etcd says it is gone. A
        refresh that fails is tried again (etcd away) until etcd answers."""
        s = self.settings
        interval = s.lease_s / 3
        while True:
            await asyncio.sleep(interval)
            self._apply(self.view.expire(datetime.datetime.now(datetime.timezone.utc)))
            try:
                ttl = await self._refresh_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
                interval = min(BACKOFF_MAX_S, s.lease_s / 3)
                continue
            self._ok()
            if ttl <= 0:
                self.lease_id = 0
                return
            interval = s.lease_s / 3

    async def _refresh_once(self) -> int:
        call = self._client.lease.keep_alive(self.lease_id)
        try:
            async with asyncio.timeout(self.settings.call_timeout_s):
                async for response in call:
                    return int(response.TTL)
        finally:
            call.cancel()
        raise ConnectionError("etcd closed the keep-alive stream without an answer")

    # -- this daemon's own key --

    def _check_own(self, value: bytes | None, lease: int, revision: int) -> None:
        """What etcd holds under this daemon's key as of ``revision`` (``value`` None: nothing):
        if it is not this daemon's registration as last put, it is put back (_keep_own_key)."""
        if not self._value or revision <= self._put_revision or not self.lease_id:
            return                      # not registered yet, or news older than the registration
        if value == self._value and lease == self.lease_id:
            return
        self._replaced_by = "deleted" if value is None else _describe(value, lease)
        self._replaced.set()

    async def _keep_own_key(self) -> None:
        """Put this daemon's registration back whenever it is found replaced or deleted."""
        s = self.settings
        loop = asyncio.get_running_loop()
        last = -RESTORE_GAP_S
        while True:
            await self._replaced.wait()
            await asyncio.sleep(max(0.0, last + RESTORE_GAP_S - loop.time()))
            self._replaced.clear()
            if not self._value or not self.lease_id:
                continue                # the lease is gone: _keep_registered registers anew
            last, lease = loop.time(), self.lease_id
            try:
                put = await self._client.kv.put(self.key, self._value, lease=lease, timeout=s.call_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:     # etcd away, or the lease just ended (then a new registration follows)
                self.counters.errors += 1
                self.counters.last_error = _why(exc)
                if self.lease_id == lease:
                    self._replaced.set()    # tried again after the gap, while this lease lasts
                continue
            self._put_revision = int(put.header.revision)
            self.counters.restorations += 1
            self._restores_unlogged += 1
            if last - self._restore_logged_at >= RESTORE_LOG_S:
                log.warning("own registration was replaced in etcd; put it back", extra={"fields": {
                    "key": self.key, "found": self._replaced_by,
                    "restorations": self._restores_unlogged}})
                self._restore_logged_at, self._restores_unlogged = last, 0

    # -- the view --

    async def _keep_view(self) -> None:
        s, backoff = self.settings, BACKOFF_S
        prefix = members_prefix(s.prefix)
        end = prefix_range_end(prefix.encode())
        while True:
            try:
                listing = await self._client.kv.get(prefix, end, timeout=s.call_timeout_s)
                self.counters.listings += 1
                rows = [(kv.key.decode(errors="replace"), kv.value, int(kv.lease)) for kv in listing.kvs]
                self._apply(self.view.reset(rows, listing.header.revision))
                mine = [(value, lease) for key, value, lease in rows if key == self.key]
                value, lease = mine[0] if mine else (None, 0)
                self._check_own(value, lease, int(listing.header.revision))
                self._ok()
                self._listed.set()
                backoff = BACKOFF_S
                await self._watch(prefix, end)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _watch(self, prefix: str, end: bytes) -> None:
        """Take watch events until the watch must be opened anew (then the caller lists again)."""
        watch = self._client.watch.watch(prefix, end, start_revision=self.view.revision + 1, progress_notify=True)
        async with contextlib.aclosing(watch):            # its stream is closed when this returns
            async for response in watch:
                if response.compact_revision or response.canceled:
                    log.info("etcd watch reopened", extra={"fields": {"compacted": response.compact_revision}})
                    return
                self._ok()
                for event in response.events:
                    self.counters.events += 1
                    kv = event.kv
                    name = kv.key.decode(errors="replace")
                    deleted = event.type == event.DELETE
                    if deleted:
                        self._apply(self.view.delete(name, kv.mod_revision))
                    else:
                        self._apply(self.view.put(name, kv.value, int(kv.lease), kv.mod_revision))
                    if name == self.key:
                        self._check_own(None if deleted else kv.value, int(kv.lease), int(kv.mod_revision))

    def _apply(self, change: Change) -> None:
        if change:
            for member in change.joined:
                log.info("member joined", extra={"fields": {"member": member.name, "host": member.host}})
            for member in change.left:
                log.info("member left", extra={"fields": {"member": member.name}})
            self.on_change(change)

    def _ok(self) -> None:
        if not self.reachable:
            self.reachable = True
            log.info("etcd reachable", extra={"fields": {"endpoints": ",".join(self.settings.endpoints)}})

    def _failed(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self.counters.last_error = _why(exc)
        if self.reachable:
            self.reachable = False
            log.warning("etcd unreachable; serving with the last membership", extra={"fields": {
                "reason": _why(exc), "members": len(self.view.members)}})

    def stats(self) -> dict[str, Any]:
        return {"etcd_reachable": self.reachable, "members": sorted(self.view.members), "revision": self.view.revision,
                "registrations_refused": self.view.refused, **{f"etcd_{k}": v for k, v in vars(self.counters).items()}}


def _describe(value: bytes, lease: int) -> str:
    """A registration found under this daemon's key, in a few words for the log (not trusted)."""
    try:
        doc = json.loads(value)
        where = f"{doc.get('host')}:{doc.get('quic_port')}" if isinstance(doc, dict) else "not an object"
    except (ValueError, UnicodeDecodeError):
        where = "not JSON"
    return f"{where} on lease {lease or 'none'}"[:120]


def _why(exc: BaseException) -> str:
    if isinstance(exc, EtcdError) and exc.__cause__ is not None:
        return f"{exc} ({exc.__cause__})"
    return str(exc) or type(exc).__name__
