"""The policy simulator (kvcached.sim): Belady's MIN on known traces, replay through the
daemon's policy classes, deterministic workloads, the report."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from kvcached.sim.replay import accesses_of, belady, replay, simulate
from kvcached.sim.report import svg, table
from kvcached.sim.workloads import WORKLOADS, make_trace


def keys(text: str) -> list[bytes]:
    return [c.encode() for c in text]


def test_belady_on_textbook_traces() -> None:
    # capacity 3: a b c d a b e a b c d e -> MIN has 5 hits (a, b, a, b, and one of c/d)
    assert belady(3, keys("abcdabeabcde")) == 5
    assert belady(1, keys("aaaa")) == 3 and belady(2, keys("abab")) == 2
    assert belady(2, keys("abcabc")) == 2          # keeps a, then b: LRU would hit nothing


def test_lru_replay_on_the_same_trace_and_no_policy_beats_min() -> None:
    trace = keys("abcdabeabcde")
    assert replay("lru", 3, trace) == 2            # a and b of the second round only
    assert replay("lru", 2, keys("abcabc")) == 0
    for name in ("lru", "clock", "arc", "s3fifo"):
        for capacity in (1, 2, 3, 4):
            assert replay(name, capacity, trace) <= belady(capacity, trace), (name, capacity)


def test_prefixes_share_blocks_and_traces_are_deterministic() -> None:
    a, b = make_trace("chatbot", 0.01), make_trace("chatbot", 0.01)
    assert a == b and len(a) == 40
    same_app = [r for r in a if r[0] == a[0][0]]
    assert len(same_app) > 1 and all(r[:32] == a[0][:32] for r in same_app)   # the 512-token system prompt
    turns = make_trace("multi_turn", 0.02)
    grown = [(x, y) for x in turns for y in turns if len(y) > len(x) and y[:len(x)] == x]
    assert grown, "a later turn extends an earlier one's chain"
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        make_trace("chat")


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_workload_simulates(name: str) -> None:
    result = simulate(name, make_trace(name, 0.02), ["lru", "arc"], [0.1, 0.5])
    assert result.accesses == len(accesses_of(make_trace(name, 0.02))) and result.unique <= result.accesses
    rates = result.hit_rate
    assert all(0 <= x <= 1 for r in rates.values() for x in r)
    assert rates["lru"] == sorted(rates["lru"]) and rates["belady"] == sorted(rates["belady"])   # stack algorithms
    assert all(b >= x for p in ("lru", "arc") for b, x in zip(rates["belady"], rates[p]))


def test_report_table_and_svg() -> None:
    results = [simulate(n, make_trace(n, 0.02), ["lru", "s3fifo"], [0.05, 0.5]) for n in ("chatbot", "scan_mix")]
    text = table(results)
    assert "chatbot:" in text and "scan_mix:" in text and "belady" in text
    root = ET.fromstring(svg(results))
    assert root.tag.endswith("svg")
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2 * 3      # 2 panels x (2 policies + MIN)
