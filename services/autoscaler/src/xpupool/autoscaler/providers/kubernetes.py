"""The ``kubernetes`` provider: a pool is a Cluster API MachineDeployment; its size is
``spec.replicas``.

Requests (group ``cluster.x-k8s.io``, version ``v1beta1``, namespaced), with the official
``kubernetes`` client:

- read: ``GET /apis/cluster.x-k8s.io/v1beta1/namespaces/{ns}/machinedeployments/{name}``;
- ``add``: ``PATCH`` of the same path, ``Content-Type: application/merge-patch+json``, body::

      {"metadata": {"resourceVersion": "<as read>",
                    "annotations": {"xpupool.dev/scale-requests": "{\\"<request id>\\": 3, ...}"}},
       "spec": {"replicas": 3}}

  The ``resourceVersion`` makes the patch conditional (a concurrent change answers 409 and
  the provider reads again, up to 5 times). The annotation records the last 32 request ids with
  the replicas each set: a request id found there is answered ``already_applied`` without a
  patch, so a replay never scales twice;
- ``remove``: ``GET .../machines?labelSelector=cluster.x-k8s.io/deployment-name={name}``, a
  merge-patch ``{"metadata": {"annotations": {"cluster.x-k8s.io/delete-machine": "yes"}}}`` on
  the Machine of each node (``status.nodeRef.name``, or the Machine's name), so the MachineSet
  deletes exactly those first, then the MachineDeployment patch above with replicas lowered by
  the number of Machines found (ids no longer there are ignored);
- ``list``: the Machines above; ``Running`` is ready, ``Deleting``/``Deleted`` or marked for
  deletion is removing, ``Failed`` is failed, any other phase provisioning. A node's id is its
  ``status.nodeRef.name`` (what its collector registers with), else the Machine's name.

An unset ``spec.replicas`` reads as 1 (Cluster API's default). Client configuration: ``host``
with ``token`` or ``token_file`` (and ``ca_file``, ``verify_ssl``) when given; else
``kubeconfig``/``context``; else the in-cluster service account when ``KUBERNETES_SERVICE_HOST``
is set; else the default kubeconfig. The client is synchronous; calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from xpupool.autoscaler.pools import KubernetesProviderConfig, PoolConfig
from xpupool.autoscaler.providers import (
    NodeLifecycle,
    ProvidedNode,
    ProviderError,
    ProviderResult,
)

__all__ = [
    "DELETE_MACHINE_ANNOTATION",
    "DEPLOYMENT_LABEL",
    "GROUP",
    "REQUESTS_ANNOTATION",
    "VERSION",
    "KubernetesProvider",
    "client_configuration",
]

GROUP: Final = "cluster.x-k8s.io"
VERSION: Final = "v1beta1"
DEPLOYMENTS: Final = "machinedeployments"
MACHINES: Final = "machines"
MERGE_PATCH: Final = "application/merge-patch+json"
REQUESTS_ANNOTATION: Final = "xpupool.dev/scale-requests"
DELETE_MACHINE_ANNOTATION: Final = "cluster.x-k8s.io/delete-machine"
DEPLOYMENT_LABEL: Final = "cluster.x-k8s.io/deployment-name"
KEEP_REQUESTS: Final = 32
CONFLICT_RETRIES: Final = 5


def client_configuration(config: KubernetesProviderConfig) -> k8s.Configuration:
    """The client configuration the provider's options describe (see the module docstring)."""
    cfg = k8s.Configuration()
    if config.host:
        cfg.host = config.host.rstrip("/")
        token = config.token
        if config.token_file:
            try:
                token = Path(config.token_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ProviderError(
                    f"kubernetes provider: cannot read token_file {config.token_file}: "
                    f"{exc.strerror or exc}"
                ) from exc
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        cfg.verify_ssl = config.verify_ssl
        if config.ca_file:
            cfg.ssl_ca_cert = config.ca_file
        return cfg
    try:
        if (
            not config.kubeconfig
            and not config.context
            and os.environ.get("KUBERNETES_SERVICE_HOST")
        ):
            k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=config.kubeconfig or None,
                context=config.context or None,
                client_configuration=cfg,
            )
    except (k8s_config.ConfigException, OSError) as exc:
        raise ProviderError(f"kubernetes provider: no client configuration: {exc}") from exc
    return cfg


