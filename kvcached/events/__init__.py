"""KV events: what the RAM and SSD tiers gain and lose, published in vLLM's schema over ZMQ so
KV-aware routers see every tier (docs/events.md). ``schema``: the msgpack layout; ``stream``:
events, batches and sequence numbers, without I/O; ``replay``: replay answered within a bound,
without I/O; ``publisher``, ``replay_server``, ``endpoints``: the sockets and the daemon's task."""

from kvcached.config import Config
from kvcached.events.group import EventStreams
from kvcached.events.publisher import EventCounters, EventPublisher, PublisherSettings
from kvcached.events.stream import EventNaming
from kvcached.tenants import DEFAULT

__all__ = ["EventCounters", "EventNaming", "EventPublisher", "EventStreams", "PublisherSettings", "streams_for"]


def streams_for(config: Config, node: str) -> EventStreams | None:
    """The streams ``[events]`` and ``tenants.events`` ask for (None: none), with sequence
    numbers kept in ``kv.index_dir``; ``node`` names this daemon where ``events.node`` does not.
    OSError if a sequence number kept there cannot be read."""
    e, t = config.events, config.tenants
    if not e.endpoint and not t.events:
        return None
    name = e.node or node
    naming = EventNaming(ram_medium=e.ram_medium.format(node=name), ssd_medium=e.ssd_medium.format(node=name),
                         ownership=f"kvcached@{name}", topic=e.topic, node=name)
    common = dict(interval_s=e.batch_ms / 1000, hwm=e.hwm, replay_batches=e.replay_batches,
                  replay_bytes=e.replay_mib << 20, replay_clients_bytes=e.replay_clients_mib << 20)
    publishers = [EventPublisher(PublisherSettings(e.endpoint, e.replay_endpoint, naming, **common),  # type: ignore[arg-type]
                                 config.kv.index_dir)] if e.endpoint else []
    for tenant, endpoint in sorted(t.events.items()):
        admit = (t.uids.get(tenant, []), t.gids.get(tenant, []))
        settings = PublisherSettings(endpoint, t.event_replays.get(tenant, ""), naming,
                                     tenant="" if tenant == DEFAULT else tenant, admit=admit,
                                     seq_file=f"events-{tenant}.seq", **common)  # type: ignore[arg-type]
        publishers.append(EventPublisher(settings, config.kv.index_dir))
    return EventStreams(publishers)
