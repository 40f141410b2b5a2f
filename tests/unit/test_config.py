"""kvcached.config: defaults, the documented file, every kind of bad input, --set overrides."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvcached import config as cfg
from kvcached.config import Config, ConfigError, load_config, parse_duration, parse_listen

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILE = ROOT / "config" / "kvcached.toml"
GIB = 1 << 30
#: plenty of memory, so ram checks do not depend on the test machine
BIG = 1 << 40


def load(*overrides: str, path: str | Path | None = None, total_memory: int = BIG) -> Config:
    return load_config(path, overrides, total_memory=total_memory)


def config_error(*overrides: str, path: str | Path | None = None, total_memory: int = BIG) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path, total_memory=total_memory)
    text = str(info.value)
    assert "\n" not in text, text
    return info.value


def assert_error(exc: ConfigError, key: str, *words: str) -> None:
    text = str(exc)
    assert text.startswith(f"config: {key}: "), text
    assert exc.key == key
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvcached.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# defaults and the documented file


def test_defaults_load() -> None:
    config = load()
    assert config == Config()
    assert config.kv.ram_gib == 1.0
    assert config.ram_bytes == GIB
    assert config.max_block_bytes == 16 << 20
    assert config.kv.ram_policy == "slru" and config.kv.slru_ratio == 0
    assert config.kv.ssd_ttl == 7 * 86400.0
    assert config.kv.gone_ttl == 3600.0
    assert config.grpc.listen == ["unix:var/kvcached.sock"]
    assert [a.unix_path for a in config.listeners] == ["var/kvcached.sock"]
    assert config.quic.peers == []
    assert config.log.level == "info"


def test_defaults_do_not_share_lists() -> None:
    a, b = Config(), Config()
    a.grpc.listen.append("127.0.0.1:1")
    assert b.grpc.listen == ["unix:var/kvcached.sock"]


def _file_value(section: str, key: str, value: object) -> object:
    return parse_duration(value) if key.endswith("_ttl") else value


def test_file_lists_exactly_the_documented_keys_with_their_defaults() -> None:
    data = tomllib.loads(CONFIG_FILE.read_text())
    documented = cfg.documented_keys()
    assert list(data) == list(documented), "sections differ (or are in another order)"
    for section, keys in documented.items():
        assert set(data[section]) == set(keys), f"[{section}] keys differ"
        for key, (doc, default) in keys.items():
            assert doc, f"{section}.{key} has no doc"
            assert _file_value(section, key, data[section][key]) == default, f"{section}.{key}"


def test_every_schema_key_has_its_line_in_its_section() -> None:
    """Read as text too: each key is written out (not only inherited) under its own header,
    after at least one comment line in that section."""
    lines = CONFIG_FILE.read_text().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("[")]
    for section, keys in cfg.documented_keys().items():
        start = lines.index(f"[{section}]")
        end = next((h for h in headers if h > start), len(lines))
        block = lines[start + 1:end]
        assert block and block[0].startswith("#"), f"[{section}] starts without a comment"
        for key in keys:
            assert sum(line.startswith(f"{key} = ") for line in block) == 1, f"{section}.{key}"


def test_file_loads_to_the_defaults() -> None:
    assert load(path=CONFIG_FILE) == Config()


def test_every_key_can_be_set_from_a_file(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    text = f"""
[kv]
ram_gib = 2
max_block_mib = 4
ram_policy = "clock"
ssd_dir = "/d/ssd"
ssd_gib = 0
ssd_ttl = "90s"
index_dir = "/d/index"
mirror_pulls = false
gone_ttl = 60
[grpc]
listen = ["unix:/tmp/k.sock", "127.0.0.1:7400", "[::1]:7401"]
max_message_mib = 2047
grace_s = 0
[agent]
socket = "/tmp/a.sock"
[metrics]
listen = ""
[quic]
listen = "0.0.0.0:7500"
peers = [{{ name = "b", address = "10.0.0.2:7500" }}]
ca = "{ca}"
cert = "{ca}"
key = "{ca}"
[log]
level = "debug"
format = "json"
"""
    c = load(path=write(tmp_path, text))
    assert c.kv.ram_gib == 2.0 and isinstance(c.kv.ram_gib, float)
    assert c.max_block_bytes == 4 << 20
    assert c.kv.ssd_ttl == 90.0 and c.kv.gone_ttl == 60.0
    assert c.kv.mirror_pulls is False
    assert c.grpc.max_message_mib == 2047 and c.grpc.grace_s == 0.0
    assert [(a.unix_path, a.host, a.port) for a in c.listeners] == [
        ("/tmp/k.sock", None, None), (None, "127.0.0.1", 7400), (None, "[::1]", 7401)]
    assert all(a.is_loopback for a in c.listeners)
    assert c.quic.peers == [{"name": "b", "address": "10.0.0.2:7500"}]
    assert c.log.format == "json"


# ---------------------------------------------------------------------------------------------
# value parsers


@pytest.mark.parametrize("text, seconds", [
    (3600, 3600.0), (1.5, 1.5), ("90", 90.0), ("250ms", 0.25), ("90s", 90.0), ("15m", 900.0),
    ("24h", 86400.0), ("7d", 604800.0), ("2w", 1209600.0), (" 1.5h ", 5400.0), (0, 0.0),
])
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7x", "d", "-1", -1, True, None, "1 d 2h", [1]])
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("text, unix, host, port", [
    ("unix:var/k.sock", "var/k.sock", None, None),
    ("unix:///run/k.sock", "/run/k.sock", None, None),
    ("127.0.0.1:7400", None, "127.0.0.1", 7400),
    ("[::1]:0", None, "[::1]", 0),
    ("example.org:65535", None, "example.org", 65535),
])
def test_parse_listen(text: str, unix: str | None, host: str | None, port: int | None) -> None:
    a = parse_listen(text)
    assert (a.text, a.unix_path, a.host, a.port) == (text, unix, host, port)


@pytest.mark.parametrize("text", ["", "unix:", "unix://", "nohost", ":80", "host:", "host:99999", "host:-1",
                                  "host:http", "[::1:80", "unix:" + "x" * 200])
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(text)


# ---------------------------------------------------------------------------------------------
# bad keys and types


def test_unknown_section_hints(tmp_path: Path) -> None:
    exc = config_error(path=write(tmp_path, "[kvv]\nram_gib = 1\n"))
    assert_error(exc, "kvv", "unknown section", "did you mean 'kv'?")


def test_unknown_key_hints(tmp_path: Path) -> None:
    exc = config_error(path=write(tmp_path, "[kv]\nram_gb = 1\n"))
    assert_error(exc, "kv.ram_gb", "unknown key", "did you mean 'ram_gib'?", "max_block_mib")


def test_unknown_key_without_a_close_match() -> None:
    exc = config_error("kv.zzzzzz=1")
    assert_error(exc, "kv.zzzzzz", "unknown key")
    assert "did you mean" not in str(exc)


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    assert_error(config_error(path=write(tmp_path, "kv = 1\n")), "kv", "must be a table")


@pytest.mark.parametrize("override, key, words", [
    ('kv.ram_gib="1"', "kv.ram_gib", ("expected a number", "a string")),
    ("kv.ram_gib=true", "kv.ram_gib", ("expected a number", "a boolean")),
    ("kv.mirror_pulls=1", "kv.mirror_pulls", ("expected a boolean", "an integer")),
    ('kv.mirror_pulls="yes"', "kv.mirror_pulls", ("expected a boolean",)),
    ("grpc.max_message_mib=true", "grpc.max_message_mib", ("expected an integer", "a boolean")),
    ("grpc.max_message_mib=1.5", "grpc.max_message_mib", ("expected an integer", "a number")),
    ("kv.ssd_dir=3", "kv.ssd_dir", ("expected a string", "an integer")),
    ('grpc.listen="unix:x.sock"', "grpc.listen", ("expected a list",)),
    ("grpc.listen=[1]", "grpc.listen", ("list of strings",)),
    ('kv.prefetch_policy="eager"', "kv.prefetch_policy", ("wait_complete, best_effort, timeout",)),
    ("kv.prefetch_timeout_ms=0", "kv.prefetch_timeout_ms", ("greater than 0",)),
    ("quic.peers={}", "quic.peers", ("expected a list",)),
    ("kv.ssd_ttl=true", "kv.ssd_ttl", ("duration",)),
])
def test_wrong_type(override: str, key: str, words: tuple[str, ...]) -> None:
    assert_error(config_error(override), key, *words)


def test_wrong_type_in_a_file(tmp_path: Path) -> None:
    exc = config_error(path=write(tmp_path, '[kv]\nram_gib = "lots"\n'))
    assert_error(exc, "kv.ram_gib", "expected a number", "'lots'")


# ---------------------------------------------------------------------------------------------
# impossible values


@pytest.mark.parametrize("override, key, words", [
    ("kv.ram_gib=0", "kv.ram_gib", ("greater than 0",)),
    ("kv.ram_gib=-1", "kv.ram_gib", ("greater than 0",)),
    ("kv.max_block_mib=0", "kv.max_block_mib", ("greater than 0",)),
    ("kv.max_block_mib=0.001", "kv.max_block_mib", ("at least 4 KiB",)),
    ("kv.ssd_gib=-1", "kv.ssd_gib", ("0 or more",)),
    ("kv.ssd_ttl=-5", "kv.ssd_ttl", ("negative",)),
    ('kv.gone_ttl="soon"', "kv.gone_ttl", ("duration",)),
    ('kv.gone_ttl="1y"', "kv.gone_ttl", ("duration",)),
    ('kv.ram_policy="lru9"', "kv.ram_policy", ("unknown policy", "clock")),
    ('kv.ssd_policy="fifo"', "kv.ssd_policy", ("unknown policy", "s3fifo")),
    ("kv.slru_ratio=0.5", "kv.slru_ratio", ("0 (tuned online) or between 1 and 1000",)),
    ("kv.slru_ratio=5000", "kv.slru_ratio", ("between 1 and 1000",)),
    ('kv.slru_ratio="auto"', "kv.slru_ratio", ("number",)),
    ('kv.admission="twice"', "kv.admission", ("one of", "reuse")),
    ("kv.admission_threshold=0", "kv.admission_threshold", ("between 1 and 255",)),
    ("kv.admission_threshold=256", "kv.admission_threshold", ("between 1 and 255",)),
    ("kv.admission_window=10", "kv.admission_window", ("between 1000",)),
    ("kv.ssd_write_budget_gib=-1", "kv.ssd_write_budget_gib", ("0 or more",)),
    ('kv.write_policy="write_around"', "kv.write_policy", ("write_through_selective",)),
    ("kv.write_through_threshold=0", "kv.write_through_threshold", ("greater than 0",)),
    ("kv.policy_save_s=0.5", "kv.policy_save_s", ("0 (save on a clean stop only)",)),
    ("kv.hash_threads=-1", "kv.hash_threads", ("0 (one per CPU, 16 at most)", "256")),
    ("kv.hash_threads=300", "kv.hash_threads", ("256",)),
    ("grpc.max_message_mib=0", "grpc.max_message_mib", ("1..2047",)),
    ("grpc.max_message_mib=2048", "grpc.max_message_mib", ("1..2047",)),
    ("grpc.grace_s=-1", "grpc.grace_s", ("0 or more",)),
    ('grpc.listen=["unix:"]', "grpc.listen", ("empty Unix socket path",)),
    ('grpc.listen=["host:99999"]', "grpc.listen", ("port out of range",)),
    ('grpc.listen=["nohost"]', "grpc.listen", ("HOST:PORT",)),
    ("grpc.listen=[]", "grpc.listen", ("at least one",)),
    ('grpc.listen=["unix:a.sock", "unix:a.sock"]', "grpc.listen", ("same listener twice",)),
    ('metrics.listen="unix:m.sock"', "metrics.listen", ("not a Unix socket",)),
    ('metrics.listen="nohost"', "metrics.listen", ("HOST:PORT",)),
    ('quic.listen="0.0.0.0:99999"', "quic.listen", ("port out of range",)),
    ("quic.max_datagram_size=1000", "quic.max_datagram_size", ("between 1200", "1000")),
    ("quic.max_datagram_size=65000", "quic.max_datagram_size", ("16000", "65000")),
    ("quic.max_data_mib=0", "quic.max_data_mib", ("between 0.0625 and 1024",)),
    ("quic.max_stream_data_mib=4096", "quic.max_stream_data_mib", ("between 0.0625 and 1024",)),
    ("quic.pull_timeout_s=0", "quic.pull_timeout_s", ("between 0.01 and 300",)),
    ("quic.hedge_ms=-1", "quic.hedge_ms", ("0 or more",)),
    ("quic.fail_limit=0", "quic.fail_limit", ("between 1 and 1000",)),
    ("quic.backoff_s=0", "quic.backoff_s", ("greater than 0",)),
    ('quic.pull_timeout_s="2s"', "quic.pull_timeout_s", ()),
    ('quic.retry="sometimes"', "quic.retry", ("always, under_load", "'sometimes'")),
    ('quic.lane="plain"', "quic.lane", ("tls, mac, quic", "'plain'")),
    ("quic.lane_stripes=0", "quic.lane_stripes", ("between 1 and 16",)),
    ("quic.lane_stripes=17", "quic.lane_stripes", ("between 1 and 16",)),
    ("quic.lane=1", "quic.lane", ()),
    ('quic.nixl_transports=["tcp;rm -rf"]', "quic.nixl_transports", ("UCX transport names", "'tcp;rm -rf'")),
    ('quic.nixl_transports="tcp"', "quic.nixl_transports", ()),
    ("quic.nixl_hold_s=0", "quic.nixl_hold_s", ("between 0.1 and 300",)),
    ('quic.nixl="yes"', "quic.nixl", ()),
    ("quic.max_handshakes=0", "quic.max_handshakes", ("between 1 and 65536",)),
    ("quic.max_handshakes_per_source=70000", "quic.max_handshakes_per_source", ("between 1 and 65536",)),
    ("quic.max_connections=0", "quic.max_connections", ("between 1 and 1048576",)),
    ("quic.handshake_timeout_s=0", "quic.handshake_timeout_s", ("greater than 0",)),
    ("quic.stateless_replies_per_s=-1", "quic.stateless_replies_per_s", ("greater than 0",)),
    ("grpc.max_batch=0", "grpc.max_batch", ("between 1 and 65536",)),
    ("grpc.batch_slice=70000", "grpc.batch_slice", ("between 1 and 65536",)),
    ("grpc.lookup_slice=0", "grpc.lookup_slice", ("between 1 and 65536",)),
    ('log.level="verbose"', "log.level", ("debug, info, warning, error", "'verbose'")),
    ('log.format="xml"', "log.format", ("text, json",)),
])
def test_impossible_value(override: str, key: str, words: tuple[str, ...]) -> None:
    assert_error(config_error(override), key, *words)


def test_quic_backoff_max_below_backoff() -> None:
    exc = config_error("quic.backoff_s=10", "quic.backoff_max_s=5")
    assert_error(exc, "quic.backoff_max_s", "less than quic.backoff_s = 10")


def test_ram_bigger_than_the_machine() -> None:
    exc = config_error("kv.ram_gib=8", total_memory=4 * GIB)
    assert_error(exc, "kv.ram_gib", "more than this machine's memory", "4.0 GiB")
    assert load("kv.ram_gib=2", total_memory=4 * GIB).ram_bytes == 2 * GIB


def test_ram_checked_against_real_memory_when_none_is_passed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["kv.ram_gib=1000000"])
    assert_error(info.value, "kv.ram_gib", "machine's memory")


def test_max_block_bigger_than_ram() -> None:
    exc = config_error("kv.ram_gib=0.01", "kv.max_block_mib=16")
    assert_error(exc, "kv.max_block_mib", "does not fit in kv.ram_gib")
    assert load("kv.ram_gib=0.015625", "kv.max_block_mib=16").max_block_bytes == 16 << 20


@pytest.mark.parametrize("override", ["kv.ram_gib=inf", "kv.ram_gib=nan", "kv.max_block_mib=nan",
                                      "kv.gone_ttl=nan", "grpc.grace_s=nan"])
def test_non_finite_number(override: str) -> None:
    key = override.partition("=")[0]
    assert_error(config_error(override), key)


@pytest.mark.parametrize("name", ["ca", "cert", "key"])
def test_quic_needs_tls_files(tmp_path: Path, name: str) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    files = {n: f'quic.{n}="{pem}"' for n in ("ca", "cert", "key") if n != name}
    exc = config_error('quic.listen="0.0.0.0:7500"', *files.values())
    assert_error(exc, f"quic.{name}", "required when quic.listen or quic.peers is set")


def test_quic_peers_alone_need_tls_files() -> None:
    exc = config_error('quic.peers=[{name="b", address="10.0.0.2:7500"}]')
    assert_error(exc, "quic.ca", "required")


def test_quic_ca_missing_file(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    missing = tmp_path / "nope.pem"
    exc = config_error('quic.listen="0.0.0.0:7500"', f'quic.ca="{missing}"', f'quic.cert="{pem}"', f'quic.key="{pem}"')
    assert_error(exc, "quic.ca", "no such file", str(missing))


def test_tls_files_ignored_without_quic(tmp_path: Path) -> None:
    assert load(f'quic.ca="{tmp_path / "nope.pem"}"').quic.ca.endswith("nope.pem")


@pytest.mark.parametrize("peers, words", [
    ('["b"]', ("entry 0", "must be a table")),
    ('[{name="b"}]', ("entry 0", "must be a table")),
    ('[{name="b", address="h:1", x=1}]', ("entry 0",)),
    ('[{name="", address="h:1"}]', ("entry 0", "name must be a non-empty string")),
    ('[{name=1, address="h:1"}]', ("entry 0", "name")),
    ('[{name="b", address="h:1"}, {name="b", address="h:2"}]', ("'b' appears twice",)),
    ('[{name="b", address=""}]', ("entry 0", "address must be HOST:PORT")),
    ('[{name="b", address="unix:x.sock"}]', ("not a Unix socket",)),
    ('[{name="b", address="h:99999"}]', ("port out of range",)),
    ('[{name="b", address="nohost"}]', ("HOST:PORT",)),
    ('[{name="b", address=7}]', ("HOST:PORT",)),
])
def test_bad_peers(peers: str, words: tuple[str, ...]) -> None:
    assert_error(config_error(f"quic.peers={peers}"), "quic.peers", *words)


def test_peer_address_of_the_wrong_type_is_named() -> None:
    exc = config_error('quic.peers=[{name="b", address=7}]')
    assert_error(exc, "quic.peers", "entry 0", "7")
    assert "unix:" not in str(exc)


@pytest.mark.parametrize("listen", ['["unix:var/agent.sock"]', '["127.0.0.1:1", "unix:///x/agent.sock"]'])
def test_agent_socket_equal_to_a_grpc_listener(listen: str) -> None:
    socket = "var/agent.sock" if "var/" in listen else "/x/agent.sock"
    exc = config_error(f"grpc.listen={listen}", f'agent.socket="{socket}"')
    assert_error(exc, "agent.socket", "also a gRPC listener")


def test_agent_socket_equal_to_a_grpc_listener_spelt_differently() -> None:
    exc = config_error('grpc.listen=["unix:var/x.sock"]', 'agent.socket="./var/x.sock"')
    assert_error(exc, "agent.socket", "also a gRPC listener")


# ---------------------------------------------------------------------------------------------
# --set overrides


def test_set_is_parsed_as_toml() -> None:
    c = load("kv.ram_gib=2", 'grpc.listen=["unix:var/k.sock"]', "kv.mirror_pulls=false", "grpc.max_message_mib=8",
             'quic.peers=[]', "kv.ssd_ttl=60")
    assert c.kv.ram_gib == 2.0 and isinstance(c.kv.ram_gib, float)
    assert c.grpc.listen == ["unix:var/k.sock"]
    assert c.kv.mirror_pulls is False
    assert c.grpc.max_message_mib == 8
    assert c.kv.ssd_ttl == 60.0


def test_set_bare_word_is_a_string() -> None:
    c = load("kv.ssd_dir=var/x", "log.level=debug", "kv.gone_ttl=2h", "kv.index_dir=a=b")
    assert c.kv.ssd_dir == "var/x"
    assert c.log.level == "debug"
    assert c.kv.gone_ttl == 7200.0
    assert c.kv.index_dir == "a=b"


def test_set_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[kv]\nram_gib = 3\nssd_gib = 1\n")
    c = load("kv.ram_gib=2", "log.level=\"warning\"", path=path)
    assert (c.kv.ram_gib, c.kv.ssd_gib, c.log.level) == (2.0, 1.0, "warning")


def test_set_last_wins() -> None:
    assert load("kv.ram_gib=2", "kv.ram_gib=3").kv.ram_gib == 3.0


@pytest.mark.parametrize("override, key", [
    ("kv.ram_gib", "kv.ram_gib"),
    ("ramgib=1", "ramgib"),
    ("=1", "=1"),
    (".ram_gib=1", ".ram_gib"),
    ("kv.=1", "kv."),
])
def test_malformed_set(override: str, key: str) -> None:
    assert_error(config_error(override), key, "--set expects section.key=value")


def test_set_checks_like_the_file() -> None:
    assert_error(config_error("kvv.ram_gib=1"), "kvv", "unknown section", "did you mean 'kv'?")
    assert_error(config_error("kv.ram_gb=1"), "kv.ram_gb", "did you mean 'ram_gib'?")
    assert_error(config_error("kv.ram_gib=abc"), "kv.ram_gib", "expected a number", "'abc'")


def test_set_into_a_section_that_is_not_a_table(tmp_path: Path) -> None:
    assert_error(config_error("kv.ram_gib=1", path=write(tmp_path, "kv = 1\n")), "kv", "must be a table")


# ---------------------------------------------------------------------------------------------
# the file itself


def test_toml_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[kv]\nram_gib = = 1\n")
    exc = config_error(path=path)
    assert_error(exc, str(path), "not valid TOML", "line 2")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    assert_error(config_error(path=path), str(path), "no such file")


def test_as_mapping() -> None:
    m = cfg.as_mapping(Config())
    assert m["kv"]["ram_gib"] == 1.0 and m["grpc"]["listen"] == ["unix:var/kvcached.sock"]


@pytest.mark.parametrize("override, key", [('kv.index_dir=""', "kv.index_dir"), ('kv.ssd_dir=" "', "kv.ssd_dir"),
                                           ('agent.socket=" "', "agent.socket")])
def test_empty_paths_are_refused(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"^config: {key}: must be a path, got an empty string$"):
        load_config(None, [override])


def test_agent_socket_may_be_disabled() -> None:
    assert load_config(None, ['agent.socket=""']).agent.socket == ""


@pytest.mark.parametrize("override, key, problem", [
    ('agent.mode="rw-rw----"', "agent.mode", "octal permission bits"),
    ('agent.mode="0999"', "agent.mode", "octal permission bits"),
    ("agent.mode=660", "agent.mode", "string"),
    ("agent.heartbeat_s=0", "agent.heartbeat_s", "between 0.05 and 3600"),
    ("agent.max_agents=0", "agent.max_agents", "between 1 and 65536"),
    ("agent.max_gpu_blocks=-1", "agent.max_gpu_blocks", "between 1 and 100000000"),
    ('agent.socket="/tmp/' + "x" * 120 + '.sock"', "agent.socket", "too long"),
])
def test_bad_agent_keys(override: str, key: str, problem: str) -> None:
    assert_error(config_error(override), key, problem)


@pytest.mark.parametrize("overrides, key, problem", [
    (['grpc.socket_mode="0999"'], "grpc.socket_mode", "octal permission bits"),
    (['grpc.read_only_listen=["unix:var/ro.sock"]'], "grpc.read_only_listen", "TCP listeners only"),
    (['grpc.read_only_listen=["127.0.0.1:1", "127.0.0.1:1"]'], "grpc.read_only_listen", "twice"),
    (["grpc.tls=true", 'grpc.tls_cert="/nonexistent/c.pem"', 'grpc.tls_key="/nonexistent/k.pem"',
      'grpc.tls_ca="/nonexistent/ca.pem"'], "grpc.tls_cert", "no such readable file: /nonexistent/c.pem"),
    (['grpc.listen=["unix:var/a.sock", "10.1.2.3:7401"]'], "grpc.listen", "plaintext gRPC on the non-loopback"),
    (['grpc.health_listen="unix:var/h.sock"'], "grpc.health_listen", "not a Unix socket"),
    (['kv.arena="shm"'], "kv.arena", "memfd, file"),
    (['kv.arena_dir=""'], "kv.arena_dir", "must be a path"),
    (['agent.socket="var/a.sock"', 'tenants.agent_sockets={ alice = "var/a.sock" }'], "tenants.agent_sockets.alice",
     "also the agent socket"),
    (['tenants.sockets={ alice = "var/t.sock" }', "tenants.uids={ alice = [1001] }",
      'tenants.agent_sockets={ alice = "var/t.sock" }'], "tenants.agent_sockets.alice", "tenant's gRPC socket"),
    (['tenants.agent_sockets={ alice = "var/a.sock", bob = "var/a.sock" }'], "tenants.agent_sockets", "var/a.sock"),
    (['tenants.agent_sockets={ "Al ice" = "var/a.sock" }'], "tenants.agent_sockets", "tenant name"),
])
def test_bad_grpc_security_keys(overrides: list[str], key: str, problem: str) -> None:
    assert_error(config_error(*overrides), key, problem)


def test_agent_mode_bits() -> None:
    assert load_config(None, ['agent.mode="0600"']).agent.mode_bits == 0o600
    assert load_config(None, ['agent.mode="640"']).agent.mode_bits == 0o640


# -- [cluster] ------------------------------------------------------------------------------------

def _quic(tmp_path: Path, listen: str = "127.0.0.1:7500") -> list[str]:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    return [f'quic.listen="{listen}"', f'quic.ca="{pem}"', f'quic.cert="{pem}"', f'quic.key="{pem}"']


def test_a_cluster_member_loads(tmp_path: Path) -> None:
    c = load(*_quic(tmp_path), 'cluster.etcd=["10.0.0.9:2379", "10.0.0.10:2379"]', 'cluster.name="node-a"').cluster
    assert c.etcd == ["10.0.0.9:2379", "10.0.0.10:2379"] and c.name == "node-a"
    assert (c.lease_s, c.replicas, c.placement_bits, c.prefix) == (10, 2, 18, "/kvcached")


@pytest.mark.parametrize("overrides, key, words", [
    (['cluster.etcd=["e:2379"]'], "quic.listen", ("required when cluster.etcd is set",)),
    (['cluster.etcd=["e:2379"]', "QUIC"], "cluster.name", ("required",)),
    (['cluster.etcd=["e:2379"]', 'cluster.name="a"', 'quic.peers=[{name="b", address="h:1"}]', "QUIC"],
     "cluster.etcd", ("either quic.peers", "not both")),
    (['cluster.etcd=["e:2379"]', 'cluster.name="a"', "WILDCARD"], "cluster.advertise", ("wildcard",)),
    (['cluster.etcd=["e:2379"]', 'cluster.name="a"', 'cluster.etcd_cert="/etc/hosts"', "QUIC"], "cluster.etcd_ca",
     ("go together",)),
    (['cluster.etcd=["e:2379"]', 'cluster.name="a"', 'cluster.etcd_ca="/nope.pem"', "QUIC"], "cluster.etcd_ca",
     ("no such readable file",)),
    (['cluster.etcd=["unix:/x"]'], "cluster.etcd", ("entry 0", "not a Unix socket")),
    (['cluster.etcd=[7]'], "cluster.etcd", ("entry 0", "HOST:PORT")),
    (['cluster.name="a/b"'], "cluster.name", ("certificate name",)),
    (['cluster.prefix="kvcached"'], "cluster.prefix", ("starting with '/'",)),
    (["cluster.lease_s=1"], "cluster.lease_s", ("between 2 and 300",)),
    (["cluster.replicas=9"], "cluster.replicas", ("between 1 and 8",)),
    (["cluster.placement_bits=30"], "cluster.placement_bits", ("between 8 and 24",)),
])
def test_bad_cluster_settings(tmp_path: Path, overrides: list[str], key: str, words: tuple[str, ...]) -> None:
    expanded: list[str] = []
    for item in overrides:
        expanded += _quic(tmp_path) if item == "QUIC" else _quic(tmp_path, "0.0.0.0:7500") if item == "WILDCARD" else [item]
    if key == "quic.listen":
        expanded += ['cluster.name="a"']
    assert_error(config_error(*expanded), key, *words)
