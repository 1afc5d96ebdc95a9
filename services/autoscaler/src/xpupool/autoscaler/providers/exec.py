"""The ``exec`` provider: any cloud or on-prem tool, through one command and two JSON documents.

For every call the autoscaler runs the pool's ``command`` (argv, no shell) with the pool's
``env`` added to its environment, writes one JSON object to its stdin and closes it, and reads
one JSON object from its stdout. The command must finish within ``timeout_s`` (its whole
process group is killed then), exit 0, and answer valid JSON; anything else is a
:class:`~xpupool.autoscaler.providers.ProviderError` saying which (the exit status and the end
of stderr, the JSON error and where). Stderr is for the operator's logs.

Request (stdin)::

    {
      "version": 1,
      "action": "add",                      # "add" | "remove" | "list"
      "request_id": "7:0:a100:scale_up",    # the idempotency key ("" for list)
      "pool": {
        "name": "a100", "model": "A100-SXM4-80GB", "vendor": "nvidia",
        "devices_per_node": 8, "cpu_milli": 96000, "memory_mib": 1048576,
        "interconnect": "nvswitch", "labels": {}, "cost_per_hour": 14.4,
        "min_size": 0, "max_size": 4
      },
      "count": 2,                           # add: nodes to provision (0 otherwise)
      "node_ids": [],                       # remove: the nodes to give back
      "options": {}                         # the pool file's provider.options, verbatim
    }

Answer (stdout)::

    {
      "ok": true,
      "nodes": [{"node_id": "a100-3", "state": "provisioning", "request_id": "7:0:a100:scale_up"}],
      "target_size": 3,                     # optional: the pool size the tool now aims at
      "already_applied": false,             # true: this request_id was carried out before
      "error": ""                           # with "ok": false, what went wrong
    }

``state`` is ``provisioning``, ``ready``, ``removing`` or ``failed``. For ``add`` and
``remove``, ``nodes`` are the nodes the request concerns (empty if the tool cannot name them
yet); for ``list``, every node the tool holds for the pool. ``node_id`` must be the id the
node's collector registers with (``XPUPOOL_NODE_ID``).

**Idempotency is the command's job**: the same ``request_id`` sent again (a retry, or a replica
that took over) must not add or remove again; answer what the first call did, with
``"already_applied": true``. ``deploy/autoscaler/exec-provider-example.py`` is a complete
example that keeps its nodes and the request ids it has seen in a JSON state file.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import signal
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from xpupool.autoscaler.pools import ExecProviderConfig, PoolConfig
from xpupool.autoscaler.providers import (
    NodeLifecycle,
    ProvidedNode,
    ProviderError,
    ProviderResult,
)
from xpupool.contracts import describe_error

__all__ = ["PROTOCOL_VERSION", "ExecProvider", "ExecRequest", "ExecAnswer"]

PROTOCOL_VERSION = 1
MAX_ANSWER_BYTES = 4 * 1024 * 1024
STDERR_TAIL = 2000


class ExecPool(msgspec.Struct, frozen=True, kw_only=True):
    """The pool as the command sees it."""

    name: str
    model: str
    vendor: str
    devices_per_node: int
    cpu_milli: int
    memory_mib: int
    interconnect: str
    labels: dict[str, str]
    cost_per_hour: float
    min_size: int
    max_size: int


class ExecRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the command reads on stdin."""

    version: int = PROTOCOL_VERSION
    action: Literal["add", "remove", "list"]
    request_id: str = ""
    pool: ExecPool
    count: int = 0
    node_ids: list[str] = msgspec.field(default_factory=list)
    options: dict[str, Any] = msgspec.field(default_factory=dict)


