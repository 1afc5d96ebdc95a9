"""Embedded nats-server and redis-server processes on free ports, for tests, the demo and dev.

They can be killed and restarted on the same port and data directory, which is what the fault
tests need; that is why the project spawns binaries instead of relying on shared instances.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 15.0


class ServerUnavailable(RuntimeError):
    """The server binary is missing or would not start."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_binary(name: str, env_var: str) -> str:
    """The server binary: ``$env_var``, then PATH, then the virtualenv's bin (PyPI wheels)."""
    candidates = [os.environ.get(env_var), shutil.which(name)]
    candidates.append(str(Path(sys.executable).parent / name))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ServerUnavailable(
        f"{name} not found: install it (apt-get install {name}, or the PyPI wheel) or set {env_var}"
    )


def _wait_for_port(port: int, process: subprocess.Popen[bytes], greeting: bytes | None) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(f"server exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                if greeting is None:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return
                elif sock.recv(len(greeting)).startswith(greeting):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise ServerUnavailable(f"server on port {port} not ready after {READY_TIMEOUT_S}s")


@dataclass
class _Server(ABC):
    workdir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @abstractmethod
    def command(self) -> list[str]:
        """The server's command line."""

    @abstractmethod
    def greeting(self) -> bytes | None:
        """What the server sends first on a new connection (None: answer a PING instead)."""

    def start(self) -> None:
        """Start the server (again) on its port and data directory; returns once it answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "server.log").open("ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        _wait_for_port(self.port, self.process, self.greeting())

    def kill(self) -> None:
        """SIGKILL: a crash, no chance to flush anything."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        """A clean shutdown."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        """Kill and start again on the same port and data."""
        self.kill()
        self.start()


@dataclass
class NatsServer(_Server):
    """``nats-server -js`` with its store in ``workdir``."""

    @property
    def url(self) -> str:
        """Client URL."""
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line."""
        return [
            find_binary("nats-server", "XPUPOOL_NATS_SERVER_BIN"),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.workdir / "js"),
        ]

    def greeting(self) -> bytes | None:
        """NATS servers greet with INFO."""
        return b"INFO"


@dataclass
class RedisServer(_Server):
    """``redis-server`` with AOF on (``appendfsync always``), as the ledger host should run."""

    @property
    def url(self) -> str:
        """Client URL."""
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """The command line."""
        return [
            find_binary("redis-server", "XPUPOOL_REDIS_SERVER_BIN"),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
        ]

    def greeting(self) -> bytes | None:
        """Redis answers PING."""
        return None
