"""kvcached.tenants without a daemon: who a process is (uid, then gid, then the default), the
addresses each tenant's digests map to, the key file, the [tenants] settings refused, and the
agent session's mapping of every message that names digests (issue 41, docs/security.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcached.api.agent_session import scoped
from kvcached.config import ConfigError, load_config, to_toml
from kvcached.store.results import TenantTally
from kvcached.tenants import DEFAULT, TenantMap, ram_shares, tenants_for
from kvcached.tenants.keyfile import load_key
from kvcached_agent import protocol as p

SECRET = bytes(range(32))
D1, D2 = b"\x01" * 32, b"\x02" * 32


def test_a_process_is_its_uids_tenant_else_its_gids_else_the_default() -> None:
    m = TenantMap(SECRET, uids={"alice": [1001], "bob": [1002]}, gids={"ml": [2000]})
    assert [m.resolve(uid, gid).name for uid, gid in ((1001, 2000), (1002, 1), (5, 2000), (5, 5))] == [  # type: ignore[union-attr]
        "alice", "bob", "ml", DEFAULT]
    assert TenantMap(SECRET, default="").resolve(5, 5) is None, "no default: refused"
    assert TenantMap(SECRET, default="guests").resolve(5, 5).name == "guests"  # type: ignore[union-attr]
    assert m.names == ["alice", "bob", "default", "ml"]


def test_each_tenant_has_addresses_of_its_own_and_the_default_keeps_the_digests() -> None:
    m = TenantMap(SECRET, uids={"alice": [1], "bob": [2]})
    alice, bob, default = (m.resolve(u, 0).scope for u in (1, 2, 3))     # type: ignore[union-attr]
    assert default.identity and default.digest(D1) == D1 and default.digests([D1, D2]) == [D1, D2]
    a, b = alice.digest(D1), bob.digest(D1)
    assert len({a, b, D1}) == 3 and len(a) == 32, "the same tokens are three blocks"
    assert alice.digest(D1) == a and alice.digests([D1, D2])[0] == a, "stable"
    again = TenantMap(SECRET, uids={"alice": [9]}).resolve(9, 0)
    assert again is not None and again.scope.digest(D1) == a, "the same key and name give the same addresses (a cluster)"
    other = TenantMap(bytes(32), uids={"alice": [1]}).resolve(1, 0)
    assert other is not None and other.scope.digest(D1) != a, "without the key, nobody computes alice's addresses"
    with pytest.raises(ValueError, match="not 32"):
        TenantMap(b"short")


def test_every_message_that_names_digests_is_mapped_and_no_other() -> None:
    scope = TenantMap(SECRET, uids={"alice": [1]}).resolve(1, 0).scope    # type: ignore[union-attr]
    s1 = scope.digest(D1)
    assert scoped(p.Allocate([(D1, 3, 4096)]), scope) == p.Allocate([(s1, 3, 4096)])
    assert scoped(p.Load([(D1, 3)]), scope) == p.Load([(s1, 3)])
    assert scoped(p.Lookup(3, [D1]), scope) == p.Lookup(3, [s1])
    assert scoped(p.Present(3, [D1]), scope) == p.Present(3, [s1])
    for kind in (p.Overlap, p.Pinned, p.Evicted):
        assert scoped(kind([D1]), scope) == kind([s1])
    assert scoped(p.Route([(D1, 3, b"keys")]), scope) == p.Route([(s1, 3, b"keys")])
    for message in (p.Commit([1]), p.Release([1]), p.Heartbeat()):
        assert scoped(message, scope) is message


def test_the_key_file_is_made_once_private_and_checked(tmp_path: Path) -> None:
    path = str(tmp_path / "tenants.key")
    key = load_key(path)
    assert len(key) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert load_key(path) == key, "never rewritten"
    os.chmod(path, 0o640)
    with pytest.raises(OSError, match="others may read"):
        load_key(path)
    os.chmod(path, 0o600)
    Path(path).write_bytes(b"x" * 31)
    with pytest.raises(OSError, match="not a 32-byte tenant key"):
        load_key(path)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(OSError):
        load_key(str(link))


def test_the_tenants_settings(tmp_path: Path) -> None:
    config = load_config(overrides=[f'kv.index_dir="{tmp_path}"', "tenants.uids={ alice = [1001], bob = [1002, 1003] }",
                                    "tenants.gids={ ml-team = [2000] }", 'tenants.default=""'])
    assert config.tenants.uids == {"alice": [1001], "bob": [1002, 1003]} and config.tenants.default == ""
    assert load_config(overrides=[f'kv.index_dir="{tmp_path}"']).tenants.default == DEFAULT, "upgrading keeps all"
    (tmp_path / "written.toml").write_text(to_toml(config, redact=False))
    assert load_config(tmp_path / "written.toml").tenants == config.tenants, "written as it reads back"
    assert tenants_for(config).resolve(1003, 0).name == "bob"    # type: ignore[union-attr]
    assert (tmp_path / "tenants.key").exists(), "made in kv.index_dir"
    for overrides, says in ((["tenants.uids={ alice = [1], bob = [1] }"], "1 is mapped twice"),
                            (["tenants.gids={ a = [2], b = [3, 2] }"], "2 is mapped twice"),
                            (['tenants.uids={ Alice = [1] }'], "tenant name"),
                            (['tenants.uids={ "a.b" = [1] }'], "tenant name"),
                            (["tenants.uids={ alice = [] }"], "non-empty list"),
                            (['tenants.uids={ alice = ["1001"] }'], "non-empty list of integers"),
                            (["tenants.uids={ alice = [4294967295] }"], "is not an id"),
                            (["tenants.uids=[1]"], "expected a table"),
                            (['tenants.default="Bad Name"'], "tenant name"),
                            (['tenants.sockets={ alice = "/run/a.sock" }'], "named by no uid or gid"),
                            (["tenants.uids={ alice = [1] }", 'tenants.sockets={ alice = "/run/a.sock" }',
                              'agent.socket="/run/a.sock"'], "also the agent socket or a gRPC listener"),
                            (["tenants.uids={ a = [1], b = [2] }", 'tenants.sockets={ a = "/r/x.sock", b = "/r/x.sock" }'],
                             "socket /r/x.sock is mapped twice: to a and to b"),
                            (['tenants.sockets={ a = 3 }'], "expected a Unix socket path"),
                            (['tenants.certs={ alice = ["eng"] }'], "only with grpc.tls = true"),
                            (['tenants.certs={ a = ["x"], b = ["y", "x"] }'], "'x' is mapped twice"),
                            (['tenants.certs={ a = [] }'], "non-empty list of certificate names"),
                            (['tenants.cert_field="dn"'], "must be one of san, cn"),
                            (["tenants.operators=[1]"], "a list of certificate names"),
                            (["tenants.uids={ a = [1] }", 'tenants.events={ a = "tcp://127.0.0.1:5557" }'],
                             "is not ipc://PATH"),
                            (['tenants.events={ a = "ipc:///r/a" }'], "its stream would admit no one"),
                            (["tenants.uids={ a = [1] }", 'tenants.events={ a = "ipc:///r/a" }',
                              'events.endpoint="ipc:///r/a"'], "also events.endpoint"),
                            (["tenants.uids={ a = [1], b = [2] }", 'tenants.events={ a = "ipc:///r/a", b = "ipc:///r/a" }'],
                             "mapped twice"),
                            (["tenants.uids={ a = [1] }", 'tenants.event_replays={ a = "ipc:///r/b" }'],
                             "has no stream to replay"),
                            (["tenants.uids={ a = [1] }", 'tenants.events={ a = "ipc:///r/a" }',
                              'tenants.event_replays={ a = "ipc:///r/a" }'], "also another events endpoint"),
                            (["tenants.ram_shares={ ghost = 0.5 }"], "no tenant called ghost is configured"),
                            (["tenants.uids={ a = [1], b = [2] }", "tenants.ram_shares={ a = 0.6, b = 0.5 }"],
                             "more than the RAM tier's"),
                            (["tenants.uids={ a = [1] }", "tenants.ram_shares={ a = 1.5 }"], "a fraction of the tier"),
                            (["tenants.uids={ a = [1] }", 'tenants.ram_shares={ a = "half" }'], "a fraction of the tier"),
                            (["tenants.uids={ " + ", ".join(f"t{n} = [{n}]" for n in range(254)) + " }"],
                             "254 tenants are configured; each has a RAM arena")):
        with pytest.raises(ConfigError, match=says):
            load_config(overrides=overrides)


def test_the_tenants_arenas_must_fit_the_address_space() -> None:
    """Each tenant's arena is the RAM tier's size in address space (kvcached.tiers.arenas): 21
    arenas of 4 TiB would not fit beside each other in a process (a node with that much memory
    is refused at load; this one is checked as such a node would be)."""
    import dataclasses

    from kvcached import config as config_module
    config = load_config(overrides=["tenants.uids={ " + ", ".join(f"t{n} = [{n}]" for n in range(20)) + " }"])
    big = dataclasses.replace(config, kv=dataclasses.replace(config.kv, ram_gib=4096.0))
    with pytest.raises(ConfigError, match="21 tenants' arenas of 4096 GiB each take 84 TiB of address space"):
        config_module._check_tenants(big, [])


def test_shares_are_fractions_or_bytes_of_the_ram_tier(tmp_path: Path) -> None:
    config = load_config(overrides=["kv.ram_gib=1", "tenants.uids={ alice = [1] }",
                                    "tenants.ram_shares={ alice = 0.25, default = 1048576 }"])
    assert ram_shares(config, 1 << 30) == {"alice": 1 << 28, "": 1 << 20}, "the default tenant's tag is empty"
    same = load_config(overrides=["tenants.uids={ a = [1], b = [2] }", "tenants.ram_shares={ a = 100, b = 100 }"])
    assert same.tenants.ram_shares == {"a": 100, "b": 100}, "two tenants may have the same share"


def test_certificates_and_operators_need_mutual_tls_and_name_no_one_twice(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    tls = ["grpc.tls=true", f'grpc.tls_cert="{cert}"', f'grpc.tls_key="{cert}"', f'grpc.tls_ca="{cert}"']
    config = load_config(overrides=[*tls, 'tenants.certs={ alice = ["eng"] }', 'tenants.operators=["root-ops"]'])
    tenants = TenantMap(bytes(32), certs=config.tenants.certs)
    assert tenants.by_certificate(["other", "eng"]).name == "alice"          # type: ignore[union-attr]
    assert tenants.by_certificate(["other"]).name == DEFAULT, "unmapped: the default tenant"  # type: ignore[union-attr]
    assert TenantMap(bytes(32), default="", certs={"a": ["x"]}).by_certificate(["y"]) is None
    assert tenants.several and not TenantMap(bytes(32)).several
    for overrides, says in (([*tls, 'tenants.operators=["ops"]'], "applies when tenants.certs is set"),
                            ([*tls, 'tenants.certs={ a = ["x"] }', 'tenants.operators=["x"]'], "also tenant a's")):
        with pytest.raises(ConfigError, match=says):
            load_config(overrides=overrides)


def test_the_tally_counts_by_tenant_only_where_tenants_are_counted() -> None:
    tally = TenantTally(on=True)
    tally.put("alice", 4096 * 3, 3)
    tally.read("alice", 2, 8192, 1)
    tally.read("", 0, 0, 4)
    assert (tally.of("alice").puts, tally.of("alice").put_bytes, tally.of("alice").hits, tally.of("").misses) == \
        (3, 12288, 2, 4)
    off = TenantTally()
    off.put("alice", 1)
    assert off.by == {}, "nothing kept where one tenant is all there is"


def test_every_admin_call_is_one_the_operator_guard_wraps() -> None:
    """kvcached.api.access.OperatorOnly guards unary Admin calls; a streaming one would pass it
    unguarded, so adding one must come with a guard for it."""
    from kvcached.v1 import kvcache_pb2

    methods = kvcache_pb2.DESCRIPTOR.services_by_name["Admin"].methods
    assert methods and all(not m.client_streaming and not m.server_streaming for m in methods)


def test_a_scope_remembers_the_addresses_it_mapped_last_and_forgets_them_all_at_its_bound() -> None:
    from kvcached.tenants.identity import REMEMBERED, Scope
    key = os.urandom(32)
    scope, fresh = Scope(key), Scope(key)
    digests = [i.to_bytes(32, "big") for i in range(REMEMBERED + 10)]
    first = [scope.digest(d) for d in digests]               # past the bound: forgotten once, then refilled
    assert first == [Scope(key).digest(d) for d in digests] == list(fresh.digests(digests))
    assert [scope.digest(d) for d in reversed(digests)] == first[::-1], "remembered or not, the same address"
    assert Scope(None).digest(digests[0]) == digests[0]
