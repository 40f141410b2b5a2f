"""The Helm charts of deploy/helm (issue 62), rendered by Helm's own template engine and checked.

- **Rendering and lint**: helm-python-sdk binds Helm v4's Go SDK (libhelm_c), so the charts are
  rendered, linted and their values.schema.json applied as `helm template` and `helm lint` do, with
  no helm binary. Each chart is rendered with its defaults and with each value set of its ci/.
- **Kubernetes versions**: every rendered object is validated against the Kubernetes API's own
  JSON schemas (kubernetes-validate, strict: an unknown field fails) for the oldest Kubernetes
  the charts support (1.29, their Chart.yaml kubeVersion) and the newest the validator ships, each
  rendered as for that version (.Capabilities.KubeVersion, and the APIs such a cluster serves).
- **The daemon's configuration**: the kvcached.toml each value set renders is loaded by the
  daemon's own loader (kvcached.config.load_config) with the container's --set arguments, so a
  key the chart writes that the daemon does not know, or a value it refuses, fails here. The
  paths it names are checked against the pod's volumes, and the engine chart against the daemon's.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from helm_python import _native
from kubernetes_validate.utils import latest_version, major_minor

from kvcached.config import SECTIONS, load_config
from kvcached.peers.certs import make_cluster
from kvcached.tiers.slabs import SlabAllocator
from kvcached.tiers.slot_directory import SlotDirectory
from kvcached_agent.engines.common import DEFAULT_SOCKET, PluginSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvcached"
ENGINE_CHART = ROOT / "deploy" / "helm" / "kvcached-engine"
RELEASE, NAMESPACE = "kvcached", "kvcached"

OLDEST = "1.29"                                   # Chart.yaml: kubeVersion >=1.29.0-0
NEWEST = major_minor(latest_version())            # 1.37 with kubernetes-validate 1.37.0
VAP = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
# The kind-qualified APIs a cluster of each version serves that the charts ask about. Offline,
# Helm's default capabilities list group/versions only (ValidatingAdmissionPolicy is then absent,
# as with `helm template` without --api-versions); 1.29 served it as v1beta1 only.
SERVED = {OLDEST: [], NEWEST: [VAP, "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding"]}
VERSIONS = [OLDEST, NEWEST]

NODE, POD_IP = "gpu-node-1", "10.1.2.3"           # what the downward API gives one pod
MiB = 1 << 20


def value_sets(chart: Path) -> list[str]:
    return ["defaults"] + sorted(p.stem for p in (chart / "ci").glob("*.yaml"))


def values_of(chart: Path, name: str) -> dict[str, Any]:
    return {} if name == "defaults" else yaml.safe_load((chart / "ci" / f"{name}.yaml").read_text()) or {}


def render(chart: Path, values: dict[str, Any], version: str, *, api_versions: list[str] | None = None,
           namespace: str = NAMESPACE) -> dict[str, str]:
    """The chart's templates rendered as for Kubernetes ``version``. helm-python-sdk 0.2's
    Chart.render does not pass them on, but its library's helm_render reads kube_version and
    api_versions (what `helm template --kube-version --api-versions` set):
    test_kube_version_and_capabilities_reach_helm checks that both take effect."""
    opts = {"name": RELEASE, "namespace": namespace, "kube_version": f"v{version}.0",
            "api_versions": SERVED[version] if api_versions is None else api_versions}
    with helm_python.Chart.load(chart) as loaded:
        rendered: dict[str, str] = json.loads(_native.call_string("helm_render", loaded._raw(), json.dumps(values),
                                                                  json.dumps(opts)))
    return rendered


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for template, text in sorted(rendered.items()):
        if template.endswith("NOTES.txt"):
            continue
        out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def only(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


# --- objects whose kind is a CRD ---------------------------------------------------------------
# kubernetes-validate knows the API's built-in kinds only. A PodMonitor (the Prometheus Operator's
# CRD) is checked here instead, against what its CRD requires and what this chart uses: an honest
# but small check, not the CRD's OpenAPI schema (not shipped in this repository).

PODMONITOR_SPEC = {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels", "sampleLimit",
                   "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit", "attachMetadata"}
PODMONITOR_ENDPOINT = {"port", "portNumber", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                       "honorTimestamps", "relabelings", "metricRelabelings", "params", "tlsConfig", "basicAuth",
                       "bearerTokenSecret", "authorization", "oauth2", "proxyUrl", "followRedirects", "enableHttp2",
                       "filterRunning"}
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def check_podmonitor(pm: dict[str, Any], daemonset: dict[str, Any]) -> None:
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    assert DNS_SUBDOMAIN.match(pm["metadata"]["name"]) and pm["metadata"]["namespace"] == NAMESPACE
    spec = pm["spec"]
    assert set(spec) <= PODMONITOR_SPEC, set(spec) - PODMONITOR_SPEC
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    assert selector and all(pod_labels.get(k) == v for k, v in selector.items()), "the PodMonitor selects no daemon pod"
    ports = {p["name"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    assert spec["podMetricsEndpoints"]
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= PODMONITOR_ENDPOINT, set(endpoint) - PODMONITOR_ENDPOINT
        assert endpoint["port"] in ports, f"port {endpoint['port']} is no container port of the daemon"
        for key in ("interval", "scrapeTimeout"):
            assert key not in endpoint or DURATION.match(endpoint[key]), endpoint[key]
        for r in endpoint.get("relabelings", []):
            assert set(r) <= {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}
            assert all(isinstance(s, str) for s in r.get("sourceLabels", []))


CUSTOM_CHECKS = {("monitoring.coreos.com/v1", "PodMonitor")}


def validate_all(objs: list[dict[str, Any]], version: str) -> None:
    """Every object against Kubernetes ``version``'s schemas (strict), or the check above for a CRD;
    a kind neither knows fails."""
    for obj in objs:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_CHECKS:
            continue          # checked by check_podmonitor, with the DaemonSet it must match
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} is not valid in Kubernetes {version}: "
                                 f"{path}: {exc.message}") from None
    if any((o["apiVersion"], o["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor") for o in objs):
        check_podmonitor(only(objs, "PodMonitor"), only(objs, "DaemonSet"))


# --- lint, schema, versions -----------------------------------------------------------------------


@pytest.mark.parametrize("chart", [CHART, ENGINE_CHART], ids=lambda p: p.name)
def test_helm_lint(chart: Path) -> None:
    """helm lint --strict, with each value set, for both ends of the supported versions: no error,
    no warning (the only message allowed is lint's advice to add an icon)."""
    for name in value_sets(chart):
        for version in VERSIONS:
            report = helm_python.lint(chart, values_of(chart, name), strict=True, kube_version=f"v{version}.0",
                                      namespace=NAMESPACE)
            problems = [m for m in report["messages"] if m["severity"] >= 2 or "icon" not in m["error"]]
            assert not report["errors"] and not problems, f"{chart.name} {name} {version}: {report}"


def test_value_sets_are_the_documented_ones() -> None:
    assert {"tenants-on", "ssd-off", "peers-etcd"} <= set(value_sets(CHART))
    assert {"sglang", "tenant"} <= set(value_sets(ENGINE_CHART))


def test_kube_version_and_capabilities_reach_helm() -> None:
    """The render is the one for the version asked: below 1.29 the chart refuses (its own check of
    .Capabilities.KubeVersion: an offline render does not apply Chart.yaml's kubeVersion), and the
    admission policy appears only where the capability is served."""
    with pytest.raises(helm_python.HelmRenderError, match="needs Kubernetes 1.29 or later.*v1.28.0"):
        _render_at(CHART, "v1.28.0")
    assert objects(_render_at(CHART, "v1.29.0"))
    tenants = values_of(CHART, "tenants-on")
    kinds_newest = {o["kind"] for o in objects(render(CHART, tenants, NEWEST))}
    kinds_oldest = {o["kind"] for o in objects(render(CHART, tenants, OLDEST))}
    assert {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} <= kinds_newest
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & kinds_oldest
    with helm_python.Chart.load(CHART) as chart:       # the SDK's public render: Helm's offline defaults
        plain = objects(chart.render(tenants, name=RELEASE, namespace=NAMESPACE))
    assert "ValidatingAdmissionPolicy" not in {o["kind"] for o in plain}


def _render_at(chart: Path, kube_version: str) -> dict[str, str]:
    opts = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": kube_version}
    with helm_python.Chart.load(chart) as loaded:
        rendered: dict[str, str] = json.loads(_native.call_string("helm_render", loaded._raw(), "{}", json.dumps(opts)))
    return rendered


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", value_sets(CHART))
def test_daemon_chart_objects_validate(name: str, version: str) -> None:
    objs = objects(render(CHART, values_of(CHART, name), version))
    kinds = {o["kind"] for o in objs}
    assert {"DaemonSet", "ConfigMap"} <= kinds
    validate_all(objs, version)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", value_sets(ENGINE_CHART))
def test_engine_chart_objects_validate(name: str, version: str) -> None:
    objs = objects(render(ENGINE_CHART, values_of(ENGINE_CHART, name), version, namespace="team-a"))
    assert "Deployment" in {o["kind"] for o in objs}
    validate_all(objs, version)


def test_schema_refuses_bad_values() -> None:
    bad = [
        {"ram": {"sizeGib": 4}},                                      # a misspelt key
        {"ram": {"arena": {"backing": "disk"}}},
        {"agent": {"mode": "666x"}},
        {"tenants": {"enabled": True, "members": {"Alice": {}}}},     # not a tenant name
        {"tenants": {"enabled": True, "members": {"alice": {"ramShare": 0}}}},
        {"peers": {"etcd": {"endpoints": ["https://etcd:2379"]}}},   # HOST:PORT, not a URL
        {"resources": {"daemonMemory": "1G"}},
        {"extraConfig": {"kvv": {"ram_gib": 1}}},                     # no such section
        {"image": {"pullPolicy": "Sometimes"}},
    ]
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(values_of(CHART, "tenants-on"))
        for values in bad:
            with pytest.raises(helm_python.HelmValuesError):
                chart.validate_schema(values)
    with helm_python.Chart.load(ENGINE_CHART) as chart:
        for values in ({"engine": "trtllm"}, {"kvcached": {"tenant": "../bob"}}, {"kvcached": {"readOnly": False}}):
            with pytest.raises(helm_python.HelmValuesError):
                chart.validate_schema(values)


def test_templates_refuse_inconsistent_values() -> None:
    bad = [
        ({"extraConfig": {"kv": {"ram_gib": 4}}}, "set by the chart"),
        ({"extraConfig": {"quic": {"cert": "/x.pem"}}}, "set by the chart"),
        ({"peers": {"enabled": True}}, "endpoints"),
        ({"ram": {"sizeGiB": 2.5, "arena": {"backing": "hugepages", "hugepages": {"pageSize": "1Gi"}}}}, "huge pages"),
        ({"ram": {"sizeGiB": 0.001}}, "does not fit"),
        ({"tenants": {"enabled": True, "keySecret": "k", "members": {"a": {}}}, "securityContext": {"runAsUser": 1000}},
         "runAsUser 0"),
    ]
    for values, message in bad:
        with pytest.raises(helm_python.HelmRenderError, match=message):
            render(CHART, values, NEWEST)


def test_extra_config_sections_are_the_daemons() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["extraConfig"]["propertyNames"]["enum"]) == set(SECTIONS)


