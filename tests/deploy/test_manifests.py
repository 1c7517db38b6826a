"""Offline checks of everything under deploy/: Kubernetes manifests, example configs,
the Grafana dashboard, the alert rules, the Dockerfile and the systemd unit.

Nothing here needs a cluster, a Docker engine or systemd: manifests are parsed and
cross-checked (labels, ports, probes, the ConfigMap's router config against the vLLM
StatefulSet it points at), configs go through `router.config.build` and the real
`kvroute serve --check`, and the dashboard's queries are compared with the metric
families a real router (in front of a stub backend) exports. The alert rules are
checked the same way, by promtool, and by a real Prometheus on loopback scraping a real
router, where Debian's prometheus package is installed (.ci/run installs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

import policies
from bench.harness.processes import free_port
from router.config import CaptureConfig, JobsConfig, ShutdownConfig, UsageConfig, build
from tests.router.conftest import running

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
EXAMPLES = DEPLOY / "examples"
DASHBOARD = DEPLOY / "grafana" / "kvroute.json"
DOCKERFILE = DEPLOY / "Dockerfile"
UNIT = DEPLOY / "systemd" / "kvroute.service"

#: Helm templates are not YAML until rendered (tests/deploy/test_helm.py renders them)
HELM_TEMPLATES = set((DEPLOY / "helm").glob("*/templates/*"))
ALL_YAML = sorted({*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")} - HELM_TEMPLATES)
EXAMPLE_CONFIGS = sorted(EXAMPLES.glob("*.yaml"))
MANIFEST_FILES = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")

#: kind -> (apiVersion, spec paths that must be present)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Deployment": ("apps/v1", ("spec.replicas", "spec.selector.matchLabels", "spec.template")),
    "StatefulSet": (
        "apps/v1",
        ("spec.serviceName", "spec.replicas", "spec.selector.matchLabels", "spec.template"),
    ),
    "Service": ("v1", ("spec.selector", "spec.ports")),
    "ConfigMap": ("v1", ("data",)),
    "ServiceAccount": ("v1", ()),
    "Role": ("rbac.authorization.k8s.io/v1", ("rules",)),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", ("roleRef", "subjects")),
    "PodDisruptionBudget": ("policy/v1", ("spec.selector.matchLabels",)),
    "ServiceMonitor": ("monitoring.coreos.com/v1", ("spec.selector.matchLabels", "spec.endpoints")),
}


def _docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _get(doc: dict, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(doc, dict) or key not in doc:
            raise KeyError(dotted)
        doc = doc[key]
    return doc


MANIFESTS = [(p.name, d) for p in MANIFEST_FILES for d in _docs(p)]


def _of_kind(kind: str) -> list[dict]:
    return [d for _, d in MANIFESTS if d["kind"] == kind]


def _one(kind: str, name: str | None = None) -> dict:
    found = [d for d in _of_kind(kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _router_deployment() -> dict:
    return _one("Deployment", "kvroute")


def _container(workload: dict, name: str | None = None) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def _container_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    raise AssertionError(f"port {port!r} is not a port of container {container['name']}")


def _router_config_data() -> dict:
    return yaml.safe_load(_one("ConfigMap", "kvroute-config")["data"]["router.yaml"])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pod_workloads() -> list[dict]:
    return _of_kind("Deployment") + _of_kind("StatefulSet")


# ---- every YAML file under deploy/ -------------------------------------------------------


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses_to_mappings(path: Path) -> None:
    docs = _docs(path)
    assert docs, "empty file"
    assert all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("name,doc", MANIFESTS, ids=[f"{n}:{d['kind']}" for n, d in MANIFESTS])
def test_manifest_required_fields(name: str, doc: dict) -> None:
    assert doc["kind"] in KINDS, f"{name}: unexpected kind {doc['kind']}"
    api_version, paths = KINDS[doc["kind"]]
    assert doc["apiVersion"] == api_version
    assert doc["metadata"]["name"]
    assert "namespace" not in doc["metadata"], "manifests are namespace-agnostic"
    for dotted in paths:
        _get(doc, dotted)


def test_every_required_kind_is_present() -> None:
    assert {d["kind"] for _, d in MANIFESTS} == set(KINDS)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert "namespace" not in kustomization
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFEST_FILES]


@pytest.mark.parametrize("workload", _pod_workloads(), ids=lambda d: d["metadata"]["name"])
def test_workload_selector_matches_its_pods(workload: dict) -> None:
    selector = workload["spec"]["selector"]["matchLabels"]
    assert _selects(selector, workload["spec"]["template"]["metadata"]["labels"])


# ---- the router Deployment ---------------------------------------------------------------


def test_router_deployment_probes_and_ports() -> None:
    container = _container(_router_deployment(), "kvroute")
    listen = build(_router_config_data()).listen
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert ready["path"] == "/ready"
    assert live["path"] == "/health"
    assert _container_port(container, ready["port"]) == listen.port
    assert _container_port(container, live["port"]) == listen.port
    assert listen.host == "0.0.0.0"  # reachable from the kubelet and the Service


def test_router_deployment_shape_and_hardening() -> None:
    deployment = _router_deployment()
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment, "kvroute")
    assert deployment["spec"]["replicas"] >= 2
    accounts = {sa["metadata"]["name"] for sa in _of_kind("ServiceAccount")}
    assert pod["serviceAccountName"] in accounts
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    csc = container["securityContext"]
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]


def test_router_deployment_mounts_its_config() -> None:
    deployment = _router_deployment()
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment, "kvroute")
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/kvroute"]
    configmap = volumes[mount["name"]]["configMap"]["name"]
    args = container["args"]
    config_path = Path(args[args.index("-c") + 1])
    assert config_path.parent == Path(mount["mountPath"])
    assert config_path.name in _one("ConfigMap", configmap)["data"]


def test_router_grace_period_covers_the_drain() -> None:
    """SIGTERM comes after preStop; then unready_seconds, then up to drain_seconds."""
    deployment = _router_deployment()
    pod = deployment["spec"]["template"]["spec"]
    pre_stop = _container(deployment, "kvroute")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown = build(_router_config_data()).shutdown
    needed = float(pre_stop[1]) + shutdown.unready_seconds + shutdown.drain_seconds
    assert pod["terminationGracePeriodSeconds"] > needed


# ---- Services, PDB, ServiceMonitor -------------------------------------------------------


@pytest.mark.parametrize("service", _of_kind("Service"), ids=lambda d: d["metadata"]["name"])
def test_service_selects_pods_and_their_ports(service: dict) -> None:
    selector = service["spec"]["selector"]
    targets = [
        w
        for w in _pod_workloads()
        if _selects(selector, w["spec"]["template"]["metadata"]["labels"])
    ]
    assert len(targets) == 1, "a Service selects exactly one workload's pods"
    container = _container(targets[0])
    for port in service["spec"]["ports"]:
        _container_port(container, port.get("targetPort", port["port"]))


def test_router_service_exposes_http_and_grpc() -> None:
    config = build(_router_config_data())
    ports = {p["port"] for p in _one("Service", "kvroute")["spec"]["ports"]}
    assert config.listen.port in ports
    assert (config.grpc.port in ports) == config.grpc.enabled


def test_pdb_selects_the_router_pods() -> None:
    deployment = _router_deployment()
    pdb = _one("PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert 0 < pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_servicemonitor_scrapes_the_router_metrics_port() -> None:
    monitor = _one("ServiceMonitor")
    service = _one("Service", "kvroute")
    assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    container = _container(_router_deployment(), "kvroute")
    assert (
        _container_port(container, port["targetPort"]) == build(_router_config_data()).listen.port
    )


# ---- vLLM StatefulSet and the ConfigMap's backends ---------------------------------------


def _vllm() -> tuple[dict, dict, dict]:
    """The vLLM StatefulSet, its headless Service, and its parsed --kv-events-config."""
    sts = _one("StatefulSet", "vllm")
    service = _one("Service", sts["spec"]["serviceName"])
    args = _container(sts, "vllm")["args"]
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    return sts, service, kv


def test_vllm_statefulset_publishes_kv_events() -> None:
    sts, service, kv = _vllm()
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert kv["enable_kv_cache_events"] is True
    assert kv["publisher"] == "zmq"
    container = _container(sts, "vllm")
    assert "--enable-prompt-tokens-details" in container["args"]
    for endpoint in (kv["endpoint"], kv["replay_endpoint"]):
        _container_port(container, URL(endpoint.replace("tcp://", "http://")).port)


def test_configmap_backends_are_the_vllm_pods() -> None:
    sts, service, kv = _vllm()
    config = build(_router_config_data())
    assert config.routing.__struct_config__.tag == "KV_AWARE"
    http_port = _container_port(_container(sts, "vllm"), "http")
    pub, replay = (
        URL(kv[k].replace("tcp://", "http://")).port for k in ("endpoint", "replay_endpoint")
    )
    name, headless = sts["metadata"]["name"], service["metadata"]["name"]
    assert len(config.backends) == sts["spec"]["replicas"]
    for i, backend in enumerate(config.backends):
        host = f"{name}-{i}.{headless}"
        assert backend.url == f"http://{host}:{http_port}"
        assert backend.kv_events is not None
        assert backend.kv_events.endpoint == f"tcp://{host}:{pub}"
        assert backend.kv_events.replay_endpoint == f"tcp://{host}:{replay}"
        assert backend.kv_events.topic == kv["topic"]


# ---- configs through the real `kvroute serve --check` ------------------------------------


def _config_cases() -> list[tuple[str, str]]:
    cases = [(f"examples/{p.name}", p.read_text()) for p in EXAMPLE_CONFIGS]
    cases.append(("kubernetes/router-configmap.yaml", _one("ConfigMap")["data"]["router.yaml"]))
    return cases


@pytest.fixture(scope="module")
def serve_check(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """`python -m router serve --check -c FILE` for every config, run concurrently."""
    tmp = tmp_path_factory.mktemp("configs")

    def check(case: tuple[str, str]) -> tuple[str, subprocess.CompletedProcess]:
        name, text = case
        path = tmp / name.replace("/", "__")
        path.write_text(text)
        cmd = [sys.executable, "-m", "router", "serve", "--check", "-c", str(path)]
        return name, subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(check, _config_cases()))


@pytest.mark.parametrize("name,text", _config_cases(), ids=[n for n, _ in _config_cases()])
def test_config_passes_serve_check(name: str, text: str, serve_check: dict) -> None:
    build(yaml.safe_load(text), name)
    result = serve_check[name]
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("config OK")


@pytest.mark.parametrize("name,text", _config_cases(), ids=[n for n, _ in _config_cases()])
def test_config_addresses_backends_by_name(name: str, text: str) -> None:
    config = build(yaml.safe_load(text), name)
    for backend in config.backends:
        urls = [backend.url]
        if backend.kv_events is not None:
            urls += [
                u for u in (backend.kv_events.endpoint, backend.kv_events.replay_endpoint) if u
            ]
        for url in urls:
            host = URL(url.replace("tcp://", "http://")).host
            assert host, url
            with pytest.raises(ValueError):
                ipaddress.ip_address(host)


def test_one_example_per_strategy() -> None:
    strategies = {}
    for path in EXAMPLE_CONFIGS:
        if path.name == "router.yaml":
            continue
        config = build(yaml.safe_load(path.read_text()), path.name)
        strategies[config.routing.__struct_config__.tag] = path.name
    assert set(strategies) == set(policies.names())
    assert set(strategies.values()) == {
        "random.yaml",
        "round-robin.yaml",
        "least-outstanding.yaml",
        "prefix-aware.yaml",
        "kv-aware.yaml",
    }


# ---- Grafana dashboard against the metrics a real router exports -------------------------


async def _scrape() -> tuple[str, dict[str, tuple[str, ...]]]:
    async with running(1) as (router, _stubs), aiohttp.ClientSession() as session:
        body = {
            "model": "stub-model",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with session.post(f"{router.url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.read()
        backend = router.fleet.members[0]  # a drain and undrain: state-change samples
        router.fleet.set_draining(backend, True)
        router.fleet.set_draining(backend, False)
        declared = {
            m._name: tuple(m._labelnames)
            for m in vars(router.metrics).values()
            if hasattr(m, "_labelnames") and hasattr(m, "_name")
        }
        return router.metrics.render().decode(), declared


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Every sample name a query may use -> the label names it carries."""
    text, declared = asyncio.run(_scrape())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = set(declared.get(family.name, ()))
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        for suffix in suffixes.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set()).update(labels)
        if family.type == "histogram":
            names[family.name + "_bucket"].add("le")
    assert "kvroute_requests_total" in names and "kvroute_backend_up" in names
    return names


