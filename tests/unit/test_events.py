"""kvcached.events without I/O: tier changes as vLLM events, numbered batches and replay,
sequence numbers across restarts, and the [events] settings refused."""

from __future__ import annotations

import pytest

from kvcached.config import ConfigError, load_config
from kvcached.events.schema import KVCacheEvent, decode_batch
from kvcached.events.stream import EventLog, EventMaker, EventNaming, SequenceLease
from kvcached.index.format import FLAGS_AT, BlockRecord, Tier, record_model, record_route, with_route
from kvcached.index.presence import TierFeed
from kvcached_agent.route import RouteKey, decode_routes, encode_routes

NAMING = EventNaming(node="n1", ownership="kvcached@n1")


def record(tiers: Tier, keys: list[RouteKey] | None = None, model: str = "org/model") -> bytes:
    route = encode_routes(keys) if keys else b""
    return BlockRecord(b"\x07" * 32, 0xFFFFFFFF, model, 4096, b"c" * 32, 1.0, 1.0, tiers, route=route).encode()


def events_of(change: tuple[bytes, int, int], naming: EventNaming) -> list[KVCacheEvent]:
    """The events of one change, whatever their topic."""
    return [e for events in EventMaker(naming).events([change]).values() for e in events]


def test_each_tier_gained_or_lost_is_one_event_per_engine_group() -> None:
    keys = [RouteKey([5, 6], 4, list(range(32)), 16, group_idx=0), RouteKey([5, 6], 4, list(range(32)), 16, group_idx=1)]
    gained = events_of((record(Tier.RAM | Tier.SSD, keys), Tier.NONE, Tier.RAM | Tier.SSD), NAMING)
    assert [(type(e).__name__, e.medium, e.group_idx) for e in gained] == [
        ("BlockStored", "CPU", 0), ("BlockStored", "CPU", 1), ("BlockStored", "STORAGE", 0), ("BlockStored", "STORAGE", 1)]
    lost = events_of((record(Tier.SSD, keys[:1]), Tier.RAM | Tier.SSD, Tier.SSD), NAMING)
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in lost] == [("BlockRemoved", "CPU", [5, 6])]
    (unkeyed,) = events_of((record(Tier.RAM), Tier.NONE, Tier.RAM), NAMING)
    assert unkeyed.block_hashes == [int.from_bytes(b"\x07" * 8, "big")] and unkeyed.token_ids == []
    assert unkeyed.extra_keys == [["kvcached-digest", "07" * 32, 0xFFFFFFFF]]


def test_events_a_vllm_engine_would_send_as_one_are_one_and_order_is_kept() -> None:
    """A chain of stores (each block's parent the one before) is one BlockStored, hashes and
    tokens joined, as vLLM sends a request's blocks; consecutive removals of a tier are one
    BlockRemoved; nothing joins across another event, a tier, a group or a topic."""
    def key(h: int, parent: int | None, group: int | None = None) -> list[RouteKey]:
        return [RouteKey([h], parent, [h, h], 2, group_idx=group)]

    maker = EventMaker(NAMING)
    changes = [(record(Tier.RAM, key(1, None)), 0, 1), (record(Tier.RAM, key(2, 1)), 0, 1),
               (record(Tier.RAM, key(3, 2)), 0, 1),
               (record(Tier.RAM, key(9, 7)), 0, 1),                       # not a child of 3
               (record(Tier.RAM, key(10, 9, group=1)), 0, 1),             # another group
               (record(Tier.NONE, key(1, None)), 1, 0), (record(Tier.NONE, key(2, 1)), 1, 0),
               (record(Tier.RAM, key(4, 3)), 0, 1),                       # after a removal: its own
               (record(Tier.NONE, key(3, 2)), 1, 0),
               (record(Tier.SSD, key(9, 7)), 1, 2),                       # RAM lost, SSD gained
               (record(Tier.RAM, key(5, 4), model="other"), 0, 1)]
    by_topic = maker.events(changes)
    assert list(by_topic) == ["kv@n1@org/model", "kv@n1@other"]
    got = [(type(e).__name__, e.medium, e.block_hashes, getattr(e, "parent_block_hash", "-"), getattr(e, "token_ids", "-"))
           for e in by_topic["kv@n1@org/model"]]
    assert got == [("BlockStored", "CPU", [1, 2, 3], None, [1, 1, 2, 2, 3, 3]),
                   ("BlockStored", "CPU", [9], 7, [9, 9]),
                   ("BlockStored", "CPU", [10], 9, [10, 10]),
                   ("BlockRemoved", "CPU", [1, 2], "-", "-"),
                   ("BlockStored", "CPU", [4], 3, [4, 4]),
                   ("BlockRemoved", "CPU", [3, 9], "-", "-"),
                   ("BlockStored", "STORAGE", [9], 7, [9, 9])]
    assert [e.block_hashes for e in by_topic["kv@n1@other"]] == [[5]]


