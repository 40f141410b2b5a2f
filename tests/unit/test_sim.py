"""The policy simulator (kvcached.sim): Belady's MIN on known traces, replay through the
daemon's policy classes (block hits and prefix hits), deterministic workloads, trace files
(tests/data/mooncake_conversation_slice.jsonl: see tests/data/README.md), the report and the
command line."""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Iterable

import pytest
from blake3 import blake3

from kvcached import cli
from kvcached.policies import EVICTION_POLICIES, KeyedPolicy, make_eviction_policy
from kvcached.sim import __main__ as sim_cli
from kvcached.sim.replay import accesses_of, belady, belady_hits, prefix_count, replay, replay_prefix, replay_requests, simulate
from kvcached.sim.report import svg, table
from kvcached.sim.traces import KEY_DOMAIN, TraceError, block_key, load_trace
from kvcached.sim.workloads import WORKLOADS, make_trace

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"
SVG = "{http://www.w3.org/2000/svg}"


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
    assert "block hits" in text and "prefix hits" in text and "vs MIN" in text
    root = ET.fromstring(svg(results))
    assert root.tag.endswith("svg")
    assert len(root.findall(f"{SVG}polyline")) == 2 * 2 * 3      # 2 workloads x (block, prefix) x (2 policies + MIN)
    assert sum("prefix hits" in (t.text or "") for t in root.iter(f"{SVG}text")) == 2
    blocks_only = [simulate("chatbot", make_trace("chatbot", 0.02), ["lru"], [0.05, 0.5], prefix=False)]
    assert blocks_only[0].prefix_hit_rate == {} and "prefix hits" not in table(blocks_only)
    assert len(ET.fromstring(svg(blocks_only)).findall(f"{SVG}polyline")) == 2


# ---------------------------------------------------------------------------------------------
# prefix hits against block hits


class Spy(KeyedPolicy):
    """LRU, recording the keys it is told were used again."""

    def __init__(self) -> None:
        super().__init__(make_eviction_policy("lru"))
        self.touched: list[bytes] = []

    def touch(self, key: bytes) -> None:
        self.touched.append(key)
        super().touch(key)


# capacity 4: r2 misses its head x while b and c are resident; e then evicts what LRU holds oldest
HAND = [keys("bc"), keys("xbc"), keys("de"), keys("b")]


def test_prefix_hits_stop_at_a_requests_first_miss_and_touch_nothing_after_it() -> None:
    block, prefix = Spy(), Spy()
    assert list(replay_requests(block, 4, HAND, prefix=False)) == [False, False, False, True, True, False, False, False]
    assert block.touched == keys("bc")        # r2 loads b, c, then saves x: b is the oldest when e comes
    assert set(block) == set(keys("xdeb"))     # and r4's b evicts c
    assert list(replay_requests(prefix, 4, HAND, prefix=True)) == [False] * 8
    assert prefix.touched == []                # b, c of r2 are recomputed and re-saved: no touch
    assert set(prefix) == set(keys("xdeb"))
    assert replay("lru", 4, accesses_of(HAND)) == 3 and replay_prefix("lru", 4, HAND) == 0   # one access a request: x older
    assert replay_prefix("lru", 5, [keys("bc"), keys("bcx"), keys("bcx")]) == 2 + 3     # hits up to the first miss


def test_a_request_saves_its_missing_blocks_as_one_batch() -> None:
    """Slots are reserved for the whole batch before any block of it is inserted: a block of
    the batch is never evicted to make room for the next (the tier's reserved blocks are not in
    the policy), and a batch larger than the tier stores what fits."""
    p = Spy()
    assert list(replay_requests(p, 3, [keys("abcde")], prefix=False)) == [False] * 5
    assert set(p) == set(keys("abc"))
    p = Spy()
    assert list(replay_requests(p, 3, [keys("ab"), keys("cde"), keys("e")], prefix=False)) == [False] * 5 + [True]
    assert set(p) == set(keys("cde"))          # a, b made room; c and d stayed for e


def test_belady_prefix_count_is_its_block_run_cut_at_each_first_miss() -> None:
    assert prefix_count([keys("abc"), keys("de"), []], [True, False, True, True, True]) == 1 + 2
    hits = belady_hits(4, accesses_of(HAND))
    assert hits == [False, False, False, True, True, False, False, True]
    assert sum(hits) == belady(4, accesses_of(HAND)) == 3 and prefix_count(HAND, hits) == 1    # r4's b only
    r = simulate("hand", HAND, ["lru"], [0.8])             # 5 distinct blocks: room for 4
    assert r.sizes == [4] and r.requests == 4 and r.span_ms is None
    assert r.hit_rate == {"lru": [2 / 8], "belady": [3 / 8]}
    assert r.prefix_hit_rate == {"lru": [0.0], "belady": [1 / 8]}


def test_the_trace_slice_lru_prefix_hits_at_most_block_hits_and_min() -> None:
    trace = load_trace(SLICE)
    assert trace.name == "mooncake_conversation_slice" and len(trace.requests) == len(trace.times_ms) == 1500
    r = simulate(trace.name, trace.requests, ["lru"], [0.02, 0.2], span_ms=trace.span_ms)
    assert r.accesses == 41702 and r.unique == 30634 and r.span_ms == 509999
    lru, lru_prefix, opt, opt_prefix = r.hit_rate["lru"], r.prefix_hit_rate["lru"], r.hit_rate["belady"], \
        r.prefix_hit_rate["belady"]
    assert all(0 < p <= b <= m for p, b, m in zip(lru_prefix, lru, opt)), r
    assert all(p <= m <= b for p, m, b in zip(lru_prefix, opt_prefix, opt)), r
    assert lru[0] < lru[1] and opt[0] < opt[1]


