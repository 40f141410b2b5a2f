"""A small Get's latency while the largest allowed requests run, against the same Get unloaded.

    python bench/bench_hostile.py [--quick] [--json PATH] [--set KEY=VALUE ...]

Issue 20 (part 4): one Lookup of 1,000,000 digests held the daemon's event loop for 5-9 s, so
every other client waited that long. Requests are now capped at ``grpc.max_batch`` entries
(65,536) and the largest allowed Lookup, Get and GetStream are worked through
``grpc.batch_slice`` entries at a time with other requests served in between
(docs/api.md "Limits"). This measures what a well-behaved client sees meanwhile.

One real ``kvcached serve`` subprocess (config/kvcached.toml, 0.5 GiB arena, an SSD tier in a
temp dir with ``write_through`` so the resident block is on SSD too, gRPC on a Unix socket,
metrics off). Two blocks are put: V, 64 KiB, the victim's; R, 512 bytes, the hostile client's.

- Victim: this process, one blocking Get of V at a time, back to back, on its own channel;
  each call timed.
- Hostile client: a subprocess of this script (``--load``), one channel, sending one case's
  request again and again, serialized once beforehand and its answers left undecoded, so it
  costs the machine little besides the daemon's own work. Errors are counted, not raised:
  the refused cases expect INVALID_ARGUMENT every time.
- Baseline: the victim's Gets with no hostile client, in the same run. Every case runs in
  interleaved rounds (quiet then loaded, then loaded then quiet, ...) of the same length; the
  p50 and p99 are over all of a side's calls in the case's rounds, the ratio loaded / quiet.

Cases (65,536 = the largest allowed batch):

1. Lookup of R 65,535 times then an unknown digest: RAM's run ends in the last slice, so every
   slice is looked up, each with its SSD copies counted (the most work a Lookup can make).
2. Lookup of 65,536 unknown digests: every run ends in the first slice.
3. Get, allow_partial, of 65,536 unknown blocks (each miss reads the index for its reason).
4. Get, allow_partial, of R 65,536 times (an answer of about 40 MiB).
5. GetStream, allow_partial, of 65,536 unknown blocks (65,536 miss chunks).
6. Delete of 65,536 unknown blocks (not sliced: a Delete refuses a busy block as a whole).
7. Lookup of 1,000,000 digests, the issue's request (34 MB): refused, INVALID_ARGUMENT.
8. Lookup of 1,900,000 digests (64 MB, just under the message limit): refused.

Figure 3 sends cases 7 and 8 to the read-only listener instead (``grpc.read_only_listen``, TCP on
127.0.0.1: what anyone who reaches it may call, with no credentials), whose receive limit is the
largest allowed read-only request (a few MiB, issue 37): gRPC refuses them from their 5-byte
length prefix, RESOURCE_EXHAUSTED, before the daemon sees a byte of them. The victim stays on the
Unix socket. Each case also notes the daemon's anonymous memory (RssAnon) before and at its
peak while the hostile client ran.

No target: the reliability test (tests/reliability/test_request_bounds.py) asserts a p99 under
1 s; this prints how far under. ``--set`` passes more daemon settings (e.g.
``--set grpc.batch_slice=256``) to compare. --quick: 2 rounds of 0.75 s per side and case
(about 45 s); full: 4 rounds of 2 s (about 3 minutes). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_core import KiB, MiB, Row, progress, start_kvcached  # noqa: E402

BATCH = 65536                # grpc.max_batch's default: the largest allowed request
VICTIM_BYTES = 64 * KiB
HOSTILE_BYTES = 512
MESSAGE_LIMIT = 64 * MiB
TITLES = {1: "1. A 64 KiB Get's latency while one client sends the largest allowed requests back to back, "
             "against the same Get with no other load; lower is better",
          2: "2. The same while one client sends requests over the limits (refused); lower is better",
         3: "3. The same while one client sends the over-limit Lookups to the read-only TCP listener; lower is better"}


@dataclass(frozen=True)
class Settings:
    seconds: float           # per side, per round
    rounds: int


FULL = Settings(seconds=2.0, rounds=4)
QUICK = Settings(seconds=0.75, rounds=2)


@dataclass(frozen=True)
class Case:
    figure: int
    name: str
    method: str              # KvCache method
    request: bytes           # serialized
    stream: bool = False
    read_only: bool = False  # sent to the read-only TCP listener (else the Unix socket)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def digest(n: int) -> bytes:
    return n.to_bytes(8, "big") * 4


def unknown(count: int) -> list[bytes]:
    return [digest((1 << 40) + i) for i in range(count)]


def make_cases(resident: bytes) -> list[Case]:
    from kvcached.v1 import kvcache_pb2 as pb

    def addresses(digests: Sequence[bytes]) -> list[Any]:
        return [pb.BlockAddress(digest=d) for d in digests]

    def ser(message: Any) -> bytes:
        return message.SerializeToString()

    return [
        Case(1, "Lookup, every slice x2", "Lookup",
             ser(pb.LookupRequest(digests=[resident] * (BATCH - 1) + unknown(1)))),
        Case(1, "Lookup, unknown", "Lookup", ser(pb.LookupRequest(digests=unknown(BATCH)))),
        Case(1, "Get, unknown", "Get", ser(pb.GetRequest(addresses=addresses(unknown(BATCH)), allow_partial=True))),
        Case(1, "Get, 40 MiB answer", "Get", ser(pb.GetRequest(addresses=addresses([resident] * BATCH),
                                                                         allow_partial=True))),
        Case(1, "GetStream, unknown", "GetStream", ser(pb.GetRequest(addresses=addresses(unknown(BATCH)),
                                                                           allow_partial=True)), stream=True),
        Case(1, "Delete, unknown", "Delete", ser(pb.DeleteRequest(addresses=addresses(unknown(BATCH))))),
        Case(2, "Lookup 1M (34 MB)", "Lookup", ser(pb.LookupRequest(digests=unknown(1_000_000)))),
        Case(2, "Lookup 1.9M (64 MB)", "Lookup", ser(pb.LookupRequest(digests=unknown(1_900_000)))),
        Case(3, "Lookup 1M, read-only", "Lookup", ser(pb.LookupRequest(digests=unknown(1_000_000))), read_only=True),
        Case(3, "Lookup 1.9M, read-only", "Lookup", ser(pb.LookupRequest(digests=unknown(1_900_000))),
             read_only=True),
    ]


# =============================================================================================
# the hostile client (a subprocess: --load)


def load(target: str, method: str, request_file: str, stream: bool) -> int:
    """Send the request in ``request_file`` again and again until stdin closes; print one JSON
    line: every call's seconds and the status codes seen. Says ``ready`` once a call is done."""
    import grpc

    request = Path(request_file).read_bytes()
    channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", MESSAGE_LIMIT),
                                                     ("grpc.max_send_message_length", MESSAGE_LIMIT)])
    path = f"/kvcached.v1.KvCache/{method}"
    call = channel.unary_stream(path) if stream else channel.unary_unary(path)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    took: list[float] = []
    codes: dict[str, int] = {}
    while not stop.is_set():
        started = time.perf_counter()
        try:
            answer = call(request, timeout=120)
            if stream:
                for _ in answer:
                    pass
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        took.append(time.perf_counter() - started)
        codes[code] = codes.get(code, 0) + 1
        if len(took) == 1:
            print("ready", flush=True)
    print(json.dumps({"took": took, "codes": codes}), flush=True)
    channel.close()
    return 0


