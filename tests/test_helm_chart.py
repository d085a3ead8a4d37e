"""The Helm chart (deploy/helm/spokefs): rendered with default and non-default values, every
manifest validated against the Kubernetes schemas.

Rendering uses Helm's own template engine (Helm v4's Go SDK) through the helm-python-sdk wheel
(import name helm_python), so no helm binary is needed; validation uses kubernetes-validate's
bundled, offline schemas, in strict mode (an unknown field is an error), for the oldest
Kubernetes the chart supports and the newest the package knows, plus the API server's rules
for pods that no schema holds (Bidirectional propagation, privilege escalation). The
ServiceMonitor and cert-manager's Issuer and Certificate are custom resources those schemas
lack: each is checked against a small schema of the fields the chart uses, written after its
CRD (monitoring.coreos.com/v1, cert-manager.io/v1). The ServiceMonitor renders only where the
Prometheus operator's CRDs are served (`.Capabilities.APIVersions`): rendering sees no cluster,
so that case is rendered from a copy of the chart that says they are.

The chart's own certificate (genCA, genSignedCert) is parsed and used for real TLS handshakes
with the servers' TLS setup (spokefs.wire.tls) and Python's client verification. Rendering sees
no cluster, so `lookup` finds nothing and every render makes a new CA; the path that keeps the
CA and certificate across upgrades is rendered from a copy of the chart whose `lookup` calls
read the previous render's Secrets from a value instead.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import shlex
import socket
import ssl
import subprocess
import threading
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

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "spokefs"
DOCS = ROOT / "docs" / "kubernetes.md"
NAMESPACE = "ml"
# The chart's kubeVersion floor, and the newest schemas the package bundles.
KUBE_VERSIONS = ["1.25.0", kubernetes_validate.latest_version()]

_SECRET_REF = {"type": "object", "required": ["name", "key"], "additionalProperties": False,
               "properties": {"name": {"type": "string", "minLength": 1},
                              "key": {"type": "string", "minLength": 1},
                              "optional": {"type": "boolean"}}}
_DURATION = {"type": "string",
             "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {"type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "minLength": 1},
                            "labels": _LABELS, "annotations": _LABELS}}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
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

# cert-manager.io/v1, after its CRDs (v1.x): the fields the chart uses, nothing else allowed.
_CM_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"}
_ISSUER_REF = {"type": "object", "required": ["name"], "additionalProperties": False,
               "properties": {"name": {"type": "string", "minLength": 1},
                              "kind": {"type": "string"}, "group": {"type": "string"}}}
_KEY_USAGES = ["signing", "digital signature", "content commitment", "key encipherment",
               "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
               "decipher only", "any", "server auth", "client auth", "code signing",
               "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
               "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]
ISSUER_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Issuer"},
        "metadata": _METADATA,
        "spec": {"type": "object", "additionalProperties": False,
                 "minProperties": 1, "maxProperties": 1,  # one issuer type
                 "properties": {
                     "selfSigned": {"type": "object", "additionalProperties": False,
                                    "properties": {"crlDistributionPoints": {"type": "array"}}},
                     "ca": {"type": "object", "required": ["secretName"],
                            "additionalProperties": False,
                            "properties": {"secretName": {"type": "string", "minLength": 1},
                                           "crlDistributionPoints": {"type": "array"},
                                           "ocspServers": {"type": "array"}}}}},
    },
}
CERTIFICATE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        "metadata": _METADATA,
        "spec": {
            "type": "object", "required": ["secretName", "issuerRef"],
            "additionalProperties": False,
            "properties": {
                "secretName": {"type": "string", "minLength": 1},
                "secretTemplate": {"type": "object", "additionalProperties": False,
                                   "properties": {"labels": _LABELS, "annotations": _LABELS}},
                "commonName": {"type": "string", "maxLength": 64},
                "dnsNames": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "ipAddresses": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "duration": _CM_DURATION,
                "renewBefore": _CM_DURATION,
                "isCA": {"type": "boolean"},
                "usages": {"type": "array", "items": {"enum": _KEY_USAGES}},
                "privateKey": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                                   "size": {"type": "integer"},
                                   "encoding": {"enum": ["PKCS1", "PKCS8"]},
                                   "rotationPolicy": {"enum": ["Never", "Always"]}},
                    # cert-manager's webhook: ECDSA takes 256, 384 or 521 bits
                    "if": {"properties": {"algorithm": {"const": "ECDSA"}},
                           "required": ["algorithm"]},
                    "then": {"properties": {"size": {"enum": [256, 384, 521]}}}},
                "issuerRef": _ISSUER_REF,
            }},
    },
}
# monitoring.coreos.com/v1 PrometheusRule, after its CRD: groups of alerting or recording rules.
PROMETHEUS_RULE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": _DURATION,
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                        "properties": {
                            "alert": {"type": "string", "minLength": 1},
                            "record": {"type": "string", "minLength": 1},
                            "expr": {"type": ["string", "integer"]},
                            "for": _DURATION,
                            "keep_firing_for": _DURATION,
                            "labels": _LABELS, "annotations": _LABELS}}}}}}}},
    },
}
CUSTOM_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR_SCHEMA,
                  ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_SCHEMA,
                  ("cert-manager.io/v1", "Issuer"): ISSUER_SCHEMA,
                  ("cert-manager.io/v1", "Certificate"): CERTIFICATE_SCHEMA}


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    with helm_python.Chart.load(chart) as c:
        out = c.render(values, name="train", namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    with helm_python.Chart.load(CHART) as c:
        out = c.render(values, name="train", namespace=NAMESPACE)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


OPERATOR_CHECK = '.Capabilities.APIVersions.Has "monitoring.coreos.com/v1"'


@pytest.fixture(scope="module")
def operator_chart(tmp_path_factory) -> Path:
    """A copy of the chart rendered as on a cluster that serves the Prometheus operator's
    CRDs: its one check of them (`spokefs.prometheusOperator`) says yes."""
    import shutil

    copy = tmp_path_factory.mktemp("operator") / "spokefs"
    shutil.copytree(CHART, copy)
    helpers = copy / "templates" / "_helpers.tpl"
    assert helpers.read_text().count(OPERATOR_CHECK) == 1, "_helpers.tpl: the check moved"
    for t in (copy / "templates").iterdir():
        t.write_text(t.read_text().replace(OPERATOR_CHECK, "true"))
    return copy


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        return doc["spec"]["template"]["spec"]
    return None


def check_api_rules(doc: dict[str, Any]) -> None:
    """What the API server refuses in a pod and no OpenAPI schema says
    (pkg/apis/core/validation: validateMountPropagation, validateSecurityContext...)."""
    spec = pod_spec(doc)
    if spec is None:
        return
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        privileged = sc.get("privileged") is True
        for m in c.get("volumeMounts", []):
            assert m.get("mountPropagation") != "Bidirectional" or privileged, (
                f"{doc['metadata']['name']}/{c['name']}: Bidirectional mount propagation is "
                f"available only to privileged containers")
        if sc.get("allowPrivilegeEscalation") is False:
            assert not privileged, "allowPrivilegeEscalation false with privileged true"
            added = sc.get("capabilities", {}).get("add", [])
            assert not {"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added), (
                "allowPrivilegeEscalation false with capabilities.add SYS_ADMIN")


def validate_all(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        what = f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        custom = CUSTOM_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
        if custom is not None:
            jsonschema.validate(doc, custom)
            continue
        assert "." not in doc["apiVersion"].split("/")[0] or doc["apiVersion"].startswith(
            ("apps/", "policy/", "rbac.authorization.k8s.io/", "networking.k8s.io/",
             "storage.k8s.io/")), (
            f"{what}: a custom resource without a schema here")
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{what} is not valid for Kubernetes {version}: "
                                     f"{exc.message} at {list(exc.path)}") from exc
        check_api_rules(doc)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} {name}"
    return found[0]


def container(doc: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]["containers"][index]


def volumes(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}


def pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    return doc["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector of matchLabels only (what the chart writes) against a pod's labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def secret_file(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def certificates(pem: bytes) -> list[bytes]:
    return re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\n?", pem,
                      re.S)


def san(pem: bytes) -> tuple[set[str], set[str]]:
    """(DNS names, IP addresses) of a PEM certificate: cryptography, else openssl."""
    try:
        from cryptography import x509
    except ImportError:
        out = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName"],
                             input=pem, capture_output=True, check=True).stdout.decode()
        items = [i.strip() for i in out.split("\n", 1)[1].split(",")]
        return ({i[4:] for i in items if i.startswith("DNS:")},
                {str(ipaddress.ip_address(i[11:])) for i in items
                 if i.startswith("IP Address:")})
    ext = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return (set(ext.get_values_for_type(x509.DNSName)),
            {str(a) for a in ext.get_values_for_type(x509.IPAddress)})


SERVICE_NAMES = {f"{svc}{suffix}" for svc in ("train-spokefs-hub", "train-spokefs-spoke",
                                               "train-spokefs-spoke-headless")
                 for suffix in ("", ".ml", ".ml.svc", ".ml.svc.cluster.local")}
MEMBERS = "*.train-spokefs-spoke-headless.ml.svc.cluster.local"


def test_default_values_render_valid_manifests():
    docs = render()
    validate_all(docs)
    kinds = sorted(d["kind"] for d in docs)
    # no ServiceMonitor: `helm template` (and an install on a cluster without the Prometheus
    # operator) renders nothing that needs its CRDs; no CSI driver unless asked for
    assert kinds == sorted(["PersistentVolumeClaim", "Deployment", "Service", "StatefulSet",
                            "Service", "Service", "PodDisruptionBudget", "ServiceAccount",
                            "Role", "RoleBinding", "DaemonSet", "Secret", "Secret",
                            "NetworkPolicy", "NetworkPolicy"])
    assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    # tokens come from a Secret the operator makes; the two here are the chart's CA and
    # certificate
    assert {s["metadata"]["name"] for s in by_kind(docs, "Secret")} == {
        "train-spokefs-ca", "train-spokefs-tls"}

    spoke = one(docs, "StatefulSet")
    args = container(spoke)["args"]
    assert "--tier-kubernetes=train-spokefs-spoke-headless" in args
    assert "--no-tier-copies" not in args  # copies in spare room: the default
    assert ("--advertise=https://$(POD_NAME).train-spokefs-spoke-headless.$(POD_NAMESPACE)"
            ".svc.cluster.local:8471") in args
    assert "--upstream=https://train-spokefs-hub.ml.svc.cluster.local:8470" in args
    assert "--auth=/etc/spokefs/tokens/spoke.tokens" in args
    assert "--upstream-token-file=/etc/spokefs/tokens/upstream.token" in args
    assert spoke["spec"]["serviceName"] == "train-spokefs-spoke-headless"
    claim = spoke["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "local-storage"
    assert spoke["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True

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
    assert {"name": "mounts", "mountPath": "/mnt/spokefs",
            "mountPropagation": "Bidirectional"} in c["volumeMounts"]
    assert "https://train-spokefs-spoke.ml.svc.cluster.local:8471/imagenet" in c["args"][0]
    assert "--token-file=/etc/spokefs/tokens/client.token" in c["args"]
    assert "--ca-bundle=/etc/spokefs/ca/ca.crt" in c["args"]
    vols = volumes(mount)
    assert vols["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert [i["key"] for i in vols["tokens"]["secret"]["items"]] == ["client.token"]


def test_probes_are_plain_http_gets_without_a_token():
    """/healthz (the event loop answers) for startup and liveness, /readyz (the upstream or the
    cache is usable) for readiness: no token, no command run in the pod, https with TLS."""
    for values, scheme in (({}, "HTTPS"), ({"tls": {"enabled": False}}, "HTTP"),
                           ({"auth": {"enabled": False}, "tls": {"enabled": False}}, "HTTP")):
        docs = render(values)
        for server in (one(docs, "StatefulSet"), one(docs, "Deployment")):
            c = container(server)
            for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                                ("readinessProbe", "/readyz")):
                assert c[probe]["httpGet"] == {"path": path, "port": "http", "scheme": scheme}
                assert "exec" not in c[probe] and "tcpSocket" not in c[probe]
            # nothing in the pod presents monitor.token any more: it is not mounted
            if "tokens" in volumes(server):
                keys = [i["key"] for i in volumes(server)["tokens"]["secret"]["items"]]
                assert "monitor.token" not in keys
    hub = container(one(render(), "Deployment"))
    assert hub["startupProbe"]["failureThreshold"] == 720  # hub.startupSeconds / 10


def test_service_monitors_only_where_the_operator_is(operator_chart):
    # without the CRDs (no cluster, or one without the operator): none, even when enabled
    assert not by_kind(render({"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    docs = render(chart=operator_chart)
    validate_all(docs)
    assert not by_kind(render({"serviceMonitor": {"enabled": False}}, chart=operator_chart),
                       "ServiceMonitor")
    # the PrometheusRule (prometheusRule.enabled) likewise: only with the operator's CRDs
    assert not [d for d in render({"prometheusRule": {"enabled": True}})
                if d["apiVersion"].startswith("monitoring.coreos.com/")]
    rules = by_kind(render({"prometheusRule": {"enabled": True}}, chart=operator_chart),
                    "PrometheusRule")
    validate_all(rules)
    monitors = by_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"train-spokefs-hub",
                                                        "train-spokefs-spoke"}
    for m in monitors:
        ep = m["spec"]["endpoints"][0]
        assert ep["path"] == "/metrics"
        assert ep["authorization"]["credentials"] == {"name": "train-spokefs-tokens",
                                                      "key": "monitor.token"}
        assert ep["scheme"] == "https"
        assert ep["tlsConfig"]["ca"]["secret"] == {"name": "train-spokefs-tls", "key": "ca.crt"}
        assert ep["tlsConfig"]["serverName"] in SERVICE_NAMES


def test_default_tls_certificate_names_the_services_and_is_signed_by_the_ca():
    x509 = pytest.importorskip("cryptography.x509", reason="cryptography (via trustme, in the "
                               "test extra) parses the certificates")
    from cryptography.x509.oid import ExtendedKeyUsageOID

    docs = render()
    ca_secret = named(docs, "Secret", "train-spokefs-ca")
    tls_secret = named(docs, "Secret", "train-spokefs-tls")
    assert tls_secret["type"] == ca_secret["type"] == "kubernetes.io/tls"
    assert set(tls_secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}

    dns, ips = san(secret_file(tls_secret, "tls.crt"))
    assert dns == SERVICE_NAMES | {MEMBERS, "localhost"}
    assert ips == {"127.0.0.1", "::1"}

    ca_pem = secret_file(ca_secret, "tls.crt")
    assert certificates(secret_file(tls_secret, "ca.crt")) == certificates(ca_pem)
    ca = x509.load_pem_x509_certificate(ca_pem)
    leaf = x509.load_pem_x509_certificate(secret_file(tls_secret, "tls.crt"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    leaf.verify_directly_issued_by(ca)
    usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days >= 3649
    # the key in the Secret is the certificate's, and the bundle carries no key
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = load_pem_private_key(secret_file(tls_secret, "tls.key"), password=None)
    assert key.public_key() == leaf.public_key()
    assert b"PRIVATE KEY" not in secret_file(tls_secret, "ca.crt")


def _handshake(cert: bytes, key: bytes, bundle: bytes, name: str, tmp: Path) -> None:
    """One TLS handshake: a server set up as spokefs's (spokefs.wire.tls.server_context) with
    cert and key, a client verifying name against bundle as spokefs's clients do."""
    from spokefs.wire.tls import server_context

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tls.crt").write_bytes(cert)
    (tmp / "tls.key").write_bytes(key)
    (tmp / "ca.crt").write_bytes(bundle)
    server = server_context(tmp / "tls.crt", tmp / "tls.key")
    client = ssl.create_default_context(cafile=str(tmp / "ca.crt"))  # client_context() so
    with socket.create_server(("127.0.0.1", 0)) as listener:
        failure: list[BaseException] = []

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(1)
            except (ssl.SSLError, OSError) as exc:  # the client hung up on a refused name
                failure.append(exc)

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=10) as raw, \
                    client.wrap_socket(raw, server_hostname=name) as tls:
                tls.sendall(b"x")
        finally:
            t.join(10)


