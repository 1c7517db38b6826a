"""The Helm chart in deploy/helm/kvroute, rendered and linted by Helm's own engine.

No Linux `helm` binary is packaged for Debian or PyPI; helm-python-sdk ships Helm's Go
SDK (v4) as a library, so `helm lint` and `helm template` run here as Helm runs them,
offline. .ci/run installs it; without it these tests skip and say why.

The chart is rendered with its default values and with every optional feature on, and
the objects are checked as a cluster would see them: kinds and apiVersions, selectors
against labels, Service and probe ports against container ports and the router's
config, the ConfigMap through the router's own config loader, secrets by secretKeyRef
for every `*_env` key, RBAC exactly where Kubernetes discovery needs it, the grace
period against the drain, and the default render against deploy/kubernetes/.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import Config, build
from tests.deploy import test_manifests as kustomize

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk (Helm's engine) is not installed: the test extra has it"
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvroute"
NAMESPACE = "llm"
SELECTOR_KEYS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
}

#: every optional feature on: discovery in two namespaces, admin API with metrics on it,
#: auth and backend keys from Secrets, usage records on a writable volume, ServiceMonitor, HPA
FULL: dict[str, Any] = {
    "config": {
        "discovery": [
            {"kind": "kubernetes", "service": "vllm", "port": 8000, "kv_events_port": 5557},
            {"kind": "kubernetes", "service": "vllm", "namespace": "gpu"},
            {"kind": "dns", "name": "vllm.llm.svc.cluster.local"},
        ],
        "admin": {"host": "0.0.0.0", "port": 9001, "token_env": "ADMIN_TOKEN"},
        "metrics": {"listen": "admin"},
        "auth": {"enabled": True, "signing_key_env": "SIGNING_KEY"},
        "backend_defaults": {"api_key_env": "VLLM_API_KEY"},
        "shutdown": {"unready_seconds": 2.5, "drain_seconds": 120},
        "usage": {"records": True},
    },
    "secretEnv": {
        "ADMIN_TOKEN": {"secretName": "kvroute-secrets", "key": "admin-token"},
        "SIGNING_KEY": {"secretName": "kvroute-secrets", "key": "signing-key"},
        "VLLM_API_KEY": {"secretName": "vllm", "key": "api-key"},
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12},
    "podAnnotations": {"example.com/team": "llm"},
    "nodeSelector": {"node-pool": "cpu"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "router"}],
    "imagePullSecrets": [{"name": "registry"}],
}
#: the values files shipped beside the chart (deploy/README.md shows this one)
DISCOVERY = yaml.safe_load((CHART / "ci" / "discovery-values.yaml").read_text())
CASES = {"default": ({}, "kvroute"), "full": (FULL, "edge"), "discovery": (DISCOVERY, "kvroute")}

#: kind -> (apiVersion, spec paths that must be present) of every kind the chart renders;
#: an autoscaled Deployment leaves `replicas` to its HPA
KINDS = kustomize.KINDS | {
    "Deployment": ("apps/v1", ("spec.selector.matchLabels", "spec.template")),
    "HorizontalPodAutoscaler": (
        "autoscaling/v2",
        ("spec.scaleTargetRef", "spec.minReplicas", "spec.maxReplicas", "spec.metrics"),
    ),
}


class Rendered:
    """One `helm template`: the objects, by kind, and the NOTES."""

    def __init__(self, manifests: dict[str, str], values: dict[str, Any]) -> None:
        self.values = values
        self.notes = manifests.pop("kvroute/templates/NOTES.txt")
        self.objects = [d for text in manifests.values() for d in yaml.safe_load_all(text) if d]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.objects if d["kind"] == kind]

    def one(self, kind: str) -> dict:
        (found,) = self.of_kind(kind)
        return found

    @property
    def deployment(self) -> dict:
        return self.one("Deployment")

    @property
    def container(self) -> dict:
        (container,) = self.deployment["spec"]["template"]["spec"]["containers"]
        return container

    @property
    def config_data(self) -> dict:
        return yaml.safe_load(self.one("ConfigMap")["data"]["router.yaml"])

    @property
    def config(self) -> Config:
        return build(self.config_data, "the chart's ConfigMap")


def render(values: dict[str, Any], name: str = "kvroute") -> Rendered:
    with helm.Chart.load(CHART) as chart:
        return Rendered(chart.render(values, name=name, namespace=NAMESPACE), values)


def render_error(values: dict[str, Any]) -> str:
    with pytest.raises(helm.HelmRenderError) as failed:
        render(values)
    return str(failed.value)


def with_config(**config: Any) -> dict[str, Any]:
    return {"config": config}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Rendered:
    values, name = CASES[request.param]
    return render(values, name)


@pytest.fixture(scope="module", autouse=True)
def _quiet_helm() -> None:
    """Helm logs each `fail` it evaluates to stderr; the tests read the error instead."""
    helm.disable_logging()


# ---- lint and object shape ----------------------------------------------------------------


@pytest.mark.parametrize("values", [v for v, _ in CASES.values()], ids=list(CASES))
def test_helm_lint_strict_passes(values: dict) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warning or error
    assert not problems and not report["errors"], report


def test_every_object_is_a_kubernetes_object(case: Rendered) -> None:
    for doc in case.objects:
        api_version, paths = KINDS[doc["kind"]]
        assert doc["apiVersion"] == api_version, doc["kind"]
        meta = doc["metadata"]
        assert meta["name"] and len(meta["name"]) <= 63
        assert meta["namespace"] in (NAMESPACE, "gpu")
        assert set(meta["labels"]) >= SELECTOR_KEYS
        for dotted in paths:
            kustomize._get(doc, dotted)
    names = [(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]) for d in case.objects]
    assert len(names) == len(set(names))


def test_the_optional_objects_render_only_when_asked() -> None:
    base = {"Deployment", "Service", "ConfigMap", "ServiceAccount", "PodDisruptionBudget"}
    extra = {"Role", "RoleBinding", "ServiceMonitor", "HorizontalPodAutoscaler"}
    assert {d["kind"] for d in render({}).objects} == base
    assert {d["kind"] for d in render(FULL).objects} == base | extra
    off = {"podDisruptionBudget": {"enabled": False}, "serviceAccount": {"create": False}}
    rendered = render(off)
    assert {d["kind"] for d in rendered.objects} == base - {"PodDisruptionBudget", "ServiceAccount"}
    assert rendered.deployment["spec"]["template"]["spec"]["serviceAccountName"] == "default"


def test_notes_name_the_release_objects(case: Rendered) -> None:
    name = case.deployment["metadata"]["name"]
    assert f"deployment/{name}" in case.notes
    assert f"svc/{name} {case.config.listen.port}:{case.config.listen.port}" in case.notes


# ---- selectors and labels -----------------------------------------------------------------


def test_selectors_match_the_router_pods(case: Rendered) -> None:
    deployment = case.deployment
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod = deployment["spec"]["template"]
    assert set(selector) == SELECTOR_KEYS, "selectors hold only labels an upgrade never changes"
    assert kustomize._selects(selector, pod["metadata"]["labels"])
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"] == selector
    service = case.one("Service")
    assert service["spec"]["selector"] == selector
    assert case.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector
    for monitor in case.of_kind("ServiceMonitor"):
        assert kustomize._selects(
            monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]
        )
    for hpa in case.of_kind("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        assert target["name"] == deployment["metadata"]["name"]


def test_two_releases_select_only_their_own_pods() -> None:
    one, two = render({}, "kvroute"), render({}, "kvroute-canary")
    pods = two.deployment["spec"]["template"]["metadata"]["labels"]
    assert not kustomize._selects(one.one("Service")["spec"]["selector"], pods)
    assert one.deployment["metadata"]["name"] != two.deployment["metadata"]["name"]


def test_replicas_are_the_hpas_when_autoscaling() -> None:
    assert render({}).deployment["spec"]["replicas"] == 3
    rendered = render(FULL)
    assert "replicas" not in rendered.deployment["spec"]
    spec = rendered.one("HorizontalPodAutoscaler")["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (3, 12)
    (metric,) = spec["metrics"]
    assert metric["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 70},
    }
    assert {"cpu"} <= set(
        rendered.container["resources"]["requests"]
    )  # what Utilization divides by


# ---- ports and probes ---------------------------------------------------------------------


def test_container_ports_are_the_configs(case: Rendered) -> None:
    config = case.config
    ports = {p["name"]: p["containerPort"] for p in case.container["ports"]}
    expected = {"http": config.listen.port}
    if config.grpc.enabled:
        expected["grpc"] = config.grpc.port
    if config.admin is not None and config.admin.host == "0.0.0.0":
        expected["admin"] = config.admin.port
    assert ports == expected
    assert config.listen.host == "0.0.0.0"


def test_service_ports_target_container_ports(case: Rendered) -> None:
    service_ports = case.one("Service")["spec"]["ports"]
    assert {p["name"] for p in service_ports} == {p["name"] for p in case.container["ports"]}
    for port in service_ports:
        assert kustomize._container_port(case.container, port["targetPort"]) == port["port"]


def test_probes_hit_the_http_port(case: Rendered) -> None:
    container = case.container
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/ready", "/health")
    for probe in (ready, live):
        assert kustomize._container_port(container, probe["port"]) == case.config.listen.port


def test_probes_speak_https_to_a_tls_listener() -> None:
    tls = {
        "cert_file": "/etc/kvroute-secrets/tls/tls.crt",
        "key_file": "/etc/kvroute-secrets/tls/tls.key",
    }
    values = with_config(listen={"host": "0.0.0.0", "port": 8443, "tls": tls})
    values["secretFiles"] = [{"secretName": "tls"}]
    container = render(values).container
    for probe in (container["readinessProbe"], container["livenessProbe"]):
        assert probe["httpGet"]["scheme"] == "HTTPS"
        assert probe["httpGet"]["port"] == "http"
    assert "scheme" not in render({}).container["livenessProbe"]["httpGet"]  # HTTP's default


def test_ports_follow_the_config() -> None:
    rendered = render(
        with_config(listen={"host": "0.0.0.0", "port": 9000}, grpc={"enabled": False})
    )
    assert {p["name"]: p["containerPort"] for p in rendered.container["ports"]} == {"http": 9000}
    assert [p["port"] for p in rendered.one("Service")["spec"]["ports"]] == [9000]


def test_servicemonitor_scrapes_where_metrics_are_served() -> None:
    for values, port in ((FULL, "admin"), ({"serviceMonitor": {"enabled": True}}, "http")):
        rendered = render(values)
        (endpoint,) = rendered.one("ServiceMonitor")["spec"]["endpoints"]
        assert (endpoint["port"], endpoint["path"]) == (port, "/metrics")
        assert port in {p["name"] for p in rendered.one("Service")["spec"]["ports"]}


def test_configs_the_pod_cannot_serve_fail_the_render() -> None:
    loopback = with_config(listen={"host": "127.0.0.1", "port": 8000})
    assert "config.listen.host is loopback" in render_error(loopback)
    admin_only = with_config(admin={"token_env": "T"}, metrics={"listen": "admin"})
    admin_only["secretEnv"] = {"T": {"secretName": "s", "key": "k"}}
    assert "Prometheus cannot scrape it" in render_error(admin_only)


# ---- the ConfigMap, secrets, the grace period ---------------------------------------------


def test_configmap_is_mounted_where_the_args_point(case: Rendered) -> None:
    pod = case.deployment["spec"]["template"]["spec"]
    args = case.container["args"]
    assert args == ["-c", "/etc/kvroute/router.yaml"]  # after the image's `kvroute serve`
    (mount,) = [m for m in case.container["volumeMounts"] if m["mountPath"] == "/etc/kvroute"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == case.one("ConfigMap")["metadata"]["name"]
    assert "router.yaml" in case.one("ConfigMap")["data"]


def test_config_change_rolls_the_pods() -> None:
    def checksum(values: dict) -> str:
        return render(values).deployment["spec"]["template"]["metadata"]["annotations"][
            "checksum/config"
        ]

    assert checksum({}) != checksum(with_config(log_level="debug"))


def test_default_config_passes_serve_check(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(render({}).one("ConfigMap")["data"]["router.yaml"])
    cmd = [sys.executable, "-m", "router", "serve", "--check", "-c", str(path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_configmap_passes_the_routers_loader(case: Rendered) -> None:
    """router.config.build: strict fields, bounds, cross-field rules."""
    config = case.config
    assert config.backends or config.discovery


def _env_names(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {v for k, v in node.items() if k.endswith("_env") and isinstance(v, str)}
        return found.union(*(_env_names(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_env_names(v) for v in node))
    return set()


def test_every_env_key_comes_from_a_secret(case: Rendered) -> None:
    names = _env_names(case.config_data)
    env = {e["name"]: e for e in case.container.get("env", [])}
    assert names <= set(env)
    for entry in env.values():
        assert "value" not in entry, f"{entry['name']} is inline"
        assert set(entry["valueFrom"]) == {"secretKeyRef"}
    for name, ref in case.values.get("secretEnv", {}).items():
        assert env[name]["valueFrom"]["secretKeyRef"] == {
            "name": ref["secretName"],
            "key": ref["key"],
        }


def test_an_env_key_without_its_secret_fails_the_render() -> None:
    values = copy.deepcopy(FULL)
    del values["secretEnv"]["VLLM_API_KEY"]
    assert "config names the variable VLLM_API_KEY" in render_error(values)
    values = with_config(backends=[{"url": "http://vllm-0.vllm:8000", "api_key_env": "KEY0"}])
    assert "secretEnv.KEY0" in render_error(values)
    values["secretEnv"] = {"KEY0": {"key": "k"}}
    assert "secretEnv.KEY0.secretName" in render_error(values)


def test_the_notes_advise_sharing_when_kv_aware_replicas_have_no_kv_events() -> None:
    assert "share through Redis" not in render({}).notes  # the defaults have KV events
    alone = with_config(backends=[{"url": "http://vllm-0.vllm:8000"}])
    assert "config.cluster.redis" in render(alone).notes
    assert "share through Redis" not in render({**alone, "replicaCount": 1}).notes
    prefix = with_config(backends=alone["config"]["backends"], routing={"strategy": "PREFIX_AWARE"})
    assert "share through Redis" not in render(prefix).notes


def test_the_cluster_redis_password_comes_from_a_secret() -> None:
    """Replicas sharing through Redis (config `cluster`): its password_env is wired from
    secretEnv like every other `*_env` key, and rendering fails without it."""
    values = with_config(
        cluster={"redis": {"url": "redis://redis:6379/0", "password_env": "REDIS_PASSWORD"}}
    )
    assert "config names the variable REDIS_PASSWORD" in render_error(values)
    values["secretEnv"] = {"REDIS_PASSWORD": {"secretName": "redis", "key": "password"}}
    rendered = render(values)
    assert rendered.config.cluster.redis.password_env == "REDIS_PASSWORD"
    assert "share through Redis" not in rendered.notes
    env = {e["name"]: e for e in rendered.container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis",
        "key": "password",
    }


@pytest.mark.parametrize(
    "shutdown,pre_stop",
    [({}, 5), ({"drain_seconds": 0}, 5), ({"unready_seconds": 2.5, "drain_seconds": 120.5}, 1)],
)
def test_grace_period_covers_pre_stop_and_drain(shutdown: dict, pre_stop: int) -> None:
    rendered = render({"config": {"shutdown": shutdown}, "preStopSleepSeconds": pre_stop})
    pod = rendered.deployment["spec"]["template"]["spec"]
    command = rendered.container["lifecycle"]["preStop"]["exec"]["command"]
    assert command == ["sleep", str(pre_stop)]
    config = rendered.config.shutdown
    needed = pre_stop + config.unready_seconds + config.drain_seconds
    assert needed < pod["terminationGracePeriodSeconds"] <= needed + 11


# ---- RBAC for Kubernetes discovery ---------------------------------------------------------


def test_no_api_access_without_kubernetes_discovery() -> None:
    rendered = render(with_config(discovery=[{"kind": "dns", "name": "vllm"}]))
    assert not rendered.of_kind("Role") and not rendered.of_kind("RoleBinding")
    assert rendered.deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert rendered.one("ServiceAccount")["automountServiceAccountToken"] is False


def test_kubernetes_discovery_gets_its_role_in_each_namespace() -> None:
    rendered = render(FULL, "edge")
    account = rendered.one("ServiceAccount")["metadata"]["name"]
    assert rendered.deployment["spec"]["template"]["spec"]["serviceAccountName"] == account
    assert rendered.deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    roles = {r["metadata"]["namespace"]: r for r in rendered.of_kind("Role")}
    bindings = {b["metadata"]["namespace"]: b for b in rendered.of_kind("RoleBinding")}
    assert set(roles) == set(bindings) == {NAMESPACE, "gpu"}
    for namespace, role in roles.items():
        assert role["rules"] == kustomize._one("Role")["rules"]
        binding = bindings[namespace]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
        ]


def test_rbac_create_overrides_the_config() -> None:
    forced = render({"rbac": {"create": True}})
    assert [r["metadata"]["namespace"] for r in forced.of_kind("Role")] == [NAMESPACE]
    assert not render({**FULL, "rbac": {"create": False}}).of_kind("Role")


# ---- what the config writes ----------------------------------------------------------------


def _written_dirs(config: Config) -> dict[str, str]:
    """The directory each path the router writes under `config` needs writable, by key
    (router.config's defaults: the chart must agree with them)."""
    dirs = {}
    if config.jobs.enabled and config.jobs.store == "sqlite":
        dirs["jobs.path"] = str(Path(config.jobs.path).parent)
    if config.usage.records:
        dirs["usage.path"] = str(Path(config.usage.path).parent)
    if config.capture.enabled:
        dirs["capture.path"] = config.capture.path
    if config.access_log.enabled and config.access_log.path != "-":
        dirs["access_log.path"] = str(Path(config.access_log.path).parent)
    return dirs


def _writable_volume_of(rendered: Rendered, directory: str) -> dict:
    """The volume of the writable mount that holds `directory` (AssertionError if none)."""
    holding = [
        m
        for m in rendered.container["volumeMounts"]
        if not m.get("readOnly") and (directory + "/").startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert holding, f"no writable mount holds {directory}"
    volumes = {v["name"]: v for v in rendered.deployment["spec"]["template"]["spec"]["volumes"]}
    return volumes[holding[-1]["name"]]


def _writable_mounts(rendered: Rendered) -> list[str]:
    return [
        m["mountPath"]
        for m in rendered.container["volumeMounts"]
        if m["name"].startswith("writable-")
    ]


def test_every_path_the_config_writes_is_on_a_writable_volume() -> None:
    """Jobs on SQLite, usage records, capture and an access-log file, at the router's
    default paths: each directory is on an emptyDir under the read-only root."""
    rendered = render(
        with_config(
            jobs={"enabled": True},
            usage={"records": True},
            capture={"enabled": True, "sample": 0.1},
            access_log={"path": "/var/log/kvroute/access.log"},
        )
    )
    dirs = _written_dirs(rendered.config)
    assert set(dirs) == {"jobs.path", "usage.path", "capture.path", "access_log.path"}
    for key, directory in dirs.items():
        assert _writable_volume_of(rendered, directory)["emptyDir"] == {"sizeLimit": "1Gi"}, key
    assert _writable_mounts(rendered) == ["/var/lib/kvroute", "/var/log/kvroute"]
    assert rendered.container["securityContext"]["readOnlyRootFilesystem"] is True


def test_notes_warn_that_sqlite_jobs_are_each_pods_own() -> None:
    jobs = with_config(jobs={"enabled": True})
    assert "Jobs on SQLite: each pod keeps its own jobs" in render(jobs).notes
    assert "Jobs on SQLite" not in render({**jobs, "replicaCount": 1}).notes
    assert "Jobs on SQLite" not in render({}).notes


def test_writable_volumes_are_mounted_only_when_the_config_writes_there() -> None:
    assert _writable_mounts(render({})) == []
    redis = {"enabled": True, "store": "redis", "redis": {"url": "redis://redis:6379/0"}}
    assert _writable_mounts(render(with_config(jobs=redis))) == []
    assert _writable_mounts(render(with_config(usage={"records": True}))) == ["/var/lib/kvroute"]


def test_a_claim_keeps_what_the_config_writes() -> None:
    values = with_config(capture={"enabled": True, "path": "/data/capture"})
    values["writableVolumes"] = [
        {"mountPath": "/var/lib/kvroute"},
        {"mountPath": "/data", "claimName": "kvroute-state"},
    ]
    rendered = render(values)
    volume = _writable_volume_of(rendered, "/data/capture")
    assert volume["persistentVolumeClaim"] == {"claimName": "kvroute-state"}
    assert _writable_mounts(rendered) == ["/data"]


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"jobs": {"enabled": True, "path": "/srv/kvroute/jobs.db"}},
         "config.jobs.path /srv/kvroute/jobs.db: the root filesystem is read-only and no "
         "writableVolumes entry holds /srv/kvroute; use writableVolumes: "
         "[{mountPath: /srv/kvroute}]"),
        ({"usage": {"records": True, "path": "/data/usage.db"}}, "config.usage.path /data/"),
        ({"capture": {"enabled": True, "path": "/capture"}}, "config.capture.path /capture:"),
        ({"access_log": {"path": "/tmp/access.log"}},
         "config.access_log.path /tmp/access.log: the root filesystem is read-only and no "
         "writableVolumes entry holds /tmp; use a directory of its own, e.g. /var/lib/kvroute"),
        ({"jobs": {"enabled": True, "path": "jobs.db"}},
         "config.jobs.path jobs.db is a relative path"),
    ],
    ids=["jobs", "usage", "capture", "access-log-in-tmp", "relative"],
)  # fmt: skip
def test_a_written_path_no_volume_holds_fails_the_render_naming_its_key(
    config: dict, expected: str
) -> None:
    assert expected in render_error({"config": config})


