"""Embedded nats-server and redis-server processes on free ports, for tests, the demo and dev.

They can be killed and restarted on the same port and data directory, which is what the fault
tests need; that is why the project spawns binaries instead of relying on shared instances.

Either server can run secured (``xpupool.devstack.secure`` generates the files): NATS with a
configuration file (TLS, users, permissions), Redis with TLS only (no plaintext port) and an ACL
file. Their ``url`` is then ``tls://`` / ``rediss://``, without credentials.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
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


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate and key, and the CA that signed it (clients verify with it)."""

    cert: Path
    key: Path
    ca: Path


# What a server that answers says to an unauthenticated PING: PONG, or (ACL with the default
# user off) that it wants a login first. Either way it is up.
_PING_ANSWERS = (b"+PONG", b"-NOAUTH")


def _answers(sock: socket.socket, greeting: bytes | None) -> bool:
    if greeting is None:
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(_PING_ANSWERS)
    return sock.recv(len(greeting)).startswith(greeting)


def _wait_for_port(
    port: int,
    process: subprocess.Popen[bytes],
    greeting: bytes | None,
    tls_ca: Path | None = None,
) -> None:
    """Wait until the server greets (NATS sends INFO in plaintext even when it requires TLS:
    the TLS upgrade comes after it) or answers a PING, over TLS verified with ``tls_ca`` if
    given."""
    context = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerUnavailable(f"server exited with code {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
                if context is None:
                    if _answers(raw, greeting):
                        return
                else:
                    with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                        if _answers(sock, greeting):
                            return
        except OSError:  # ssl.SSLError included
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

    def probe_ca(self) -> Path | None:
        """The CA to verify the readiness probe's TLS with (None: the probe is plaintext)."""
        return None

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
        _wait_for_port(self.port, self.process, self.greeting(), self.probe_ca())

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
    """``nats-server -js`` with its store in ``workdir``; with ``config``, that configuration
    file too (TLS, authorization, and its ``jetstream`` block, which must name the store:
    nats-server refuses a store given twice). Address and port come from here. ``tls``: the
    configuration requires TLS (clients use ``tls://``)."""

    config: Path | None = None
    tls: bool = False

    @property
    def url(self) -> str:
        """Client URL."""
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line (flags override the configuration file)."""
        store = (
            ["-c", str(self.config)] if self.config else ["-js", "-sd", str(self.workdir / "js")]
        )
        return [
            find_binary("nats-server", "XPUPOOL_NATS_SERVER_BIN"),
            *store,
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
        ]

    def reload(self) -> None:
        """Make the server re-read its configuration file (SIGHUP, as ``nats-server --signal
        reload`` does): rotated keys and changed permissions take effect."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGHUP)

    def greeting(self) -> bytes | None:
        """NATS servers greet with INFO."""
        return b"INFO"


@dataclass
class RedisServer(_Server):
    """``redis-server`` with AOF on (``appendfsync always``), as the ledger host should run.

    With ``tls`` it listens for TLS only on ``port`` (no plaintext port; clients are not asked
    for certificates); with ``acl_file`` its users come from that file (``ACL LOAD`` re-reads
    it)."""

    tls: TlsFiles | None = None
    acl_file: Path | None = None

    @property
    def url(self) -> str:
        """Client URL (no credentials)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def probe_ca(self) -> Path | None:
        """The readiness probe speaks TLS to a TLS server."""
        return self.tls.ca if self.tls else None

    def command(self) -> list[str]:
        """The command line."""
        if self.tls:
            listen = [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.tls.cert),
                "--tls-key-file",
                str(self.tls.key),
                "--tls-ca-cert-file",
                str(self.tls.ca),
                "--tls-auth-clients",
                "no",
            ]
        else:
            listen = ["--port", str(self.port)]
        acl = ["--aclfile", str(self.acl_file)] if self.acl_file else []
        return [
            find_binary("redis-server", "XPUPOOL_REDIS_SERVER_BIN"),
            "--bind",
            "127.0.0.1",
            *listen,
            *acl,
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
