"""Security material for a secured xpupool: a CA and TLS certificates, one NKey identity per
service role and per tenant, the nats-server configuration (TLS, ``max_payload``, users with the
permissions of ``xpupool.contracts.access``), the Redis ACL file (one user per service role plus
``operator``, ``default`` off), and for each identity the environment its process needs.

Used by ``Stack(secure=True)``, ``xpupool dev up --secure`` and, as
``python -m xpupool.devstack.secure generate --out DIR --tenants a,b``, by docker-compose's
init service. Layout of ``DIR``::

    ca.pem  ca.key                      the CA (keep ca.key offline in a real deployment)
    server-cert.pem  server-key.pem     NATS and Redis (SAN: localhost, 127.0.0.1, --host names)
    nats.conf  users.acl                the servers' configuration
    manifest.json                       what was generated (no secrets)
    identities/service/<role>/          scheduler, lease-manager, telemetry-collector, operator
    identities/tenant/<tenant>/         one per tenant
        nats.seed                       the NKey seed (0600; the server knows only its public key)
        env                             XPUPOOL_* lines for that identity (0600: the Redis password)

Redis passwords are 32 random bytes (hex); the ACL file holds only their SHA-256 (``#<hash>``).

Rotation (every step keeps the other identities connected):

- an NKey: ``SecureMaterial.load(DIR).rotate_seed("tenant", "team-a")`` writes a new seed file
  and a ``nats.conf`` with the new public key; then make the server reload its configuration
  (``nats-server --signal reload=<pid>``, or SIGHUP; ``NatsServer.reload()`` here). The server
  closes connections authenticated with the old key; clients reconnect reading the seed file
  again (nats-py re-reads it at each connect), so a process given the new file carries on.
  Compromised: the old key stops working at the reload, before anyone else is touched.
- a Redis password: ``rotate_redis_password(role)`` rewrites ``users.acl`` and the role's
  ``env``; then run ``ACL LOAD`` as ``operator``. Existing connections stay authenticated
  (Redis checks passwords at AUTH only), so restart the role's processes to cut an old one off
  (``CLIENT KILL USER <role>``).
- the CA or server certificate: regenerate into a new directory and roll the servers and every
  client's CA file; NATS reloads TLS on SIGHUP, Redis on ``CONFIG SET tls-cert-file`` (or a
  restart).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import nkeys  # type: ignore[import-untyped]
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from xpupool.contracts import access
from xpupool.contracts.subjects import TENANT_NAME
from xpupool.ledger.ledger import SCRIPTS, glob_escaped, script_source

# Lower than nats-server's 1 MiB default on purpose: no xpupool message comes near it, and a
# small limit bounds what one (tenant) connection can make every subscriber receive.
MAX_PAYLOAD: Final = 256 * 1024
SERVICE_ROLES: Final = (
    access.SCHEDULER,
    access.LEASE_MANAGER,
    access.TELEMETRY_COLLECTOR,
    access.AUTOSCALER,
)
NAMESPACE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CERT_DAYS: Final = 825

# ---- Redis ACL -------------------------------------------------------------------------------

# The ledger scripts (lua/*.lua) each service runs. Every script belongs to exactly one role,
# or is the outbox relay's (``RELAY_SCRIPTS``; a test checks that none is left out or listed
# twice); a role's ACL allows the commands its scripts call,
# since Redis 7 checks each command a script runs against the caller's ACL.
LEDGER_SCRIPTS: Final[Mapping[str, tuple[str, ...]]] = {
    access.SCHEDULER: (
        "reserve",
        "pend",
        "drop_pending",
        "note_pending",
        "cancel_job",
        "request_preemption",
        "acquire",
        "release_lock",
        "time_out_pending",
        "read_changes",
        # pending_jobs (the autoscaler lists the waiting jobs with it too: it reads only what
        # the autoscaler's own rules let it read)
        "list_pending",
    ),
    access.LEASE_MANAGER: (
        "grant",
        "renew",
        "end",
        "end_after",
        "reclaim_idle",
        "expire",
        "warn_deadlines",
        "reap_nodes",
        "lease_states",
        # at start (``prepare_ledger``): its retention settings, tenants' lease sets
        "set_retention",
        "index_tenant_leases",
    ),
    access.TELEMETRY_COLLECTOR: ("register_node", "heartbeat", "set_health"),
    access.AUTOSCALER: ("set_draining",),
}
# What every ledger client needs: run the scripts (redis-py loads them on NOSCRIPT; pipelines
# ask SCRIPT EXISTS first) and ping. (redis-py also sends CLIENT SETINFO, which Redis 7.0 does
# not know, so an ACL naming it would not load there; redis-py ignores the refusal.)
_CLIENT_COMMANDS: Final = ("evalsha", "script|load", "script|exists", "ping")
# The outbox relay (``outbox.py``), run by every role in ``RELAY_ROLES``: a consumer group on
# the role's outbox stream (these commands), and its own scripts (``RELAY_SCRIPTS``; each other
# script belongs to one role, ``LEDGER_SCRIPTS``).
RELAY_ROLES: Final = (access.SCHEDULER, access.LEASE_MANAGER)
_RELAY_COMMANDS: Final = ("xgroup|create", "xreadgroup", "xautoclaim", "xack", "xdel")
RELAY_SCRIPTS: Final = ("reap_consumers",)
# Commands each role runs outside scripts (``ledger.py`` reads, ``publish_fair_share``).
DIRECT_COMMANDS: Final[Mapping[str, tuple[str, ...]]] = {
    access.SCHEDULER: (
        # the ledger's change feed (Ledger.follow_changes), on its channel only
        "subscribe",
        "unsubscribe",
        # nodes/get_nodes/leases/live_leases/pending/pending_jobs/get_job/pending_count; and
        # tenant_jobs, when the tenant's job index is short: its live leases (tenant_leases)
        "hgetall",
        "hget",
        "smembers",
        "smismember",
        "zrange",
        # any_pending: whether a cycle has anything to decide
        "zcard",
        # tenant_jobs (redis-py sends ZREVRANGE for zrange(desc=True)); and, when the tenant's
        # count of waiting jobs says some are not in its index, a scan of the queue for them
        "zrevrange",
        "zscan",
        "mget",
        "get",
        # publish_fair_share
        "hset",
        # now_ms (changes_since is a script: read_changes)
        "time",
    ),
    # get_lease/leases; tenant_leases: the tenant's set of live leases (smembers), their
    # records and whether each is live (smismember)
    access.LEASE_MANAGER: (
        "hgetall",
        "smembers",
        # lease_states: the live lease set a chunk at a time, for the lease gauge
        "sscan",
        "smismember",
        "time",
        # outbox lag for its metrics (lease_manager.metrics): entries and the oldest one
        "xlen",
        "xrange",
        # usage retention (ledger.usage.trim_usage): the expired ids, dropped in one MULTI
        "zrangebyscore",
        "hdel",
        "zrem",
        "multi",
        "exec",
        "discard",
    ),
    access.TELEMETRY_COLLECTOR: ("hgetall", "smembers"),
    # nodes/leases/pending_jobs/now_ms; its own state (``xpupool.autoscaler.state``: the fenced
    # leader lease, journal and node records, read directly and written by its own scripts,
    # which GET/SET/PEXPIRE/INCR/DEL the lease and HGET/HSET/HDEL the hashes).
    access.AUTOSCALER: (
        "hgetall",
        "smembers",
        "zrange",
        "time",
        "get",
        "mget",
        "set",
        "pexpire",
        "incr",
        "del",
        "hget",
        "hset",
        "hdel",
    ),
}

# The collector is narrowed by key as well: it reads the whole ledger (it needs the leases that
# hold its devices), but each command writes only the key families its scripts write with it.
# register_node ends the leases of a vanished device (``end_lease`` in _prelude.lua), which is
# why lease, job, usage and expiry keys appear here at all. A rule missing here would make a
# script fail half-way (Redis does not roll a script back), so the secure tests run every
# collector flow, a vanished device included, as this user.
_COLLECTOR_READS: Final = (
    "hget",
    "hgetall",
    "hmget",
    "hexists",
    "smembers",
    "exists",
    "zcard",
    "zrange",
)
_COLLECTOR_WRITES: Final[tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = (
    (("evalsha",), ("",)),  # KEYS[1] of every script is the bare prefix
    (("hset", "hincrby"), ("node:*", "dev:*", "lease:*", "job:*")),
    (("hincrbyfloat",), ("usage:*",)),
    (("sadd", "srem"), ("devices", "nodes", "node-devices:*")),
    # the heartbeat index (register_node, heartbeat; reap_nodes reads it)
    (("zadd",), ("node-seen",)),
    (("srem",), ("dev-leases:*", "node-leases:*", "leases", "tenant-leases:*")),
    (("del",), ("dev:*", "dev-leases:*")),
    # a quarantine ended by a collector that restarted (register_node, end_quarantine)
    (("hdel",), ("dev:*",)),
    (("expire",), ("lease:*", "job:*")),
    (("zrem",), ("expiry", "idle-watch", "deadlines")),
    (("zadd", "zremrangebyrank"), ("changes",)),
    # end_lease's usage record (write_usage in _prelude.lua)
    (("hset",), ("usage-rec",)),
    (("zadd",), ("usage-ended",)),
    (("incr",), ("changes-seq", "ver")),
    (("set",), ("changes-epoch", "changes-floor", "capacity-seq")),
    (("xadd",), ("outbox:lease-manager",)),
)
# The one channel: every script that changes a record announces it there (``touched`` in
# _prelude.lua, so every role publishes), and the scheduler follows it.
CHANGE_FEED: Final = "changes-feed"
# A command and, for the commands made of subcommands (XGROUP, XINFO, PUBSUB), the subcommand its
# script names: an ACL then allows ``xgroup|delconsumer``, not every ``xgroup``.
_LUA_CALL: Final = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?")
_CONTAINER_COMMANDS: Final = frozenset({"xgroup", "xinfo", "pubsub"})


def script_commands(names: Sequence[str]) -> set[str]:
    """The Redis commands (lowercase) that the named ledger scripts call, with the prelude and
    the shared parts each includes."""
    found: set[str] = set()
    for name in names:
        for command, sub in _LUA_CALL.findall(script_source(name)):
            command = command.lower()
            if command not in _CONTAINER_COMMANDS:
                found.add(command)
            elif sub:
                found.add(f"{command}|{sub.lower()}")
            else:
                raise ValueError(f"{name}.lua: name {command.upper()}'s subcommand literally")
    return found


def ledger_scripts() -> set[str]:
    """Every ledger script, by name (the files in lua/ but the shared parts)."""
    return set(SCRIPTS)


def _key_prefix(namespace: str) -> str:
    """The ledger's key prefix as an ACL glob (``Ledger.prefix``, glob characters escaped)."""
    return glob_escaped("{" + namespace + "}:")


def redis_acl_rules(role: str, namespace: str) -> str:
    """The ACL rules (after ``user <name> on #<hash>``) of one role."""
    prefix = _key_prefix(namespace)
    if role == access.OPERATOR:
        return "~* &* +@all"
    feed = f"&{prefix}{CHANGE_FEED}"
    if role == access.TELEMETRY_COLLECTOR:
        root = [f"%R~{prefix}*", "resetchannels", "-@all"]
        root += [f"+{c}" for c in (*_CLIENT_COMMANDS[1:], "time", *_COLLECTOR_READS)]
        selectors = [
            "("
            + " ".join(
                [*(f"~{prefix}{k}" for k in keys), "resetchannels", "-@all"]
                + [f"+{c}" for c in commands]
            )
            + ")"
            for commands, keys in _COLLECTOR_WRITES
        ]
        selectors.append(f"(resetchannels {feed} -@all +publish)")
        return " ".join(root + selectors)
    if role not in LEDGER_SCRIPTS:
        raise ValueError(f"no Redis user for role {role!r}")
    commands = set(_CLIENT_COMMANDS) | set(DIRECT_COMMANDS[role])
    commands |= script_commands(LEDGER_SCRIPTS[role])
    if role in RELAY_ROLES:
        commands |= set(_RELAY_COMMANDS) | script_commands(RELAY_SCRIPTS)
    return " ".join(
        [f"~{prefix}*", "resetchannels", feed, "-@all", *(f"+{c}" for c in sorted(commands))]
    )