class KubernetesProvider:
    """Scales one MachineDeployment per pool (see the module docstring)."""

    kind = "kubernetes"

    def __init__(self, config: KubernetesProviderConfig) -> None:
        self.config = config
        self._api: k8s.CustomObjectsApi | None = None

    def _objects(self) -> k8s.CustomObjectsApi:
        if self._api is None:
            self._api = k8s.CustomObjectsApi(k8s.ApiClient(client_configuration(self.config)))
        return self._api

    async def add(self, pool: PoolConfig, count: int, request_id: str) -> ProviderResult:
        if count < 1:
            raise ProviderError(f"pool {pool.name}: add needs a count of at least 1, got {count}")
        return await asyncio.to_thread(self._scale, pool, request_id, count, ())

    async def remove(
        self, pool: PoolConfig, node_ids: Sequence[str], request_id: str
    ) -> ProviderResult:
        return await asyncio.to_thread(self._scale, pool, request_id, 0, tuple(node_ids))

    async def list(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        machines = await asyncio.to_thread(self._guarded, pool, "list", self._machines)
        return tuple(_provided(m) for m in machines)

    # -- synchronous parts (worker thread) ----------------------------------------------------

    def _guarded(self, pool: PoolConfig, what: str, call: Any, *args: Any) -> Any:
        target = f"{self.config.namespace}/{self.config.machine_deployment}"
        try:
            return call(*args)
        except ApiException as exc:
            body = (exc.body or "")[:300] if isinstance(exc.body, str) else ""
            raise ProviderError(
                f"pool {pool.name}: kubernetes {what} on MachineDeployment {target}: "
                f"{exc.status} {exc.reason}" + (f": {body}" if body else "")
            ) from exc
        except (HTTPError, OSError) as exc:
            raise ProviderError(
                f"pool {pool.name}: kubernetes {what} on MachineDeployment {target}: {exc}"
            ) from exc

    def _deployment(self) -> dict[str, Any]:
        result = self._objects().get_namespaced_custom_object(
            GROUP,
            VERSION,
            self.config.namespace,
            DEPLOYMENTS,
            self.config.machine_deployment,
            _request_timeout=self.config.timeout_s,
        )
        return _as_dict(result)

    def _machines(self) -> builtins.list[dict[str, Any]]:
        result = self._objects().list_namespaced_custom_object(
            GROUP,
            VERSION,
            self.config.namespace,
            MACHINES,
            label_selector=f"{DEPLOYMENT_LABEL}={self.config.machine_deployment}",
            _request_timeout=self.config.timeout_s,
        )
        return builtins.list(_as_dict(result).get("items") or [])

    def _patch(self, plural: str, name: str, body: dict[str, Any]) -> None:
        self._objects().patch_namespaced_custom_object(
            GROUP,
            VERSION,
            self.config.namespace,
            plural,
            name,
            body,
            _content_type=MERGE_PATCH,
            _request_timeout=self.config.timeout_s,
        )

    def _scale(
        self, pool: PoolConfig, request_id: str, add: int, remove: tuple[str, ...]
    ) -> ProviderResult:
        what = "add" if add else "remove"
        for _ in range(CONFLICT_RETRIES):
            deployment = self._guarded(pool, "read", self._deployment)
            metadata = deployment.get("metadata") or {}
            applied = _applied(metadata)
            replicas = int((deployment.get("spec") or {}).get("replicas", 1))
            if request_id in applied:
                return ProviderResult(
                    request_id=request_id,
                    pool=pool.name,
                    target_size=applied[request_id],
                    already_applied=True,
                )
            nodes: tuple[ProvidedNode, ...] = ()
            if add:
                target = replicas + add
                if target > pool.max_size:
                    raise ProviderError(
                        f"pool {pool.name}: {replicas} replicas + {add} exceed max_size "
                        f"{pool.max_size}"
                    )
            else:
                machines = self._guarded(pool, "list", self._machines)
                chosen = [m for m in machines if _node_id(m) in set(remove)]
                for machine in chosen:
                    name = str(machine["metadata"]["name"])
                    annotations = {DELETE_MACHINE_ANNOTATION: "yes"}
                    self._guarded(
                        pool,
                        "mark machine",
                        self._patch,
                        MACHINES,
                        name,
                        {"metadata": {"annotations": annotations}},
                    )
                nodes = tuple(
                    ProvidedNode(_node_id(m), NodeLifecycle.REMOVING, request_id) for m in chosen
                )
                target = max(0, replicas - len(chosen))
            applied[request_id] = target
            kept = dict(list(applied.items())[-KEEP_REQUESTS:])
            body = {
                "metadata": {
                    "resourceVersion": metadata.get("resourceVersion"),
                    "annotations": {REQUESTS_ANNOTATION: json.dumps(kept)},
                },
                "spec": {"replicas": target},
            }
            try:
                self._patch(DEPLOYMENTS, self.config.machine_deployment, body)
            except ApiException as exc:
                if exc.status == 409:
                    continue  # changed since we read it: read again
                self._guarded(pool, what, _reraise, exc)
            except (HTTPError, OSError) as exc:
                self._guarded(pool, what, _reraise, exc)
            return ProviderResult(
                request_id=request_id, pool=pool.name, nodes=nodes, target_size=target
            )
        raise ProviderError(
            f"pool {pool.name}: kubernetes {what}: MachineDeployment "
            f"{self.config.namespace}/{self.config.machine_deployment} kept changing "
            f"({CONFLICT_RETRIES} conflicts)"
        )


def _as_dict(result: object) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise ProviderError(f"kubernetes API answered {type(result).__name__}, not an object")
    return result


def _reraise(exc: BaseException) -> None:
    raise exc


def _applied(metadata: dict[str, Any]) -> dict[str, int]:
    raw = (metadata.get("annotations") or {}).get(REQUESTS_ANNOTATION)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int)}


def _node_id(machine: dict[str, Any]) -> str:
    node_ref = (machine.get("status") or {}).get("nodeRef") or {}
    return str(node_ref.get("name") or machine["metadata"]["name"])


def _provided(machine: dict[str, Any]) -> ProvidedNode:
    phase = str((machine.get("status") or {}).get("phase") or "")
    annotations = (machine.get("metadata") or {}).get("annotations") or {}
    if phase in ("Deleting", "Deleted") or annotations.get(DELETE_MACHINE_ANNOTATION):
        state = NodeLifecycle.REMOVING
    elif phase == "Running":
        state = NodeLifecycle.READY
    elif phase == "Failed":
        state = NodeLifecycle.FAILED
    else:
        state = NodeLifecycle.PROVISIONING
    return ProvidedNode(node_id=_node_id(machine), state=state)
