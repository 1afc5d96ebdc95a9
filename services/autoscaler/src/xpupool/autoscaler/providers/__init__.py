"""Providers add and remove a pool's nodes: one Protocol, three implementations.

- ``exec`` (:mod:`.exec`): the operator's command, JSON on stdin, JSON answer on stdout;
- ``kubernetes`` (:mod:`.kubernetes`): a Cluster API MachineDeployment's ``spec.replicas``;
- ``simulated`` (:mod:`.simulated`): telemetry-collector processes with the simulated backend.

Every call carries a ``request_id`` (the scale decision's id) and is **idempotent by it**: a
request already carried out is answered from the provider's own record (the exec command's
state, an annotation on the MachineDeployment, the simulated provider's state directory), never
applied twice, so a replica that takes over from a killed one replays its in-flight requests
without doubling them. A failure raises :class:`ProviderError`; retry with the same id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from xpupool.autoscaler.pools import (
    ExecProviderConfig,
    KubernetesProviderConfig,
    PoolConfig,
    ProviderConfig,
    SimulatedProviderConfig,
)

if TYPE_CHECKING:
    from xpupool.autoscaler.providers.simulated import NodeProcessLauncher

__all__ = [
    "NodeLifecycle",
    "ProvidedNode",
    "Provider",
    "ProviderError",
    "ProviderResult",
    "make_provider",
]


class ProviderError(RuntimeError):
    """A provider could not carry out a request (the message says what and why)."""


class NodeLifecycle(StrEnum):
    """A node's state as its provider reports it."""

    PROVISIONING = "provisioning"
    READY = "ready"
    REMOVING = "removing"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ProvidedNode:
    """One node a provider holds for a pool. ``node_id`` is the id its collector registers
    with (``XPUPOOL_NODE_ID``); ``request_id`` the request that added it, where known."""

    node_id: str
    state: NodeLifecycle
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class ProviderResult:
    """What an ``add``/``remove`` did: the nodes concerned (empty where the provider cannot name
    them yet), the pool's size the provider now aims at (where it knows), and whether the
    request had already been carried out (a replay: nothing was changed)."""

    request_id: str
    pool: str
    nodes: tuple[ProvidedNode, ...] = ()
    target_size: int | None = None
    already_applied: bool = False
    detail: str = ""
    extra: dict[str, object] = field(default_factory=dict)


class Provider(Protocol):
    """Adds and removes the nodes of pools; idempotent by ``request_id``."""

    kind: str

    async def add(self, pool: PoolConfig, count: int, request_id: str) -> ProviderResult:
        """Provision ``count`` more nodes of ``pool``'s shape."""
        ...

    async def remove(
        self, pool: PoolConfig, node_ids: Sequence[str], request_id: str
    ) -> ProviderResult:
        """Give back these (drained) nodes; ids the provider no longer holds are ignored."""
        ...

    async def list(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        """Every node the provider holds for ``pool``, provisioning ones included."""
        ...


def make_provider(
    config: ProviderConfig, *, launcher: NodeProcessLauncher | None = None
) -> Provider:
    """The provider for one pool's ``provider`` configuration. ``launcher`` starts the
    simulated provider's collector processes (default: subprocesses of this process)."""
    if isinstance(config, ExecProviderConfig):
        from xpupool.autoscaler.providers.exec import ExecProvider

        return ExecProvider(config)
    if isinstance(config, KubernetesProviderConfig):
        from xpupool.autoscaler.providers.kubernetes import KubernetesProvider

        return KubernetesProvider(config)
    if isinstance(config, SimulatedProviderConfig):
        from xpupool.autoscaler.providers.simulated import SimulatedProvider

        return SimulatedProvider(config, launcher=launcher)
    raise TypeError(f"unknown provider configuration {type(config).__name__}")
