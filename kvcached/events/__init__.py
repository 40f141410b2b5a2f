"""KV events: what the RAM and SSD tiers gain and lose, published in vLLM's schema over ZMQ so
KV-aware routers see every tier (docs/events.md). ``schema``: the msgpack layout; ``stream``:
events, batches, replay and sequence numbers, without I/O; ``publisher``: the sockets and the
daemon's task."""

from kvcached.config import Config
from kvcached.events.publisher import EventCounters, EventPublisher, PublisherSettings
from kvcached.events.stream import EventNaming

__all__ = ["EventCounters", "EventNaming", "EventPublisher", "PublisherSettings", "publisher_for"]


def publisher_for(config: Config, node: str) -> EventPublisher | None:
    """The publisher ``[events]`` asks for (None: no endpoint), with sequence numbers kept in
    ``kv.index_dir``; ``node`` names this daemon where ``events.node`` does not. OSError if
    the sequence number kept there cannot be read."""
    e = config.events
    if not e.endpoint:
        return None
    name = e.node or node
    naming = EventNaming(ram_medium=e.ram_medium.format(node=name), ssd_medium=e.ssd_medium.format(node=name),
                         ownership=f"kvcached@{name}", topic=e.topic, node=name)
    settings = PublisherSettings(e.endpoint, e.replay_endpoint, naming, interval_s=e.batch_ms / 1000, hwm=e.hwm,
                                 replay_batches=e.replay_batches, replay_bytes=e.replay_mib << 20)
    return EventPublisher(settings, config.kv.index_dir)
