"""Deployment artefacts parse and agree with the code (no Docker engine needed)."""

from __future__ import annotations

import copy
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import msgspec
import pytest
import yaml

from xpupool.autoscaler.pools import SimulatedProviderConfig, load_pools
from xpupool.autoscaler.settings import AutoscalerSettings
from xpupool.contracts import access
from xpupool.devstack import secure
from xpupool.devstack.servers import LEDGER_REDIS_TUNING
from xpupool.lease_manager.settings import LeaseManagerSettings
from xpupool.scheduler.domain import load_config
from xpupool.scheduler.settings import SchedulerSettings
from xpupool.telemetry_collector.settings import CollectorSettings

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
# Each service's module, the settings Struct its XPUPOOL_* environment must fit, its secured
# identity's role, and the port it serves metrics on in the deployments.
MODULES: dict[str, tuple[type[msgspec.Struct], str, int]] = {
    "xpupool.scheduler": (SchedulerSettings, access.SCHEDULER, 9401),
    "xpupool.lease_manager": (LeaseManagerSettings, access.LEASE_MANAGER, 9402),
    "xpupool.autoscaler": (AutoscalerSettings, access.AUTOSCALER, 9403),
    "xpupool.telemetry_collector": (CollectorSettings, access.TELEMETRY_COLLECTOR, 9400),
}
# The collector's metrics knob is unprefixed, the other services' carry the service's name.
METRICS_PORT_ENV = {
    "xpupool.scheduler": "XPUPOOL_SCHEDULER_METRICS_PORT",
    "xpupool.lease_manager": "XPUPOOL_LEASE_MANAGER_METRICS_PORT",
    "xpupool.autoscaler": "XPUPOOL_AUTOSCALER_METRICS_PORT",
}


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _module_of(command: list[str] | str) -> str | None:
    text = command if isinstance(command, str) else " ".join(command)
    return next((m for m in MODULES if f"python -m {m}" in text), None)


def _assert_env_fits(where: str, module: str, names: list[str]) -> None:
    """Every XPUPOOL_* name is a field of the module's settings, so a typo fails here."""
    fields = set(MODULES[module][0].__struct_fields__)
    for name in names:
        if name.startswith("XPUPOOL_"):
            field = name.removeprefix("XPUPOOL_").lower()
            assert field in fields, f"{where}: {name} is no field of {MODULES[module][0].__name__}"


def test_compose_runs_every_service_module_against_the_brokers() -> None:
    """docker-compose.yml parses, starts each service's module, and points them at NATS/Redis."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    commands = {" ".join(s.get("command", [])) for s in services.values()}
    for module in MODULES:
        assert any(f"python -m {module}" in c for c in commands), module
    assert services["scheduler"]["environment"]["XPUPOOL_NATS_URL"] == "tls://nats:4222"
    assert "--appendonly" in services["redis"]["command"]


def _generate_as_compose_does(compose: dict[str, Any], out: Path) -> None:
    """Run the secrets service's generate command, writing to ``out`` instead of /secrets."""
    script = compose["services"]["secrets"]["command"][-1]
    words = shlex.split(script.split("&&")[0].replace("${XPUPOOL_TENANTS:-", "").replace("}", ""))
    assert words[:3] == ["python", "-m", "xpupool.devstack.secure"], words
    args = words[3:]
    args[args.index("--out") + 1] = str(out)
    assert secure.main(args) == 0


