"""The ``simulated`` provider: a node is a telemetry-collector process with the simulated backend.

A new node of pool ``p`` gets the id ``<node_prefix or p>-<n>`` and a collector started with the
environment the dev stack gives its simulated nodes (``xpupool.devstack.stack.Stack
.spawn_collector``): ``XPUPOOL_NODE_ID``, ``XPUPOOL_NODE_PROFILE`` (``<count>x<model>`` from the
pool's node shape), ``XPUPOOL_BACKEND=simulated``, ``XPUPOOL_CPU_MILLI``, ``XPUPOOL_MEMORY_MIB``,
plus the pool's ``collector_env`` (on a secure stack: the collector's identity). Processes are
started through a :class:`NodeProcessLauncher`; the default, :class:`CollectorLauncher`, runs
``python -m xpupool.telemetry_collector`` in its own session (it inherits this environment but
not ``XPUPOOL_PARENT_PID``: a node outlives the autoscaler replica that started it, so that a
replica taking over finds it running; the dev stack stops the nodes recorded in the pools' state
directories with :func:`stop_recorded_nodes` when it stops).

State lives in ``state_dir`` (one JSON file per node and per request, under a file lock), not in
the process, so a replica that takes over sees the nodes another started and resumes its
requests: an ``add`` first records the node ids it will start, then starts those not started
yet; the same request id again starts only what is missing and changes nothing when all are
there (``already_applied``). ``remove`` stops the nodes' processes (SIGTERM, then SIGKILL) and
forgets them; ids it does not hold are ignored.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from xpupool.autoscaler.pools import PoolConfig, SimulatedProviderConfig
from xpupool.autoscaler.providers import (
    NodeLifecycle,
    ProvidedNode,
    ProviderError,
    ProviderResult,
)
from xpupool.bus.lifecycle import PARENT_PID_ENV

__all__ = [
    "COLLECTOR_MODULE",
    "stop_recorded_nodes",
    "CollectorLauncher",
    "NodeProcessLauncher",
    "SimulatedNode",
    "SimulatedProvider",
    "collector_env",
]

COLLECTOR_MODULE = "xpupool.telemetry_collector"


@dataclass(frozen=True, slots=True)
class SimulatedNode:
    """One simulated node to start: the collector's id, profile, host resources and the extra
    environment (the pool's ``collector_env``)."""

    node_id: str
    pool: str
    profile: str
    cpu_milli: int
    memory_mib: int
    env: Mapping[str, str] = field(default_factory=dict)


def collector_env(node: SimulatedNode) -> dict[str, str]:
    """The variables a simulated node's collector needs (as ``Stack.spawn_collector`` sets)."""
    return {
        "XPUPOOL_NODE_ID": node.node_id,
        "XPUPOOL_NODE_PROFILE": node.profile,
        "XPUPOOL_BACKEND": "simulated",
        "XPUPOOL_CPU_MILLI": str(node.cpu_milli),
        "XPUPOOL_MEMORY_MIB": str(node.memory_mib),
        **node.env,
    }


class NodeProcessLauncher(Protocol):
    """Starts and stops the process of a simulated node, by pid (a replica may stop a process
    another replica started)."""

    def launch(self, node: SimulatedNode) -> int:
        """Start the node's collector; return its pid."""
        ...

    def alive(self, pid: int) -> bool:
        """Whether that process still runs."""
        ...

    def stop(self, pid: int, timeout_s: float) -> None:
        """SIGTERM it, SIGKILL it after ``timeout_s``; a process already gone is no error."""
        ...


class CollectorLauncher:
    """Runs each node's collector as a child process (own session, log file per node)."""

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        command: Sequence[str] | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self.command = list(command or (sys.executable, "-m", COLLECTOR_MODULE))
        self.base_env = dict(os.environ if base_env is None else base_env)
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def launch(self, node: SimulatedNode) -> int:
        env = {**self.base_env, "PYTHONUNBUFFERED": "1", **collector_env(node)}
        # A collector stops when $XPUPOOL_PARENT_PID is not its parent: that is this replica's
        # parent (the dev stack), never the collector's own, so it would stop at once.
        env.pop(PARENT_PID_ENV, None)
        with contextlib.ExitStack() as stack:
            out: Any = subprocess.DEVNULL
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = stack.enter_context((self.log_dir / f"{node.node_id}.log").open("ab"))
            process = subprocess.Popen(
                self.command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._children[process.pid] = process
        return process.pid

    def alive(self, pid: int) -> bool:
        child = self._children.get(pid)
        if child is not None:
            return child.poll() is None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not _zombie(pid)

    def stop(self, pid: int, timeout_s: float) -> None:
        child = self._children.pop(pid, None)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            if child is not None:
                child.wait()
            return
        if child is not None:
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive(pid):
                return
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Stop every process this launcher started (a dev stack shutting down, tests)."""
        for pid in list(self._children):
            self.stop(pid, timeout_s)


def stop_recorded_nodes(state_dir: str | Path, timeout_s: float = 10.0) -> int:
    """Stop every node process recorded under a simulated provider's ``state_dir`` (SIGTERM,
    then SIGKILL) and forget them; how many were running. For the dev stack's shutdown and
    tests: the autoscaler itself never stops nodes but through ``remove``."""
    launcher = CollectorLauncher()
    stopped = 0
    for path in sorted(Path(state_dir).glob("pools/*/*.json")):
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if launcher.alive(pid):
            stopped += 1
        launcher.stop(pid, timeout_s)
        path.unlink(missing_ok=True)
    return stopped


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "Z"


class SimulatedProvider:
    """Simulated nodes as collector processes (see the module docstring)."""

    kind = "simulated"

    def __init__(
        self,
        config: SimulatedProviderConfig,
        *,
        launcher: NodeProcessLauncher | None = None,
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.config = config
        default_dir = Path(tempfile.gettempdir()) / "xpupool-autoscaler-simulated"
        self.state_dir = Path(config.state_dir) if config.state_dir else default_dir
        self.launcher = launcher or CollectorLauncher(self.state_dir / "logs")
        self.stop_timeout_s = stop_timeout_s

    async def add(self, pool: PoolConfig, count: int, request_id: str) -> ProviderResult:
        if count < 1:
            raise ProviderError(f"pool {pool.name}: add needs a count of at least 1, got {count}")
        return await asyncio.to_thread(self._add, pool, count, request_id)

    async def remove(
        self, pool: PoolConfig, node_ids: Sequence[str], request_id: str
    ) -> ProviderResult:
        return await asyncio.to_thread(self._remove, pool, tuple(node_ids), request_id)

    async def list(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        return await asyncio.to_thread(self._list, pool)

    # -- state directory ------------------------------------------------------------------

    def _pool_dir(self, pool: PoolConfig) -> Path:
        return self.state_dir / "pools" / pool.name

    def _request_path(self, request_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)
        return self.state_dir / "requests" / f"{safe}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with (self.state_dir / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _nodes(self, pool: PoolConfig) -> dict[str, dict[str, Any]]:
        directory = self._pool_dir(pool)
        if not directory.exists():
            return {}
        out = {}
        for path in sorted(directory.glob("*.json")):
            record = json.loads(path.read_text())
            out[str(record["node_id"])] = record
        return out

    def _next_ids(self, pool: PoolConfig, count: int) -> builtins.list[str]:
        counter = self.state_dir / "pools" / f"{pool.name}.serial"
        serial = int(counter.read_text()) if counter.exists() else 0
        prefix = self.config.node_prefix or pool.name
        ids = [f"{prefix}-{serial + i + 1}" for i in range(count)]
        counter.parent.mkdir(parents=True, exist_ok=True)
        _write(counter, str(serial + count))
        return ids

    def _add(self, pool: PoolConfig, count: int, request_id: str) -> ProviderResult:
        with self._locked():
            path = self._request_path(request_id)
            replay = path.exists()
            if replay:
                request = json.loads(path.read_text())
                planned = [str(n) for n in request["node_ids"]]
            else:
                held = len(self._nodes(pool))
                if held + count > pool.max_size:
                    raise ProviderError(
                        f"pool {pool.name}: {held} nodes + {count} exceed max_size {pool.max_size}"
                    )
                planned = self._next_ids(pool, count)
                path.parent.mkdir(parents=True, exist_ok=True)
                _write(path, json.dumps({"action": "add", "pool": pool.name, "node_ids": planned}))
            nodes = self._nodes(pool)
            started = 0
            for node_id in planned:
                if node_id in nodes:
                    continue
                node = SimulatedNode(
                    node_id=node_id,
                    pool=pool.name,
                    profile=pool.node.profile,
                    cpu_milli=pool.node.cpu_milli,
                    memory_mib=pool.node.memory_mib,
                    env=dict(self.config.collector_env),
                )
                try:
                    pid = self.launcher.launch(node)
                except OSError as exc:
                    raise ProviderError(
                        f"pool {pool.name}: cannot start the collector of {node_id}: {exc}"
                    ) from exc
                record = {"node_id": node_id, "pid": pid, "request_id": request_id}
                self._pool_dir(pool).mkdir(parents=True, exist_ok=True)
                _write(self._pool_dir(pool) / f"{node_id}.json", json.dumps(record))
                started += 1
            listed = self._list_locked(pool)
            concerned = tuple(n for n in listed if n.node_id in planned)
            return ProviderResult(
                request_id=request_id,
                pool=pool.name,
                nodes=concerned,
                target_size=len(listed),
                already_applied=replay and started == 0,
            )

    def _remove(
        self, pool: PoolConfig, node_ids: tuple[str, ...], request_id: str
    ) -> ProviderResult:
        with self._locked():
            path = self._request_path(request_id)
            replay = path.exists()
            if not replay:
                path.parent.mkdir(parents=True, exist_ok=True)
                record = {"action": "remove", "pool": pool.name, "node_ids": list(node_ids)}
                _write(path, json.dumps(record))
            nodes = self._nodes(pool)
            stopped: builtins.list[ProvidedNode] = []
            for node_id in node_ids:
                held = nodes.get(node_id)
                if held is None:
                    continue
                self.launcher.stop(int(held["pid"]), self.stop_timeout_s)
                (self._pool_dir(pool) / f"{node_id}.json").unlink(missing_ok=True)
                stopped.append(ProvidedNode(node_id, NodeLifecycle.REMOVING, request_id))
            return ProviderResult(
                request_id=request_id,
                pool=pool.name,
                nodes=tuple(stopped),
                target_size=len(self._nodes(pool)),
                already_applied=replay and not stopped,
            )

    def _list(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        with self._locked():
            return self._list_locked(pool)

    def _list_locked(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        return tuple(
            ProvidedNode(
                node_id=node_id,
                state=(
                    NodeLifecycle.READY
                    if self.launcher.alive(int(record["pid"]))
                    else NodeLifecycle.FAILED
                ),
                request_id=record.get("request_id"),
            )
            for node_id, record in self._nodes(pool).items()
        )


def _write(path: Path, text: str) -> None:
    """Write atomically (a crash leaves the old file or the new one, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