@pytest.mark.parametrize("name", [
    "train-spokefs-spoke.ml.svc.cluster.local",      # the mounts' URL
    "train-spokefs-hub.ml.svc.cluster.local",        # the spokes' upstream
    "train-spokefs-spoke-2.train-spokefs-spoke-headless.ml.svc.cluster.local",  # --advertise
    "localhost", "127.0.0.1",                        # the readiness probes
])
def test_default_tls_certificate_is_trusted_by_clients_for_each_name(name, tmp_path):
    s = named(render(), "Secret", "train-spokefs-tls")
    _handshake(secret_file(s, "tls.crt"), secret_file(s, "tls.key"), secret_file(s, "ca.crt"),
               name, tmp_path)


def test_default_tls_certificate_is_refused_for_other_names_and_other_cas(tmp_path):
    s = named(render(), "Secret", "train-spokefs-tls")
    cert, key, bundle = (secret_file(s, k) for k in ("tls.crt", "tls.key", "ca.crt"))
    with pytest.raises(ssl.SSLCertVerificationError, match=r"[Hh]ostname mismatch"):
        _handshake(cert, key, bundle, "train-spokefs-spoke.other.svc.cluster.local",
                   tmp_path / "a")
    with pytest.raises(ssl.SSLCertVerificationError, match=r"[Hh]ostname mismatch"):
        _handshake(cert, key, bundle, "a.b.train-spokefs-spoke-headless.ml.svc.cluster.local",
                   tmp_path / "b")
    other = named(render(), "Secret", "train-spokefs-tls")  # a new CA (no cluster to look up)
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        _handshake(cert, key, secret_file(other, "ca.crt"),
                   "train-spokefs-spoke.ml.svc.cluster.local", tmp_path / "c")