def redis_acl(namespace: str, passwords: Mapping[str, str]) -> str:
    """The ACL file: ``default`` off, one user per role in ``passwords`` (stored as SHA-256).

    ``default`` is off (no connection can use it, authenticated or not) but keeps every right:
    Redis 7.0 replays the AOF's MULTI/EXEC blocks (what a Lua script's writes become) under the
    default user's ACL, and with ``-@all`` there it drops them all at start-up, so a restarted
    ledger came back empty (seen with 7.0.15; the secure fault test restarts Redis for this).
    """
    lines = ["user default off resetpass resetchannels ~* &* +@all"]
    for role, password in passwords.items():
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {role} on #{digest} {redis_acl_rules(role, namespace)}")
    return "\n".join(lines) + "\n"


# ---- nats-server configuration -----------------------------------------------------------------


def _conf_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def nats_users(identities: Sequence[Identity]) -> str:
    """The ``authorization.users`` entries: each identity's public NKey and permissions."""
    entries = []
    for identity in identities:
        p = identity.permissions
        deny = f", deny: {_conf_list(p.publish_deny)}" if p.publish_deny else ""
        entries.append(
            f"    # {identity.kind} {identity.name}\n"
            f"    {{nkey: {json.dumps(identity.public_key)}, permissions: {{\n"
            f"      publish: {{allow: {_conf_list(p.publish)}{deny}}}\n"
            f"      subscribe: {{allow: {_conf_list(p.subscribe)}}}\n"
            f"    }}}}"
        )
    return "\n".join(entries)