def test_compose_runs_the_secured_configuration(tmp_path: Path) -> None:
    """The generated material has every file compose points at; NATS and Redis run TLS-only
    with the generated config and ACL, and each service sources its own role's identity."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    _generate_as_compose_does(compose, tmp_path)
    referenced = set(re.findall(r"/secrets/[\w./-]+", yaml.safe_dump(compose)))
    assert referenced, "compose names no generated file"
    for path in referenced:
        assert (tmp_path / path.removeprefix("/secrets/")).exists(), path
    assert services["nats"]["command"] == ["-c", "/secrets/nats.conf"]
    conf = (tmp_path / "nats.conf").read_text()
    assert '"0.0.0.0:4222"' in conf and "tls {" in conf and "authorization {" in conf
    assert '"/data"' in conf and "nats-data:/data" in services["nats"]["volumes"]
    redis = services["redis"]["command"]
    for flag, value in (
        ("--port", "0"),
        ("--tls-port", "6379"),
        ("--tls-auth-clients", "no"),
        *LEDGER_REDIS_TUNING,
    ):
        assert redis[redis.index(flag) + 1] == value, flag
    assert redis[redis.index("--aclfile") + 1] == "/secrets/users.acl"
    for name, service in services.items():
        command = " ".join(service.get("command", []))
        module = _module_of(command)
        if module is None:
            continue
        role = MODULES[module][1]
        assert f". /secrets/identities/service/{role}/env" in command, name
        env = dict(
            line.split("=", 1)
            for line in (tmp_path / f"identities/service/{role}/env").read_text().splitlines()
        )
        _assert_env_fits(f"identities/service/{role}/env", module, list(env))
        assert env["XPUPOOL_NATS_URL"] == service["environment"]["XPUPOOL_NATS_URL"], name
        assert env["XPUPOOL_REDIS_URL"].startswith(f"rediss://{role}:"), name
        assert env["XPUPOOL_REDIS_URL"].endswith("@redis:6379/0"), name
        assert "secrets:/secrets:ro" in service["volumes"], name


def test_example_queue_config_is_valid() -> None:
    """The queue file shipped in deploy/ loads with the scheduler's own validator."""
    config = load_config(ROOT / "deploy" / "queues.example.yaml")
    assert config.resolve_queue("alice", None) == "vision"
    assert config.priority_value("critical") == 1000


def test_the_image_build_context_leaves_out_local_state() -> None:
    """deploy/Dockerfile copies the whole repository root: .dockerignore keeps the local
    virtualenv, git history, caches and any generated identities out of the image."""
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "**/__pycache__", "secrets/", "**/identities/"} <= ignored
    assert "COPY . ." in (ROOT / "deploy" / "Dockerfile").read_text()


# --- compose: specification, services, metrics, Grafana -------------------------------------


def _compose_schema() -> jsonschema.Draft7Validator:
    """The vendored Compose Specification schema (deploy/schema/README.md: source, commit)."""
    schema = json.loads((ROOT / "deploy" / "schema" / "compose-spec.json").read_text())
    assert "draft-07" in schema["$schema"]
    return jsonschema.Draft7Validator(schema)


def test_compose_validates_against_the_compose_specification() -> None:
    """docker-compose.yml is valid Compose; a misspelt key in it would not be."""
    validator = _compose_schema()
    compose = _compose()
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    broken = copy.deepcopy(compose)
    broken["services"]["scheduler"]["enviroment"] = broken["services"]["scheduler"].pop(
        "environment"
    )
    assert not validator.is_valid(broken)


def _compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "environment as a mapping, so anchors merge"
    return {str(k): str(v) for k, v in env.items()}


def _xpupool_services() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for name, service in _compose()["services"].items():
        module = _module_of(service.get("command", []))
        if module is not None:
            yield name, module, service


def test_compose_env_names_are_settings_fields() -> None:
    """Every XPUPOOL_* variable compose sets is a field of that service's settings Struct, and
    every service module runs, the autoscaler with a pool file that loads."""
    seen = set()
    for name, module, service in _xpupool_services():
        seen.add(module)
        _assert_env_fits(f"docker-compose.yml {name}", module, list(_compose_env(service)))
    assert seen == set(MODULES)
    autoscaler = _compose()["services"]["autoscaler"]
    target = _compose_env(autoscaler)["XPUPOOL_POOLS_FILE"]
    source = next(v.split(":")[0] for v in autoscaler["volumes"] if v.endswith(f":{target}:ro"))
    pools = load_pools(ROOT / source)
    assert pools.pools and all(isinstance(p.provider, SimulatedProviderConfig) for p in pools.pools)
    assert "XPUPOOL_AUTOSCALER_COLLECTOR_ENV" in " ".join(autoscaler["command"])