LOOKUPS = ('lookup "v1" "Secret" .Release.Namespace $caName',
           'lookup "v1" "Secret" .Release.Namespace $secret')


@pytest.fixture(scope="module")
def upgrade_chart(tmp_path_factory) -> Path:
    """A copy of the chart whose two `lookup` calls read .Values.cluster (Secrets by name)
    instead of a cluster this test does not have; the schema is left out to allow that value."""
    import shutil

    copy = tmp_path_factory.mktemp("chart") / "spokefs"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    tls = copy / "templates" / "tls.yaml"
    text = tls.read_text()
    for call in LOOKUPS:
        assert text.count(call) == 1, f"tls.yaml no longer has: {call}"
        name = call.rsplit(" ", 1)[1]
        text = text.replace(call, f"dig {name} (dict) .Values.cluster")
    tls.write_text(text)
    return copy


def render_upgrade(chart: Path, previous: list[dict[str, Any]],
                   values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    cluster = {d["metadata"]["name"]: d for d in previous if d["kind"] == "Secret"}
    with helm_python.Chart.load(chart) as c:
        out = c.render({**(values or {}), "cluster": cluster}, name="train",
                       namespace=NAMESPACE, is_upgrade=True)
    return [d for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]


def test_upgrade_keeps_the_ca_and_the_certificate(upgrade_chart, tmp_path):
    x509 = pytest.importorskip("cryptography.x509", reason="cryptography (via trustme, in the "
                               "test extra) parses the certificates")

    first = render()
    again = render_upgrade(upgrade_chart, first)
    for name in ("train-spokefs-ca", "train-spokefs-tls"):
        assert named(again, "Secret", name)["data"] == named(first, "Secret", name)["data"]

    # new names: the same CA signs a new certificate that has them; old clients still trust it
    more = render_upgrade(upgrade_chart, first, {"tls": {"extraDnsNames": ["spokes.example"]}})
    assert named(more, "Secret", "train-spokefs-ca")["data"] == named(
        first, "Secret", "train-spokefs-ca")["data"]
    old, new = named(first, "Secret", "train-spokefs-tls"), named(more, "Secret",
                                                                   "train-spokefs-tls")
    assert secret_file(new, "tls.crt") != secret_file(old, "tls.crt")
    assert "spokes.example" in san(secret_file(new, "tls.crt"))[0]
    assert secret_file(new, "ca.crt") == secret_file(old, "ca.crt")
    x509.load_pem_x509_certificate(secret_file(new, "tls.crt")).verify_directly_issued_by(
        x509.load_pem_x509_certificate(secret_file(old, "ca.crt")))
    _handshake(secret_file(new, "tls.crt"), secret_file(new, "tls.key"),
               secret_file(old, "ca.crt"), "spokes.example", tmp_path)
    assert (one(more, "StatefulSet")["spec"]["template"]["metadata"]["annotations"]
            != one(first, "StatefulSet")["spec"]["template"]["metadata"]["annotations"])

    # the CA's Secret gone: a new CA, and a certificate of the new CA (never the old one)
    fresh = render_upgrade(upgrade_chart, [named(first, "Secret", "train-spokefs-tls")])
    assert secret_file(named(fresh, "Secret", "train-spokefs-tls"), "ca.crt") != \
        secret_file(old, "ca.crt")
    assert secret_file(named(fresh, "Secret", "train-spokefs-tls"), "tls.crt") != \
        secret_file(old, "tls.crt")


def test_servers_and_clients_are_wired_to_the_chart_certificate():
    docs = render()
    spoke, hub, mount = one(docs, "StatefulSet"), one(docs, "Deployment"), one(docs, "DaemonSet")
    for server in (spoke, hub):
        c = container(server)
        assert {"--tls-cert=/etc/spokefs/tls/tls.crt",
                "--tls-key=/etc/spokefs/tls/tls.key"} <= set(c["args"])
        assert {"name": "tls", "mountPath": "/etc/spokefs/tls", "readOnly": True} in \
            c["volumeMounts"]
        tls = volumes(server)["tls"]["secret"]
        assert tls["secretName"] == "train-spokefs-tls"
        assert [i["key"] for i in tls["items"]] == ["tls.crt", "tls.key"]
        # the servers restart when the certificate's names change, not on every upgrade
        annotations = server["spec"]["template"]["metadata"]["annotations"]
        assert annotations["spokefs.io/tls-names"] == named(
            docs, "Secret", "train-spokefs-tls")["metadata"]["annotations"]["spokefs.io/tls-names"]
    # the spoke is also a client (upstream, members): it trusts the bundle
    assert container(spoke)["args"][:2] == ["--ca-bundle=/etc/spokefs/ca/ca.crt", "spoke"]
    # every pod that trusts, trusts the chart's bundle; only servers see a key; no pod
    # mounts the CA's key
    for doc in (spoke, hub, mount):
        vols = volumes(doc)
        assert vols["ca"]["secret"] == {"secretName": "train-spokefs-tls",
                                        "items": [{"key": "ca.crt", "path": "ca.crt"}]}
        assert all(v.get("secret", {}).get("secretName") != "train-spokefs-ca"
                   for v in vols.values())
    assert "tls" not in volumes(mount)
    assert not [a for a in container(mount)["args"] if a.startswith("--tls")]


def test_tls_disabled_removes_certificates_and_flags(operator_chart):
    docs = render({"tls": {"enabled": False}}, chart=operator_chart)
    validate_all(docs)
    assert not by_kind(docs, "Secret")
    spoke, hub, mount = one(docs, "StatefulSet"), one(docs, "Deployment"), one(docs, "DaemonSet")
    for doc in (spoke, hub, mount):
        c = container(doc)
        flat = " ".join(c["args"]) + " " + " ".join(c.get("readinessProbe", {}).get(
            "exec", {}).get("command", []))
        assert "--tls-" not in flat and "--ca-bundle" not in flat and "https://" not in flat
        assert not {"tls", "ca"} & set(volumes(doc))
        assert "annotations" not in doc["spec"]["template"]["metadata"]
    assert "--upstream=http://train-spokefs-hub.ml.svc.cluster.local:8470" in \
        container(spoke)["args"]
    for m in by_kind(docs, "ServiceMonitor"):
        assert m["spec"]["endpoints"][0]["scheme"] == "http"
        assert "tlsConfig" not in m["spec"]["endpoints"][0]


def test_extra_names_and_another_regions_ca(tmp_path):
    region_a = named(render({"spoke": {"enabled": False}, "mount": {"enabled": False},
                             "tls": {"extraDnsNames": ["hub.region-a.example.org"]},
                             "networkPolicy": {"hub": {"extraFrom": [
                                 {"ipBlock": {"cidr": "198.51.100.0/24"}}]}}}),
                     "Secret", "train-spokefs-tls")
    dns, _ = san(secret_file(region_a, "tls.crt"))
    assert "hub.region-a.example.org" in dns
    assert not [n for n in dns if "spokefs-spoke" in n]  # no spoke in that release: not named
    a_ca = secret_file(region_a, "ca.crt").decode()

    docs = render({"hub": {"enabled": False},
                   "spoke": {"upstream": "https://hub.region-a.example.org:8470"},
                   "tls": {"extraCaBundle": a_ca}})
    validate_all(docs)
    region_b = named(docs, "Secret", "train-spokefs-tls")
    bundle = secret_file(region_b, "ca.crt")
    assert len(certificates(bundle)) == 2
    assert certificates(bundle)[0] == certificates(
        secret_file(named(docs, "Secret", "train-spokefs-ca"), "tls.crt"))[0]
    # region B's spokes trust region A's hub, and still their own members
    _handshake(secret_file(region_a, "tls.crt"), secret_file(region_a, "tls.key"), bundle,
               "hub.region-a.example.org", tmp_path / "hub")
    _handshake(secret_file(region_b, "tls.crt"), secret_file(region_b, "tls.key"), bundle,
               "train-spokefs-spoke-0.train-spokefs-spoke-headless.ml.svc.cluster.local",
               tmp_path / "member")
    # new names, new digest: the servers' pods roll to load the re-signed certificate
    default = named(render(), "Secret", "train-spokefs-tls")["metadata"]["annotations"]
    assert region_a["metadata"]["annotations"] != default


def test_cert_manager_issues_the_certificate_instead():
    docs = render({"tls": {"certManager": {"enabled": True}}})
    validate_all(docs)
    assert not by_kind(docs, "Secret")  # cert-manager writes them
    issuers = {i["metadata"]["name"]: i["spec"] for i in by_kind(docs, "Issuer")}
    assert issuers == {"train-spokefs-selfsigned": {"selfSigned": {}},
                       "train-spokefs-ca": {"ca": {"secretName": "train-spokefs-ca"}}}
    ca = named(docs, "Certificate", "train-spokefs-ca")["spec"]
    assert ca["isCA"] is True and ca["secretName"] == "train-spokefs-ca"
    assert ca["issuerRef"]["name"] == "train-spokefs-selfsigned"
    assert ca["privateKey"]["rotationPolicy"] == "Never"  # the clients' bundle stays valid
    serving = named(docs, "Certificate", "train-spokefs-tls")["spec"]
    assert serving["secretName"] == "train-spokefs-tls"
    assert set(serving["dnsNames"]) == SERVICE_NAMES | {MEMBERS, "localhost"}
    assert set(serving["ipAddresses"]) == {"127.0.0.1", "::1"}
    assert serving["issuerRef"] == {"name": "train-spokefs-ca", "kind": "Issuer",
                                    "group": "cert-manager.io"}
    assert "server auth" in serving["usages"] and "isCA" not in serving
    # the pods read the Secret cert-manager writes, and the ca.crt it puts there
    spoke = one(docs, "StatefulSet")
    assert volumes(spoke)["tls"]["secret"]["secretName"] == "train-spokefs-tls"
    assert volumes(spoke)["ca"]["secret"]["secretName"] == "train-spokefs-tls"
    assert "--tls-cert=/etc/spokefs/tls/tls.crt" in container(spoke)["args"]

    docs = render({"tls": {"certManager": {"enabled": True, "issuerRef": {
        "name": "internal-ca", "kind": "ClusterIssuer"}}}})
    validate_all(docs)
    assert not by_kind(docs, "Issuer")
    serving = one(docs, "Certificate")["spec"]
    assert serving["issuerRef"] == {"name": "internal-ca", "kind": "ClusterIssuer",
                                    "group": "cert-manager.io"}


def test_the_certificate_schemas_can_fail():
    docs = render({"tls": {"certManager": {"enabled": True}}})
    cert = named(docs, "Certificate", "train-spokefs-tls")
    cert["spec"]["privateKey"]["size"] = 2048  # ECDSA
    with pytest.raises(jsonschema.ValidationError):
        validate_all([cert])
    issuer = named(docs, "Issuer", "train-spokefs-ca")
    issuer["spec"]["selfSigned"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate_all([issuer])


def test_mount_only_release_trusts_the_given_ca():
    pem = secret_file(named(render(), "Secret", "train-spokefs-tls"), "ca.crt").decode()
    docs = render({"hub": {"enabled": False}, "spoke": {"enabled": False},
                   "mount": {"spokeUrl": "https://spokes.example.org:8471"},
                   "tls": {"extraCaBundle": pem}})
    validate_all(docs)
    secret = one(docs, "Secret")
    assert set(secret["data"]) == {"ca.crt"}  # no certificate, no key
    assert certificates(secret_file(secret, "ca.crt")) == certificates(pem.encode())
    assert volumes(one(docs, "DaemonSet"))["ca"]["secret"]["secretName"] == secret[
        "metadata"]["name"]
    assert not by_kind(docs, "NetworkPolicy")  # no server here to protect

    docs = render({"hub": {"enabled": False}, "spoke": {"enabled": False},
                   "mount": {"spokeUrl": "https://spokes.example.org:8471"},
                   "tls": {"caSecretName": "spokes-ca"}})
    assert not by_kind(docs, "Secret")
    assert volumes(one(docs, "DaemonSet"))["ca"]["secret"]["secretName"] == "spokes-ca"


def test_default_network_policies_admit_only_the_release_and_prometheus():
    docs = render()
    spoke, hub, mount = one(docs, "StatefulSet"), one(docs, "Deployment"), one(docs, "DaemonSet")
    labels = {"spoke": pod_labels(spoke), "hub": pod_labels(hub), "mount": pod_labels(mount)}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    assert set(policies) == {"train-spokefs-spoke", "train-spokefs-hub"}

    for component, port, admitted in (("spoke", 8471, {"spoke", "mount"}),
                                      ("hub", 8470, {"spoke"})):
        policy = policies[f"train-spokefs-{component}"]
        # it selects exactly that component's pods
        assert {k for k, v in labels.items() if selects(policy["podSelector"], v)} == {component}
        assert policy["policyTypes"] == ["Ingress"] and "egress" not in policy  # egress open
        (rule,) = policy["ingress"]
        assert rule["ports"] == [{"port": port, "protocol": "TCP"}]
        # the port is the one the pods listen on
        doc = spoke if component == "spoke" else hub
        assert container(doc)["ports"][0]["containerPort"] == port
        peers = rule["from"]
        same_namespace = [p for p in peers if "namespaceSelector" not in p]
        assert {k for k, v in labels.items()
                if any(selects(p["podSelector"], v) for p in same_namespace)} == admitted
        (prom,) = [p for p in peers if "namespaceSelector" in p]
        assert prom == {"namespaceSelector": {}, "podSelector": {"matchLabels": prometheus}}
        assert not any(selects(p["podSelector"], prometheus) for p in same_namespace)


def test_network_policy_options():
    assert not by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")

    extra = {"podSelector": {"matchLabels": {"team": "vision"}}}
    docs = render({"tier": {"enabled": False}, "networkPolicy": {
        "prometheus": {"namespaceSelector": {"matchLabels": {
                           "kubernetes.io/metadata.name": "monitoring"}},
                       "podSelector": None},
        "spoke": {"extraFrom": [extra],
                  "egress": [{"to": [{"namespaceSelector": {}}],
                              "ports": [{"port": 53, "protocol": "UDP"}]}]},
        "hub": {"egress": []}}})
    validate_all(docs)
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind(docs, "NetworkPolicy")}
    spoke = policies["train-spokefs-spoke"]
    peers = spoke["ingress"][0]["from"]
    # no tier: the spokes do not talk to each other, so they are not admitted
    assert not any(selects(p.get("podSelector", {"matchLabels": {"x": "y"}}),
                           pod_labels(one(docs, "StatefulSet"))) for p in peers)
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                  "monitoring"}}} in peers
    assert peers[-1] == extra
    assert spoke["policyTypes"] == ["Ingress", "Egress"]
    assert spoke["egress"][0]["ports"] == [{"port": 53, "protocol": "UDP"}]
    hub = policies["train-spokefs-hub"]
    assert hub["policyTypes"] == ["Ingress", "Egress"] and hub["egress"] == []  # no egress

    # nobody left to admit: no ingress rule at all (an empty "from" would admit everyone)
    docs = render({"tier": {"enabled": False}, "mount": {"enabled": False},
                   "hub": {"enabled": False}, "spoke": {"upstream": "https://h.example:8470"},
                   "networkPolicy": {"prometheus": {"enabled": False}}})
    validate_all(docs)
    assert one(docs, "NetworkPolicy")["spec"]["ingress"] == []