class ExecNode(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    state: NodeLifecycle = NodeLifecycle.PROVISIONING
    request_id: str | None = None


class ExecAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """What the command writes on stdout (unknown keys are ignored)."""

    ok: bool
    nodes: list[ExecNode] = msgspec.field(default_factory=list)
    target_size: int | None = None
    already_applied: bool = False
    error: str = ""


_answer_decoder = msgspec.json.Decoder(ExecAnswer)


def exec_pool(pool: PoolConfig) -> ExecPool:
    """The ``pool`` object of a request."""
    return ExecPool(
        name=pool.name,
        model=pool.node.model,
        vendor=pool.vendor,
        devices_per_node=pool.node.count,
        cpu_milli=pool.node.cpu_milli,
        memory_mib=pool.node.memory_mib,
        interconnect=pool.node.interconnect or "pcie",
        labels=dict(pool.node.labels),
        cost_per_hour=pool.cost_per_hour,
        min_size=pool.min_size,
        max_size=pool.max_size,
    )


class ExecProvider:
    """Runs the operator's command for every add, remove and list (see the module docstring)."""

    kind = "exec"

    def __init__(self, config: ExecProviderConfig) -> None:
        self.config = config

    async def add(self, pool: PoolConfig, count: int, request_id: str) -> ProviderResult:
        if count < 1:
            raise ProviderError(f"pool {pool.name}: add needs a count of at least 1, got {count}")
        answer = await self._call(pool, "add", request_id, count=count)
        return self._result(pool, request_id, answer)

    async def remove(
        self, pool: PoolConfig, node_ids: Sequence[str], request_id: str
    ) -> ProviderResult:
        answer = await self._call(pool, "remove", request_id, node_ids=list(node_ids))
        return self._result(pool, request_id, answer)

    async def list(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        answer = await self._call(pool, "list", "")
        return tuple(_node(n) for n in answer.nodes)

    def _result(self, pool: PoolConfig, request_id: str, answer: ExecAnswer) -> ProviderResult:
        return ProviderResult(
            request_id=request_id,
            pool=pool.name,
            nodes=tuple(_node(n) for n in answer.nodes),
            target_size=answer.target_size,
            already_applied=answer.already_applied,
        )

    async def _call(
        self,
        pool: PoolConfig,
        action: Literal["add", "remove", "list"],
        request_id: str,
        *,
        count: int = 0,
        node_ids: builtins.list[str] | None = None,
    ) -> ExecAnswer:
        request = ExecRequest(
            action=action,
            request_id=request_id,
            pool=exec_pool(pool),
            count=count,
            node_ids=node_ids or [],
            options=dict(self.config.options),
        )
        what = f"pool {pool.name}: exec provider {action}" + (
            f" {request_id}" if request_id else ""
        )
        env = {**os.environ, **self.config.env}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.config.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            raise ProviderError(
                f"{what}: cannot run {self.config.command[0]!r}: {exc.strerror or exc}"
            ) from exc
        try:
            stdout, stderr = await asyncio.wait_for(
                process.communicate(msgspec.json.encode(request)), self.config.timeout_s
            )
        except TimeoutError:
            _kill_group(process)
            await process.wait()
            raise ProviderError(
                f"{what}: no answer within {self.config.timeout_s:g} s (command killed)"
            ) from None
        except asyncio.CancelledError:
            _kill_group(process)
            raise
        tail = stderr.decode(errors="replace")[-STDERR_TAIL:].strip()
        if process.returncode != 0:
            raise ProviderError(
                f"{what}: command exited with status {process.returncode}"
                + (f": {tail}" if tail else "")
            )
        if len(stdout) > MAX_ANSWER_BYTES:
            raise ProviderError(f"{what}: answer larger than {MAX_ANSWER_BYTES} bytes")
        try:
            answer = _answer_decoder.decode(stdout)
        except msgspec.ValidationError as exc:
            where, reason = describe_error(exc)
            raise ProviderError(
                f"{what}: bad answer on stdout: {where or '(top)'}: {reason}"
            ) from exc
        except msgspec.DecodeError as exc:
            shown = stdout[:200].decode(errors="replace")
            raise ProviderError(f"{what}: answer on stdout is not JSON ({exc}): {shown!r}") from exc
        if not answer.ok:
            raise ProviderError(f"{what}: command refused: {answer.error or 'no reason given'}")
        return answer


def _node(n: ExecNode) -> ProvidedNode:
    return ProvidedNode(node_id=n.node_id, state=n.state, request_id=n.request_id)


def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