def test_prometheus_scrapes_every_service_where_it_serves_metrics() -> None:
    """Each xpupool service serves metrics on 0.0.0.0 at its port, that port is not published,
    and a Prometheus job finds every replica of it there; NATS through its exporter only."""
    compose = _compose()
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets: dict[str, int] = {}
    static: set[str] = set()
    for job in prometheus["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                targets[host] = sd["port"]
        for config in job.get("static_configs", []):
            static.update(config["targets"])
    for name, module, service in _xpupool_services():
        env = _compose_env(service)
        port_env = METRICS_PORT_ENV.get(module, "XPUPOOL_METRICS_PORT")
        addr_env = port_env.replace("_PORT", "_ADDR")
        assert int(env[port_env]) == MODULES[module][2], name
        assert env[addr_env] == "0.0.0.0", name
        assert targets.get(name) == MODULES[module][2], f"Prometheus does not scrape {name}"
        published = " ".join(str(p) for p in service.get("ports", []))
        assert str(MODULES[module][2]) not in published, f"{name} publishes its metrics port"
    exporter = compose["services"]["nats-exporter"]
    assert exporter["network_mode"] == "service:nats"
    assert "-connz" not in exporter["command"]
    assert exporter["command"][-1] == "http://127.0.0.1:8222"
    port = exporter["command"][exporter["command"].index("-port") + 1]
    assert f"nats:{port}" in static
    assert "--monitor 127.0.0.1:8222" in compose["services"]["secrets"]["command"][-1]
    assert "8222" not in " ".join(str(p) for p in compose["services"]["nats"].get("ports", []))


def test_traces_go_from_the_services_through_the_collector_to_jaeger() -> None:
    """The services' OTLP/HTTP endpoint is the collector's HTTP receiver, which exports to
    Jaeger's OTLP port."""
    compose = _compose()
    otel = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    http = otel["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    for name, _, service in _xpupool_services():
        endpoint = _compose_env(service)["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert endpoint.endswith(f"-http://otel-collector:{http}}}"), name
    exporters = otel["service"]["pipelines"]["traces"]["exporters"]
    assert [otel["exporters"][e]["endpoint"] for e in exporters] == ["jaeger:4317"]
    assert "otel-collector" in compose["services"] and "jaeger" in compose["services"]


def _datasource_uids(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        source = node.get("datasource")
        if isinstance(source, dict) and isinstance(source.get("uid"), str):
            yield source["uid"]
        elif isinstance(source, str):
            yield source
        for value in node.values():
            yield from _datasource_uids(value)
    elif isinstance(node, list):
        for value in node:
            yield from _datasource_uids(value)


def test_grafana_provisions_the_data_sources_and_dashboards_folder() -> None:
    """Prometheus and Jaeger are provisioned with the uids the dashboards use, and the file
    provider reads the folder compose mounts deploy/grafana/dashboards at."""
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    sources = yaml.safe_load((provisioning / "datasources" / "datasources.yaml").read_text())
    uids = {s["uid"]: s for s in sources["datasources"]}
    assert uids["prometheus"]["type"] == "prometheus"
    assert uids["prometheus"]["url"] == "http://prometheus:9090"
    assert uids["jaeger"]["type"] == "jaeger"
    assert uids["jaeger"]["url"] == "http://jaeger:16686"
    providers = yaml.safe_load((provisioning / "dashboards" / "dashboards.yaml").read_text())
    [provider] = providers["providers"]
    grafana = _compose()["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    # The dashboards are written separately; whichever exist must use provisioned sources.
    for path in sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for uid in _datasource_uids(dashboard):
            if uid.startswith("$") or uid.startswith("-- "):
                continue  # a template variable or Grafana's built-in sources
            assert uid in uids, f"{path.name} uses data source {uid!r}"


# --- Kubernetes ------------------------------------------------------------------------------

KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes release still maintained upstream


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    return [
        (resource, document)
        for resource in kustomization["resources"]
        for document in yaml.safe_load_all((KUBERNETES / resource).read_text())
        if document is not None
    ]


def test_kustomization_lists_every_manifest() -> None:
    """Every YAML file in deploy/kubernetes is in the kustomization, except the PodMonitor
    example (it needs the Prometheus Operator's CRDs)."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    files = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files - {"podmonitor.example.yaml"})
    assert "namespace" not in kustomization, "would move the Role out of the pools' namespace"


@pytest.mark.parametrize(
    "document",
    [pytest.param(d, id=f"{f}:{d['kind']}:{d['metadata']['name']}") for f, d in _manifests()],
)
def test_manifest_validates_against_the_kubernetes_schema(document: dict[str, Any]) -> None:
    """Offline, strict: an unknown or misplaced field fails (kubernetes-validate's schemas)."""
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for _, document in _manifests():
        if document["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            yield document["metadata"]["name"], document["spec"]["template"]


def test_kubernetes_workloads() -> None:
    """The workload kinds and replicas, every service module, pinned images, non-root
    read-only containers with resources and probes, and identities from the role's secret."""
    kinds = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    assert kinds[("StatefulSet", "nats")]["spec"]["volumeClaimTemplates"]
    redis = kinds[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--appendonly" in redis
    for flag, value in LEDGER_REDIS_TUNING:
        assert redis[redis.index(flag) + 1] == value, flag
    assert kinds[("Deployment", "scheduler")]["spec"]["replicas"] == 2
    assert kinds[("Deployment", "lease-manager")]["spec"]["replicas"] == 2
    assert ("Deployment", "autoscaler") in kinds and ("DaemonSet", "telemetry-collector") in kinds
    assert ("Namespace", "xpupool") in kinds
    modules = set()
    for name, template in _pod_specs():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        for container in spec["containers"]:
            where = f"{name}/{container['name']}"
            image = container["image"]
            assert ":" in image and not image.endswith(":latest"), where
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert {"requests", "limits"} <= set(container["resources"]), where
            assert "livenessProbe" in container, where
            module = _module_of(container.get("command", []))
            if module is None:
                continue
            modules.add(module)
            settings, role, port = MODULES[module]
            assert image == "xpupool:dev", where
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            _assert_env_fits(f"deploy/kubernetes {where}", module, list(env))
            port_env = METRICS_PORT_ENV.get(module, "XPUPOOL_METRICS_PORT")
            assert env[port_env] == str(port), where
            assert env[port_env.replace("_PORT", "_ADDR")] == "0.0.0.0", where
            assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port), where
            assert "readinessProbe" in container, where
            assert f". /secrets/identities/service/{role}/env" in container["command"][-1], where
            [identity] = [v for v in spec["volumes"] if v["name"] == "identity"]
            secrets = {s["secret"]["name"] for s in identity["projected"]["sources"]}
            assert secrets == {"xpupool-ca", f"xpupool-{role}"}, where
    assert modules == set(MODULES)


def test_kubernetes_config_maps_load_with_the_services_validators(tmp_path: Path) -> None:
    """The queue and pool files in the ConfigMaps pass the scheduler's and autoscaler's own
    validators, and the secret names the README tells operators to create are the ones used."""
    maps = {d["metadata"]["name"]: d["data"] for _, d in _manifests() if d["kind"] == "ConfigMap"}
    (tmp_path / "queues.yaml").write_text(maps["xpupool-queues"]["queues.yaml"])
    load_config(tmp_path / "queues.yaml")
    (tmp_path / "pools.yaml").write_text(maps["xpupool-pools"]["pools.yaml"])
    assert load_pools(tmp_path / "pools.yaml").pools
    readme = (KUBERNETES / "README.md").read_text()
    secret_names: set[str] = set()
    for _, template in _pod_specs():
        for volume in template["spec"]["volumes"]:
            if "secret" in volume:
                secret_names.add(volume["secret"]["secretName"])
            for source in volume.get("projected", {}).get("sources", []):
                secret_names.add(source["secret"]["name"])
    assert {"xpupool-servers", "xpupool-ca"} <= secret_names
    for secret in secret_names:
        generic = f"create secret generic {secret} " in readme
        role = secret.removeprefix("xpupool-")
        per_role = role in access.SERVICE_ROLES and '"xpupool-$role"' in readme
        assert generic or per_role, f"README.md does not say how to create {secret}"
    assert re.search(r"for role in scheduler lease-manager autoscaler telemetry-collector;", readme)