_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query or "")
        if match:  # a label_values(metric, label) variable, as a selector
            exprs.append(f"{match[1]}{{{match[2]}!=''}}")
    return exprs


def _parse(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """Metric names in a PromQL expression with the labels their selectors match, and
    the label names of its `by (...)`/`without (...)` clauses."""
    expr = re.sub(r"\$\{?\w+\}?", "X", expr)  # Grafana variables
    selectors: dict[str, set[str]] = {}
    for name, matchers in re.findall(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr):
        labels = set(
            re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", re.sub(r'"[^"]*"|\'[^\']*\'', "", matchers))
        )
        selectors.setdefault(name, set()).update(labels)
    grouping = {
        label.strip()
        for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in clause.split(",")
        if label.strip()
    }
    bare = re.sub(
        r"\{[^}]*\}|\[[^\]]*\]|\b\d+(?:ms|[smhdwy])\b"
        r"|\b(?:by|without|on|ignoring|group_left|group_right)\s*(?:\([^)]*\))?",
        " ",
        expr,
    )
    for name in re.findall(r"[A-Za-z_:][\w:]*(?![\w:]*\s*\()", bare):
        if name.lower() not in _PROMQL_WORDS:
            selectors.setdefault(name, set())
    return selectors, grouping


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel.get("targets", []):
            assert target["expr"].strip() and target["refId"]
            assert target["datasource"]["uid"] == "${datasource}"
    assert len(_queries()) >= 20


