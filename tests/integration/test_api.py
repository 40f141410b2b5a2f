"""Put/Get/Lookup/Delete/ListBlocks against a real daemon subprocess over its Unix socket."""

from __future__ import annotations

import os
import time

import grpc
import pytest

from kvcached.v1 import kvcache_pb2 as pb
from kvcached_agent.address import BlockAddress, chain_digests

SIZES = [1 << 10, 4 << 10, (64 << 10) + 3, 1 << 20, (3 << 20) + 7, 8 << 20]


def chain(n: int, seed: int = 0, model: str = "test/model") -> list[bytes]:
    return chain_digests(list(range(seed, seed + 16 * n)), 16, model=model, dtype="bfloat16")


@pytest.mark.parametrize("size", SIZES)
def test_put_get_round_trip_bit_exact(daemon, size: int) -> None:
    address = BlockAddress(chain(1, seed=size)[0], layer=size % 80)
    payload = os.urandom(size)
    with daemon.client() as c:
        assert c.put([(address, payload)], model="m").stored == 1
        (got,), misses = c.get([address])
        assert not misses and got.payload == payload and got.address == address
        (streamed,), _ = c.get_stream([address])
        assert streamed.payload == payload


@pytest.mark.parametrize("size", [1 << 10, 1 << 20, 8 << 20])
def test_put_stream_round_trip(daemon, size: int) -> None:
    address = BlockAddress(chain(1, seed=7 * size)[0])
    payload = os.urandom(size)
    with daemon.client() as c:
        assert c.put_stream([(address, payload)]).stored == 1
        assert c.put_stream([(address, payload)]).already_present == 1
        (got,), _ = c.get([address])
        assert got.payload == payload


def test_batch_put_get_and_already_present(daemon) -> None:
    digests = chain(32)
    blocks = [(BlockAddress(d, layer), os.urandom(16 << 10)) for d in digests for layer in (0, 1)]
    with daemon.client() as c:
        r = c.put(blocks, model="m")
        assert (r.stored, r.already_present) == (64, 0)
        r = c.put(blocks[:10], model="m")
        assert (r.stored, r.already_present) == (0, 10)
        found, misses = c.get([a for a, _ in blocks])
        assert [f.payload for f in found] == [p for _, p in blocks] and not misses


def test_lookup_longest_prefix_per_tier(daemon) -> None:
    digests = chain(64)
    with daemon.client() as c:
        assert c.lookup(digests).longest == 0
        c.put([(BlockAddress(d), b"x" * 4096) for d in digests[:40]])
        c.put([(BlockAddress(digests[45]), b"y" * 4096)])          # after a gap: never counted
        r = c.lookup(digests)
        assert (r.longest, r.ram, r.ssd, r.gpu, r.peer) == (40, 40, 0, 0, 0)
        assert c.lookup(digests[:10]).longest == 10
        assert c.lookup(digests, layer=3).longest == 0             # other layer: other blocks
        assert c.lookup(digests[1:]).longest == 39


def test_ram_budget_never_exceeded(make_daemon) -> None:
    """A stream of puts several times the arena: evictions keep resident bytes within budget.
    RAM only (no SSD tier), so what is evicted is gone and says so."""
    daemon = make_daemon("kv.ssd_gib=0")
    budget = int(0.125 * (1 << 30))
    sizes = [1 << 20, (1 << 20) + 4096, 300 << 10, 2 << 20, 64 << 10]
    digests = chain(600, seed=99)
    total = 0
    with daemon.client() as c:
        for i, d in enumerate(digests):
            payload = os.urandom(sizes[i % len(sizes)])
            total += len(payload)
            c.put([(BlockAddress(d), payload)])
            if i % 50 == 0:
                ram = c.stats().tiers[0]
                assert ram.bytes <= ram.reserved_bytes <= ram.capacity_bytes <= budget
        s = c.stats()
        ram = s.tiers[0]
        assert total > 3 * budget
        assert ram.evictions > 0 and ram.reserved_bytes <= ram.capacity_bytes <= budget
        # the newest block is resident, an early one was evicted and says so
        (got,), _ = c.get([BlockAddress(digests[-1])])
        assert len(got.payload) == sizes[(len(digests) - 1) % len(sizes)]
        with pytest.raises(grpc.RpcError) as err:
            c.get([BlockAddress(digests[0])])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "evicted" in err.value.details()


def test_delete_and_list_blocks(make_daemon) -> None:
    daemon = make_daemon("kv.ssd_gib=0")              # RAM only: write-back cannot race the listing
    digests = chain(30)
    with daemon.client() as c:
        c.put([(BlockAddress(d), b"a" * 5000) for d in digests[:20]], model="model-a")
        c.put([(BlockAddress(d), b"b" * 5000) for d in digests[20:]], model="model-b")
        listed = list(c.list_blocks(page_size=7))
        assert len(listed) == 30 and len({i.address.digest for i in listed}) == 30
        assert {i.address.digest for i in c.list_blocks(model="model-b", page_size=3)} == set(digests[20:])
        assert all(list(i.tiers) == [pb.TIER_RAM] for i in listed)
        r = c.delete([BlockAddress(d) for d in digests[:5]] + [BlockAddress(b"\x01" * 32)])
        assert (r.deleted, r.not_found) == (5, 1)
        assert len(list(c.list_blocks())) == 25
        assert c.lookup(digests).longest == 0


