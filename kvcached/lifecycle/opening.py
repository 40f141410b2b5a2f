"""What a daemon opens before it serves: its state directories, the index (with its boot
reconcile) and the SSD tier, each refused with a one-line StartupError that says why.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kvcached.codecs import SEAL_PURPOSE, Sealer, stored_form
from kvcached.config import Config
from kvcached.host.fsmodes import UnsafeDirectory, check_state_dir, make_dirs
from kvcached.host.logs import fields
from kvcached.host.process import StartupError
from kvcached.index import BlockIndex, IndexError_
from kvcached.index.boot import reconcile_at_boot
from kvcached.index.presence import TierFeed
from kvcached.index.record_cache import cached_records
from kvcached.tenants import TenantMap
from kvcached.tiers.ssd import SsdTier
from kvcached.tiers.ssd_format import PAGE

__all__ = ["prepare_state_dirs", "open_index", "open_ssd", "SSD_DIR_LEVELS"]

log = logging.getLogger("kvcached.daemon")

SSD_DIR_LEVELS = 3         # directories under kv.ssd_dir: blocks/ and quarantine/, blocks/xx/, blocks/xx/y/
INDEX_PROGRESS_GRACE_S = 60.0  # each index reconcile progress line asks systemd for this much more start time


def prepare_state_dirs(config: Config) -> None:
    """Create the index and SSD directories (0700, missing parents too) or check the ones
    that exist (kvcached.host.fsmodes.check_state_dir): refuse a directory others could write to
    or that another user owns, tighten wider modes of our own directories to 0700."""
    kv = config.kv
    dirs = [("kv.index_dir", kv.index_dir, 0)] + ([("kv.ssd_dir", kv.ssd_dir, SSD_DIR_LEVELS)] if kv.ssd_gib else [])
    for key, path, levels in dirs:
        try:
            created = make_dirs(path)
            tightened = check_state_dir(path, levels)
        except UnsafeDirectory as exc:
            raise StartupError(f"{key}: {exc}") from None
        except OSError as exc:
            raise StartupError(f"{key} {path}: {exc.strerror or exc}") from None
        if created:
            log.info("state directory created", extra=fields(key=key, created=",".join(created), mode="0700"))
        if tightened:
            log.warning("state directories were open to other users; set to 0700",
                        extra=fields(key=key, directories=", ".join(tightened)))


def open_ssd(config: Config, tenants: TenantMap | None = None) -> SsdTier | None:
    """The SSD tier of ``[kv] ssd_*`` opened (None: ``ssd_gib`` 0), its blocks stored as
    ``kv.ssd_codec`` and ``tenants.seal_ssd`` say (sealing needs ``tenants``, whose key it derives
    each tenant's from); StartupError saying why it cannot be."""
    kv = config.kv
    if kv.ssd_gib == 0:
        return None
    # The sealer opens sealed files whatever tenants.seal_ssd says now (turning sealing off must
    # not make what was sealed unreadable); the setting decides whether new files are sealed.
    sealer = None
    if tenants is not None:
        key_map = tenants
        sealer = Sealer(lambda tag: key_map.derived_key(SEAL_PURPOSE, tag))
    if config.tenants.seal_ssd and sealer is None:
        raise StartupError("tenants.seal_ssd needs the tenant key (tenants.key_file)")
    form = stored_form(kv.ssd_codec, kv.ssd_codec_margin, sealer, seal=config.tenants.seal_ssd, granule=PAGE)
    ssd = SsdTier(kv.ssd_dir, config.ssd_bytes, durability=kv.ssd_durability,  # type: ignore[arg-type]
                  commit_s=kv.ssd_commit_ms / 1000, direct_io=kv.ssd_direct_io,  # type: ignore[arg-type]
                  threads=kv.ssd_io_threads, form=form)
    try:
        ssd.open()
    except OSError as exc:
        raise StartupError(f"kv.ssd_dir {kv.ssd_dir}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    return ssd


def open_index(config: Config, status: Callable[..., object], ram_kept: set[bytes] | frozenset[bytes],
               reconcile: bool = True, tier_feed: TierFeed | None = None) -> tuple[BlockIndex, dict[str, Any]]:
    """The index of ``kv.index_dir`` opened and, with ``reconcile``, reconciled at boot (its
    progress told to ``status``, which may extend the service manager's start timeout; the
    blocks of ``ram_kept`` are in RAM still); returns it and the reconcile's counts. With
    ``tier_feed`` (KV events), the reconcile's changes of tiers are recorded in it."""
    cfg = config
    try:
        index = BlockIndex(cfg.kv.index_dir, cached_records(cfg.ram_bytes))
    except IndexError_ as exc:
        raise StartupError(str(exc)) from None
    index.tier_feed = tier_feed
    if not reconcile:
        return index, {}
    estimate = index.count_estimate()
    t0 = time.monotonic()

    def progress(seen: int) -> None:
        log.info("reconciling index", extra=fields(seen=seen, of_about=estimate,
                                                   elapsed_s=round(time.monotonic() - t0, 1)))
        status(f"reconciling the index: {seen} of about {estimate} records", extend_timeout_s=INDEX_PROGRESS_GRACE_S)

    try:
        counts = reconcile_at_boot(index, time.time(), cfg.kv.gone_ttl, progress, batch=100_000, ram_kept=ram_kept)
    except IndexError_ as exc:
        index.close()
        raise StartupError(f"kv.index_dir {cfg.kv.index_dir}: the boot reconcile cannot write the index "
                           f"({index.unwritable_reason or exc}); free space on its disk, then start again") from None
    if counts["seen"]:
        log.info("index reconciled", extra=fields(**counts, elapsed_s=round(time.monotonic() - t0, 3)))
    return index, {**counts, "elapsed_s": round(time.monotonic() - t0, 3)}
