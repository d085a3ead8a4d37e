"""The Helm chart (deploy/helm/spokefs): rendered with default and non-default values, every
manifest validated against the Kubernetes schemas.

Rendering uses Helm's own template engine (Helm v4's Go SDK) through the helm-python-sdk wheel
(import name helm_python), so no helm binary is needed; validation uses kubernetes-validate's
bundled, offline schemas, in strict mode (an unknown field is an error), for the oldest
Kubernetes the chart supports and the newest the package knows. The ServiceMonitor is a
custom resource those schemas lack: it is checked against a small schema of the fields the
chart uses, written after the Prometheus operator's CRD (monitoring.coreos.com/v1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

try:  # the renderer is a native library in a wheel: skip, saying why, where it cannot load
    import helm_python

    HELM_SDK = helm_python.helm_sdk_version()
except Exception as exc:  # ImportError, or the library failing to load on this platform
    pytest.skip(f"helm-python-sdk (the chart renderer, in the test extra) is unavailable: "
                f"{exc!r}", allow_module_level=True)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (in the test extra) is not installed")
yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "spokefs"
NAMESPACE = "ml"
# The chart's kubeVersion floor, and the newest schemas the package bundles.
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]

_SECRET_REF = {"type": "object", "required": ["name", "key"], "additionalProperties": False,
               "properties": {"name": {"type": "string", "minLength": 1},
                              "key": {"type": "string", "minLength": 1},
                              "optional": {"type": "boolean"}}}
_DURATION = {"type": "string",
             "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1},
                                    "labels": {"type": "object",
                                               "additionalProperties": {"type": "string"}}}},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {
                    "type": "object", "minProperties": 1,
                    "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"any": {"type": "boolean"},
                                                     "matchNames": {"type": "array",
                                                                    "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": _DURATION,
                        "scrapeTimeout": _DURATION,
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "authorization": {"type": "object", "additionalProperties": False,
                                          "required": ["credentials"],
                                          "properties": {"type": {"type": "string"},
                                                         "credentials": _SECRET_REF}},
                        "tlsConfig": {"type": "object", "additionalProperties": False,
                                      "properties": {
                                          "serverName": {"type": "string"},
                                          "insecureSkipVerify": {"type": "boolean"},
                                          "ca": {"type": "object", "additionalProperties": False,
                                                 "properties": {"secret": _SECRET_REF}}}},
                    }}},
            }},
    },
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm_python.Chart.load(CHART) as chart:
        out = chart.render(values, name="train", namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        what = f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if doc.get("apiVersion", "").startswith("monitoring.coreos.com/"):
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{what} is not valid for Kubernetes {version}: "
                                     f"{exc.message} at {list(exc.path)}") from exc


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def container(doc: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][index]


def test_default_values_render_valid_manifests():
    docs = render()
    validate_all(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["PersistentVolumeClaim", "Deployment", "Service", "StatefulSet",
                            "Service", "Service", "PodDisruptionBudget", "ServiceAccount",
                            "Role", "RoleBinding", "DaemonSet", "ServiceMonitor",
                            "ServiceMonitor"])
    assert not by_kind(docs, "Secret")  # tokens come from a Secret the operator makes

    spoke = one(docs, "StatefulSet")
    args = container(spoke)["args"]
    assert "--tier-kubernetes=train-spokefs-spoke-headless" in args
    assert "--no-tier-copies" not in args  # copies in spare room: the default
    assert ("--advertise=http://$(POD_NAME).train-spokefs-spoke-headless.$(POD_NAMESPACE)"
            ".svc.cluster.local:8471") in args
    assert "--upstream=http://train-spokefs-hub.ml.svc.cluster.local:8470" in args
    assert "--auth=/etc/spokefs/tokens/spoke.tokens" in args
    assert "--upstream-token-file=/etc/spokefs/tokens/upstream.token" in args
    assert spoke["spec"]["serviceName"] == "train-spokefs-spoke-headless"
    claim = spoke["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "local-storage"
    assert spoke["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    probe = container(spoke)["readinessProbe"]["exec"]["command"]
    assert probe[-2:] == ["--json", "http://localhost:8471"]
    assert "--token-file=/etc/spokefs/tokens/monitor.token" in probe

    hub = one(docs, "Deployment")
    assert hub["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "data", "persistentVolumeClaim": {"claimName": "dataset", "readOnly": True}}
    assert "--auth=/etc/spokefs/tokens/hub.tokens" in container(hub)["args"]

    headless = next(s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None")
    assert headless["metadata"]["name"] == "train-spokefs-spoke-headless"
    role = one(docs, "Role")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]

    mount = one(docs, "DaemonSet")
    c = container(mount)
    assert c["securityContext"]["privileged"] is True
    assert {"name": "mounts", "mountPath": "/mnt/spokefs",
            "mountPropagation": "Bidirectional"} in c["volumeMounts"]
    assert "http://train-spokefs-spoke.ml.svc.cluster.local:8471/imagenet" in c["args"][0]
    assert "--token-file=/etc/spokefs/tokens/client.token" in c["args"]
    volumes = {v["name"]: v for v in mount["spec"]["template"]["spec"]["volumes"]}
    assert volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert [i["key"] for i in volumes["tokens"]["secret"]["items"]] == ["client.token"]

    monitors = by_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"train-spokefs-hub",
                                                        "train-spokefs-spoke"}
    for m in monitors:
        ep = m["spec"]["endpoints"][0]
        assert ep["path"] == "/metrics"
        assert ep["authorization"]["credentials"] == {"name": "train-spokefs-tokens",
                                                      "key": "monitor.token"}


def test_non_default_values_render_valid_manifests():
    docs = render({
        "tier": {"enabled": False},
        "serviceMonitor": {"enabled": False},
        "tls": {"enabled": True, "secretName": "spokefs-cert"},
        "auth": {"create": True, "tokens": {"hub.tokens": "spoke-eu read aaaa\n",
                                            "spoke.tokens": "mount read bbbb\n",
                                            "upstream.token": "aaaa", "client.token": "bbbb",
                                            "monitor.token": "cccc"}},
        "spoke": {"replicas": 6, "workers": 8, "antiAffinity": "hard",
                  "cache": {"storageClass": "nvme-raid0", "size": "3TiB",
                            "volumeSize": "3200Gi"},
                  "extraArgs": ["--policy", "s3fifo"]},
        "hub": {"state": {"existingClaim": "hub-state"}, "blockSize": "8MiB",
                "data": {"volume": {"nfs": {"server": "fs-1.efs.example", "path": "/imagenet",
                                            "readOnly": True}}},
                "service": {"type": "LoadBalancer",
                            "loadBalancerSourceRanges": ["203.0.113.0/24"]}},
        "mount": {"hostPath": "/mnt/data/", "datasets": [{"name": "imagenet"},
                                                         {"name": "laion_5b",
                                                          "snapshot": "3fa9c1d20b7e"}]},
    })
    validate_all(docs)
    assert not by_kind(docs, "ServiceMonitor")
    assert not by_kind(docs, "Role") and not by_kind(docs, "ServiceAccount")
    assert not by_kind(docs, "PersistentVolumeClaim")  # the hub's state claim exists already
    secret = one(docs, "Secret")
    assert set(secret["stringData"]) == {"hub.tokens", "spoke.tokens", "upstream.token",
                                         "client.token", "monitor.token"}

    spoke = one(docs, "StatefulSet")
    args = container(spoke)["args"]
    assert not [a for a in args if a.startswith(("--tier", "--advertise"))]
    assert args[:1] == ["--ca-bundle=/etc/spokefs/ca/ca.crt"]
    assert {"--tls-cert=/etc/spokefs/tls/tls.crt", "--workers=8", "--cache-size=3TiB",
            "--upstream=https://train-spokefs-hub.ml.svc.cluster.local:8470"} <= set(args)
    assert args[-2:] == ["--policy", "s3fifo"]
    assert spoke["spec"]["replicas"] == 6
    assert spoke["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "nvme-raid0"
    assert spoke["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    anti = spoke["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in anti
    assert container(spoke)["readinessProbe"]["exec"]["command"][-1] == "https://localhost:8471"

    hub = one(docs, "Deployment")
    assert "--block-size=8MiB" in container(hub)["args"]
    assert hub["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "data", "nfs": {"server": "fs-1.efs.example", "path": "/imagenet",
                                "readOnly": True}}
    assert hub["spec"]["template"]["spec"]["volumes"][1]["persistentVolumeClaim"] == {
        "claimName": "hub-state"}

    mount = one(docs, "DaemonSet")
    names = [c["name"] for c in mount["spec"]["template"]["spec"]["containers"]]
    assert names == ["mount-imagenet", "mount-laion-5b"]
    second = container(mount, 1)["args"][0]
    assert ('"https://train-spokefs-spoke.ml.svc.cluster.local:8471/laion_5b@3fa9c1d20b7e" '
            '"/mnt/data/laion_5b"') in second


def test_dns_membership_and_a_region_without_a_hub():
    docs = render({"hub": {"enabled": False}, "tier": {"membership": "dns", "copies": False},
                   "spoke": {"upstream": "https://hub.example.org:8470"},
                   "auth": {"enabled": False}, "mount": {"enabled": False}})
    validate_all(docs)
    assert not by_kind(docs, "Deployment") and not by_kind(docs, "DaemonSet")
    args = container(one(docs, "StatefulSet"))["args"]
    assert "--tier-dns=train-spokefs-spoke-headless.$(POD_NAMESPACE).svc.cluster.local" in args
    assert "--advertise=http://$(POD_IP):8471" in args and "--no-tier-copies" in args
    assert "--insecure" in args and "--upstream=https://hub.example.org:8470" in args
    # without tokens the kubelet can ask /v1/status itself
    probe = container(one(docs, "StatefulSet"))["readinessProbe"]
    assert probe["httpGet"] == {"path": "/v1/status", "port": "http"}
    assert [m["metadata"]["name"] for m in by_kind(docs, "ServiceMonitor")] == [
        "train-spokefs-spoke"]
    assert "authorization" not in by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]


@pytest.mark.parametrize(("values", "message"), [
    ({"hub": {"enabled": False}}, "spoke.upstream is required"),
    ({"tier": {"membership": "gossip"}}, "tier.membership must be"),
    ({"hub": {"data": {"existingClaim": ""}}}, "where the dataset is"),
    ({"auth": {"create": True}}, "auth.tokens."),
    # values.schema.json: a misspelt key, a bad dataset name
    ({"spoke": {"cache": {"storageclass": "x"}}}, "'storageclass' not allowed"),
    ({"mount": {"datasets": [{"name": "../etc"}]}}, "does not match pattern"),
])
def test_bad_values_fail_with_a_message(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def test_chart_lints_clean():
    report = helm_python.lint(CHART, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