def test_get_partial_reports_misses(daemon) -> None:
    digests = chain(3)
    with daemon.client() as c:
        c.put([(BlockAddress(digests[0]), b"z" * 4096)])
        found, misses = c.get([BlockAddress(d) for d in digests], allow_partial=True)
        assert len(found) == 1 and [m.reason for m in misses] == ["unknown block"] * 2
        found, misses = c.get_stream([BlockAddress(d) for d in digests], allow_partial=True)
        assert len(found) == 1 and len(misses) == 2


def test_stats_counts(daemon) -> None:
    digests = chain(4)
    with daemon.client() as c:
        c.put([(BlockAddress(d), b"q" * 8192) for d in digests])
        c.get([BlockAddress(d) for d in digests[:2]])
        c.lookup(digests)
        s = c.stats()
        assert (s.puts, s.put_bytes, s.hits, s.lookups) == (4, 4 * 8192, 2, 1)
        assert s.tiers[0].tier == pb.TIER_RAM and s.tiers[0].blocks == 4 and s.index_entries >= 4


def test_stats_says_the_threads_the_daemon_resolved(make_daemon, tmp_path) -> None:
    """kv.hash_threads and kv.ssd_io_threads reach the Store and the SSD tier as configured,
    and 0 (the default) is one hashing thread per CPU of the daemon's affinity, 16 at most
    (docs/operations.md "Threads and cores")."""
    with make_daemon("kv.hash_threads=3", "kv.ssd_gib=0.0625", "kv.ssd_io_threads=5").client() as c:
        s = c.stats()
        assert (s.hash_threads, s.ssd_io_threads) == (3, 5)
    (tmp_path / "defaults").mkdir()
    with make_daemon("kv.ssd_gib=0", state=tmp_path / "defaults").client() as c:
        s = c.stats()
        assert (s.hash_threads, s.ssd_io_threads) == (min(16, len(os.sched_getaffinity(0))), 0)


def test_metrics_endpoint(make_daemon) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon(f'metrics.listen="127.0.0.1:{port}"')
    with d.client() as c:
        c.put([(BlockAddress(chain(1)[0]), b"m" * 4096)])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvcached_blocks{tier="ram"} 1.0' in text
    assert 'kvcached_bytes{tier="ram"} 4096.0' in text
    assert 'kvcached_build_info{version="0.1.0"} 1.0' in text
    assert 'kvcached_puts_total 1.0' in text


def test_get_stream_pins_its_batch_until_done_or_cancelled(daemon) -> None:
    """A streaming Get is a snapshot: its blocks can be neither deleted nor evicted while it
    runs, and a cancelled stream gives its pins back."""
    a, b = (BlockAddress(d) for d in chain(2, seed=5))
    big = os.urandom(8 << 20)
    with daemon.client() as c:
        c.put_stream([(a, big), (b, big)])
        request = pb.GetRequest(addresses=[pb.BlockAddress(digest=a.digest), pb.BlockAddress(digest=b.digest)])
        stream = c.stub.GetStream(request, timeout=30)
        first = next(stream)                          # the stream is running: both blocks pinned
        with pytest.raises(grpc.RpcError) as err:
            c.delete([b])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "in use (1 readers)" in err.value.details()
        # a flood of puts larger than the arena cannot evict them either
        for d in chain(20, seed=1000):
            c.put_stream([(BlockAddress(d), os.urandom(8 << 20))])
        rest = b"".join(chunk.data for chunk in stream)
        assert first.data + rest == big + big
        # done: the pins are gone
        assert c.delete([b]).deleted == 1

        stream = c.stub.GetStream(pb.GetRequest(addresses=[pb.BlockAddress(digest=a.digest)]), timeout=30)
        next(stream)
        stream.cancel()
        for _ in range(100):                          # the daemon sees the cancel shortly after
            try:
                assert c.delete([a]).deleted == 1
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                time.sleep(0.05)
        else:
            raise AssertionError("a cancelled stream kept its pin")


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_each_ram_policy_runs_a_daemon_through_evictions(make_daemon, policy: str) -> None:
    d = make_daemon(f'kv.ram_policy="{policy}"', "kv.ram_gib=0.0078125", "kv.max_block_mib=1", "kv.ssd_gib=0")
    hot = [BlockAddress(x) for x in chain(4, seed=77)]
    with d.client() as c:
        c.put([(a, b"h" * 100_000) for a in hot])
        for round_ in range(6):                        # 6 x 20 one-off blocks of 100 KB through an 8 MiB tier
            c.get(hot)
            c.put([(BlockAddress(x), os.urandom(100_000)) for x in chain(20, seed=1000 + round_)])
        s = c.stats()
        assert s.tiers[0].evictions > 0 and s.puts == 124
        found, _ = c.get(hot, allow_partial=True)
        assert len(found) == 4 or policy == "lru"      # the hot blocks outlive the one-off ones
    d.stop()