# ---- the chart's defaults are deploy/kubernetes/ ------------------------------------------


def _pairs() -> list[tuple[dict, dict]]:
    """(kustomize object, chart object) for every router object the kustomize set has."""
    rendered = render({"serviceMonitor": {"enabled": True}, "rbac": {"create": True}})
    chart = {(d["kind"], d["metadata"]["name"]): d for d in rendered.objects}
    return [
        (doc, chart[(doc["kind"], doc["metadata"]["name"])])
        for _, doc in kustomize.MANIFESTS
        if doc["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
    ]


def test_chart_renders_every_kustomize_router_object_with_its_labels() -> None:
    pairs = _pairs()
    assert {k["kind"] for k, _ in pairs} == set(kustomize.KINDS) - {"StatefulSet"}
    for kust, chart in pairs:
        assert kust["metadata"]["labels"].items() <= chart["metadata"]["labels"].items()


def test_chart_and_kustomize_deployments_agree() -> None:
    kust = kustomize._router_deployment()
    chart = render({}).deployment
    assert (
        kustomize._container(kust, "kvroute") == chart["spec"]["template"]["spec"]["containers"][0]
    )
    for key in ("replicas", "revisionHistoryLimit", "strategy"):
        assert kust["spec"][key] == chart["spec"][key], key
    kust_pod, chart_pod = kust["spec"]["template"]["spec"], chart["spec"]["template"]["spec"]
    assert kust_pod.keys() == chart_pod.keys()
    for key in kust_pod.keys() - {"topologySpreadConstraints"}:
        assert kust_pod[key] == chart_pod[key], key
    for spread in (kust_pod, chart_pod):
        (constraint,) = spread["topologySpreadConstraints"]
        constraint.pop("labelSelector")  # each selects its own pods (checked above)
    assert kust_pod["topologySpreadConstraints"] == chart_pod["topologySpreadConstraints"]


def test_chart_and_kustomize_specs_agree() -> None:
    for kust, chart in _pairs():
        if kust["kind"] in ("Service", "PodDisruptionBudget", "ServiceMonitor"):
            strip = {"selector"}
            assert {k: v for k, v in kust["spec"].items() if k not in strip} == {
                k: v for k, v in chart["spec"].items() if k not in strip
            }, kust["kind"]
        if kust["kind"] in ("Role", "ServiceAccount"):
            assert {k: v for k, v in kust.items() if k != "metadata"} == {
                k: v for k, v in chart.items() if k != "metadata"
            }, kust["kind"]


def test_chart_default_config_is_the_kustomize_config() -> None:
    assert render({}).config_data == kustomize._router_config_data()


def test_every_file_key_is_read_from_a_mounted_secret() -> None:
    """`*_file` keys point into Secrets the chart mounts read-only, readable by the pod's
    fsGroup alone; one that points anywhere else fails the render, naming the path."""
    config = {
        "auth": {"enabled": True, "tokens_file": "/etc/kvroute-secrets/auth/tokens"},
        "jobs": {"enabled": True, "store": "redis",
                 "redis": {"url": "redis://redis:6379/0",
                           "password_file": "/var/run/redis-secret/password"}},
    }  # fmt: skip
    files = [
        {"secretName": "kvroute-auth", "mountPath": "/etc/kvroute-secrets/auth"},
        {"secretName": "redis-secret", "mountPath": "/var/run/redis-secret"},
    ]
    rendered = render({"config": config, "secretFiles": files})
    mounts = {m["mountPath"]: m for m in rendered.container["volumeMounts"]}
    volumes = {v["name"]: v for v in rendered.deployment["spec"]["template"]["spec"]["volumes"]}
    for secret in files:
        mount = mounts[secret["mountPath"]]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {
            "secretName": secret["secretName"],
            "defaultMode": 0o440,
        }
    assert rendered.config.jobs.redis.password_file == "/var/run/redis-secret/password"
    error = render_error({"config": config, "secretFiles": files[:1]})
    assert "config names the file /var/run/redis-secret/password" in error
    by_name = [{"secretName": "auth"}, files[1]]  # mounted at /etc/kvroute-secrets/auth
    default_mount = render({"config": config, "secretFiles": by_name})
    assert "/etc/kvroute-secrets/auth" in {
        m["mountPath"] for m in default_mount.container["volumeMounts"]
    }