class Hostile:
    """The --load subprocess for one case; stop() returns its report."""

    def __init__(self, target: str, case: Case, tmp: Path) -> None:
        request_file = tmp / "request.bin"
        request_file.write_bytes(case.request)
        argv = [sys.executable, __file__, "--load", target, case.method, str(request_file),
                "stream" if case.stream else "unary"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"hostile client for {case.name!r} did not start: {line!r}")

    def stop(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read()
        self.proc.wait(120)
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# =============================================================================================
# the victim


def victim_gets(stub: Any, request: Any, seconds: float) -> list[float]:
    """Seconds of each of back-to-back Gets for ``seconds``."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.perf_counter()
        stub.Get(request, timeout=60)
        out.append(time.perf_counter() - started)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_rows(rows: list[Row], header: str) -> None:
    """One line per case: its p50 and p99 rows side by side, loaded against quiet."""
    print(header)
    for figure in sorted({r.figure for r in rows}):
        print()
        print(TITLES[figure])
        widths = [24, 11, 11, 8, 11, 11, 8]
        print("  " + "".join(h.ljust(w) for h, w in zip(
            ["case", "quiet p50", "loaded", "ratio", "quiet p99", "loaded", "ratio"], widths)).rstrip())
        mine = [r for r in rows if r.figure == figure]
        for p50, p99 in zip(mine[0::2], mine[1::2]):
            cells = [p50.case.rsplit(": ", 1)[0],
                     f"{p50.baseline:.0f} us", f"{p50.kvcached:.0f} us", f"{p50.ratio:.2f}x",
                     f"{p99.baseline:.0f} us", f"{p99.kvcached:.0f} us", f"{p99.ratio:.2f}x"]
            print("  " + "".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    print()
    print("quiet: the 64 KiB Get alone; loaded: while the hostile client runs; ratio = loaded / quiet, same run.")


def anon_mib(pid: int) -> float:
    """The daemon's anonymous resident memory (RssAnon), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakMemory:
    """The daemon's RssAnon, sampled every 20 ms while a hostile client runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, anon_mib(pid)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, anon_mib(self.pid))

    def done(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.peak


def run_case(case: Case, stub: Any, victim: Any, target: str, tmp: Path,
             s: Settings, pid: int) -> tuple[list[Row], dict[str, Any]]:
    """The case's rounds; its p50 and p99 rows, and every timed call (for --json)."""
    quiet: list[float] = []
    loaded: list[float] = []
    hostile_took: list[float] = []
    codes: dict[str, int] = {}
    memory_before, memory_peak = anon_mib(pid), 0.0
    for r in range(s.rounds):
        for side in (("quiet", "loaded") if r % 2 == 0 else ("loaded", "quiet")):
            if side == "quiet":
                quiet += victim_gets(stub, victim, s.seconds)
                continue
            hostile = Hostile(target, case, tmp)
            peak = PeakMemory(pid)
            try:
                loaded += victim_gets(stub, victim, s.seconds)
                report = hostile.stop()
            finally:
                hostile.kill()
                memory_peak = max(memory_peak, peak.done())
            hostile_took += report["took"]
            for code, n in report["codes"].items():
                codes[code] = codes.get(code, 0) + n
    details = {"quiet_calls": len(quiet), "loaded_calls": len(loaded), "hostile_calls": len(hostile_took),
               "hostile_ms_median": statistics.median(hostile_took) * 1000, "hostile_codes": codes,
               "anon_mib_before": memory_before, "anon_mib_peak": memory_peak}
    rows = []
    for label, q in (("p50", 0.5), ("p99", 0.99)):
        rows.append(Row(case.figure, f"{case.name}: {label}", "us", percentile(loaded, q) * 1e6, "no other load",
                        percentile(quiet, q) * 1e6, higher_is_better=False, details=details))
    return rows, {"case": case.name, "quiet_s": quiet, "loaded_s": loaded, "hostile_s": hostile_took, "codes": codes}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 0.75 s per side and case (about 45 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures and every timed call as JSON")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another daemon setting, e.g. grpc.batch_slice=256 (repeatable)")
    parser.add_argument("--load", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load:
        target, method, request_file, kind = args.load
        return load(target, method, request_file, kind == "stream")

    from kvcached.v1 import kvcache_pb2 as pb
    from kvcached.v1 import kvcache_pb2_grpc as pb_grpc

    s = QUICK if args.quick else FULL
    started = time.time()
    rows: list[Row] = []
    raw: list[dict[str, Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvcbench-hostile-") as tmpdir, contextlib.ExitStack() as stack:
        tmp = Path(tmpdir)
        read_only = f"127.0.0.1:{free_port()}"
        settings = ['kv.write_policy="write_through"', 'kv.ssd_durability="none"', "kv.ssd_gib=1",
                    f'grpc.read_only_listen=["{read_only}"]', *args.set]
        progress(f"starting kvcached ({', '.join(settings)})")
        proc, channel = start_kvcached(stack, tmp, 0.5, settings)
        stub = pb_grpc.KvCacheStub(channel)
        victim_digest, resident = digest(1), digest(2)
        stub.Put(pb.PutRequest(blocks=[
            pb.Block(address=pb.BlockAddress(digest=victim_digest), payload=os.urandom(VICTIM_BYTES)),
            pb.Block(address=pb.BlockAddress(digest=resident), payload=os.urandom(HOSTILE_BYTES))]), timeout=30)
        victim = pb.GetRequest(addresses=[pb.BlockAddress(digest=victim_digest)])
        check = stub.Lookup(pb.LookupRequest(digests=[resident] * (BATCH - 1) + unknown(1)), timeout=60)
        if (check.longest, check.ram) != (BATCH - 1, BATCH - 1):
            raise RuntimeError(f"the resident block is not resident: {check}")
        victim_gets(stub, victim, 0.3)                                    # warm up
        for case in make_cases(resident):
            progress(f"{case.name}: {s.rounds} rounds x {s.seconds:g} s per side")
            target = read_only if case.read_only else f"unix:{tmp}/kvcached.sock"
            case_rows, case_raw = run_case(case, stub, victim, target, tmp, s, proc.proc.pid)
            rows += case_rows
            raw.append(case_raw)
            d = case_rows[0].details
            codes = ", ".join(f"{k} {v}" for k, v in sorted(d["hostile_codes"].items()))
            notes.append(f"{case.name}: the hostile client's calls took {d['hostile_ms_median']:.0f} ms (median) "
                         f"while it ran: {d['hostile_calls']} calls ({codes}); victim calls {d['loaded_calls']} "
                         f"loaded, {d['quiet_calls']} quiet; daemon RssAnon {d['anon_mib_before']:.0f} MiB before, "
                         f"{d['anon_mib_peak']:.0f} MiB at the peak")
        if not proc.alive():
            raise RuntimeError(f"kvcached died:\n{proc.tail()}")
    header = (f"kvcached under hostile requests ({'quick' if args.quick else 'full'}): {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - started:.0f} s; "
              f"{s.rounds} interleaved rounds x {s.seconds:g} s per side and case"
              + (f"; daemon settings: {', '.join(args.set)}" if args.set else ""))
    print_rows(rows, header)
    for note in notes:
        print(f"note: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "meta": {"quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
                     "started": started, "elapsed_s": time.time() - started, "settings": asdict(s), "set": args.set},
            "figures": [{**asdict(r), "ratio": r.ratio, "verdict": r.verdict} for r in rows], "raw": raw}) + "\n")
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