@pytest.mark.parametrize("expr", _queries())
def test_dashboard_queries_only_exported_metrics(expr: str, exported: dict[str, set[str]]) -> None:
    selectors, grouping = _parse(expr)
    assert selectors, f"no metric found in {expr!r}"
    for name, labels in selectors.items():
        assert name.startswith("kvroute_"), f"{name} is not a kvroute metric"
        assert name in exported, f"{name} is not exported by the router"
        assert labels <= exported[name], f"{name} has no label {labels - exported[name]}"
    available = set().union(*(exported[n] for n in selectors))
    assert grouping <= available, f"grouping by {grouping - available} in {expr!r}"


def test_dashboard_covers_the_issue_panels() -> None:
    text = DASHBOARD.read_text()
    for metric in (
        "kvroute_requests_total",
        "kvroute_time_to_first_token_seconds_bucket",
        "kvroute_inter_token_latency_seconds_bucket",
        "kvroute_backend_inflight_requests",
        "kvroute_spillovers_total",
        "kvroute_routing_decision_seconds_bucket",
        "kvroute_kv_prediction_error_tokens_bucket",
        "kvroute_backend_up",
        "kvroute_backend_circuit_state",
        "kvroute_backend_index_mode",
        "kvroute_retries_total",
        "kvroute_upstream_errors_total",
    ):
        assert metric in text