# ---------------------------------------------------------------------------------------------
# trace files


def write(tmp_path: Path, text: str | bytes, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def line(ts: object = 0, ids: Iterable[object] | str = (1, 2)) -> str:
    """A line of a trace file, as in the Mooncake release (lengths in tokens, ignored)."""
    return json.dumps({"timestamp": ts, "input_length": 1024, "output_length": 8,
                       "hash_ids": ids if isinstance(ids, str) else list(ids)})


GOOD = line(0, (0, 1, 2)) + "\n"


@pytest.mark.parametrize("text, lineno, message", [
    (GOOD + "{oops\n", 2, "invalid JSON"),
    (GOOD + "\n\n" + '{"timestamp": 1, "hash_ids": [1]\n', 4, "invalid JSON"),     # blank lines count
    (GOOD + "[1, 2]\n", 2, "expected a JSON object"),
    ('{"hash_ids": [1]}\n', 1, "missing field 'timestamp'"),
    (GOOD + '{"timestamp": 5}\n', 2, "missing field 'hash_ids'"),
    (line("5") + "\n", 1, "'timestamp' must be a finite number"),
    (line(True) + "\n", 1, "'timestamp' must be a finite number"),
    ('{"timestamp": NaN, "hash_ids": []}\n', 1, "'timestamp' must be a finite number"),
    (line(0, "1,2") + "\n", 1, "'hash_ids' must be a list"),
    (GOOD + line(1, (3, -1)) + "\n", 2, r"hash_ids\[1\] must be an integer .* got -1"),
    (line(0, (1.5,)) + "\n", 1, r"hash_ids\[0\] .* got 1.5"),
    (line(0, (1, True)) + "\n", 1, r"hash_ids\[1\] .* got True"),
    (line(0, ("7",)) + "\n", 1, r"hash_ids\[0\] .* got '7'"),
    (line(0, (2 ** 64,)) + "\n", 1, r"hash_ids\[0\] .* got 18446744073709551616"),
    (line(10) + "\n" + line(20) + "\n" + line(19.5) + "\n", 3, "timestamp 19.5 is before the previous line's 20"),
])
def test_a_bad_trace_names_its_file_and_line(tmp_path: Path, text: str, lineno: int, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TraceError, match=f"^{path}:{lineno}: {message}") as info:
        load_trace(path)
    assert isinstance(info.value, ValueError)


def test_an_empty_trace_and_bad_bytes_are_errors(tmp_path: Path) -> None:
    for text in ("", "\n  \n"):
        with pytest.raises(TraceError, match="no requests"):
            load_trace(write(tmp_path, text))
    with pytest.raises(TraceError, match=":2: invalid JSON"):
        load_trace(write(tmp_path, GOOD.encode() + b'{"timestamp": 0, "x": "\xff"}\n'))


def test_trace_keys_are_blake3_of_the_ids_and_times_are_kept(tmp_path: Path) -> None:
    assert block_key(7) == block_key(7) == blake3(KEY_DOMAIN + (7).to_bytes(8, "little")).digest()
    assert len(block_key(0)) == 32 and len({block_key(i) for i in range(1000)}) == 1000
    path = write(tmp_path, "\n".join([line(0, (0, 1, 2)), "", line(0, ()), line(2500.5, (0, 1, 3))]) + "\n",
                 "my.trace.jsonl")
    trace = load_trace(path)
    assert trace.name == "my.trace"
    assert trace.requests == [[block_key(0), block_key(1), block_key(2)], [], [block_key(0), block_key(1), block_key(3)]]
    assert trace.times_ms == [0, 0, 2500.5] and trace.span_ms == 2500.5 and trace.requests_per_s == pytest.approx(3 / 2.5005)
    assert load_trace(path) == trace                         # the same file, the same keys
    assert load_trace(write(tmp_path, GOOD)).requests_per_s is None


# ---------------------------------------------------------------------------------------------
# the command line


def small_trace(tmp_path: Path) -> Path:
    lines = [line(i * 100, range(i % 3 * 10, i % 3 * 10 + 1 + i % 4)) for i in range(40)]
    return write(tmp_path, "\n".join(lines) + "\n", "tiny.jsonl")


def test_the_cli_replays_trace_files_with_every_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = small_trace(tmp_path)
    assert sim_cli.main(["--trace", str(path), "--sizes", "0.2,1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("tiny: 40 requests over 3.9 s, 10.3 requests/s;") and "chatbot" not in out
    assert "block hits" in out and "prefix hits" in out and "belady" in out
    for name in EVICTION_POLICIES:                         # all registered, by default
        assert f"\n    {name} " in out
        assert f"tiny: {name}, 2 sizes" in err
    assert sim_cli.main(["--trace", str(path), "--trace", str(path), "--workload", "chatbot", "--scale", "0.01",
                         "--policy", "lru", "--no-prefix"]) == 0
    out, err = capsys.readouterr()
    assert out.count("tiny: ") == 2 and "chatbot: " in out and "prefix hits" not in out
    assert " 284 (50.0%)" in out and " 2 (16.7%)" in out     # each kind its own default sizes
    actions = {a.dest: a for a in _parser()._actions}
    assert actions["policy"].choices == sorted(EVICTION_POLICIES)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    return parser


def test_the_cli_reports_a_bad_trace_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, GOOD + GOOD + '{"timestamp": 3, "hash_ids": [1, -4]}\n')
    assert sim_cli.main(["--trace", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"kvcached sim: error: {path}:3: hash_ids[1] must be an integer in [0, 2**64), got -4"
    assert cli.main(["sim", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "kvcached sim: error: cannot read" in capsys.readouterr().err