def test_a_record_carries_its_route_keys_and_older_records_read_as_before() -> None:
    keys = [RouteKey([5], None, [1, 2], 2)]
    raw = record(Tier.RAM, keys, model="m\u00e9")
    assert record_model(raw) == "m\u00e9" and decode_routes(record_route(raw) or b"") == keys
    back = BlockRecord.decode(raw)
    assert back.model == "m\u00e9" and back.route == encode_routes(keys) and back.encode() == raw
    old = record(Tier.RAM)                                       # no route: flags 0, the tail is the model
    assert old[FLAGS_AT] == 0 and old.endswith("org/model".encode()) and record_route(old) is None
    assert BlockRecord.decode(old).route == b""
    again = with_route(with_route(old, b"first"), b"second")
    assert record_route(again) == b"second" and record_model(again) == "org/model"
    damaged = record(Tier.RAM, keys)[:-3]                          # a route cut short: named by digest
    (event,) = events_of((damaged, 0, 1), NAMING)
    assert event.extra_keys[0][0] == "kvcached-digest"


def test_the_feed_records_changes_of_tiers_only_and_is_bounded() -> None:
    feed = TierFeed(limit=3)
    feed.record_write([record(Tier.RAM), record(Tier.RAM)], [None, record(Tier.RAM), record(Tier.SSD)])
    (change, deleted) = feed.take()
    assert change[1:] == (Tier.NONE, Tier.RAM)
    assert deleted == (record(Tier.SSD), Tier.SSD, Tier.NONE)
    feed.record_write([record(Tier.RAM)] * 5, [None] * 5)
    assert len(feed) == 3 and feed.dropped == 2


def test_batches_are_numbered_and_kept_for_replay() -> None:
    log = EventLog(10, max_batches=3, max_bytes=1 << 20, max_events=2)
    dropped: list[tuple[int, int]] = []
    log.on_drop = lambda seq, nbytes: dropped.append((seq, nbytes))
    change = (record(Tier.RAM), Tier.NONE, Tier.RAM)
    events = events_of(change, NAMING) * 5
    sent = log.add("kv@n1@m", events, 1.5)
    assert [int.from_bytes(seq, "big") for _, seq, _ in sent] == [10, 11, 12]     # 5 events, 2 a batch
    assert decode_batch(sent[0][2]).ts == 1.5 and len(decode_batch(sent[2][2]).events) == 1
    log.add("kv@n1@m", events[:1], 2.0)                                               # 13; 10 is no longer kept
    assert log.oldest_kept == 11 and log.batch(10) is None and log.batch(13) is not None and log.batch(14) is None
    assert [seq for seq, _ in dropped] == [10] and dropped[0][1] == len(sent[0][2]) + len(b"kv@n1@m")


def test_a_batch_holds_at_most_its_bytes_unless_one_event_alone_is_larger() -> None:
    keys = [RouteKey([i], None, list(range(400)), 16) for i in range(64)]     # ~1 KiB of tokens a block
    changes = [(record(Tier.RAM, [k]), Tier.NONE, Tier.RAM) for k in keys]
    events = [e for c in changes for e in events_of(c, NAMING)]
    log = EventLog(0, max_batches=1000, max_bytes=1 << 30, max_batch_bytes=8 << 10)
    sent = log.add("t", events, 1.0)
    assert len(sent) > 1 and all(len(p) <= 8 << 10 for _, _, p in sent)
    assert sum(len(decode_batch(p).events) for _, _, p in sent) == len(events), "nothing lost to the split"
    huge = EventLog(0, max_batches=10, max_bytes=1 << 30, max_batch_bytes=100)
    assert len(huge.add("t", events[:1], 1.0)) == 1, "one event larger than the cap is a batch of its own"


def test_sequence_numbers_never_go_back_after_a_crash_and_run_on_after_a_clean_stop() -> None:
    stored: list[int] = []
    lease = SequenceLease(0, stored.append, lease=100)
    assert [lease.take() for _ in range(3)] == [0, 1, 2] and stored == [100]
    crashed = SequenceLease(stored[-1], stored.append, lease=100)         # the crash lost 3..99: skipped, never repeated
    assert crashed.take() == 100
    crashed.close()
    assert SequenceLease(stored[-1], stored.append).take() == 101