# --- the daemon's configuration and the pod -------------------------------------------------------


def daemon_parts(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    ds = only(objs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return ds, pod, container


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args; a reference to no defined variable would stay as it
    is, so it fails here."""
    def one(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not an env var of the container"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    fields = {"spec.nodeName": NODE, "status.podIP": POD_IP, "metadata.name": "kvcached-x1y2z"}
    env = {}
    for e in container["env"]:
        env[e["name"]] = e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def mount_of(container: dict[str, Any], pod: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volume mount ``path`` lies on (the deepest), and its volume."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume of the daemon's pod (its root file system is read-only)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def node_path(container: dict[str, Any], pod: dict[str, Any], path: str) -> str:
    """Where a path of the daemon's container is on the node (its volume must be a hostPath)."""
    mount, volume = mount_of(container, pod, path)
    assert "hostPath" in volume, f"{path} is on volume {volume['name']}, not on the node"
    return volume["hostPath"]["path"].rstrip("/") + path[len(mount["mountPath"].rstrip("/")):]


def daemon_config(objs: list[dict[str, Any]], tmp: Path) -> tuple[Any, dict[str, str]]:
    """The daemon's configuration as one pod loads it: kvcached.toml from the ConfigMap and the
    container's --set arguments, $(VAR)s expanded. The Secrets' mount points are stood for by
    directories of the test holding what `kvcached certs` makes. Returns the Config and the map
    from the test's directories back to the pod's paths."""
    _, pod, container = daemon_parts(objs)
    args = container["args"]
    assert args[:4] == ["serve", "--config", "/etc/kvcached/kvcached.toml", "--rolling"], args
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and "kvcached.toml" in o.get("data", {})]
    config_mount, config_volume = mount_of(container, pod, args[2])
    assert config_volume["configMap"]["name"] == cm["metadata"]["name"] and config_mount.get("subPath") == "kvcached.toml"
    env = pod_env(container)
    rest = args[4:]
    assert len(rest) % 2 == 0 and rest[::2] == ["--set"] * (len(rest) // 2), rest
    overrides = [expand(item, env) for item in rest[1::2]]
    toml = cm["data"]["kvcached.toml"]
    stand_ins: dict[str, str] = {}
    for volume in pod["volumes"]:
        if "secret" not in volume:
            continue
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount.get("readOnly") is True, f"Secret {volume['secret']['secretName']} is mounted writable"
        here = tmp / volume["name"]
        if volume["name"] == "peer-certs":
            files, _ = make_cluster(here, [NODE])      # the files `kvcached certs --dir DIR NODE` makes
            assert {p.name for p in here.iterdir()} == {"ca.pem", "ca-key.pem", f"{NODE}.pem", f"{NODE}-key.pem"}
            (here / "ca-key.pem").unlink()             # never in the Secret
        elif volume["name"] == "etcd-certs":
            here.mkdir()
            for name in ("ca.pem", "cert.pem", "key.pem"):
                (here / name).write_text("PEM\n")
        else:                                          # the tenant key: a file (subPath); the loader does not read it
            here.mkdir()
            (here / mount["subPath"]).write_bytes(b"k" * 32)
            stand_ins[str(here / mount["subPath"])] = mount["mountPath"]
            toml = toml.replace(f'"{mount["mountPath"]}"', f'"{here / mount["subPath"]}"')
            continue
        stand_ins[str(here)] = mount["mountPath"]
        toml = toml.replace(f'"{mount["mountPath"]}/', f'"{here}/')
        overrides = [o.replace(f'"{mount["mountPath"]}/', f'"{here}/') for o in overrides]
    path = tmp / "kvcached.toml"
    path.write_text(toml)
    tomllib.loads(toml)                                # plain TOML first, for a clearer failure
    return load_config(path, overrides, total_memory=1 << 50), stand_ins


def pod_path(path: str, stand_ins: dict[str, str]) -> str:
    for here, there in stand_ins.items():
        if path == here or path.startswith(here + "/"):
            return there + path[len(here):]
    return path


@pytest.mark.parametrize("name", value_sets(CHART))
def test_daemon_config_loads_and_fits_the_pod(name: str, tmp_path: Path) -> None:
    values = values_of(CHART, name)
    with helm_python.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)
    objs = objects(render(CHART, values, NEWEST))
    ds, pod, container = daemon_parts(objs)
    config, stand_ins = daemon_config(objs, tmp_path)
    kv = config.kv

    # What the values say is what the daemon runs with.
    assert kv.ram_gib == merged["ram"]["sizeGiB"] and kv.ssd_gib == merged["ssd"]["sizeGiB"]
    assert config.agent.mode == merged["agent"]["mode"]
    assert kv.arena == ("memfd" if merged["ram"]["arena"]["backing"] == "memfd" else "file")

    # Writable state on the node, each where its volume says.
    state = merged["state"]["hostPath"]
    assert node_path(container, pod, kv.index_dir) == f"{state}/index"    # the handover socket is index/handover.sock
    if kv.arena == "file":
        backing = merged["ram"]["arena"]["backing"]
        expected = merged["ram"]["arena"]["tmpfsPath"] if backing == "tmpfs" else merged["ram"]["arena"]["hugepages"]["path"]
        assert node_path(container, pod, kv.arena_dir) == expected
    if kv.ssd_gib:
        mount, volume = mount_of(container, pod, kv.ssd_dir)
        if merged["ssd"]["volume"]["type"] == "hostPath":
            assert volume["hostPath"]["path"] == merged["ssd"]["volume"]["hostPath"]
        else:
            claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
            assert claim["resources"]["requests"]["storage"].endswith("Gi")
            assert int(claim["resources"]["requests"]["storage"][:-2]) >= kv.ssd_gib
    else:
        assert not any(v["name"] == "ssd" for v in pod["volumes"])
    for path in (kv.index_dir, kv.ssd_dir if kv.ssd_gib else None, kv.arena_dir if kv.arena == "file" else None):
        if path:
            assert not mount_of(container, pod, path)[0].get("readOnly"), f"{path} is read-only"

    # Sockets: under the node's socket directory, laid out as the engine chart expects.
    sockets = merged["sockets"]["hostPath"].rstrip("/")
    (admin,) = [a for a in config.grpc.listen if a.startswith("unix:")]
    assert node_path(container, pod, admin[len("unix:"):]) == f"{sockets}/admin/kvcached.sock"
    if merged["agent"]["enabled"]:
        assert node_path(container, pod, config.agent.socket) == f"{sockets}/agent/agent.sock"
    if merged["tenants"]["enabled"]:
        assert set(config.tenants.agent_sockets) == set(merged["tenants"]["members"])
        for tenant, sock in config.tenants.agent_sockets.items():
            assert node_path(container, pod, sock) == f"{sockets}/tenants/{tenant}/agent.sock"
            member = merged["tenants"]["members"][tenant] or {}
            for key, field in (("ramShare", "ram_shares"), ("ssdShare", "ssd_shares")):
                if key in member:                   # a fraction stays a fraction, bytes stay bytes
                    share = getattr(config.tenants, field)[tenant]
                    assert share == member[key] and isinstance(share, float) == (member[key] <= 1), (tenant, share)
            assert config.tenants.uids.get(tenant, []) == member.get("uids", [])
        if merged["tenants"]["keySecret"]:
            assert pod_path(config.tenants.key_file, stand_ins) == "/etc/kvcached/tenants.key"

    # Ports: health (the probes), metrics, peers.
    ports = {(p["name"]): p for p in container["ports"]}
    health = int(config.grpc.health_listen.rpartition(":")[2])
    assert config.grpc.health_listen.startswith("0.0.0.0:") and ports["health"]["containerPort"] == health
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": health}, probe
    # Liveness asks for the service a daemon that handed over still answers (kvcached.lifecycle.linger).
    from kvcached.api.grpc_servers import LIVENESS_SERVICE

    assert container["livenessProbe"]["grpc"] == {"port": health, "service": LIVENESS_SERVICE}
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 300
    assert config.metrics.listen == f"0.0.0.0:{ports['metrics']['containerPort']}"
    if merged["peers"]["enabled"]:
        port = int(config.quic.listen.rpartition(":")[2])
        assert (ports["quic"]["containerPort"], ports["quic"]["protocol"]) == (port, "UDP")
        assert (ports["lane"]["containerPort"], ports["lane"]["protocol"]) == (port, "TCP")
        assert config.cluster.name == NODE and config.cluster.advertise == POD_IP
        assert config.cluster.etcd == merged["peers"]["etcd"]["endpoints"]
        certs = "/etc/kvcached/certs"
        assert [pod_path(p, stand_ins) for p in (config.quic.ca, config.quic.cert, config.quic.key)] == \
            [f"{certs}/ca.pem", f"{certs}/{NODE}.pem", f"{certs}/{NODE}-key.pem"]
        (secret,) = [v["secret"] for v in pod["volumes"] if v["name"] == "peer-certs"]
        assert secret["secretName"] == merged["peers"]["certsSecret"]
    else:
        assert not config.quic.listen and not {"quic", "lane"} & set(ports)

    # Memory: the RAM tier and its slot directory (as large as the daemon's own code makes it for
    # this tier), plus the daemon's own; on huge pages the first two are the hugepages request.
    daemon = merged["resources"]["daemonMemory"]
    daemon_mib = int(daemon[:-2]) * (1024 if daemon.endswith("Gi") else 1)
    geometry = SlabAllocator.geometry(config.ram_bytes, config.max_block_bytes)
    shared = config.ram_bytes + SlotDirectory._size_for(geometry)
    res = container["resources"]

    def mib(quantity: str) -> int:
        assert quantity.endswith("Mi"), quantity
        return int(quantity[:-2])
    if merged["ram"]["arena"]["backing"] == "hugepages":
        page = merged["ram"]["arena"]["hugepages"]["pageSize"]
        page_mib = {"2Mi": 2, "1Gi": 1024}[page]
        huge = mib(res["limits"][f"hugepages-{page}"])
        assert res["requests"][f"hugepages-{page}"] == res["limits"][f"hugepages-{page}"]
        assert huge % page_mib == 0 and shared <= huge * MiB < shared + page_mib * MiB + 2 * MiB, (huge, shared)
        assert kv.ram_gib * 1024 % page_mib == 0
        assert mib(res["limits"]["memory"]) == daemon_mib
    else:
        assert not any(k.startswith("hugepages-") for k in res["limits"])
        assert shared <= (mib(res["limits"]["memory"]) - daemon_mib) * MiB < shared + 2 * MiB
    assert res["requests"]["memory"] == res["limits"]["memory"]


@pytest.mark.parametrize("name", value_sets(CHART))
def test_daemonset_is_unprivileged_and_rolls_by_handover(name: str) -> None:
    values = values_of(CHART, name)
    with helm_python.Chart.load(CHART) as chart:
        merged = chart.merge_values(values)
    objs = objects(render(CHART, values, NEWEST))
    ds, pod, container = daemon_parts(objs)

    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "--rolling" in container["args"]
    assert 30 <= pod["terminationGracePeriodSeconds"] <= 300
    assert pod["nodeSelector"] == merged["nodeSelector"] and pod["tolerations"] == merged["tolerations"]
    if name == "defaults":
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    # No privileges.
    assert pod["hostNetwork"] is False and pod["hostIPC"] is False and pod["hostPID"] is False
    assert pod["automountServiceAccountToken"] is False
    psc = pod["securityContext"]
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert (psc["runAsUser"], psc["runAsGroup"]) == (merged["securityContext"]["runAsUser"], merged["securityContext"]["runAsGroup"])
    assert psc["runAsNonRoot"] is (psc["runAsUser"] != 0)
    sc = container["securityContext"]
    assert sc == {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert not any(p.get("hostPort") for p in container["ports"])

    # The container: image, environment, scratch space.
    image = merged["image"]
    assert container["image"] == f"{image['repository']}:{image['tag'] or '0.1.0'}"
    env = {e["name"]: e for e in container["env"]}
    assert env["PYTHONDONTWRITEBYTECODE"]["value"] == "1"
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    tmp_mount, tmp_volume = mount_of(container, pod, "/tmp")
    assert tmp_mount["mountPath"] == "/tmp" and "emptyDir" in tmp_volume

    # Only the node directories the values name are mounted from the node.
    host_paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    expected = {merged["state"]["hostPath"], merged["sockets"]["hostPath"]}
    backing = merged["ram"]["arena"]["backing"]
    expected |= {"tmpfs": {merged["ram"]["arena"]["tmpfsPath"]}, "hugepages": {merged["ram"]["arena"]["hugepages"]["path"]},
                 "memfd": set()}[backing]
    if merged["ssd"]["sizeGiB"] and merged["ssd"]["volume"]["type"] == "hostPath":
        expected.add(merged["ssd"]["volume"]["hostPath"])
    assert host_paths == expected

    # The configuration's checksum rolls the pods when it changes.
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    changed = objects(render(CHART, {**values, "log": {"level": "debug", "format": "json"}}, NEWEST))
    assert daemon_parts(changed)[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != \
        ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    # Optional objects, each gated by its value.
    kinds = [o["kind"] for o in objs]
    assert ("PodMonitor" in kinds) == merged["metrics"]["podMonitor"]["enabled"]
    assert ("Service" in kinds) == merged["metrics"]["service"]["enabled"]
    assert ("PriorityClass" in kinds) == merged["priorityClass"]["create"]
    if merged["priorityClass"]["create"] or merged["priorityClassName"]:
        names = [o["metadata"]["name"] for o in objs if o["kind"] == "PriorityClass"] or [merged["priorityClassName"]]
        assert pod["priorityClassName"] in names
    else:
        assert "priorityClassName" not in pod


def test_admission_policy_guards_the_tenants_socket_directories() -> None:
    values = values_of(CHART, "tenants-on")
    objs = objects(render(CHART, values, NEWEST))
    policy, binding = only(objs, "ValidatingAdmissionPolicy"), only(objs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"] == \
        [{"key": "kvcached.io/tenant", "operator": "Exists"}]
    assert policy["spec"]["failurePolicy"] == "Fail"
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["tenant"] == "namespaceObject.metadata.labels['kvcached.io/tenant']"
    assert variables["socketDir"] == "'/run/kvcached/tenants/' + variables.tenant"
    fields = " ".join(v["expression"] for v in policy["spec"]["validations"])
    for field in ("volumes", "containers", "initContainers", "ephemeralContainers", "hostNetwork", "hostPID", "hostIPC",
                  "privileged", "readOnly"):
        assert f".{field}" in fields, field
    # Off unless asked for, and only with tenants.
    assert "ValidatingAdmissionPolicy" not in {o["kind"] for o in objects(render(CHART, {}, NEWEST))}
    off = {**values, "tenants": {**values["tenants"], "admissionPolicy": {"enabled": False, "namespaceLabel": "x"}}}
    assert "ValidatingAdmissionPolicy" not in {o["kind"] for o in objects(render(CHART, off, NEWEST))}


# --- the engine chart ---------------------------------------------------------------------------


def sglang_engine_keys() -> set[str]:
    """The keys of SGLang's extra config that belong to SGLang, as the plug-in lists them
    (_SGLANG_KEYS, read from its source: importing it needs SGLang)."""
    source = (ROOT / "agent" / "kvcached_agent" / "engines" / "sglang_storage.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_SGLANG_KEYS" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("_SGLANG_KEYS not found in sglang_storage.py")


def engine_pod(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    objs = objects(render(ENGINE_CHART, values, NEWEST, namespace="team-a"))
    pod = only(objs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kvcached"]
    return pod, container, volume


def plugin_settings(container: dict[str, Any], engine: str) -> PluginSettings:
    """The plug-in's settings as the engine hands them over, parsed by the plug-in's own parser."""
    args = container["args"]
    if engine == "vllm":
        assert container["command"] == ["vllm", "serve"]
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert {k: config[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role", "kv_load_failure_policy")} == \
            {"kv_connector": "KvcachedConnector", "kv_connector_module_path": "kvcached_agent.engines.vllm_connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
        return PluginSettings.from_mapping(config["kv_connector_extra_config"], "kv_connector_extra_config")
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    assert "--enable-hierarchical-cache" in args
    assert args[args.index("--hicache-storage-backend") + 1] == "dynamic"
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert {k: extra[k] for k in ("backend_name", "module_path", "class_name", "interface_v1")} == \
        {"backend_name": "kvcached", "module_path": "kvcached_agent.engines.sglang_storage",
         "class_name": "KvcachedStorage", "interface_v1": 1}
    return PluginSettings.from_mapping(extra, "--hicache-storage-backend-extra-config", ignore=tuple(sglang_engine_keys()))


@pytest.mark.parametrize("name", value_sets(ENGINE_CHART))
def test_engine_mounts_one_socket_directory_read_only(name: str) -> None:
    values = values_of(ENGINE_CHART, name)
    with helm_python.Chart.load(ENGINE_CHART) as chart:
        merged = chart.merge_values(values)
    pod, container, volume = engine_pod(values)
    k = merged["kvcached"]
    tenant = k["tenant"]
    expected_dir = f"{k['socketsHostPath']}/tenants/{tenant}" if tenant else f"{k['socketsHostPath']}/agent"
    assert volume["hostPath"] == {"path": expected_dir, "type": "Directory"}
    assert [v for v in pod["volumes"] if "hostPath" in v] == [volume]          # nothing else of the node
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kvcached"]
    assert mount["readOnly"] is True
    socket = f"{mount['mountPath']}/agent.sock"
    settings = plugin_settings(container, merged["engine"])
    assert settings.socket_path == socket == DEFAULT_SOCKET
    assert settings.namespace == k["namespace"] and settings.timeout_s == k["timeoutS"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVCACHED_AGENT_SOCKET"] == socket
    # What the kvcached chart's admission policy asks of a tenant's pod.
    sc = container["securityContext"]
    assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    hugepages = k["hugepages"]["size"]
    limits = container["resources"]["limits"]
    assert limits.get(f"hugepages-{k['hugepages']['pageSize']}") == (hugepages or None)


def test_engine_reaches_the_daemons_tenant_socket(tmp_path: Path) -> None:
    """The engine chart's directory for tenant alice is the node directory of the daemon's socket
    for alice, as tenants-on renders it; and the default socket's likewise."""
    objs = objects(render(CHART, values_of(CHART, "tenants-on"), NEWEST))
    _, pod, container = daemon_parts(objs)
    config, _ = daemon_config(objs, tmp_path)
    for tenant, sock in config.tenants.agent_sockets.items():
        _, engine, volume = engine_pod({"kvcached": {"tenant": tenant}})
        (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "kvcached"]
        assert f"{volume['hostPath']['path']}/agent.sock" == node_path(container, pod, sock)
    _, engine, volume = engine_pod({})
    assert f"{volume['hostPath']['path']}/agent.sock" == node_path(container, pod, config.agent.socket)


def test_every_value_is_documented() -> None:
    """Each value values.schema.json defines has a comment in values.yaml: on its line, above it,
    or (a map of values) below it. The insides of free-form values (a Kubernetes resources or
    securityContext object, a list's entries) are examples of that one value."""
    for chart in (CHART, ENGINE_CHART):
        schema = json.loads((chart / "values.schema.json").read_text())
        lines = (chart / "values.yaml").read_text().splitlines()
        stack: list[tuple[int, str]] = []
        for i, line in enumerate(lines):
            m = re.match(r"^(\s*)([A-Za-z][A-Za-z0-9_.-]*):", line)
            if not m:
                continue
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            node: dict[str, Any] | None = schema
            for _, key in stack:
                node = (node or {}).get("properties", {}).get(key)
            stack.append((indent, m.group(2)))
            if node is None or "properties" not in node or m.group(2) not in node["properties"]:
                continue                               # inside a free-form value
            above = lines[i - 1].strip() if i else ""
            below = i + 1 < len(lines) and re.match(rf"^{m.group(1)}\s+\S", lines[i + 1]) is not None
            assert above.startswith("#") or "#" in line or below, \
                f"{chart.name}/values.yaml:{i + 1}: {line.strip()} has no comment"


def test_the_manual_lists_every_value() -> None:
    def leaves(node: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, sub in node.get("properties", {}).items():
            if key == "global":
                continue
            path = f"{prefix}{key}"
            out += leaves(sub, path + ".") if "properties" in sub else [path]
        return out
    manuals = {CHART: CHART.parent.parent.parent / "docs" / "kubernetes.md", ENGINE_CHART: ENGINE_CHART / "README.md"}
    for chart, manual in manuals.items():
        readme = manual.read_text()
        missing = [p for p in leaves(json.loads((chart / "values.schema.json").read_text())) if f"| `{p}` |" not in readme]
        assert not missing, f"{manual} has no row for {missing}"