# ---- Dockerfile ---------------------------------------------------------------------------


def _dockerfile_stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """Global ARG defaults, and each stage's (INSTRUCTION, arguments) list."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stages.append([])
        if not stages:
            if op == "ARG" and "=" in rest:
                key, _, value = rest.partition("=")
                args[key] = value.strip('"')
            continue
        stages[-1].append((op, rest.strip()))
    return args, stages


_BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|make|cmake|build-essential|python3?-dev|libc6?-dev|apt-get|apk|git)\b"
)


def test_dockerfile_final_stage() -> None:
    args, stages = _dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: a builder and a final stage"
    final = stages[-1]
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), final[0][1])
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    ops = dict(final)
    user = ops["USER"].split(":")[0]
    assert user not in ("root", "0")
    run_as = _router_deployment()["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert user == str(run_as)
    assert json.loads(ops["ENTRYPOINT"]) == ["kvroute", "serve"]
    assert json.loads(ops["CMD"]) == ["-c", "/etc/kvroute/router.yaml"]
    # the health check reads the file the router runs with (port, TLS), not a fixed URL
    interval, _, check = ops["HEALTHCHECK"].partition(" CMD ")
    assert "--interval=" in interval
    assert json.loads(check) == ["kvroute", "health", *json.loads(ops["CMD"])]
    assert "8000" in [p for op, rest in final if op == "EXPOSE" for p in rest.split()]
    assert any(op == "COPY" and rest.startswith("--from=") for op, rest in final)
    for op, rest in final:
        if op == "RUN":
            assert not _BUILD_TOOLS.search(rest), f"build tool in the final stage: {rest}"


def test_dockerfile_documents_probes_and_copies_only_included_files() -> None:
    text = DOCKERFILE.read_text()
    assert "/health" in text and "/ready" in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    _, stages = _dockerfile_stages()
    for op, rest in (i for stage in stages for i in stage):
        if op != "COPY" or rest.startswith("--from="):
            continue
        *sources, _dest = shlex.split(rest)
        for source in sources:
            assert (ROOT / source).exists(), source
            assert f"!{source}" in ignore or f"!{source}/" in ignore, f"{source} is ignored"


# ---- systemd unit -------------------------------------------------------------------------


def _unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit() -> None:
    unit = _unit()
    service = {k: v[-1] for k, v in unit["Service"].items()}
    assert shlex.split(service["ExecStart"])[1:] == ["serve", "-c", "/etc/kvroute/router.yaml"]
    assert Path(shlex.split(service["ExecStart"])[0]).name == "kvroute"
    assert re.fullmatch(r"\S*kill -HUP \$MAINPID", service["ExecReload"])
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert service["User"] not in ("root", "0")
    shutdown = ShutdownConfig()  # the bare-host config (examples/router.yaml) uses defaults
    assert float(service["TimeoutStopSec"]) > shutdown.unready_seconds + shutdown.drain_seconds
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }.items():
        assert service[key] == value
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # ProtectSystem=strict leaves writable only what systemd makes for the unit: the
    # default paths of what the router writes must be there
    state = Path("/var/lib") / service["StateDirectory"]
    for default in (JobsConfig().path, UsageConfig().path, CaptureConfig().path):
        assert Path(default).is_relative_to(state), default
    assert service["LogsDirectory"] == "kvroute"  # the README's access_log.path example


def test_rbac_grants_only_what_kubernetes_discovery_reads() -> None:
    """The Role allows get/list/watch on EndpointSlices and nothing else, and is bound to
    the router's ServiceAccount."""
    kinds = {d["kind"]: d for _, d in MANIFESTS}
    assert kinds["Role"]["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = kinds["RoleBinding"]
    assert binding["roleRef"]["name"] == kinds["Role"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": kinds["ServiceAccount"]["metadata"]["name"]}
    ]


# ---- Alert rules: against the metrics a real router exports, promtool, a live Prometheus --

RULES = DEPLOY / "prometheus" / "kvroute-rules.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "kvroute-rules.test.yaml"
#: labels Prometheus adds to every scraped series
_TARGET_LABELS = {"instance", "job"}


def _rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def test_the_rules_cover_what_operators_page_on() -> None:
    assert {r["alert"] for r in _rules()} == {
        "KvrouteNoUsableBackend",
        "KvrouteHigh5xxRatio",
        "KvrouteBreakerOpen",
        "KvrouteEventLoopLag",
        "KvrouteKvEventsStale",
    }
    for rule in _rules():
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule["alert"])
def test_rules_query_only_exported_metrics(rule: dict, exported: dict[str, set[str]]) -> None:
    selectors, grouping = _parse(rule["expr"])
    for name, labels in selectors.items():
        assert name in exported, f"{name} is not exported by the router"
        assert labels <= exported[name], f"{name} has no label {labels - exported[name]}"
    available = set().union(*(exported[n] for n in selectors)) | _TARGET_LABELS
    assert grouping <= available, f"grouping by {grouping - available}"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian's prometheus package has it)")
    return path