# ---- certificates -----------------------------------------------------------------------------


def _write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write atomically with ``mode`` from the start (a secret is never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _certificates(hosts: Sequence[str]) -> tuple[bytes, bytes, bytes, bytes]:
    """A CA (cert, key) and a server certificate (cert, key) for ``hosts`` (names or IPs)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "xpupool dev CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "xpupool server")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=CERT_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return ca.public_bytes(pem), _pem_key(ca_key), server.public_bytes(pem), _pem_key(key)


# ---- identities and the material --------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """One NATS identity: a service role (or the operator) or a tenant."""

    kind: str  # "service" | "tenant"
    name: str
    public_key: str
    directory: Path

    @property
    def seed_path(self) -> Path:
        """The NKey seed file (``XPUPOOL_NATS_CREDS``)."""
        return self.directory / "nats.seed"

    @property
    def env_path(self) -> Path:
        """The identity's environment as ``KEY=VALUE`` lines (sourceable by a shell)."""
        return self.directory / "env"

    @property
    def permissions(self) -> access.Permissions:
        """Its NATS allow lists, from ``xpupool.contracts.access``."""
        if self.kind == "tenant":
            return access.tenant_permissions(self.name)
        return access.service_permissions(self.name)

    @property
    def inbox_prefix(self) -> str:
        """Where its replies arrive (the only inbox its permissions allow)."""
        if self.kind == "tenant":
            return access.tenant_inbox(self.name)
        return access.service_inbox(self.name)


def _new_seed() -> tuple[bytes, str]:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


def _check_tenants(tenants: Sequence[str]) -> tuple[str, ...]:
    for tenant in tenants:
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{tenant!r} is not a valid tenant name ({TENANT_NAME.pattern})")
    if len(set(tenants)) != len(tenants):
        raise ValueError(f"tenants repeated: {', '.join(tenants)}")
    return tuple(tenants)


@dataclass
class SecureMaterial:
    """Everything a secured stack needs, in ``directory`` (see the module docstring)."""

    directory: Path
    namespace: str
    tenants: tuple[str, ...]
    nats_port: int
    redis_port: int
    nats_host: str = "127.0.0.1"
    redis_host: str = "127.0.0.1"
    listen: str = "127.0.0.1"
    jetstream_dir: Path | None = None
    monitor: str = ""
    identities: dict[tuple[str, str], Identity] = field(default_factory=dict)
    redis_passwords: dict[str, str] = field(default_factory=dict, repr=False)

    # -- paths

    @property
    def ca_path(self) -> Path:
        """The CA certificate every client verifies the servers with."""
        return self.directory / "ca.pem"

    @property
    def ca_key_path(self) -> Path:
        """The CA's private key."""
        return self.directory / "ca.key"

    @property
    def server_cert_path(self) -> Path:
        """The servers' certificate (NATS and Redis share it)."""
        return self.directory / "server-cert.pem"

    @property
    def server_key_path(self) -> Path:
        """The servers' private key."""
        return self.directory / "server-key.pem"

    @property
    def nats_conf_path(self) -> Path:
        """The nats-server configuration file."""
        return self.directory / "nats.conf"

    @property
    def acl_path(self) -> Path:
        """The Redis ACL file (``--aclfile``)."""
        return self.directory / "users.acl"

    # -- URLs and environments

    @property
    def nats_url(self) -> str:
        """The client URL (TLS only)."""
        return f"tls://{self.nats_host}:{self.nats_port}"

    def redis_url(self, role: str | None = None, with_ca: bool = False) -> str:
        """The Redis URL, as ``role`` if given; ``with_ca`` adds the CA as a query parameter
        (redis-py's ``from_url`` passes it on), for tools that take a bare URL."""
        auth = f"{role}:{self.redis_passwords[role]}@" if role else ""
        query = f"?ssl_ca_certs={self.ca_path}" if with_ca else ""
        return f"rediss://{auth}{self.redis_host}:{self.redis_port}/0{query}"

    def identity(self, kind: str, name: str) -> Identity:
        """One identity; KeyError names what exists."""
        try:
            return self.identities[(kind, name)]
        except KeyError:
            known = ", ".join(f"{k}:{n}" for k, n in self.identities)
            raise KeyError(f"no {kind} identity {name!r} (known: {known})") from None

    def _nats_env(self, identity: Identity) -> dict[str, str]:
        return {
            "XPUPOOL_NATS_URL": self.nats_url,
            "XPUPOOL_NATS_CREDS": str(identity.seed_path),
            "XPUPOOL_NATS_TLS_CA": str(self.ca_path),
        }

    def service_env(self, role: str) -> dict[str, str]:
        """The environment of a process of service ``role`` (or ``operator``)."""
        env = self._nats_env(self.identity("service", role))
        env.update(
            XPUPOOL_REDIS_URL=self.redis_url(role),
            XPUPOOL_REDIS_TLS_CA=str(self.ca_path),
            XPUPOOL_NAMESPACE=self.namespace,
        )
        return env

    def operator_env(self) -> dict[str, str]:
        """The operator's environment (CLI, audits, tests): every right."""
        return self.service_env(access.OPERATOR)

    def tenant_env(self, tenant: str) -> dict[str, str]:
        """A tenant client's environment: NATS only (tenants never reach Redis)."""
        return self._nats_env(self.identity("tenant", tenant))

    def env_of(self, identity: Identity) -> dict[str, str]:
        """The environment of any identity."""
        if identity.kind == "tenant":
            return self.tenant_env(identity.name)
        return self.service_env(identity.name)

    # -- generation

    @classmethod
    def generate(
        cls,
        directory: Path,
        tenants: Sequence[str],
        namespace: str,
        nats_port: int,
        redis_port: int,
        *,
        nats_host: str = "127.0.0.1",
        redis_host: str = "127.0.0.1",
        listen: str = "127.0.0.1",
        extra_hosts: Sequence[str] = (),
        jetstream_dir: Path | None = None,
        monitor: str = "",
    ) -> SecureMaterial:
        """Generate fresh material into ``directory`` (created; existing files replaced).

        ``nats_host``/``redis_host`` are the names clients use (they go into the URLs and the
        certificate); ``listen`` is the address nats-server binds; ``monitor`` an optional
        ``host:port`` for nats-server's HTTP monitoring (health checks).
        """
        if not NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must match {NAMESPACE.pattern}")
        material = cls(
            directory=directory.resolve(),
            namespace=namespace,
            tenants=_check_tenants(tenants),
            nats_port=nats_port,
            redis_port=redis_port,
            nats_host=nats_host,
            redis_host=redis_host,
            listen=listen,
            jetstream_dir=jetstream_dir,
            monitor=monitor,
        )
        material.directory.mkdir(parents=True, exist_ok=True)
        hosts = ["localhost", "127.0.0.1", nats_host, redis_host, *extra_hosts]
        ca, ca_key, cert, key = _certificates(hosts)
        _write(material.ca_path, ca)
        _write(material.ca_key_path, ca_key, 0o600)
        _write(material.server_cert_path, cert)
        _write(material.server_key_path, key, 0o600)
        names = [("service", r) for r in access.SERVICE_ROLES]
        names += [("tenant", t) for t in material.tenants]
        for kind, name in names:
            seed, public = _new_seed()
            identity = Identity(kind, name, public, material.directory / "identities" / kind / name)
            _write(identity.seed_path, seed + b"\n", 0o600)
            material.identities[(kind, name)] = identity
        for role in (*SERVICE_ROLES, access.OPERATOR):
            material.redis_passwords[role] = secrets.token_hex(32)
        material.write_configs()
        return material

    def write_configs(self) -> None:
        """(Re)write nats.conf, users.acl, every identity's env file and the manifest."""
        _write(self.nats_conf_path, self.nats_conf())
        _write(self.acl_path, redis_acl(self.namespace, self.redis_passwords), 0o600)
        for identity in self.identities.values():
            env = self.env_of(identity)
            lines = [f"{k}={_shell_quote(v)}" for k, v in env.items()]
            _write(identity.env_path, "\n".join(lines) + "\n", 0o600)
        manifest = {
            "namespace": self.namespace,
            "tenants": list(self.tenants),
            "nats": {"host": self.nats_host, "port": self.nats_port, "listen": self.listen},
            "redis": {"host": self.redis_host, "port": self.redis_port},
            "jetstream_dir": str(self.jetstream_dir) if self.jetstream_dir else "",
            "monitor": self.monitor,
            "max_payload": MAX_PAYLOAD,
            "identities": [
                {"kind": i.kind, "name": i.name, "public_key": i.public_key}
                for i in self.identities.values()
            ],
        }
        _write(self.directory / "manifest.json", json.dumps(manifest, indent=2) + "\n")

    def nats_conf(self) -> str:
        """The nats-server configuration."""
        store = self.jetstream_dir or self.directory / "jetstream"
        monitor = f"http: {json.dumps(self.monitor)}\n" if self.monitor else ""
        return (
            "# Generated by xpupool.devstack.secure: regenerate instead of editing.\n"
            f"listen: {json.dumps(f'{self.listen}:{self.nats_port}')}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            f"{monitor}"
            f"jetstream {{\n  store_dir: {json.dumps(str(store))}\n}}\n"
            "# With tls set the server refuses plaintext clients. verify: false: clients\n"
            "# authenticate with their NKey, not a certificate.\n"
            "tls {\n"
            f"  cert_file: {json.dumps(str(self.server_cert_path))}\n"
            f"  key_file: {json.dumps(str(self.server_key_path))}\n"
            f"  ca_file: {json.dumps(str(self.ca_path))}\n"
            "  verify: false\n"
            "  timeout: 5\n"
            "}\n"
            "authorization {\n"
            "  users = [\n"
            f"{nats_users(list(self.identities.values()))}\n"
            "  ]\n"
            "}\n"
        )

    @classmethod
    def load(cls, directory: Path) -> SecureMaterial:
        """Read material generated earlier (the manifest, public keys, Redis passwords)."""
        directory = directory.resolve()
        manifest = json.loads((directory / "manifest.json").read_text())
        material = cls(
            directory=directory,
            namespace=manifest["namespace"],
            tenants=tuple(manifest["tenants"]),
            nats_port=int(manifest["nats"]["port"]),
            redis_port=int(manifest["redis"]["port"]),
            nats_host=manifest["nats"]["host"],
            redis_host=manifest["redis"]["host"],
            listen=manifest["nats"]["listen"],
            jetstream_dir=Path(manifest["jetstream_dir"]) if manifest["jetstream_dir"] else None,
            monitor=manifest.get("monitor", ""),
        )
        for entry in manifest["identities"]:
            kind, name = entry["kind"], entry["name"]
            material.identities[(kind, name)] = Identity(
                kind, name, entry["public_key"], directory / "identities" / kind / name
            )
        for role in (*SERVICE_ROLES, access.OPERATOR):
            env = _read_env(material.identity("service", role).env_path)
            password = env["XPUPOOL_REDIS_URL"].split("://", 1)[1].split("@", 1)[0]
            material.redis_passwords[role] = password.split(":", 1)[1]
        return material

    # -- rotation

    def rotate_seed(self, kind: str, name: str) -> Identity:
        """A new NKey for one identity: its seed file and nats.conf are rewritten; reload the
        server (SIGHUP) for it to take effect."""
        old = self.identity(kind, name)
        seed, public = _new_seed()
        identity = Identity(kind, name, public, old.directory)
        _write(identity.seed_path, seed + b"\n", 0o600)
        self.identities[(kind, name)] = identity
        self.write_configs()
        return identity

    def rotate_redis_password(self, role: str) -> None:
        """A new Redis password for ``role``: users.acl and env files are rewritten; run
        ``ACL LOAD`` for it to take effect."""
        if role not in self.redis_passwords:
            raise KeyError(f"no Redis user {role!r}")
        self.redis_passwords[role] = secrets.token_hex(32)
        self.write_configs()

    def describe_tenant(self, tenant: str) -> str:
        """How a tenant's client connects, for humans (``xpupool dev up --secure``)."""
        identity = self.identity("tenant", tenant)
        p = identity.permissions
        env = "\n".join(
            f"  export {k}={_shell_quote(v)}" for k, v in self.tenant_env(tenant).items()
        )
        return (
            f"tenant {tenant}\n"
            f"  url       {self.nats_url}\n"
            f"  creds     {identity.seed_path}  (NKey seed: nats-py nkeys_seed=)\n"
            f"  ca        {self.ca_path}\n"
            f"  inbox     {identity.inbox_prefix}  (nats-py inbox_prefix=)\n"
            f"  publish   {', '.join(p.publish)}\n"
            f"  subscribe {', '.join(p.subscribe)}\n"
            f"{env}\n"
        )


def _shell_quote(value: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_./:@?=+-]*", value):
        return value
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        if value.startswith("'") and value.endswith("'"):
            value = value[1:-1].replace("'\"'\"'", "'")
        env[key] = value
    return env


# ---- command line ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xpupool.devstack.secure generate --out DIR --tenants a,b …``"""
    parser = argparse.ArgumentParser(prog="python -m xpupool.devstack.secure", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write a CA, certificates, identities and configs")
    gen.add_argument("--out", type=Path, required=True, help="the directory to write")
    gen.add_argument("--tenants", default="", help="comma-separated tenant names")
    gen.add_argument("--namespace", default="xpupool", help="the ledger namespace (Redis ACL)")
    gen.add_argument("--nats-host", default="127.0.0.1", help="the name clients reach NATS by")
    gen.add_argument("--nats-port", type=int, default=4222)
    gen.add_argument("--redis-host", default="127.0.0.1", help="the name clients reach Redis by")
    gen.add_argument("--redis-port", type=int, default=6379)
    gen.add_argument("--listen", default="127.0.0.1", help="the address nats-server binds")
    gen.add_argument("--host", action="append", default=[], help="another certificate name")
    gen.add_argument("--jetstream-dir", type=Path, help="nats-server's store directory")
    gen.add_argument("--monitor", default="", help="nats-server HTTP monitoring host:port")
    gen.add_argument(
        "--if-missing", action="store_true", help="keep material already in --out (no rotation)"
    )
    args = parser.parse_args(argv)
    if args.if_missing and (args.out / "manifest.json").exists():
        print(f"kept the material in {args.out}")
        return 0
    material = SecureMaterial.generate(
        args.out,
        [t for t in args.tenants.split(",") if t],
        args.namespace,
        args.nats_port,
        args.redis_port,
        nats_host=args.nats_host,
        redis_host=args.redis_host,
        listen=args.listen,
        extra_hosts=args.host,
        jetstream_dir=args.jetstream_dir,
        monitor=args.monitor,
    )
    print(f"wrote {material.directory}")
    for tenant in material.tenants:
        print(material.describe_tenant(tenant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