@pytest.mark.parametrize("overrides, key", [
    (['events.endpoint="tcp://0.0.0.0:5557"'], "events.endpoint"),
    (['events.endpoint="tcp://*:5557"'], "events.endpoint"),
    (['events.endpoint="tcp://127.0.0.1:5557"', 'events.replay_endpoint="tcp://10.0.0.1:5558"'], "events.replay_endpoint"),
    (['events.replay_endpoint="tcp://127.0.0.1:5558"'], "events.replay_endpoint"),
    (['events.endpoint="udp://127.0.0.1:5557"'], "events.endpoint"),
    (['events.topic="kv@{pod}"'], "events.topic"),
    (["events.replay_clients_mib=4"], "events.replay_clients_mib"),
    (["events.route_keys_mib=0"], "events.route_keys_mib"),
])
def test_events_settings_refused_at_start(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value)


ALICE = ["tenants.uids={ alice = [1001] }"]


@pytest.mark.parametrize("overrides, key, says", [
    (['events.endpoint="ipc://@kv-events"'], "events.endpoint", "abstract"),
    (['events.endpoint="ipc:///tmp/e"', 'events.replay_endpoint="ipc://@kv-replay"'], "events.replay_endpoint",
     "abstract"),
    ([*ALICE, 'tenants.events={ alice = "ipc://@alice" }'], "tenants.events", "abstract"),
    ([*ALICE, 'tenants.events={ alice = "ipc:///tmp/a" }', 'tenants.event_replays={ alice = "ipc://@r" }'],
     "tenants.event_replays", "abstract"),
    ([*ALICE, 'events.endpoint="tcp://127.0.0.1:5557"'], "events.endpoint", "alice"),
    ([*ALICE, 'events.endpoint="ipc:///tmp/e"', 'events.replay_endpoint="tcp://127.0.0.1:5558"'],
     "events.replay_endpoint", "every tenant's blocks"),
    ([*ALICE, 'events.endpoint="tcp://*:5557"', "events.remote=true"], "events.endpoint", "every tenant's blocks"),
    (['tenants.gids={ ml = [2000] }', 'events.endpoint="tcp://127.0.0.1:5557"'], "events.endpoint", "ml"),
])
def test_streams_anyone_on_the_host_could_open_are_refused(overrides: list[str], key: str, says: str) -> None:
    """An abstract socket has no file mode; a TCP port admits every local process: neither may
    carry the stream that names every tenant's blocks (issue 59)."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and says in str(err.value), str(err.value)


def test_the_operators_stream_beside_tenants_is_an_ipc_path() -> None:
    config = load_config(None, [*ALICE, 'events.endpoint="ipc:///tmp/e"', 'events.replay_endpoint="ipc:///tmp/r"'])
    assert config.events.endpoint == "ipc:///tmp/e"
    # The default tenant alone is no other tenant: loopback TCP stays as before.
    config = load_config(None, ["tenants.uids={ default = [0] }", 'events.endpoint="tcp://127.0.0.1:5557"'])
    assert config.events.endpoint == "tcp://127.0.0.1:5557"


def test_a_routable_endpoint_is_allowed_when_said_so() -> None:
    config = load_config(None, ['events.endpoint="tcp://*:5557"', "events.remote=true"])
    assert config.events.endpoint == "tcp://*:5557"


def test_a_sequence_file_that_cannot_be_written_is_counted_and_publishing_goes_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvcached.events.publisher import SEQ_FILE, EventPublisher, PublisherSettings
    publisher = EventPublisher(PublisherSettings("ipc://unused", "", NAMING), str(tmp_path))
    (tmp_path / (SEQ_FILE + ".tmp")).mkdir()          # the write's temporary file cannot be made
    assert [publisher._lease.take() for _ in range(2)] == [0, 1]
    assert publisher.counters.seq_write_failures == 1


def test_a_sequence_file_that_does_not_hold_a_number_is_refused_saying_how_to_mend_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvcached.events.publisher import SEQ_FILE, EventPublisher, PublisherSettings
    (tmp_path / SEQ_FILE).write_bytes(b"\x00garbage")
    with pytest.raises(OSError, match="does not hold a sequence number.*remove it"):
        EventPublisher(PublisherSettings("ipc://unused", "", NAMING), str(tmp_path))
