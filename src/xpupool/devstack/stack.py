"""A whole xpupool on one machine: embedded servers (unless URLs are given) and every service as
its own process. Used by ``xpupool dev up``, the demo and the end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from xpupool.devstack.servers import NatsServer, RedisServer

SERVICE_MODULES = {
    "scheduler": "xpupool.scheduler",
    "lease-manager": "xpupool.lease_manager",
    "telemetry-collector": "xpupool.telemetry_collector",
}


@dataclass(frozen=True)
class NodeSpec:
    """A simulated node: its id and fleet profile such as ``2xA100-80GB``."""

    node_id: str
    profile: str
    cpu_milli: int = 64_000
    memory_mib: int = 512 * 1024


@dataclass
class ServiceProcess:
    """One running service process."""

    name: str
    process: subprocess.Popen[bytes]
    env: dict[str, str]
    log_path: Path

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.poll() is None


@dataclass
class Stack:
    """Servers plus services. ``nats_url``/``redis_url`` None means: start embedded ones."""

    nodes: list[NodeSpec]
    nats_url: str | None = None
    redis_url: str | None = None
    namespace: str = "xpupool"
    schedulers: int = 1
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="xpupool-")))
    extra_env: dict[str, str] = field(default_factory=dict)
    nats: NatsServer | None = None
    redis: RedisServer | None = None
    services: list[ServiceProcess] = field(default_factory=list)

    def start_servers(self) -> None:
        """Start embedded NATS (JetStream) and Redis where no URL was given."""
        if self.nats_url is None:
            self.nats = NatsServer(self.workdir / "nats")
            self.nats.start()
            self.nats_url = self.nats.url
        if self.redis_url is None:
            self.redis = RedisServer(self.workdir / "redis")
            self.redis.start()
            self.redis_url = self.redis.url

    def base_env(self) -> dict[str, str]:
        """Environment every service gets."""
        assert self.nats_url and self.redis_url
        env = dict(os.environ)
        env.update(
            XPUPOOL_NATS_URL=self.nats_url,
            XPUPOOL_REDIS_URL=self.redis_url,
            XPUPOOL_NAMESPACE=self.namespace,
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def spawn(self, name: str, **overrides: str) -> ServiceProcess:
        """Start one service process with the stack's environment plus ``overrides``."""
        env = self.base_env()
        env.update(overrides)
        suffix = overrides.get("XPUPOOL_NODE_ID", str(len(self.services)))
        log_path = self.workdir / f"{name}-{suffix}.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", SERVICE_MODULES[name]],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        service = ServiceProcess(name, process, env, log_path)
        self.services.append(service)
        return service

    def spawn_collector(self, node: NodeSpec, **overrides: str) -> ServiceProcess:
        """Start the collector of one simulated node."""
        return self.spawn(
            "telemetry-collector",
            XPUPOOL_NODE_ID=node.node_id,
            XPUPOOL_NODE_PROFILE=node.profile,
            XPUPOOL_BACKEND="simulated",
            XPUPOOL_CPU_MILLI=str(node.cpu_milli),
            XPUPOOL_MEMORY_MIB=str(node.memory_mib),
            **overrides,
        )

    def start(self) -> None:
        """Servers, then the lease-manager, schedulers and one collector per node."""
        self.start_servers()
        self.spawn("lease-manager")
        for _ in range(self.schedulers):
            self.spawn("scheduler")
        for node in self.nodes:
            self.spawn_collector(node)

    def restart(self, service: ServiceProcess) -> ServiceProcess:
        """Kill a service (SIGKILL) and start it again with the same environment."""
        self.kill(service)
        with service.log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", SERVICE_MODULES[service.name]],
                env=service.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        replacement = ServiceProcess(service.name, process, service.env, service.log_path)
        self.services[self.services.index(service)] = replacement
        return replacement

    @staticmethod
    def kill(service: ServiceProcess) -> None:
        """SIGKILL one service, as a crash would."""
        if service.alive():
            service.process.send_signal(signal.SIGKILL)
            service.process.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM every service, wait for a clean exit (SIGKILL stragglers), stop the servers."""
        for service in self.services:
            if service.alive():
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for service in self.services:
            try:
                service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(service)
        self.services.clear()
        for server in (self.nats, self.redis):
            if server is not None:
                server.stop()

    def logs(self) -> str:
        """Every service log, for a failing test's report."""
        return "\n".join(
            f"===== {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )
