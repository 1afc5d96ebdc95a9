"""Deployment artefacts parse and agree with the code (no Docker engine needed)."""

from __future__ import annotations

from pathlib import Path

import yaml

from xpupool.scheduler.domain import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_compose_runs_every_service_module_against_the_brokers() -> None:
    """docker-compose.yml parses, starts each service's module, and points them at NATS/Redis."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    commands = {" ".join(s.get("command", [])) for s in services.values()}
    for module in ("xpupool.scheduler", "xpupool.lease_manager", "xpupool.telemetry_collector"):
        assert any(module in c for c in commands), module
    assert services["scheduler"]["environment"]["XPUPOOL_NATS_URL"] == "nats://nats:4222"
    assert "--appendonly" in services["redis"]["command"]


def test_example_queue_config_is_valid() -> None:
    """The queue file shipped in deploy/ loads with the scheduler's own validator."""
    config = load_config(ROOT / "deploy" / "queues.example.yaml")
    assert config.resolve_queue("alice", None) == "vision"
    assert config.priority_value("critical") == 1000