def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    promtool = _tool("promtool")
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr


async def _rule_states(http: aiohttp.ClientSession, url: str) -> dict[str, dict] | None:
    """Each rule's state once Prometheus has evaluated every one after a scrape."""
    async with http.get(url + "/api/v1/rules") as resp:
        groups = (await resp.json())["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    async with http.get(url + "/api/v1/query", params={"query": "up"}) as resp:
        scraped = (await resp.json())["data"]["result"]
    # a rule never evaluated shows Go's zero time
    done = scraped and not any(r["lastEvaluation"].startswith("0001-") for r in rules.values())
    return rules if done and len(rules) == len(_rules()) else None


async def test_a_live_prometheus_evaluates_every_rule_against_a_router(tmp_path) -> None:
    """Prometheus (on loopback) scrapes a router whose only backend is down and
    evaluates the rules: every one is healthy, and the no-usable-backend alert is
    pending while the others stay inactive."""
    prometheus = _tool("prometheus")
    async with running(1, health={"interval": 0.05, "timeout": 0.3}) as (router, stubs):
        stubs[0].behaviour.health_status = 503
        port = free_port()
        config = tmp_path / "prometheus.yml"
        target = router.url.removeprefix("http://")
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {"job_name": "kvroute", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        cmd = [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as http:
                rules = await _until_rules(http, url)
        finally:
            proc.terminate()
            proc.wait(10)
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    states = {name: rule["state"] for name, rule in rules.items()}
    assert states.pop("KvrouteNoUsableBackend") == "pending"
    assert set(states.values()) == {"inactive"}


async def _until_rules(http: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    """Bounded: Prometheus answers, scrapes once, evaluates every rule (about 3 s)."""
    async with asyncio.timeout(60):
        while True:
            with contextlib.suppress(aiohttp.ClientError, KeyError, TypeError):
                if (rules := await _rule_states(http, url)) is not None:
                    pending = rules["KvrouteNoUsableBackend"]["state"] == "pending"
                    if pending:
                        return rules
            await asyncio.sleep(0.2)
