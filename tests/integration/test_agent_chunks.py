"""Saves and loads in chunks whose requests overlap the copies (kvcached_agent.transfer) against
a real daemon: what a batch cut into chunks stores, finds and gives back, when all goes well
and when a copy fails halfway, and requests answered out of the order they were sent."""

from __future__ import annotations

import os

import pytest
import torch

from kvcached_agent import protocol as p
from kvcached_agent.address import BlockAddress
from kvcached_agent.agent import Agent
from kvcached_agent.transfer import chunks

from .conftest import DaemonProcess, wait_for
from .test_agent import NO_SSD, agent_socket, wait_stats

MIB = 1 << 20
BLOCKS = 40                      # 1 MiB blocks: chunks of 1, 4, 16 and 19


def connect(daemon: DaemonProcess) -> Agent:
    return Agent.connect(agent_socket(daemon), agent_id="chunks", model="test/chunks", dtype="uint8", block_tokens=16,
                         num_layers=1, layer_block_bytes=MIB, timeout=30)


def blocks(n: int, seed: int) -> tuple[list[BlockAddress], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return ([BlockAddress(os.urandom(32)) for _ in range(n)],
            [torch.randint(0, 256, (MIB,), dtype=torch.uint8, generator=gen) for _ in range(n)])


def test_a_batch_in_chunks_stores_counts_and_loads_back_bit_exact(make_daemon) -> None:
    assert len(chunks([MIB] * BLOCKS)) > 2
    daemon = make_daemon(NO_SSD)
    addresses, tensors = blocks(BLOCKS, 1)
    with connect(daemon) as agent, daemon.client() as c:
        early = agent.save(addresses[20:24], tensors[20:24])     # across the third and fourth chunks: present there
        assert early.stored == 4
        saved = agent.save(addresses, tensors)
        assert (saved.stored, saved.present, saved.skipped) == (BLOCKS - 4, 4, [])
        targets = [torch.zeros(MIB, dtype=torch.uint8) for _ in range(BLOCKS + 1)]
        loaded = agent.load(addresses + [BlockAddress(os.urandom(32))], targets)
        assert loaded.loaded == BLOCKS and loaded.missing == [BLOCKS]
        assert all(torch.equal(a, b) for a, b in zip(targets, tensors))
        wait_stats(c, held=0)


class FailingCopy:
    """An arena copy that raises on its ``fail``-th call: the engine's copy failing halfway."""

    def __init__(self, real, fail: int) -> None:  # type: ignore[no-untyped-def]
        self.real, self.fail, self.calls = real, fail, 0

    def __call__(self, tensors, offsets) -> None:  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("the copy failed")
        self.real(tensors, offsets)


@pytest.mark.parametrize("fail", [1, 2, 3])
def test_a_copy_failing_halfway_keeps_nothing_and_holds_nothing(make_daemon, fail: int) -> None:
    """The chunks copied before, the one that failed and the one whose slots were on their way
    all go back: nothing of the batch is stored, no slot stays reserved, and the next save of
    the same blocks stores them all."""
    daemon = make_daemon(NO_SSD)
    addresses, tensors = blocks(BLOCKS, 2)
    with connect(daemon) as agent, daemon.client() as c:
        real = agent.copier.save
        agent.copier.save = FailingCopy(real, fail)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="the copy failed"):
            agent.save(addresses, tensors)
        wait_stats(c, held=0)
        assert agent.lookup([a.digest for a in addresses]).ram == 0
        agent.copier.save = real  # type: ignore[method-assign]
        assert agent.save(addresses, tensors).stored == BLOCKS


def test_a_load_whose_tensor_does_not_fit_releases_every_pin(make_daemon) -> None:
    daemon = make_daemon(NO_SSD)
    addresses, tensors = blocks(BLOCKS, 3)
    with connect(daemon) as agent, daemon.client() as c:
        assert agent.save(addresses, tensors).stored == BLOCKS
        last = chunks([MIB] * BLOCKS)[-1]
        targets = [torch.zeros(MIB, dtype=torch.uint8) for _ in range(BLOCKS)]
        targets[last[len(last) // 2]] = torch.zeros(MIB // 2, dtype=torch.uint8)       # in the last chunk
        with pytest.raises(ValueError, match="its tensor holds"):
            agent.load(addresses, targets)
        wait_stats(c, held=0)
        before = last.start
        assert all(torch.equal(a, b) for a, b in zip(targets[:before], tensors[:before]))   # the chunks before were copied


def test_submitted_requests_are_answered_in_any_order(make_daemon) -> None:
    daemon = make_daemon(NO_SSD)
    addresses, tensors = blocks(3, 4)
    with connect(daemon) as agent:
        agent.save(addresses[:2], tensors[:2])
        wait_for(lambda: agent.lookup([a.digest for a in addresses]).ram == 2, 10, "the two blocks recorded")
        client = agent.client
        assert client is not None
        layer = addresses[0].layer
        first = client.submit(p.Lookup(layer, [a.digest for a in addresses[:1]]))
        second = client.submit(p.Lookup(layer, [a.digest for a in addresses]))
        assert client.call(p.Lookup(layer, [a.digest for a in addresses[:2]])).ram == 2     # reads past both answers
        later = client.answer(second)
        earlier = client.answer(first)
        assert isinstance(later, p.LookupResult) and isinstance(earlier, p.LookupResult)
        assert (earlier.ram, later.ram) == (1, 2)
