"""Deployment artefacts parse and agree with the code (no Docker engine needed)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from xpupool.contracts import access
from xpupool.devstack import secure
from xpupool.scheduler.domain import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_compose_runs_every_service_module_against_the_brokers() -> None:
    """docker-compose.yml parses, starts each service's module, and points them at NATS/Redis."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    commands = {" ".join(s.get("command", [])) for s in services.values()}
    for module in ("xpupool.scheduler", "xpupool.lease_manager", "xpupool.telemetry_collector"):
        assert any(module in c for c in commands), module
    assert services["scheduler"]["environment"]["XPUPOOL_NATS_URL"] == "tls://nats:4222"
    assert "--appendonly" in services["redis"]["command"]


def _generate_as_compose_does(compose: dict[str, Any], out: Path) -> None:
    """Run the secrets service's generate command, writing to ``out`` instead of /secrets."""
    script = compose["services"]["secrets"]["command"][-1]
    words = shlex.split(script.split("&&")[0].replace("${XPUPOOL_TENANTS:-", "").replace("}", ""))
    assert words[:3] == ["python", "-m", "xpupool.devstack.secure"], words
    args = words[3:]
    args[args.index("--out") + 1] = str(out)
    assert secure.main(args) == 0


def test_compose_runs_the_secured_configuration(tmp_path: Path) -> None:
    """The generated material has every file compose points at; NATS and Redis run TLS-only
    with the generated config and ACL, and each service sources its own role's identity."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    _generate_as_compose_does(compose, tmp_path)
    referenced = set(re.findall(r"/secrets/[\w./-]+", yaml.safe_dump(compose)))
    assert referenced, "compose names no generated file"
    for path in referenced:
        assert (tmp_path / path.removeprefix("/secrets/")).exists(), path
    assert services["nats"]["command"] == ["-c", "/secrets/nats.conf"]
    conf = (tmp_path / "nats.conf").read_text()
    assert '"0.0.0.0:4222"' in conf and "tls {" in conf and "authorization {" in conf
    assert '"/data"' in conf and "nats-data:/data" in services["nats"]["volumes"]
    redis = services["redis"]["command"]
    for flag, value in (("--port", "0"), ("--tls-port", "6379"), ("--tls-auth-clients", "no")):
        assert redis[redis.index(flag) + 1] == value, flag
    assert redis[redis.index("--aclfile") + 1] == "/secrets/users.acl"
    roles = {
        "xpupool.scheduler": access.SCHEDULER,
        "xpupool.lease_manager": access.LEASE_MANAGER,
        "xpupool.telemetry_collector": access.TELEMETRY_COLLECTOR,
    }
    for name, service in services.items():
        command = " ".join(service.get("command", []))
        module = next((m for m in roles if f"python -m {m}" in command), None)
        if module is None:
            continue
        role = roles[module]
        assert f". /secrets/identities/service/{role}/env" in command, name
        env = dict(
            line.split("=", 1)
            for line in (tmp_path / f"identities/service/{role}/env").read_text().splitlines()
        )
        assert env["XPUPOOL_NATS_URL"] == service["environment"]["XPUPOOL_NATS_URL"], name
        assert env["XPUPOOL_REDIS_URL"].startswith(f"rediss://{role}:"), name
        assert env["XPUPOOL_REDIS_URL"].endswith("@redis:6379/0"), name
        assert "secrets:/secrets:ro" in service["volumes"], name


def test_example_queue_config_is_valid() -> None:
    """The queue file shipped in deploy/ loads with the scheduler's own validator."""
    config = load_config(ROOT / "deploy" / "queues.example.yaml")
    assert config.resolve_queue("alice", None) == "vision"
    assert config.priority_value("critical") == 1000


def test_the_image_build_context_leaves_out_local_state() -> None:
    """deploy/Dockerfile copies the whole repository root: .dockerignore keeps the local
    virtualenv, git history, caches and any generated identities out of the image."""
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "**/__pycache__", "secrets/", "**/identities/"} <= ignored
    assert "COPY . ." in (ROOT / "deploy" / "Dockerfile").read_text()
