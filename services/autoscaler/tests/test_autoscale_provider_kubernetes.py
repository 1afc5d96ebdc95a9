"""The kubernetes provider against a fake API server at the HTTP boundary.

The fake records every request (method, path, headers, body) and answers like the API server
for one Cluster API MachineDeployment and its Machines: merge patches applied, resourceVersion
checked (409 on a stale one)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from autoscale_builders import make_pool

from xpupool.autoscaler.pools import KubernetesProviderConfig, PoolConfig
from xpupool.autoscaler.providers import NodeLifecycle, ProviderError, make_provider
from xpupool.autoscaler.providers.kubernetes import (
    DELETE_MACHINE_ANNOTATION,
    REQUESTS_ANNOTATION,
    KubernetesProvider,
)

BASE = "/apis/cluster.x-k8s.io/v1beta1/namespaces/gpu"
MD_PATH = f"{BASE}/machinedeployments/a100-md"
TOKEN = "s3cr3t-token"


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


def merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = value


@dataclass
class FakeApi:
    deployment: dict[str, Any]
    machines: list[dict[str, Any]]
    requests: list[Recorded] = field(default_factory=list)
    conflicts: int = 0  # answer this many MachineDeployment patches 409 first
    url: str = ""

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        split = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body: Any = json.loads(raw) if raw else {}
        self.requests.append(
            Recorded(
                h.command,
                split.path,
                parse_qs(split.query),
                {k.lower(): v for k, v in h.headers.items()},
                body,
            )
        )
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.reply(h, 401, {"kind": "Status", "reason": "Unauthorized"})
        if split.path == MD_PATH and h.command == "GET":
            return self.reply(h, 200, self.deployment)
        if split.path == MD_PATH and h.command == "PATCH":
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if self.conflicts or wanted not in (
                None,
                self.deployment["metadata"]["resourceVersion"],
            ):
                self.conflicts = max(0, self.conflicts - 1)
                self.deployment["metadata"]["resourceVersion"] = str(
                    int(self.deployment["metadata"]["resourceVersion"]) + 1
                )
                return self.reply(h, 409, {"kind": "Status", "reason": "Conflict"})
            patch = json.loads(json.dumps(body))
            patch.get("metadata", {}).pop("resourceVersion", None)
            merge(self.deployment, patch)
            meta = self.deployment["metadata"]
            meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
            return self.reply(h, 200, self.deployment)
        if split.path == f"{BASE}/machines" and h.command == "GET":
            return self.reply(h, 200, {"kind": "MachineList", "items": self.machines})
        if split.path.startswith(f"{BASE}/machines/") and h.command == "PATCH":
            name = split.path.rsplit("/", 1)[1]
            for machine in self.machines:
                if machine["metadata"]["name"] == name:
                    merge(machine, body)
                    return self.reply(h, 200, machine)
        return self.reply(h, 404, {"kind": "Status", "reason": "NotFound"})

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def of(self, method: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method]


def machine(name: str, node: str | None, phase: str) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if node:
        status["nodeRef"] = {"kind": "Node", "name": node}
    return {
        "apiVersion": "cluster.x-k8s.io/v1beta1",
        "kind": "Machine",
        "metadata": {
            "name": name,
            "namespace": "gpu",
            "labels": {"cluster.x-k8s.io/deployment-name": "a100-md"},
        },
        "status": status,
    }


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi(
        deployment={
            "apiVersion": "cluster.x-k8s.io/v1beta1",
            "kind": "MachineDeployment",
            "metadata": {"name": "a100-md", "namespace": "gpu", "resourceVersion": "100"},
            "spec": {"replicas": 2, "clusterName": "c1"},
        },
        machines=[
            machine("a100-md-x1", "gpu-node-1", "Running"),
            machine("a100-md-x2", None, "Provisioning"),
        ],
    )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fake.handle(self)

        def do_PATCH(self) -> None:
            fake.handle(self)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


def k8s_pool(api: FakeApi, **options: Any) -> tuple[PoolConfig, KubernetesProvider]:
    provider = {
        "type": "kubernetes",
        "namespace": "gpu",
        "machine_deployment": "a100-md",
        "host": api.url,
        "token": TOKEN,
        **options,
    }
    pool = make_pool("a100", max_size=6, provider=provider)
    assert isinstance(pool.provider, KubernetesProviderConfig)
    made = make_provider(pool.provider)
    assert isinstance(made, KubernetesProvider)
    return pool, made


async def test_add_sends_the_documented_merge_patch(api: FakeApi) -> None:
    pool, provider = k8s_pool(api)
    result = await provider.add(pool, 3, "7:0:a100:scale_up")
    assert result.target_size == 5 and not result.already_applied
    get, patch = api.requests
    assert (get.method, get.path) == ("GET", MD_PATH)
    assert (patch.method, patch.path) == ("PATCH", MD_PATH)
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.headers["authorization"] == f"Bearer {TOKEN}"
    assert patch.body == {
        "metadata": {
            "resourceVersion": "100",
            "annotations": {REQUESTS_ANNOTATION: json.dumps({"7:0:a100:scale_up": 5})},
        },
        "spec": {"replicas": 5},
    }
    assert api.deployment["spec"] == {"replicas": 5, "clusterName": "c1"}


async def test_a_replayed_request_is_not_applied_twice(api: FakeApi) -> None:
    pool, provider = k8s_pool(api)
    await provider.add(pool, 1, "r1")
    _, other_replica = k8s_pool(api)  # a replica that took over replays r1
    replay = await other_replica.add(pool, 1, "r1")
    assert replay.already_applied and replay.target_size == 3
    assert api.deployment["spec"]["replicas"] == 3
    assert len(api.of("PATCH")) == 1


async def test_a_conflict_reads_again_and_patches_the_new_version(api: FakeApi) -> None:
    api.conflicts = 1
    pool, provider = k8s_pool(api)
    result = await provider.add(pool, 1, "r1")
    assert result.target_size == 3
    patches = api.of("PATCH")
    assert [p.body["metadata"]["resourceVersion"] for p in patches] == ["100", "101"]
    assert len(api.of("GET")) == 2


async def test_remove_marks_the_nodes_machines_then_lowers_replicas(api: FakeApi) -> None:
    pool, provider = k8s_pool(api)
    result = await provider.remove(pool, ["gpu-node-1", "gone-node"], "r9")
    assert [n.node_id for n in result.nodes] == ["gpu-node-1"] and result.target_size == 1
    listing = next(r for r in api.requests if r.path == f"{BASE}/machines")
    assert listing.query == {"labelSelector": ["cluster.x-k8s.io/deployment-name=a100-md"]}
    mark, scale = api.of("PATCH")
    assert mark.path == f"{BASE}/machines/a100-md-x1"
    assert mark.headers["content-type"] == "application/merge-patch+json"
    assert mark.body == {"metadata": {"annotations": {DELETE_MACHINE_ANNOTATION: "yes"}}}
    assert scale.path == MD_PATH and scale.body["spec"] == {"replicas": 1}
    assert (await provider.remove(pool, ["gpu-node-1"], "r9")).already_applied


async def test_list_maps_machine_phases(api: FakeApi) -> None:
    pool, provider = k8s_pool(api)
    nodes = await provider.list(pool)
    assert [(n.node_id, n.state) for n in nodes] == [
        ("gpu-node-1", NodeLifecycle.READY),
        ("a100-md-x2", NodeLifecycle.PROVISIONING),
    ]


async def test_max_size_and_api_errors_are_clear(api: FakeApi, tmp_path: Path) -> None:
    pool, provider = k8s_pool(api)
    with pytest.raises(ProviderError, match="2 replicas \\+ 5 exceed max_size 6"):
        await provider.add(pool, 5, "r1")
    wrong = tmp_path / "token"
    wrong.write_text("wrong\n")
    pool, provider = k8s_pool(api, token="", token_file=str(wrong))
    with pytest.raises(
        ProviderError, match="kubernetes read on MachineDeployment gpu/a100-md: 401"
    ):
        await provider.add(pool, 1, "r2")
    assert api.requests[-1].headers["authorization"] == "Bearer wrong"


async def test_a_kubeconfig_configures_the_client(api: FakeApi, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                "users": [{"name": "u", "user": {"token": TOKEN}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "ctx",
            }
        )
    )
    pool, provider = k8s_pool(api, host="", token="", kubeconfig=str(kubeconfig), context="ctx")
    assert (await provider.add(pool, 1, "r1")).target_size == 3
    assert api.requests[-1].headers["authorization"] == f"Bearer {TOKEN}"
