"""The Helm chart: lint, render, validate, and run the configuration it ships.

Rendering uses the real Helm engine (helm-python binds Helm's Go SDK); manifests of
built-in kinds are validated against the Kubernetes 1.31 OpenAPI schemas; the
Prometheus Operator objects are checked for the structure the operator reads, and
their alert rules with promtool. The processor configuration taken out of the
rendered ConfigMap is then run by ``durable-check serve``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm
import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporters.config import OtlpConfig
from exporters.otlp_spans import OtlpSpanExporter
from exporters.resource import resource_attributes
from processor._version import __version__
from processor.config import Config
from processor.telemetry import Telemetry
from tests._deploy_support import (
    REPO,
    ServeProcess,
    base_env,
    check_config,
    give_to_unprivileged,
    rewrite_for_localhost,
    unprivileged_workdir,
    write_yaml,
)
from tests.pg_support import fresh_database, pg_server
from tests.servers import OtlpGrpcReceiver, alertmanager_server, make_violation, prometheus_server, wait_until

CHART = REPO / "deploy/helm/durable-check"
CI_FILES = sorted((CHART / "ci").glob("*.yaml"))
BAD_VALUES = sorted((REPO / "tests/testdata/helm/bad-values").glob("*.yaml"))
# Contradictions the schema cannot express: the templates stop with a message naming the value.
BAD_VALUES_TEMPLATE = sorted((REPO / "tests/testdata/helm/bad-values-template").glob("*.yaml"))
KUBE_VERSION = "1.31.0"
__all__ = ["pg_server"]  # the fixture, used by name
RELEASE = "example"
NAMESPACE = "default"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def render(values: dict[str, Any], *, name: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values, name=name, namespace=namespace)


def manifests(values: dict[str, Any], **kwargs: str) -> list[dict[str, Any]]:
    """Every rendered object (NOTES.txt aside)."""
    objects: list[dict[str, Any]] = []
    for path, text in render(values, **kwargs).items():
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def first_tier(obj: dict[str, Any]) -> bool:
    """Whether ``obj`` belongs to the first tier (firstTier.enabled), not to the evaluators."""
    return str(obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")).startswith("first-tier")


def workload(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluators' StatefulSet or Deployment."""
    (found,) = [o for o in objects if o["kind"] in {"StatefulSet", "Deployment"} and not first_tier(o)]
    return found


def config_volume_sources(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The projected sources of the volume mounted at /etc/durable-check."""
    pod = workload(objects)["spec"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/etc/durable-check"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    sources: list[dict[str, Any]] = volume["projected"]["sources"]
    return sources


def processor_configmap(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The ConfigMap holding serve's configuration (the Grafana dashboard may have one of its own)."""
    found = [o for o in by_kind(objects, "ConfigMap") if "config.yaml" in o.get("data", {}) and not first_tier(o)]
    assert len(found) == 1, f"expected one ConfigMap with config.yaml, found {len(found)}"
    return found[0]


def processor_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    config = yaml.safe_load(processor_configmap(objects)["data"]["config.yaml"])
    assert isinstance(config, dict)
    return config


# Every optional branch of the templates at once (beyond the ci/ files).
ALL_OPTIONS: dict[str, Any] = {
    "mode": "deployment", "replicaCount": 3, "postgres": {"existingSecret": "pg", "key": "url"},
    "image": {"repository": "registry.example.com/durable-check",
              "digest": "sha256:" + "ab" * 32},
    "imagePullSecrets": [{"name": "registry"}],
    "tls": {"enabled": True, "existingSecret": "tls", "clientAuth": False},
    "auth": {"enabled": True, "existingSecret": "token", "key": "token"},
    "service": {"type": "LoadBalancer", "annotations": {"a": "b"}, "loadBalancerSourceRanges": ["10.0.0.0/8"]},
    "headlessService": {"enabled": True, "annotations": {"c": "d"}},
    "extraEnv": [{"name": "WEBHOOK_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hook", "key": "token"}}},
                 {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "deployment.environment=prod"}],
    "extraEnvFrom": [{"configMapRef": {"name": "more"}}],
    "extraVolumes": [{"name": "spare", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "spare", "mountPath": "/spare"}],
    "config": {"exporters": {"webhook": {"url": "http://hooks.example.com/x",
                                         "headers": {"authorization": "Bearer ${env:WEBHOOK_TOKEN}"}}}},
    "annotations": {"e": "f"}, "podAnnotations": {"g": "h"}, "podLabels": {"team": "agents"},
    "additionalLabels": {"cost-center": "ai"},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "agents", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100,
        "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "durable-check"}}},
    }]}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway",
                                   "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "durable-check"}}}],
    "priorityClassName": "high",
    "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
    "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 9, "targetCPUUtilizationPercentage": 70,
                    "targetMemoryUtilizationPercentage": 80,
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}}},
    "serviceMonitor": {"enabled": True, "interval": "10s", "scrapeTimeout": "5s",
                       "relabelings": [{"targetLabel": "cluster", "replacement": "prod"}],
                       "metricRelabelings": [{"sourceLabels": ["__name__"], "regex": "go_.*", "action": "drop"}]},
    "prometheusRule": {"enabled": True},
    "serviceAccount": {"create": True, "name": "dc", "annotations": {"i": "j"}},
    "collectorResolverAccess": {"enabled": True, "serviceAccount": {"name": "collector", "namespace": "otel"}},
}
STATEFUL_OPTIONS: dict[str, Any] = {
    "replicaCount": 2,
    "persistence": {"size": "20Gi", "storageClassName": "fast", "accessModes": ["ReadWriteOncePod"],
                    "annotations": {"k": "l"}},
    "statefulset": {"podManagementPolicy": "OrderedReady",
                    "persistentVolumeClaimRetentionPolicy": {"enabled": True, "whenDeleted": "Delete",
                                                             "whenScaled": "Retain"}},
    "serviceAccount": {"create": False, "name": "existing"},
    "ports": {"otlp": {"containerPort": 14317, "servicePort": 4317, "appProtocol": "grpc"},
              "otlp-http": {"containerPort": 14318, "servicePort": 4318, "appProtocol": "http"},
              "metrics": {"enabled": False, "containerPort": 9464, "servicePort": 9464}},
    "livenessProbe": {}, "startupProbe": {},
    "firstTier": {"enabled": True, "replicaCount": 3, "sessionsEndpoint": "otel-collector.observability:14317",
                  "insecure": False,
                  "config": {"queue": {"max_requests": 8}, "route": {"checkpoint_interval": "500ms"}},
                  "resources": {"requests": {"cpu": "1"}}, "persistence": {"size": "5Gi"}},
    "extraEnv": [{"name": "OTEL_RESOURCE_ATTRIBUTES",
                  "valueFrom": {"configMapKeyRef": {"name": "otel-resource", "key": "attributes"}}}],
}

