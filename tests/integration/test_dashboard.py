"""The Grafana dashboard (deploy/grafana/kvcached.json) against what the daemon really exports.

The JSON is checked for what Grafana needs (unique panel ids, every panel's queries on the
`datasource` template variable, panels that do not overlap), then every PromQL expression in it,
the panels' and the template variables' (`label_values(...)`), is taken apart by a small
tokenizer: the metric names it queries, the label matchers on each, the labels of its `by`,
`without`, `on`, `ignoring` and `group_*` clauses, and the labels its legends name. Two real
daemons on loopback (node-a and node-b, peers over QUIC and the TLS bulk lane, sharing a
tenant key) then do the work that makes the metrics appear: node-b, the one scraped, runs a small
RAM tier over an SSD tier written back, two tenants (alice, bob) on their own gRPC sockets with
RAM and SSD shares, the live curves, KV events, an SSD write budget and periodic policy saves; it
pulls alice's blocks from node-a, evicts to SSD and promotes back, refuses a caller naming an
unknown tenant, and serves a connected agent with blocks pinned on its "GPU". Every metric a query
names must be in that scrape (as the sample names Prometheus stores: `_total` on counters,
`_bucket`, `_sum`, `_count` of histograms), with every label a query matches or groups by, and
every label value it matches literally (`tier="ssd"`) present on some sample.

Checked against docs/metrics.md only, not the scrape:

- `kvcached_nixl_pulled_bytes_total` (the "Peer bytes" and "Lane bytes" panels): exported only
  where pulls go over NIXL (`quic.nixl`), which needs the optional NIXL library (`make nixl`) and
  is absent from a plain checkout; a daemon without it exports no NIXL series at all.

With promtool installed (the project's alert tests use it), every expression must also parse:
each, with the Grafana variables ($__rate_interval, $instance, ...) given concrete values, is a
recording rule in a file `promtool check rules` reads.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvcached.client import KvCacheClient
from kvcached_agent.address import BlockAddress
from kvcached_agent.agent import Agent
from tests.integration.conftest import ROOT, wait_for
from tests.integration.test_operations import free_tcp_port
from tests.integration.test_peers import Cluster, connected

DASHBOARD = ROOT / "deploy" / "grafana" / "kvcached.json"
DOCS = ROOT / "docs"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
KIB = 1 << 10

#: Queried by the dashboard but checked against docs/metrics.md alone (the module says why).
DOCS_ONLY = {"kvcached_nixl_pulled_bytes_total"}
#: Labels Prometheus adds to every series of a target: never in a daemon's own scrape.
TARGET_LABELS = {"instance", "job"}
#: Grafana's own variables, and a value each that PromQL accepts where the dashboard uses it.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}

# PromQL's vocabulary (prometheus/promql/parser): functions, aggregation operators, keywords.
FUNCTIONS = frozenset("""
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
    clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
    double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
    histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
    label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh
    time timestamp vector year""".split())
AGGREGATIONS = frozenset("avg bottomk count count_values group limit_ratio limitk max min quantile stddev stdvar "
                         "sum topk".split())
GROUPING = frozenset("by without on ignoring group_left group_right".split())
KEYWORDS = GROUPING | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}

TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-zA-Z]*)      # 0.99, 1e-9, and durations: 5m, 1h
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){}\[\],:@])
  | (?P<space>\s+)
""", re.VERBOSE)


@dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)    # (label, op, value)


@dataclass
class Query:
    where: str                         # the panel or variable, for messages
    expr: str                          # as the dashboard has it
    legend: str = ""
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)   # labels of by/without/on/ignoring/group_*
    label: str | None = None                          # label_values(..., label)