def test_mount_privileges_are_only_those_the_docs_justify():
    docs = render({"mount": {"datasets": [{"name": "imagenet"}, {"name": "laion"}]}})
    mount = one(docs, "DaemonSet")
    spec = mount["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert "securityContext" not in spec and "initContainers" not in spec
    hostpaths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert hostpaths == {"mounts": {"path": "/mnt/spokefs", "type": "DirectoryOrCreate"},
                         "fuse": {"path": "/dev/fuse", "type": "CharDevice"}}
    granted = {"privileged": True, "allowPrivilegeEscalation": True, "runAsUser": 0,
               "runAsGroup": 0, "runAsNonRoot": False}
    assert len(spec["containers"]) == 2
    for c in spec["containers"]:
        # exactly these, and the read-only root; a capabilities list would be ignored
        # beside privileged, so there is none to mislead
        assert c["securityContext"] == {**granted, "readOnlyRootFilesystem": True}
        assert [m for m in c["volumeMounts"] if m.get("mountPropagation")] == [
            {"name": "mounts", "mountPath": "/mnt/spokefs", "mountPropagation": "Bidirectional"}]
        assert {m["name"] for m in c["volumeMounts"]} == {"mounts", "fuse", "tmp", "tokens",
                                                          "ca"}
    # privileged is there for Bidirectional: the API's rule (check_api_rules) refuses the
    # container without it
    unprivileged = yaml.safe_load(yaml.safe_dump(mount))
    unprivileged["spec"]["template"]["spec"]["containers"][0]["securityContext"].pop(
        "privileged")
    with pytest.raises(AssertionError, match="Bidirectional mount propagation"):
        check_api_rules(unprivileged)

    # docs/kubernetes.md has a row for each privilege the container keeps, and the template
    # says why in a comment
    text = DOCS.read_text()
    assert "### The mount's privileges" in text
    section = text.split("### The mount's privileges", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines()  # a row's first cell
            if line.startswith("|") and not line.startswith(("|---", "| privilege"))]
    for key, value in granted.items():
        shown = f"`{key}: {str(value).lower()}`"
        assert any(shown in row for row in rows), f"docs/kubernetes.md: no row for {shown}"
    for needed in ("`/dev/fuse`", "`mount.hostPath`", "`mountPropagation: Bidirectional`"):
        assert any(needed in row for row in rows), f"docs/kubernetes.md: no row for {needed}"
    template = (CHART / "templates" / "mount.yaml").read_text()
    for key in granted:
        assert re.search(rf"^#.*\b{key}\b", template, re.M), f"mount.yaml: no comment on {key}"


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
    secret = one(docs, "Secret")  # the tokens; the certificate is the user's spokefs-cert
    assert set(secret["stringData"]) == {"hub.tokens", "spoke.tokens", "upstream.token",
                                         "client.token", "monitor.token"}
    assert volumes(one(docs, "Deployment"))["tls"]["secret"]["secretName"] == "spokefs-cert"
    assert volumes(one(docs, "DaemonSet"))["ca"]["secret"]["secretName"] == "spokefs-cert"
    assert "annotations" not in one(docs, "Deployment")["spec"]["template"]["metadata"]

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
    assert container(spoke)["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"

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


def test_dns_membership_and_a_region_without_a_hub(operator_chart):
    values = {"hub": {"enabled": False}, "tier": {"membership": "dns", "copies": False},
              "spoke": {"upstream": "http://hub.example.org:8470"},
              "tls": {"enabled": False},  # no certificate names pod IPs
              "auth": {"enabled": False}, "mount": {"enabled": False}}
    docs = render(values)
    validate_all(docs)
    assert not by_kind(docs, "Deployment") and not by_kind(docs, "DaemonSet")
    docs = render(values, chart=operator_chart)
    args = container(one(docs, "StatefulSet"))["args"]
    assert "--tier-dns=train-spokefs-spoke-headless.$(POD_NAMESPACE).svc.cluster.local" in args
    assert "--advertise=http://$(POD_IP):8471" in args and "--no-tier-copies" in args
    assert "--insecure" in args and "--upstream=http://hub.example.org:8470" in args
    probe = container(one(docs, "StatefulSet"))["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": "http", "scheme": "HTTP"}
    assert [m["metadata"]["name"] for m in by_kind(docs, "ServiceMonitor")] == [
        "train-spokefs-spoke"]
    assert "authorization" not in by_kind(docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]


CSI = {"csi": {"enabled": True}, "mount": {"enabled": False}}


def test_csi_driver_renders_valid_manifests():
    docs = render(CSI)
    validate_all(docs)
    driver = one(docs, "CSIDriver")
    assert driver["metadata"]["name"] == "csi.spokefs.io"
    assert driver["spec"] == {"attachRequired": False, "podInfoOnMount": True,
                              "fsGroupPolicy": "None",
                              "volumeLifecycleModes": ["Ephemeral", "Persistent"]}
    ds = one(docs, "DaemonSet")
    assert ds["metadata"]["name"] == "train-spokefs-csi-node"
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}  # an upgrade ends no mount
    spec = ds["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    drv, reg = spec["containers"]
    assert (drv["name"], reg["name"]) == ("driver", "node-driver-registrar")
    assert drv["args"][:3] == ["--token-file=/etc/spokefs/tokens/client.token",
                               "--ca-bundle=/etc/spokefs/ca/ca.crt", "csi"]
    assert {"--endpoint=unix:///csi/csi.sock", "--node-id=$(NODE_NAME)",
            "--state-dir=/var/lib/spokefs/csi", "--driver-name=csi.spokefs.io",
            "--spoke-url=https://train-spokefs-spoke.ml.svc.cluster.local:8471"} <= set(
        drv["args"])
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} \
        in drv["env"]
    assert "livenessProbe" not in drv  # a restart would take every mount of the node along
    # Bidirectional on the driver only, onto the kubelet's pods folder at the same path
    propagated = {c["name"]: [m for m in c["volumeMounts"] if m.get("mountPropagation")]
                  for c in (drv, reg)}
    assert propagated == {"driver": [{"name": "pods-dir", "mountPath": "/var/lib/kubelet/pods",
                                      "mountPropagation": "Bidirectional"}],
                          "node-driver-registrar": []}
    assert drv["securityContext"] == {"privileged": True, "allowPrivilegeEscalation": True,
                                      "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                                      "readOnlyRootFilesystem": True}
    assert "privileged" not in reg["securityContext"]
    assert reg["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert reg["args"] == ["--csi-address=/csi/csi.sock", "--kubelet-registration-path="
                           "/var/lib/kubelet/plugins/csi.spokefs.io/csi.sock"]
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (drv, reg)}
    assert mounts["node-driver-registrar"] == {"plugin-dir": "/csi",
                                               "registration-dir": "/registration"}
    assert mounts["driver"]["plugin-dir"] == "/csi"
    hostpaths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert hostpaths == {
        "plugin-dir": {"path": "/var/lib/kubelet/plugins/csi.spokefs.io",
                       "type": "DirectoryOrCreate"},
        "registration-dir": {"path": "/var/lib/kubelet/plugins_registry", "type": "Directory"},
        "pods-dir": {"path": "/var/lib/kubelet/pods", "type": "Directory"},
        "state": {"path": "/var/lib/spokefs/csi", "type": "DirectoryOrCreate"},
        "fuse": {"path": "/dev/fuse", "type": "CharDevice"}}
    assert [i["key"] for i in volumes(ds)["tokens"]["secret"]["items"]] == ["client.token"]
    # the spokes admit the driver's pods (the mounts run there)
    policy = named(docs, "NetworkPolicy", "train-spokefs-spoke")
    assert any(selects(p.get("podSelector", {"matchLabels": {"x": "y"}}), pod_labels(ds))
               for p in policy["spec"]["ingress"][0]["from"])

    # another driver name, kubelet folder, spoke; a release of the driver only
    docs = render({"hub": {"enabled": False}, "spoke": {"enabled": False},
                   "mount": {"enabled": False}, "tls": {"caSecretName": "spokes-ca"},
                   "csi": {"enabled": True, "driverName": "datasets.example.org",
                           "kubeletDir": "/var/lib/k0s/kubelet/",
                           "spokeUrl": "https://spokes.example.org:8471",
                           "updateStrategy": {"type": "RollingUpdate"}}})
    validate_all(docs)
    assert one(docs, "CSIDriver")["metadata"]["name"] == "datasets.example.org"
    ds = one(docs, "DaemonSet")
    drv, reg = ds["spec"]["template"]["spec"]["containers"]
    assert "--spoke-url=https://spokes.example.org:8471" in drv["args"]
    assert reg["args"][1] == ("--kubelet-registration-path=/var/lib/k0s/kubelet/plugins/"
                              "datasets.example.org/csi.sock")
    assert volumes(ds)["pods-dir"]["hostPath"]["path"] == "/var/lib/k0s/kubelet/pods"


# The Pod Security Standard "restricted" (v1.25 on), the rules a pod spec can break
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    bad = []
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {sorted(kinds - _RESTRICTED_VOLUMES)}")
    bad += [k for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    pod_sc = spec.get("securityContext", {})
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities added")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
    return bad


def _example_pods() -> list[tuple[str, dict[str, Any]]]:
    """The training pods with a CSI volume that docs/kubernetes.md and NOTES.txt show."""
    import textwrap

    found = []
    for block in re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S):
        for doc in yaml.safe_load_all(block):
            if doc and doc.get("kind") == "Pod" and "csi" in str(doc):
                found.append(("docs/kubernetes.md", doc))
    text = notes(CSI)
    block = text[text.index("  apiVersion: v1"):].split("\n\n", 1)[0]
    found.append(("NOTES.txt", yaml.safe_load(textwrap.dedent(block))))
    return found


def test_training_pods_with_a_csi_volume_need_no_privilege():
    pods = _example_pods()
    assert [where for where, _ in pods] == ["docs/kubernetes.md", "NOTES.txt"]
    for where, pod in pods:
        validate_all([pod])
        assert restricted_violations(pod["spec"]) == [], where
        (volume,) = [v for v in pod["spec"]["volumes"] if "csi" in v]
        assert volume["csi"]["driver"] == "csi.spokefs.io"
        assert volume["csi"]["volumeAttributes"]["dataset"] == "imagenet"
    # the check can fail: the hostPath way, and the driver itself, are not restricted
    assert restricted_violations(one(render(), "DaemonSet")["spec"]["template"]["spec"])
    assert restricted_violations(one(render(CSI), "DaemonSet")["spec"]["template"]["spec"])


def test_pods_take_service_account_annotations_env_and_volumes():
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/spokefs"}
    env = [{"name": "AWS_REGION", "value": "eu-west-1"}]
    vol = [{"name": "extra-ca", "configMap": {"name": "corp-ca"}}]
    vm = [{"name": "extra-ca", "mountPath": "/etc/corp-ca", "readOnly": True}]
    extras = {"podAnnotations": {"example.org/team": "vision"}, "extraEnv": env,
              "extraVolumes": vol, "extraVolumeMounts": vm}
    docs = render({"hub": {"serviceAccount": {"create": True, "annotations": irsa}, **extras},
                   "spoke": {"serviceAccount": {"annotations": irsa}, **extras},
                   "mount": extras, "csi": {"enabled": True, **extras}})
    validate_all(docs)
    accounts = {a["metadata"]["name"]: a for a in by_kind(docs, "ServiceAccount")}
    assert set(accounts) == {"train-spokefs-hub", "train-spokefs-spoke"}
    for name, a in accounts.items():
        assert a["metadata"]["annotations"] == irsa, name
    hub, spoke = one(docs, "Deployment"), one(docs, "StatefulSet")
    assert hub["spec"]["template"]["spec"]["serviceAccountName"] == "train-spokefs-hub"
    assert hub["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert spoke["spec"]["template"]["spec"]["serviceAccountName"] == "train-spokefs-spoke"
    assert one(docs, "RoleBinding")["subjects"][0]["name"] == "train-spokefs-spoke"
    workloads = [hub, spoke, *by_kind(docs, "DaemonSet")]
    assert len(workloads) == 4
    for w in workloads:
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["example.org/team"] == "vision"
        c = container(w)
        assert c["env"][-1] == env[0] and c["volumeMounts"][-1] == vm[0]
        assert volumes(w)["extra-ca"] == vol[0]
    # the servers keep their own annotation beside the extra one
    assert "spokefs.io/tls-names" in hub["spec"]["template"]["metadata"]["annotations"]

    # an existing service account of your own, e.g. made by eksctl or Terraform
    docs = render({"tier": {"enabled": False},
                   "hub": {"serviceAccount": {"name": "data-reader"}},
                   "spoke": {"serviceAccount": {"name": "data-reader"}}})
    assert not by_kind(docs, "ServiceAccount")
    for w in (one(docs, "Deployment"), one(docs, "StatefulSet")):
        assert w["spec"]["template"]["spec"]["serviceAccountName"] == "data-reader"
        assert w["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    # none asked for: the namespace's default account, no API token
    spec = one(render(), "Deployment")["spec"]["template"]["spec"]
    assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False


NAMESPACE_VALUES: dict[str, Any] = {
    "hub": {"datasets": [
        {"name": "imagenet"},                                    # a folder on hub.data
        {"name": "coco", "source": "s3://team-data/coco", "blockSize": "8MiB",
         "endpoint": "http://minio.storage:9000"},
        {"name": "audio", "existingClaim": "audio-dataset"},     # a volume of its own
        {"name": "text.v2", "source": "/corpora/text", "volume": {"nfs": {
            "server": "nfs.example.org", "path": "/export/text"}}},
    ]},
    "spoke": {"datasetRules": "[datasets.imagenet]\nmin_share = 0.4\n\n"
                              "[datasets.coco]\nmax_share = 0.3\n"},
    "mount": {"namespace": True, "pins": ["imagenet@3fa9c1d20b7e"]},
}


def mount_argv(c: dict[str, Any]) -> list[str]:
    """The spokefs command line a mount container runs: its shell script's `exec spokefs
    "$@" ...` with "$@" (the global options after $0) put back."""
    script, _zero, *global_opts = c["args"]
    tail = script.split('exec spokefs "$@" ', 1)[1]
    return [*global_opts, *shlex.split(tail)]


def test_one_release_serves_a_namespace():
    """hub.datasets is the hub's config file, read by the hub's own loader; each folder is on
    a mounted volume; the spokes get the rules file; one mount per node shows the namespace."""
    import tomllib

    from spokefs.cli import build_parser
    from spokefs.hub.namespace import parse_datasets
    from spokefs.mount.run import parse_pins
    from spokefs.mount.source import Target
    from spokefs.spoke.datasets import parse_rules

    docs = render(NAMESPACE_VALUES)
    validate_all(docs)
    hub = one(docs, "Deployment")
    c = container(hub)
    assert "--config=/etc/spokefs/hub/hub.toml" in c["args"]
    # no DIR and no --name: the datasets come from the file only
    assert [a for a in c["args"] if not a.startswith("-")] == ["hub", "serve"], c["args"]
    assert not [a for a in c["args"] if a.startswith("--name")]
    cm = named(docs, "ConfigMap", "train-spokefs-hub-datasets")
    mounted = {m["mountPath"]: m for m in c["volumeMounts"]}
    conf = mounted["/etc/spokefs/hub"]
    assert conf["readOnly"] is True
    assert volumes(hub)[conf["name"]]["configMap"]["name"] == "train-spokefs-hub-datasets"
    # A ConfigMap volume, not a subPath: the kubelet updates it in place and the hub reloads.
    assert "subPath" not in conf
    specs = parse_datasets(tomllib.loads(cm["data"]["hub.toml"]),
                           Path("/etc/spokefs/hub/hub.toml"), 4 << 20, "/var/lib/spokefs/hub",
                           None)
    by_name = {s.name: s for s in specs}
    assert set(by_name) == {"imagenet", "coco", "audio", "text.v2"}
    assert by_name["coco"].source == "s3://team-data/coco"
    assert by_name["coco"].block_size == 8 << 20 and by_name["imagenet"].block_size == 4 << 20
    assert by_name["coco"].endpoint == "http://minio.storage:9000"
    assert by_name["audio"].state_dir == "/var/lib/spokefs/hub/audio"
    assert by_name["audio"].source == "/datasets/audio"
    assert by_name["imagenet"].source == "/data/imagenet"
    # every folder lies on a read-only volume of the hub's pod: the claim or source it names
    sources = {"imagenet": {"persistentVolumeClaim": {"claimName": "dataset",
                                                      "readOnly": True}},
               "audio": {"persistentVolumeClaim": {"claimName": "audio-dataset",
                                                   "readOnly": True}},
               "text.v2": {"nfs": {"server": "nfs.example.org", "path": "/export/text"}}}
    for name, source in sources.items():
        path = by_name[name].source
        under = [m for p, m in mounted.items() if path == p or path.startswith(p + "/")]
        mount = max(under, key=lambda m: len(m["mountPath"]))
        assert mount["readOnly"] is True, name
        vol = dict(volumes(hub)[mount["name"]])
        vol.pop("name")
        assert vol == source, name

    spoke = one(docs, "StatefulSet")
    sc = container(spoke)
    assert "--dataset-config=/etc/spokefs/rules/datasets.toml" in sc["args"]
    rules = named(docs, "ConfigMap", "train-spokefs-spoke-rules")["data"]["datasets.toml"]
    _default, per = parse_rules(rules)
    assert per["imagenet"].min_share == 0.4 and per["coco"].max_share == 0.3
    assert {"name": "rules", "mountPath": "/etc/spokefs/rules", "readOnly": True} in (
        sc["volumeMounts"])

    mount = one(docs, "DaemonSet")
    [mc] = mount["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(mount_argv(mc))
    assert Target.parse(args.url).namespace
    assert args.url == "https://train-spokefs-spoke.ml.svc.cluster.local:8471/"
    assert str(args.mountpoint) == "/mnt/spokefs"
    assert parse_pins(args.pin) == {"imagenet": "3fa9c1d20b7e"}
    assert mc["lifecycle"]["preStop"]["exec"]["command"] == ["spokefs", "umount",
                                                              "/mnt/spokefs"]
    assert {"name": "mounts", "mountPath": "/mnt/spokefs",
            "mountPropagation": "Bidirectional"} in mc["volumeMounts"]


def test_the_docs_namespace_values_render():
    """docs/kubernetes.md's values-team.yaml renders valid manifests, as it says."""
    block = re.search(r"```yaml\n# values-team.yaml\n(.+?)```", DOCS.read_text(), re.S)
    assert block, "docs/kubernetes.md: the values-team.yaml example moved"
    docs = render(yaml.safe_load(block.group(1)))
    validate_all(docs)
    cm = named(docs, "ConfigMap", "train-spokefs-hub-datasets")["data"]["hub.toml"]
    assert all(f'[datasets."{n}"]' in cm for n in ("imagenet", "laion", "audio"))
    [mc] = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    assert "--pin=imagenet@3fa9c1d20b7e" in " ".join(mount_argv(mc))


def test_a_namespace_of_buckets_needs_no_data_volume():
    docs = render({"hub": {"datasets": [{"name": "a", "source": "gs://b/a"},
                                        {"name": "b", "source": "az://c/b"}]}})
    validate_all(docs)
    hub = one(docs, "Deployment")
    assert "data" not in volumes(hub)
    assert "/data" not in {m["mountPath"] for m in container(hub)["volumeMounts"]}


def test_the_single_dataset_form_stays():
    docs = render({"hub": {"dataset": {"name": "coco", "path": "/srv/coco"}}})
    c = container(one(docs, "Deployment"))
    assert c["args"][:4] == ["hub", "serve", "/srv/coco", "--name=coco"]
    assert not by_kind(docs, "ConfigMap")
    mount = one(docs, "DaemonSet")
    assert [x["name"] for x in mount["spec"]["template"]["spec"]["containers"]] == [
        "mount-imagenet"]


@pytest.mark.parametrize(("values", "message"), [
    ({"hub": {"enabled": False}}, "spoke.upstream is required"),
    ({"tier": {"membership": "gossip"}}, "tier.membership must be"),
    ({"hub": {"data": {"existingClaim": ""}}}, "where the dataset is"),
    ({"auth": {"create": True}}, "auth.tokens."),
    # values.schema.json: a misspelt key, a bad dataset name
    ({"spoke": {"cache": {"storageclass": "x"}}}, "'storageclass' not allowed"),
    ({"mount": {"datasets": [{"name": "../etc"}]}}, "does not match pattern"),
    # TLS: members named by pod IP cannot be certified; what the chart cannot make
    ({"tier": {"membership": "dns"}}, "no certificate can name"),
    ({"tls": {"extraCaBundle": "not a certificate"}}, "must hold PEM certificates"),
    ({"tls": {"certManager": {"enabled": True},
              "extraCaBundle": "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----"}},
     "with cert-manager, give tls.caSecretName"),
    ({"hub": {"enabled": False}, "spoke": {"enabled": False},
      "mount": {"spokeUrl": "https://s.example:8471"}}, "the chart makes no certificate"),
    ({"tls": {"certManager": {"enabled": True, "issuerRef": {"kind": "ClusterIssuer"}}}},
     "issuerRef needs a name"),
    ({"tls": {"certManager": {"issuer": {"name": "x"}}}}, "'issuer' not allowed"),
    ({"tls": {"extraDnsNames": ["Bad_Name"]}}, "does not match pattern"),
    # NetworkPolicy: a hub whose spokes are elsewhere needs them named; no empty Prometheus
    ({"spoke": {"enabled": False}, "mount": {"enabled": False}}, "networkPolicy.hub.extraFrom"),
    ({"networkPolicy": {"prometheus": {"namespaceSelector": None, "podSelector": None}}},
     "give a namespaceSelector or a podSelector"),
    ({"networkPolicy": {"spoke": {"egress": {}}}}, "egress"),
    ({"networkPolicy": {"prometheus": {"podselector": {}}}}, "'podselector' not allowed"),
    # the CSI driver, pod extras, the reserved PrometheusRule
    ({"csi": {"enabled": True, "driverName": "Spokefs_CSI"}}, "does not match pattern"),
    ({"csi": {"updateStrategy": {"type": "Recreate"}}}, "value must be one of"),
    ({"csi": {"enable": True}}, "'enable' not allowed"),
    ({"csi": {"spokeUrl": "https://spokes.example.org:8471/imagenet"}}, "does not match"),
    ({"hub": {"enabled": False}, "spoke": {"enabled": False}, "mount": {"enabled": False},
      "tls": {"caSecretName": "x"}, "csi": {"enabled": True}}, "csi.spokeUrl is required"),
    ({"spoke": {"extraEnv": [{"value": "x"}]}}, "missing property 'name'"),
    ({"hub": {"extraVolumeMounts": [{"name": "x", "mountPath": "relative"}]}},
     "does not match"),
    ({"hub": {"serviceAccount": {"annotations": {"a": 1}}}}, "want string"),
    ({"spoke": {"podAnnotations": {"a": True}}}, "want string"),
    ({"prometheusRule": {"enabeld": True}}, "'enabeld' not allowed"),
    ({"prometheusRule": {"hitRatioBelow": 2}}, "maximum: got 2"),
    # a namespace release: the hub's dataset list, the mount's pins
    ({"hub": {"datasets": [{"name": "a"}, {"name": "a", "source": "s3://b/a"}]}},
     '"a" is named twice'),
    ({"hub": {"datasets": [{"source": "/data/x"}]}}, "missing property 'name'"),
    ({"hub": {"datasets": [{"name": "../x"}]}}, "does not match pattern"),
    ({"hub": {"datasets": [{"name": "x", "source": "relative/x"}]}}, "does not match pattern"),
    ({"hub": {"datasets": [{"name": "x", "blockSize": "lots"}]}}, "blockSize"),
    ({"hub": {"datasets": [{"name": "x", "srouce": "/data/x"}]}}, "'srouce' not allowed"),
    ({"hub": {"datasets": [{"name": "x", "source": "/elsewhere/x"}]}}, "is on no volume"),
    ({"hub": {"datasets": [{"name": "x", "source": "s3://b/x", "existingClaim": "c"}]}},
     "takes no existingClaim or volume"),
    ({"hub": {"datasets": [{"name": "x", "existingClaim": "c", "volume": {"nfs": {}}}]}},
     "give existingClaim or volume, not both"),
    ({"hub": {"datasets": [{"name": "x", "existingClaim": "c", "source": "/m"},
                           {"name": "y", "existingClaim": "d", "source": "/m/"}]}},
     "another volume is already mounted at /m"),
    ({"mount": {"pins": ["imagenet@abc"]}}, "set mount.namespace=true"),
    ({"mount": {"namespace": True, "pins": ["imagenet"]}}, "does not match pattern"),
    ({"mount": {"namespace": True, "pins": ["a@x", "a@y"]}}, '"a" is pinned twice'),
    ({"spoke": {"datasetRules": ["min_share = 1"]}}, "want string"),
])
def test_bad_values_fail_with_a_message(values, message):
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


def test_chart_lints_clean():
    report = helm_python.lint(CHART, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