# Every branch of the first tier's templates: TLS and auth on its receivers, its ServiceMonitor,
# the shared pod extras and its own scheduling, every section firstTier.config may set.
FIRST_TIER_OPTIONS: dict[str, Any] = {
    "replicaCount": 3,
    "config": {"evaluate": {"allowed_lateness": "10s"}},
    "tls": {"enabled": True, "existingSecret": "tls", "clientAuth": True},
    "auth": {"enabled": True, "existingSecret": "token", "key": "token"},
    "ui": {"enabled": True},
    "rules": {"mine.yaml": "version: 1\nrules: []\n"},
    "serviceMonitor": {"enabled": True, "interval": "15s"},
    "podDisruptionBudget": {"enabled": True},
    "extraEnv": [{"name": "COLLECTOR_TOKEN", "valueFrom": {"secretKeyRef": {"name": "collector", "key": "token"}}},
                 {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "deployment.environment=prod"}],
    "extraVolumes": [{"name": "collector-ca", "configMap": {"name": "collector-ca"}}],
    "extraVolumeMounts": [{"name": "collector-ca", "mountPath": "/etc/collector-ca", "readOnly": True}],
    "podAnnotations": {"team": "agents"}, "podLabels": {"tier-owner": "platform"},
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "durable-check"}}},
    }]}},
    "firstTier": {
        "enabled": True, "replicaCount": 2, "sessionsEndpoint": "otel-collector.observability:14317",
        "insecure": False,
        "config": {"queue": {"max_requests": 64}, "convert": {}, "evaluate": {"session_idle_timeout": "1d"},
                   "state": {"journal_max_size": "512MiB", "synchronous": "full", "busy_timeout": "5s"},
                   "route": {"ca_file": "/etc/collector-ca/ca.crt", "checkpoint_interval": "2s",
                             "headers": {"authorization": "Bearer ${env:COLLECTOR_TOKEN}"}},
                   "exporters": {"otlp_metrics": {"endpoint": "otel-collector.observability:4317"}},
                   "telemetry": {}},
        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
        "persistence": {"size": "2Gi"},
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "durable-check-first-tier"}}},
        }]}},
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "durable-check-first-tier"}}}],
    },
}

VALUE_SETS = [
    pytest.param({}, id="chart-defaults"),
    pytest.param(ALL_OPTIONS, id="all-options"),
    pytest.param(STATEFUL_OPTIONS, id="statefulset-options"),
    pytest.param(FIRST_TIER_OPTIONS, id="first-tier-options"),
] + [
    pytest.param(load_values(path), id=path.stem) for path in CI_FILES
]