def substitute(expr: str, variables: set[str]) -> str:
    """The expression with Grafana's variables given values PromQL accepts: intervals for
    Grafana's own, ".*" for the dashboard's (they sit in regex matchers)."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in GRAFANA_VARIABLES:
            return GRAFANA_VARIABLES[name]
        assert name in variables, f"${name} is no variable of the dashboard: {expr}"
        return ".*"
    return re.sub(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))", value, expr)


def tokens(expr: str) -> list[tuple[str, str]]:
    out, at = [], 0
    while at < len(expr):
        m = TOKEN.match(expr, at)
        assert m is not None, f"the tokenizer does not know {expr[at:at + 20]!r} in {expr}"
        assert m.lastgroup is not None
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        at = m.end()
    return out


def closing(toks: list[tuple[str, str]], at: int, open_: str, close: str) -> int:
    """Index of the token closing the bracket at ``at``."""
    depth = 0
    for i in range(at, len(toks)):
        depth += (toks[i][1] == open_) - (toks[i][1] == close)
        if depth == 0:
            return i
    raise AssertionError(f"unbalanced {open_}{close}")


def unquote(text: str) -> str:
    return text[1:-1] if text.startswith("`") else str(ast.literal_eval(text))


def parse(query: Query) -> Query:
    """Fill in what ``query.expr`` (variables substituted) queries. Identifiers are metric names
    unless they are functions (followed by "("), aggregation operators or keywords; label names
    inside {...} and grouping clauses, and durations inside [...], are taken as such."""
    toks = tokens(query.expr)
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        after = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "ident" and text in GROUPING and after == "(":
            end = closing(toks, i + 1, "(", ")")
            query.grouping |= {t for k, t in toks[i + 2:end] if k == "ident"}
            i = end + 1
        elif kind == "ident" and (text in KEYWORDS or text in AGGREGATIONS):
            i += 1
        elif kind == "ident" and after == "(":
            assert text in FUNCTIONS, f"{query.where}: {text}() is no PromQL function"
            i += 1
        elif kind == "ident":
            selector = Selector(text)
            i += 1
            if after == "{":
                end = closing(toks, i, "{", "}")
                inner = [t for t in toks[i + 1:end] if t[1] != ","]
                assert len(inner) % 3 == 0, f"{query.where}: matchers {inner}"
                for label, op, value in zip(inner[::3], inner[1::3], inner[2::3]):
                    assert label[0] == "ident" and op[1] in ("=", "!=", "=~", "!~") and value[0] == "string", inner
                    selector.matchers.append((label[1], op[1], unquote(value[1])))
                i = end + 1
            query.selectors.append(selector)
        elif text == "{":
            raise AssertionError(f"{query.where}: a selector without a metric name: {query.expr}")
        elif text == "[":
            i = closing(toks, i, "[", "]") + 1          # a range or subquery: durations only
        else:
            i += 1
    return query


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queries(board: dict[str, Any]) -> list[Query]:
    """Every query of the dashboard, variables substituted, parsed."""
    variables = {v["name"] for v in board["templating"]["list"]}
    out = []
    for panel in all_panels(board["panels"]):
        for target in panel.get("targets", []):
            out.append(parse(Query(f"panel {panel['id']} ({panel['title']}) {target['refId']}",
                                   substitute(target["expr"], variables), target.get("legendFormat", ""))))
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\s*\)\s*", text)
        assert m, f"variable {var['name']}: only label_values(selector, label) is understood here: {text}"
        query = parse(Query(f"variable {var['name']}", substitute(m.group(1), variables)))
        query.label = m.group(2)
        out.append(query)
    return out


def documented() -> str:
    """The docs' text with `a_{b,c}_d` spelled out as `a_b_d a_c_d` (docs/security.md lists
    the tenant counters that way)."""
    text = "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    return re.sub(r"(\w*)\{(\w+(?:,\w+)+)\}(\w*)",
                  lambda m: " ".join(m.group(1) + x + m.group(3) for x in m.group(2).split(",")), text)


def mentions(text: str, metric: str) -> bool:
    """Whether ``text`` names ``metric`` (docs/metrics.md drops the kvcached_ prefix and lists a
    histogram by its family's name)."""
    base = metric.removeprefix("kvcached_")
    names = {base, re.sub(r"_(bucket|sum|count)$", "", base)}
    return any(re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", text.replace("kvcached_", "")) for n in names)


# ---------------------------------------------------------------------------------------------
# Without a daemon


def test_the_tokenizer_finds_metrics_labels_and_nothing_else() -> None:
    q = parse(Query("t", 'sum by (tier, le) (rate(a_bucket{tier="ram",x=~`r|s`}[5m] offset 1h)) / on (instance) '
                         "group_left (tenant) max without (job) (b_total) > bool 0.5 and c unless histogram_quantile("
                         '0.99, d[5m:1m]) or vector(1e-9) - count(e{y!="z"} == inf)'))
    assert [s.metric for s in q.selectors] == ["a_bucket", "b_total", "c", "d", "e"]
    assert q.selectors[0].matchers == [("tier", "=", "ram"), ("x", "=~", "r|s")]
    assert q.selectors[4].matchers == [("y", "!=", "z")]
    assert q.grouping == {"tier", "le", "instance", "tenant", "job"}
    with pytest.raises(AssertionError, match="no PromQL function"):
        parse(Query("t", "rat(x[5m])"))
    with pytest.raises(AssertionError, match="no variable"):
        substitute("x{a=~\"$nope\"}", {"instance"})
    assert substitute('rate(x{i=~"${instance}"}[$__rate_interval])', {"instance"}) == 'rate(x{i=~".*"}[1m])'


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "tenant"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"] == DATASOURCE
    panels = list(all_panels(board["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), "panel ids must be unique"
    shown = [p for p in panels if p["type"] != "row"]
    assert len(shown) >= 40
    taken: set[tuple[int, int]] = set()
    for p in panels:
        where = f"panel {p['id']} ({p.get('title')})"
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, where
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{where} overlaps another panel"
        taken |= cells
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, f"{where}: datasource is not the $datasource variable"
        assert p.get("description"), f"{where} says nothing of what it shows"
        assert p["targets"], f"{where} has no queries"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t.get("expr", "").strip(), f"{where} {t['refId']}: no expr"
            assert t.get("datasource", DATASOURCE) == DATASOURCE, f"{where} {t['refId']}"


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (make system-deps installs it)")
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for n, q in enumerate(queries(dashboard())):
        # a variable's label_values() is no PromQL, its selector is
        rules += [f"      - record: dashboard:query_{n}", f"        expr: {json.dumps(q.expr)}"]
    (tmp_path / "rules.yml").write_text("\n".join(rules) + "\n")
    r = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_every_metric_queried_is_documented() -> None:
    docs, metrics_md = documented(), (DOCS / "metrics.md").read_text()
    queried = {s.metric for q in queries(dashboard()) for s in q.selectors}
    undocumented = sorted(m for m in queried if not mentions(docs, m))
    assert not undocumented, f"queried by the dashboard, named in no doc: {undocumented}"
    missing = sorted(m for m in DOCS_ONLY if not mentions(metrics_md, m))
    assert not missing, f"checked against docs/metrics.md alone, and not there: {missing}"


# ---------------------------------------------------------------------------------------------
# Against a real scrape


def scrape(port: int) -> dict[str, list[dict[str, str]]]:
    """Sample name (as Prometheus stores it) -> the label sets of its samples."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def busy_node_b(tmp_path: Path, socket_dir: Path) -> tuple[Cluster, int, dict[str, Path]]:
    """node-a and node-b, peers; node-b with everything that exports metrics on loopback."""
    key = tmp_path / "tenants.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    cluster = Cluster(tmp_path, ("node-a", "node-b"))
    socks = {f"{node}-{t}": socket_dir / f"{node[-1]}-{t}.sock" for node in ("node-a", "node-b") for t in ("alice", "bob")}
    port = free_tcp_port()
    try:
        for node, extra in (("node-a", []), ("node-b", [
                f'metrics.listen="127.0.0.1:{port}"', "kv.ram_gib=0.0078125", "kv.max_block_mib=1",  # 8 MiB of RAM
                "kv.ssd_gib=0.0625", 'kv.write_policy="write_back"', "kv.curves=true", "kv.ssd_write_budget_gib=1",
                "kv.policy_save_s=1", f'events.endpoint="ipc://{socket_dir / "events"}"',
                "tenants.ram_shares={ alice = 0.5 }", "tenants.ssd_shares={ alice = 0.5 }"])):
            cluster.daemon(node, f'tenants.key_file="{key}"', "tenants.uids={ alice = [4242], bob = [4243] }",
                           f'tenants.sockets={{ alice = "{socks[node + "-alice"]}", bob = "{socks[node + "-bob"]}" }}',
                           *extra)
        a, b = cluster.daemons["node-a"], cluster.daemons["node-b"]
        wait_for(lambda: connected(a, "node-b") and connected(b, "node-a"), text="peers connected")
    except BaseException:
        cluster.stop()
        raise
    return cluster, port, socks


def test_every_metric_the_dashboard_queries_is_in_a_real_scrape(tmp_path: Path, socket_dir: Path) -> None:
    board = dashboard()
    wanted = queries(board)
    names = {s.metric for q in wanted for s in q.selectors} - DOCS_ONLY
    cluster, port, socks = busy_node_b(tmp_path, socket_dir)
    try:
        b = cluster.daemons["node-b"]
        pulled = [BlockAddress(os.urandom(32)) for _ in range(8)]
        with KvCacheClient(f"unix:{socks['node-a-alice']}") as alice_a:
            assert alice_a.put([(x, os.urandom(64 * KIB)) for x in pulled]).stored == 8
        with KvCacheClient(f"unix:{socks['node-b-alice']}") as alice, KvCacheClient(f"unix:{socks['node-b-bob']}") as bob:
            wait_for(lambda: alice.lookup([x.digest for x in pulled]).peer == 8, text="node-b learns alice's blocks")
            assert len(alice.get(pulled)[0]) == 8                               # pulled from node-a
            alice.get([BlockAddress(os.urandom(32))], allow_partial=True)        # a miss of every tier
            keys = [BlockAddress(i.to_bytes(4, "big") * 8) for i in range(48)]  # 12 MiB through 8 MiB of RAM
            for _ in range(2):
                for i in range(0, len(keys), 8):
                    bob.put([(x, bytes([i]) * (256 * KIB)) for x in keys[i:i + 8]])
                for i in range(0, len(keys), 4):                                 # RAM hits, SSD promotions
                    bob.get(keys[i:i + 4], allow_partial=True)
            # The curves sample one key in 8 at most, fewer when their CPU budget says so (a
            # loaded machine): a stream of 1,024 small blocks, used twice, gives them enough.
            stream = [BlockAddress(i.to_bytes(4, "big") * 8) for i in range(1 << 16, (1 << 16) + 1024)]
            for _ in range(2):
                for i in range(0, len(stream), 256):
                    bob.put([(x, bytes(4 * KIB)) for x in stream[i:i + 256]])
                    bob.get(stream[i:i + 256], allow_partial=True)
        with KvCacheClient(b.target, tenant="nobody") as nobody:                # the operator naming no tenant
            with pytest.raises(grpc.RpcError) as refused:
                nobody.lookup([os.urandom(32)])
            assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
        with Agent.connect(str(b.state / "agent.sock"), agent_id="engine", model="m", dtype="bf16", block_tokens=16,
                           num_layers=1, layer_block_bytes=4 * KIB, timeout=10) as agent:
            addresses = agent.addresses(agent.hash_tokens(list(range(32))))
            assert agent.save(addresses, [torch.full((4 * KIB,), 1, dtype=torch.uint8) for _ in addresses]).stored == 2
            agent.report_pinned([x.digest for x in addresses])
            assert agent.lookup([x.digest for x in addresses]).gpu == 2        # answered by its GPU blocks
            seen: dict[str, list[dict[str, str]]] = {}

            def complete() -> bool:       # the policy save, the curves' figures, write-back come in their time
                seen.clear()
                seen.update(scrape(port))
                return names <= seen.keys()

            try:
                wait_for(complete, timeout=20, text="every metric the dashboard queries")
            except AssertionError:
                pass                      # said below, metric by metric
        problems = check(wanted, seen)
    finally:
        cluster.stop()
    assert not problems, "\n".join(problems)


def check(wanted: list[Query], seen: dict[str, list[dict[str, str]]]) -> list[str]:
    """What in the dashboard's queries the scrape does not bear out."""
    problems = []
    for q in wanted:
        labels: set[str] = set(TARGET_LABELS)
        for s in q.selectors:
            if s.metric in DOCS_ONLY:
                continue
            samples = seen.get(s.metric)
            if not samples:
                problems.append(f"{q.where}: {s.metric} is not in the scrape")
                continue
            known = {k for sample in samples for k in sample}
            labels |= known | ({"le"} if s.metric.endswith("_bucket") else set())
            for label, op, value in s.matchers:
                if label in TARGET_LABELS:
                    continue
                if label not in known:
                    problems.append(f"{q.where}: {s.metric} has no label {label} (it has {sorted(known)})")
                elif op == "=" and not any(sample.get(label) == value for sample in samples):
                    problems.append(f"{q.where}: no {s.metric}{{{label}=\"{value}\"}} in the scrape")
                elif op == "=~" and not any(re.fullmatch(value, sample.get(label, "")) for sample in samples):
                    problems.append(f"{q.where}: no {s.metric}{{{label}=~\"{value}\"}} in the scrape")
        if all(s.metric in DOCS_ONLY for s in q.selectors) and q.selectors:
            continue
        for label in sorted(q.grouping - labels):
            problems.append(f"{q.where}: groups by {label}, a label none of its metrics has")
        if q.label is not None and q.label not in labels:
            problems.append(f"{q.where}: label_values of {q.label}, a label its metric does not have")
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", q.legend):
            if label not in labels:
                problems.append(f"{q.where}: the legend names {label}, a label none of its metrics has")
    return problems