def test_chart_deploys_this_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["appVersion"] == __version__, "the image tag defaults to appVersion"
    image = workload(manifests({}))["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"durable-check:{__version__}"


def test_ci_values_cover_every_mode_and_option() -> None:
    names = {path.stem for path in CI_FILES}
    assert {"default-values", "postgres-values", "monitoring-values", "tls-values", "first-tier-values",
            "first-tier-postgres-values"} <= names


def test_chart_lints() -> None:
    value_sets: list[dict[str, Any]] = [{}, ALL_OPTIONS, STATEFUL_OPTIONS, FIRST_TIER_OPTIONS,
                                        *(load_values(path) for path in CI_FILES)]
    for values in value_sets:
        report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["errors"] == [], report
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert serious == [], serious


@pytest.mark.parametrize("values", VALUE_SETS)
def test_rendered_manifests_validate(values: dict[str, Any]) -> None:
    objects = manifests(values)
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    for pod in (o["spec"]["template"]["spec"] for o in objects if o["kind"] in {"StatefulSet", "Deployment"}):
        mounts = [m["mountPath"].rstrip("/") for c in pod["containers"] for m in c["volumeMounts"]]
        for outer in mounts:
            nested = [m for m in mounts if m.startswith(outer + "/")]
            # The kubelet cannot create a mount point inside a read-only ConfigMap/Secret mount.
            assert not nested, f"{nested} inside {outer}"
    for obj in by_kind(objects, "ServiceMonitor"):
        check_service_monitor(obj, objects)
    for obj in by_kind(objects, "PrometheusRule"):
        check_prometheus_rule(obj)


def check_service_monitor(monitor: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "sampleLimit"}
    selected = [
        s for s in by_kind(objects, "Service")
        if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    if first_tier(monitor):
        # The first tier's headless Service: it has no other.
        assert [s["metadata"]["name"] for s in selected] == [f"{RELEASE}-durable-check-first-tier-headless"]
    else:
        # Exactly the client Service: the headless one would have every pod scraped twice.
        assert [s["spec"].get("clusterIP") for s in selected] == [None]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings"}
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"


def check_prometheus_rule(rule: dict[str, Any]) -> None:
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit", "partial_response_strategy"}
        assert group["name"] and group["rules"]
        for item in group["rules"]:
            assert ("alert" in item) != ("record" in item)
            assert set(item) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
            assert isinstance(item["expr"], str)


def test_prometheus_rule_holds_the_shipped_alerts_and_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    extra = {"name": "team", "rules": [{"alert": "TeamRule", "expr": "vector(1) > 0", "for": "1m"}]}
    values = load_values(CHART / "ci/monitoring-values.yaml")
    values["prometheusRule"]["groups"] = [extra]
    groups = one(manifests(values), "PrometheusRule")["spec"]["groups"]
    shipped = yaml.safe_load((REPO / "config/prometheus-alerts.yaml").read_text(encoding="utf-8"))["groups"]
    assert groups == [*shipped, extra], "the shipped groups unchanged (alert templates included), then the user's"
    rules_file = write_yaml(tmp_path / "rules.yaml", {"groups": groups})
    result = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_packaged_chart_carries_its_files_and_leaves_out_the_repository_ones(tmp_path: Path) -> None:
    with helm.Chart.load(str(CHART)) as chart:
        archive = Path(chart.save(str(tmp_path)))
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "durable-check/files/prometheus-alerts.yaml" in names
    assert "durable-check/values.schema.json" in names
    assert not any("/examples/" in n or "/ci/" in n for n in names)
    with helm.Chart.load(str(archive)) as packaged:
        rendered = packaged.render(load_values(CHART / "ci/monitoring-values.yaml"), name=RELEASE, namespace=NAMESPACE)
    assert any(path.endswith("prometheusrule.yaml") and text.strip() for path, text in rendered.items())


def test_chart_copy_of_alert_rules_is_identical() -> None:
    source = REPO / "config/prometheus-alerts.yaml"
    copy = CHART / "files/prometheus-alerts.yaml"
    assert copy.read_bytes() == source.read_bytes(), "run: python deploy/helm/render-examples.py"


def expected_messages(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    expected = [line.partition("# expect:")[2].strip() for line in lines if line.startswith("# expect:")]
    assert expected, f"{path.name}: no '# expect:' line"
    return expected


@pytest.mark.parametrize("bad_file", BAD_VALUES, ids=[p.stem for p in BAD_VALUES])
def test_schema_rejects_bad_values_with_their_message(bad_file: Path) -> None:
    values = load_values(bad_file)
    with pytest.raises(helm.HelmValuesError) as caught:
        render(values)
    for message in expected_messages(bad_file):
        assert message in str(caught.value), f"{bad_file.name}: {caught.value}"
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)


@pytest.mark.parametrize("bad_file", BAD_VALUES_TEMPLATE, ids=[p.stem for p in BAD_VALUES_TEMPLATE])
def test_templates_reject_contradictory_values_with_their_message(bad_file: Path) -> None:
    values = load_values(bad_file)
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)  # well-formed values ...
    with pytest.raises(helm.HelmRenderError) as caught:  # ... that contradict the chart
        render(values)
    for message in expected_messages(bad_file):
        assert message in str(caught.value), f"{bad_file.name}: {caught.value}"


def test_schema_knows_every_section_of_the_serve_configuration() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    sections = set(schema["properties"]["config"]["properties"])
    assert sections == {f.name for f in dataclasses.fields(Config)}


def test_bad_values_cover_the_schema() -> None:
    assert len(BAD_VALUES) >= 15 and len(BAD_VALUES_TEMPLATE) >= 5


def _render_examples_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_examples", REPO / "deploy/helm/render-examples.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_examples_are_up_to_date() -> None:
    module = _render_examples_module()
    assert module.differences() == [], "run: python deploy/helm/render-examples.py"
    assert {p.name for p in (CHART / "examples").iterdir()} == {p.stem for p in CI_FILES}


@pytest.mark.parametrize(("values_file", "config_file"), [
    ("default-values.yaml", "embedded-state.yaml"),
    ("postgres-values.yaml", "postgres.yaml"),
])
def test_reference_configs_are_what_the_chart_runs(values_file: str, config_file: str) -> None:
    rendered = processor_config(manifests(load_values(CHART / "ci" / values_file)))
    reference = yaml.safe_load((REPO / "config" / config_file).read_text(encoding="utf-8"))
    assert rendered == reference


def test_modes_own_their_state() -> None:
    stateful = manifests({})
    sts = one(stateful, "StatefulSet")
    assert sts["spec"]["serviceName"] == one([s for s in by_kind(stateful, "Service")
                                               if s["spec"].get("clusterIP") == "None"], "Service")["metadata"]["name"]
    assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["data"]
    assert not by_kind(stateful, "HorizontalPodAutoscaler")

    shared = manifests(load_values(CHART / "ci/postgres-values.yaml"))
    deployment = one(shared, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert one(shared, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DURABLE_CHECK_POSTGRES_DSN"]["valueFrom"]["secretKeyRef"] == {"name": "durable-check-postgres",
                                                                               "key": "dsn"}
    assert one(shared, "PodDisruptionBudget")["spec"]["minAvailable"] == 1


def test_pod_is_locked_down_and_writes_only_to_its_volumes() -> None:
    pod = workload(manifests({}))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001, "the image's USER"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    # The Dockerfile's VOLUMEs: the only places the process writes.
    assert writable == {"/var/lib/durable-check", "/tmp"}
    assert container["args"] == ["--config=/etc/durable-check/config.yaml"]
    assert pod["automountServiceAccountToken"] is False


# --- replicas tell themselves apart in what they push ---------------------------------------

_ENV_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def kubelet_env(container: dict[str, Any], pod_name: str, sources: Mapping[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it from ``env``: entries in order, each
    ``value``'s ``$(VAR)`` expanded from the entries before it (``$$`` is a literal ``$``, an unknown
    reference stays as written), ``valueFrom`` read from the pod (``metadata.name``) or from
    ``sources`` (``"<ConfigMap or Secret name>/<key>"``)."""
    known = dict(sources or {})
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            def expand(match: re.Match[str]) -> str:
                if match.group(0) == "$$":
                    return "$"
                return env.get(match.group(1), match.group(0))
            env[entry["name"]] = _ENV_REFERENCE.sub(expand, entry["value"])
            continue
        source = entry["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", source
            env[entry["name"]] = pod_name
        else:
            ref = source.get("configMapKeyRef") or source["secretKeyRef"]
            env[entry["name"]] = known[f"{ref['name']}/{ref['key']}"]
    return env


def container_ports(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = workload(objects)["spec"]["template"]["spec"]["containers"][0]["ports"]
    return ports


def container_of(values: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = workload(manifests(values))["spec"]["template"]["spec"]["containers"][0]
    return container


@pytest.mark.parametrize("values", VALUE_SETS)
def test_each_pod_names_itself_in_its_otlp_resource(values: dict[str, Any]) -> None:
    for workload_object in (o for o in manifests(values) if o["kind"] in {"StatefulSet", "Deployment"}):
        name = workload_object["metadata"]["name"]
        _names_itself(workload_object["spec"]["template"]["spec"]["containers"][0], (f"{name}-0", f"{name}-1"))


def _names_itself(container: dict[str, Any], pods: tuple[str, ...]) -> None:
    names = [entry["name"] for entry in container["env"]]
    assert names[0] == "POD_NAME", "first, so that every later entry may refer to it"
    assert container["env"][0]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert names[-1] == "OTEL_RESOURCE_ATTRIBUTES", "last, so that it may refer to every extraEnv entry"
    assert names.count("OTEL_RESOURCE_ATTRIBUTES") == 1
    # Every Secret and ConfigMap key the value sets name.
    sources = {"otel-resource/attributes": "k8s.cluster.name=eu-1", "hook/token": "t", "pg/url": "postgresql://",
               "token/token": "t", "durable-check-postgres/dsn": "postgresql://", "durable-check-token/token": "t",
               "durable-check-view/token": "t", "collector/token": "t"}
    for pod in pods:
        resource = resource_attributes(kubelet_env(container, pod, sources))
        assert resource["service.instance.id"] == pod
        assert resource["service.name"] == "durable-check"


def test_extra_resource_attributes_are_merged_and_win() -> None:
    pod = "example-durable-check-0"
    from_value = container_of({"extraEnv": [
        {"name": "CLUSTER", "value": "eu-1"},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": "deployment.environment=prod,k8s.cluster.name=$(CLUSTER)"},
        {"name": "WEBHOOK_TOKEN", "value": "t"},
    ]})
    assert [e["name"] for e in from_value["env"]] == ["POD_NAME", "CLUSTER", "WEBHOOK_TOKEN",
                                                       "OTEL_RESOURCE_ATTRIBUTES"]
    assert resource_attributes(kubelet_env(from_value, pod)) == {
        "service.name": "durable-check", "service.version": __version__, "service.instance.id": pod,
        "deployment.environment": "prod", "k8s.cluster.name": "eu-1",
    }
    # A key set in extraEnv comes after the chart's: the last of a key wins.
    own_id = container_of({"extraEnv": [{"name": "OTEL_RESOURCE_ATTRIBUTES",
                                          "value": "service.instance.id=checker-a"}]})
    assert resource_attributes(kubelet_env(own_id, pod))["service.instance.id"] == "checker-a"
    # From a ConfigMap: read under another name, then referenced.
    from_configmap = container_of({"extraEnv": [{
        "name": "OTEL_RESOURCE_ATTRIBUTES",
        "valueFrom": {"configMapKeyRef": {"name": "otel-resource", "key": "attributes"}},
    }]})
    env = kubelet_env(from_configmap, pod, {"otel-resource/attributes": "deployment.environment=staging"})
    assert resource_attributes(env)["deployment.environment"] == "staging"
    assert resource_attributes(env)["service.instance.id"] == pod


def test_replicas_violation_spans_carry_their_pod_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment two pods of the StatefulSet get, read by the real OTLP span exporter."""
    container = container_of({"replicaCount": 2})
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    receiver = OtlpGrpcReceiver()
    try:
        for pod, n in (("example-durable-check-0", 1), ("example-durable-check-1", 2)):
            monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", kubelet_env(container, pod)["OTEL_RESOURCE_ATTRIBUTES"])
            exporter = OtlpSpanExporter(OtlpConfig(endpoint=receiver.endpoint, insecure=True), Telemetry())
            exporter.export([make_violation(n)])
            exporter.shutdown(5.0)
        instances = sorted(
            kv.value.string_value
            for request in receiver.trace_requests
            for resource_spans in request.resource_spans
            for kv in resource_spans.resource.attributes
            if kv.key == "service.instance.id"
        )
    finally:
        receiver.stop()
    assert instances == ["example-durable-check-0", "example-durable-check-1"]


def test_probes_follow_tls() -> None:
    plain = workload(manifests({}))["spec"]["template"]["spec"]["containers"][0]
    assert plain["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "otlp-http"}
    assert plain["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "otlp-http"}
    tls = {"tls": {"enabled": True, "existingSecret": "tls", "clientAuth": False}}
    https = workload(manifests(tls))["spec"]["template"]["spec"]["containers"][0]
    assert https["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    mtls = workload(manifests(load_values(CHART / "ci/tls-values.yaml")))["spec"]["template"]["spec"]["containers"][0]
    assert mtls["readinessProbe"] == {**{k: v for k, v in plain["readinessProbe"].items() if k != "httpGet"},
                                      "tcpSocket": {"port": "otlp-http"}}
    # With the view on, readiness is asked of the view's port (which a load balancer routes to).
    view = {"ui": {"enabled": True}}
    viewed = workload(manifests(view))["spec"]["template"]["spec"]["containers"][0]
    assert viewed["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ui"}
    viewed_tls = workload(manifests({**view, **tls}))["spec"]["template"]["spec"]["containers"][0]
    assert viewed_tls["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ui", "scheme": "HTTPS"}
    viewed_mtls = workload(manifests({"ui": {"enabled": True}, **load_values(CHART / "ci/tls-values.yaml")}))
    # The view asks for no client certificate: an HTTPS probe works where the receivers' needs a tcpSocket.
    assert viewed_mtls["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] == "ui"
    unviewed = workload(manifests({"ui": {"enabled": True, "readiness": False}}))
    assert unviewed["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] == "otlp-http"


def test_config_change_rolls_the_pods() -> None:
    def checksum(values: dict[str, Any]) -> str:
        annotations = workload(manifests(values))["spec"]["template"]["metadata"]["annotations"]
        return str(annotations["checksum/config"])

    base = checksum({})
    assert checksum({"replicaCount": 1, "podAnnotations": {"team": "agents"}}) == base
    assert checksum({"config": {"evaluate": {"strict": True}}}) != base
    assert checksum({"rules": {"mine.yaml": "version: 1\nrules: []\n"}}) != base


def test_user_config_is_merged_and_rules_are_mounted() -> None:
    values = load_values(CHART / "ci/monitoring-values.yaml")
    objects = manifests(values)
    config = processor_config(objects)
    assert config["evaluate"]["allowed_lateness"] == "10s"
    assert config["evaluate"]["rules"] == ["/etc/durable-check/rules/payments.yaml"]
    assert config["exporters"]["alertmanager"]["url"] == values["config"]["exporters"]["alertmanager"]["url"]
    assert config["exporters"]["prometheus"]["endpoint"] == "0.0.0.0:9464"
    configmap = processor_configmap(objects)
    assert configmap["data"]["rules.payments.yaml"] == values["rules"]["payments.yaml"]
    (configmap_source,) = [source["configMap"] for source in config_volume_sources(objects) if "configMap" in source]
    assert {"key": "rules.payments.yaml", "path": "rules/payments.yaml"} in configmap_source["items"]


def test_collector_config_routes_sessions_to_the_headless_service() -> None:
    """config/otel-collector.yaml names what the chart creates for release durable-check."""
    collector = yaml.safe_load((REPO / "config/otel-collector.yaml").read_text(encoding="utf-8"))
    objects = manifests({}, name="durable-check", namespace="durable-check")
    (headless,) = [s for s in by_kind(objects, "Service") if s["spec"].get("clusterIP") == "None"]
    grpc_port = next(p["port"] for p in headless["spec"]["ports"] if p["name"] == "otlp")

    exporter = collector["exporters"]["loadbalancing/durable-check"]
    # By trace, for replicas on PostgreSQL (docs/scaling.md says why).
    assert exporter["routing_key"] == "traceID"
    assert "endpoint" not in exporter["protocol"]["otlp"], "the resolver supplies the endpoints"
    k8s = exporter["resolver"]["k8s"]
    assert k8s["service"] == f"{headless['metadata']['name']}.{headless['metadata']['namespace']}"
    assert k8s["ports"] == [grpc_port]

    pipelines = collector["service"]["pipelines"]
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in collector[kind], f"pipeline {name}: {component} is not defined"
    assert pipelines["traces/durable-check"]["exporters"] == ["loadbalancing/durable-check"]
    assert any("otlp/" in e for e in pipelines["traces"]["exporters"]), "the tracing backend keeps every trace"


FIRST_TIER_VALUES = CHART / "ci" / "first-tier-values.yaml"


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_first_tier_is_a_workload_of_its_own_that_no_evaluator_service_selects() -> None:
    """Each Service selects the pods of one tier: an evaluator Service that selected first-tier pods
    would send agents' spans to a tier that evaluates nothing, and the Collector's rings would mix."""
    objects = manifests(load_values(FIRST_TIER_VALUES), name="durable-check", namespace="durable-check")
    workloads = by_kind(objects, "StatefulSet")
    assert len(workloads) == 2
    (tier,) = [w for w in workloads if first_tier(w)]
    evaluators = workload(objects)
    tier_pods = tier["spec"]["template"]["metadata"]["labels"]
    evaluator_pods = evaluators["spec"]["template"]["metadata"]["labels"]
    for service in by_kind(objects, "Service"):
        selector = service["spec"]["selector"]
        if first_tier(service):
            assert _selects(selector, tier_pods) and not _selects(selector, evaluator_pods), service["metadata"]
        else:
            assert _selects(selector, evaluator_pods) and not _selects(selector, tier_pods), service["metadata"]
    assert tier["spec"]["serviceName"] == "durable-check-first-tier-headless"
    assert tier["spec"]["replicas"] == 2
    (claim,) = tier["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in tier["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/var/lib/durable-check"
    (disruption,) = by_kind(manifests({**load_values(FIRST_TIER_VALUES), "podDisruptionBudget": {"enabled": True}}),
                            "PodDisruptionBudget")
    assert not _selects(disruption["spec"]["selector"]["matchLabels"], tier_pods)
    # A long release name: every name still a DNS label, and the tiers' names still apart.
    long = manifests(load_values(FIRST_TIER_VALUES), name="r" * 53)
    names = [(o["kind"], o["metadata"]["name"]) for o in long if o["kind"] in {"Service", "StatefulSet", "ConfigMap"}]
    assert all(len(n) <= 63 for _, n in names) and len(set(names)) == len(names) == 7, names


def test_first_tier_in_front_of_evaluators_on_postgres_that_scale() -> None:
    """The evaluators a Deployment on PostgreSQL (autoscaled, listed by the headless Service the Collector's
    by-session ring resolves), the first tier a StatefulSet journaling on its own volumes."""
    values = load_values(CHART / "ci" / "first-tier-postgres-values.yaml")
    objects = manifests(values, name="durable-check", namespace="durable-check")
    (tier,) = [w for w in by_kind(objects, "StatefulSet") if first_tier(w)]
    (evaluators,) = by_kind(objects, "Deployment")
    assert processor_config(objects)["state"]["backend"] == "postgres"
    assert _first_tier_config(objects)["state"]["backend"] == "sqlite"
    assert tier["spec"]["volumeClaimTemplates"]
    (scaler,) = by_kind(objects, "HorizontalPodAutoscaler")
    assert scaler["spec"]["scaleTargetRef"]["name"] == evaluators["metadata"]["name"]
    headless = [s for s in by_kind(objects, "Service") if s["spec"].get("clusterIP") == "None" and not first_tier(s)]
    assert [s["metadata"]["name"] for s in headless] == ["durable-check-headless"]
    evaluator_pods = evaluators["spec"]["template"]["metadata"]["labels"]
    assert _selects(headless[0]["spec"]["selector"], evaluator_pods)


def _first_tier_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (configmap,) = [o for o in by_kind(objects, "ConfigMap") if first_tier(o)]
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert isinstance(config, dict)
    return config


def test_first_tier_runs_config_first_tier_yaml_and_it_checks(tmp_path: Path) -> None:
    """config/first-tier.yaml is what the chart runs for ci/first-tier-values.yaml; serve accepts it as
    the first tier (route_problems finds nothing), and its lateness is the evaluators'."""
    objects = manifests(load_values(FIRST_TIER_VALUES))
    rendered = _first_tier_config(objects)
    assert rendered == yaml.safe_load((REPO / "config" / "first-tier.yaml").read_text(encoding="utf-8"))
    assert rendered["evaluate"]["allowed_lateness"] == processor_config(objects)["evaluate"]["allowed_lateness"]
    path = tmp_path / "first-tier.yaml"
    path.write_text(yaml.safe_dump(rendered), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "processor.cli", "serve", "--config", str(path), "--check"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    # With TLS and auth, the first tier receives as the evaluators do.
    secured = manifests({**load_values(FIRST_TIER_VALUES), **load_values(CHART / "ci" / "tls-values.yaml")})
    assert _first_tier_config(secured)["receivers"] == processor_config(secured)["receivers"]


def test_two_tier_collector_config_names_the_charts_services() -> None:
    """config/otel-collector-two-tier.yaml routes by trace to the first tier and by session to the
    evaluators, by the names the chart gives them for release durable-check."""
    collector = yaml.safe_load((REPO / "config/otel-collector-two-tier.yaml").read_text(encoding="utf-8"))
    objects = manifests(load_values(FIRST_TIER_VALUES), name="durable-check", namespace="durable-check")
    headless = {s["metadata"]["name"]: s for s in by_kind(objects, "Service") if s["spec"].get("clusterIP") == "None"}
    routes = {"loadbalancing/by-trace": ("durable-check-first-tier-headless", "traceID"),
              "loadbalancing/by-session": ("durable-check-headless", "attributes")}
    for name, (service, key) in routes.items():
        exporter = collector["exporters"][name]
        assert exporter["routing_key"] == key
        port = next(p["port"] for p in headless[service]["spec"]["ports"] if p["name"] == "otlp")
        assert exporter["resolver"]["k8s"] == {"service": f"{service}.durable-check", "ports": [port]}
    pipelines = collector["service"]["pipelines"]
    assert pipelines["traces/first-tier"]["exporters"] == ["loadbalancing/by-trace"]
    assert pipelines["traces/by-session"]["receivers"] == ["otlp/sessions"]
    # What the first tier sends to is that second receiver's port.
    sessions_port = collector["receivers"]["otlp/sessions"]["protocols"]["grpc"]["endpoint"].rpartition(":")[2]
    assert _first_tier_config(objects)["route"]["endpoint"].rpartition(":")[2] == sessions_port


def _first_tier_workload(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [o for o in by_kind(objects, "StatefulSet") if first_tier(o)]
    return found


def test_first_tier_takes_what_it_is_given_and_nothing_of_the_evaluators_own() -> None:
    """firstTier.config is merged under what the chart owns; the pod shares the evaluators' image,
    security, probes, receivers' Secrets and extras, but not their view, rule files, resources or
    label-selecting scheduling."""
    objects = manifests(FIRST_TIER_OPTIONS)
    config = _first_tier_config(objects)
    given = FIRST_TIER_OPTIONS["firstTier"]["config"]
    assert config["state"] == {**given["state"], "backend": "sqlite", "path": "/var/lib/durable-check/first-tier.db"}
    assert config["route"] == {**given["route"], "endpoint": "otel-collector.observability:14317", "insecure": False}
    assert config["evaluate"] == {"session_idle_timeout": "1d", "allowed_lateness": "10s"}
    assert config["exporters"] == {**given["exporters"], "prometheus": {"endpoint": "0.0.0.0:9464"}}
    assert config["queue"] == given["queue"]
    assert set(config) == {"receivers", "queue", "convert", "evaluate", "state", "route", "exporters", "telemetry"}

    tier_pod = _first_tier_workload(objects)["spec"]["template"]
    evaluator_pod = workload(objects)["spec"]["template"]
    (tier,) = tier_pod["spec"]["containers"]
    (evaluator,) = evaluator_pod["spec"]["containers"]
    for key in ("image", "imagePullPolicy", "args", "securityContext", "livenessProbe", "startupProbe"):
        assert tier[key] == evaluator[key], key
    # The evaluators' readiness asks the view (ui.enabled); the first tier has none.
    assert tier["readinessProbe"]["tcpSocket"] == {"port": "otlp-http"}, "mTLS: the kubelet has no client certificate"
    assert [p["name"] for p in tier["ports"]] == ["otlp", "otlp-http", "metrics"]
    assert "ui" in [p["name"] for p in evaluator["ports"]]
    env = {e["name"]: e for e in tier["env"]}
    assert set(env) == {"POD_NAME", "DURABLE_CHECK_BEARER_TOKEN", "COLLECTOR_TOKEN", "OTEL_RESOURCE_ATTRIBUTES"}
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == "service.instance.id=$(POD_NAME),deployment.environment=prod"
    assert tier["resources"] == {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
    assert evaluator["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert tier["volumeMounts"][-1] == FIRST_TIER_OPTIONS["extraVolumeMounts"][0]
    (config_volume,) = [v for v in tier_pod["spec"]["volumes"] if v["name"] == "config"]
    (configmap, secret) = config_volume["projected"]["sources"]
    assert configmap["configMap"] == {"name": "example-durable-check-first-tier",
                                      "items": [{"key": "config.yaml", "path": "config.yaml"}]}, "no rule files"
    assert [i["path"] for i in secret["secret"]["items"]] == ["tls/tls.crt", "tls/tls.key", "tls/ca.crt"]
    assert tier_pod["metadata"]["annotations"]["team"] == "agents"
    assert tier_pod["metadata"]["labels"]["tier-owner"] == "platform"
    assert tier_pod["spec"]["affinity"] == FIRST_TIER_OPTIONS["firstTier"]["affinity"]
    assert tier_pod["spec"]["topologySpreadConstraints"] == FIRST_TIER_OPTIONS["firstTier"]["topologySpreadConstraints"]
    assert evaluator_pod["spec"]["affinity"] == FIRST_TIER_OPTIONS["affinity"]
    assert "topologySpreadConstraints" not in evaluator_pod["spec"]
    writable = {m["mountPath"] for m in tier["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/var/lib/durable-check", "/tmp"}
    (claim,) = _first_tier_workload(objects)["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    # Its ServiceMonitor scrapes the port its headless Service names.
    (monitor,) = [m for m in by_kind(objects, "ServiceMonitor") if first_tier(m)]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["interval"] == "15s"


def test_first_tier_config_change_rolls_the_first_tier_only() -> None:
    def checksums(values: dict[str, Any]) -> tuple[str, str]:
        objects = manifests({**load_values(FIRST_TIER_VALUES), **values})
        return (str(_first_tier_workload(objects)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]),
                str(workload(objects)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]))

    tier, evaluators = checksums({})
    changed_tier = checksums({"firstTier": {**load_values(FIRST_TIER_VALUES)["firstTier"],
                                            "config": {"route": {"checkpoint_interval": "2s"}}}})
    assert changed_tier[0] != tier and changed_tier[1] == evaluators
    changed_rules = checksums({"rules": {"mine.yaml": "version: 1\nrules: []\n"}})
    assert changed_rules[0] == tier and changed_rules[1] != evaluators
    # allowed_lateness is both tiers': both roll.
    lateness = checksums({"config": {"evaluate": {"allowed_lateness": "7s"}}})
    assert lateness[0] != tier and lateness[1] != evaluators


def test_notes_send_agents_to_the_collector_with_two_tiers() -> None:
    notes = next(text for path, text in render(load_values(FIRST_TIER_VALUES), name="durable-check",
                                                namespace="durable-check").items() if path.endswith("NOTES.txt"))
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in notes, "agents sending to a tier directly would skip the first tier"
    assert "durable-check-first-tier-headless.durable-check, port 4317" in notes
    assert "durable-check-headless.durable-check, port 4317" in notes
    assert "otel-collector.observability:14317" in notes
    assert "config/otel-collector-two-tier.yaml" in notes


def _loadbalancing_exporters(text: str) -> list[dict[str, Any]]:
    """Every loadbalancing exporter configured in the YAML blocks (or the whole YAML) of ``text``."""
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL) or [text]
    found = []
    for block in blocks:
        document = yaml.safe_load(block)
        exporters = document.get("exporters", {}) if isinstance(document, dict) else {}
        found += [cfg for name, cfg in exporters.items() if name.split("/")[0] in {"loadbalancing", "load_balancing"}]
    return found


@pytest.mark.parametrize("source", ["config/otel-collector.yaml", "config/otel-collector-by-session.yaml",
                                    "config/otel-collector-two-tier.yaml", "docs/scaling.md", "docs/deploy.md",
                                    "NOTES.txt"])
def test_collector_snippets_queue_and_retry_on_the_exporter_itself(source: str) -> None:
    """Shipped snippets queue and retry on the exporter itself, where what a replica gave up on is routed
    again. The per-replica exporters (protocol.otlp) keep their own queue and retry, on by default: a
    snippet may only tune that retry (it retries "retry later" on the same replica, what a handover
    needs), never switch it off or give them a queue of their own."""
    if source == "NOTES.txt":
        text = next(t for path, t in render({}).items() if path.endswith("NOTES.txt"))
        # The Collector configuration of step 2: from "exporters:" to the blank line after it.
        snippet = text[text.index("     exporters:"):].split("\n\n")[0]
        exporters = _loadbalancing_exporters("\n".join(line[5:] for line in snippet.splitlines()))
    else:
        exporters = _loadbalancing_exporters((REPO / source).read_text(encoding="utf-8"))
    assert exporters, f"{source}: no loadbalancing exporter"
    for exporter in exporters:
        otlp = exporter["protocol"]["otlp"]
        assert "sending_queue" not in otlp, f"{source}: a queue under protocol.otlp"
        assert otlp.get("retry_on_failure", {}).get("enabled", True) is True, f"{source}: retry off per replica"
        if source != "docs/deploy.md":  # deploy.md's short snippet leaves them to config/otel-collector.yaml
            assert exporter["sending_queue"]["enabled"] is True
            assert exporter["retry_on_failure"]["enabled"] is True


def test_notes_tell_where_to_point_agents() -> None:
    notes = next(text for path, text in render({}, name="acme", namespace="agents").items()
                 if path.endswith("NOTES.txt"))
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://acme-durable-check.agents:4318" in notes
    assert "acme-durable-check-headless.agents.svc.cluster.local" in notes
    assert "routing_key: attributes" in notes
    shared = next(text for path, text in render({"mode": "deployment", "postgres": {"existingSecret": "pg"}},
                                                name="acme", namespace="agents").items()
                  if path.endswith("NOTES.txt"))
    assert "routing_key: traceID" in shared and "routing_key: attributes" not in shared


def test_deploy_doc_names_every_shipped_alert() -> None:
    doc = (REPO / "docs/deploy.md").read_text(encoding="utf-8")
    shipped = yaml.safe_load((REPO / "config/prometheus-alerts.yaml").read_text(encoding="utf-8"))
    for group in shipped["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                assert f"`{rule['alert']}`" in doc, f"docs/deploy.md does not mention {rule['alert']}"


def test_readme_lists_every_value_with_its_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    rows = {}
    for line in (CHART / "README.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"^\| `([^`]+)` \| (.+?) \| .+ \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    whole = {"resources", "podSecurityContext", "securityContext", "livenessProbe", "readinessProbe", "startupProbe"}

    def leaves(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
        for key, value in tree.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key not in whole:
                yield from leaves(value, path + ".")
            else:
                yield path, value

    for path, default in leaves(values):
        assert path in rows, f"README.md has no row for {path}"
        if path not in whole:
            assert rows[path] == f"`{json.dumps(default, separators=(',', ':'))}`", path


# --- the shipped configuration runs ---------------------------------------------------------

def violation_counts(exposition: str) -> dict[tuple[str, str, str], float]:
    return {
        (sample.labels["rule"], sample.labels["severity"], sample.labels["service"]): sample.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "durable_check_violations"
        for sample in family.samples
        if sample.name == "durable_check_violations_total"
    }


def doc_example_request(now_ns: int) -> bytes:
    """The OTLP/JSON request docs/deploy.md sends to make the first violation."""
    doc = (REPO / "docs/deploy.md").read_text(encoding="utf-8")
    match = re.search(r"-d '(\{.*?\})'\n", doc, re.DOTALL)
    assert match, "docs/deploy.md has no curl -d '{...}' example"
    body = match.group(1).replace('\'"$now"\'', str(now_ns))
    json.loads(body)
    return body.encode()


def _self_signed(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    tmp.mkdir(parents=True, exist_ok=True)
    files = {name: tmp / name for name in ("ca.crt", "ca.key", "tls.crt", "tls.key", "client.crt", "client.key")}

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", str(files["ca.key"]), "-out", str(files["ca.crt"]))
    for name, extension in (("tls", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        csr = tmp / f"{name}.csr"
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(files[f"{name}.key"]),
            "-out", str(csr))
        ext = tmp / f"{name}.ext"
        ext.write_text(extension + "\n", encoding="utf-8")
        run("x509", "-req", "-in", str(csr), "-CA", str(files["ca.crt"]), "-CAkey", str(files["ca.key"]),
            "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(files[f"{name}.crt"]))
    return files


# first-tier-values.yaml runs both tiers: the first tier sends on to the evaluator's gRPC
# receiver where the Collector's otlp/sessions receiver would be (one evaluator needs no routing).
RUN_VALUES_FILES = ["default-values.yaml", "monitoring-values.yaml", "tls-values.yaml", "first-tier-values.yaml"]


@pytest.fixture(scope="module")
def chart_runs() -> dict[str, BaseException | None]:
    """Each ci/ configuration run once, all at the same time: most of a run is waiting for
    evaluate.allowed_lateness, so running them side by side keeps this file short."""
    try:
        import processor.serve  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"processor.serve is not importable yet: {exc}")

    def run(values_file: str) -> BaseException | None:
        try:
            with unprivileged_workdir() as workdir:
                run_chart_configuration(load_values(CHART / "ci" / values_file), workdir)
        except BaseException as exc:  # handed to the test of this values file
            return exc
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(RUN_VALUES_FILES)) as pool:
        return dict(zip(RUN_VALUES_FILES, pool.map(run, RUN_VALUES_FILES), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("values_file", [
    # Prometheus and Alertmanager are started for the monitoring values.
    pytest.param(name, marks=[pytest.mark.servers] if name.startswith("monitoring") else [])
    for name in RUN_VALUES_FILES
])
def test_chart_configuration_runs(values_file: str, chart_runs: dict[str, BaseException | None]) -> None:
    """The ConfigMap's config and rules, addresses and paths made local: --check passes, serve gets
    ready, the documented first violation is counted, alerted on (monitoring) and written; with
    firstTier, sent through the first tier's own configuration."""
    failure = chart_runs[values_file]
    if failure is not None:
        raise failure


@pytest.mark.slow
@pytest.mark.servers
def test_chart_postgres_configuration_runs(pg_server: str) -> None:
    """mode=deployment: the same, with the DSN from the Secret as the pod gets it (an env var) and a real PostgreSQL."""
    try:
        import processor.serve  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"processor.serve is not importable yet: {exc}")
    with unprivileged_workdir() as workdir:
        run_chart_configuration(load_values(CHART / "ci/postgres-values.yaml"), workdir,
                                {"DURABLE_CHECK_POSTGRES_DSN": fresh_database(pg_server)})


def run_chart_configuration(values: dict[str, Any], workdir: Path, secret_env: dict[str, str] | None = None) -> None:
    objects = manifests(values)
    configmap = processor_configmap(objects)
    etc = workdir / "etc-durable-check"
    data = workdir / "var-lib-durable-check"
    scratch = workdir / "tmp"
    for directory in (etc / "rules", etc / "tls", data, scratch):
        directory.mkdir(parents=True)
    # The config volume laid out as the pod gets it: the ConfigMap's items at their paths
    # (the Secret's TLS items follow below, once there are certificates).
    sources = config_volume_sources(objects)
    for source in sources:
        for item in source.get("configMap", {}).get("items", []):
            (etc / item["path"]).write_text(configmap["data"][item["key"]], encoding="utf-8")
    config_text = (etc / "config.yaml").read_text(encoding="utf-8")
    config, ports = rewrite_for_localhost(yaml.safe_load(config_text), {
        "/etc/durable-check": etc, "/var/lib/durable-check": data,
    })

    env_extra = dict(secret_env or {})
    headers = {}
    client = httpx.Client(timeout=2.0)
    scheme = "http"
    if values.get("tls", {}).get("enabled"):
        certs = _self_signed(workdir / "pki")
        # The Secret, as `kubectl create secret tls` plus ca.crt would hold it.
        for source in sources:
            for item in source.get("secret", {}).get("items", []):
                shutil.copy(certs[item["key"]], etc / item["path"])
        context = ssl.create_default_context(cafile=str(certs["ca.crt"]))
        context.load_cert_chain(str(certs["client.crt"]), str(certs["client.key"]))
        client = httpx.Client(timeout=2.0, verify=context)
        scheme = "https"
    if values.get("auth", {}).get("enabled"):
        env_extra["DURABLE_CHECK_BEARER_TOKEN"] = "test-token-for-the-chart"
        headers["authorization"] = "Bearer test-token-for-the-chart"
    view_port = None
    if values.get("ui", {}).get("enabled"):
        # The port the chart names `ui` on the pod, as the Service's `ui` port targets it.
        view_port = next(port["containerPort"] for port in container_ports(objects) if port["name"] == "ui")
        service = next(s for s in by_kind(objects, "Service") if s["spec"].get("clusterIP") != "None")
        assert any(port["name"] == "ui" and port["targetPort"] == "ui" for port in service["spec"]["ports"])
        if values["ui"].get("auth", {}).get("existingSecret"):
            env_extra["DURABLE_CHECK_UI_TOKEN"] = "view-token-for-the-chart"

    expected = {("DS002", "critical", "checkout-agent"): 1.0}
    if "payments.yaml" in values.get("rules", {}):
        # The team's own rule of monitoring-values.yaml fires on the same payment.
        expected[("ACME001", "critical", "checkout-agent")] = 1.0

    with contextlib.ExitStack() as stack:
        stack.enter_context(client)
        alertmanager = prometheus = None
        if ((config.get("exporters") or {}).get("alertmanager") or {}).get("url"):
            # The in-cluster Alertmanager Service of the values becomes a real local one.
            alertmanager = stack.enter_context(alertmanager_server(workdir / "alertmanager"))
            config["exporters"]["alertmanager"]["url"] = alertmanager.url
        tier = None
        if values.get("firstTier", {}).get("enabled"):
            tier = first_tier_for_run(objects, workdir, to_grpc_port=ports[4317])
        if values.get("prometheusRule", {}).get("enabled"):
            # Prometheus with the PrometheusRule's groups, scraping what the ServiceMonitor scrapes.
            groups = one(objects, "PrometheusRule")["spec"]["groups"]
            rule_file = write_yaml(workdir / "prometheus-rules.yaml", {"groups": groups})
            prometheus = stack.enter_context(
                prometheus_server(workdir / "prometheus", [f"127.0.0.1:{ports[9464]}"], [rule_file]))
        config_path = write_yaml(workdir / "config.yaml", config)
        give_to_unprivileged(workdir / "config.yaml", etc, data, scratch)
        env = base_env(env_extra, tmp_dir=scratch)
        checked = check_config(config_path, env, cwd=data)
        assert checked.returncode == 0, checked.stdout + checked.stderr

        server = stack.enter_context(ServeProcess(config_path, env, cwd=data, log_path=workdir / "serve.log"))
        base = f"{scheme}://127.0.0.1:{ports[4318]}"
        server.wait_for(f"{base}/readyz", client=client)
        tier_process = None
        if tier is not None:
            # Agents send to the first tier (through the Collector), never to the evaluator.
            assert scheme == "http" and not headers, "the first tier's run sends on in plaintext"
            tier_env = base_env(env_extra, tmp_dir=scratch)
            checked = check_config(tier.config_path, tier_env, cwd=tier.data)
            assert checked.returncode == 0, checked.stdout + checked.stderr
            tier_process = stack.enter_context(ServeProcess(tier.config_path, tier_env, cwd=tier.data,
                                                            log_path=workdir / "first-tier.log"))
            base = f"http://127.0.0.1:{tier.ports[4318]}"
            tier_process.wait_for(f"{base}/readyz", client=client)
        # docs/deploy.md's first violation: an unkeyed payment is DS002.
        sent = client.post(f"{base}/v1/traces", content=doc_example_request(time.time_ns()),
                           headers={"content-type": "application/json", **headers})
        assert sent.status_code == 200, sent.text
        if headers:
            refused = client.post(f"{base}/v1/traces", content=doc_example_request(time.time_ns()),
                                  headers={"content-type": "application/json"})
            assert refused.status_code == 401
        # Records wait evaluate.allowed_lateness (5-10s) for ordering before they are evaluated.
        metrics_url = f"http://127.0.0.1:{ports[9464]}/metrics"
        wait_until(lambda: violation_counts(httpx.get(metrics_url, timeout=5).text) == expected,
                   timeout_s=40, interval_s=0.2, what=f"the violation counters {expected}")
        if view_port is not None:
            # The operator view, reached through the port the chart names, lists the same violation.
            view = f"{scheme}://127.0.0.1:{ports[view_port]}/api/v1/violations"
            token = {"authorization": "Bearer view-token-for-the-chart"}
            assert client.get(view).status_code == 401
            # The readiness probe the chart points at the view answers without the token.
            ready = client.get(f"{scheme}://127.0.0.1:{ports[view_port]}/readyz")
            assert (ready.status_code, ready.json()["status"]) == (200, "ready")
            rules = sorted(rule for rule, _, _ in expected)
            wait_until(lambda: sorted(v["rule"] for v in client.get(view, headers=token).json()["items"]) == rules,
                       timeout_s=20, interval_s=0.2, what=f"{rules} on the operator view")
        if prometheus is not None:
            wait_until(lambda: firing(prometheus.url, "DurableCheckCriticalViolation", "DS002"),
                       timeout_s=40, interval_s=0.5, what="DurableCheckCriticalViolation firing in Prometheus")
        if alertmanager is not None:
            wait_until(lambda: received_by_alertmanager(alertmanager.url, "DS002"),
                       timeout_s=40, interval_s=0.5, what="the DS002 alert in Alertmanager")
        if tier is not None and tier_process is not None:
            tier_metrics = f"http://127.0.0.1:{tier.ports[9464]}/metrics"
            # The one span, sent on once (counted once the evaluator has taken it).
            wait_until(lambda: route_sent_spans(httpx.get(tier_metrics, timeout=5).text) == 1.0,
                       timeout_s=20, interval_s=0.2, what="the first tier's durable_check_route_sent_spans_total")
            tier_code = tier_process.stop()
            assert tier_code == 0, tier_process.output()[-4000:]
            assert (tier.data / "first-tier.db").exists(), "its journal, on its own volume"
        code = server.stop()
    jsonl = data / "violations.jsonl"
    found = sorted(json.loads(line)["rule"] for line in jsonl.read_text(encoding="utf-8").splitlines())
    assert found == sorted(rule for rule, _, _ in expected)
    assert code == 0, server.output()[-4000:]


@dataclasses.dataclass(frozen=True)
class FirstTierRun:
    config_path: Path
    data: Path
    ports: dict[int, int]


def first_tier_for_run(objects: list[dict[str, Any]], workdir: Path, to_grpc_port: int) -> FirstTierRun:
    """The first tier's pod laid out locally: its ConfigMap's config, its own data volume and
    ports, route.endpoint pointed at the evaluator's gRPC receiver on ``to_grpc_port``."""
    (configmap,) = [o for o in by_kind(objects, "ConfigMap") if first_tier(o)]
    (tier_workload,) = [o for o in by_kind(objects, "StatefulSet") if first_tier(o)]
    pod = tier_workload["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert volume["projected"]["sources"][0]["configMap"]["name"] == configmap["metadata"]["name"]
    etc = workdir / "etc-durable-check-first-tier"
    data = workdir / "var-lib-durable-check-first-tier"
    etc.mkdir()
    data.mkdir()
    config, ports = rewrite_for_localhost(yaml.safe_load(configmap["data"]["config.yaml"]), {
        "/etc/durable-check": etc, "/var/lib/durable-check": data,
    })
    assert config["route"]["endpoint"] == "otel-collector.observability:14317"
    config["route"]["endpoint"] = f"127.0.0.1:{to_grpc_port}"
    config_path = write_yaml(etc / "config.yaml", config)
    give_to_unprivileged(etc, data)
    return FirstTierRun(config_path, data, ports)


def route_sent_spans(exposition: str) -> float:
    return sum(sample.value
               for family in text_string_to_metric_families(exposition)
               if family.name == "durable_check_route_sent_spans"
               for sample in family.samples
               if sample.name == "durable_check_route_sent_spans_total")


def firing(prometheus_url: str, alertname: str, rule: str) -> bool:
    alerts = httpx.get(f"{prometheus_url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return any(a["labels"].get("alertname") == alertname and a["labels"].get("rule") == rule
               and a["state"] == "firing" for a in alerts)


def received_by_alertmanager(alertmanager_url: str, rule: str) -> bool:
    alerts = httpx.get(f"{alertmanager_url}/api/v2/alerts", timeout=5).json()
    return any(a["labels"].get("rule") == rule for a in alerts)


def test_render_examples_script_check_mode() -> None:
    result = subprocess.run([sys.executable, str(REPO / "deploy/helm/render-examples.py"), "--check"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
